"""Thread settings MXNet 1.9.1 needs to run at full speed on CPU.

Unset, MXNet uses half the cores, and any large ``asnumpy()``/``nd.array()``
on the Python thread starts a second OpenMP team after which MXNet's workers
sleep between operators (measured 1.3–4× slower).  Both variables are read
once, when mxnet is imported, so they are set (only where the user has not
set them) before that import.
"""
from __future__ import annotations

import os
import sys


def configure_threads() -> bool:
    """Set OMP_NUM_THREADS and MXNET_CPU_PARALLEL_SIZE if unset; False if mxnet was already imported."""
    if "mxnet" in sys.modules:
        return False
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                                 else os.cpu_count() or 1))
    os.environ.setdefault("MXNET_CPU_PARALLEL_SIZE", "2000000000")
    os.environ.setdefault("MXNET_SUBGRAPH_VERBOSE", "0")
    return True
