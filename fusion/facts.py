"""Facts about values: inferred shapes and dtypes, at the user's input shapes and at probe shapes.

Rules decide from facts, not from guesses: "is this addend one value per output
feature?", "is the softmax over the last axis?", "which operand of the add is the
broadcast one?".  The answers come from MXNet's own shape and type inference over
the whole graph, so every op's broadcasting and attribute semantics are MXNet's.

**Probes.**  A decision that holds at the input shapes the user gave may not hold at
another batch size or sequence length — yet the fused model must run like the
original at every shape the original accepts.  So the facts are also inferred at up
to two *probe* shapes, derived from the user's:

* the batch axis changed (axis 0 of every data input that shares the first input's
  batch size: ``B → B + 1``);
* then, in addition, each other size of the data inputs changed where the original
  graph still accepts it (``S → S // 2 + 1``, or ``S + 1`` for small sizes) — a
  sequence length, an image side.

A probe is kept only when MXNet infers every shape of the original graph at it.
``Context.shapes(entry)`` gives the entry's shape at every probe (the user's first);
a rule whose decision depends on sizes requires it at all of them, and the engine's
self-check runs every rewrite at every probe.
"""
from __future__ import annotations

import json
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .graph import Entry, Graph

Shape = Tuple[int, ...]
ShapeDict = Dict[str, Shape]

MAX_PROBES = 3          # the user's shapes and two alternates
MAX_SIZES_TRIED = 4     # distinct non-batch sizes tried for the second alternate


def _renamed_json(graph: Graph) -> dict:
    """The graph's JSON with node ``i`` named ``__n<i>`` (MXNet reports values by name)."""
    data = graph.to_json()
    for i, jn in enumerate(data["nodes"]):
        jn["name"] = "__n%d" % i
    return data


def _entries_by_output(graph: Graph, names: Sequence[str]) -> List[Entry]:
    out, seen = [], {}
    for name in names:
        idx = int(name[3:].split("_", 1)[0])
        k = seen.get(idx, 0)
        seen[idx] = k + 1
        out.append(Entry(graph.nodes[idx], k))
    return out


def infer(graph: Graph, shapes: Mapping[str, Shape], dtypes: Optional[Mapping[str, str]] = None,
          complete: bool = False) -> Tuple[Dict[Entry, Shape], Dict[Entry, str]]:
    """(shape, dtype) of every value MXNet can infer, given variables' shapes (and dtypes) by name.

    With ``complete``, an empty result unless every value's shape is known.  Library ops
    are inferred only when every variable's shape is given: MXNet 1.9.1's wrapper around a
    library op's shape function overruns a buffer when an input shape is unknown.
    """
    import mxnet as mx

    graph.compact()
    data = _renamed_json(graph)
    known: Dict[str, Shape] = {}
    known_t: Dict[str, str] = {}
    missing = False
    for i, nd in enumerate(graph.nodes):
        if nd.is_variable:
            s = shapes.get(nd.name)
            if s is not None:
                known["__n%d" % i] = tuple(s)
            else:
                missing = True
            if dtypes and nd.name in dtypes:
                known_t["__n%d" % i] = dtypes[nd.name]
    if missing and (complete or any(nd.op.startswith("fused_") for nd in graph.nodes)):
        return {}, {}
    try:
        internals = mx.sym.load_json(json.dumps(data)).get_internals()
        _, out_shapes, _ = internals.infer_shape_partial(**known)
    except Exception:       # an op without shape inference, or shapes that do not fit: no facts
        return {}, {}
    entries = _entries_by_output(graph, internals.list_outputs())
    result: Dict[Entry, Shape] = {}
    for e, s in zip(entries, out_shapes):
        if s and 0 not in s:        # MXNet reports an unknown shape as () (and unknown dims as 0)
            result[e] = tuple(s)
    if complete and (len(result) < len(entries) or any(
            e.node.is_variable and e.node.name in shapes and result[e] != tuple(shapes[e.node.name])
            for e in result)):
        return {}, {}       # partial inference does not report shapes that contradict the given ones
    types: Dict[Entry, str] = {}
    if dtypes is not None:
        try:
            _, out_types, _ = internals.infer_type_partial(**known_t)
            for e, t in zip(entries, out_types):
                if t is not None:
                    types[e] = np.dtype(t).name
        except Exception:   # a dtype MXNet cannot infer: leave dtypes unknown
            types = {}
    return result, types


def _changed(shape: Shape, axes: Sequence[int], new: Dict[int, int]) -> Shape:
    return tuple(new.get(d, d) if i in axes else d for i, d in enumerate(shape))


def _alternate(v: int) -> int:
    return v + 1 if v < 4 else v // 2 + 1


def make_probes(graph: Graph, param_shapes: Mapping[str, Shape], input_shapes: Mapping[str, Shape]) -> List[ShapeDict]:
    """The user's input shapes, then up to two alternates the original graph accepts (see module docs)."""
    data_names = [nd.name for nd in graph.variables() if nd.name not in param_shapes and nd.name in input_shapes]
    if not data_names:
        return [dict(input_shapes)]
    base = {n: tuple(input_shapes[n]) for n in data_names}

    def accepted(probe: ShapeDict) -> bool:
        if probe == base:
            return False
        shapes, _ = infer(graph, {**param_shapes, **probe}, complete=True)
        return bool(shapes)

    probes = [dict(input_shapes)]
    first = next((base[n] for n in data_names if base[n]), None)
    with_batch = dict(base)
    if first:
        b = first[0]
        with_batch = {n: ((b + 1,) + s[1:] if s and s[0] == b else s) for n, s in base.items()}
        if accepted(with_batch):
            probes.append(with_batch)
        else:
            with_batch = dict(base)
    # other sizes, each tried alone on top of the batch change, then all that work together
    values = sorted({d for s in base.values() for d in s[1:] if d > 1}, reverse=True)[:MAX_SIZES_TRIED]
    good: Dict[int, int] = {}
    for v in values:
        new = {v: _alternate(v)}
        probe = {n: (s[:1] + _changed(s[1:], range(len(s) - 1), new)) for n, s in with_batch.items()}
        if accepted(probe):
            good.update(new)
    if good:
        probe = {n: (s[:1] + _changed(s[1:], range(len(s) - 1), good)) for n, s in with_batch.items()}
        if not accepted(probe):
            v = max(good)
            probe = {n: (s[:1] + _changed(s[1:], range(len(s) - 1), {v: good[v]})) for n, s in with_batch.items()}
        probes.append(probe)
    return [{**input_shapes, **p} for p in probes[:MAX_PROBES]]
