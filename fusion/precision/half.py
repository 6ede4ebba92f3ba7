"""float16 graphs of MXNet's AMP, fused for the GPU: read as their float32 model, then given back
the dtypes AMP gave them.

``mx.contrib.amp.convert_symbol(sym, target_dtype="float16")`` (or ``convert_model`` /
``convert_hybrid_block``) runs FullyConnected in float16 (its data, weight and bias cast), softmax
and LayerNorm in float32 (their inputs cast up), and its widest-type ops (``batch_dot``, the adds,
the interleaved attention products) in the widest dtype of their inputs (``amp_multicast``).
The rules match float32 graphs, so ``fuse(..., device="gpu")`` reads such a graph in three steps:

1. **read** (``read_half``): MXNet's type inference gives the dtype of every value of AMP's graph
   and of every input slot of every op (what AMP's casts hand it); then every ``amp_cast`` /
   ``amp_multicast`` is removed (its readers take its input) and every float16 parameter is
   widened to float32 — exactly, a float16 value is a float32 value;
2. the rules fuse the float32 graph (the per-rewrite self-check runs there, in float32, on the CPU);
3. **lower** (``lower_half``): every op gets the dtypes AMP gave it.  An op of the user's graph
   (or one a rule re-emits in its place) reads each input in the dtype AMP's cast handed it (an
   ``amp_cast`` is put back where the value has another dtype).  A fused op writes the dtype AMP's
   graph had at the value it replaces (``out_dtype``) — or, where every reader casts that value
   to one narrower dtype, that dtype (the same rounding, done once by the op); it reads its inputs
   as ``HALF_INPUTS`` says: ``fused_dense`` its data, weight and bias in the dtype AMP gave the
   product's data (float16: the float16 GEMM), ``fused_attention`` its q/k/v in the dtype AMP gave
   the products, ``fused_add_layer_norm`` and ``fused_elemwise`` every input as it comes (they take
   float16 and float32 mixed, widening inside; AMP's casts up in front of them are exact and
   dropped).  Widened parameters get their float16 arrays back, unchanged.

What the fused graph computes then differs from AMP's graph by where values are rounded to float16
(a fused op rounds once, at its output), within ``TOLERANCE`` (see fusion/precision/policy.py).
Graphs this does not read, with the reason (``HalfRefused``): casts to another reduced dtype (a
bfloat16 ``amp_cast``), a graph MXNet cannot infer the dtypes of, training (inference only).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..ir.attrs import Attrs
from ..ir.graph import Entry, Graph, Node
from .policy import AMP_OPS, FLOAT32, dtype_name

FLOAT16 = "float16"
#: MXNet's dtype code of float16 (mshadow::kFloat16), as a variable's ``__dtype__`` declares it.
FLOAT16_CODE = "2"
#: The dtypes a float value may have in a graph this module reads.
_FLOATS = (FLOAT32, FLOAT16)
_WIDTH = {FLOAT16: 2, FLOAT32: 4}


class HalfRefused(Exception):
    """A float16 graph this module does not read; the message is the report's reason."""


@dataclass
class HalfGraph:
    """What ``read_half`` learnt of AMP's graph, for ``lower_half``."""

    #: the dtype AMP's graph gives each value (of the ops and variables kept)
    had: Dict[Entry, str]
    #: the dtype AMP's graph hands each input slot of each op kept: (node, slot) -> dtype
    want: Dict[Tuple[Node, int], str]
    #: parameters AMP gave in float16: name -> the caller's array (the rules saw it widened)
    params16: Dict[str, Any] = field(default_factory=dict)
    #: variables whose declared dtype (``__dtype__``) was removed for the rules: name -> the value
    declared: Dict[str, Any] = field(default_factory=dict)
    #: the dtypes of the graph's outputs in AMP's graph
    heads: List[str] = field(default_factory=list)
    #: how many casts were read through
    casts: int = 0
    #: the inputs' dtypes as AMP's graph takes them (for the check after lowering)
    input_dtypes: Dict[str, str] = field(default_factory=dict)


