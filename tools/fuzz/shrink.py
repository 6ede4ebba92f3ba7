"""Delta debugging over a case's choice sequence: the smallest graph that still fails the same way.

The generator draws every decision through :class:`~tools.fuzz.draw.Draw`, index 0
being the simplest (an optional step absent, the first size).  The shrinker edits
the recorded sequence — zeroing runs of 8, 4, 2 and 1 decisions, then lowering single
ones — regenerates the case, and keeps an edit when the same check (e.g.
``inference.values``) still fails on it.  Edits that make MXNet refuse the original
graph, or the generator give up, are simply not kept.  It stops at a fixpoint or when
its budget (attempts, seconds) is spent.
"""
from __future__ import annotations

import copy
import os
import time
from typing import Callable, List, Optional, Tuple

import numpy as np

from .case import Case, Invalid
from .generator import generate
from .oracle import Finding, Oracle, signature


Predicate = Callable[[Case], Optional[Finding]]


def same_failure(finding: Finding) -> Predicate:
    """Whether a case fails the check of ``finding`` in the same class (run here, by the oracle)."""
    sig = signature(finding.check, finding.detail)

    def fails(case: Case) -> Optional[Finding]:
        out = Oracle(case, only=[finding.group]).run()
        if not out.valid:
            return None
        return next((f for f in out.findings if f.check == finding.check and signature(f.check, f.detail) == sig),
                    None)
    return fails


_CRASH_PROBE = r"""
import os, pickle, sys
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("MXNET_CPU_PARALLEL_SIZE", "2000000000")
sys.path.insert(0, sys.argv[1])
import fusion
from tools.fuzz.oracle import Oracle
case = pickle.load(open(sys.argv[2], "rb"))
out = Oracle(case, only=[sys.argv[3]], stage=lambda s: print("STAGE", s, flush=True)).run()
print("VALID", out.valid, flush=True)
"""


