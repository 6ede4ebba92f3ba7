"""The distributed example's dist_sync run (scheduler, server and 2 workers on loopback, as MXNet's
own tests launch them): a fused model trains with MXNet's kvstore exactly as the unfused one."""
import os
import re
import subprocess
import sys

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
