"""The clean-up passes of the ONNX export, over one :class:`~fusion.onnx.graph.GraphView` of the graph.

``fusion/onnx/export.py`` converts each MXNet op; these passes then clean the ONNX graph, in the order
``onnx_export`` calls them.  Each computes the same function for every input (see that module's
docstring).  A pass that replaces a chain of ops is a chain pattern (``fusion/onnx/graph.py``) and a
check on what it bound; the others (constant folding, common subexpressions, the swapped-layout
regions, the embedding sum) are plain functions over the view.

While the graph is assembled (``_finish``), on the node list:

* :func:`peephole`: Cast(int → float → int) of an input back to the input; a MatMul's bias Add folded
  into the SkipLayerNormalization that reads it; Unsqueeze of Unsqueeze as one.
* :func:`drop_identities`: Identity nodes removed.
* :func:`slice_squeeze`: ``Squeeze(Slice(x, [i], [i+1], [a]), [a])`` → ``Gather(x, i, axis=a)``.

On the model:

* :func:`fold_constants` (static shapes): ``Shape`` of a known shape, and nodes on constants alone, as
  constants.
* :func:`common_subexpressions`: equal constants and equal nodes kept once.
* :func:`expand_into_constant`: ``Expand(x·c, shape)`` → ``x·C``, C = c broadcast to the added dims.
* :func:`flip_swapped_regions` then :func:`swap_as_reshape`: regions of row-wise ops between
  (1, 0, 2) Transposes computed in the other layout.
* :func:`drop_leading_unsqueeze`: an Unsqueeze that only puts leading 1s, where broadcasting
  restores the rank.
* :func:`fused_gemm` (ORT): ``Act(Gemm(...))`` → ``FusedGemm``.
* :func:`embed_layer_norm`, :func:`mask_index_from_embedding`, :func:`repeated_lengths_as_mask_index`
  (ORT, static shapes): the embedding sum + LayerNorm as ``EmbedLayerNormalization``, attention biases
  built from an integer mask or from repeated lengths as ONNX Runtime's ``mask_index``.
"""
from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from .graph import Const, GraphView, Init, Input, Op, Var, drop_dead, is_standard, match, matches

MS = "com.microsoft"

__all__ = ["peephole", "drop_identities", "slice_squeeze", "fold_constants", "common_subexpressions",
           "expand_into_constant", "flip_swapped_regions", "swap_as_reshape", "drop_leading_unsqueeze",
           "fused_gemm", "embed_layer_norm", "mask_index_from_embedding", "repeated_lengths_as_mask_index",
           "drop_dead", "MAX_FOLDED"]


def _ms_opset(model) -> None:
    from onnx import helper
    if not any(o.domain == MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS, 1))


def _attr(node, name: str, default=None):
    from onnx import helper
    a = next((a for a in node.attribute if a.name == name), None)
    return default if a is None else helper.get_attribute_value(a)


# --------------------------------------------------------------------------------------------
# while the graph is assembled (node list, initializer dict, output names)
# --------------------------------------------------------------------------------------------

def _unsqueeze_axes(view: GraphView, n) -> Optional[List[int]]:
    if n.op_type != "Unsqueeze" or len(n.input) != 2:
        return None
    axes = view.ints(n.input[1])
    return axes if axes is not None and all(a >= 0 for a in axes) else None


def peephole(nodes: List[Any], inits: Dict[str, Any], input_types: Mapping[str, int],
             graph_outputs: frozenset = frozenset()) -> List[Any]:
    """Small exact clean-ups: Cast(int → float → int) of an input back to the input; a matmul's bias
    add folded into the SkipLayerNormalization that reads it; Unsqueeze of Unsqueeze as one."""
    from onnx import TensorProto, helper
    view = GraphView(nodes, inits, graph_outputs)
    ints = {TensorProto.INT64, TensorProto.INT32}
    out = []
    for n in nodes:
        if n.op_type == "Cast" and view.producer(n.input[0]) is not None:
            p = view.producer(n.input[0])
            while p.op_type == "Identity" and view.producer(p.input[0]) is not None:   # (trunc of whole numbers)
                p = view.producer(p.input[0])
            to = _attr(n, "to")
            if p.op_type == "Cast" and input_types.get(p.input[0]) in ints and to in ints:
                n = helper.make_node("Identity" if to == input_types[p.input[0]] else "Cast", [p.input[0]],
                                     list(n.output), name=n.name, **({} if to == input_types[p.input[0]]
                                                                     else {"to": to}))
        if n.op_type == "SkipLayerNormalization" and n.domain == MS and len(n.input) == 4:
            for slot in (0, 1):
                a = view.producer(n.input[slot])
                if a is None or a.op_type != "Add" or view.uses(n.input[slot]) != 1:
                    continue
                mm, bias = a.input
                if bias not in inits or _op_of(view, mm) != "MatMul":
                    mm, bias = bias, mm
                if bias in inits and _op_of(view, mm) == "MatMul" and len(inits[bias].dims) == 1:
                    n.input[slot] = mm
                    n.input.append(bias)
                    break
        if n.op_type == "Unsqueeze" and view.producer(n.input[0]) is not None and view.single_reader(n.input[0]):
            first, second = view.producer(n.input[0]), _unsqueeze_axes(view, n)
            a1 = _unsqueeze_axes(view, first)
            if a1 is not None and second is not None and first in out:
                dims = ["x"] * 64
                for a in sorted(a1):
                    dims.insert(a, 1)
                for a in sorted(second):
                    dims.insert(a, 1)
                axes = [i for i, d in enumerate(dims) if d == 1]
                name = view.add_init(np.array(axes, np.int64), n.output[0] + "__axes")
                out.remove(first)
                n = helper.make_node("Unsqueeze", [first.input[0], name], list(n.output), name=n.name)
        out.append(n)
    return out


