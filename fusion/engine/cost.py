"""Whether a rewrite should be made on this device: measured costs, not hope.

A capability says an op *can* run; a cost table says whether replacing the stock ops *pays*.
Tables are measured per device kind by a prepared command (``tools/measure_cpu_costs.py`` on
a CPU; the GPU's own command later) and kept in ``fusion/engine/cost_tables/`` as JSON::

    {"device": "<CPU model name (lscpu) or GPU name>", "kind": "cpu" | "gpu",
     "cpu_flags": ["avx2", ...],            # the flags that matter (FLAGS), CPU tables only
     "date": "YYYY-MM-DD", "command": "<the command that measured it>",
     "entries": [{"op": "<fused op or rewrite name>", "dtype": "float32", "pass": "forward",
                  "case": {<the features the decision depends on>},
                  "fused_ms": float, "unfused_ms": float, "reference": "MXNet default bind"}]}

``decide(op, dtype, pass_, case, kind=, device=)`` answers ``Decision(fuse, reason)``.  The
table is the one measured on this device: for a CPU the same model name and the same FLAGS
present (``MXFUSION_COST_TABLES`` names more folders to look in, first).  Entries of the same
op, dtype and pass whose categorical features (strings, booleans) equal the case's are
candidates; the one nearest in its numeric features (sizes, compared on a log scale) decides:
fuse when its fused time beats the unfused time by ``WIN_MARGIN``.  Ties and losses are
declined — a rewrite is made where it measurably wins.

Without a table for this device, or without an entry of the case's kind in it, the
conservative rule decides (``fallback``):

* CPU: decline where the case says the replacement puts a library op where MXNet's oneDNN
  ops keep their blocked layout (``"adds_reorders": true``: MXNet reorders every value a
  library op reads or writes there) or takes apart ops its oneDNN subgraph backend would fuse
  at bind (``"breaks_onednn_fusion": true``) or gives MXNet an op form it runs outside oneDNN's
  kernel (``"adds_slow_path": true``: a Deconvolution with a bias); fuse otherwise, as before.
* GPU: fuse (the decision the rules made before any table existed); a measured GPU table
  overrides it entry by entry.

``MXFUSION_NO_COST=1`` turns the decisions off (every rewrite the rules allow is made: how the
tables' fused side is measured).

Rules state the case (what they would replace, how large, what is around it); this module
knows nothing about graphs.
"""
from __future__ import annotations

import functools
import json
import math
import os
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple

#: The CPU flags a table is measured under: a table measured with one of them present (or absent)
#: is not taken for a CPU that differs (oneDNN picks other kernels).
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
#: A fused op must beat the ops it replaces by this fraction of their time to be made: a smaller
#: difference is within the noise of the shared 2-core machines the tables are measured on.
WIN_MARGIN = 0.05
KINDS = ("cpu", "gpu")
#: The folder of the tables shipped with the package.
TABLES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cost_tables")


class Decision(NamedTuple):
    fuse: bool
    reason: str


class CostTableError(ValueError):
    """A cost table that does not follow the schema (the message names the file and the field)."""


# ---------------------------------------------------------------------------- the device
def cpu_identity(cpuinfo: str = "/proc/cpuinfo") -> Tuple[str, Tuple[str, ...]]:
    """(model name, the FLAGS this CPU has) as lscpu reads them from /proc/cpuinfo."""
    name, flags = "unknown CPU", set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name == "unknown CPU":
                    name = " ".join(value.split())
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return name, tuple(f for f in FLAGS if f in flags)


# ---------------------------------------------------------------------------- tables
def validate(table: Mapping[str, Any], where: str = "cost table") -> Dict[str, Any]:
    """The table if it follows the schema, else CostTableError naming what is wrong."""
    def need(obj, key, types, ctx):
        v = obj.get(key)
        if not isinstance(v, types) or isinstance(v, bool):
            raise CostTableError("%s: %s needs '%s'" % (where, ctx, key))
        return v

    if not isinstance(table, Mapping):
        raise CostTableError("%s: not a JSON object" % where)
    for key in ("device", "kind", "date", "command"):
        need(table, key, str, "the table")
    if table["kind"] not in KINDS:
        raise CostTableError("%s: kind must be one of %s, got %r" % (where, ", ".join(KINDS), table["kind"]))
    if table["kind"] == "cpu":
        flags = need(table, "cpu_flags", list, "a CPU table")
        if not all(isinstance(f, str) for f in flags):
            raise CostTableError("%s: cpu_flags must be strings" % where)
    for k, e in enumerate(need(table, "entries", list, "the table")):
        ctx = "entry %d" % k
        if not isinstance(e, Mapping):
            raise CostTableError("%s: %s is not an object" % (where, ctx))
        for key in ("op", "dtype", "pass", "reference"):
            need(e, key, str, ctx)
        need(e, "case", Mapping, ctx)
        for key in ("fused_ms", "unfused_ms"):
            v = need(e, key, (int, float), ctx)
            if not math.isfinite(v) or v <= 0:
                raise CostTableError("%s: %s has %s = %r (a positive time in ms)" % (where, ctx, key, v))
    return dict(table)


def load_table(path: str) -> Dict[str, Any]:
    with open(path) as f:
        try:
            data = json.load(f)
        except ValueError as e:
            raise CostTableError("%s: not JSON (%s)" % (path, e)) from None
    return validate(data, path)