def is_half_graph(graph: Graph, arg_params: Mapping[str, Any], aux_params: Mapping[str, Any]) -> bool:
    """Whether the graph holds float16: an AMP cast to float16, a float16 parameter or variable."""
    for nd in graph.op_nodes():
        if nd.op == "amp_cast" and str(nd.attrs.raw("dtype")) == FLOAT16:
            return True
    for store in (arg_params, aux_params):
        if any(dtype_name(v.dtype) == FLOAT16 for v in store.values()):
            return True
    return any(str(nd.attrs.raw("__dtype__")) == FLOAT16_CODE for nd in graph.variables())


# -------------------------------------------------------------------------------------------- read
def read_half(graph: Graph, arg_params: Mapping[str, Any], aux_params: Mapping[str, Any],
              input_dtypes: Optional[Mapping[str, Any]] = None):
    """Read AMP's float16 graph as its float32 model (in place; see the module docstring).

    Returns ``(HalfGraph, arg_params, aux_params)`` with the float16 parameters widened to float32
    (new arrays; the caller's are kept for ``lower_half``).  Raises HalfRefused, with nothing
    changed, for a graph it does not read."""
    for nd in graph.op_nodes():
        if nd.op == "amp_cast" and str(nd.attrs.raw("dtype")) not in _FLOATS:
            raise HalfRefused("amp_cast '%s' casts to %s: only float16 graphs (and their float32 parts) are read "
                              "for the GPU" % (nd.name, nd.attrs.raw("dtype")))
    given = {k: dtype_name(v) for k, v in (input_dtypes or {}).items()}
    params = {k: v for store in (arg_params, aux_params) for k, v in store.items()}
    for name, v in params.items():
        if dtype_name(v.dtype) not in _FLOATS + ("int32", "int64", "int8", "uint8", "float64", "bool"):
            raise HalfRefused("parameter '%s' is %s: a float16 graph is read with float16 and float32 parameters"
                              % (name, dtype_name(v.dtype)))
    known = {k: dtype_name(v.dtype) for k, v in params.items()}
    known.update(given)
    had = value_dtypes(graph, known)
    if had is None:
        raise HalfRefused("MXNet cannot infer the dtypes of the graph, so the dtypes AMP gave its values are "
                          "unknown")
    want: Dict[Tuple[Node, int], str] = {}
    target: Dict[Entry, Entry] = {}
    casts = [nd for nd in graph.op_nodes() if nd.op in AMP_OPS]
    for nd in casts:            # in topological order: a cast of a cast reads through both
        for i in range(nd.num_outputs if nd.op == "amp_multicast" else 1):
            src = nd.inputs[i]
            target[Entry(nd, i)] = target.get(src, src)
    for nd in graph.op_nodes():
        if nd.op in AMP_OPS:
            continue
        for slot, e in enumerate(nd.inputs):
            t = had.get(Entry(e.node, e.index))        # (an entry's variable version aside)
            if t is not None:
                want[(nd, slot)] = t
    heads = [had.get(Entry(e.node, e.index), "") for e in graph.heads]
    if any(t not in _FLOATS and e.node.op in AMP_OPS for t, e in zip(heads, graph.heads)):
        raise HalfRefused("an output of the graph is a cast of unknown dtype")
    for nd in graph.nodes:
        nd.inputs = [target.get(e, e) for e in nd.inputs]
    graph.heads = [target.get(e, e) for e in graph.heads]
    half = HalfGraph(had={e: t for e, t in had.items() if e.node.op not in AMP_OPS}, want=want, heads=heads,
                     casts=len(casts), input_dtypes={nd.name: had[Entry(nd)] for nd in graph.variables()
                                                     if nd.name not in params and Entry(nd) in had})
    for nd in graph.variables():
        if str(nd.attrs.raw("__dtype__")) == FLOAT16_CODE:
            half.declared[nd.name] = nd.attrs.raw("__dtype__")
            del nd.attrs["__dtype__"]

    def widen(store):
        out = {}
        for k, v in store.items():
            if dtype_name(v.dtype) == FLOAT16:
                half.params16[k] = v
                v = (v.asnumpy() if hasattr(v, "asnumpy") else np.asarray(v)).astype(np.float32)
            out[k] = v
        return out

    arg_out, aux_out = widen(arg_params), widen(aux_params)
    graph.mark_changed()
    graph.compact()
    return half, arg_out, aux_out