def _op_of(view: GraphView, name: str) -> Optional[str]:
    p = view.producer(name)
    return None if p is None else p.op_type


def drop_identities(nodes: List[Any], inits: Mapping[str, Any], graph_outputs: set) -> List[Any]:
    """Identity nodes removed: readers read the Identity's input (a graph output keeps its name: the
    node writing the value writes it under the output's name when nothing else reads it)."""
    view = GraphView(nodes, dict(inits), graph_outputs)
    rename: Dict[str, str] = {}
    out = []
    for n in nodes:
        if n.op_type == "Identity" and is_standard(n):
            src = rename.get(n.input[0], n.input[0])
            if n.output[0] not in graph_outputs:
                rename[n.output[0]] = src
                continue
            p = view.producer(src)
            if p is not None and view.uses(n.input[0]) == 1 and src not in graph_outputs:
                for i, o in enumerate(p.output):
                    if o == src:
                        p.output[i] = n.output[0]
                continue
        for i, x in enumerate(n.input):
            if x in rename:
                n.input[i] = rename[x]
        out.append(n)
    return out


# Squeeze(Slice(x, [i], [i + 1], [a] [, [1]]), [a]): element i of x along a
SLICE_SQUEEZE = Op("Squeeze",
                   Op("Slice", Var("x"), Init("starts"), Init("ends"), Init("slice_axes"),
                      Init("steps", optional=True), arity=(4, 5), name="slice", domain=None),
                   Init("axes"), arity=(2,), name="squeeze", domain=None)


def _flat(v: Optional[np.ndarray]) -> Optional[List[int]]:
    return None if v is None else [int(a) for a in v.reshape(-1)]


def slice_squeeze(nodes: List[Any], inits: Dict[str, Any], graph_outputs: set) -> List[Any]:
    """Slice of one element along an axis then Squeeze of that axis -> Gather of that index."""
    from onnx import helper
    view = GraphView(nodes, inits, graph_outputs)
    drop = set()
    out = []
    for n in nodes:
        m = match(view, SLICE_SQUEEZE, n)
        if m is not None:
            sl = m["slice"]
            axes, starts, ends = _flat(m["axes"]), _flat(m["starts"]), _flat(m["ends"])
            steps = [1] if len(sl.input) == 4 else _flat(m["steps"])
            if len(axes) == 1 and _flat(m["slice_axes"]) == axes and steps == [1] and len(starts) == 1 and \
                    starts[0] >= 0 and ends == [starts[0] + 1]:
                idx = view.add_init(np.array(starts[0], np.int64), n.output[0] + "__index")
                drop.add(id(sl))
                n = helper.make_node("Gather", [m["x"], idx], list(n.output), name=n.name, axis=axes[0])
        out.append(n)
    return [n for n in out if id(n) not in drop]


# --------------------------------------------------------------------------------------------
# on the model
# --------------------------------------------------------------------------------------------

MAX_FOLDED = 1 << 22     # elements of one folded value (larger ones stay computed)


