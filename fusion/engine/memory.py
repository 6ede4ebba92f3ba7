"""The memory plan: how much the checks may hold at once, and how much a run of a graph takes.

The checks that run models — the per-rewrite self-check, ``--verify``, ``--benchmark`` — bind
MXNet executors, and an executor of a large detector holds gigabytes (Mask R-CNN at 384×384:
3.5 GiB for one inference).  Each stage estimates its peak from the inferred shapes *before*
it runs, holds at most what the **budget** allows, runs smaller where its usual plan would not
fit (fewer executors alive, values not kept, the graph's own values not computed), and says so
in the report.  Where even its smallest plan would not fit, it stops with one line naming the
stage, the estimate and the flag that helps (:class:`OverBudget`), before anything is written.

**The budget** (``--max-memory SIZE``, ``fuse(..., max_memory=)``, ``verify(..., max_memory=)``):
by default ``DEFAULT_SHARE`` of the memory available when the run starts — the least of the
cgroup's limit less its usage (v2 ``memory.max``/``memory.current``, v1
``memory.limit_in_bytes``/``memory.usage_in_bytes``) and the kernel's ``MemAvailable``.  It
bounds what a stage adds to what the process holds when the stage starts (the model and its
parameters are already loaded then).

**The estimate of one bound executor** (``GraphMemory.run``): MXNet plans an inference
executor's memory so that values whose readers have all run share storage; what it takes is
about the graph's *live peak* — the largest sum of the values alive at once, walking the graph
in order, each value freed after its last reader — times ``EXECUTOR_FACTOR`` (its storage
matched by size, not reused exactly, the outputs' copies, oneDNN's scratch buffers), plus a
share of the parameters (oneDNN reorders convolution weights into its own layout while it runs:
``REORDER_SHARE``; all of them again with MXNet's oneDNN subgraph backend on, which keeps the
reordered copies).  Calibrated against the peak resident memory of a plain inference
(``benchmarks/bench_memory.py``): see docs/reliability.md.
"""
from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..ir.errors import FusionError
from ..ir.graph import Entry, Graph

DEFAULT_SHARE = 0.6         # of the memory available when the run starts
EXECUTOR_FACTOR = 2.25      # MXNet's allocation of one inference executor over the graph's live peak
REORDER_SHARE = 0.5         # oneDNN's weight reorders while an executor runs, as a share of the parameters
MIB = 1 << 20
#: Library ops that keep their own buffers while an executor lives: fused_region holds the values inside
#: it in an arena of its own (taken as the original's, which an estimate of the original counts) and its
#: data inputs and outputs again in the layouts oneDNN chose (cuda_kernels/fused_region/README.md)
OWN_LAYOUT_OPS = frozenset({"fused_region"})


class OverBudget(FusionError):
    """A stage whose smallest plan needs more than the memory budget: one line, nothing run or written."""


def fmt_bytes(n: float) -> str:
    """``n`` bytes as people read them: 512 KiB, 340 MiB, 2.1 GiB."""
    n = float(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            value = n / size
            return ("%.1f %s" % (value, unit)) if value < 10 else ("%.0f %s" % (value, unit))
    return "%d B" % n


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: Any, what: str = "--max-memory") -> int:
    """Bytes of a size as ``--max-memory`` takes it: ``4G``, ``500M``, ``1.5GiB``, ``64k``, or plain
    bytes; K, M, G, T are powers of 1024.  A one-line FusionError otherwise."""
    if isinstance(text, bool):
        raise FusionError("%s %r: expected a size such as 4G or 500M" % (what, text))
    if isinstance(text, (int, float, np.integer, np.floating)):
        value = float(text)
    else:
        m = _SIZE.match(str(text))
        if not m:
            raise FusionError("%s %r: expected a size such as 4G or 500M (K, M, G, T: powers of 1024)"
                              % (what, str(text)))
        value = float(m.group(1)) * (1 << (10 * " kmgt".index(m.group(2).lower() or " ")))
    if not np.isfinite(value) or value < 1:
        raise FusionError("%s %r: the size must be at least one byte" % (what, str(text)))
    return int(value)


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < (1 << 60) else None        # v1's "no limit" is a huge number


def _cgroup_dirs() -> List[Tuple[str, str]]:
    """(version, folder) of this process's memory cgroup(s)."""
    out = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            out.append(("2", os.path.join("/sys/fs/cgroup", path.lstrip("/"))))
            out.append(("2", "/sys/fs/cgroup"))
        elif "memory" in controllers.split(","):
            out.append(("1", os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))))
            out.append(("1", "/sys/fs/cgroup/memory"))
    return out


