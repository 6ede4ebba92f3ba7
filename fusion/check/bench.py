"""Latency measurement of bound models: interleaved runs, medians with their spread.

Machines are shared and noisy, so every system is timed in the same process,
round-robin (one forward of each per round), and the median per system is
reported with the 10th and 90th percentiles of its rounds.  Speed-ups are
given like for like — fused vs original both with MXNet's oneDNN subgraph
backend on (its default bind), and both with it off — and a fused model that
is slower than the original gets a warning where the p10–p90 spreads do not
overlap (a slower median within them is reported as noise, not warned about).
``MXNET_SUBGRAPH_BACKEND`` is read by MXNet at bind time, so an
executor bound with ``subgraph=False`` runs without the oneDNN fusion
backend while others in the same process keep it.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Mapping

import numpy as np

from ..native.env import subgraph_backend
from .verify import bind


def executor(symbol: Any, arg: Mapping[str, Any], aux: Mapping[str, Any], inputs: Mapping[str, Any],
             subgraph: bool = True) -> Callable[[], None]:
    """A zero-argument function running one inference forward of the bound model to completion."""
    with subgraph_backend(subgraph):
        exe = bind(symbol, arg, aux, inputs)

    def step() -> None:
        for out in exe.forward(is_train=False):
            out.wait_to_read()

    return step


def time_samples(systems: Mapping[str, Callable[[], None]], repeats: int = 30,
                 warmup: int = 3) -> Dict[str, List[float]]:
    """Seconds of every timed call of each system, timed round-robin."""
    for _ in range(warmup):
        for step in systems.values():
            step()
    samples: Dict[str, List[float]] = {name: [] for name in systems}
    for _ in range(repeats):
        for name, step in systems.items():
            t = time.perf_counter()
            step()
            samples[name].append(time.perf_counter() - t)
    return samples


def time_interleaved(systems: Mapping[str, Callable[[], None]], repeats: int = 30, warmup: int = 3) -> Dict[str, float]:
    """Median seconds per call of each system, timed round-robin."""
    return {name: statistics.median(v) for name, v in time_samples(systems, repeats, warmup).items()}


def _systems(symbol: Any, arg: Mapping[str, Any], aux: Mapping[str, Any], result: Any,
             inputs: Mapping[str, Any]) -> Dict[str, Callable[[], None]]:
    fused_inputs = {k: v for k, v in inputs.items() if k in set(result.symbol.list_arguments())}
    return {
        "original": executor(symbol, arg, aux, inputs),
        "fused": executor(result.symbol, result.arg_params, result.aux_params, fused_inputs),
        "original_no_subgraph": executor(symbol, arg, aux, inputs, subgraph=False),
        "fused_no_subgraph": executor(result.symbol, result.arg_params, result.aux_params, fused_inputs,
                                      subgraph=False),
    }


def fused_vs_original(symbol: Any, arg: Mapping[str, Any], aux: Mapping[str, Any], result: Any,
                      inputs: Mapping[str, Any], repeats: int = 30) -> Dict[str, float]:
    """Median seconds of the original and the fused model, each with MXNet's default bind and
    with its subgraph backend off: keys original, fused, original_no_subgraph, fused_no_subgraph."""
    return time_interleaved(_systems(symbol, arg, aux, result, inputs), repeats=repeats)


#: (label, original, fused): the like-for-like comparisons, both sides bound the same way
LIKE_FOR_LIKE = (("subgraph backend on (MXNet's default bind)", "original", "fused"),
                 ("subgraph backend off", "original_no_subgraph", "fused_no_subgraph"))


def figures(samples: Mapping[str, List[float]]) -> Dict[str, Any]:
    """The benchmark as a report records it: per system median, p10 and p90 (ms), the speed-ups,
    and a warning when the fused model is slower than the original bound the same way."""
    ms = {k: np.asarray(v, dtype=float) * 1e3 for k, v in samples.items()}
    med = {k: float(np.median(v)) for k, v in ms.items()}
    p10 = {k: float(np.percentile(v, 10)) for k, v in ms.items()}
    p90 = {k: float(np.percentile(v, 90)) for k, v in ms.items()}
    out: Dict[str, Any] = {
        "rounds": min(len(v) for v in ms.values()) if ms else 0,
        "median_ms": {k: round(v, 3) for k, v in med.items()},
        "p10_ms": {k: round(v, 3) for k, v in p10.items()},
        "p90_ms": {k: round(v, 3) for k, v in p90.items()},
        "speedup_vs_mxnet_default": round(med["original"] / med["fused"], 3),
        "speedup_vs_subgraph_off": round(med["original_no_subgraph"] / med["fused"], 3),
        "speedup_both_subgraph_off": round(med["original_no_subgraph"] / med["fused_no_subgraph"], 3),
    }
    slower, noise = [], []
    for label, orig, fused in LIKE_FOR_LIKE:
        if med[fused] > med[orig]:
            # a warning only where the spreads part: a slower median inside the original's own
            # p10-p90 range is what reruns of one model give (3943.8 vs 3939.1 ms)
            overlap = p10[fused] <= p90[orig]
            line = "with the %s the fused model's median is %.3f ms vs %.3f ms (%.2fx)" % (
                label, med[fused], med[orig], med[orig] / med[fused])
            if overlap:
                noise.append(line + ", within the p10-p90 spreads (noise; rerun with more --repeats to tell)")
            else:
                slower.append(line.replace("model's median is", "model is slower:", 1)
                              + "; the p10-p90 ranges do not overlap: keep the original for this input shape")
    out["warnings"] = slower
    out["within_noise"] = noise
    return out


#: the systems timed, as (model, subgraph backend on): the pairs timed together come first
SYSTEMS = (("original", "original", True), ("fused", "fused", True),
           ("original_no_subgraph", "original", False), ("fused_no_subgraph", "fused", False))


def benchmark_plan(symbol: Any, arg: Mapping[str, Any], aux: Mapping[str, Any], result: Any,
                   input_shapes: Mapping[str, Any], budget: Any) -> List[List[str]]:
    """The systems timed together, group by group, within the memory budget (fusion/engine/memory.py),
    decided from the inferred shapes before anything is bound: the two models' pair with MXNet's
    oneDNN backend on, then the pair with it off (each pair timed round-robin: what is compared like
    for like is interleaved; two executors alive, not four -- a segmentation model's four took 3.7×
    the memory of its plain inference); else one executor at a time (a note says the timings are
    not interleaved).
    ``OverBudget`` where one executor alone would not fit.  ``result`` may be None (planned before
    fusing: the fused model taken as the original's size)."""
    from ..engine.memory import model_memory

    est0 = model_memory(symbol, arg, aux, input_shapes)
    est1 = model_memory(result.symbol, result.arg_params, result.aux_params,
                        {k: v for k, v in input_shapes.items() if k in result.symbol.list_arguments()}) \
        if result is not None else None
    names = [name for name, _, _ in SYSTEMS]
    pairs = [["original", "fused"], ["original_no_subgraph", "fused_no_subgraph"]]
    if est0 is None:
        return pairs
    # a fused op's own buffers (a region's arena of the values inside it) are not values of the fused
    # graph: it is taken as the original's size, whose values those are, and its edge copies
    need = {name: max(est0.run(on) + est1.own_buffers, est1.run(on)) if est1 is not None and model == "fused"
            else est0.run(on) for name, model, on in SYSTEMS}
    inputs = est0.inputs
    budget.estimates["benchmark"] = {"one_pair": max(need["original"] + need["fused"],
                                                     need["original_no_subgraph"] + need["fused_no_subgraph"]) + inputs,
                                     "one": max(need.values()) + inputs}
    if all(budget.allows(sum(need[n] for n in pair) + inputs) for pair in pairs):
        return pairs
    worst = max(need.values()) + inputs
    if not budget.allows(worst):
        shapes = ", ".join("%s=%s" % (k, ",".join(map(str, v))) for k, v in input_shapes.items())
        raise budget.refuse("benchmark", worst, "one bound executor of the model at %s" % shapes)
    budget.note("benchmark: one executor at a time (the timings of the four are not interleaved), to stay "
                "within the memory budget")
    return [[n] for n in names]


def benchmark(symbol: Any, arg: Mapping[str, Any], aux: Mapping[str, Any], result: Any,
              inputs: Mapping[str, Any], repeats: int = 30, warmup: int = 3, max_memory: Any = None) -> Dict[str, Any]:
    """:func:`figures` of the original and the fused model, each bound with the subgraph backend on and off,
    within the memory budget ``max_memory`` (see ``benchmark_plan``; default 60 % of the memory available)."""
    from ..engine.memory import budget as make_budget, collections_of_new_objects, release

    budget = make_budget(max_memory)
    groups = benchmark_plan(symbol, arg, aux, result, {k: tuple(v.shape) for k, v in inputs.items()}, budget)
    fused_inputs = {k: v for k, v in inputs.items() if k in set(result.symbol.list_arguments())}
    models = {"original": (symbol, arg, aux, inputs),
              "fused": (result.symbol, result.arg_params, result.aux_params, fused_inputs)}
    samples: Dict[str, List[float]] = {}
    with collections_of_new_objects():
        for group in groups:
            systems = {name: executor(*models[model], subgraph=on) for name, model, on in SYSTEMS if name in group}
            samples.update(time_samples(systems, repeats, warmup))
            del systems
            release()
    return figures({name: samples[name] for name, _, _ in SYSTEMS})