def fold_constants(model, known: Mapping[str, List[int]]):
    """The shapes of a static export are known: ``Shape`` of a tensor of known shape becomes a constant,
    then every standard node computing on constants alone is evaluated (once, by ONNX Runtime) and
    replaced by its value.  Values above ``MAX_FOLDED`` elements stay computed."""
    from onnx import helper, numpy_helper
    try:
        import onnxruntime as ort
    except ImportError:
        return model
    view = GraphView.of(model)
    inferred = view.static_shapes()
    if inferred is None:
        return model
    static: Dict[str, List[int]] = {**known, **inferred}
    g = model.graph
    for t in g.initializer:
        static.setdefault(t.name, list(t.dims))
    const = set(view.inits)
    shape_consts: Dict[str, np.ndarray] = {}
    folded_nodes = []
    for n in g.node:
        std = is_standard(n)
        if std and n.op_type == "Shape" and n.input[0] in static and not n.attribute:
            shape_consts[n.output[0]] = np.array(static[n.input[0]], np.int64)
            const.add(n.output[0])
        elif std and n.op_type not in ("Shape",) and not n.op_type.startswith("Random") and \
                all((not x) or x in const for x in n.input) and n.input:
            folded_nodes.append(n)
            const.update(o for o in n.output if o)
    if not folded_nodes and not shape_consts:
        return model
    folded_outs = {o for n in folded_nodes for o in n.output if o}
    needed = set()
    graph_outs = view.outputs
    for n in g.node:
        if n in folded_nodes:
            continue
        needed.update(x for x in n.input if x in folded_outs)
    needed |= graph_outs & folded_outs
    values: Dict[str, np.ndarray] = dict(shape_consts)
    if needed:
        used = {x for n in folded_nodes for x in n.input}
        inits = [t for t in g.initializer if t.name in used] + \
            [numpy_helper.from_array(v, k) for k, v in shape_consts.items() if k in used]
        outs = [helper.make_empty_tensor_value_info(o) for o in sorted(needed)]
        sub = helper.make_model(helper.make_graph(folded_nodes, "constants", [], outs, inits),
                                opset_imports=list(model.opset_import))
        sub.ir_version = model.ir_version
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        try:
            sess = ort.InferenceSession(sub.SerializeToString(), opts, providers=["CPUExecutionProvider"])
            got = sess.run(None, {})
        except Exception:
            return model
        for o, v in zip(sorted(needed), got):
            values[o] = np.asarray(v)
    if any(v.size > MAX_FOLDED for v in values.values()):
        return model      # keep the nodes that compute large values: fold nothing (rare; simple and safe)
    keep = [n for n in g.node if n not in folded_nodes and not (n.op_type == "Shape" and n.output[0] in shape_consts)]
    # values consumed by kept nodes or graph outputs become initializers
    wanted = {x for n in keep for x in n.input} | graph_outs
    new_inits = [numpy_helper.from_array(v, k) for k, v in values.items() if k in wanted and k not in graph_outs]
    for o in graph_outs & set(values):         # an output that is constant: Identity of an initializer
        name = o + "__const"
        new_inits.append(numpy_helper.from_array(values[o], name))
        keep.append(helper.make_node("Identity", [name], [o]))
    used = {x for n in keep for x in n.input}
    inits = [t for t in g.initializer if t.name in used] + [t for t in new_inits if t.name in used]
    graph = helper.make_graph(keep, g.name, list(g.input), list(g.output), inits)
    out = helper.make_model(graph, opset_imports=list(model.opset_import), producer_name=model.producer_name)
    out.ir_version = model.ir_version
    return out


def common_subexpressions(model):
    """Equal constants kept once, then nodes computing the same op on the same inputs with the same
    attributes kept once (the masks each layer of a model rebuilds from the same input)."""
    from onnx import numpy_helper
    g = model.graph
    outs = {o.name for o in g.output}
    alias: Dict[str, str] = {}
    seen: Dict[Any, str] = {}
    keep_inits = []
    for t in g.initializer:
        if t.external_data:
            keep_inits.append(t)
            continue
        key = (t.data_type, tuple(t.dims), hashlib.sha1(numpy_helper.to_array(t).tobytes()).digest())
        if key in seen:
            alias[t.name] = seen[key]
        else:
            seen[key] = t.name
            keep_inits.append(t)
    done: Dict[Any, List[str]] = {}
    nodes = []
    for n in g.node:
        for i, x in enumerate(n.input):
            n.input[i] = alias.get(x, x)
        key = (n.domain, n.op_type, tuple(n.input), len(n.output),
               tuple(sorted(a.SerializeToString() for a in n.attribute)))
        if key in done and not any(o in outs for o in n.output) and \
                not n.op_type.startswith(("Random", "Multinomial", "Bernoulli")):
            for o, prev in zip(n.output, done[key]):
                if o:
                    alias[o] = prev
            continue
        done[key] = list(n.output)
        nodes.append(n)
    if len(nodes) == len(g.node) and len(keep_inits) == len(g.initializer):
        return model
    del g.node[:]
    g.node.extend(nodes)
    del g.initializer[:]
    g.initializer.extend(keep_inits)
    return model


# Expand(x·c, shape), c one value
SCALED_EXPAND = Op("Expand", Op("Mul", Var("x"), Init("c", lambda v: v.size == 1), commutative=True, name="mul",
                                domain=None),
                   Init("shape"), name="expand", domain=None)


def expand_into_constant(model, known: Mapping[str, List[int]]):
    """Expand(x·c, shape) with c one constant value and x·c used only there: x·C with C = c broadcast to
    the dims the Expand adds (each element is the same x·c; the Expand node goes)."""
    view = GraphView.of(model)
    drop = []
    for n, m in matches(view, SCALED_EXPAND):
        if n.input[0] not in known:
            continue
        mul, c = m["mul"], m["c"]
        x_shape = list(known[n.input[0]])
        target = _flat(m["shape"])
        if len(target) < len(x_shape):
            continue
        x_full = [1] * (len(target) - len(x_shape)) + x_shape
        if any(a != 1 and a != t and t != 1 for a, t in zip(x_full, target)):
            continue
        shape = [t if a == 1 else 1 for a, t in zip(x_full, target)]
        name = view.add_init(np.full(shape, c.reshape(()), c.dtype), n.output[0] + "__scale")
        mul.input[1 if mul.input[1] == m.name("c") else 0] = name
        mul.output[0] = n.output[0]
        drop.append(n)
    for n in drop:
        model.graph.node.remove(n)
    if drop:
        view.drop_unread_initializers()
    return model


BROADCASTING = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where", "Equal", "Less", "LessOrEqual",
                "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Mod"}
ELEMENTWISE = {"Cast", "Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Floor", "Ceil", "Sign", "Not", "Relu",
               "Sigmoid", "Tanh", "Erf", "Identity"}


