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
* CPU, ``fused_region`` (a region of a CNN in one op, ``patterns/region.py``; its case:
  ``convs``, ``other_ops`` -- the program's other ops and post steps -- and ``mmacs``, the
  convolutions' multiply-adds in millions at the input shapes): made when the region holds at
  least ``REGION_MIN_CONVS`` convolutions, or a convolution and ``REGION_MIN_OTHER`` other ops or
  steps; a convolution with its activation alone is what MXNet's oneDNN backend already fuses at
  bind, and the region's edges cost a reorder each.  Entries of op ``fused_region`` in a CPU's
  table (this case, fused against MXNet's default bind; not measured yet) replace the rule there.
* GPU (``GPU_FALLBACK``): what an NVIDIA H200 measured before a table existed (the project's
  issue on GPU graphs), conservatively — ``fused_attention`` in float32 is declined (its earlier
  kernel measured 5-16x slower than the ops it replaces; the cuBLASLt path that replaced it is not
  measured), in float16/bfloat16 made (cuDNN's fused attention, not measured here either);
  ``fused_dense`` made (cuBLASLt with the bias and activation in its epilogue: 0.88-1.19x PyTorch's
  addmm + GELU, parity); ``fused_add_layer_norm`` made (1.4-1.8x); ``fused_elemwise`` made in
  float32 (its interpreter kernel 1.11-1.18x) and declined in float16/bfloat16 (0.62-0.63x; the
  NVRTC kernels that replaced it are not measured) and declined for the backward (not measured).

A GPU's table is found by the GPU's name: ``MXFUSION_GPU`` (as nvidia-smi names it, e.g. "NVIDIA
H200"), else the first GPU ``nvidia-smi`` lists on the machine that fuses (``gpu_name``).  To
measure one: ``make gpu-check`` on that GPU writes ``$OUT/gpu-check/costs-gpu.json`` (this schema:
the device, driver, CUDA, date, command and ``benchmarks/bench_cuda.py``'s entries — fused op
against PyTorch's eager ops per dtype, pass and case); copy it to
``fusion/engine/cost_tables/gpu-<name>.json`` and commit it (or point ``MXFUSION_COST_TABLES`` at
its folder).  GPU timings (CUDA events, medians) are steady: a fused op is made where it is at
least as fast (``WIN_MARGINS``).

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
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

#: The CPU flags a table is measured under: a table measured with one of them present (or absent)
#: is not taken for a CPU that differs (oneDNN picks other kernels).
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
#: A fused op must beat the ops it replaces by this fraction of their time to be made: a smaller
#: difference is within the noise of the shared 2-core machines the tables are measured on.
WIN_MARGIN = 0.05
#: The margin per device kind: on a GPU (CUDA-event medians) at least as fast is enough.
WIN_MARGINS = {"cpu": WIN_MARGIN, "gpu": 0.0}

_H200 = "on an NVIDIA H200 (before any table: the issue on GPU graphs)"
#: The GPU's conservative rule without a measured entry: (op, dtype or "*", pass or "*") -> (make it?, why).
GPU_FALLBACK: Dict[Tuple[str, str, str], Tuple[bool, str]] = {
    ("fused_attention", "float32", "*"): (False, "fused_attention in float32 measured 5-16x slower than the ops it "
                                                 "replaces %s; its cuBLASLt path is not measured yet" % _H200),
    ("fused_attention", "float16", "*"): (True, "fused_attention in float16 runs cuDNN's fused attention (not "
                                                "measured on this GPU)"),
    ("fused_attention", "bfloat16", "*"): (True, "fused_attention in bfloat16 runs cuDNN's fused attention (not "
                                                 "measured on this GPU)"),
    ("fused_dense", "*", "*"): (True, "fused_dense (cuBLASLt, bias and activation in the epilogue) measured "
                                      "0.88-1.19x PyTorch's addmm + GELU %s: parity" % _H200),
    ("fused_add_layer_norm", "*", "*"): (True, "fused_add_layer_norm measured 1.4-1.8x PyTorch's add + layer_norm %s"
                                         % _H200),
    ("fused_elemwise", "*", "backward"): (False, "fused_elemwise's GPU backward (NVRTC) is not measured yet"),
    ("fused_elemwise", "float32", "forward"): (True, "fused_elemwise in float32 measured 1.11-1.18x PyTorch's "
                                                     "separate ops %s (its interpreter kernel)" % _H200),
    ("fused_elemwise", "float16", "forward"): (False, "fused_elemwise in float16 measured 0.62-0.63x PyTorch's "
                                                      "separate ops %s (its interpreter kernel; the NVRTC kernels "
                                                      "that replaced it are not measured yet)" % _H200),
    ("fused_elemwise", "bfloat16", "forward"): (False, "fused_elemwise in bfloat16: its float16 interpreter kernel "
                                                       "measured 0.62-0.63x PyTorch's separate ops %s (the NVRTC "
                                                       "kernels are not measured yet)" % _H200),
}
#: The CPU's conservative rule for ``fused_region`` without measured entries (see the module docstring).
REGION_MIN_CONVS = 2
REGION_MIN_OTHER = 2
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


def gpu_name() -> Optional[str]:
    """The name of the GPU the fused graph is for: ``MXFUSION_GPU``, else the first GPU nvidia-smi
    lists here (None without either)."""
    name = os.environ.get("MXFUSION_GPU", "").strip()
    return name or _nvidia_smi_name()


@functools.lru_cache(maxsize=None)
def _nvidia_smi_name() -> Optional[str]:
    import shutil
    import subprocess
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0].strip() if out and out[0].strip() else None


def gpu_fallback(op: str, dtype: str, pass_: str, device: Optional[str] = None, no_entry: bool = False) -> Decision:
    """``GPU_FALLBACK``'s decision, its reason naming the GPU that has no table and how to measure one."""
    rule = None
    for key in ((op, dtype, pass_), (op, dtype, "*"), (op, "*", pass_), (op, "*", "*")):
        if key in GPU_FALLBACK:
            rule = GPU_FALLBACK[key]
            break
    if no_entry:
        where = "the cost table of %s has no %s %s %s entry" % (device, op, dtype, pass_)
    elif device:
        where = "no cost table measured on this GPU (%s)" % device
    else:
        where = "no GPU named for the cost table (MXFUSION_GPU, or nvidia-smi where the model is fused)"

    if rule is None:
        return Decision(True, "%s; %s %s %s: made, as before any table" % (where, op, dtype, pass_))
    fuse, why = rule
    return Decision(fuse, "%s: %s; %s (make gpu-check on the GPU measures a table)" % (
        where, "made" if fuse else "declined", why))


def fallback(op: str, case: Mapping[str, Any], kind: str) -> Decision:
    """The conservative rule for a device without a measured entry (see the module docstring)."""
    if kind == "cpu" and op == "fused_region":
        return region_fallback(case)
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


def region_fallback(case: Mapping[str, Any]) -> Decision:
    """The conservative rule for a ``fused_region`` case on a CPU without measured entries."""
    convs, other = int(case.get("convs", 0)), int(case.get("other_ops", 0))
    if convs >= REGION_MIN_CONVS or (convs >= 1 and other >= REGION_MIN_OTHER):
        return Decision(True, "no cost table entry for fused_region on this CPU; %d convolution(s) and %d other "
                              "op(s) or step(s) are enough work for its edges" % (convs, other))
    return Decision(False, "too small to pay for its edges (%d convolution(s), %d other op(s) or step(s); the rule "
                           "without a measured cost table wants %d convolutions, or one and %d other ops or steps: "
                           "a convolution with its activation alone is what MXNet's oneDNN backend fuses at bind)"
                    % (convs, other, REGION_MIN_CONVS, REGION_MIN_OTHER))


def decide(op: str, dtype: str, pass_: str, case: Mapping[str, Any], kind: str = "cpu",
           device: Optional[str] = None, table: Optional[Mapping[str, Any]] = None,
           unseen: Iterable[str] = ()) -> Decision:
    """Whether to make a rewrite emitting ``op`` (or named ``op``) for ``case`` on this device, and why.

    ``pass_`` is "forward" (inference) or "backward"; ``table`` overrides the lookup (tests);
    ``unseen`` names features a table's entries have that the case cannot state (a benchmark's
    own expression): they are left out of the comparison.  On a GPU, ``device`` defaults to
    ``gpu_name()``."""
    if os.environ.get("MXFUSION_NO_COST", "") not in ("", "0"):
        return Decision(True, "cost decisions off (MXFUSION_NO_COST)")
    if kind == "gpu" and device is None and table is None:
        device = gpu_name()
    if table is None:
        table = table_for(kind, device)
    if table is None:
        return gpu_fallback(op, dtype, pass_, device) if kind == "gpu" else fallback(op, case, kind)
    best: Optional[Tuple[float, Mapping[str, Any]]] = None
    unseen = set(unseen)
    for e in table["entries"]:
        if e["op"] != op or e["dtype"] != dtype or e["pass"] != pass_:
            continue
        d = _distance(case, {k: v for k, v in e["case"].items() if k not in unseen})
        if d is not None and (best is None or d < best[0]):
            best = (d, e)
    if best is None:
        if kind == "gpu":
            return gpu_fallback(op, dtype, pass_, table["device"], no_entry=True)
        return fallback(op, case, kind)
    e = best[1]
    fused, unfused = float(e["fused_ms"]), float(e["unfused_ms"])
    near = "" if best[0] == 0 else " (nearest measured: %s)" % _describe(e["case"])
    where = "measured on %s, %s: %s %.3f ms vs %.3f ms for the ops it replaces under %s%s" % (
        table["device"], table["date"], op, fused, unfused, e["reference"], near)
    if fused <= unfused * (1.0 - WIN_MARGINS.get(table["kind"], WIN_MARGIN)):
        return Decision(True, where)
    return Decision(False, "slower or no faster than what it replaces (%s)" % where)


# ---------------------------------------------------------------------------- GPU cases
def _prod(dims: Sequence[int]) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def gpu_case(op: str, attrs: Mapping[str, str], shapes: Sequence[Optional[Tuple[int, ...]]],
             dtype: str) -> Tuple[Dict[str, Any], Tuple[str, ...]]:
    """The case of a GPU fused op as ``benchmarks/bench_cuda.py --costs`` writes its entries, from the
    op's attributes (as strings), its inputs' shapes and the dtype it computes in; and the entry
    features it cannot state (``decide``'s ``unseen``).  Empty where a shape is unknown (no entry
    matches it: the fallback decides)."""
    def flag(key: str) -> bool:
        return str(attrs.get(key, "False")).lower() in ("true", "1")

    if not shapes or any(s is None for s in shapes):
        return {}, ()
    try:
        if op == "fused_dense":
            x = shapes[0]
            flat = str(attrs.get("flatten", "True")).lower() in ("true", "1")
            return {"M": int(x[0]) if flat else _prod(x[:-1]), "K": _prod(x[1:]) if flat else int(x[-1]),
                    "N": int(attrs["num_hidden"]), "act": str(attrs.get("act", "none"))}, ()
        if op == "fused_add_layer_norm":
            a = shapes[0]
            return {"rows": _prod(a[:-1]), "cols": int(a[-1])}, ()
        if op == "fused_attention":
            layout, heads = str(attrs.get("layout", "plain")), int(attrs.get("heads", 1))
            q = shapes[0]
            if layout == "plain":
                b, h, sq, sk, d = _prod(q[:-2]), 1, q[-2], shapes[1][-2], q[-1]
            elif layout == "bshd":
                b, h, sq, sk, d = q[0], heads, q[1], shapes[1][1], q[2] // heads
            elif layout == "packed_qkv":
                b, h, sq, sk, d = q[0], heads, q[1], q[1], q[2] // (3 * heads)
            elif layout == "interleaved":
                b, h, sq, sk, d = q[1], heads, q[0], q[0], q[2] // (3 * heads)
            else:                           # interleaved_encdec
                b, h, sq, sk, d = q[1], heads, q[0], shapes[1][0], q[2] // heads
            return {"B": int(b), "H": int(h), "Sq": int(sq), "Sk": int(sk), "D": int(d), "causal": flag("causal"),
                    "mask": str(attrs.get("mask_kind", "none")),
                    "backend": "gemm_softmax" if dtype == "float32" else "cudnn"}, ()
        if op == "fused_elemwise":
            import re
            out = tuple(max(dims) for dims in zip(*[(1,) * (max(map(len, shapes)) - len(s)) + tuple(s)
                                                    for s in shapes]))
            if len(shapes) == 1:
                kind = "chain"
            elif all(tuple(s) == out for s in shapes):
                kind = "binary"
            elif all(tuple(s) == out or tuple(out[len(out) - len(s):]) == tuple(s) for s in shapes):
                kind = "broadcast row"
            else:
                kind = "broadcast channel"
            return {"elements": _prod(out), "ops": len(re.findall(r"[a-z_]+\(", str(attrs.get("expr", "")))),
                    "kind": kind}, ("expr", "shapes")
    except (KeyError, ValueError, IndexError, TypeError, ZeroDivisionError):
        return {}, ()
    return {}, ()