def _folders() -> List[str]:
    extra = [p for p in os.environ.get("MXFUSION_COST_TABLES", "").split(os.pathsep) if p]
    return extra + [TABLES_DIR]


@functools.lru_cache(maxsize=None)
def _tables(folders: Tuple[str, ...]) -> Tuple[Dict[str, Any], ...]:
    out = []
    for folder in folders:
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            if name.endswith(".json"):
                out.append(dict(load_table(os.path.join(folder, name)), path=os.path.join(folder, name)))
    return tuple(out)


def table_for(kind: str = "cpu", device: Optional[str] = None,
              cpu_flags: Optional[Iterable[str]] = None) -> Optional[Dict[str, Any]]:
    """The table measured on this device (CPU: this model name and FLAGS unless given; GPU: the
    name given), or None.  A table in a folder of MXFUSION_COST_TABLES wins over the shipped one."""
    if kind not in KINDS:
        raise ValueError("kind must be one of %s, got %r" % (", ".join(KINDS), kind))
    if kind != "cpu" and device is None:
        return None             # a GPU table is taken only for the GPU it was measured on
    if kind == "cpu" and (device is None or cpu_flags is None):
        here, flags = cpu_identity()
        device = here if device is None else device
        cpu_flags = flags if cpu_flags is None else cpu_flags
    want_flags = sorted(f for f in (cpu_flags or ()) if f in FLAGS)
    for t in _tables(tuple(_folders())):
        if t["kind"] != kind or (device is not None and t["device"] != device):
            continue
        if kind == "cpu" and sorted(f for f in t["cpu_flags"] if f in FLAGS) != want_flags:
            continue
        return t
    return None


# ---------------------------------------------------------------------------- decisions
def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _distance(a: Mapping[str, Any], b: Mapping[str, Any]) -> Optional[float]:
    """How far measured case ``b`` is from case ``a``: None when a categorical feature differs
    (or one side lacks a feature), else the sum of |log(a/b)| over the numeric features."""
    if set(a) != set(b):
        return None
    d = 0.0
    for k, v in a.items():
        w = b[k]
        if _numeric(v) and _numeric(w):
            d += abs(math.log(max(float(v), 1e-9) / max(float(w), 1e-9)))
        elif v != w:
            return None
    return d


def _describe(case: Mapping[str, Any]) -> str:
    return ", ".join("%s=%s" % (k, json.dumps(v)) for k, v in sorted(case.items()))


def fallback(op: str, case: Mapping[str, Any], kind: str) -> Decision:
    """The conservative rule for a device without a measured entry (see the module docstring)."""
    if kind == "cpu":
        if case.get("adds_reorders"):
            return Decision(False, "no cost table measured on this CPU for %s (%s): declined, as it would put a library "
                                   "op where MXNet's oneDNN ops keep their blocked layout (tools/measure_cpu_costs.py "
                                   "measures one)" % (op, _describe(case)))
        if case.get("adds_slow_path"):
            return Decision(False, "no cost table measured on this CPU for %s (%s): declined, as it would give MXNet "
                                   "an op form that runs outside oneDNN's kernel (tools/measure_cpu_costs.py measures "
                                   "one)" % (op, _describe(case)))
        if case.get("breaks_onednn_fusion"):
            return Decision(False, "no cost table measured on this CPU for %s (%s): declined, as it would take apart ops "
                                   "MXNet's oneDNN backend fuses at bind (tools/measure_cpu_costs.py measures one)"
                            % (op, _describe(case)))
        return Decision(True, "no cost table for this CPU; nothing around it stays in oneDNN's layout")
    return Decision(True, "no cost table measured on this %s" % kind)


def decide(op: str, dtype: str, pass_: str, case: Mapping[str, Any], kind: str = "cpu",
           device: Optional[str] = None, table: Optional[Mapping[str, Any]] = None) -> Decision:
    """Whether to make a rewrite emitting ``op`` (or named ``op``) for ``case`` on this device, and why.

    ``pass_`` is "forward" (inference) or "backward"; ``table`` overrides the lookup (tests)."""
    if os.environ.get("MXFUSION_NO_COST", "") not in ("", "0"):
        return Decision(True, "cost decisions off (MXFUSION_NO_COST)")
    if table is None:
        table = table_for(kind, device)
    if table is None:
        return fallback(op, case, kind)
    best: Optional[Tuple[float, Mapping[str, Any]]] = None
    for e in table["entries"]:
        if e["op"] != op or e["dtype"] != dtype or e["pass"] != pass_:
            continue
        d = _distance(case, e["case"])
        if d is not None and (best is None or d < best[0]):
            best = (d, e)
    if best is None:
        return fallback(op, case, kind)
    e = best[1]
    fused, unfused = float(e["fused_ms"]), float(e["unfused_ms"])
    near = "" if best[0] == 0 else " (nearest measured: %s)" % _describe(e["case"])
    where = "measured on %s, %s: %s %.3f ms vs %.3f ms for the ops it replaces under %s%s" % (
        table["device"], table["date"], op, fused, unfused, e["reference"], near)
    if fused <= unfused * (1.0 - WIN_MARGIN):
        return Decision(True, where)
    return Decision(False, "slower or no faster than what it replaces (%s)" % where)
