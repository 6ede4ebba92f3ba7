"""The per-rewrite numerical self-check: a rewrite is accepted only if it computes what it replaces.

Before a batch of rewrites is committed, each matched subgraph ("old") and its
replacement ("new") are run side by side by MXNet on the same inputs, at every
probe shape of the pass (the user's input shapes and the alternates of
``fusion/engine/facts.py``), and compared output by output:

* shapes equal, NaN and ±inf at the same positions, and the finite values within
  ``TOLERANCE`` of the old output's scale (``max|new − old| / max|old|``, the same
  measure as ``fusion.verify``);
* in ``mode="training"`` also the gradients of every input (with the same random
  output gradients on both sides), and no input whose gradient the old side
  computes may be dropped by the new one.

The inputs of a subgraph are the values it reads from the rest of the graph:

* parameters: their values;
* values computed from shapes and parameters alone (a causal mask built with
  ``arange_like``, a sliced position embedding): computed by MXNet from the graph;
* everything else: random, drawn in the domain the subgraph reads it in — 0/1 for a
  ``where`` condition, integers in ``[0, n]`` for softmax lengths, valid indices for
  ``Embedding``/``take``, small integers for integer dtypes, N(0, 1) otherwise.

A rewrite is first checked **on its own** (``SelfCheck._alone``): nothing else of the graph
runs, its inputs are drawn as above (values computed from shapes alone are the graph's, computed
without what computes the tensors whose shape they read), at its own shapes at each probe — at
smaller ones where it names no size (``ALONE_MIN``), at the first probe no smaller than where every tap
of its convolutions' and poolings' windows still reads a value.  One that does not pass there, or cannot be
checked so, is checked on the graph's own values as described above, which decides.  What the
check holds at once is planned against the memory budget (fusion/engine/memory.py): fewer
candidates per executor, the graph's values not kept or not computed; a note says so.

A rewrite that fails the check is refused with the mismatch as its reason.  One
whose inputs' shapes are unknown (no input shapes were given) is not checked, and
the report says how many were; the check is defence in depth, not a substitute for
rules that decide exactly.

All candidates of one rule application are checked in one MXNet graph per probe
(with MXNet's oneDNN subgraph backend off, like ``fusion.verify``); when that graph
fails to bind or run, it is bisected to the candidates that fail.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..ir.graph import Entry, Node
from ..precision.policy import dtype_name
from .inputs import SHAPE_ONLY, draw, input_domain

TOLERANCE = 1e-4            # outputs: max|new − old| / max|old|
# A rewrite checked on its own (drawn inputs) at sizes it names none of: sizes above this are shrunk
ALONE_MIN = 8
# Rewrites of one batch with the same structure, attributes and input shapes (a 100k-node graph
# folds thousands of identical Conv→BN blocks) are checked up to this many at the user's shapes,
# and this many at the other probe shapes; the report counts the rest as sampled.
MAX_PER_SIGNATURE = 64
MAX_PER_SIGNATURE_AT_OTHER_SHAPES = 4
GRAD_TOLERANCE = 1e-3       # gradients: backward passes re-associate more sums


@dataclass
class Candidate:
    """A rewrite built but not committed.

    ``mapping`` pairs the values compared (old entry -> new entry); ``replaces`` is what the
    commit redirects.  ``old_extra``/``new_extra``: nodes outside the match run on both sides
    to compare a value through its readers (see ``Rule.outside_use_ok``).
    """

    match: Any
    created: List[Node]
    mapping: Dict[Entry, Entry]
    replaces: Dict[Entry, Entry] = field(default_factory=dict)
    old_extra: List[Node] = field(default_factory=list)
    new_extra: List[Node] = field(default_factory=list)


@dataclass
class CheckStats:
    checked: int = 0
    sampled: int = 0        # same structure and shapes as rewrites checked in the same batch
    refused: int = 0
    unchecked: int = 0
    size_free: int = 0      # of those checked, checked at smaller shapes alone (see ``size_free``)
    alone: int = 0          # of those checked, checked on their own on drawn inputs (``SelfCheck._alone``)
    alone_smaller: int = 0  # of those, at smaller shapes of their own
    unchecked_reasons: Dict[str, int] = field(default_factory=dict)
    worst_rel: float = 0.0
    worst_at: str = ""
    probes: List[Dict[str, tuple]] = field(default_factory=list)

    def note_unchecked(self, reason: str) -> None:
        self.unchecked += 1
        self.unchecked_reasons[reason] = self.unchecked_reasons.get(reason, 0) + 1

    def to_dict(self) -> Dict[str, Any]:
        return {"checked": self.checked, "sampled": self.sampled, "refused": self.refused, "unchecked": self.unchecked,
                "checked_at_small_shapes": self.size_free, "checked_alone": self.alone,
                "checked_alone_at_smaller_shapes": self.alone_smaller,
                "unchecked_reasons": dict(self.unchecked_reasons), "worst_rel": self.worst_rel,
                "worst_at": self.worst_at, "probes": [{k: list(v) for k, v in p.items()} for p in self.probes]}


# ---------------------------------------------------------------- which values depend on data

class DataDependence:
    """Whether a value depends on the values (not only the shapes) of the model's data inputs —
    or, with ``params=True``, of any variable (a trained parameter included)."""

    def __init__(self, ctx: Any, params: bool = False):
        self.ctx = ctx
        self.params = params
        self._memo: Dict[Node, bool] = {}

    def __call__(self, node: Node) -> bool:
        memo = self._memo
        stack = [(node, False)]
        while stack:
            nd, expanded = stack.pop()
            if nd in memo:
                continue
            if nd.op == "null":
                memo[nd] = self.params or self.ctx.value(Entry(nd)) is None
                continue
            if nd.op.startswith(("_random", "_sample")) or nd.op == "Dropout":
                memo[nd] = True
                continue
            parents = [e.node for slot, e in enumerate(nd.inputs) if (nd.op, slot) not in SHAPE_ONLY]
            if expanded:
                memo[nd] = any(memo.get(p, True) for p in parents)
                continue
            stack.append((nd, True))
            stack.extend((p, False) for p in parents if p not in memo)
        return memo[node]


# ---------------------------------------------------------------- building the side-by-side graph

class _Side:
    """One side (old or new) of one candidate: its nodes, outputs and external inputs."""

    def __init__(self, nodes: Sequence[Node], outputs: Sequence[Entry]):
        self.nodes = [n for n in nodes if not n.is_variable]     # variables (new parameters) are inputs
        inside = {id(n) for n in self.nodes}
        ext: List[Entry] = []
        seen = set()
        for nd in self.nodes:
            for e in nd.inputs:
                if id(e.node) not in inside and e not in seen:
                    seen.add(e)
                    ext.append(e)
        for e in outputs:
            if id(e.node) not in inside and e not in seen:
                seen.add(e)
                ext.append(e)
        self.outputs = list(outputs)
        self.external = ext
        self.inside = inside

    def users(self, node: Node) -> List[Tuple[Node, int]]:
        return [(nd, slot) for nd in self.nodes for slot, e in enumerate(nd.inputs) if e.node is node]

    def users_of_entry(self, entry: Entry) -> List[Tuple[Node, int]]:
        return [(nd, slot) for nd in self.nodes for slot, e in enumerate(nd.inputs) if e == entry]


class _Prepared:
    def __init__(self, index: int, old: _Side, new: _Side, values: Dict[Entry, np.ndarray],
                 shapes: Optional[Dict[Entry, tuple]] = None):
        self.index = index
        self.old, self.new = old, new
        self.values = values
        self.shapes = shapes        # of every value of both sides, where known (the memory plan reads them)


def _emit(side: _Side, tag: str, jnodes: List[dict], row_counts: List[int]) -> Tuple[List[list], Dict[str, Entry]]:
    """Append ``side`` to the JSON node list; returns its head refs and {variable name: entry}."""
    index: Dict[int, int] = {}
    variables: Dict[Entry, int] = {}
    names: Dict[str, Entry] = {}

    def ref(e: Entry) -> list:
        if id(e.node) in index:
            return [index[id(e.node)], e.index, 0]
        if e not in variables:
            name = "%s_x%d" % (tag, len(variables))
            variables[e] = len(jnodes)
            names[name] = e
            jnodes.append({"op": "null", "name": name, "inputs": []})
            row_counts.append(1)
        return [variables[e], 0, 0]

    for k, nd in enumerate(side.nodes):
        inputs = [ref(e) for e in nd.inputs]
        jn = {"op": nd.op, "name": "%s_n%d" % (tag, k), "inputs": inputs}
        if len(nd.attrs):
            jn["attrs"] = nd.attrs.to_json()
        if "subgraphs" in nd.extra:
            jn["subgraphs"] = nd.extra["subgraphs"]
        index[id(nd)] = len(jnodes)
        jnodes.append(jn)
        row_counts.append(nd.num_outputs)
    heads = [ref(e) for e in side.outputs]
    return heads, names


def _build(items: Sequence[_Prepared]):
    jnodes: List[dict] = []
    rows: List[int] = []
    heads: List[list] = []
    layout = []          # per item: (n outputs, {name: entry} old, {name: entry} new)
    for it in items:
        h_old, v_old = _emit(it.old, "c%do" % it.index, jnodes, rows)
        h_new, v_new = _emit(it.new, "c%dn" % it.index, jnodes, rows)
        heads.extend(h_old + h_new)
        layout.append((len(h_old), v_old, v_new))
    row_ptr = [0]
    for r in rows:
        row_ptr.append(row_ptr[-1] + r)
    data = {"nodes": jnodes, "arg_nodes": [i for i, n in enumerate(jnodes) if n["op"] == "null"],
            "node_row_ptr": row_ptr, "heads": heads, "attrs": {"mxnet_version": ["int", 10901]}}
    return json.dumps(data), layout


# ---------------------------------------------------------------- comparing

def compare(old: np.ndarray, new: np.ndarray) -> Tuple[float, Optional[str]]:
    """(relative error, reason or None) of ``new`` against ``old``."""
    if old.shape != new.shape:
        return float("inf"), "shape %s instead of %s" % (new.shape, old.shape)
    if old.size == 0:
        return 0.0, None
    if old.dtype != new.dtype:
        return float("inf"), "dtype %s instead of %s" % (new.dtype, old.dtype)
    from ..precision.policy import from_bf16, is_bf16
    if is_bf16(old.dtype):          # bfloat16 values: compared as the float32 values they are
        old, new = from_bf16(old), from_bf16(new)
    if not np.issubdtype(old.dtype, np.floating):
        diff = int(np.count_nonzero(old != new))
        return (0.0, None) if diff == 0 else (float("inf"), "%d value(s) differ" % diff)
    a, b = old, new
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(a - b)
        worst = d.max()
        if np.isfinite(worst):       # no NaN/inf on either side (the common case): one pass
            scale = float(np.abs(a).max())
            return (float(worst) / scale if scale > 0 else float(worst)), None
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if not np.array_equal(nan_a, nan_b):
        return float("inf"), "NaN at %d position(s) where the original has NaN at %d" % (nan_b.sum(), nan_a.sum())
    inf_a, inf_b = np.isinf(a), np.isinf(b)
    if not np.array_equal(inf_a, inf_b) or not np.array_equal(a[inf_a], b[inf_b]):
        return float("inf"), "±inf at %d position(s) where the original has ±inf at %d" % (inf_b.sum(), inf_a.sum())
    fin = ~(nan_a | inf_a)
    if not fin.any():
        return 0.0, None
    diff = float(np.abs(a[fin].astype(np.float64) - b[fin].astype(np.float64)).max())
    scale = float(np.abs(a[fin]).max())
    return (diff / scale if scale > 0 else diff), None


# ---------------------------------------------------------------- the check

class SelfCheck:
    """Checks candidates of the rewrite pass (see module docs); one per ``fuse()`` call."""

    def __init__(self, ctx: Any, enabled: bool = True, seed: int = 0, budget: Any = None):
        from .memory import budget as make_budget

        self.ctx = ctx
        self.enabled = enabled
        self.stats = CheckStats()
        self.seed = seed
        self.depends = DataDependence(ctx)
        self.reads_values = DataDependence(ctx, params=True)
        #: the memory plan's budget (fusion/engine/memory.py); its notes say what was run smaller
        self.budget = make_budget(budget)
        self._names: Dict[int, str] = {}        # candidate index -> "rule at 'anchor'" (the batch being checked)
        self._estimates: Dict[int, Any] = {}    # probe -> GraphMemory of the graph there

    # -- entry point -------------------------------------------------------------------
    def run(self, rule: Any, candidates: Sequence[Candidate]) -> List[Optional[str]]:
        """A refusal reason (or None) per candidate."""
        reasons: List[Optional[str]] = [None] * len(candidates)
        if not candidates:
            return reasons
        if not self.enabled:
            return reasons
        ctx = self.ctx
        if not ctx.input_shapes and any(ctx.value(Entry(nd)) is None for nd in ctx.graph.variables()):
            for _ in candidates:
                self.stats.note_unchecked("no input shapes given")
            return reasons
        signatures = [_signature(c, ctx) for c in candidates]
        self._names = {i: "%s at '%s'" % (rule.name, c.match.anchor.name) for i, c in enumerate(candidates)}
        passed, sampled, smaller = self._alone(rule, candidates, signatures)
        rest = [i for i in range(len(candidates)) if i not in passed and i not in sampled]
        if rest:
            self._with_the_graph(rule, candidates, signatures, rest, reasons)
        for i in passed:
            self.stats.checked += 1
            self.stats.alone += 1
            if i in smaller:
                self.stats.alone_smaller += 1
                self.stats.size_free += 1
        return reasons

    def _with_the_graph(self, rule: Any, candidates: Sequence[Candidate], signatures: List[tuple],
                        members_: List[int], reasons: List[Optional[str]]) -> None:
        """Check ``members_`` on the graph's own values at its probes: a rewrite that names no size at the
        small probes alone, the others at the user's."""
        ctx = self.ctx
        probes = ctx.probes
        small, smallest = ctx.small_probes()
        general = {i: bool(small) and size_free(candidates[i], ctx, smallest) for i in members_}
        schedule = [(len(probes) + k, k == 0, [i for i in members_ if general[i]]) for k in range(len(small))]
        schedule += [(p, p == 0, [i for i in members_ if not general[i]]) for p in range(len(probes))]
        checked = {i: False for i in members_}
        for p, first, members in schedule:
            if not members:
                continue
            shapes = ctx.probe_shapes(p)
            if shapes not in self.stats.probes:
                self.stats.probes.append(shapes)
            chosen = self._sample(members, signatures, reasons, first)
            items = []
            for i, prepared in zip(chosen, self._prepare_all([(i, candidates[i]) for i in chosen], p)):
                if isinstance(prepared, str):
                    if first:
                        self.stats.note_unchecked(prepared)
                    continue
                items.append(prepared)
            if not items:
                continue
            for i, reason, rel in self._run_planned(items, p, "at input shapes %s" % _fmt(shapes), first):
                if reason is None:
                    checked[i] = True
                    self._worst(rule, candidates[i], rel)
                elif reason is not _UNCHECKED:
                    reasons[i] = "self-check%s: %s" % ("" if p == 0 else " at input shapes %s" % _fmt(shapes),
                                                      reason)
        for i, ok in checked.items():
            if reasons[i] is not None:
                self.stats.refused += 1
            elif ok:
                self.stats.checked += 1
                if general[i]:
                    self.stats.size_free += 1

    def _sample(self, members: List[int], signatures: List[tuple], reasons: List[Optional[str]],
                first: bool, count: bool = True) -> List[int]:
        """``members`` but those past the quota of their signature (counted as sampled at the first probe)."""
        quota = MAX_PER_SIGNATURE if first else MAX_PER_SIGNATURE_AT_OTHER_SHAPES
        seen: Dict[Any, int] = {}
        chosen = []
        for i in members:
            if reasons[i] is not None:
                continue
            seen[signatures[i]] = seen.get(signatures[i], 0) + 1
            if seen[signatures[i]] > quota:
                if first and count:
                    self.stats.sampled += 1
                continue
            chosen.append(i)
        return chosen

    def _worst(self, rule: Any, c: Candidate, rel: float) -> None:
        if rel > self.stats.worst_rel:
            self.stats.worst_rel = rel
            self.stats.worst_at = "%s at '%s'" % (rule.name, c.match.anchor.name)

    # -- on their own ------------------------------------------------------------------
    def _alone(self, rule: Any, candidates: Sequence[Candidate], signatures: List[tuple]):
        """Check each candidate on its own — its subgraph and its replacement, nothing else of the
        graph run — on drawn inputs, at its own shapes at each probe of the graph (``_alone_probes``:
        smaller ones where it names no size).  The others (no such shapes, a value computed
        from shapes alone, a mismatch) are checked on the graph's own values (``_with_the_graph``),
        which decides: a mismatch on drawn inputs is not taken as the reason.  Returns (the candidates
        that passed at every such probe, those past the quota of their signature taken as their twins
        that passed, those that passed at smaller shapes only)."""
        ctx = self.ctx
        sides = {}
        plans: Dict[int, List[Dict[Entry, tuple]]] = {}
        shrunk: set = set()
        small_probes, smallest = ctx.small_probes()
        for i, c in enumerate(candidates):
            old, new = self._sides(c)
            sides[i] = (old, new)
            found = self._alone_probes(c, old, new)
            if found is None:
                continue
            if not found[1] and small_probes and size_free(c, ctx, smallest) and \
                    self._alone_bytes(found[0]) > self._small_probes_bytes():
                continue        # at its own full shapes: the graph's small probes cost less
            plans[i] = found[0]
            if all(at is None for _, _, at in found[0]):
                shrunk.add(i)
        ok = {i: True for i in plans}
        depth = max((len(v) for v in plans.values()), default=0)
        never: List[Optional[str]] = [None] * len(candidates)
        first_round = self._sample(sorted(plans), signatures, never, True, count=False)
        past_quota = set(plans) - set(first_round)
        for k in range(depth):
            members = [i for i in sorted(plans) if ok[i] and len(plans[i]) > k and i not in past_quota]
            chosen = self._sample(members, signatures, never, k == 0, count=False)
            items = []
            for i in chosen:
                prepared = self._prepare_alone(i, candidates[i], *sides[i], plans[i][k], k)
                if isinstance(prepared, str):
                    ok[i] = False
                    continue
                items.append(prepared)
            if not items:
                continue
            labels = {it.index: "on its own, its inputs' shapes %s" % plans[it.index][k][1] for it in items}
            for i, reason, rel in self._run_planned(items, None, "on their own", k == 0, labels):
                if reason is None:
                    self._worst(rule, candidates[i], rel)
                else:
                    ok[i] = False
        passed = {i for i in first_round if ok[i]}
        # past the quota of their signature: taken as their checked twins are, where every one passed
        failed_signatures = {signatures[i] for i in first_round if not ok[i]}
        sampled = {i for i in past_quota if signatures[i] not in failed_signatures}
        self.stats.sampled += len(sampled)
        return passed, sampled, shrunk & passed

    def _alone_probes(self, c: Candidate, old: _Side, new: _Side):
        """(the shapes of every value of both sides at each probe it is checked at on its own, with a
        label and the graph's probe where they are not shrunk; whether every one of them is smaller than
        the graph's or has no size to shrink), or None where it cannot be
        checked on its own: it reads a value computed from shapes alone (only the graph computes it),
        or MXNet cannot infer its sides at such shapes.

        At each probe of the graph, the shapes its inputs have there; where the rewrite names no size
        above ``ALONE_MIN`` (``size_free``), every size above it that no parameter it reads has and no
        attribute of the matched ops names is shrunk — to ``ALONE_MIN`` and on by rank (sizes equal
        stay equal, different stay different and in order), else to a fraction (``_FRACTIONS``, smallest
        first) — where both sides still infer (their compared outputs of one shape); where none does, the
        same with the sizes past the channel axis alone (a channel count that a concatenation's
        parameters tie keeps its size).  At the first probe the shapes taken are also ones where every
        tap of every window of the matched ops (``_taps_read``) that the graph's shapes read is read:
        a dilated convolution shrunk to a map smaller than its window reads its centre alone."""
        ctx = self.ctx
        created = {id(n) for n in c.created + c.new_extra}
        params: Dict[Entry, tuple] = {}
        data: List[Entry] = []
        shape_only = False
        for e in _unique(old.external + new.external):
            if e.node.is_variable:
                shape = ctx._param_shape(e.node.name)
                if shape is not None:
                    params[e] = tuple(int(d) for d in shape)
                    continue
            elif id(e.node) in created:
                return None
            elif not self.depends(e.node):
                shape_only = True       # computed from the graph at its own probes: no shapes of our own
            data.append(e)
        if not data:
            return None
        pdims = {d for shape in params.values() for d in shape}
        named: set = set()
        for nd in list(c.match.nodes) + list(c.old_extra):
            named |= _integers(nd.attrs.to_json())
        may_shrink = not shape_only and size_free(c, ctx, ALONE_MIN + 1)
        found, seen, smaller, small_already = [], set(), True, True
        windows = [nd for nd in old.nodes if nd.op in _WINDOWED]
        for p in range(len(ctx.probes)):
            at: Dict[Entry, tuple] = {}
            for e in data:
                shape = ctx.probe_shapes(p).get(e.node.name) if e.node.is_variable else ctx._lookup(e, p, 0)
                if shape is None:
                    break
                at[e] = tuple(int(d) for d in shape)
            if len(at) < len(data):
                if p == 0:
                    return None
                continue
            free = sorted({d for shape in at.values() for d in shape
                           if d > ALONE_MIN and d not in pdims and d not in named})
            small_already = small_already and not free
            free = free if may_shrink else []
            maps: List[Dict[int, int]] = []
            # then the sizes past the channel axis alone (H, W of NCHW): a channel count that a concat's
            # parameters tie (2048 + 4·512 read by a 4096-channel convolution) keeps its size
            trailing = [d for d in free if not any(len(s) > 2 and d in s[:2] for s in at.values())]
            for sizes in [free] + ([trailing] if trailing and trailing != free else []):
                maps.append({d: ALONE_MIN + k for k, d in enumerate(sizes)})
                maps += [{d: max(ALONE_MIN, d * a // b) for d in sizes} for a, b in _FRACTIONS]
            maps.append({})
            # at the first probe, every tap of every window (convolution, pooling) that the graph's shapes
            # read is read at the shapes checked: a 3×3 convolution of dilation 36 on an 8×8 map reads
            # its centre alone, and a wrong dilation would pass (the other probes check the batch)
            taps = None
            if p == 0 and windows and len(maps) > 1:
                full = self._infer_alone(old, new, params, at)
                taps = _taps_read(windows, full) if full is not None else None
            shapes = None
            for m in maps:
                shapes = self._infer_alone(old, new, params, {e: tuple(m.get(d, d) for d in s) for e, s in at.items()})
                if shapes is not None and (not m or taps is None or taps <= _taps_read(windows, shapes)):
                    break
                shapes = None
            if shapes is None:      # not even at the graph's shapes: the graph's check says why
                return None
            key = tuple(shapes[e] for e in data)
            if key in seen:
                continue
            seen.add(key)
            smaller = smaller and bool(m)
            found.append((shapes, "; ".join(",".join(map(str, shapes[e])) for e in data[:3])
                          + (" …" if len(data) > 3 else ""), None if m else p))
        return (found, smaller or small_already) if found else None

    def _alone_bytes(self, probes) -> int:
        """What checking a candidate on its own at ``probes`` computes (bytes of every value, each probe)."""
        from .memory import nbytes

        return sum(nbytes(shape, self.ctx.dtype(e)) for shapes, _, _ in probes for e, shape in shapes.items()
                   if not e.node.is_variable)

    def _small_probes_bytes(self) -> int:
        """What the graph's values at its small probes take to compute, where not computed yet."""
        ctx = self.ctx
        small, _ = ctx.small_probes()
        total = 0
        for k in range(len(small)):
            p = len(ctx.probes) + k
            if not ctx.memo.get(("selfcheck-activations", p)):
                total += self._graph_estimate(p).all_values
        return total

    def _infer_alone(self, old: _Side, new: _Side, params: Dict[Entry, tuple], data: Dict[Entry, tuple]):
        """The shapes of every value of both sides from their inputs' (None where MXNet does not infer
        them all, or the compared outputs differ in shape); a library op inferred alone, every input known."""
        from .facts import infer_nodes

        shapes: Dict[Entry, tuple] = {**params, **data}
        for side in (old, new):
            batch: List[Node] = []
            for nd in side.nodes + [None]:
                if nd is not None and not nd.op.startswith("fused_"):
                    batch.append(nd)
                    continue
                for run_now in ([batch] if batch else []) + ([[nd]] if nd is not None else []):
                    got = infer_nodes(run_now, shapes)
                    if got is None:
                        return None
                    shapes.update(got[0])
                batch = []
            if any(Entry(nd, k) not in shapes for nd in side.nodes for k in range(nd.num_outputs)):
                return None
        if any(shapes.get(a) != shapes.get(b) for a, b in zip(old.outputs, new.outputs)):
            return None
        return shapes

    def _prepare_alone(self, i: int, c: Candidate, old: _Side, new: _Side, probe, k: int):
        """A _Prepared of candidate ``i`` on its own at ``probe`` (shapes, label, the graph's probe where
        they are its shapes there): parameters as they are, every other input drawn in the domain its
        readers read it in."""
        ctx = self.ctx
        shapes, _, at = probe
        if at is not None and ctx.probe_shapes(at) not in self.stats.probes:
            self.stats.probes.append(ctx.probe_shapes(at))
        created = {id(n) for n in c.created + c.new_extra}

        def shape_of(e: Entry):
            return None if id(e.node) in created else shapes.get(e)

        rng = np.random.default_rng(self.seed + 7919 * i + 104723 * (k + 1))
        values: Dict[Entry, Any] = {}
        for e in _unique(old.external + new.external):
            if e.node.is_variable:
                v = ctx.array(e)
                if v is not None:
                    values[e] = v
                    continue
            elif not self.depends(e.node):      # from shapes alone: the graph's own value there
                got = self._shape_values([e], at).get(e) if at is not None else None
                if got is None or tuple(got.shape) != tuple(shapes.get(e) or ()):
                    return "values computed from shapes could not be evaluated"
                values[e] = got
                continue
            shape = shapes.get(e)
            if shape is None:
                return "the shape of '%s' is unknown" % e.node.name
            dtype = (ctx.input_dtypes.get(e.node.name) if e.node.is_variable else None) or ctx.dtype(e) or "float32"
            users = old.users_of_entry(e) + new.users_of_entry(e)
            domain = input_domain(users, lambda n: old.users(n) + new.users(n), shape_of)
            values[e] = draw(rng, tuple(shape), dtype, domain)
        return _Prepared(i, old, new, values, shapes)

    # -- the memory plan ----------------------------------------------------------------
    def _item_bytes(self, it: _Prepared, p: Optional[int]) -> int:
        """What running ``it`` side by side adds: its drawn inputs, and every value of both sides (kept
        at once: an upper bound of what MXNet plans)."""
        from .memory import nbytes

        ctx = self.ctx
        total = 0
        for e, v in it.values.items():
            if not e.node.is_variable or ctx.value(e) is None:
                total += int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize if hasattr(v, "dtype") else 0
        for side in (it.old, it.new):
            for nd in side.nodes:
                for k in range(nd.num_outputs):
                    e = Entry(nd, k)
                    shape = it.shapes.get(e) if it.shapes is not None else (
                        ctx._lookup(e, p, 0) if p is not None and side is it.old else None)
                    total += nbytes(shape, ctx.dtype(e) if side is it.old else None)
        if it.shapes is None:       # the replacement's values: not inferred here, taken as the old side's
            total += sum(nbytes(ctx._lookup(Entry(nd, k), p, 0)) for nd in it.old.nodes for k in range(nd.num_outputs)
                         ) if p is not None else 0
        return total

    def _held(self) -> int:
        """Bytes of the graph's values kept for later rules (each array once)."""
        seen, total = set(), 0
        for key, cache in self.ctx.memo.items():
            if isinstance(key, tuple) and key and key[0] == "selfcheck-activations":
                for v in cache.values():
                    if v is not None and id(v) not in seen:
                        seen.add(id(v))
                        total += int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
        return total

    def _drop_kept(self) -> None:
        """Forget the graph's values kept for later rules (they are computed again where needed)."""
        from .memory import release

        for key in [k for k in self.ctx.memo if isinstance(k, tuple) and k and k[0] in (
                "selfcheck-activations", "selfcheck-telling")]:
            del self.ctx.memo[key]
        release(collect=False)

    def _run_planned(self, items: List[_Prepared], p: Optional[int], where: str, first: bool,
                     labels: Optional[Dict[int, str]] = None):
        """``_run_group`` of ``items`` in as few executors as the memory budget allows.  A rewrite that
        does not fit alone is skipped at this probe (a note says so), or — at its first probe, where no
        smaller plan is left — stops the run (``OverBudget``)."""
        from .memory import fmt_bytes, release

        budget = self.budget
        need = [self._item_bytes(it, p) for it in items]
        held = self._held()
        room = None if budget.limit is None else budget.limit - held
        if room is not None and held and sum(need) > room:
            self._drop_kept()
            held, room = 0, budget.limit
        groups: List[List[_Prepared]] = []
        chunk: List[_Prepared] = []
        chunk_need = 0
        for it, n in zip(items, need):
            if room is not None and n > room:
                at = (labels or {}).get(it.index, where)
                if first:
                    raise budget.refuse("selfcheck", n, "to run one rewrite, %s, beside what it replaces %s"
                                        % (self._names.get(it.index, "?"), at))
                budget.note("self-check: %s not run %s: it needs about %s, over the memory budget"
                            % (self._names.get(it.index, "a rewrite"), at, fmt_bytes(n)))
                continue
            if chunk and room is not None and chunk_need + n > room:
                groups.append(chunk)
                chunk, chunk_need = [], 0
            chunk.append(it)
            chunk_need += n
        if chunk:
            groups.append(chunk)
        if len(groups) > 1:
            budget.note("self-check: rewrites run a few at a time (%s), not all in one MXNet executor, to stay "
                        "within the memory budget" % where)
        out = []
        for g in groups:
            out += self._run_group(g, p)
            if len(groups) > 1 or budget.limit is not None and sum(need) > budget.limit // 4:
                release(collect=False)
        return out

    def _graph_estimate(self, p: int):
        """GraphMemory of the graph at probe ``p`` (made once per probe, from the graph as it is then)."""
        from .memory import graph_memory

        if p not in self._estimates:
            ctx = self.ctx
            ctx.graph.compact()
            shapes, dtypes = {}, {}
            for nd in ctx.graph.nodes:
                for k in range(nd.num_outputs):
                    e = Entry(nd, k)
                    shape = ctx._lookup(e, p, 0) if not nd.is_variable else (
                        ctx._param_shape(nd.name) or ctx.probe_shapes(p).get(nd.name))
                    if shape is not None:
                        shapes[e] = shape
                    t = ctx.dtype(e)
                    if t is not None:
                        dtypes[e] = t
            params = {nd.name for nd in ctx.graph.variables() if ctx._param_shape(nd.name) is not None}
            self._estimates[p] = graph_memory(ctx.graph, shapes, dtypes, params)
        return self._estimates[p]

    # -- inputs ------------------------------------------------------------------------
    def _shape_at(self, p: int):
        return lambda e: self.ctx._lookup(e, p, 0)

    def _sides(self, c: Candidate) -> Tuple[_Side, _Side]:
        keys = list(c.mapping)
        old = _Side(sorted(c.match.nodes, key=lambda n: n.pos) + c.old_extra, keys)
        new = _Side(c.created + c.new_extra, [c.mapping[k] for k in keys])
        return old, new

    def _prepare_all(self, indexed: Sequence[Tuple[int, Candidate]], p: int) -> List[Any]:
        """A _Prepared (or why not) per candidate: its inputs at probe ``p``.  The values the
        candidates read from the graph are the graph's own at that probe, computed in one run of
        the graph on random data inputs (``_activations``); one that is not finite or is constant
        there while it depends on the data is drawn instead (it could not tell a wrong rewrite)."""
        sides = [self._sides(c) for _, c in indexed]
        computed = _unique([e for old, new in sides for e in old.external + new.external
                            if not e.node.is_variable])
        acts = self._activations(computed, p) if computed else {}
        return [self._prepare(i, c, p, old, new, acts) for (i, c), (old, new) in zip(indexed, sides)]

    def _prepare(self, i: int, c: Candidate, p: int, old: _Side, new: _Side, acts: Dict[Entry, Any]):
        ctx = self.ctx
        created = {id(n) for n in c.created + c.new_extra}
        shape_at = self._shape_at(p)

        def shape_of(e: Entry):
            return None if id(e.node) in created else shape_at(e)

        values: Dict[Entry, np.ndarray] = {}
        rng = np.random.default_rng(self.seed + 7919 * i + p)
        data = None
        externals = [e for e in _unique(old.external + new.external) if not e.node.is_variable]
        for e in _unique(old.external + new.external):
            if e.node.is_variable:
                v = ctx.array(e)
                if v is not None:
                    values[e] = v
                    continue
                if data is None:
                    data = self._data(p)
                if e.node.name in data:
                    values[e] = data[e.node.name]
                    continue
                shape = ctx.probe_shapes(p).get(e.node.name)
            else:
                shape = shape_at(e)
            if shape is None:
                return "the shape of '%s' is unknown" % e.node.name
            got = acts.get(e)
            reads_data = e.node.is_variable or self.depends(e.node)
            if not reads_data:
                if got is None:
                    return "values computed from shapes could not be evaluated"
                values[e] = got
                continue
            if got is not None and tuple(got.shape) == tuple(shape) and \
                    (self._telling(e, got, p) or _related(e, externals)) and \
                    dtype_name(got.dtype) == (ctx.dtype(e) or dtype_name(got.dtype)):
                # (a value computed from another the rewrite reads -- a mask and the comparison it
                # is carried from -- stays the graph's even where it is one constant: drawn on its
                # own it would no longer be what the other gives)
                values[e] = got
                continue
            dtype = ctx.dtype(e) or "float32"
            users = old.users_of_entry(e) + new.users_of_entry(e)
            domain = input_domain(users, lambda n: old.users(n) + new.users(n), shape_of)
            values[e] = draw(rng, tuple(shape), dtype, domain)
        return _Prepared(i, old, new, values)

    def _data(self, p: int) -> Dict[str, np.ndarray]:
        """The graph's data inputs at probe ``p``, drawn once in the domain the graph reads each in."""
        import mxnet as mx

        ctx = self.ctx
        key = ("selfcheck-data", p)
        if key not in ctx.memo:
            users = ctx.graph.consumers()
            shape_at = self._shape_at(p)
            rng = np.random.default_rng(self.seed + 15485863 + p)
            out = {}
            for nd in ctx.graph.variables():
                shape = ctx.probe_shapes(p).get(nd.name)
                if ctx.value(Entry(nd)) is not None or shape is None:
                    continue
                domain = input_domain(users.get(nd, []), lambda n: users.get(n, []), shape_at)
                dtype = ctx.input_dtypes.get(nd.name) or ctx.dtype(Entry(nd)) or "float32"
                v = draw(rng, tuple(shape), dtype, domain)
                out[nd.name] = mx.nd.array(v, dtype=v.dtype)      # made once, bound as it is
            ctx.memo[key] = out
        return ctx.memo[key]

    def _activations(self, entries: List[Entry], p: int) -> Dict[Entry, Any]:
        """The values of ``entries`` at probe ``p``, computed by MXNet from the graph on the data
        inputs of ``_data`` (None where it cannot run the graph there).  Kept for later rule
        applications: a rewrite keeps every value it does not replace."""
        ctx = self.ctx
        cache = ctx.memo.setdefault(("selfcheck-activations", p), {})
        missing = [e for e in entries if e not in cache]
        if missing:
            every = self._value_plan(missing, p)
            if every is None:        # over the budget: the candidates read drawn inputs here
                return {e: cache.get(e) for e in entries}
            if every:                # a small probe: every value at once, for every later rule too
                missing = _unique(missing + [Entry(nd, k) for nd in ctx.graph.nodes if not nd.is_variable
                                             for k in range(nd.num_outputs) if Entry(nd, k) not in cache])
            got = self._evaluate(missing, p)
            cache = ctx.memo.setdefault(("selfcheck-activations", p), {})     # (dropped by the plan?)
            for e in missing:
                cache[e] = None if got is None else got[e]
        return {e: cache[e] for e in entries}

    def _value_plan(self, missing: List[Entry], p: int) -> Optional[bool]:
        """How the graph's values at probe ``p`` are computed within the memory budget: True, every value
        at once, kept for later rules (a small probe, where it fits); False, ``missing`` alone; None, not
        at all (one run of the graph there would not fit: the candidates read drawn inputs, a note says so)."""
        from .memory import fmt_bytes, nbytes

        ctx, budget = self.ctx, self.budget
        est = self._graph_estimate(p)
        run = est.run()
        want = sum(est.values.get(e, nbytes(ctx._lookup(e, p, 0), ctx.dtype(e))) for e in missing)
        small = p >= len(ctx.probes)
        budget.estimates.setdefault("self-check", {})["one run of the graph at %s" % _fmt(ctx.probe_shapes(p))] = run
        for attempt in range(2):
            held = self._held()
            if small and budget.allows(held + run + est.all_values):
                return True
            if budget.allows(held + run + want):
                if small:
                    budget.note("self-check: the graph's values at input shapes %s computed for each rule, not kept "
                                "for the next (all of them take about %s)" % (_fmt(ctx.probe_shapes(p)),
                                                                             fmt_bytes(est.all_values)))
                return False
            if attempt == 0 and held:
                self._drop_kept()       # the values kept at other probes go first
        budget.note("self-check: the graph's own values at input shapes %s not computed (one run of the graph there "
                    "needs about %s, over the memory budget of %s): the rewrites checked there read drawn inputs"
                    % (_fmt(ctx.probe_shapes(p)), fmt_bytes(run + want), fmt_bytes(budget.limit or 0)))
        return None

    def _telling(self, e: Entry, value: Any, p: int) -> bool:
        """``_telling`` of the graph's value of ``e`` at probe ``p``, decided once."""
        memo = self.ctx.memo.setdefault(("selfcheck-telling", p), {})
        if e not in memo:
            memo[e] = _telling(value.asnumpy() if hasattr(value, "asnumpy") else value)
        return memo[e]

    def committed(self, replaced: Dict[Entry, Entry]) -> None:
        """A batch of rewrites was committed: each new value is the value it replaces (checked so),
        so the values kept for the old ones serve the new ones too (no new run of the graph)."""
        for key, cache in self.ctx.memo.items():
            if isinstance(key, tuple) and key and key[0] == "selfcheck-activations":
                for old, new in replaced.items():
                    if new not in cache and cache.get(old) is not None:
                        cache[new] = cache[old]

    def _shape_values(self, entries: List[Entry], p: int) -> Dict[Entry, Any]:
        """The values of ``entries`` — computed from shapes and parameters alone (a causal mask, anchors
        laid over a feature map) — at probe ``p``, kept for later rules; None where MXNet cannot."""
        cache = self.ctx.memo.setdefault(("selfcheck-shape-values", p), {})
        missing = [e for e in entries if e not in cache]
        if missing:
            got = self._evaluate(missing, p, shapes_only=True)
            for e in missing:
                cache[e] = None if got is None else got[e]
        return {e: cache[e] for e in entries}

    def _evaluate(self, entries: List[Entry], p: int, shapes_only: bool = False) -> Optional[Dict[Entry, Any]]:
        """The values of ``entries`` computed by MXNet from the graph at probe ``p``, on the data inputs
        of ``_data``: one run of the graph for every value the candidates of a rule read.  With
        ``shapes_only`` (values computed from shapes and parameters alone): every input that an op reads
        only for its shape (``SHAPE_ONLY``) is fed zeros of that shape instead, so that nothing before
        it runs (anchors over a feature map without the backbone that computes it)."""
        import mxnet as mx

        from ..native.env import subgraph_backend

        ctx = self.ctx
        data = self._data(p) if not shapes_only else {}
        graph = ctx.graph
        graph.compact()
        spec = graph.to_json()
        spec["heads"] = [[int(e.node.pos), e.index, 0] for e in entries]
        zeros: Dict[str, Any] = {}
        if shapes_only:
            cuts = [(i, k, e) for i, nd in enumerate(graph.nodes) for k, e in enumerate(nd.inputs)
                    if (nd.op, k) in SHAPE_ONLY and not e.node.is_variable]
            n = len(cuts)
            front = []
            for j, (_, _, e) in enumerate(cuts):
                shape = ctx._lookup(e, p, 0)
                if shape is None:
                    return None
                front.append({"op": "null", "name": "__selfcheck_shape_%d" % j, "inputs": []})
                zeros["__selfcheck_shape_%d" % j] = mx.nd.zeros(shape, dtype=ctx.dtype(e) or "float32")
            for jn in spec["nodes"]:
                jn["inputs"] = [[r[0] + n, r[1], r[2]] for r in jn["inputs"]]
            for j, (i, k, _) in enumerate(cuts):
                spec["nodes"][i]["inputs"][k] = [j, 0, 0]
            spec["nodes"] = front + spec["nodes"]
            spec["arg_nodes"] = list(range(n)) + [a + n for a in spec["arg_nodes"]]
            spec["node_row_ptr"] = list(range(n)) + [r + n for r in spec["node_row_ptr"]]
            spec["heads"] = [[h[0] + n, h[1], h[2]] for h in spec["heads"]]
        try:
            sym = mx.sym.load_json(json.dumps(spec))
            by_name = {nd.name: nd for nd in graph.variables()}
            feed = {}
            for name in sym.list_arguments() + sym.list_auxiliary_states():
                v = zeros[name] if name in zeros else ctx.array(Entry(by_name[name]))
                if v is None:
                    v = data.get(name)
                if v is None and shapes_only:       # a data input read for more than its shape: not computable so
                    return None
                if v is None:
                    return None
                feed[name] = v
            if misread_nodes(sym, feed):       # MXNet would run a node past its buffers here
                return None
            args, aux = _arrays(sym, feed, _written(sym.tojson()))
            with subgraph_backend(False):
                exe = sym.bind(mx.cpu(), args, aux_states=aux, grad_req="null")
            outs = exe.forward(is_train=False)
            for o in outs:      # kept as NDArrays: bound as they are, no copy to NumPy and back
                o.wait_to_read()
            del exe             # its storage goes now: only the values kept stay
        except Exception:       # MXNet cannot run the graph here: the candidates' inputs are drawn
            return None
        return dict(zip(entries, outs))

    # -- running -----------------------------------------------------------------------
    def _run_group(self, items: List[_Prepared], p: int):
        """[(candidate index, reason | None | _UNCHECKED, rel)] for ``items`` at probe ``p``."""
        try:
            return self._run(items)
        except Exception as e:      # some candidate's graph fails: find which
            if len(items) > 1:
                half = len(items) // 2
                return self._run_group(items[:half], p) + self._run_group(items[half:], p)
            it = items[0]
            try:
                self._run_one_side(it, "old")
            except Exception:       # the matched subgraph alone does not run here: nothing to compare with
                if p == 0 and p is not None:
                    self.stats.note_unchecked("the matched subgraph does not run alone")
                return [(it.index, _UNCHECKED, 0.0)]
            return [(it.index, "the replacement fails to run: %s" % _first_line(str(e)), 0.0)]

    def _run_one_side(self, it: _Prepared, which: str) -> None:
        import mxnet as mx

        from ..native.env import subgraph_backend

        side = it.old if which == "old" else it.new
        jnodes: List[dict] = []
        rows: List[int] = []
        heads, names = _emit(side, "s", jnodes, rows)
        row_ptr = [0]
        for r in rows:
            row_ptr.append(row_ptr[-1] + r)
        text = json.dumps({"nodes": jnodes, "arg_nodes": [], "node_row_ptr": row_ptr,
                           "heads": heads, "attrs": {"mxnet_version": ["int", 10901]}})
        sym = mx.sym.load_json(text)
        args, aux = _arrays(sym, {n: it.values[e] for n, e in names.items()}, _written(text))
        with subgraph_backend(False):
            exe = sym.bind(mx.cpu(), args, aux_states=aux, grad_req="null")
        for o in exe.forward(is_train=self.ctx.mode == "training"):
            o.wait_to_read()

    def _run(self, items: List[_Prepared]):
        import mxnet as mx

        from ..native.env import subgraph_backend

        from ..precision.policy import tolerance

        training = self.ctx.mode == "training"
        # reduced precision: the bfloat16 tolerance against the float32 subgraph (fusion/precision/policy.py)
        tol = max(TOLERANCE, tolerance(getattr(self.ctx, "precision", "float32")))
        text, layout = _build(items)
        sym = mx.sym.load_json(text)
        feed: Dict[str, np.ndarray] = {}
        for it, (_, v_old, v_new) in zip(items, layout):
            for names in (v_old, v_new):
                for n, e in names.items():
                    feed[n] = it.values[e]
        bad = misread_nodes(sym, feed)
        if bad:     # MXNet would run them past their buffers: report without running anything
            out = []
            for it in items:
                mine = [(n, op) for n, op in bad
                        if n.startswith("c%d" % it.index + "n_") or n.startswith("c%d" % it.index + "o_")]
                if any(n.startswith("c%do_" % it.index) for n, _ in mine):
                    out.append((it.index, _UNCHECKED, 0.0))
                elif any(op != "where" for _, op in mine):
                    out.append((it.index, "the replacement reshapes a tensor to a shape of another size", 0.0))
                elif mine:
                    out.append((it.index, "the replacement's where reads a condition of another shape than "
                                          "its operands (MXNet reads it elsewhere)", 0.0))
            if out:
                return out + (self._run([it for it in items if it.index not in {o[0] for o in out}])
                              if len(out) < len(items) else [])
        args, aux = _arrays(sym, feed, _written(text))
        grad_req, args_grad = "null", None
        if training:
            grad_req = {n: ("write" if np.issubdtype(np.dtype(feed[n].dtype), np.floating) else "null") for n in args}
            args_grad = {n: mx.nd.zeros(a.shape, dtype=a.dtype) for n, a in args.items() if grad_req[n] == "write"}
        with subgraph_backend(False):
            exe = sym.bind(mx.cpu(), args, args_grad=args_grad, aux_states=aux, grad_req=grad_req)
        outs = exe.forward(is_train=training)
        results = []
        head = 0
        rng = np.random.default_rng(self.seed + 104729)
        out_grads: List[Any] = []
        for it, (n_out, v_old, v_new) in zip(items, layout):
            reason, worst = None, 0.0
            for k in range(n_out):
                a, b = outs[head + k].asnumpy(), outs[head + n_out + k].asnumpy()
                rel, why = compare(a, b)
                if why is None and rel > tol:
                    why = "output differs by %.3g (relative to its scale; tolerance %g)" % (rel, tol)
                if why is not None and reason is None:
                    reason = ("output %d: %s" % (k, why)) if n_out > 1 else why
                worst = max(worst, rel if np.isfinite(rel) else worst)
            if training:
                for k in range(n_out):
                    g = rng.standard_normal(outs[head + k].shape).astype(outs[head + k].dtype)
                    out_grads.append(g)
                out_grads.extend(out_grads[-n_out:])
            results.append([it.index, reason, worst])
            head += 2 * n_out
        if training:
            exe.backward([mx.nd.array(g, dtype=g.dtype) for g in out_grads])
            grads = args_grad
            for r, it, (_, v_old, v_new) in zip(results, items, layout):
                if r[1] is not None:
                    continue
                new_by_entry = {e: n for n, e in v_new.items()}
                for n, e in v_old.items():
                    g_old = grads.get(n)
                    if g_old is None:
                        continue
                    g_old = g_old.asnumpy()
                    m = new_by_entry.get(e)
                    if m is None or grads.get(m) is None:
                        # a value computed from shapes alone (positions, a causal mask) trains nothing
                        if np.any(g_old != 0) and (e.node.is_variable or self.reads_values(e.node)):
                            r[1] = "the gradient of '%s' is lost (it would stop training)" % e.node.name
                            break
                        continue
                    rel, why = compare(g_old, grads[m].asnumpy())
                    if why is None and rel > GRAD_TOLERANCE:
                        why = "differs by %.3g (relative; tolerance %g)" % (rel, GRAD_TOLERANCE)
                    if why is not None:
                        r[1] = "gradient of '%s': %s" % (e.node.name, why)
                        break
                    r[2] = max(r[2], rel)
        return [tuple(r) for r in results]


_UNCHECKED = "unchecked"


def misread_nodes(sym: Any, feed: Dict[str, Any]) -> List[Tuple[str, str]]:
    """(name, op) of the nodes MXNet 1.9.1 would not run as their inferred shapes say (``facts.misread``:
    a reshape to another size copies past its buffer, a ``where`` condition of another shape is
    read elsewhere or divides by zero)."""
    from .facts import SIZE_KEEPING, misread

    conf = json.loads(sym.tojson())
    if not any(n["op"] in SIZE_KEEPING or n["op"] == "where" for n in conf["nodes"]):
        return []
    internals = sym.get_internals()
    try:
        _, shapes, _ = internals.infer_shape_partial(**{k: tuple(v.shape) for k, v in feed.items()})
    except Exception:       # shapes that do not fit at all: MXNet refuses at bind, nothing runs
        return []
    by_name = dict(zip(internals.list_outputs(), shapes))
    nodes = conf["nodes"]

    def shape_of(entry):
        src = nodes[entry[0]]
        if src["op"] == "null":
            name = src["name"]
        elif entry[1] > 0:
            name = "%s_output%d" % (src["name"], entry[1])
        else:
            name = "%s_output" % src["name"]
        got = by_name.get(name)
        return tuple(got) if got else None

    bad = []
    for n in nodes:
        if (n["op"] in SIZE_KEEPING or n["op"] == "where") and n["inputs"]:
            out = by_name.get("%s_output" % n["name"])
            if misread(n["op"], [shape_of(i) for i in n["inputs"]], tuple(out) if out else None):
                bad.append((n["name"], n["op"]))
    return bad


def _signature(c: Candidate, ctx: Any) -> tuple:
    """What two rewrites must share to be the same check but for parameter values: ops, attributes,
    wiring, and the shapes/dtypes of what they read."""
    ext: Dict[Entry, int] = {}

    def wiring(nodes: Sequence[Node]) -> tuple:
        local = {id(n): k for k, n in enumerate(nodes)}
        out = []
        for n in nodes:
            ins = []
            for e in n.inputs:
                if id(e.node) in local:
                    ins.append((local[id(e.node)], e.index))
                else:
                    if e not in ext:
                        ext[e] = len(ext)
                    ins.append(("x", ext[e]))
            out.append((n.op, tuple(sorted(n.attrs.to_json().items())), tuple(ins)))
        return tuple(out)

    old = wiring(sorted(c.match.nodes, key=lambda n: n.pos))
    new = wiring([n for n in c.created if not n.is_variable])
    facts = tuple((ctx.shape(e) if not e.node.is_variable or ctx.value(e) is None else ctx.value(e).shape,
                   e.node.is_variable and ctx.value(e) is not None) for e in ext)
    return old, new, facts


# Ops that write some of their inputs when run: BatchNorm sets γ to 1 under fix_gamma (oneDNN's
# kernel, in place) and updates its moving statistics in training.
_WRITES_INPUTS = frozenset({"BatchNorm"})


def _written(text: str) -> set:
    """Names of the variables that an op in the Symbol JSON ``text`` may write."""
    nodes = json.loads(text)["nodes"]
    return {nodes[i[0]]["name"] for nd in nodes if nd["op"] in _WRITES_INPUTS for i in nd["inputs"]
            if nodes[i[0]]["op"] == "null"}


def _arrays(sym: Any, feed: Dict[str, Any], written: Optional[set] = None):
    """NDArrays to bind: parameters as they are (bound read-only), copied where an op may write
    them (``_WRITES_INPUTS``: the caller's arrays must not change), NumPy values copied in."""
    import mxnet as mx

    written = written or set()

    def nd(n):
        v = feed[n]
        if isinstance(v, mx.nd.NDArray):
            return v.copy() if n in written else v
        return mx.nd.array(v, dtype=v.dtype)

    return ({n: nd(n) for n in sym.list_arguments()}, {n: nd(n) for n in sym.list_auxiliary_states()})


#: The shrunk sizes tried for a rewrite checked on its own (after ALONE_MIN and on by rank): d·a/b
_FRACTIONS = ((1, 32), (1, 16), (1, 12), (1, 8), (1, 6), (1, 4), (1, 3), (1, 2), (2, 3), (3, 4))

#: Ops that slide a window over the axes past the channel axis (NCHW)
_WINDOWED = frozenset({"Convolution", "Pooling", "Deconvolution"})


def _taps_read(nodes: Sequence[Node], shapes: Dict[Entry, tuple]) -> set:
    """(node, tap) of every tap of the windows of ``nodes`` (``_WINDOWED``) that some output reads — a tap
    reads a value of the input, not only padding — at ``shapes``.  A tap is a tuple of kernel positions,
    one per spatial axis; a global pooling or a layout other than channel-first has none listed."""
    out = set()
    for nd in nodes:
        a = nd.attrs
        if nd.op == "Pooling" and a.get("global_pool"):
            continue
        layout = a.get("layout")
        kernel = a.get("kernel") or ()
        if not nd.inputs or not kernel or (layout is not None and layout not in ("NCW", "NCHW", "NCDHW")):
            continue
        x, y = shapes.get(nd.inputs[0]), shapes.get(Entry(nd, 0))
        n = len(kernel)
        if x is None or y is None or len(x) != n + 2 or len(y) != n + 2:
            continue

        def each(name: str, default: int) -> tuple:
            v = a.get(name) or ()
            return tuple(v) if len(v) == n else (default,) * n

        stride, pad, dilate = each("stride", 1), each("pad", 0), each("dilate", 1)
        per_axis = []
        for ax in range(n):
            size_in, size_out = x[2 + ax], y[2 + ax]
            # Convolution/Pooling: output o reads input o·s − p + j·d; Deconvolution: input i writes output
            # i·s − p + j·d (the same relation, the roles swapped)
            moving, fixed = (size_in, size_out) if nd.op == "Deconvolution" else (size_out, size_in)
            read = []
            for j in range(kernel[ax]):
                lo, hi = pad[ax] - j * dilate[ax], fixed - 1 + pad[ax] - j * dilate[ax]
                first, last = max(0, -(-lo // stride[ax])), min(moving - 1, hi // stride[ax])
                if first <= last:
                    read.append(j)
            per_axis.append(read)
        taps = [()]
        for read in per_axis:
            taps = [t + (j,) for t in taps for j in read]
        out |= {(id(nd), t) for t in taps}
    return out


def _unique(entries: Sequence[Entry]) -> List[Entry]:
    seen, out = set(), []
    for e in entries:
        if e not in seen:
            seen.add(e)
            out.append(e)
    return out


def _fmt(probe: Dict[str, tuple]) -> str:
    return ", ".join("%s=%s" % (k, ",".join(map(str, v))) for k, v in probe.items())


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in lines:
        if "Check failed" in ln or "Error" in ln:
            return ln[:300]
    return (lines[-1] if lines else text)[:300]


def _related(e: Entry, others: Sequence[Entry], limit: int = 200) -> bool:
    """Whether ``e`` is computed from one of ``others`` or one of them from ``e`` (within ``limit`` nodes)."""
    def reaches(a: Entry, b: Entry) -> bool:
        seen, stack = set(), [a.node]
        while stack and len(seen) < limit:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            for x in n.inputs:
                if x == b:
                    return True
                stack.append(x.node)
        return False
    return any(o != e and (reaches(e, o) or reaches(o, e)) for o in others)


def _telling(a: np.ndarray) -> bool:
    """Whether a value can tell a wrong rewrite from a right one: finite, and not one constant."""
    from ..precision.policy import from_bf16, is_bf16

    if a.size == 0:
        return False
    if is_bf16(a.dtype):
        a = from_bf16(a)
    if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all():
        return False
    return a.size == 1 or not bool((a == a.flat[0]).all())


_NUMBER = re.compile(r"-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?")


#: In an attribute holding a JSON program (fused_region's: its README in cuda_kernels/fused_region/), the
#: keys whose integers are places in the program — a value's index ("in", a post step's "add"/"mul"
#: operand), a parameter's slot, the outputs — or its version and parameter shapes, not sizes.
REFERENCE_KEYS = frozenset({"in", "add", "mul", "weight", "bias", "gamma", "beta", "mean", "var", "outputs",
                            "version", "params"})


def _integers(attrs: Dict[str, str]) -> set:
    """The integers an op's attributes (as MXNet writes them) name; decimals and exponents skipped, and in
    a JSON program those under ``REFERENCE_KEYS`` (indices, not sizes)."""
    out = set()
    for v in attrs.values():
        text = str(v)
        if text[:1] in "{[":
            try:
                out |= _json_integers(json.loads(text))
                continue
            except ValueError:      # not JSON: read as text
                pass
        for tok in _NUMBER.findall(text):
            if "." not in tok and "e" not in tok.lower():
                out.add(abs(int(tok)))
    return out


def _json_integers(value: Any) -> set:
    if isinstance(value, bool) or value is None:
        return set()
    if isinstance(value, int):
        return {abs(value)}
    if isinstance(value, list):
        return set().union(*(_json_integers(v) for v in value)) if value else set()
    if isinstance(value, dict):
        return set().union(*(_json_integers(v) for k, v in value.items() if k not in REFERENCE_KEYS)) \
            if value else set()
    if isinstance(value, str):
        return _integers({"": value})
    return set()        # floats: not sizes


def size_free(c: Candidate, ctx: Any, smallest: int) -> bool:
    """Whether the replacement names no size that the small probes could stand below.

    A rewrite that bakes a size (a reshape to the user's 480×480, 64 rows of a gather) may be right
    at every size under it and wrong above: checked at the small probes alone it could pass.  So a
    rewrite is checked there alone only when every integer of at least ``smallest`` (the smallest
    size the small probes shrank) in its new ops' attributes and its new parameters' shapes is one
    the matched ops' attributes or the parameters they read already have (a weight's channel count,
    or the product or quotient of two such dimensions)."""
    known: set = set()
    dims: set = set()
    for nd in c.match.nodes:
        known |= _integers(nd.attrs.to_json())
        for e in nd.inputs:
            if e.node.is_variable:
                s = ctx._param_shape(e.node.name)
                if s:
                    dims |= {int(d) for d in s}
    known |= dims
    known |= {a * b for a in dims for b in dims} | {a // b for a in dims for b in dims if b and a % b == 0}
    for nd in c.created + c.new_extra:
        if nd.is_variable:
            s = ctx._param_shape(nd.name)
            found = {int(d) for d in s} if s else set()
        else:
            found = _integers(nd.attrs.to_json())
        if any(v >= smallest and v not in known for v in found):
            return False
    return True
