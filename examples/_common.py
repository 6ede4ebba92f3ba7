"""Shared bits of the examples: thread settings before mxnet, the bundled model, timing."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from fusion.native import env as _env  # noqa: E402

_env.configure_threads()

MODEL = os.path.join(ROOT, "examples", "models", "mobilenetv2_0.25")
QUICK = "--quick" in sys.argv          # the tests run every example this way: fewer timed rounds


def repeats(n=30):
    return 3 if QUICK else n


def speedups(times):
    """'fused 6.4 ms, original 8.3 ms (1.30x)' from time_interleaved() medians."""
    fused = times["fused"]
    parts = ["fused %.2f ms" % (1e3 * fused)]
    for name, t in times.items():
        if name != "fused":
            parts.append("%s %.2f ms (%.2fx)" % (name, 1e3 * t, t / fused))
    return ", ".join(parts)
