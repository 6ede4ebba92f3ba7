"""Thread settings MXNet 1.9.1 needs to run at full speed on CPU, and binding with its subgraph backend off.

Unset, MXNet uses half the cores, and any large ``asnumpy()``/``nd.array()``
on the Python thread starts a second OpenMP team after which MXNet's workers
sleep between operators (measured 1.3–4× slower).  Both variables are read
once, when mxnet is imported, so they are set (only where the user has not
set them) before that import.

``MXNET_SUBGRAPH_BACKEND`` is read by MXNet at bind time, so an executor bound inside
``subgraph_backend(False)`` runs without the oneDNN fusion backend while others in the same
process keep it (its bugs: judge numbers with it off).
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager


def configure_threads() -> bool:
    """Set OMP_NUM_THREADS and MXNET_CPU_PARALLEL_SIZE if unset; False if mxnet was already imported."""
    if "mxnet" in sys.modules:
        return False
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                                 else os.cpu_count() or 1))
    os.environ.setdefault("MXNET_CPU_PARALLEL_SIZE", "2000000000")
    os.environ.setdefault("MXNET_SUBGRAPH_VERBOSE", "0")
    return True


def configure_memory() -> bool:
    """Set MXNET_CPU_TEMP_COPY to 1 if unset; False if mxnet was already imported.

    MXNet keeps MXNET_CPU_TEMP_COPY (default 4) temporary-space buffers on the CPU, gives each new
    executor's ops the next of them in turn, grows each to the largest workspace an op asks of it
    (oneDNN's convolutions: a reordered copy of their input) and never gives it back: binding one
    executor after another — the self-check, ``--verify``, ``--benchmark`` — kept up to four times
    the largest workspace (measured: Faster R-CNN's 300-RoI convolutions, 230 MiB each time, four
    times; Mask R-CNN's, about 1 GiB each).  With one copy, once.  Ops share it only where MXNet
    runs several at once (``MXNET_CPU_WORKER_NTHREADS`` above its default of 1)."""
    if "mxnet" in sys.modules:
        return False
    os.environ.setdefault("MXNET_CPU_TEMP_COPY", "1")
    return True


@contextmanager
def quiet_native_stderr():
    """Silence what MXNet's C++ side prints to fd 2 (its INFO line on every bind with the backend off)."""
    import sys

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextmanager
def subgraph_backend(enabled: bool):
    """Bind inside this block with MXNet's default subgraph backend on (enabled) or off."""
    key = "MXNET_SUBGRAPH_BACKEND"
    old = os.environ.get(key)
    if enabled:
        os.environ.pop(key, None)
    else:
        os.environ[key] = "NONE"
    quiet = quiet_native_stderr() if not enabled else None
    if quiet is not None:
        quiet.__enter__()
    try:
        yield
    finally:
        if quiet is not None:
            quiet.__exit__(None, None, None)
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