def value_dtypes(graph: Graph, dtypes: Mapping[str, str]) -> Optional[Dict[Entry, str]]:
    """The dtype MXNet's type inference gives every value of ``graph`` (variables by name in
    ``dtypes``, others as declared or float32), or None where it cannot."""
    import mxnet as mx

    graph.compact()
    data = graph.to_json()
    for i, jn in enumerate(data["nodes"]):
        jn["name"] = "__n%d" % i
    nodes = graph.nodes
    known = {}
    for i, nd in enumerate(nodes):
        if not nd.is_variable:
            continue
        if nd.name in dtypes:
            known["__n%d" % i] = dtypes[nd.name]
        elif nd.attrs.raw("__dtype__") is None:
            known["__n%d" % i] = FLOAT32
    try:
        internals = mx.sym.load_json(json.dumps(data)).get_internals()
        _, types, _ = internals.infer_type_partial(**known)
    except Exception:           # noqa: BLE001 -- MXNet's refusal: the caller says it cannot tell
        return None
    out: Dict[Entry, str] = {}
    seen: Dict[int, int] = {}
    for name, t in zip(internals.list_outputs(), types):
        idx = int(name[3:].split("_", 1)[0])
        k = seen.get(idx, 0)
        seen[idx] = k + 1
        if t is not None:
            out[Entry(nodes[idx], k)] = dtype_name(t)
    return out


# ------------------------------------------------------------------------------------------- lower
#: How a fused op takes its inputs in a float16 graph: "product" — the slots named are cast to one
#: dtype, the one AMP gave the product's data (the first of them); "as_is" — every input read in
#: the dtype it comes in (the op widens float16 inside).  Others: as AMP's casts handed the ops
#: they replace.
HALF_INPUTS: Dict[str, str] = {"fused_dense": "product", "fused_attention": "product",
                               "fused_add_layer_norm": "as_is", "fused_elemwise": "as_is"}
_ATTENTION_DATA = {"plain": 3, "bshd": 3, "packed_qkv": 1, "interleaved": 1, "interleaved_encdec": 2}


def _product_slots(nd: Node) -> Tuple[int, ...]:
    if nd.op == "fused_dense":
        return tuple(range(min(len(nd.inputs), 3)))
    return tuple(range(_ATTENTION_DATA.get(str(nd.attrs.raw("layout", "plain")), 3)))