def available_memory() -> Tuple[Optional[int], str]:
    """(bytes available to this process now, where that figure comes from); (None, why) when unknown."""
    found: List[Tuple[int, str]] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable"))
                    break
    except (OSError, ValueError, IndexError):
        pass
    for version, folder in _cgroup_dirs():
        if version == "2":
            limit, used = _read_int(os.path.join(folder, "memory.max")), _read_int(os.path.join(folder, "memory.current"))
        else:
            limit = _read_int(os.path.join(folder, "memory.limit_in_bytes"))
            used = _read_int(os.path.join(folder, "memory.usage_in_bytes"))
        if limit is not None:
            found.append((max(0, limit - (used or 0)), "the cgroup's limit less its usage"))
            break
    if not found:
        return None, "unknown (no /proc/meminfo or cgroup limit)"
    return min(found)


#: per stage: (its name, what helps) as mxfuse's one-line error says them, and as fuse()/verify()'s
_STAGES = {
    "selfcheck": {"cli": ("the self-check", "raise --max-memory or pass --no-self-check"),
                  "api": ("the self-check", "raise max_memory= or pass self_check=False")},
    "verify": {"cli": ("--verify", "raise --max-memory or drop --verify"),
               "api": ("verify()", "raise max_memory= or verify at smaller input shapes")},
    "benchmark": {"cli": ("--benchmark", "raise --max-memory or drop --benchmark"),
                  "api": ("the benchmark", "raise max_memory= or time smaller input shapes")},
}


@dataclass
class Budget:
    """What the checks may hold at once (``limit`` bytes; None: no limit known), where that figure
    comes from (``source``), and the reductions the stages made to stay within it (``notes``:
    one line each, for the report).  ``door``: "cli" (errors name mxfuse's flags) or "api"."""

    limit: Optional[int]
    source: str
    door: str = "api"
    notes: List[str] = field(default_factory=list)
    #: the estimates each stage planned with (for the JSON report): stage -> {what: bytes}
    estimates: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    def allows(self, need: float) -> bool:
        return self.limit is None or need <= self.limit

    def note(self, line: str) -> None:
        if line not in self.notes:
            self.notes.append(line)

    def refuse(self, stage: str, need: float, what: str) -> OverBudget:
        """The one-line error of ``stage`` ("selfcheck", "verify", "benchmark") whose smallest plan
        needs ``need`` bytes (``what``: for what)."""
        name, hint = _STAGES[stage][self.door]
        return OverBudget("%s needs about %s (%s), over the memory budget of %s (%s); %s"
                          % (name, fmt_bytes(need), what, fmt_bytes(self.limit or 0), self.source, hint))

    def describe(self) -> str:
        return "unlimited (%s)" % self.source if self.limit is None else "%s (%s)" % (fmt_bytes(self.limit), self.source)

    def to_dict(self) -> Dict[str, Any]:
        return {"limit_bytes": self.limit, "source": self.source, "reductions": list(self.notes),
                "estimates": {k: dict(v) for k, v in self.estimates.items()}}


def budget(max_memory: Any = None, door: str = "api") -> Budget:
    """The Budget of ``max_memory`` (bytes, or a size such as "4G"), a Budget passed through, or by
    default ``DEFAULT_SHARE`` of the memory available now."""
    if isinstance(max_memory, Budget):
        return max_memory
    what = "--max-memory" if door == "cli" else "max_memory="
    if max_memory is None:
        avail, where = available_memory()
        if avail is None:
            return Budget(None, where, door)
        return Budget(int(avail * DEFAULT_SHARE), "%d %% of the %s available: %s"
                      % (round(DEFAULT_SHARE * 100), fmt_bytes(avail), where), door)
    limit = parse_size(max_memory, what)
    return Budget(limit, "%s%s" % (what, max_memory if door != "cli" else " " + str(max_memory)), door)


# ---------------------------------------------------------------- estimates from shapes

def itemsize(dtype: Any) -> int:
    """Bytes per element of a dtype name (bfloat16 included); 4 where unknown."""
    if dtype is None:
        return 4
    name = str(dtype)
    if name in ("bfloat16", "bf16"):
        return 2
    try:
        return int(np.dtype(name).itemsize)
    except TypeError:
        return 4


def nbytes(shape: Optional[Sequence[int]], dtype: Any = None) -> int:
    return 0 if shape is None else int(np.prod([int(d) for d in shape], dtype=np.int64)) * itemsize(dtype)


