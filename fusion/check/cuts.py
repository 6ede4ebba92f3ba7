"""Verifying a detection model piecewise: cut at the inputs of its NMS, where the outputs stop
depending continuously on the values before them.

Non-maximum suppression keeps the best-scored box of each overlapping group and drops the rest.
Two scores a rounding apart can change which box survives, and a box that survives an earlier
NMS (Faster R-CNN's proposals) decides what every later op computes: a fused model whose every
value before an NMS agrees with the original's to float rounding can still end in other
detections — on a random-weight network, whose scores are all near-ties, it does (Faster
R-CNN's fused dense layers of its box head move its scores by 1e-7, and 1 in 20 detections
changes).  Compared as a whole, such a model looks wrong; it is not.

So where the whole comparison fails and the original has NMS nodes that the fused graph still
has by name (MXNet's ``_contrib_box_nms`` or the library's ``fused_box_nms``), the fused graph is
also compared **piecewise**: every NMS input of the fused graph is cut off and fed the
original's value at that point, and

* each NMS input the fused graph computes (from the original's values at the cuts before it) is
  compared with the original's — the segments before the NMS;
* its outputs (from the original's NMS inputs) are compared with the original's — the NMS itself
  and everything after it, compared as the whole comparison compares them (rows as sets where
  they come out of sorting).

Every op of the fused graph is then checked against the original on the original's own values;
a wrong rewrite anywhere still fails (a weight off by 1 % moves the NMS inputs by about that),
only the NMS's choice among near-ties no longer counts.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..ir.graph import Entry, Graph, Node
from .rowsets import NMS, align_rows

#: the NMS ops a fused graph may hold in place of the original's (by the original node's name)
NMS_LIKE = NMS | {"fused_box_nms"}
CUT_PREFIX = "__verify_cut_"


def cut_points(g0: Graph, g1: Graph) -> List[str]:
    """Names of the original's (``g0``) NMS nodes that the fused graph (``g1``) holds as an NMS of the same name."""
    fused_nms = {nd.name for nd in g1.nodes if nd.op in NMS_LIKE and nd.inputs}
    return [nd.name for nd in g0.nodes if nd.op in NMS and nd.inputs and nd.name in fused_nms]


def piecewise(original: Any, arg0: Mapping[str, Any], aux0: Mapping[str, Any],
              fused: Any, arg1: Mapping[str, Any], aux1: Mapping[str, Any],
              feed: Mapping[str, np.ndarray], names: Sequence[str], layouts, run, compare
              ) -> Optional[Tuple[Any, Any, List[str], List[Tuple[str, str]]]]:
    """(outputs compared, NMS inputs compared field by field, the cut nodes' names, (cut, field) of each
    compared NMS input field) on one verification input, or None where the graphs share no NMS to
    cut at.  ``run`` and ``compare`` are verify's."""
    got = piecewise_many(original, arg0, aux0, fused, arg1, aux1, [feed], names, layouts,
                         lambda sym, arg, aux, feeds: [run(sym, arg, aux, f) for f in feeds], compare)
    return None if got is None else got[0]


def piecewise_many(original: Any, arg0: Mapping[str, Any], aux0: Mapping[str, Any],
                   fused: Any, arg1: Mapping[str, Any], aux1: Mapping[str, Any],
                   feeds: Sequence[Mapping[str, np.ndarray]], names: Sequence[str], layouts, run_many, compare
                   ) -> Optional[List[Tuple[Any, Any, List[str], List[Tuple[str, str]]]]]:
    """``piecewise`` on each of ``feeds``, each cut graph bound once for all of them (``run_many``:
    verify's; a first run, oneDNN's primitives made and weights reordered, costs several later ones)."""
    g0, g1 = Graph.from_symbol(original), Graph.from_symbol(fused)
    cuts = cut_points(g0, g1)
    if not cuts:
        return None
    by_name0 = {nd.name: nd for nd in g0.nodes}
    g0.heads = list(g0.heads) + [by_name0[c].inputs[0] for c in cuts]
    vals0 = run_many(g0.to_symbol(), arg0, aux0, feeds)

    by_name1 = {nd.name: nd for nd in g1.nodes}
    computed: List[Entry] = []
    cut_vars: List[str] = []
    for c in cuts:
        nms = by_name1[c]
        computed.append(nms.inputs[0])
        var = Node("null", g1.unique_name(CUT_PREFIX + c))
        g1.nodes.insert(0, var)
        nms.inputs[0] = Entry(var)
        cut_vars.append(var.name)
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
    for v0, v1 in zip(vals0, vals1):
        out0, at_cuts = v0[:len(names)], v0[len(names):]
        out1, inputs1 = v1[:len(names)], v1[len(names):]
        aligned, _ = align_rows(out0, out1, layouts)
        refs, gots, fields = [], [], []
        for c, ref, got in zip(cuts, at_cuts, inputs1):
            for field, cols in nms_fields(by_name0[c], ref.shape[-1] if ref.ndim else 0):
                refs.append(ref[..., cols])
                gots.append(got[..., cols])
                fields.append((c, field))
        labels = ["the %s of %s's input" % (f, c) for c, f in fields]
        results.append((compare(out0, aligned, names), compare(refs, gots, labels), cuts, fields))
    return results


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