class _Lowering:
    def __init__(self, graph: Graph, half: HalfGraph, origins: Mapping[Node, Sequence[Node]],
                 lineage: Mapping[Entry, Entry]):
        self.graph, self.half, self.origins, self.lineage = graph, half, origins, lineage
        self.dtype: Dict[Entry, str] = {}
        self.casts: Dict[Tuple[Entry, str], Entry] = {}
        self.added: List[Node] = []
        self.fused16: Dict[str, int] = {}

    def orig(self, e: Entry) -> Entry:
        e = self.lineage.get(e, e)
        return Entry(e.node, e.index)

    def dt(self, e: Entry) -> Optional[str]:
        """The dtype ``e`` has in the graph being lowered (None: not known)."""
        return self.dtype.get(Entry(e.node, e.index))

    def amp_dtype(self, e: Entry) -> Optional[str]:
        return self.half.had.get(self.orig(e))

    def wanted(self, nd: Node, slot: int, narrowest: bool = False) -> Optional[str]:
        """The dtype AMP's graph handed this input: its own slot's, or that of the ops it replaces
        reading the same value — where they read it in both dtypes, the wider (nothing lost), or
        with ``narrowest`` the narrower (a product AMP ran in float16); None where unknown (an op a
        rule made of no op AMP saw)."""
        t = self.half.want.get((nd, slot))
        if t is not None:
            return t
        origins = self.origins.get(nd, ())
        src = self.orig(nd.inputs[slot])
        seen = {self.half.want.get((o, k)) for o in origins for k, x in enumerate(o.inputs) if self.orig(x) == src}
        seen.discard(None)
        if len(seen) == 1:
            return seen.pop()
        if seen:
            return FLOAT16 if narrowest and FLOAT16 in seen else FLOAT32
        same = [o for o in origins if o.op == nd.op and len(o.inputs) == len(nd.inputs)]
        if len(same) == 1:      # the op re-emitted (a folded convolution): its slots as AMP had them
            return self.half.want.get((same[0], slot))
        return None

    def cast(self, e: Entry, dtype: str, before: Node) -> Entry:
        key = (e, dtype)
        if key not in self.casts:
            name = self.graph.unique_name("%s_amp_cast_%s" % (e.node.name, dtype))
            nd = Node("amp_cast", name, Attrs.from_values({"dtype": dtype}), [e], pos=before.pos - 0.5 + 1e-6 *
                      len(self.added))
            self.added.append(nd)
            self.casts[key] = Entry(nd)
            self.dtype[Entry(nd)] = dtype
        return self.casts[key]

    def run(self, params: Mapping[str, Any]) -> None:
        users = self.graph.consumers()
        for nd in list(self.graph.nodes):
            if nd.is_variable:
                self.dtype[Entry(nd)] = self._variable_dtype(nd, params)
                continue
            if nd.op.startswith("fused_"):
                self._fused(nd, users)
            else:
                self._stock(nd)

    def _variable_dtype(self, nd: Node, params: Mapping[str, Any]) -> str:
        if nd.name in self.half.params16:
            return FLOAT16
        if nd.name in params:
            return dtype_name(params[nd.name].dtype)
        if nd.name in self.half.declared:
            return FLOAT16
        return self.half.input_dtypes.get(nd.name) or self.half.had.get(Entry(nd)) or FLOAT32

    def _stock(self, nd: Node) -> None:
        for slot, e in enumerate(nd.inputs):
            have, want = self.dt(e), self.wanted(nd, slot)
            if want is not None and have in _FLOATS and want in _FLOATS and have != want:
                nd.inputs[slot] = self.cast(e, want, nd)
        outs = [self.amp_dtype(Entry(nd, k)) for k in range(nd.num_outputs)]
        if any(t is None for t in outs):
            outs = _node_types(nd, [self.dt(e) for e in nd.inputs]) or outs
        for k, t in enumerate(outs):
            if t is not None:
                self.dtype[Entry(nd, k)] = t

    def _fused(self, nd: Node, users) -> None:
        how = HALF_INPUTS.get(nd.op)
        if how == "product":
            slots = _product_slots(nd)
            first = self.wanted(nd, slots[0], narrowest=True) or self.dt(nd.inputs[slots[0]])
            for slot in slots:
                if self.dt(nd.inputs[slot]) in _FLOATS and self.dt(nd.inputs[slot]) != first:
                    nd.inputs[slot] = self.cast(nd.inputs[slot], first, nd)
        elif how is None:
            self._stock(nd)
            return
        computes = {self.dt(nd.inputs[s]) for s in (_product_slots(nd) if how == "product" else
                                                           range(len(nd.inputs)))}
        out = self._out_dtype(nd, users)
        if out is not None and out in _FLOATS:
            nd.attrs["out_dtype"] = out
        types = _node_types(nd, [self.dt(e) for e in nd.inputs])
        for k in range(nd.num_outputs):
            t = types[k] if types else out
            if t is not None:
                self.dtype[Entry(nd, k)] = t
        if FLOAT16 in computes:
            self.fused16[nd.op] = self.fused16.get(nd.op, 0) + 1

    def _out_dtype(self, nd: Node, users) -> Optional[str]:
        """AMP's dtype of the value the op's output 0 replaces; the narrower dtype every reader
        casts it to where there is one (the op rounds as the cast would, once)."""
        had = {self.amp_dtype(Entry(nd, k)) for k in range(nd.num_outputs)}
        had.discard(None)
        if len(had) != 1:
            return None
        out = had.pop()
        heads = {id(e.node) for e in self.graph.heads}
        readers = users.get(nd, [])
        if out == FLOAT32 and readers and id(nd) not in heads and nd.num_outputs == 1:
            wants = {self.wanted(r, slot) for r, slot in readers}
            if wants == {FLOAT16} and all(not r.op.startswith("fused_") or HALF_INPUTS.get(r.op) == "product"
                                          for r, _ in readers):
                return FLOAT16
        return out


