"""Session fixture for the kernel tests: build the fused-op library if it is missing or
stale, then load it.  Imported by each test module (not a conftest.py, so that
`from conftest import ...` in tests/ keeps meaning tests/conftest.py)."""
import importlib.util
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("MXNET_CPU_PARALLEL_SIZE", "2000000000")

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def native_module():
    try:
        from fusion.native import library as _native
        return _native
    except ImportError:  # the package itself failed to import; the builder stands alone
        spec = importlib.util.spec_from_file_location(
            "fusion_native_standalone", os.path.join(_REPO, "fusion", "native", "library.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


@pytest.fixture(scope="session", autouse=True)
def fused_ops():
    native = native_module()
    native.build(cuda=False)
    native.load()
    return native


def grads(fn, arrays, head_grad):
    """Gradients of ``fn(*arrays)`` for the output gradient ``head_grad``, by MXNet autograd."""
    import mxnet as mx

    xs = [mx.nd.array(a) for a in arrays]
    for x in xs:
        x.attach_grad()
    with mx.autograd.record():
        y = fn(*xs)
    y.backward(mx.nd.array(head_grad))
    return [x.grad.asnumpy() for x in xs]


def run_python(code, *args, **env):
    """Runs ``code`` in a fresh Python (``args`` as sys.argv[1:], ``env`` added to the
    environment: the library reads its switches when it loads) with this folder on
    sys.path, so it can import the references.  Asserts a zero exit; returns stdout and
    stderr together."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, %r)\n%s" % (here, code)]
                       + [str(a) for a in args], env=dict(os.environ, **env), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout + r.stderr
