"""Latency measurement of bound models: interleaved runs, medians.

Machines are shared and noisy, so every system is timed in the same process,
round-robin (one forward of each per round), and the median per system is
reported.  ``MXNET_SUBGRAPH_BACKEND`` is read by MXNet at bind time, so an
executor bound with ``subgraph=False`` runs without the oneDNN fusion
backend while others in the same process keep it.
"""
from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Mapping

from .verify import bind


@contextmanager
def _quiet_native_stderr():
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
    quiet = _quiet_native_stderr() if not enabled else None
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


def executor(symbol: Any, arg: Mapping[str, Any], aux: Mapping[str, Any], inputs: Mapping[str, Any],
             subgraph: bool = True) -> Callable[[], None]:
    """A zero-argument function running one inference forward of the bound model to completion."""
    with subgraph_backend(subgraph):
        exe = bind(symbol, arg, aux, inputs)

    def step() -> None:
        for out in exe.forward(is_train=False):
            out.wait_to_read()

    return step


def time_interleaved(systems: Mapping[str, Callable[[], None]], repeats: int = 30, warmup: int = 3) -> Dict[str, float]:
    """Median seconds per call of each system, timed round-robin."""
    for _ in range(warmup):
        for step in systems.values():
            step()
    samples: Dict[str, list] = {name: [] for name in systems}
    for _ in range(repeats):
        for name, step in systems.items():
            t = time.perf_counter()
            step()
            samples[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in samples.items()}


def fused_vs_original(symbol: Any, arg: Mapping[str, Any], aux: Mapping[str, Any], result: Any,
                      inputs: Mapping[str, Any], repeats: int = 30) -> Dict[str, float]:
    """Median seconds of the original and the fused model, each with MXNet's default bind and
    with its subgraph backend off: keys original, fused, original_no_subgraph, fused_no_subgraph."""
    fused_inputs = {k: v for k, v in inputs.items() if k in set(result.symbol.list_arguments())}
    return time_interleaved({
        "original": executor(symbol, arg, aux, inputs),
        "fused": executor(result.symbol, result.arg_params, result.aux_params, fused_inputs),
        "original_no_subgraph": executor(symbol, arg, aux, inputs, subgraph=False),
        "fused_no_subgraph": executor(result.symbol, result.arg_params, result.aux_params, fused_inputs,
                                      subgraph=False),
    }, repeats=repeats)
