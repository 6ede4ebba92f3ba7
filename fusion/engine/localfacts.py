"""Facts of one match without the input shapes: its values' shapes at sizes filled into the unknowns.

Without input shapes MXNet still infers every value's rank and the sizes the parameters fix
(``Context.partial_shape``: a CNN block's channels come from its weights); the batch and the
spatial sizes stay unknown.  What a block rule asks of them is how the values of its match relate
("the pool gives one value per sample and channel", "the product has the map's shape"), and
that is decided by the matched ops themselves.  So ``match_shapes`` infers the matched nodes with
MXNet from the match's inputs, each unknown size filled in, at two fillings of different sizes —
one size per axis for every input (the batch is one batch, the plane one plane: an elementwise op
reading two inputs meets them at one size) — and gives each value's shapes there, as
``Context.shapes`` gives them at the probes.  What holds at both fillings is what the ops make of
sizes of those axes; a rule that compares two inputs' unknown sizes learns nothing from it (they
were filled alike) and must decide that from the ops (an ``elemwise_add`` takes equal shapes only;
a ``broadcast_add`` may broadcast at some sizes: without input shapes it is refused).

A reshape that infers a size (-1, -4) is computed first (``facts.reshape_output``): at a filling
where MXNet would infer 0 there the match has no facts (MXNet 1.9.1 divides by it later, a crash).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..ir.graph import Entry, Node

#: sizes filled into an unknown axis a, per filling: the batch, channels, then spatial sizes (at
#: least 7, so that an unpadded 7×7 window fits; different in each axis and in each filling)
FILLS = ((2, 11, 23, 17, 13, 19, 29, 31), (3, 7, 14, 26, 9, 12, 8, 10))


class MatchShapes:
    """``shapes(entry)``: the shapes of a value of the match at each filling (empty where unknown)."""

    assumed = True      # the sizes are filled in, not the user's

    def __init__(self, per_fill: List[Dict[Entry, tuple]]):
        self._per_fill = per_fill

    def __call__(self, entry: Entry) -> Tuple[tuple, ...]:
        got = [f.get(entry) for f in self._per_fill]
        return tuple(got) if got and all(s is not None for s in got) else ()


def match_shapes(ctx: Any, nodes: Sequence[Node], extra_inputs: Sequence[Entry] = ()) -> Optional[MatchShapes]:
    """The shapes of ``nodes``' values (and of ``extra_inputs``) at the fillings of the unknown sizes
    of their inputs; None when an input's rank is unknown or MXNet cannot infer them."""
    from .facts import as_sizes, infer_nodes, reshape_divides, reshape_output

    ordered = sorted({id(n): n for n in nodes if not n.is_variable}.values(), key=lambda n: n.pos)
    inside = {id(n) for n in ordered}
    inputs = []
    seen = set()
    for nd in ordered:
        for e in nd.inputs:
            if id(e.node) not in inside and e not in seen:
                seen.add(e)
                inputs.append(e)
    for e in extra_inputs:
        if e not in seen and id(e.node) not in inside:
            seen.add(e)
            inputs.append(e)
    partial = {}
    for e in inputs:
        s = ctx.partial_shape(e)
        if s is None:
            return None
        partial[e] = s
    per_fill: List[Dict[Entry, tuple]] = []
    for fill in FILLS:
        known: Dict[Entry, tuple] = {}
        for e, s in partial.items():
            if len(s) > len(fill):
                return None
            known[e] = tuple(fill[a] if d is None else int(d) for a, d in enumerate(s))
        chunk: List[Node] = []
        for nd in ordered + [None]:     # inferred in runs, each reshape that infers a size computed first
            if nd is not None and not reshape_divides(nd):
                chunk.append(nd)
                continue
            if chunk:
                got = infer_nodes(chunk, known)
                if got is None:
                    return None
                known.update(got[0])
                chunk = []
            if nd is None:
                break
            if nd.op not in ("Reshape", "reshape"):
                return None             # another reshape dialect (_npx_reshape): not read here
            src = known.get(nd.inputs[0])
            if src is None or reshape_output(src, as_sizes(nd.attrs.get("shape")),
                                              bool(nd.param("reverse", False))) is None:
                return None             # MXNet would infer a size of 0 here (then divide by it)
            chunk.append(nd)
        per_fill.append(known)
    return MatchShapes(per_fill)
