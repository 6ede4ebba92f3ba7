"""Facts about values: inferred shapes and dtypes, at the user's input shapes and at probe shapes.

Rules decide from facts, not from guesses: "is this addend one value per output
feature?", "is the softmax over the last axis?", "which operand of the add is the
broadcast one?".  The answers come from MXNet's own shape and type inference over
the whole graph, so every op's broadcasting and attribute semantics are MXNet's.

**Probes.**  A decision that holds at the input shapes the user gave may not hold at
another batch size or sequence length — yet the fused model must run like the
original at every shape the original accepts.  So the facts are also inferred at up
to three *probe* shapes, derived from the user's:

* the batch axis changed (axis 0 of every data input that shares the batch size, the
  smallest first axis tried first: ``B → B + 1``; where the graph does not take that, also
  the inputs whose first axis is a multiple of it, ``kB → k(B + 1)``: lengths per batch
  element and head);
* then, in addition, each other size of the data inputs changed where the original
  graph still accepts it (``S → S + S // 4``, or ``S + 1`` for small sizes; never
  smaller, see ``_alternate``) — a sequence length, an image side, an input's width
  that no parameter fixes even where a parameter has the same size; the sizes are added
  one by one, largest first, each kept where the graph accepts it with those before;
* then sizes that are equal only by coincidence set apart: a place (input, axis) that
  shares its size with another is grown alone where the graph still accepts it (a query
  length equal to the key length, an image's height equal to its width, a dim of 1 of one
  addend equal to the other's).

A probe is kept only when MXNet infers every shape of the original graph at it.
``Context.shapes(entry)`` gives the entry's shape at every probe (the user's first);
a rule whose decision depends on sizes requires it at all of them, and the engine's
self-check runs every rewrite at every probe.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..ir.graph import Entry, Graph, Node
from ..precision.policy import dtype_name

Shape = Tuple[int, ...]
ShapeDict = Dict[str, Shape]

MAX_PROBES = 4          # the user's shapes and three alternates
MAX_PLACES_TRIED = 8    # places (input, axis) tried alone for the third alternate
MAX_SIZES_TRIED = 4     # distinct non-batch sizes tried for the second alternate


class _View:
    """The graph as MXNet sees it for inference, made once per graph version: the symbol of all
    internal values (node ``i`` named ``__n<i>``), and the entry each value is."""

    def __init__(self, graph: Graph):
        import mxnet as mx

        data = graph.to_json()
        for i, jn in enumerate(data["nodes"]):
            jn["name"] = "__n%d" % i
        self.internals = mx.sym.load_json(json.dumps(data)).get_internals()
        self.entries: List[Entry] = []
        seen: Dict[int, int] = {}
        nodes = graph.nodes
        for name in self.internals.list_outputs():
            idx = int(name[3:].split("_", 1)[0])
            k = seen.get(idx, 0)
            seen[idx] = k + 1
            self.entries.append(Entry(nodes[idx], k))
        self.variables = [(i, nd.name) for i, nd in enumerate(nodes) if nd.is_variable]
        self.has_library_ops = any(nd.op.startswith("fused_") for nd in nodes)


def _view(graph: Graph) -> _View:
    graph.compact()
    cached = getattr(graph, "_facts_view", None)
    if cached is None or cached[0] != graph.version:
        cached = (graph.version, _View(graph))
        graph._facts_view = cached
    return cached[1]


SIZE_KEEPING = frozenset({"Reshape", "reshape", "_npx_reshape", "_np_reshape", "Flatten", "flatten"})


def misread(op: str, ins: Sequence[Optional[Shape]], out: Optional[Shape]) -> bool:
    """Whether MXNet 1.9.1 infers these shapes for ``op`` but does not run it as they say:
    a reshape to a shape of another size (it infers a fully given target without comparing sizes,
    then copies past the buffer), or a ``where`` whose branches differ in shape, or whose condition
    is neither their shape nor their leading dims (followed by ones): its shape function accepts
    such shapes, and the kernel reads cond[i // (|x| / |cond|)] -- elsewhere, or divides by zero."""
    if op in SIZE_KEEPING:
        return bool(ins and ins[0] is not None and out is not None and int(np.prod(ins[0])) != int(np.prod(out)))
    if op == "where" and len(ins) >= 2 and ins[0] is not None and ins[1] is not None:
        c, x = tuple(ins[0]), tuple(ins[1])
        if len(ins) > 2 and ins[2] is not None and tuple(ins[2]) != x:
            return True         # it infers the output from one branch and reads both as that shape
        if c == x:
            return False
        lead = len(c)
        while lead and c[lead - 1] == 1:
            lead -= 1
        return len(c) > len(x) or c[:lead] != x[:lead]
    return False


def first_misread(shapes: Mapping[Entry, Shape], among: Optional[Mapping[Entry, Shape]] = None,
                  ops: Any = SIZE_KEEPING | {"where"}) -> Optional[Entry]:
    """The first value of an op of ``ops`` that MXNet does not run as the shapes say (see ``misread``),
    or None; only the values ``among`` when given (their inputs' shapes read from ``shapes``)."""
    for e, out in (shapes if among is None else among).items():
        nd = e.node
        if nd.op in ops and nd.inputs and misread(nd.op, [shapes.get(i) for i in nd.inputs], out):
            return e
    return None


def _sizes_kept(shapes: Mapping[Entry, Shape], among: Optional[Mapping[Entry, Shape]] = None) -> bool:
    """Whether MXNet runs every op as the shapes say (see ``misread``)."""
    return first_misread(shapes, among) is None


def infer(graph: Graph, shapes: Mapping[str, Shape], dtypes: Optional[Mapping[str, str]] = None,
          complete: bool = False, guard: bool = False) -> Tuple[Dict[Entry, Shape], Dict[Entry, str]]:
    """(shape, dtype) of every value MXNet can infer, given variables' shapes (and dtypes) by name.

    With ``complete``, an empty result unless every value's shape is known.  Library ops
    are inferred only when every variable's shape is given: MXNet 1.9.1's wrapper around a
    library op's shape function overruns a buffer when an input shape is unknown.

    ``guard``: shapes smaller than the user's (the self-check's small probes).  A reshape that
    infers a size by division (``reshape_divides``) is then computed first (``reshape_output``,
    the graph inferred in runs between such reshapes), and the shapes are refused (no facts)
    where it would infer a size of 0: MXNet 1.9.1 would divide by it in a later reshape, a crash
    rather than an error.  Every variable's shape must be given.
    """
    try:
        view = _view(graph)
    except Exception:       # MXNet cannot load the graph (an unknown op): no facts
        return {}, {}
    known: Dict[str, Shape] = {}
    known_t: Dict[str, str] = {}
    missing = False
    for i, name in view.variables:
        s = shapes.get(name)
        if s is not None:
            known["__n%d" % i] = tuple(s)
        else:
            missing = True
        if dtypes and name in dtypes:
            known_t["__n%d" % i] = dtypes[name]
    guard = guard and _divides_sizes(graph)
    if missing and (complete or view.has_library_ops or guard):
        return {}, {}
    entries = view.entries
    if view.has_library_ops or guard:
        staged = _infer_staged(graph, shapes, dtypes, guard)
        if staged is None:
            return {}, {}
        result, staged_types = staged
    else:
        try:
            _, out_shapes, _ = view.internals.infer_shape_partial(**known)
        except Exception:       # an op without shape inference, or shapes that do not fit: no facts
            return {}, {}
        result = {}
        for e, s in zip(entries, out_shapes):
            if s and 0 not in s:        # MXNet reports an unknown shape as () (and unknown dims as 0)
                result[e] = tuple(s)
    if complete and (len(result) < len(entries) or any(
            e.node.is_variable and e.node.name in shapes and result[e] != tuple(shapes[e.node.name])
            for e in result) or not _sizes_kept(result)):
        return {}, {}       # partial inference does not report shapes that contradict the given ones
    types: Dict[Entry, str] = {}
    if dtypes is not None and (view.has_library_ops or guard):
        types = staged_types
    elif dtypes is not None:
        try:
            _, out_types, _ = view.internals.infer_type_partial(**known_t)
            for e, t in zip(entries, out_types):
                if t is not None:
                    types[e] = dtype_name(t)
        except Exception:   # a dtype MXNet cannot infer: leave dtypes unknown
            types = {}
    return result, types


def _infer_staged(graph: Graph, shapes: Mapping[str, Shape], dtypes: Optional[Mapping[str, str]],
                  guard: bool = False) -> Optional[Tuple[Dict[Entry, Shape], Dict[Entry, str]]]:
    """``infer`` of a graph holding library ops, in stages: the stock ops before a library op, then
    the library op alone once each input's shape is known.  MXNet 1.9.1's wrapper around a library
    op's shape function overruns a buffer (SIGSEGV, or bad_alloc) when an input's shape is
    unknown, which a stock op may leave so without an error (a where of branches of two shapes).
    With ``guard``, also a stage before each reshape that infers a size by division, computed
    first by ``reshape_output``: None where it would infer a size of 0 (see ``infer``).
    None when some value cannot be inferred: no facts."""
    result: Dict[Entry, Shape] = {}
    types: Dict[Entry, str] = {}
    variable_dtypes = dict(dtypes or {})
    batch: List[Node] = []
    with_types = [dtypes is not None]

    def run(nodes: List[Node], before_library_op: bool = False) -> bool:
        if not nodes:
            return True
        got = infer_nodes(nodes, result, types if with_types[0] else None, shapes,
                          variable_dtypes if with_types[0] else None)
        if got is None and with_types[0]:     # dtypes MXNet cannot infer here: shapes without them
            with_types[0] = False
            types.clear()
            got = infer_nodes(nodes, result, None, shapes, None)
        if got is None:
            return False
        result.update(got[0])
        if before_library_op and not _sizes_kept(result, got[0]):
            return False        # a library op would read values MXNet does not compute as inferred
        types.update(got[1])
        for nd in nodes:
            if nd.is_variable:
                result[Entry(nd, 0)] = tuple(shapes[nd.name])
                if with_types[0] and nd.name in variable_dtypes:
                    types[Entry(nd, 0)] = variable_dtypes[nd.name]
        return True

    for nd in graph.nodes:
        divides = guard and reshape_divides(nd)
        if not nd.op.startswith("fused_") and not divides:
            batch.append(nd)
            continue
        if not run(batch, before_library_op=True):
            return None
        batch = []
        if any(e not in result and Entry(e.node, e.index) not in result for e in nd.inputs):
            return None         # an input of unknown shape would crash MXNet's wrapper
        if divides:
            if nd.op not in ("Reshape", "reshape") or reshape_output(
                    result[nd.inputs[0]], as_sizes(nd.attrs.get("shape")), bool(nd.param("reverse", False))) is None:
                return None     # MXNet would infer a size of 0 here (then divide by it), or another dialect
            batch.append(nd)    # MXNet infers it with what follows
            continue
        if not run([nd]):
            return None
    if not run(batch):
        return None
    return result, (types if with_types[0] else {})


def infer_dtypes(graph: Graph, dtypes: Mapping[str, str]) -> Dict[Entry, str]:
    """The dtype of every value MXNet's type inference gives, shapes not needed, with the variables'
    dtypes by name (those not given: as the graph declares them, else float32, what bind gives an
    input it is not told about).  Empty when MXNet cannot infer them."""
    try:
        view = _view(graph)
    except Exception:
        return {}
    if view.has_library_ops:
        return {}           # MXNet 1.9.1's wrappers of library ops need every input's facts
    known = {}
    for i, name in view.variables:
        nd = graph.nodes[i] if i < len(graph.nodes) else None
        declared = nd is not None and nd.name == name and nd.attrs.get("__dtype__") is not None
        if name in dtypes:
            known["__n%d" % i] = dtypes[name]
        elif not declared:              # a declared dtype MXNet reads from the variable itself
            known["__n%d" % i] = "float32"
    try:
        _, out_types, _ = view.internals.infer_type_partial(**known)
    except Exception:
        return {}
    return {e: dtype_name(t) for e, t in zip(view.entries, out_types) if t is not None}


def infer_nodes(nodes: Sequence[Node], known: Mapping[Entry, Shape], dtypes: Optional[Mapping[Entry, str]] = None,
                param_shapes: Optional[Mapping[str, Shape]] = None, param_dtypes: Optional[Mapping[str, str]] = None
                ) -> Optional[Tuple[Dict[Entry, Shape], Dict[Entry, str]]]:
    """Shapes (and dtypes) of ``nodes`` (topologically ordered) from those of the values they read
    (``known``, by entry; a variable among ``nodes`` by name in ``param_shapes``).  None when an
    input's shape is unknown or MXNet cannot infer them: the caller infers the whole graph."""
    import mxnet as mx

    jnodes: List[dict] = []
    rows: List[int] = []
    index: Dict[int, int] = {}
    variables: Dict[Entry, int] = {}
    shapes: Dict[str, Shape] = {}
    types: Dict[str, str] = {}
    for nd in nodes:
        if nd.is_variable:
            s = (param_shapes or {}).get(nd.name)
            if s is None:
                return None
            index[id(nd)] = len(jnodes)
            name = "__v%d" % len(jnodes)
            shapes[name] = tuple(s)
            if param_dtypes and nd.name in param_dtypes:
                types[name] = param_dtypes[nd.name]
            jnode: Dict[str, Any] = {"op": "null", "name": name, "inputs": []}
            declared = nd.attrs.raw("__dtype__")     # bfloat16 (the precision policy's weights) is only
            if declared is not None:                 # declared: MXNet's Python API cannot pass it by name
                jnode["attrs"] = {"__dtype__": declared}
            jnodes.append(jnode)
            rows.append(1)
            continue
        refs = []
        for e in nd.inputs:
            if id(e.node) in index:
                refs.append([index[id(e.node)], e.index, 0])
                continue
            if e not in variables:
                s = known.get(e)
                if s is None and e.version:     # an aux state is read as version 1 of its variable
                    s = known.get(Entry(e.node, e.index))
                if s is None and e.node.is_variable:   # a variable an earlier stage read too
                    s = (param_shapes or {}).get(e.node.name)
                if s is None:
                    return None
                name = "__v%d" % len(jnodes)
                variables[e] = len(jnodes)
                shapes[name] = tuple(s)
                if dtypes and e in dtypes:
                    types[name] = dtypes[e]
                elif e.node.is_variable and param_dtypes and e.node.name in param_dtypes:
                    types[name] = param_dtypes[e.node.name]
                jnodes.append({"op": "null", "name": name, "inputs": []})
                rows.append(1)
            refs.append([variables[e], 0, 0])
        index[id(nd)] = len(jnodes)
        jn = {"op": nd.op, "name": "__n%d" % len(jnodes), "inputs": refs}
        if len(nd.attrs):
            jn["attrs"] = nd.attrs.to_json()
        jnodes.append(jn)
        rows.append(nd.num_outputs)
    outs = [nd for nd in nodes if not nd.is_variable]
    heads = [[index[id(nd)], k, 0] for nd in outs for k in range(nd.num_outputs)]
    if not heads:
        return {}, {}
    try:
        row_ptr = [0]
        for r in rows:
            row_ptr.append(row_ptr[-1] + r)
        sym = mx.sym.load_json(json.dumps({"nodes": jnodes, "arg_nodes": [], "node_row_ptr": row_ptr,
                                           "heads": heads, "attrs": {"mxnet_version": ["int", 10901]}}))
        names = set(sym.list_arguments()) | set(sym.list_auxiliary_states())
        _, out_shapes, _ = sym.infer_shape_partial(**{k: v for k, v in shapes.items() if k in names})
        out_types = (sym.infer_type_partial(**{k: v for k, v in types.items() if k in names})[1]
                     if dtypes is not None else None)
    except Exception as e:       # MXNet cannot infer them this way: infer the whole graph
        import os
        if os.environ.get("MXFUSION_DEBUG_FACTS"):
            print("local inference failed:", str(e)[:2000])
        return None
    if out_shapes is None:
        return None
    entries = [Entry(nd, k) for nd in outs for k in range(nd.num_outputs)]
    result = {e: tuple(s) for e, s in zip(entries, out_shapes) if s and 0 not in s}
    rtypes = {e: dtype_name(t) for e, t in zip(entries, out_types or ()) if t is not None}
    return result, rtypes


def _changed(shape: Shape, axes: Sequence[int], new: Dict[int, int]) -> Shape:
    return tuple(new.get(d, d) if i in axes else d for i, d in enumerate(shape))


def _alternate(v: int) -> int:
    """A size other than ``v``, never smaller: MXNet 1.9.1's Reshape infers a -1 of a size that
    does not divide as 0 (27 elements into (3, 3, 4, -1)) and a later -1 then divides by zero
    -- a crash, not an error.  Grown inputs keep every -1 at least as large as it was."""
    return v + max(1, v // 4)


def make_probes(graph: Graph, param_shapes: Mapping[str, Shape], input_shapes: Mapping[str, Shape],
                guard: bool = False) -> List[Tuple[ShapeDict, Optional[Dict[Entry, Shape]]]]:
    """The user's input shapes, then up to three alternates the original graph accepts (see module
    docs), each with the graph's shapes there when they were inferred to accept it (``guard``: around
    shapes smaller than the user's, see ``infer``)."""
    # in name order, not graph order: a rewrite reorders the variables, and fuse(fuse(g)) must
    # decide at the same probes as fuse(g)
    data_names = sorted(nd.name for nd in graph.variables() if nd.name not in param_shapes and nd.name in input_shapes)
    if not data_names:
        return [(dict(input_shapes), None)]
    base = {n: tuple(input_shapes[n]) for n in data_names}
    inferred: Dict[tuple, Dict[Entry, Shape]] = {}

    def key(probe: ShapeDict) -> tuple:
        return tuple(sorted(probe.items()))

    def accepted(probe: ShapeDict) -> bool:
        if probe == base:
            return False
        if key(probe) not in inferred:
            inferred[key(probe)], _ = infer(graph, {**param_shapes, **probe}, complete=True, guard=guard)
        return bool(inferred[key(probe)])

    def resized(shapes: ShapeDict, new: Dict[int, int]) -> ShapeDict:
        return {n: (s[:1] + _changed(s[1:], range(len(s) - 1), new)) for n, s in shapes.items()}

    probes = [dict(input_shapes)]
    with_batch = dict(base)
    # the batch: the first axis of the inputs sharing it (B -> B + 1); where the graph does not
    # take that, also inputs whose first axis is a multiple of it (B·H rows of lengths per
    # batch element and head: kB -> k(B + 1)); the smallest first axis is tried first
    for b in sorted({s[0] for s in base.values() if s}):
        same = {n: ((b + 1,) + s[1:] if s and s[0] == b else s) for n, s in base.items()}
        scaled = {n: ((s[0] // b * (b + 1),) + s[1:] if s and s[0] % b == 0 else s) for n, s in base.items()}
        found = next((c for c in (same, scaled) if accepted(c)), None)
        if found is not None:
            with_batch = found
            probes.append(found)
            break
    # sizes of 1 too: a length-1 sequence or a single channel may be anything at run time
    values = sorted({d for s in base.values() for d in s[1:] if d >= 1}, reverse=True)[:MAX_SIZES_TRIED]
    # Sizes no parameter has (a sequence length, an image side) are likely free: tried together
    # first; then every other size is added, one at a time, where the graph still accepts it.
    # Every size is tried whether or not the free ones were taken together: a size a parameter also
    # has (an input's width equal to a weight's) may still be free, and whether it is probed must
    # not depend on an unrelated part of the graph -- a Reshape elsewhere that names a sequence
    # length, which a rewrite removes, made fuse(fuse(g)) probe other sizes than fuse(g).
    # (1 is no parameter's size to keep: a scalar parameter or a broadcast axis has it, and where a
    # size of 1 is a real one the graph refuses the other sizes -- `accepted` asks it)
    param_dims = {d for s in param_shapes.values() for d in s if d != 1}
    free = {v: _alternate(v) for v in values if v not in param_dims}
    changed = free if free and accepted(resized(with_batch, free)) else {}
    for v in values:
        if v not in changed and accepted(resized(with_batch, {**changed, v: _alternate(v)})):
            changed = {**changed, v: _alternate(v)}
    if changed:
        probes.append(resized(with_batch, changed))
    apart = _sizes_apart(data_names, with_batch, param_dims, accepted)
    if apart is not None:
        probes.append(apart)
    return [({**input_shapes, **p}, inferred.get(key(p))) for p in probes[:MAX_PROBES]]


def _sizes_apart(data_names: Sequence[str], start: ShapeDict, param_dims: set, accepted) -> Optional[ShapeDict]:
    """The batch alternate with sizes that are equal only by coincidence set apart: each place
    (input, axis) whose size another place shares is grown alone, to a size of its own, and kept
    where the graph still accepts it.  Equal sizes change together in the other alternates, so a
    query length equal to the key length, or an addend's dim of 1 equal to the other operand's,
    look tied there; here a rule sees them differ.  None when no place could be set apart."""
    probe = dict(start)
    moved = 0
    tried = 0
    for n in data_names:
        for a, d in enumerate(start[n]):
            if tried >= MAX_PLACES_TRIED:
                break
            if a > 0 and d in param_dims:
                continue        # a size a parameter has (a channel count) is fixed
            if not any((m, b) != (n, a) and e == probe[n][a]
                       for m in data_names for b, e in enumerate(probe[m])):
                continue        # no other place has this size: nothing to set apart
            tried += 1
            size = 2 * probe[n][a] + 3 + 2 * tried
            cand = dict(probe)
            cand[n] = probe[n][:a] + (size,) + probe[n][a + 1:]
            if accepted(cand):
                probe = cand
                moved += 1
    return probe if moved else None


# ---------------------------------------------------------------- the self-check's small probes

SHRINK_TO = 64          # sizes of the data inputs above this are shrunk for the self-check's probes, to an
                        # eighth (then a quarter, a half) but never below it: a stride-32 CNN keeps 2×2 maps


def reshape_divides(nd: Node) -> bool:
    """Whether reshape ``nd`` infers a size by division (-1, or a -4 split): at an input smaller than
    the user's, MXNet 1.9.1 may infer 0 there and divide by it in a later reshape (a crash)."""
    if nd.op not in SIZE_KEEPING or nd.op in ("Flatten", "flatten"):
        return False
    spec = nd.attrs.get("shape", nd.attrs.get("newshape"))
    return "target_shape" in nd.attrs or spec is None or any(int(v) in (-1, -4) for v in as_sizes(spec))


def as_sizes(spec) -> tuple:
    """A reshape's ``shape`` attribute as a tuple: MXNet also takes one size (``shape=-1``, as GluonNLP's
    BERT flattens its valid lengths)."""
    if spec is None:
        return ()
    return tuple(spec) if isinstance(spec, (tuple, list)) else (spec,)


def _divides_sizes(graph: Graph) -> bool:
    return any(reshape_divides(nd) for nd in graph.nodes)


def small_probes(graph: Graph, param_shapes: Mapping[str, Shape], input_shapes: Mapping[str, Shape]
                 ) -> Tuple[List[Tuple[ShapeDict, Optional[Dict[Entry, Shape]]]], int]:
    """Probes like ``make_probes``' but around a smaller copy of the user's input shapes: every
    size above ``SHRINK_TO`` after the batch axis shrunk to an eighth (then a quarter, a half, then
    only the sizes no parameter has), at least ``SHRINK_TO``, where the original graph accepts it.

    The self-check runs a rewrite that is the same at every size (see ``selfcheck.size_free``) at
    these instead of the user's sizes: a 480×480 segmentation model is checked at 64×64.  Where a
    reshape divides sizes (``reshape_divides``: a detector's heads), a smaller size is taken only
    where every such reshape divides exactly there (``infer(..., guard=True)``).
    Returns (probes with their inferred shapes, the smallest shrunk size), or ([], 0) when
    nothing shrinks."""
    data_names = sorted(nd.name for nd in graph.variables() if nd.name not in param_shapes and nd.name in input_shapes)
    if not data_names:
        return [], 0
    param_dims = {d for s in param_shapes.values() for d in s}

    def shrunk(divisor: int, keep_param_dims: bool) -> ShapeDict:
        return {n: tuple(s[:1]) + tuple(
            max(SHRINK_TO, d // divisor) if d > SHRINK_TO and not (keep_param_dims and d in param_dims) else d
            for d in s[1:]) for n, s in ((n, tuple(input_shapes[n])) for n in data_names)}

    base = {n: tuple(input_shapes[n]) for n in data_names}
    for divisor, keep in ((8, False), (4, False), (2, False), (8, True)):
        small = shrunk(divisor, keep)
        if small == base:
            continue
        if infer(graph, {**param_shapes, **small}, complete=True, guard=True)[0]:
            smallest = min(d for n in data_names for d, b in zip(small[n][1:], base[n][1:]) if d != b)
            probes = make_probes(graph, param_shapes, {**input_shapes, **small}, guard=True)
            if len(probes) > 2 and all(probes[2][0][n][:1] != small[n][:1] for n in data_names if small[n]):
                del probes[1]   # the sizes' alternate changes the batch too: one run fewer, the same sizes changed
            return probes, smallest
    return [], 0


# ---------------------------------------------------------------- facts without the input shapes

MAX_RANK_TRIED = 6
PartialShape = Tuple[Optional[int], ...]


def partial_shapes(graph: Graph, param_shapes: Mapping[str, Shape]) -> Dict[Entry, PartialShape]:
    """What MXNet infers of every value without the data inputs' sizes: its rank, and the sizes
    the parameters fix (channels from the weights); a size that depends on the data's is None.

    From two shapes the graph accepts, as far apart as it allows (``_samples``: each data input's
    rank and channels from the convolution it feeds): a size the same at both is fixed by the
    parameters, one that differs is None.  Where no convolution tells a data input's channels,
    MXNet's own partial inference, each data input at the one rank MXNet accepts with all its
    sizes unknown (up to ``MAX_RANK_TRIED``; an op that refuses unknown sizes, a pooling window
    checked against the plane, gives no facts there).
    Graphs with library ops give none (MXNet 1.9.1's wrapper of a library op's shape function
    overruns a buffer on unknown sizes)."""
    try:
        view = _view(graph)
    except Exception:       # MXNet cannot load the graph: no facts
        return {}
    if view.has_library_ops:
        return {}
    params = {"__n%d" % i: tuple(param_shapes[name]) for i, name in view.variables if name in param_shapes}
    data = [(i, name) for i, name in view.variables if name not in param_shapes]
    samples = _samples(graph, param_shapes, [name for _, name in data])
    if len(samples) == 2:
        out: Dict[Entry, PartialShape] = {}
        for e, s in samples[0].items():
            t = samples[1].get(e)
            if t is not None and len(t) == len(s):
                out[e] = tuple(a if a == b else None for a, b in zip(s, t))
        return out

    def accepted(shapes: Dict[str, tuple]) -> Optional[list]:
        try:
            return view.internals.infer_shape_partial(**params, **shapes)[1]
        except Exception:   # that rank does not fit an op, or an op refuses unknown sizes
            return None

    ranks: Dict[str, int] = {}
    for i, name in data:
        fits = [r for r in range(1, MAX_RANK_TRIED + 1) if accepted({"__n%d" % i: (0,) * r}) is not None]
        if len(fits) == 1:
            ranks["__n%d" % i] = fits[0]
    got = accepted({k: (0,) * r for k, r in ranks.items()}) if len(ranks) == len(data) else None
    return {e: tuple(int(d) if d else None for d in s) for e, s in zip(view.entries, got or ()) if s}


#: image sides tried for ``_samples`` (the first the graph accepts is paired with a larger one)
SAMPLE_SIDES = (224, 256, 320, 512, 480, 300, 416, 608, 128, 64, 32)


def _samples(graph: Graph, param_shapes: Mapping[str, Shape], data_names: Sequence[str]) -> List[Dict[Entry, Shape]]:
    """The graph's shapes at two data shapes it accepts, as far apart as it allows: (1, C, s, s)
    and (2, C, s', s') with s' = s + s/4 + 1, else s + 1, else s (then every size is fixed but
    the batch).  Each data input's rank and channels come from the convolution it feeds (through
    rank- and channel-keeping ops); [] when an input feeds none, or no side is accepted."""
    templates = {}
    for name in data_names:
        t = _conv_input_template(graph, name, param_shapes)
        if t is None:
            return []
        templates[name] = t

    def at(batch: int, side: int) -> Optional[Dict[Entry, Shape]]:
        shapes = {n: (batch, c) + (side,) * (rank - 2) for n, (rank, c) in templates.items()}
        got, _ = infer(graph, {**param_shapes, **shapes}, complete=True)
        return got or None

    for side in SAMPLE_SIDES:
        first = at(1, side)
        if first is None:
            continue
        for other in (side + side // 4 + 1, side + 1, side):
            second = at(2, other)
            if second is not None:
                return [first, second]
        return []
    return []


_CHANNEL_KEEPING = frozenset({"BatchNorm", "Activation", "LeakyReLU", "relu", "sigmoid", "Cast", "cast",
                              "identity", "_copy", "clip", "Dropout"})


def _conv_input_template(graph: Graph, name: str, param_shapes: Mapping[str, Shape]) -> Optional[Tuple[int, int]]:
    """(rank, channels) of data input ``name`` from the first convolution it reaches through ops
    that keep rank and channels (a leading BatchNorm, a cast, a scalar op): NC… layouts only."""
    users = graph.consumers()
    frontier = [nd for nd in graph.variables() if nd.name == name]
    for _ in range(4):
        nxt = []
        for src in frontier:
            for user, slot in users.get(src, ()):
                if user.op == "Convolution" and slot == 0:
                    w = user.inputs[1]
                    ws = param_shapes.get(w.node.name) if w.node.is_variable else None
                    layout = user.param("layout", None)
                    if ws is None or layout not in (None, "NCW", "NCHW", "NCDHW"):
                        return None
                    return len(tuple(user.param("kernel"))) + 2, int(ws[1]) * int(user.param("num_group") or 1)
                if slot == 0 and (user.op in _CHANNEL_KEEPING or user.op.endswith("_scalar")):
                    nxt.append(user)
        frontier = nxt
    return None


def reshape_output(shape: Sequence[int], spec: Sequence[int], reverse: bool = False) -> Optional[Shape]:
    """The shape MXNet 1.9.1's Reshape infers for an input of ``shape`` (every size known) and
    the target ``spec`` (codes 0, -1, -2, -3, -4), computed as its InferReshapeShape does; None
    where MXNet would refuse it, infer a size of 0 or divide by one (a crash in a later reshape)."""
    src, tgt = list(shape), list(spec)
    if reverse:
        src, tgt = src[::-1], tgt[::-1]
    out: List[int] = []
    i = k = 0
    infer_at = -1
    while i < len(tgt):
        code = int(tgt[i])
        if code == 0:
            if k >= len(src):
                return None
            out.append(src[k])
            k += 1
        elif code == -1:
            if infer_at >= 0:
                return None
            infer_at = len(out)
            out.append(1)
            k += 1
        elif code == -2:
            out.extend(src[k:])
            k = len(src)
        elif code == -3:
            if k + 1 >= len(src):
                return None
            out.append(src[k] * src[k + 1])
            k += 2
        elif code == -4:
            if i + 2 >= len(tgt) or k >= len(src):
                return None
            d0, d1, d2 = src[k], int(tgt[i + 1]), int(tgt[i + 2])
            k += 1
            i += 2
            if d1 == -1 and d2 == -1 or 0 in (d1, d2):
                return None
            d1 = d0 // d2 if d1 == -1 else d1
            d2 = d0 // d1 if d2 == -1 else d2
            if d1 <= 0 or d2 <= 0 or d1 * d2 != d0:
                return None
            out.extend((d1, d2))
        elif code > 0:
            out.append(code)
            k += 1
        else:
            return None
        i += 1
    if infer_at >= 0:
        rest = int(np.prod(out))
        if rest <= 0 or int(np.prod(src)) % rest:
            return None
        out[infer_at] = int(np.prod(src)) // rest
    if any(d <= 0 for d in out) or int(np.prod(out)) != int(np.prod(src)):
        return None
    return tuple(out[::-1] if reverse else out)
