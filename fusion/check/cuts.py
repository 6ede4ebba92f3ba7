"""Verifying a model piecewise: cut where its outputs stop depending continuously on the values
before them — the inputs of its NMS, of its sorting ops and of its comparisons.

Non-maximum suppression keeps the best-scored box of each overlapping group and drops the rest.
Two scores a rounding apart can change which box survives, and a box that survives an earlier
NMS (Faster R-CNN's proposals) decides what every later op computes: a fused model whose every
value before an NMS agrees with the original's to float rounding can still end in other
detections — on a random-weight network, whose scores are all near-ties, it does (Faster
R-CNN's fused dense layers of its box head move its scores by 1e-7, and 1 in 20 detections
changes).  Compared as a whole, such a model looks wrong; it is not.  The same holds for

* a sorting op (``topk``, ``sort``, ``argsort``) among near-ties: CenterNet's decoder takes the
  ``topk`` of its heat map, whose random-weight values tie to the last bit, and gathers each
  detection's box by the indices it returns — the same detections in another order, with boxes
  that no row-set comparison can pair up (they come out of a chain of index arithmetic);
* a step: a comparison (``broadcast_equal(max_pool(heat), heat)``, CenterNet's peak picking),
  ``round``/``floor``/``ceil``/``sign``, ``argmax``: a rounding's difference of an input flips
  its output from 0 to 1.

So where the whole comparison fails and the original has such nodes that the fused graph still
has by name and op (an NMS may be the library's ``fused_box_nms`` there), the fused graph is also
compared **piecewise**: each such input of the fused graph (an NMS's or a sort's rows, every
computed input of a step) is cut off and fed the original's value at that point, and

* each cut input the fused graph computes (from the original's values at the cuts before it) is
  compared with the original's — the segments before the cuts (an NMS input field by field:
  scores, boxes, class ids);
* its outputs (from the original's values at the cuts) are compared with the original's — the
  cut ops themselves and everything after them, compared as the whole comparison compares them
  (rows as sets where they come out of sorting).

Every op of the fused graph is then checked against the original on the original's own values;
a wrong rewrite anywhere still fails (a weight off by 1 % moves the cut inputs by about that),
only the choice among near-ties no longer counts.

**Float64** (``rounding_check``): where a compared value still differs by more than the
tolerance, the original is run once more in float64 (the same cuts, fed the original's values
there) for the values that differ, and each is judged by how far the original's own float32
result and the fused model's are from it.  A fused value no farther from the float64 result than
``ROUNDING_FACTOR`` times the original's own float32 error is the original's rounding, not a
wrong rewrite: a sigmoid read at its steepest after convolutions whose terms reach ±2000
(CenterNet's heat map on random weights) moves by 2e-4 when the same sums are added in another
order, in the original as much as in the fused model.  Where MXNet cannot run the values in
float64 (an op without a float64 kernel, a cast to float32 met by a float64 operand), the
comparison stands as it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..ir.graph import Entry, Graph, Node, upstream
from ..ir.names import gives_back
from .rowsets import NMS, SORTS, align_rows

#: the NMS ops a fused graph may hold in place of the original's (by the original node's name)
NMS_LIKE = NMS | {"fused_box_nms"}
#: ops whose output steps where an input crosses a value: cut at every computed input
STEPS = frozenset({
    "broadcast_equal", "broadcast_not_equal", "broadcast_greater", "broadcast_greater_equal", "broadcast_lesser",
    "broadcast_lesser_equal", "_equal", "_not_equal", "_greater", "_greater_equal", "_lesser", "_lesser_equal",
    "_equal_scalar", "_not_equal_scalar", "_greater_scalar", "_greater_equal_scalar", "_lesser_scalar",
    "_lesser_equal_scalar", "_npi_equal", "_npi_not_equal", "_npi_greater", "_npi_greater_equal", "_npi_less",
    "_npi_less_equal", "_npi_equal_scalar", "_npi_not_equal_scalar", "_npi_greater_scalar",
    "_npi_greater_equal_scalar", "_npi_less_scalar", "_npi_less_equal_scalar",
    "round", "rint", "ceil", "floor", "trunc", "fix", "sign", "argmax", "argmin", "argmax_channel"})
CUT_PREFIX = "__verify_cut_"
#: a fused value within this many times the original's own float32 error (against float64) is rounding
ROUNDING_FACTOR = 2.0


#: ops where a rounding's difference of an input can change the output by a whole step
DISCONTINUOUS = NMS | SORTS | STEPS


@dataclass(frozen=True)
class Cut:
    """Where the fused graph is cut: inputs ``inputs`` (their indices) of its node ``node``, each fed the
    original's value at ``at`` (the entry of the original graph holding it).  ``kind``: "nms", "sort",
    "step" (the node is in both graphs) or "fused" (a fused op of the fused graph in place of original
    ops among which is a step or a sort)."""

    node: str
    kind: str
    inputs: Tuple[int, ...]
    at: Tuple[Tuple[str, int], ...]          # (node name, output index) in the original, per input
    members: Tuple[str, ...] = ()            # the original's nodes that read those values where the fused
                                             # graph's node does (for kind "fused": the ops it stands for)


def cut_points(g0: Graph, g1: Graph) -> List[Cut]:
    """Where to cut the fused graph ``g1`` against the original ``g0``: each of the original's NMS, sorting
    and step nodes that the fused graph holds by the same name and op (an NMS also as ``fused_box_nms``)
    — an NMS's and a sort's input 0, each input of a step that both graphs compute (not a variable) —
    and each fused op named after an original node whose original ops (back to the fused op's inputs,
    found in the original by name) hold a step or a sort: every computed input of the fused op."""
    by_name0 = {nd.name: nd for nd in g0.nodes}
    out: List[Cut] = []
    for other in g1.nodes:
        nd = by_name0.get(other.name)
        if nd is None or not nd.inputs or not other.inputs:
            continue
        if nd.op in NMS and other.op in NMS_LIKE or nd.op in SORTS and other.op == nd.op:
            out.append(Cut(nd.name, "nms" if nd.op in NMS else "sort", (0,),
                           ((nd.inputs[0].node.name, nd.inputs[0].index),)))
        elif nd.op in STEPS and other.op == nd.op and len(other.inputs) == len(nd.inputs):
            ins = tuple(k for k, (a, b) in enumerate(zip(nd.inputs, other.inputs))
                        if a.node.op != "null" and b.node.op != "null")
            if ins:
                out.append(Cut(nd.name, "step", ins, tuple((nd.inputs[k].node.name, nd.inputs[k].index) for k in ins)))
        elif other.op != nd.op:
            cut = _fused_cut(nd, other, by_name0)
            if cut is not None:
                out.append(cut)
    return out


def _fused_cut(nd: Node, other: Node, by_name0: Mapping[str, Node]) -> Optional[Cut]:
    """The cut before fused op ``other`` (named after the original's ``nd``) where the original ops it
    stands for hold a step or a sort; None where they do not, or its inputs are not found in the original."""
    ins, at, stops = [], [], []
    for k, e in enumerate(other.inputs):
        if e.node.op == "null":
            continue
        name, index = gives_back(e)         # a region's outputs: the original's values they give back
        src = by_name0.get(name)
        if src is None or src.op == "null" or index >= src.num_outputs:
            return None
        ins.append(k)
        at.append((src.name, index))
        stops.append(src)
    if not ins:
        return None
    stood_for = [n for n in upstream([nd], stops) if n.op != "null"]
    if not any(n.op in DISCONTINUOUS for n in stood_for):
        return None
    return Cut(nd.name, "fused", tuple(ins), tuple(at), tuple(n.name for n in stood_for))


def _cut(g: Graph, cuts: Sequence[Cut]) -> Tuple[List[str], List[Entry]]:
    """Feed each cut input of the fused graph ``g`` from a new variable (``g`` changed in place): (the
    variables' names, the entries ``g`` computed there), in the order of ``cuts``."""
    by_name = {nd.name: nd for nd in g.nodes}
    names: List[str] = []
    computed: List[Entry] = []
    for c in cuts:
        nd = by_name[c.node]
        for k in c.inputs:
            computed.append(nd.inputs[k])
            var = Node("null", g.unique_name("%s%s_%d" % (CUT_PREFIX, c.node, k)))
            g.nodes.insert(0, var)
            nd.inputs[k] = Entry(var)
            names.append(var.name)
    return names, computed


def _cut_original(g: Graph, cuts: Sequence[Cut]) -> Tuple[List[str], List[Entry]]:
    """The original graph ``g`` cut where the fused graph is (``g`` changed in place): each cut value, where
    the cut's nodes (``Cut.members``, or its node) read it, read from a new variable instead.  (The
    variables' names, the entries ``g`` computes there), in the order of the cut inputs."""
    by_name = {nd.name: nd for nd in g.nodes}
    names: List[str] = []
    computed: List[Entry] = []
    for c in cuts:
        members = [by_name[m] for m in (c.members or (c.node,)) if m in by_name]
        for name, index in c.at:
            src = by_name[name]
            computed.append(Entry(src, index))
            var = Node("null", g.unique_name("%s%s_%d" % (CUT_PREFIX, name, index)))
            g.nodes.insert(0, var)
            for nd in members:
                nd.inputs = [Entry(var) if e.node is src and e.index == index else e for e in nd.inputs]
            names.append(var.name)
    return names, computed


def follows_a_step(entry: Entry) -> Optional[str]:
    """The first step, sort or NMS op (as "op 'name'") between the graph's variables and ``entry`` that reads
    a computed value (one fed only variables — the values at the cuts — steps alike in every run), or None."""
    for n in upstream([entry.node]):
        if n.op in DISCONTINUOUS and any(e.node.op != "null" for e in n.inputs):
            return "%s '%s'" % (n.op, n.name)
    return None


def piecewise(original: Any, arg0: Mapping[str, Any], aux0: Mapping[str, Any],
              fused: Any, arg1: Mapping[str, Any], aux1: Mapping[str, Any],
              feed: Mapping[str, np.ndarray], names: Sequence[str], layouts, run, compare
              ) -> Optional[Tuple[Any, Any, List[str], List[Tuple[str, str]]]]:
    """(outputs compared, cut inputs compared field by field, the cut nodes' names, (cut, field) of each
    compared field) on one verification input, or None where the graphs share no node to cut at.
    ``run`` and ``compare`` are verify's."""
    got = piecewise_many(original, arg0, aux0, fused, arg1, aux1, [feed], names, layouts,
                         lambda sym, arg, aux, feeds: [run(sym, arg, aux, f) for f in feeds], compare)
    return None if got is None else got[0]


def _fields(cut: Cut, nd: Optional[Node], k: int, value: np.ndarray) -> List[Tuple[str, Any]]:
    """(name, columns) of what is compared of input ``k`` of the cut at ``cut`` (``nd``: the original's node
    of that name)."""
    if cut.kind == "nms" and nd is not None:
        return nms_fields(nd, value.shape[-1] if value.ndim else 0)
    if cut.kind == "sort":
        return [("values", slice(None))]
    return [("input %d" % k, slice(None))]


def piecewise_many(original: Any, arg0: Mapping[str, Any], aux0: Mapping[str, Any],
                   fused: Any, arg1: Mapping[str, Any], aux1: Mapping[str, Any],
                   feeds: Sequence[Mapping[str, np.ndarray]], names: Sequence[str], layouts, run_many, compare,
                   run64: Any = None, rtol: float = 1e-4) -> Optional[List[Tuple[Any, ...]]]:
    """``piecewise`` on each of ``feeds``, each cut graph bound once for all of them (``run_many``:
    verify's; a first run, oneDNN's primitives made and weights reordered, costs several later ones).
    With ``run64`` (verify's float64 run), each draw's tuple has a fifth item: ``rounding_check``'s
    judgement of the values that differ by more than ``rtol`` (the same list in every draw)."""
    g0, g1 = Graph.from_symbol(original), Graph.from_symbol(fused)
    cuts = cut_points(g0, g1)
    if not cuts:
        return None
    by_name0 = {nd.name: nd for nd in g0.nodes}
    inputs_cut = [(c, k, at) for c in cuts for k, at in zip(c.inputs, c.at)]
    g0.heads = list(g0.heads) + [Entry(by_name0[name], index) for _, _, (name, index) in inputs_cut]
    vals0 = run_many(g0.to_symbol(), arg0, aux0, feeds)

    cut_vars, computed = _cut(g1, cuts)
    g1.heads = list(g1.heads) + computed
    sym1 = g1.to_symbol()
    args1 = set(sym1.list_arguments())
    feeds1 = []
    for feed, vals in zip(feeds, vals0):
        feed1 = {k: v for k, v in feed.items() if k in args1}
        feed1.update(zip(cut_vars, vals[len(names):]))
        feeds1.append(feed1)
    vals1 = run_many(sym1, arg1, aux1, feeds1)
    results = []
    # per draw: the original's outputs and cut fields, the fused model's (rows aligned)
    values: List[Tuple[List[np.ndarray], List[np.ndarray], List[np.ndarray], List[np.ndarray]]] = []
    where: List[Tuple[int, Any]] = []          # (index of the cut input, columns) of each field
    for v0, v1 in zip(vals0, vals1):
        out0, at_cuts = v0[:len(names)], v0[len(names):]
        out1, inputs1 = v1[:len(names)], v1[len(names):]
        aligned, _ = align_rows(out0, out1, layouts)
        refs, gots, fields, where = [], [], [], []
        for j, ((c, k, _), ref, got) in enumerate(zip(inputs_cut, at_cuts, inputs1)):
            for field, cols in _fields(c, by_name0.get(c.node), k, ref):
                refs.append(ref[..., cols])
                gots.append(got[..., cols])
                fields.append((c.node, field))
                where.append((j, cols))
        labels = ["the %s of %s's input" % (f, c) if f in ("scores", "boxes", "class ids", "other columns", "rows")
                  else "the %s of '%s'" % (f, c) for c, f in fields]
        results.append((compare(out0, aligned, names), compare(refs, gots, labels), [c.node for c in cuts], fields))
        values.append((out0, aligned, refs, gots))
    if run64 is None:
        return results
    bad_out = sorted({i for r in results for i, (_, _, rel) in enumerate(r[0].per_output) if not rel <= rtol})
    bad_cut = sorted({j for r in results for j, (_, _, rel) in enumerate(r[1].per_output) if not rel <= rtol})
    judged: List[Dict[str, Any]] = []
    if bad_out or bad_cut:
        g = Graph.from_symbol(original)
        cut_vars0, computed0 = _cut_original(g, cuts)
        wanted_cuts = sorted({where[j][0] for j in bad_cut})
        heads = [g.heads[i] for i in bad_out] + [computed0[j] for j in wanted_cuts]
        feeds64 = []
        for feed, vals in zip(feeds, vals0):
            f = dict(feed)
            f.update(zip(cut_vars0, vals[len(names):]))
            feeds64.append(f)
        items = [_Judged("output", i, names[i], n, slice(None), {0: layouts[i]} if i in layouts else {},
                         [(v[0][i], v[1][i], r[0].per_output[i][2]) for r, v in zip(results, values)])
                 for n, i in enumerate(bad_out)]
        items += [_Judged("cut", j, "the %s of '%s'" % results[0][3][j][::-1],
                          len(bad_out) + wanted_cuts.index(where[j][0]), where[j][1], {},
                          [(v[2][j], v[3][j], r[1].per_output[j][2]) for r, v in zip(results, values)])
                  for j in bad_cut]
        judged = _judge(g, heads, items, feeds64, arg0, aux0, run64, compare)
    return [r + (judged,) for r in results]


def rounding_check(original: Any, arg0: Mapping[str, Any], aux0: Mapping[str, Any],
                   feeds: Sequence[Mapping[str, np.ndarray]], refs: Sequence[Sequence[np.ndarray]],
                   fused_outs: Sequence[Sequence[np.ndarray]], per_output: Sequence[Tuple[str, float, float]],
                   names: Sequence[str], layouts, run64, compare, rtol: float = 1e-4) -> List[Dict[str, Any]]:
    """The whole comparison's outputs that differ by more than ``rtol`` (``per_output``: its (name, abs,
    rel)), judged against the original run in float64: for each, how far the original's float32 result
    (``refs``, per draw) and the fused model's (``fused_outs``, rows aligned to ``refs``) are from it."""
    bad = [i for i, (_, _, rel) in enumerate(per_output) if not rel <= rtol]
    if not bad:
        return []
    g = Graph.from_symbol(original)
    items = [_Judged("output", i, names[i], n, slice(None), {0: layouts[i]} if i in layouts else {},
                     [(refs[d][i], fused_outs[d][i], per_output[i][2]) for d in range(len(feeds))])
             for n, i in enumerate(bad)]
    return _judge(g, [g.heads[i] for i in bad], items, feeds, arg0, aux0, run64, compare)


@dataclass(frozen=True)
class _Judged:
    """A value to judge against float64: ``head`` its place among the heads run in float64, ``cols`` the
    part of it compared, ``draws`` (the original's float32 value, the fused model's, their max rel) per draw."""

    kind: str
    index: int
    label: str
    head: int
    cols: Any
    layout: Any
    draws: Any


def _judge(g: Graph, heads: Sequence[Entry], items: Sequence[_Judged], feeds: Sequence[Mapping[str, Any]],
           arg0: Mapping[str, Any], aux0: Mapping[str, Any], run64, compare) -> List[Dict[str, Any]]:
    """Each of ``items`` judged: ``g`` run in float64 with ``heads`` (``run64``; once, where any item is
    judged), and how far the original's and the fused model's values are from it; or why not."""
    steps = [follows_a_step(h) for h in heads]
    got64 = None
    if run64 is not None and any(steps[it.head] is None for it in items):
        g.heads = list(heads)
        sym = g.to_symbol()
        args = set(sym.list_arguments())
        got64 = run64(sym, arg0, aux0, [{k: v for k, v in f.items() if k in args} for f in feeds])
    judged: List[Dict[str, Any]] = []
    for it in items:
        step = steps[it.head]
        if step is not None or got64 is None:
            why = ("%s follows %s, which the fused graph does not hold to cut at" % (it.label, step)
                   if step is not None else "MXNet cannot run %s of the original in float64" % it.label)
            judged.append({"kind": it.kind, "index": it.index, "value": None, "why": why})
            continue
        e_o = e_f = rel = 0.0
        for d, (mine, theirs, r) in enumerate(it.draws):
            exact = got64[d][it.head] if it.cols == slice(None) else got64[d][it.head][..., it.cols]
            e_o = max(e_o, _rel_to(exact, mine, it.layout, compare))
            e_f = max(e_f, _rel_to(exact, theirs, it.layout, compare))
            rel = max(rel, r)
        judged.append({"kind": it.kind, "index": it.index, "value": it.label, "max_rel": rel, "original_f32": e_o,
                       "fused": e_f})
    return judged


def _rel_to(exact: np.ndarray, value: np.ndarray, layout, compare) -> float:
    """The relative error of ``value`` against the float64 ``exact`` (rows aligned where ``layout``)."""
    value = np.asarray(value)
    if layout:
        value = align_rows([exact], [value], layout)[0][0]
    return compare([exact], [value.astype(np.float64)], ["x"]).per_output[0][2]


def within_rounding(entry: Dict[str, Any], rtol: float) -> bool:
    """Whether a judged value's fused error is the original's own float32 rounding."""
    return entry.get("value") is not None and entry["fused"] <= max(rtol, ROUNDING_FACTOR * entry["original_f32"])


def nms_fields(nms: Node, width: int) -> List[Tuple[str, Any]]:
    """(name, columns) of each field of an NMS input's rows: scores, box coordinates, class ids, the rest.

    Each is compared on its own scale: a box's coordinates (pixels, or thousands of them with random
    weights) would hide a 1 % error of the scores (at most 1) in one relative measure of the whole row."""
    score, coord = int(nms.param("score_index", 1)), int(nms.param("coord_start", 2))
    ident = int(nms.param("id_index", -1))          # -1: the rows carry no class id
    if width < 5 or not (0 <= score < width and 0 <= coord <= width - 4):
        return [("rows", slice(None))]
    fields = [("scores", [score]), ("boxes", list(range(coord, coord + 4)))]
    if 0 <= ident < width:
        fields.append(("class ids", [ident]))
    taken = {c for _, cols in fields for c in cols}
    rest = [c for c in range(width) if c not in taken]
    if rest:
        fields.append(("other columns", rest))
    return fields