def drop_leading_unsqueeze(model):
    """Unsqueeze(x) that only puts 1s before x's dims (a (1, S) mask as (1, 1, 1, S)), read by one chain of
    elementwise ops that ends at a broadcasting op with another operand of at least the Unsqueeze's rank:
    the chain reads x itself.  Broadcasting aligns dims from the last, so every element gets the same
    value, and the chain's last op the same shape."""
    view = GraphView.of(model)
    static = view.static_shapes()
    if static is None:
        return model
    ranks = dict(view.inferred_ranks())
    for t in model.graph.initializer:
        ranks[t.name] = len(t.dims)
    drop = []
    for u in model.graph.node:
        if u.op_type != "Unsqueeze" or not is_standard(u) or len(u.input) != 2 or \
                u.input[1] not in view.inits or u.input[0] not in static:
            continue
        x_shape = static[u.input[0]]
        given = view.init(u.input[1])
        r = len(x_shape) + int(given.size)
        axes = sorted(int(a) % r for a in given.reshape(-1))
        dims = list(x_shape)
        for a in axes:
            dims.insert(a, 1)
        if dims[r - len(x_shape):] != x_shape:
            continue
        cur, ok = u.output[0], False
        while True:
            rs = view.readers(cur)
            if len(rs) != 1 or view.is_output(cur) or list(rs[0].input).count(cur) != 1 or not is_standard(rs[0]):
                break
            n = rs[0]
            if n.op_type in ELEMENTWISE:
                cur = n.output[0]
                continue
            if n.op_type not in BROADCASTING:
                break
            others = [ranks.get(x) for x in n.input if x != cur]
            if any(k is None for k in others):
                break
            if any(k >= r for k in others):
                ok = True
                break
            cur = n.output[0]
        if ok:
            reader = view.readers(u.output[0])[0]
            reader.input[list(reader.input).index(u.output[0])] = u.input[0]
            drop.append(u)
    for u in drop:
        model.graph.node.remove(u)
    if drop:
        view.drop_unread_initializers()
    return model


SWAP = [1, 0, 2]
_UNARY_SWAP = ELEMENTWISE | {"Gelu"}
_BINARY_SWAP = BROADCASTING - {"Xor", "Mod"}
_LAST_AXIS_SWAP = {("", "LayerNormalization"): 1, (MS, "SkipLayerNormalization"): 2, (MS, "BiasGelu"): 1,
                   (MS, "FastGelu"): 1, (MS, "Gelu"): 1, ("", "MatMul"): 1, ("", "Softmax"): 1}


def _is_swap(n) -> bool:
    return n.op_type == "Transpose" and is_standard(n) and \
        [list(a.ints) for a in n.attribute if a.name == "perm"] == [SWAP]


def _ranks(view: GraphView) -> Dict[str, int]:
    """The rank of each value ONNX's shape inference knows, then through the ops ONNX Runtime's contrib
    ops that keep their first input's shape."""
    rank = dict(view.inferred_ranks())
    for t in view.graph.initializer:
        rank[t.name] = len(t.dims)
    for n in view.nodes:
        if n.output and n.output[0] and n.output[0] not in rank and n.input and n.input[0] in rank:
            if n.domain == MS and n.op_type in ("SkipLayerNormalization", "BiasGelu", "FastGelu", "Gelu",
                                                "Attention", "MultiHeadAttention", "EmbedLayerNormalization"):
                rank[n.output[0]] = rank[n.input[0]] if n.op_type != "EmbedLayerNormalization" else 3
            elif n.op_type == "Transpose":
                rank[n.output[0]] = rank[n.input[0]]
            elif n.op_type == "MatMul" and n.input[1] in rank:
                rank[n.output[0]] = max(rank[n.input[0]], rank[n.input[1]])
            elif n.op_type in _UNARY_SWAP:
                rank[n.output[0]] = rank[n.input[0]]
            elif n.op_type in _BINARY_SWAP and all(x in rank for x in n.input):
                rank[n.output[0]] = max(rank[x] for x in n.input)
    return rank


def _swapping_inputs(n, inits, const, rank) -> Optional[List[str]]:
    """The inputs of n that swap with its output, when n computes each (s, b) row on its own."""
    key = (n.domain if n.domain != "ai.onnx" else "", n.op_type)
    if key[0] == "" and n.op_type in _UNARY_SWAP and len(n.input) == 1:
        ins = [n.input[0]]
    elif key[0] == "" and n.op_type in _BINARY_SWAP:
        ins = [x for x in n.input if x not in const]
        for x in n.input:
            if x in const and (x not in inits or len(inits[x].dims) > 3):
                return None
    elif key in _LAST_AXIS_SWAP:
        k = _LAST_AXIS_SWAP[key]
        ins = list(n.input[:k])
        if any(x in const or not x for x in ins) or any(x and x not in inits for x in n.input[k:]):
            return None
        if n.op_type == "MatMul" and len(inits[n.input[1]].dims) != 2:
            return None
        axis = _attr(n, "axis")
        if n.op_type in ("LayerNormalization", "Softmax") and axis is not None and axis not in (-1, 2):
            return None
        if any(o for o in n.output[1:]):
            return None
    else:
        return None
    if not ins or any(rank.get(x) != 3 for x in ins) or rank.get(n.output[0]) != 3:
        return None
    return ins