def lower_half(graph: Graph, half: HalfGraph, origins: Mapping[Node, Sequence[Node]],
               lineage: Mapping[Entry, Entry], arg_params: Dict[str, Any], aux_params: Dict[str, Any],
               new_params: Optional[Dict[str, np.ndarray]] = None) -> Dict[str, int]:
    """Give the fused float32 graph the dtypes AMP gave it (in place; see the module docstring):
    casts put back where ops read another dtype than AMP handed them, fused ops' ``out_dtype``,
    the float16 parameters' own arrays back in ``arg_params``/``aux_params``; a parameter the rules
    made (``new_params``, NumPy arrays) that only casts to float16 read is stored in float16 (the
    same rounding, once).  Returns how many fused ops of each kind compute in float16."""
    for store in (arg_params, aux_params):
        for k in list(store):
            if k in half.params16:
                store[k] = half.params16[k]
    for nd in graph.variables():
        if nd.name in half.declared:
            nd.attrs["__dtype__"] = half.declared[nd.name]
    low = _Lowering(graph, half, origins, lineage)
    low.run({**arg_params, **aux_params})
    for k, e in enumerate(graph.heads):         # model outputs keep the dtypes AMP's graph gave them
        want = half.heads[k] if k < len(half.heads) else ""
        if want in _FLOATS and low.dt(e) in _FLOATS and low.dt(e) != want:
            graph.heads[k] = low.cast(e, want, _After(e.node))
    graph.nodes.extend(low.added)
    graph.mark_changed()
    graph.compact()
    if new_params:
        _store_cast_params(graph, new_params)
    return low.fused16


def _store_cast_params(graph: Graph, new_params: Dict[str, np.ndarray]) -> None:
    users = graph.consumers()
    forward: Dict[Entry, Entry] = {}
    for nd in graph.variables():
        if nd.name not in new_params or new_params[nd.name].dtype != np.float32:
            continue
        readers = users.get(nd, [])
        if not readers or not all(r.op == "amp_cast" and str(r.attrs.raw("dtype")) == FLOAT16 for r, _ in readers):
            continue
        new_params[nd.name] = new_params[nd.name].astype(np.float16)     # round to nearest even, as amp_cast
        for r, _ in readers:
            forward[Entry(r)] = Entry(nd)
    if not forward:
        return
    for nd in graph.nodes:
        nd.inputs = [forward.get(e, e) for e in nd.inputs]
    graph.heads = [forward.get(e, e) for e in graph.heads]
    graph.mark_changed()
    graph.compact()


class _After:
    """Where a cast of a graph output goes: just after the node writing it."""

    def __init__(self, node: Node):
        self.pos = node.pos + 0.75


def _node_types(nd: Node, in_types: Sequence[Optional[str]]) -> Optional[List[Optional[str]]]:
    """MXNet's type inference of one op from its inputs' dtypes (None where it cannot say)."""
    import mxnet as mx

    jnodes = [{"op": "null", "name": "__v%d" % i, "inputs": []} for i in range(len(nd.inputs))]
    jn = {"op": nd.op, "name": "__op", "inputs": [[i, 0, 0] for i in range(len(nd.inputs))]}
    if len(nd.attrs):
        jn["attrs"] = nd.attrs.to_json()
    jnodes.append(jn)
    n = len(nd.inputs)
    try:
        sym = mx.sym.load_json(json.dumps({
            "nodes": jnodes, "arg_nodes": list(range(n)), "node_row_ptr": list(range(n + 1)) + [n + nd.num_outputs],
            "heads": [[n, k, 0] for k in range(nd.num_outputs)], "attrs": {"mxnet_version": ["int", 10901]}}))
        known = {"__v%d" % i: t for i, t in enumerate(in_types) if t is not None}
        names = set(sym.list_arguments()) | set(sym.list_auxiliary_states())
        _, types, _ = sym.infer_type_partial(**{k: v for k, v in known.items() if k in names})
    except Exception:           # noqa: BLE001 -- unknown: the caller keeps AMP's dtype
        return None
    if types is None:
        return None
    return [dtype_name(t) if t is not None else None for t in types]


