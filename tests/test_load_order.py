"""The op library (and a user library built as the docs show) next to a libmxnet.so loaded RTLD_GLOBAL.

Horovod's MXNet library needs libmxnet.so and is loaded RTLD_GLOBAL, which puts libmxnet.so's
exported ``mxnet::ext::`` symbols (its own lib_api.cc) in the global scope.  A library of ops that
exported its copy of lib_api.cc bound its own calls to those instead (a floating-point exception
while its ops registered, ``free(): invalid pointer`` at the first call).  Each case runs in a
process of its own: a crash must fail the test, not the test run.
"""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GLOBAL_LIBMXNET = """
import ctypes, os, sys
sys.path.insert(0, {root!r})
os.environ.setdefault("OMP_NUM_THREADS", "2")
import mxnet as mx
ctypes.CDLL(mx.libinfo.find_lib_path()[0], mode=ctypes.RTLD_GLOBAL)   # as Horovod's library brings it in
"""

FUSED_TRAINING_STEP = GLOBAL_LIBMXNET + """
from mxnet import autograd, gluon, nd
import fusion
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(16, flatten=False, activation="relu"), gluon.nn.Dense(4, flatten=False))
net.initialize()
x = nd.random.uniform(shape=(2, 5, 8))
ref = net(x)
net.optimize_for(x, backend="fusion", mode="training")
assert "fused_dense" in net._cached_graph[1].tojson()
with autograd.record():
    y = net(x)
y.backward()
print("max|diff|", float((y - ref).abs().max().asscalar()))
"""

USER_LIBRARY = GLOBAL_LIBMXNET + """
sys.path.insert(0, os.path.join({root!r}, "examples", "custom_library_op"))
import rules                      # builds libmy_relu6.so as the example shows, loads it
x = mx.nd.array([[-1.0, 3.0, 9.0]])
print(mx.nd.my_relu6(x).asnumpy().tolist())
"""


def _run(code):
    p = subprocess.run([sys.executable, "-c", code.format(root=ROOT)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert p.returncode == 0, "exit %d\n%s\n%s" % (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    return p.stdout


def test_fused_training_beside_global_libmxnet():
    out = _run(FUSED_TRAINING_STEP)
    assert float(out.split()[-1]) < 1e-5


def test_user_library_beside_global_libmxnet():
    assert "[[0.0, 3.0, 6.0]]" in _run(USER_LIBRARY)


@pytest.mark.skipif(shutil.which("nm") is None, reason="binutils' nm is not installed")
def test_op_library_exports_only_entry_points():
    from fusion.native import library as _native

    out = subprocess.run(["nm", "-D", "--defined-only", _native.load()], capture_output=True, text=True,
                         check=True).stdout
    names = [ln.split()[-1] for ln in out.splitlines() if ln.strip()]
    assert "_opRegGet" in names and "initialize" in names and "mxf_capabilities" in names
    leaked = [n for n in names if not n.startswith(("_op", "_part", "_pass", "_msg", "initialize", "mxf"))]
    assert not leaked, leaked[:10]