def _best_region(view: GraphView):
    """(gain, values, nodes) of the region whose flip takes away the most Transposes, else None."""
    inits = view.inits
    const = set(inits) | {n.output[0] for n in view.nodes if n.op_type == "Constant"}
    rank = _ranks(view)
    done = set()
    best = None
    for seed in view.nodes:
        if not _is_swap(seed) or seed.output[0] in done:
            continue
        region, todo, inner = set(), [seed.output[0]], {}
        while todo:
            v = todo.pop()
            if v in region:
                continue
            region.add(v)
            p = view.producer(v)
            around = ([p] if p is not None else []) + view.readers(v)
            for n in around:
                if id(n) in inner or _is_swap(n):
                    continue
                ins = _swapping_inputs(n, inits, const, rank)
                if ins is None:
                    continue
                inner[id(n)] = n
                todo += [x for x in ins if x not in region] + [n.output[0]]
        done |= region
        gain = 0
        for v in region:
            p = view.producer(v)
            if p is None or id(p) not in inner:
                gain += 1 if p is not None and _is_swap(p) else -1
            back = view.is_output(v)
            for r in view.readers(v):
                if id(r) in inner:
                    continue
                if _is_swap(r):     # a graph output: v swapped written under its name when only it reads v
                    gain += 1 if not view.is_output(r.output[0]) or \
                        (len(view.readers(v)) == 1 and not view.is_output(v)) else 0
                else:
                    back = True
            gain -= 1 if back else 0
        if gain > 0 and (best is None or gain > best[0]):
            best = (gain, region, inner)
    return best


def _flip(view: GraphView, region: set, inner: Dict[int, Any]) -> None:
    """The values of ``region`` computed by the nodes ``inner`` in the swapped layout (in place)."""
    from onnx import helper
    g = view.graph
    inits = dict(view.inits)
    outs = view.outputs
    taken = {x for n in g.node for x in list(n.input) + list(n.output)} | set(inits) | \
        {i.name for i in g.input} | outs
    flip = {}
    for v in sorted(region):
        name, k = v + "__sw", 1
        while name in taken:
            name, k = "%s__sw%d" % (v, k), k + 1
        taken.add(name)
        flip[v] = name
    nodes: List[Any] = []
    swapped_consts: Dict[str, str] = {}

    def swap_const(x):
        if x in swapped_consts:
            return swapped_consts[x]
        a = view.init(x)
        if a.ndim <= 1:
            swapped_consts[x] = x
            return x
        a = a.reshape((1,) * (3 - a.ndim) + a.shape).transpose(SWAP)
        swapped_consts[x] = view.add_init(np.ascontiguousarray(a), view.fresh(x + "__sw"))
        return swapped_consts[x]

    alias: Dict[str, str] = {}
    for i in g.input:       # graph inputs in the region: swapped once
        if i.name in region:
            nodes.append(helper.make_node("Transpose", [i.name], [flip[i.name]], perm=SWAP))
    for n in g.node:
        if id(n) in inner:
            new = helper.make_node(n.op_type, [], [], name=n.name, domain=n.domain)
            new.CopyFrom(n)
            k = _LAST_AXIS_SWAP.get((n.domain if n.domain != "ai.onnx" else "", n.op_type))
            for i, x in enumerate(n.input):
                if x in flip:
                    new.input[i] = flip[x]
                elif x and k is None and x in inits:
                    new.input[i] = swap_const(x)
            new.output[0] = flip[n.output[0]]
            nodes.append(new)
            continue
        if _is_swap(n) and n.output[0] in region and n.input[0] not in region:
            alias[flip[n.output[0]]] = n.input[0]        # T(x) swapped back is x
            continue
        if _is_swap(n) and n.input[0] in region and n.output[0] not in region:
            if n.output[0] in outs:                     # a graph output: v swapped under its name
                nodes.append(helper.make_node("Identity", [flip[n.input[0]]], [n.output[0]]))
            else:
                alias[n.output[0]] = flip[n.input[0]]    # T(v) is v swapped
            continue
        nodes.append(n)
        for o in n.output:
            if o in region:        # produced outside the region: swapped once
                nodes.append(helper.make_node("Transpose", [o], [flip[o]], perm=SWAP))
    # values read outside the region: swapped back once, under their own name
    final = []
    for n in nodes:
        final.append(n)
        if n.output and n.output[0] in flip.values():
            v = next(k for k, f in flip.items() if f == n.output[0])
            if v in outs or any(id(r) not in inner and not _is_swap(r) for r in view.readers(v)):
                final.append(helper.make_node("Transpose", [n.output[0]], [v], perm=SWAP))
    for n in final:
        for i, x in enumerate(n.input):
            seen = set()
            while x in alias and x not in seen:
                seen.add(x)
                x = alias[x]
            n.input[i] = x
    final = drop_identities(final, inits, outs)
    del g.node[:]
    g.node.extend(final)
    view.drop_dead()


def flip_swapped_regions(model):
    """GluonNLP's models run in (S, B, C) and transpose to (B, S, C) around each attention: a region of ops
    that each compute every (s, b) row on its own (MatMul by a weight, SkipLayerNormalization, BiasGelu,
    elementwise ops) is computed in the swapped layout instead wherever that takes away more Transposes
    (perm 1, 0, 2) at its edges than it adds: its constants are swapped alike, a value read outside
    the region (a graph output, another op) is swapped back once.  Each element is computed by the
    same ops from the same operands."""
    for _ in range(8):
        view = GraphView.of(model)
        best = _best_region(view)
        if best is None:
            break
        _flip(view, best[1], best[2])
    return swap_as_reshape(model)