def check_lowered(symbol, half: HalfGraph, arg_params: Mapping[str, Any], aux_params: Mapping[str, Any],
                  input_shapes: Optional[Mapping[str, Sequence[int]]]) -> Optional[str]:
    """Why the lowered graph is not what AMP's was (None: MXNet infers its types, at the input
    shapes where given, and its outputs have the dtypes AMP's graph gave them)."""
    names = symbol.list_arguments() + symbol.list_auxiliary_states()
    params = {**arg_params, **aux_params}
    types = {k: params[k].dtype for k in names if k in params}
    types.update({k: v for k, v in half.input_dtypes.items() if k in names})
    try:
        if input_shapes:
            shapes = {k: tuple(v) for k, v in input_shapes.items() if k in names}
            shapes.update({k: tuple(params[k].shape) for k in names if k in params})
            symbol.infer_shape(**shapes)
        _, outs, _ = symbol.infer_type_partial(**types)
    except Exception as e:      # noqa: BLE001 -- the reason, on one line
        return "MXNet cannot infer the dtypes of the float16 graph: %s" % str(e).strip().splitlines()[-1][:300]
    got = [dtype_name(t) if t is not None else "" for t in outs]
    for k, (g, w) in enumerate(zip(got, half.heads)):
        if w and g and g != w:
            return "output %d would be %s where AMP's graph gives %s" % (k, g, w)
    return None


# ----------------------------------------------------------------------- on the CPU, as the GPU computes
#: Ops MXNet 1.9.1's CPU runs in float32 only, which a GPU runs in float16 (cuBLAS, float32 accumulation).
GPU_ONLY_HALF_OPS = ("FullyConnected", "_contrib_interleaved_matmul_selfatt_qk",
                     "_contrib_interleaved_matmul_selfatt_valatt", "_contrib_interleaved_matmul_encdec_qk",
                     "_contrib_interleaved_matmul_encdec_valatt")


def as_the_gpu_computes(symbol, arg_params: Mapping[str, Any], aux_params: Mapping[str, Any],
                        input_dtypes: Mapping[str, Any]):
    """``symbol`` runnable on MXNet's CPU where it holds float16 ops of ``GPU_ONLY_HALF_OPS``: each
    computed in float32 from its inputs widened (exact) and its output rounded to float16 once —
    the arithmetic of the GPU's float16 GEMMs with float32 accumulation, up to the summation order.
    The symbol as it is where there is none (or its dtypes cannot be inferred)."""
    import mxnet as mx

    text = symbol.tojson(remove_amp_cast=False) if hasattr(symbol, "tojson") else ""
    if not any('"%s"' % op in text for op in GPU_ONLY_HALF_OPS) or "float16" not in text and not any(
            dtype_name(v.dtype) == FLOAT16 for store in (arg_params, aux_params) for v in store.values()):
        return symbol
    graph = Graph.from_json(text)
    known = {k: dtype_name(v.dtype) for store in (arg_params, aux_params) for k, v in store.items()}
    known.update({k: dtype_name(v) for k, v in input_dtypes.items()})
    dtypes = value_dtypes(graph, known)
    if not dtypes:
        return symbol
    changed = False
    for nd in list(graph.op_nodes()):
        if nd.op not in GPU_ONLY_HALF_OPS or dtypes.get(Entry(nd)) != FLOAT16:
            continue
        wide = []
        for k, e in enumerate(nd.inputs):
            c = Node("amp_cast", graph.unique_name("%s_in%d_float32" % (nd.name, k)),
                     Attrs.from_values({"dtype": FLOAT32}), [e], pos=nd.pos - 0.5 + 0.01 * k)
            graph.nodes.append(c)
            wide.append(Entry(c))
        f32 = Node(nd.op, graph.unique_name(nd.name + "_float32"), nd.attrs, wide, pos=nd.pos - 0.1,
                   num_outputs=nd.num_outputs)
        graph.nodes.append(f32)
        nd.op, nd.attrs, nd.inputs = "amp_cast", Attrs.from_values({"dtype": FLOAT16}), [Entry(f32)]
        changed = True
    if not changed:
        return symbol
    graph.mark_changed()
    graph.compact()
    return mx.sym.load_json(graph.to_json_str())