def same_crash(finding: Finding, timeout: float = 120.0) -> Predicate:
    """Whether a case still kills the process in the same stage (each try in a fresh subprocess)."""
    import pickle
    import re
    import subprocess
    import sys
    import tempfile

    from .runner import ROOT, STAGE_CHECK

    stage = re.search(r"stage '([^']*)'", finding.detail)
    want = stage.group(1) if stage else None
    group = STAGE_CHECK.get(want, finding.group)

    def fails(case: Case) -> Optional[Finding]:
        with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
            pickle.dump(case, f)
            path = f.name
        try:
            r = subprocess.run([sys.executable, "-c", _CRASH_PROBE, ROOT, path, group], capture_output=True,
                               text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            os.unlink(path)
        stages = re.findall(r"^STAGE (\S+)", r.stdout, re.M)
        died = r.returncode < 0 or r.returncode in (134, 136, 139)
        if died and stages and stages[-1] == want:
            return Finding(finding.check, "worker died (exit code %d) in stage '%s'" % (r.returncode, want))
        return None
    return fails


def _fails(seed: int, family: str, choices: List[int], pred: Predicate) -> Optional[Tuple[Case, Finding]]:
    try:
        case = generate(seed, family, replay=choices)
    except Invalid:
        return None
    except Exception:         # a clamped replay the generator cannot build: not a candidate
        return None
    f = pred(case)
    return (case, f) if f is not None else None


def shrink(case: Case, finding: Finding, max_attempts: int = 200, max_seconds: float = 90.0,
           progress: Callable[[str], None] = lambda s: None, pred: Optional[Predicate] = None
           ) -> Tuple[Case, Finding, int]:
    """(smallest failing case, its finding, attempts made).  ``pred``: what failing means
    (default: the same check fails in the same class)."""
    t0 = time.perf_counter()
    best, best_f = case, finding
    pred = pred or same_failure(finding)
    choices = list(case.choices)
    attempts = 0

    def budget() -> bool:
        return attempts < max_attempts and time.perf_counter() - t0 < max_seconds

    def smaller(c: Case) -> bool:
        return (c.op_count(), sum(c.choices)) < (best.op_count(), sum(best.choices))

    improved = True
    while improved and budget():
        improved = False
        for k in (8, 4, 2, 1):
            i = 0
            while i < len(choices) and budget():
                if any(choices[i:i + k]):
                    cand = choices[:i] + [0] * len(choices[i:i + k]) + choices[i + k:]
                    attempts += 1
                    r = _fails(case.seed, case.family, cand, pred)
                    if r is not None and smaller(r[0]):
                        best, best_f = r
                        choices = list(best.choices)
                        improved = True
                        progress("%d ops" % best.op_count())
                        continue
                i += k
        for i in range(len(choices)):
            if not budget() or i >= len(choices):
                break
            if choices[i] > 1:
                for v in (1, choices[i] // 2, choices[i] - 1):
                    cand = choices[:i] + [v] + choices[i + 1:]
                    attempts += 1
                    r = _fails(case.seed, case.family, cand, pred)
                    if r is not None and smaller(r[0]):
                        best, best_f = r
                        choices = list(best.choices)
                        improved = True
                        break
                    if not budget():
                        break
    if budget():
        best, best_f, more = graph_shrink(best, best_f, max_attempts - attempts, t0 + max_seconds, pred)
        attempts += more
    return best, best_f, attempts


# ---------------------------------------------------------------------------- shrinking the graph itself
def _with_graph(case: Case, data: dict) -> Optional[Case]:
    """``case`` with its graph replaced by the JSON ``data`` (unused inputs and parameters dropped)."""
    import contextlib
    import io
    import json

    import mxnet as mx

    text = json.dumps(data)
    try:
        sym = mx.sym.load_json(text)
        args, auxs = set(sym.list_arguments()), set(sym.list_auxiliary_states())
    except Exception:
        return None
    new = copy.copy(case)
    new.specs = [s for s in case.specs if s.name in args]
    new.arg = {k: v for k, v in case.arg.items() if k in args}
    new.aux = {k: v for k, v in case.aux.items() if k in auxs}
    known = {s.name for s in new.specs} | set(new.arg) | set(new.aux)
    if not args <= known | auxs or not auxs <= known:
        return None
    new.symbol = sym
    if case.json_text is not None:
        new.json_text = json.dumps(data)
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            new.symbol.infer_shape(**new.shapes(), **{k: v.shape for k, v in new.arg.items()})
        except Exception:
            return None
    return new


def _graph_data(case: Case) -> dict:
    import json

    return json.loads(case.json_text if case.json_text is not None else case.symbol.tojson())


def _cut_spec(case: Case, data: dict, i: int):
    """A data input standing for node ``i``'s output (its shape as a template over the case's dims), or None."""
    import contextlib
    import io

    from .case import InputSpec

    node = data["nodes"][i]
    internals = case.symbol.get_internals()
    names = internals.list_outputs()
    key = node["name"] + "_output"
    if key not in names:
        return None
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            _, s1, _ = internals.infer_shape(**case.shapes(), **{k: v.shape for k, v in case.arg.items()})
            _, s2, _ = internals.infer_shape(**case.shapes(second=True), **{k: v.shape for k, v in case.arg.items()})
            _, t1, _ = internals.infer_type(**{s.name: s.dtype for s in case.specs},
                                             **{k: str(v.dtype) for k, v in case.arg.items()})
    except Exception:
        return None
    j = names.index(key)
    if s1 is None or s2 is None or t1 is None or t1[j] is None or np.dtype(t1[j]) != np.float32:
        return None
    tmpl = []
    for a, b in zip(s1[j], s2[j]):
        if a == b:
            tmpl.append(int(a))
        else:
            dim = next((n for n in case.dims if case.dims[n] == a and case.dims2.get(n) == b), None)
            if dim is None:
                return None
            tmpl.append(dim)
    return InputSpec("cut_" + node["name"], tuple(tmpl))


def graph_shrink(case: Case, finding: Finding, attempts_left: int, deadline: float,
                 pred: Optional[Predicate] = None) -> Tuple[Case, Finding, int]:
    """Drop outputs, bypass ops (an input of the same shape takes their place) and cut the graph at
    interior values (a data input takes their place) while the same check still fails."""
    import contextlib
    import io

    best, best_f, attempts = case, finding, 0
    pred = pred or same_failure(finding)

    def still(cand: Optional[Case]):
        nonlocal attempts
        if cand is None:
            return None
        attempts += 1
        return pred(cand)

    improved = True
    while improved and attempts < attempts_left and time.perf_counter() < deadline:
        improved = False
        data = _graph_data(best)
        # 1. fewer outputs
        if len(data["heads"]) > 1:
            for h in range(len(data["heads"])):
                d2 = dict(data, heads=data["heads"][:h] + data["heads"][h + 1:])
                cand = _with_graph(best, d2)
                f = still(cand)
                if f:
                    best, best_f, improved = cand, f, True
                    break
            if improved:
                continue
        nodes = data["nodes"]
        sym = best.symbol
        try:
            internals = sym.get_internals()
            with contextlib.redirect_stdout(io.StringIO()):
                _, shp, _ = internals.infer_shape(**best.shapes(), **{k: v.shape for k, v in best.arg.items()})
            shape_of = dict(zip(internals.list_outputs(), shp or []))
        except Exception:
            shape_of = {}
        # 2. bypass an op by one of its inputs of the same shape (from the outputs backwards)
        for i in range(len(nodes) - 1, -1, -1):
            if attempts >= attempts_left or time.perf_counter() > deadline:
                break
            n = nodes[i]
            if n["op"] == "null" or n["name"] + "_output" not in shape_of:
                continue
            for e in n["inputs"]:
                src = nodes[e[0]]
                src_key = src["name"] + "_output" if e[1] == 0 else "%s_output%d" % (src["name"], e[1])
                if shape_of.get(src_key) != shape_of[n["name"] + "_output"]:
                    continue
                d2 = _replace_uses(data, i, e)
                f = still(_with_graph(best, d2))
                if f:
                    best, best_f, improved = _with_graph(best, d2), f, True
                    break
            if improved:
                break
        if improved:
            continue
        # 3. cut: an interior value becomes a data input (from the inputs forwards)
        for i in range(len(nodes)):
            if attempts >= attempts_left or time.perf_counter() > deadline:
                break
            n = nodes[i]
            if n["op"] == "null" or not any(e[0] == i for m in nodes for e in m.get("inputs", [])):
                continue
            spec = _cut_spec(best, data, i)
            if spec is None:
                continue
            d2 = json_copy(data)
            d2["nodes"][i] = {"op": "null", "name": spec.name, "inputs": []}
            base = copy.copy(best)
            base.specs = list(best.specs) + [spec]
            cand = _with_graph(base, d2)
            f = still(cand)
            if f and cand.op_count() < best.op_count():
                best, best_f, improved = cand, f, True
                break
    return best, best_f, attempts


def json_copy(data: dict) -> dict:
    import json

    return json.loads(json.dumps(data))


def _replace_uses(data: dict, i: int, e: list) -> dict:
    """Every use of node ``i``'s output 0 read from entry ``e`` instead."""
    d2 = json_copy(data)
    for n in d2["nodes"]:
        n["inputs"] = [list(e) if (x[0] == i and x[1] == 0) else x for x in n.get("inputs", [])]
    d2["heads"] = [list(e) if (x[0] == i and x[1] == 0) else x for x in d2["heads"]]
    return d2