# Transpose(1, 0, 2) of Reshape(y)
SWAPPED_RESHAPE = Op("Transpose", Op("Reshape", Var("y"), name="reshape", domain=None), where=_is_swap,
                     name="transpose")


def swap_as_reshape(model):
    """Transpose (1, 0, 2) of Reshape(y) read only there, the swapped dims one of them 1 (the order of the
    elements unchanged): one Reshape of y to the swapped shape."""
    view = GraphView.of(model)
    static = view.static_shapes()
    if static is None:
        return model
    drop = []
    for n, m in matches(view, SWAPPED_RESHAPE):
        shape = static.get(n.input[0])
        if shape is None or len(shape) != 3 or 1 not in shape[:2]:
            continue
        name = view.add_init(np.array([shape[1], shape[0], shape[2]], np.int64), view.fresh(n.output[0] + "__shape"))
        del n.attribute[:]
        n.op_type = "Reshape"
        n.input[0] = m["y"]
        n.input.append(name)
        drop.append(m["reshape"])
    for r in drop:
        model.graph.node.remove(r)
    return drop_dead(model) if drop else model


GEMM_ACTIVATIONS = {"Relu": (), "Tanh": (), "Sigmoid": (), "LeakyRelu": (("alpha", 0.01),),
                    "HardSigmoid": (("alpha", 0.2), ("beta", 0.5))}
# an activation of a Gemm's result
GEMM_ACT = Op(tuple(GEMM_ACTIVATIONS), Op("Gemm", name="gemm"), name="act")


