"""The distributed example's dist_sync run (scheduler, server and 2 workers on loopback, as MXNet's
own tests launch them): a fused model trains with MXNet's kvstore exactly as the unfused one.  Where
Horovod is installed (not in CI: its build takes ~12 minutes; tests/test_load_order.py stands in for
it), the op library next to ``horovod.mxnet`` in either import order, and the example under
``horovodrun --gloo -np 2``."""
import os
import re
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "distributed_training.py")


def test_dist_sync_fused_and_unfused_losses_agree():
    p = subprocess.run([sys.executable, EXAMPLE, "--steps", "3", "--warmup", "1"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    worst = float(re.search(r"fused vs unfused: (\S+)", p.stdout).group(1))
    assert worst <= 1e-6, p.stdout
    assert re.search(r"dist_sync \(gluon\), 2 workers, .* unfused [\d.]+ steps/s, fused [\d.]+ steps/s", p.stdout), p.stdout
    rows = [ln for ln in p.stdout.splitlines() if re.match(r"\s+\d+\s", ln)]
    assert len(rows) == 3                                 # every step of both workers side by side


def _horovodrun():
    import importlib.util
    import shutil
    if importlib.util.find_spec("horovod") is None:
        return None
    return shutil.which("horovodrun") or shutil.which(os.path.join(os.path.dirname(sys.executable), "horovodrun"))


@pytest.mark.skipif(_horovodrun() is None, reason="Horovod is not installed (built with HOROVOD_WITH_MXNET=1)")
@pytest.mark.parametrize("first", ["horovod", "fusion"])
def test_fusion_next_to_horovod_in_either_order(first):
    order = ["import horovod.mxnet", "import fusion"]
    code = "\n".join(order if first == "horovod" else order[::-1]) + """
from mxnet import autograd, gluon, nd
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(16, flatten=False, activation="relu"), gluon.nn.Dense(4, flatten=False))
net.initialize()
x = nd.random.uniform(shape=(2, 5, 8))
net.optimize_for(x, backend="fusion", mode="training")
with autograd.record():
    y = net(x)
y.backward()
print("ok")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(EXAMPLE)))
    assert p.returncode == 0 and "ok" in p.stdout, (p.returncode, p.stderr[-3000:])


@pytest.mark.skipif(_horovodrun() is None, reason="Horovod is not installed (built with HOROVOD_WITH_MXNET=1)")
def test_horovod_fused_and_unfused_losses_agree():
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    p = subprocess.run([_horovodrun(), "--gloo", "-np", "2", "-H", "localhost:2", "--network-interface", "lo",
                        sys.executable, EXAMPLE, "--horovod", "--steps", "3", "--warmup", "1"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    worst = float(re.search(r"fused vs unfused: (\S+)", p.stdout).group(1))
    assert worst <= 1e-6, p.stdout