@dataclass
class GraphMemory:
    """What a graph's values take at one set of input shapes (bytes): ``params`` (its parameters),
    ``inputs`` (its data inputs), ``outputs`` (its heads), ``live_peak`` (the most alive at once when
    it runs in order), ``all_values`` (every value computed, kept at once), and ``values`` (bytes of
    each computed value, by entry)."""

    params: int = 0
    inputs: int = 0
    outputs: int = 0
    live_peak: int = 0
    all_values: int = 0
    values: Dict[Entry, int] = field(default_factory=dict)
    #: what ops holding their own buffers keep besides MXNet's plan (``OWN_LAYOUT_OPS``)
    own_buffers: int = 0

    def run(self, subgraph: bool = False) -> int:
        """The estimated memory one bound executor adds while it runs (its parameters not counted:
        they are bound as they are)."""
        return int(EXECUTOR_FACTOR * self.live_peak + self.inputs + self.outputs + self.own_buffers
                   + (REORDER_SHARE + (1.0 if subgraph else 0.0)) * self.params)

    def to_dict(self) -> Dict[str, int]:
        return {"params": self.params, "inputs": self.inputs, "outputs": self.outputs, "live_peak": self.live_peak,
                "all_values": self.all_values, "one_run": self.run(), "one_run_subgraph_backend": self.run(True)}


def graph_memory(graph: Graph, shapes: Mapping[Entry, Sequence[int]], dtypes: Optional[Mapping[Entry, str]] = None,
                 param_names: Optional[set] = None) -> GraphMemory:
    """GraphMemory of ``graph`` from the shapes (and dtypes) of its values; a value of unknown shape
    counts 0.  ``param_names``: the variables that are parameters (the others are data inputs)."""
    dtypes = dtypes or {}
    out = GraphMemory()
    heads = set(graph.heads)
    last: Dict[Entry, int] = {}
    for i, nd in enumerate(graph.nodes):
        for e in nd.inputs:
            last[e] = i
    live = 0
    for i, nd in enumerate(graph.nodes):
        if nd.is_variable:
            b = nbytes(shapes.get(Entry(nd)), dtypes.get(Entry(nd)))
            if param_names is None or nd.name in param_names:
                out.params += b
            else:
                out.inputs += b
            continue
        for k in range(nd.num_outputs):
            e = Entry(nd, k)
            b = nbytes(shapes.get(e), dtypes.get(e))
            out.values[e] = b
            out.all_values += b
            live += b
        if nd.op in OWN_LAYOUT_OPS:     # its data inputs and outputs again, in its own layout
            out.own_buffers += sum(out.values.get(Entry(nd, k), 0) for k in range(nd.num_outputs))
            out.own_buffers += sum(out.values.get(e, 0) for e in nd.inputs if not e.node.is_variable)
        out.live_peak = max(out.live_peak, live)
        for e in set(nd.inputs):
            if last.get(e) == i and not e.node.is_variable and e not in heads:
                live -= out.values.get(e, 0)
    out.outputs = sum(out.values.get(e, 0) for e in heads)
    return out


def model_memory(symbol: Any, arg_params: Mapping[str, Any], aux_params: Mapping[str, Any],
                 input_shapes: Mapping[str, Sequence[int]],
                 input_dtypes: Optional[Mapping[str, Any]] = None) -> Optional[GraphMemory]:
    """GraphMemory of a model (symbol and params) at ``input_shapes``; None where MXNet cannot infer its shapes."""
    from .facts import infer

    graph = Graph.from_symbol(symbol) if not isinstance(symbol, Graph) else symbol
    params = {**dict(arg_params or {}), **dict(aux_params or {})}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    shapes.update({k: tuple(v) for k, v in input_shapes.items()})
    dtypes = {k: _dtype_of(v) for k, v in params.items()}
    dtypes.update({k: str(v) for k, v in (input_dtypes or {}).items()})
    try:
        found, types = infer(graph, shapes, dtypes)
    except Exception:       # an op MXNet cannot infer: no estimate
        return None
    if not found:
        return None
    return graph_memory(graph, found, types, set(params))


def _dtype_of(v: Any) -> str:
    from ..precision.policy import dtype_name
    try:
        return dtype_name(v.dtype)
    except (TypeError, AttributeError):
        return "float32"


@contextmanager
def collections_of_new_objects():
    """Within it, ``release``'s collections look at the objects made since it began only (``gc.freeze``):
    a full collection walks every object of the process, MXNet's and the project's modules' included
    (75 ms each on a 2-core EPYC, three per ``--verify``: a quarter of ResNet-50's).  The objects from
    before are collected again after it."""
    import gc

    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def release(collect: bool = True) -> None:
    """Hand what was freed back: Python's cycles collected (``collect``), MXNet's pending frees done,
    and the C heap's free pages returned to the system (glibc keeps them otherwise, and the process's
    resident memory would not fall between stages)."""
    import gc

    if collect:
        gc.collect()
    try:
        import mxnet as mx
        mx.nd.waitall()
    except Exception:       # MXNet not importable or already shutting down: nothing pending to free
        pass
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):      # not glibc
        pass