def fused_gemm(model):
    """Gemm then an activation (Tanh of BERT's pooler), the Gemm's result read only there: ONNX Runtime's
    FusedGemm (the activation applied to the Gemm's result by the same kernels)."""
    from onnx import TensorProto, helper
    view = GraphView.of(model)
    floats = {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    drop = []
    for act, m in matches(view, GEMM_ACT):
        gemm = m["gemm"]
        if not all(x in floats for x in gemm.input[1:] if x):
            continue
        extra = {"activation": act.op_type}
        params = [float(_attr(act, k, d)) for k, d in GEMM_ACTIVATIONS[act.op_type]]
        if params:
            extra["activation_alpha"] = params[0]
        if len(params) > 1:
            extra["activation_beta"] = params[1]
        attrs = {a.name: helper.get_attribute_value(a) for a in gemm.attribute}
        gemm.CopyFrom(helper.make_node("FusedGemm", list(gemm.input), list(act.output), name=gemm.name or act.name,
                                       domain=MS, **attrs, **extra))
        drop.append(act)
    for a in drop:
        model.graph.node.remove(a)
    if drop:
        _ms_opset(model)
    return model


def _embedding_sum(view: GraphView, ln):
    """(gathers, position constant, inner Adds, gamma, beta, eps) when LayerNorm ``ln`` reads
    word[ids] (+ segment[types]) + P through Adds read only there; else None."""
    if ln.op_type == "LayerNormalization" and is_standard(ln) and len(ln.output) == 1 and \
            all(a.name != "axis" or a.i == -1 for a in ln.attribute):
        roots, gamma, beta = [ln.input[0]], ln.input[1], ln.input[2] if len(ln.input) > 2 else ""
    elif ln.op_type == "SkipLayerNormalization" and ln.domain == MS and len(ln.input) == 4 and len(ln.output) == 1:
        roots, gamma, beta = [ln.input[0], ln.input[1]], ln.input[2], ln.input[3]
    else:
        return None
    eps = next((a.f for a in ln.attribute if a.name == "epsilon"), 1e-5)
    leaves, inner = [], []
    todo = list(roots)
    while todo:
        x = todo.pop()
        p = view.producer(x)
        if p is not None and p.op_type == "Add" and view.single_reader(x):
            inner.append(p)
            todo += list(p.input)
        else:
            leaves.append(x)
    gathers, consts = [], []
    for x in leaves:
        p = view.producer(x)
        if p is not None and p.op_type == "Gather" and view.single_reader(x) and p.input[0] in view.inits and \
                p.input[1] in view.inputs and all(a.name != "axis" or a.i == 0 for a in p.attribute):
            gathers.append(p)
        elif x in view.inits:
            consts.append(x)
        else:
            return None
    if len(consts) != 1 or len(gathers) not in (1, 2) or gamma not in view.inits or \
            (beta and beta not in view.inits):
        return None
    return gathers, consts[0], inner, gamma, beta, eps


def embed_layer_norm(model):
    """word[ids] (+ segment[types]) + P -> LayerNorm, P a constant (S, H) block of position rows and ids
    graph inputs of static shape (B, S): ONNX Runtime's EmbedLayerNormalization, whose default
    positions 0..S-1 read exactly P."""
    from onnx import TensorProto, helper
    g = model.graph
    changed = True
    while changed:            # the graph changed: look again
        changed = False
        view = GraphView.of(model)
        for ln in g.node:
            got = _embedding_sum(view, ln)
            if got is None:
                continue
            gathers, pos_name, inner, gamma, beta, eps = got
            ids = [view.inputs[p.input[1]] for p in gathers]
            dims = [[d.dim_value if d.HasField("dim_value") else None for d in i.type.tensor_type.shape.dim]
                    for i in ids]
            if any(len(d) != 2 or None in d or d != dims[0] for d in dims) or \
                    any(i.type.tensor_type.elem_type not in (TensorProto.INT64, TensorProto.INT32) for i in ids):
                continue
            pos = view.init(pos_name)
            tables = [view.init(p.input[0]) for p in gathers]
            hidden = tables[0].shape[-1]
            if pos.shape not in ((dims[0][1], hidden), (1, dims[0][1], hidden)) or \
                    any(t.ndim != 2 or t.shape[1] != hidden for t in tables):
                continue
            new, names = [], []
            for i in ids:
                if i.type.tensor_type.elem_type == TensorProto.INT32:
                    names.append(i.name)
                else:
                    names.append(i.name + "__int32")
                    new.append(helper.make_node("Cast", [i.name], [names[-1]], to=TensorProto.INT32))
            pname = view.add_init(pos.reshape(dims[0][1], hidden), pos_name + "__rows")
            if not beta:
                beta = view.add_init(np.zeros(hidden, np.float32), ln.output[0] + "__beta")
            ins = [names[0], names[1] if len(names) > 1 else "", gathers[0].input[0], pname,
                   gathers[1].input[0] if len(gathers) > 1 else "", gamma, beta]
            new.append(helper.make_node("EmbedLayerNormalization", ins,
                                        [ln.output[0], ln.output[0] + "__mask_index"], name=ln.name, domain=MS,
                                        epsilon=eps))
            drop = {id(n) for n in inner + gathers + [ln]}
            nodes = []
            for n in g.node:
                if id(n) == id(ln):
                    nodes += new
                elif id(n) not in drop:
                    nodes.append(n)
            del g.node[:]
            g.node.extend(nodes)
            view.drop_unread_initializers()
            _ms_opset(model)
            changed = True
            break
    return model


def _to(t: int):
    return lambda n: _attr(n, "to") == t


def _all_equal(v: np.ndarray) -> bool:
    return bool(v.size) and bool(np.all(v == v.reshape(-1)[0])) and v.ndim <= 4


def _scalar(value: Optional[float] = None):
    return lambda v: v.size == 1 and (value is None or float(v.reshape(-1)[0]) == value)


def _shared(op_type: str, *inputs, **kw) -> Op:
    """An op of a chain whose values may be read elsewhere too (the chain's nodes stay where they are)."""
    return Op(op_type, *inputs, one_reader=False, **kw)


def _mask_pattern() -> Op:
    from onnx import TensorProto
    f32 = _to(TensorProto.FLOAT)
    ones = _shared("Cast", _shared("Equal", _shared("Cast", Input("m")), Const("one", _scalar(1.0)), commutative=True),
                   where=f32)
    count = _shared("Reshape", _shared("ReduceSum", ones, name="sum"), name="count")
    beyond = _shared("Cast", _shared("GreaterOrEqual", Const("keys"), count), where=f32)
    return Op("Mul", _shared("Unsqueeze", beyond, optional=True), Const("c", _all_equal), commutative=True,
              name="mul")


# c·[j ≥ count(m_b == 1)] (an optional Unsqueeze to (B, 1, 1, Sk)); nothing here need be read only once
COUNT_MASK = _mask_pattern()


def mask_index_from_embedding(model):
    """ONNX Runtime's own mask: an attention bias c·[key j ≥ L_b], L_b the number of ones in row b of an
    integer graph input m (what our importer reads ORT's EmbedLayerNormalization mask_index as), becomes
    that mask_index again: m (as int32, as the file's other ids) into the EmbedLayerNormalization, its
    mask_index output into each Attention (keys at or past the end position get ``mask_filter_value``
    c added, the same as the bias)."""
    from onnx import TensorProto, helper
    g = model.graph
    view = GraphView.of(model)
    static = view.static_shapes()
    if static is None:
        return model

    def mask_of(bias):
        """(graph input m, c, B, Sk) when ``bias`` is c·[j ≥ count(m_b == 1)] of shape (B, 1, Sq, Sk)."""
        mul = view.producer(bias, "Mul")
        if mul is None or bias not in static or len(static[bias]) != 4:
            return None
        m = match(view, COUNT_MASK, mul)
        if m is None:
            return None
        b, one, sq, sk = static[bias]
        cv = m["c"]
        pe = mul.input[0] if mul.input[1] == m.name("c") else mul.input[1]
        if pe not in static or (static[pe] not in ([b, sk], [b, 1, 1, sk]) or (static[pe] == [b, sk] and b != 1)):
            return None
        if list(cv.shape[-4:]) not in ([1, 1, sq, 1], [1, 1, 1, 1], [sq, 1], [1], []) or one != 1:
            return None
        keys = m["keys"]
        if keys.reshape(-1).tolist() != list(range(sk)) or keys.ndim > 2:
            return None
        if static.get(m.name("count")) != [b, 1] or static.get(m["count"].input[0]) != [b]:
            return None
        red = m["sum"]
        axes = _attr(red, "axes")
        if axes is not None:
            axes = list(axes)
        elif len(red.input) > 1 and red.input[1]:
            axes = view.ints(red.input[1], constants=True)
        if axes not in ([1], [-1]):
            return None
        name = m["m"]
        if view.inputs[name].type.tensor_type.elem_type not in (TensorProto.INT64, TensorProto.INT32) or \
                static.get(name) != [b, sk]:
            return None
        return name, float(cv.reshape(-1)[0]), b, sk

    elns = [n for n in g.node if n.op_type == "EmbedLayerNormalization" and n.domain == MS]
    if len(elns) != 1:
        return model
    eln = elns[0]
    ids = view.producer(eln.input[0])
    ids_name = ids.input[0] if ids is not None and ids.op_type == "Cast" else eln.input[0]
    done: Dict[str, Any] = {}
    changed = False
    for att in g.node:
        if att.op_type != "Attention" or att.domain != MS or len(att.input) != 6 or any(att.input[3:5]) or \
                any(a.name in ("mask_filter_value", "past_present_share_buffer") for a in att.attribute):
            continue
        got = mask_of(att.input[5])
        if got is None or static.get(ids_name) != [got[2], got[3]]:
            continue
        m, c, _, _ = got
        if len(eln.input) > 7 and eln.input[7]:
            if done.get("mask") != m:
                continue
        else:
            m32 = m
            if view.inputs[m].type.tensor_type.elem_type != TensorProto.INT32:
                m32 = view.fresh(m + "__int32")
                g.node.insert(list(g.node).index(eln), helper.make_node("Cast", [m], [m32], to=TensorProto.INT32))
            while len(eln.input) < 7:
                eln.input.append("")
            eln.input.append(m32)
            done["mask"] = m
        del att.input[3:]
        att.input.append(eln.output[1])
        att.attribute.append(helper.make_attribute("mask_filter_value", c))
        changed = True
    return drop_dead(model) if changed else model


def _lengths_pattern() -> Op:
    from onnx import TensorProto
    lengths = _shared("Add", _shared("Reshape", Var("lengths"), Const("r1_shape")), Const("zeros"), commutative=True)
    as_int = _shared("Cast", lengths, where=_to(TensorProto.INT32))
    unsqueezed = _shared("Unsqueeze", as_int, Const("un_axes", lambda v: _flat(v) == [1]))
    repeated = _shared("Reshape", _shared("Expand", unsqueezed, Const("ex_shape")), Const("r2_shape"))
    per_key = _shared("Reshape", _shared("Cast", repeated), Const("r4_shape"))
    keys = Const("keys", lambda v: v.ndim == 1 and v.tolist() == list(range(v.size)))
    return Op("Where", _shared("Less", keys, per_key), Const("zero", _scalar(0.0)), Const("d", _scalar()), name="where")


# d·[k ≥ L], L (B, H, Sq, 1) valid_length (B,) reshaped to (B, 1), plus zeros (1, Sq), to int32, repeated
# over the heads (as GluonNLP builds it); nothing here need be read only once
REPEATED_LENGTHS = _lengths_pattern()


def _lengths(view: GraphView, bias: str):
    """(length value (B,), d) when ``bias`` is d·[k ≥ L] as REPEATED_LENGTHS draws it; else None."""
    w = view.producer(bias)
    m = None if w is None else match(view, REPEATED_LENGTHS, w)
    if m is None:
        return None
    shape4 = _flat(m["r4_shape"])
    if len(shape4) != 4 or shape4[3] != 1 or min(shape4) < 1:
        return None
    b, h, sq, _ = shape4
    if _flat(m["r2_shape"]) != [b * h, sq] or _flat(m["ex_shape"]) != [b, h, sq]:
        return None
    z = m["zeros"]
    if z.shape != (1, sq) or np.any(z) or _flat(m["r1_shape"]) not in ([b, 1], [-1, 1]):
        return None
    return m["lengths"], float(m["d"].reshape(-1)[0]), b


def repeated_lengths_as_mask_index(model):
    """An attention bias d·[key k ≥ L] whose lengths L (B, H, Sq, 1) repeat one length per batch element,
    built as GluonNLP builds them (valid_length (B,) reshaped to (B, 1), plus zeros (1, Sq), to int32,
    repeated over the heads): that length as ONNX Runtime's mask_index (B,), d as its mask_filter_value
    (keys at or past the length get d added to their scores, the others nothing)."""
    from onnx import TensorProto, helper
    g = model.graph
    view = GraphView.of(model)
    changed, done = False, {}
    for att in g.node:
        if att.op_type != "Attention" or att.domain != MS or len(att.input) != 6 or any(att.input[3:5]) or \
                any(a.name == "mask_filter_value" for a in att.attribute):
            continue
        got = _lengths(view, att.input[5])
        if got is None:
            continue
        vl, d, b = got
        if vl not in done:
            done[vl] = view.fresh(vl + "__mask_index")
            where = view.producer(att.input[5])
            at = list(g.node).index(where) if where is not None else 0
            g.node.insert(at, helper.make_node("Cast", [vl], [done[vl]], to=TensorProto.INT32))
        del att.input[3:]
        att.input.append(done[vl])
        att.attribute.append(helper.make_attribute("mask_filter_value", d))
        changed = True
    return drop_dead(model) if changed else model
