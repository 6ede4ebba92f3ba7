"""ONNX export: ``export_onnx`` writes a (fused) MXNet model as an ONNX file, checked in ONNX Runtime.

Stock MXNet ops go through MXNet 1.9.1's own converters (``mx.onnx``, opset-13 converters)
except the ones it lacks or writes wrongly, which are written here from the shapes MXNet
infers for the graph (``facts.infer``): ``Reshape`` with MXNet's special codes (0, -1, -2, -3,
-4, ``reverse``) gets an explicit target (or, with ``dynamic``, one computed from ``Shape``),
``LayerNorm`` becomes ``LayerNormalization`` from opset 17.  The fused ops get the best form of
the target:

=====================  ===========================================  ==========================================
fused op               ``target="ort"`` (ONNX Runtime contrib ops)   ``target="standard"`` (ai.onnx only)
=====================  ===========================================  ==========================================
fused_dense            MatMul (pre-transposed weight) + BiasGelu /  MatMul + Add + Gelu (opset 20) or its erf /
                       FastGelu, or + Add + activation              tanh form
fused_add_layer_norm   SkipLayerNormalization (a matmul's bias       Add + LayerNormalization (opset 17) or its
                       folded into it)                              ops
fused_attention        Attention (q/k/v projections of one input     the stock ops ``fusion.unfuse`` writes
                       packed into its weight) or MultiHeadAttention  (batch_dot, softmax [lengths], masks)
                       (masks as lengths / attention bias, causal
                       as ``unidirectional``)
fused_elemwise         the expression's ops                         the same
fused_box_nms,         MXNet's own op (``_contrib_box_nms``,        the same
fused_max_pool,        ``Pooling``, ``_contrib_ROIAlign``) through
fused_roi_align        MXNet's converter (it has none for ROIAlign:
                       the original's error)
fused_bilinear_resize  Resize (linear; align_corners or              the same (also for MXNet's own
                       pytorch_half_pixel, MXNet's output size)     _contrib_BilinearResize2D)
fused_region           its program's stock ops (``fusion.unfuse``:  the same
                       Conv, pooling, Concat, BatchNormalization,
                       Add, Mul, activations)
=====================  ===========================================  ==========================================

A fused op with no form for the target (an attention layout or mask the contrib ops cannot
express) is un-fused (``fusion.unfuse(nodes=...)``) and its stock ops exported instead.  Then
the graph is cleaned: single assignment restored (MXNet's converters can write one name twice),
weights are initializers only (not graph inputs), dead nodes and initializers dropped, integer
inputs (token ids) keep their dtype, ops whose spelling changed after opset 13 (``Reduce*`` axes,
``Split``) are written in the form of the output opset; regions of row-wise ops between (1, 0, 2)
Transposes (GluonNLP's (S, B, C) layers) computed in the other layout where that takes Transposes
away; for static shapes constants are folded, equal constants and common subexpressions kept once,
an Unsqueeze that only puts leading 1s before a value dropped where broadcasting restores the rank,
and (``ort``) the embedding sum + LayerNorm written as ``EmbedLayerNormalization``, an attention bias
built from the count of ones of an integer mask (ORT's own mask_index, read back) as that mask_index,
a Gemm and its activation as ``FusedGemm``.  Every clean-up computes the same function for every
input (EmbedLayerNormalization and a bias folded into SkipLayerNormalization add the same terms in
another order); none assumes what an input holds (ONNX Runtime's optimizer reads a 0/1 mask as
right-padded lengths; an exported additive mask stays ``(1 - m)·c`` for any m).  Integer inputs are
read as int32 where ONNX Runtime's embedding ops need it, as ORT's optimizer casts them.  The clean-up
passes live in ``fusion/onnx/passes.py``; this module converts and assembles the graph, then calls them.

An export that fails raises :class:`OnnxExportError` naming the node that stopped it.
"""
from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from . import passes as passes
from ..ir.errors import FusionError, GraphError, VerificationError
from ..check.verify import DEFAULT_RTOL, VerifyResult, compare, random_inputs, run
from ..precision.policy import dtype_name, np_dtype

__all__ = ["export_onnx", "OnnxExportError", "FUSED_OP_EXPORTERS", "node_io", "DEFAULT_OPSET", "OPSET_RANGE",
           "TARGETS", "onnx_opset_of"]

DEFAULT_OPSET = 17          # LayerNormalization; what torch's exporter writes by default
OPSET_RANGE = (13, 21)
TARGETS = ("ort", "standard")
MS = "com.microsoft"
_CONVERTER_OPSET = 13       # MXNet's converters are written for opsets 12 and 13


class OnnxExportError(GraphError):
    """The ONNX export stopped at ``node`` (its op ``op``)."""

    def __init__(self, message: str, node: Optional[str] = None, op: Optional[str] = None):
        self.node, self.op = node, op
        where = "" if node is None else "at node '%s' (%s): " % (node, op)
        super().__init__("ONNX export stopped %s%s" % (where, message) if node is not None else message)


class _NeedsUnfuse(Exception):
    """A fused op with no form for the target: exported through its stock ops instead."""


def _first_line(e: Any) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def onnx_opset_of(path: str) -> Optional[int]:
    """The ai.onnx opset an ONNX file imports (None if unreadable)."""
    try:
        import onnx
        model = onnx.load(path, load_external_data=False)
    except Exception:
        return None
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return None


# --------------------------------------------------------------------------------------------
# conversion state: facts of the graph being exported, read by the converters
# --------------------------------------------------------------------------------------------

class _State:
    def __init__(self, graph_json, shapes, dtypes, target: str, opset: int, dynamic: bool):
        self.nodes = graph_json["nodes"]
        self.shapes: Dict[Tuple[int, int], Tuple[int, ...]] = shapes
        self.dtypes: Dict[Tuple[int, int], str] = dtypes
        self.target, self.opset, self.dynamic = target, opset, dynamic
        from ..engine.inputs import SHAPE_ONLY
        # readers of each value, those reading only its shape left out (a projection packed into
        # Attention still feeds them; static exports fold them away)
        self.uses: Dict[Tuple[int, int], int] = {}
        for node in self.nodes:
            for slot, e in enumerate(node.get("inputs", [])):
                if (node["op"], slot) not in SHAPE_ONLY:
                    self.uses[(e[0], e[1])] = self.uses.get((e[0], e[1]), 0) + 1
        for e in graph_json["heads"]:
            self.uses[(e[0], e[1])] = self.uses.get((e[0], e[1]), 0) + 1
        self.unfuse: List[str] = []          # fused nodes to export through their stock ops
        self.cache: Dict[Any, str] = {}      # shared helper values (masks expanded once)
        self.names: set = set()
        self.seq_dims: List[Tuple[str, int]] = []   # (tensor, axis) of Sq and Sk of the attention exported
        self.int_inputs: set = set()         # graph inputs the file holds as integers


_LOCAL = threading.local()


def _st() -> _State:
    return _LOCAL.state


def _fresh(base: str) -> str:
    st = _st()
    name, i = base, 1
    while name in st.names:
        name, i = "%s_%d" % (base, i), i + 1
    st.names.add(name)
    return name


def node_io(node: Dict[str, Any], kwargs: Mapping[str, Any]) -> Tuple[str, List[str], Dict[str, str]]:
    """(output name, ONNX names of the inputs, MXNet attributes) of ``node``, for an exporter function."""
    from mxnet.onnx.mx2onnx._op_translations._op_translations_opset12 import get_inputs
    return get_inputs(node, kwargs)


def _in_shape(node, i: int) -> Optional[Tuple[int, ...]]:
    e = node["inputs"][i]
    return _st().shapes.get((e[0], e[1]))


def _in_node(node, i: int) -> Tuple[int, Dict[str, Any]]:
    e = node["inputs"][i]
    return e[0], _st().nodes[e[0]]


def _out_shape(kwargs, k: int = 0) -> Optional[Tuple[int, ...]]:
    return _st().shapes.get((kwargs["idx"], k))


def _attr_bool(attrs: Mapping[str, str], key: str, default: bool) -> bool:
    return str(attrs.get(key, default)).strip().lower() in ("true", "1")


def _const_tensor(kwargs, name: str, value) -> str:
    """Add ``value`` as an initializer (named ``name``, made unique); returns its name."""
    from onnx import numpy_helper
    name = _fresh(name)
    kwargs["initializer"].append(numpy_helper.from_array(np.asarray(value), name))
    return name


def _i64(kwargs, name: str, values) -> str:
    return _const_tensor(kwargs, name, np.asarray(values, np.int64))


def _f32(kwargs, name: str, value) -> str:
    return _const_tensor(kwargs, name, np.asarray(value, np.float32))


def _param(kwargs, name: str) -> Optional[np.ndarray]:
    w = kwargs.get("weights", {}).get(name)
    return None if w is None else np.asarray(w)


# --------------------------------------------------------------------------------------------
# Reshape: MXNet's special codes resolved
# --------------------------------------------------------------------------------------------

def _reshape_plan(codes: Sequence[int], in_rank: int) -> Optional[List[Tuple]]:
    """Per output dim: ("in", j) input dim j, ("mul", j, j+1), ("const", c), ("infer",), or
    ("split", j, part, other) — MXNet's Reshape codes (not reversed) read against an input of
    rank ``in_rank``; None when the codes do not read as MXNet reads them."""
    plan: List[Tuple] = []
    j, i = 0, 0
    codes = list(codes)
    while i < len(codes):
        c = codes[i]
        if c > 0:
            plan.append(("const", c))
            j += 1
        elif c == 0:
            if j >= in_rank:
                return None
            plan.append(("in", j))
            j += 1
        elif c == -1:
            plan.append(("infer",))
            j += 1
        elif c == -2:
            plan += [("in", t) for t in range(j, in_rank)]
            j = in_rank
        elif c == -3:
            if j + 1 >= in_rank:
                return None
            plan.append(("mul", j, j + 1))
            j += 2
        elif c == -4:
            if i + 2 >= len(codes) or j >= in_rank:
                return None
            a, b = codes[i + 1], codes[i + 2]
            if a == -1 and b > 0:
                plan += [("div", j, b), ("const", b)]
            elif b == -1 and a > 0:
                plan += [("const", a), ("div", j, a)]
            elif a > 0 and b > 0:
                plan += [("const", a), ("const", b)]
            else:
                return None
            j += 1
            i += 2
        else:
            return None
        i += 1
    return plan


def _export_reshape(node, **kwargs):
    """MXNet Reshape/reshape: the target its codes give for the inferred shapes (explicit), or with a
    dynamic export, ONNX codes 0/-1 where they say the same and Shape-computed dims elsewhere."""
    from onnx import helper
    name, inputs, attrs = node_io(node, kwargs)
    out = _out_shape(kwargs)
    x_shape = _in_shape(node, 0)
    if out is None:
        raise GraphError("the output shape of Reshape is unknown (pass the input shapes)")
    codes = [int(c) for c in re.findall(r"-?\d+", str(attrs.get("shape", "()")))]
    reverse = _attr_bool(attrs, "reverse", False)
    st = _st()
    target: List[Any] = list(out)
    nodes: List[Any] = []
    if st.dynamic and x_shape is not None and not reverse:
        plan = _reshape_plan(codes, len(x_shape))
        if plan is not None and len(plan) == len(out):
            infer = sum(1 for p in plan if p[0] == "infer")
            parts, dynamic_parts = [], False
            shape_name = None
            for i, p in enumerate(plan):
                if p[0] == "in" and p[1] == i:
                    parts.append(0)
                elif p[0] == "infer" and infer == 1:
                    parts.append(-1)
                elif p[0] == "const":
                    parts.append(int(p[1]))
                elif p[0] in ("in", "mul", "div"):
                    if shape_name is None:
                        shape_name = _fresh(name + "_inshape")
                        nodes.append(helper.make_node("Shape", [inputs[0]], [shape_name]))
                    g = _fresh(name + "_d%d" % i)
                    nodes.append(helper.make_node("Gather", [shape_name, _i64(kwargs, name + "_ix", [p[1]])], [g],
                                                  axis=0))
                    if p[0] == "mul":
                        g2 = _fresh(name + "_d%db" % i)
                        nodes.append(helper.make_node("Gather", [shape_name, _i64(kwargs, name + "_ix", [p[2]])],
                                                      [g2], axis=0))
                        g3 = _fresh(name + "_d%dm" % i)
                        nodes.append(helper.make_node("Mul", [g, g2], [g3]))
                        g = g3
                    elif p[0] == "div":
                        g3 = _fresh(name + "_d%dq" % i)
                        nodes.append(helper.make_node("Div", [g, _i64(kwargs, name + "_dv", [p[2]])], [g3]))
                        g = g3
                    parts.append(g)
                    dynamic_parts = True
                else:
                    parts.append(int(out[i]))
            if dynamic_parts:
                pieces = [p if isinstance(p, str) else _i64(kwargs, name + "_c", [p]) for p in parts]
                tgt = _fresh(name + "_target")
                nodes.append(helper.make_node("Concat", pieces, [tgt], axis=0))
                nodes.append(helper.make_node("Reshape", [inputs[0], tgt], [name], name=name))
                return nodes
            target = parts
    shape = _i64(kwargs, name + "_shape", target)
    return nodes + [helper.make_node("Reshape", [inputs[0], shape], [name], name=name)]


def _export_layer_norm(node, **kwargs):
    """LayerNorm over the last axis: LayerNormalization from opset 17, MXNet's own converter before."""
    from onnx import helper
    name, inputs, attrs = node_io(node, kwargs)
    x_shape = _in_shape(node, 0)
    axis = int(attrs.get("axis", -1))
    if _st().opset >= 17 and not _attr_bool(attrs, "output_mean_var", False):
        if x_shape is not None and axis not in (-1, len(x_shape) - 1):
            raise GraphError("LayerNorm over axis %d (not the last) has no LayerNormalization form" % axis)
        return [helper.make_node("LayerNormalization", inputs[:3], [name], name=name, axis=-1,
                                 epsilon=float(attrs.get("eps", 1e-5)))]
    from mxnet.onnx.mx2onnx._op_translations._op_translations_opset13 import convert_layer_norm
    return convert_layer_norm(node, **kwargs)


def _export_fully_connected(node, **kwargs):
    """FullyConnected: Gemm on a 2-D input (after Flatten(axis=1) with flatten=True), else MatMul with Wᵀ as
    an initializer + Add (MXNet's converter writes Shape/Flatten/Gemm/Slice/Concat/Reshape for it)."""
    from onnx import helper
    name, inputs, attrs = node_io(node, kwargs)
    x_shape = _in_shape(node, 0)
    flatten = _attr_bool(attrs, "flatten", True)
    no_bias = _attr_bool(attrs, "no_bias", False)
    w = _param(kwargs, inputs[1])
    if x_shape is None or w is None:
        from mxnet.onnx.mx2onnx._op_translations._op_translations_opset12 import convert_fully_connected
        return convert_fully_connected(node, **kwargs)
    nodes, x = [], inputs[0]
    if flatten and len(x_shape) != 2:
        x = _fresh(name + "_flat")
        nodes.append(helper.make_node("Flatten", [inputs[0]], [x], axis=1))
    if flatten or len(x_shape) == 2:
        ins = [x, inputs[1]] + ([] if no_bias else [inputs[2]])
        nodes.append(helper.make_node("Gemm", ins, [name], name=name, transB=1))
        return nodes
    wt = _const_tensor(kwargs, name + "_weight_T", np.ascontiguousarray(w.T))
    mm = name if no_bias else _fresh(name + "_mm")
    nodes.append(helper.make_node("MatMul", [x, wt], [mm]))
    if not no_bias:
        nodes.append(helper.make_node("Add", [mm, inputs[2]], [name]))
    nodes[-1].name = name
    return nodes


# --------------------------------------------------------------------------------------------
# fused ops
# --------------------------------------------------------------------------------------------

def _layer_norm_nodes(kwargs, name: str, x: str, gamma: str, beta: str, eps: float, out: str) -> list:
    """LayerNorm over the last axis in standard ops (LayerNormalization from opset 17)."""
    from onnx import helper
    if _st().opset >= 17:
        return [helper.make_node("LayerNormalization", [x, gamma, beta], [out], axis=-1, epsilon=eps)]
    ax = dict(axes=[-1], keepdims=1)
    m, c, sq, var, ve, sd, nrm, sc = (_fresh(name + t) for t in ("_mean", "_cen", "_sq", "_var", "_ve", "_sd",
                                                                "_norm", "_scaled"))
    return [helper.make_node("ReduceMean", [x], [m], **ax), helper.make_node("Sub", [x, m], [c]),
            helper.make_node("Mul", [c, c], [sq]), helper.make_node("ReduceMean", [sq], [var], **ax),
            helper.make_node("Add", [var, _f32(kwargs, name + "_eps", eps)], [ve]),
            helper.make_node("Sqrt", [ve], [sd]), helper.make_node("Div", [c, sd], [nrm]),
            helper.make_node("Mul", [nrm, gamma], [sc]), helper.make_node("Add", [sc, beta], [out])]


def _export_fused_add_layer_norm(node, **kwargs):
    """fused_add_layer_norm(a, b, γ, β) = LayerNorm(a + b) [, a + b]: SkipLayerNormalization (ort, a and b of
    one shape), else Add + LayerNormalization."""
    from onnx import helper
    name, inputs, attrs = node_io(node, kwargs)
    eps = float(attrs.get("eps", 1e-5))
    output_sum = _attr_bool(attrs, "output_sum", False)
    sa, sb = _in_shape(node, 0), _in_shape(node, 1)
    if _st().target == "ort" and sa is not None and sa == sb and len(sa) in (2, 3):
        outputs = [name, "", "", name + "1"] if output_sum else [name]
        return [helper.make_node("SkipLayerNormalization", inputs[:4], outputs, name=name, domain=MS,
                                 epsilon=eps)]
    total = name + "1" if output_sum else _fresh(name + "_sum")
    nodes = [helper.make_node("Add", inputs[:2], [total])]
    nodes += _layer_norm_nodes(kwargs, name, total, inputs[2], inputs[3], eps, name)
    nodes[-1].name = name
    return nodes


_GELU_ERF = ("gelu_erf",)
_SIMPLE_ACTS = {"relu": "Relu", "act_relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh", "softrelu": "Softplus"}


def _gelu_nodes(kwargs, name: str, y: str, out: str, tanh: bool) -> list:
    """GELU in standard ops: opset-20 Gelu, or 0.5·y·(1 + erf(y/√2)) / its tanh form written out."""
    from onnx import helper
    if _st().opset >= 20:
        return [helper.make_node("Gelu", [y], [out], approximate="tanh" if tanh else "none")]
    half, one = _f32(kwargs, name + "_half", 0.5), _f32(kwargs, name + "_one", 1.0)
    t = [_fresh(name + "_g%d" % i) for i in range(6)]
    if tanh:   # 0.5·y·(1 + tanh(√(2/π)·(y + 0.044715·y³)))
        return [helper.make_node("Mul", [y, y], [t[0]]), helper.make_node("Mul", [t[0], y], [t[1]]),
                helper.make_node("Mul", [t[1], _f32(kwargs, name + "_c", 0.044715)], [t[2]]),
                helper.make_node("Add", [y, t[2]], [t[3]]),
                helper.make_node("Mul", [t[3], _f32(kwargs, name + "_k", 0.7978845608028654)], [t[4]]),
                helper.make_node("Tanh", [t[4]], [t[5]]),
                helper.make_node("Add", [t[5], one], [name + "_g1p"]),
                helper.make_node("Mul", [y, half], [name + "_gh"]),
                helper.make_node("Mul", [name + "_gh", name + "_g1p"], [out])]
    return [helper.make_node("Mul", [y, _f32(kwargs, name + "_r2", 0.7071067811865476)], [t[0]]),
            helper.make_node("Erf", [t[0]], [t[1]]), helper.make_node("Add", [t[1], one], [t[2]]),
            helper.make_node("Mul", [y, half], [t[3]]), helper.make_node("Mul", [t[3], t[2]], [out])]


def _export_fused_dense(node, **kwargs):
    """fused_dense(x, W[, b]) = act(x·Wᵀ + b) [-> (B, H, S, D)]: MatMul with Wᵀ as an initializer, then
    bias + GELU as BiasGelu / FastGelu (ort) or Add + Gelu / its ops (standard), other acts as ONNX ops."""
    from onnx import helper
    st = _st()
    name, inputs, attrs = node_io(node, kwargs)
    act = str(attrs.get("act", "none"))
    heads_out = str(attrs.get("out_layout", "plain")) == "heads_bhsd"
    x_shape = _in_shape(node, 0)
    nodes, x = [], inputs[0]
    if _attr_bool(attrs, "flatten", True) and (x_shape is None or len(x_shape) != 2):
        x = _fresh(name + "_flat")
        nodes.append(helper.make_node("Flatten", [inputs[0]], [x], axis=1))
    w = _param(kwargs, inputs[1])
    if w is not None:
        wt = _const_tensor(kwargs, name + "_weight_T", np.ascontiguousarray(w.T))
    else:
        wt = _fresh(name + "_wT")
        nodes.append(helper.make_node("Transpose", [inputs[1]], [wt], perm=[1, 0]))
    y = _fresh(name + "_mm")
    nodes.append(helper.make_node("MatMul", [x, wt], [y]))
    bias = None if _attr_bool(attrs, "no_bias", False) else inputs[2]
    final = _fresh(name + "_act") if heads_out else name
    if act in ("gelu_erf", "gelu_tanh") and st.target == "ort":
        if act == "gelu_erf":
            nodes.append(helper.make_node("BiasGelu", [y, bias], [final], domain=MS) if bias else
                         helper.make_node("Gelu", [y], [final], domain=MS))
        else:
            nodes.append(helper.make_node("FastGelu", [y] + ([bias] if bias else []), [final], domain=MS))
    else:
        if bias:
            yb = _fresh(name + "_biased")
            nodes.append(helper.make_node("Add", [y, bias], [yb]))
            y = yb
        if act in _SIMPLE_ACTS:
            nodes.append(helper.make_node(_SIMPLE_ACTS[act], [y], [final]))
        elif act == "leaky":
            nodes.append(helper.make_node("LeakyRelu", [y], [final], alpha=float(attrs.get("slope", 0.25))))
        elif act in ("gelu_erf", "gelu_tanh"):
            nodes += _gelu_nodes(kwargs, name, y, final, act == "gelu_tanh")
        elif act == "none":
            if nodes[-1].output[0] == y:
                nodes[-1].output[0] = final
            else:
                nodes.append(helper.make_node("Identity", [y], [final]))
        else:
            raise GraphError("no ONNX form for act=%s" % act)
    if heads_out:
        out = _out_shape(kwargs)
        heads = int(attrs["heads"])
        shape = _i64(kwargs, name + "_heads_shape", [0, 0, heads, -1])
        split = _fresh(name + "_split")
        nodes.append(helper.make_node("Reshape", [final, shape], [split]))
        nodes.append(helper.make_node("Transpose", [split], [name], perm=[0, 2, 1, 3]))
        del out
    nodes[-1].name = name
    return nodes


# ---- fused_attention ----

def _dense_producer(node, i: int):
    """(json node, index) of a fused_dense without activation, flatten=False, plain output, with its
    weight (and bias) params, feeding input ``i`` of ``node`` and used only there; else None."""
    st = _st()
    e = node["inputs"][i]
    nid, src = e[0], st.nodes[e[0]]
    if src.get("op") != "fused_dense" or st.uses.get((e[0], e[1]), 0) != 1 or e[1] != 0:
        return None
    a = src.get("attrs", {})
    if str(a.get("act", "none")) != "none" or _attr_bool(a, "flatten", True) or \
            str(a.get("out_layout", "plain")) != "plain":
        return None
    return nid, src


def _dense_parts(kwargs, nid: int, src) -> Optional[Tuple[str, np.ndarray, np.ndarray, Tuple[int, ...]]]:
    """(ONNX name of x, W (N, K), b (N,), x shape) of a fused_dense json node, when W and b are params."""
    st = _st()
    lookup = kwargs["outputs_lookup"]
    x_e, w_e = src["inputs"][0], src["inputs"][1]
    w = _param(kwargs, st.nodes[w_e[0]]["name"])
    if w is None or w.ndim != 2:
        return None
    if _attr_bool(src.get("attrs", {}), "no_bias", False):
        b = np.zeros(w.shape[0], w.dtype)
    else:
        b = _param(kwargs, st.nodes[src["inputs"][2][0]]["name"])
        if b is None:
            return None
    x_shape = st.shapes.get((x_e[0], x_e[1]))
    if x_shape is None:
        return None
    return lookup[x_e[0]][x_e[1]].name, w, b.reshape(-1), x_shape


def _bias4(kwargs, name: str, cur: str, shape, b: int, h: int, sq: int, sk: int) -> Tuple[List[Any], str]:
    """``cur`` (aligned with the (B·H, Sq, Sk) or (B, H, Sq, Sk) scores from the last axis) as ONNX
    Runtime's attention_bias (B|1, H|1, Sq, Sk).  A dynamic export takes Sq and Sk from the shapes
    of q and k (``_State.seq_dims``)."""
    from onnx import helper
    st = _st()
    ms = list(shape)
    if len(ms) == 4:
        shape4 = ms
    elif len(ms) == 3 and ms[0] == b * h and b * h > 1:
        shape4 = [b, h] + ms[1:]
    elif len(ms) < 3 or ms[0] == 1:
        shape4 = [1] * (4 - len(ms[-2:])) + ms[-2:]
    else:
        raise _NeedsUnfuse("mask of shape %s" % (tuple(ms),))
    if len(shape4) != 4 or shape4[0] not in (1, b) or shape4[1] not in (1, h):
        raise _NeedsUnfuse("mask of shape %s" % (tuple(ms),))
    nodes = []
    if tuple(shape4) != tuple(ms):
        r = _fresh(name + "_bias4")
        if st.dynamic:
            if list(shape4[4 - len(ms):]) != ms or any(d != 1 for d in shape4[:4 - len(ms)]):
                raise _NeedsUnfuse("a mask to reshape in a dynamic export")
            nodes.append(helper.make_node("Unsqueeze", [cur, _i64(kwargs, name + "_ax", list(range(4 - len(ms))))],
                                          [r]))
        else:
            nodes.append(helper.make_node("Reshape", [cur, _i64(kwargs, name + "_b4", shape4)], [r]))
        cur = r
    if shape4[2] != sq or shape4[3] != sk:
        e = _fresh(name + "_biasx")
        if st.dynamic:
            parts = [_i64(kwargs, name + "_ones", [1, 1])]
            lens: Dict[Tuple[str, int], str] = {}
            for src, axis in st.seq_dims:
                if (src, axis) not in lens:
                    sh, lens[(src, axis)] = _fresh(name + "_shp"), _fresh(name + "_len")
                    nodes += [helper.make_node("Shape", [src], [sh]),
                              helper.make_node("Gather", [sh, _i64(kwargs, name + "_axis", [axis])],
                                               [lens[(src, axis)]], axis=0)]
                parts.append(lens[(src, axis)])
            target = _fresh(name + "_bxs")
            nodes.append(helper.make_node("Concat", parts, [target], axis=0))
        else:
            target = _i64(kwargs, name + "_bx", [shape4[0], shape4[1], sq, sk])
        nodes.append(helper.make_node("Expand", [cur, target], [e]))
        cur = e
    return nodes, cur


def _attention_bias(kwargs, name: str, mask: str, m_shape, b: int, h: int, sq: int, sk: int, boolean: bool,
                    mask_value: float) -> Tuple[List[Any], str]:
    """The mask as ONNX Runtime's attention_bias (B|1, H|1, Sq, Sk); shared between layers using one mask."""
    from onnx import helper
    st = _st()
    key = (mask, boolean, mask_value, b, h, sq, sk)
    if key in st.cache:
        return [], st.cache[key]
    nodes, cur = [], mask
    if boolean:      # kept where ≠ 0, else the mask value
        flag, bias = _fresh(name + "_keep"), _fresh(name + "_bias")
        nodes += [helper.make_node("Equal", [mask, _f32(kwargs, name + "_zero", 0.0)], [flag]),
                  helper.make_node("Where", [flag, _f32(kwargs, name + "_mv", mask_value),
                                             _f32(kwargs, name + "_z", 0.0)], [bias])]
        cur = bias
    more, cur = _bias4(kwargs, name, cur, m_shape, b, h, sq, sk)
    st.cache[key] = cur
    return nodes + more, cur


_DROPPED = -1e30     # added to the scores of keys beyond a row's length: probability exactly 0


def _length_mask(kwargs, name: str, lengths: str, l_shape, b: int, h: int, sq: int, sk: int):
    """Valid lengths as (mask_index, attention_bias): (B,) lengths shared by the heads as ONNX Runtime's
    mask_index, other forms (per head, per query row) as a bias dropping the keys at or past the length."""
    from onnx import TensorProto, helper
    st = _st()
    ls = tuple(l_shape)
    key = ("len", lengths, b, h, sq, sk)
    if key in st.cache:
        return st.cache[key]
    nodes: List[Any] = []
    if ls == (b,) and (b != b * h or h == 1):
        idx = _fresh(name + "_lengths")
        nodes.append(helper.make_node("Cast", [lengths], [idx], to=TensorProto.INT32))
        st.cache[key] = (nodes, idx, "")
        return nodes, idx, ""
    # the form the fused op reads (scores' form first, then N = B·H, then N = B)
    if ls == (b * h, sq):
        shape = [b, h, sq, 1]
    elif ls == (b * h,):
        shape = [b, h, 1, 1]
    elif ls == (b, sq):
        shape = [b, 1, sq, 1]
    elif ls == (b,):
        shape = [b, 1, 1, 1]
    elif ls == (b, h, sq):
        shape = [b, h, sq, 1]
    else:
        raise _NeedsUnfuse("lengths of shape %s" % (ls,))
    if st.dynamic:
        raise _NeedsUnfuse("lengths per row in a dynamic export")
    lf, l4, keep, bias = (_fresh(name + t) for t in ("_lenf", "_len4", "_keep", "_lbias"))
    nodes += [helper.make_node("Cast", [lengths], [lf], to=TensorProto.FLOAT),
              helper.make_node("Reshape", [lf, _i64(kwargs, name + "_l4", shape)], [l4]),
              helper.make_node("Less", [_f32(kwargs, name + "_keys", np.arange(sk, dtype=np.float32)), l4], [keep]),
              helper.make_node("Where", [keep, _f32(kwargs, name + "_z", 0.0), _f32(kwargs, name + "_drop", _DROPPED)],
                               [bias])]
    more, cur = _bias4(kwargs, name, bias, [shape[0], shape[1], shape[2], sk], b, h, sq, sk)
    st.cache[key] = (nodes + more, "", cur)
    return nodes + more, "", cur


def _export_fused_attention(node, **kwargs):
    """fused_attention: ONNX Runtime's Attention / MultiHeadAttention (ort) where they compute it, else
    (and for the standard target) the stock ops of ``fusion.unfuse``; plain layouts as MatMul/Softmax."""
    from onnx import helper
    st = _st()
    name, inputs, attrs = node_io(node, kwargs)
    layout, mask_kind = str(attrs.get("layout", "plain")), str(attrs.get("mask_kind", "none"))
    causal = _attr_bool(attrs, "causal", False)
    causal_mode = str(attrs.get("causal_mode", "exclude"))
    scale = float(attrs["scale"])
    mask_value = float(attrs.get("mask_value", -1e18))
    heads = int(attrs.get("heads", 1))
    if _attr_bool(attrs, "length_fill", False):
        # ORT's attention ops drop the keys past the length; length_fill keeps them in the sum
        raise _NeedsUnfuse("lengths with length_fill")
    if layout == "plain":
        if mask_kind in ("none", "additive") and not causal:
            return _plain_attention(kwargs, node, name, inputs, scale, mask_kind)
        raise _NeedsUnfuse("plain layout with mask %s, causal=%s" % (mask_kind, causal))
    if st.target != "ort":
        raise _NeedsUnfuse("standard target")
    n_data = {"bshd": 3, "packed_qkv": 1, "interleaved": 1, "interleaved_encdec": 2}[layout]
    shapes = [_in_shape(node, i) for i in range(len(node["inputs"]))]
    if any(s is None for s in shapes):
        raise _NeedsUnfuse("shapes unknown")
    out = _out_shape(kwargs)
    if layout in ("interleaved", "interleaved_encdec"):
        sq, b = shapes[0][0], shapes[0][1]
        sk = shapes[1][0] if layout == "interleaved_encdec" else sq
    else:
        b, sq = shapes[0][0], shapes[0][1]
        sk = shapes[1][1] if layout == "bshd" else sq
    if causal and sq != sk:
        raise _NeedsUnfuse("causal band with Sq != Sk")
    if layout == "bshd":
        st.seq_dims = [(inputs[0], 1), (inputs[1], 1)]
    elif layout == "packed_qkv":
        st.seq_dims = [(inputs[0], 1), (inputs[0], 1)]
    else:
        st.seq_dims = [(inputs[0], 0), (inputs[1 if layout == "interleaved_encdec" else 0], 0)]
    # q/k/v projections of one input: Attention with their weights packed
    packed = _packed_projection(kwargs, node, layout, heads)
    if packed is not None:      # Sq and Sk of a dynamic export from the input, not from the projections
        axis = 0 if packed[4] else 1
        st.seq_dims = [(packed[0], axis), (packed[0], axis)]
    nodes: List[Any] = []
    mask_index, bias4 = "", ""
    if mask_kind != "none":
        mask, m_shape = inputs[n_data], shapes[n_data]
        if mask_kind == "valid_length":
            if ("len", mask, b, heads, sq, sk) in st.cache:
                _, mask_index, bias4 = st.cache[("len", mask, b, heads, sq, sk)]
            else:
                extra, mask_index, bias4 = _length_mask(kwargs, name, mask, m_shape, b, heads, sq, sk)
                nodes += extra
        else:
            extra, bias4 = _attention_bias(kwargs, name, mask, m_shape, b, heads, sq, sk, mask_kind == "boolean",
                                           mask_value)
            nodes += extra
    common = dict(num_heads=heads, scale=scale)
    if causal:
        common["unidirectional"] = 1
        del causal_mode
    if packed is not None:
        x, x_shape, w, bias, transpose = packed
        if transpose:
            xt = _fresh(name + "_bsc")
            nodes.append(helper.make_node("Transpose", [x], [xt], perm=[1, 0, 2]))
            x = xt
        wname = _const_tensor(kwargs, name + "_qkv_weight", w)
        bname = _const_tensor(kwargs, name + "_qkv_bias", bias)
        ins = [x, wname, bname, mask_index, "", bias4]
        while ins and ins[-1] == "":
            ins.pop()
        o = _fresh(name + "_bsh") if transpose else name
        nodes.append(helper.make_node("Attention", ins, [o], domain=MS, **common))
        if transpose:
            nodes.append(helper.make_node("Transpose", [o], [name], perm=[1, 0, 2]))
        nodes[-1].name = name
        return nodes
    # MultiHeadAttention on (B, S, H·D) query, key, value
    if layout == "bshd":
        q, k, v = inputs[:3]
    elif layout == "packed_qkv":
        hd = shapes[0][2] // 3
        q, k, v = (_fresh(name + t) for t in ("_q", "_k", "_v"))
        nodes.append(helper.make_node("Split", [inputs[0], _i64(kwargs, name + "_parts", [hd] * 3)], [q, k, v],
                                      axis=2))
    else:
        raise _NeedsUnfuse("layout %s without its projection" % layout)
    ins = [q, k, v, "", mask_index, bias4]
    while ins and ins[-1] == "":
        ins.pop()
    nodes.append(helper.make_node("MultiHeadAttention", ins, [name], name=name, domain=MS, **common))
    del out
    return nodes


def _packed_projection(kwargs, node, layout: str, heads: int):
    """(x, x shape, W (K, 3·H·D) q|k|v blocks, bias, whether x is (S, B, K)) when the attention's q, k, v are
    fused_dense projections of one input x used only here; else None."""
    st = _st()
    if layout == "bshd":
        prods = [_dense_producer(node, i) for i in range(3)]
        if any(p is None for p in prods):
            return None
        parts = [_dense_parts(kwargs, *p) for p in prods]
        if any(p is None for p in parts) or len({p[0] for p in parts}) != 1:
            return None
        if len({p[1].shape for p in parts}) != 1 or len(parts[0][3]) != 3:
            return None
        w = np.concatenate([p[1] for p in parts], axis=0).T
        bias = np.concatenate([p[2] for p in parts])
        return parts[0][0], parts[0][3], np.ascontiguousarray(w), bias, False
    if layout in ("packed_qkv", "interleaved"):
        p = _dense_producer(node, 0)
        if p is None:
            return None
        got = _dense_parts(kwargs, *p)
        if got is None or len(got[3]) != 3:
            return None
        x, w, bias, x_shape = got
        if layout == "interleaved":    # rows per head h: q (D), k (D), v (D)  ->  q | k | v blocks of H·D
            n = w.shape[0]
            d = n // (3 * heads)
            order = np.arange(n).reshape(heads, 3, d).transpose(1, 0, 2).reshape(-1)
            w, bias = w[order], bias[order]
        del st
        return x, x_shape, np.ascontiguousarray(w.T), bias, layout == "interleaved"
    return None


def _plain_attention(kwargs, node, name, inputs, scale, mask_kind):
    """softmax(scale·q·kᵀ [+ mask])·v over the last two axes, at any rank ≥ 2."""
    from onnx import helper
    q_shape = _in_shape(node, 1)
    rank = len(q_shape) if q_shape is not None else None
    nodes = []
    if rank is not None:
        perm = list(range(rank - 2)) + [rank - 1, rank - 2]
        kt = _fresh(name + "_kT")
        nodes.append(helper.make_node("Transpose", [inputs[1]], [kt], perm=perm))
        qk = _fresh(name + "_qk")
        nodes.append(helper.make_node("MatMul", [inputs[0], kt], [qk]))
    else:
        qk = _fresh(name + "_qk")
        nodes.append(helper.make_node("Einsum", inputs[:2], [qk], equation="...id,...jd->...ij"))
    s = _fresh(name + "_scores")
    nodes.append(helper.make_node("Mul", [qk, _f32(kwargs, name + "_scale", scale)], [s]))
    if mask_kind == "additive":
        s2 = _fresh(name + "_masked")
        nodes.append(helper.make_node("Add", [s, inputs[3]], [s2]))
        s = s2
    p = _fresh(name + "_probs")
    nodes.append(helper.make_node("Softmax", [s], [p], axis=-1))
    nodes.append(helper.make_node("MatMul", [p, inputs[2]], [name], name=name))
    return nodes


# ---- fused_elemwise ----

_EXPR_TOKEN = re.compile(r"\s*(?:(?P<num>[-+]?(?:inf|nan|(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?))"
                         r"|(?P<name>[A-Za-z_][A-Za-z_0-9]*)|(?P<punct>[(),]))")
_EXPR_UNARY = {"neg": "Neg", "abs": "Abs", "exp": "Exp", "log": "Log", "sqrt": "Sqrt", "tanh": "Tanh",
               "sigmoid": "Sigmoid", "relu": "Relu", "act_relu": "Relu", "erf": "Erf", "softrelu": "Softplus",
               "softsign": "Softsign"}
_EXPR_BINARY = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "pow": "Pow", "max": "Max", "min": "Min"}
_EXPR_COMPARE = {"lt": "Less", "le": "LessOrEqual", "gt": "Greater", "ge": "GreaterOrEqual", "eq": "Equal"}


def _export_fused_elemwise(node, **kwargs):
    """fused_elemwise(x0, x1, ..., expr=...): the expression program written out as ONNX nodes."""
    from onnx import TensorProto, helper
    name, inputs, attrs = node_io(node, kwargs)
    text = str(attrs.get("expr", ""))
    from ..ir.expr import parse_expr      # the program as a tree, read without recursion
    try:
        tree = parse_expr(text)
    except (AssertionError, IndexError, ValueError):
        raise GraphError("fused_elemwise '%s': cannot export expression %r" % (name, text)) from None
    nodes: List[Any] = []
    count = [0]

    def emit(op_type, args, **kw):
        out = _fresh("%s_e%d" % (name, len(nodes)))
        nodes.append(helper.make_node(op_type, args, [out], **kw))
        return out

    def const(tag, value):
        count[0] += 1
        return _f32(kwargs, "%s_%s%d" % (name, tag, count[0]), value)

    def call(tok, args):
        if tok in _EXPR_UNARY:
            return emit(_EXPR_UNARY[tok], args)
        if tok in _EXPR_BINARY:
            return emit(_EXPR_BINARY[tok], args)
        if tok == "square":
            return emit("Mul", [args[0], args[0]])
        if tok == "rsqrt":
            return emit("Reciprocal", [emit("Sqrt", args)])
        if tok in _EXPR_COMPARE or tok == "ne":
            flag = emit(_EXPR_COMPARE.get(tok, "Equal"), args)
            flag = emit("Not", [flag]) if tok == "ne" else flag
            return emit("Cast", [flag], to=TensorProto.FLOAT)
        if tok == "where":
            cond = emit("Cast", [args[0]], to=TensorProto.BOOL)
            return emit("Where", [cond, args[1], args[2]])
        if tok == "clip":
            return emit("Min", [emit("Max", args[:2]), args[2]])
        if tok == "gelu":       # 0.5·x·(1 + erf(x/√2))
            e = emit("Add", [emit("Erf", [emit("Mul", [args[0], const("r2_", 0.7071067811865476)])]),
                             const("one", 1.0)])
            return emit("Mul", [emit("Mul", [args[0], const("half", 0.5)]), e])
        if tok == "leaky":      # x > 0 ? x : x·s
            pos_ = emit("Greater", [args[0], const("zero", 0.0)])
            return emit("Where", [pos_, args[0], emit("Mul", [args[0], args[1]])])
        if tok == "hard_sigmoid":   # clip(α·x + β, 0, 1)
            r = emit("Add", [emit("Mul", [args[0], args[1]]), args[2]])
            return emit("Min", [emit("Max", [r, const("lo", 0.0)]), const("hi", 1.0)])
        raise GraphError("fused_elemwise '%s': no ONNX export for function %r" % (name, tok))

    # post-order without recursion: programs nest as deep as MXNet loads (fusion/ir/graph.py)
    values: Dict[int, str] = {}
    todo = [(tree, False)]
    while todo:
        t, ready = todo.pop()
        if id(t) in values:
            continue
        if t[0] == "num":
            values[id(t)] = const("c", t[1])
        elif t[0] == "in":
            if t[1] >= len(inputs):
                raise GraphError("fused_elemwise '%s': x%d is not an input in %r" % (name, t[1], text))
            values[id(t)] = inputs[t[1]]
        elif not ready:
            todo.append((t, True))
            todo.extend((a, False) for a in reversed(t[1]))
        else:
            values[id(t)] = call(t[0], [values[id(a)] for a in t[1]])
    root = values[id(tree)]
    if nodes and nodes[-1].output[0] == root:
        nodes[-1].output[0] = name
    else:
        nodes.append(helper.make_node("Identity", [root], [name]))
    nodes[-1].name = name
    return nodes


def _export_through_stock_ops(node, **kwargs):
    """fused_box_nms, fused_max_pool, fused_roi_align: MXNet's own op computes the same
    (``_contrib_box_nms``, ``Pooling``, ``_contrib_ROIAlign``); fused_region: its program's stock ops
    (Convolution, Pooling, Concat, BatchNorm, adds, products, activations): exported un-fused, through
    MXNet's converters where it has them (none for ROIAlign: the original model's error)."""
    raise _NeedsUnfuse()


def _export_bilinear_resize(node, **kwargs):
    """_contrib_BilinearResize2D / fused_bilinear_resize (the same attributes): ONNX Resize, linear, with
    MXNet's coordinates -- ``align_corners``, or ``pytorch_half_pixel`` (in/out · (i + ½) − ½, clamped
    at 0; 0 for a side of 1) without it -- to the output size MXNet infers (every mode).  MXNet 1.9.1's
    own converter writes align_corners for both and takes mode 'size' only."""
    from onnx import helper
    name, inputs, attrs = node_io(node, kwargs)
    st = _st()
    mode = attrs.get("mode", "size")
    out = _out_shape(kwargs)
    if out is None or len(out) != 4:
        raise OnnxExportError("BilinearResize2D '%s': its output shape is unknown" % name, node=name, op=node["op"])
    shape, nc = _fresh(name + "_shape"), _fresh(name + "_nc")
    nodes = [helper.make_node("Shape", [inputs[0]], [shape]),
             helper.make_node("Slice", [shape, _i64(kwargs, name + "_0", [0]), _i64(kwargs, name + "_2", [2])], [nc])]
    if mode == "like":
        like, hw = _fresh(name + "_like_shape"), _fresh(name + "_hw")
        nodes += [helper.make_node("Shape", [inputs[1]], [like]),
                  helper.make_node("Slice", [like, _i64(kwargs, name + "_2b", [2]), _i64(kwargs, name + "_4", [4])],
                                   [hw])]
    elif mode == "size" and attrs.get("scale_height", "None") == "None" or not st.dynamic:
        hw = _i64(kwargs, name + "_hw", [int(out[2]), int(out[3])])
    else:
        raise OnnxExportError("BilinearResize2D '%s' in mode %s: its output size follows the input's, with "
                              "MXNet's rounding; no dynamic ONNX form" % (name, mode), node=name, op=node["op"])
    sizes = _fresh(name + "_sizes")
    nodes.append(helper.make_node("Concat", [nc, hw], [sizes], axis=0))
    coords = "align_corners" if _attr_bool(attrs, "align_corners", True) else "pytorch_half_pixel"
    nodes.append(helper.make_node("Resize", [inputs[0], "", "", sizes], [name], name=name, mode="linear",
                                  coordinate_transformation_mode=coords))
    return nodes


# MXNet op name -> exporter, called like MXNet's own converters: fn(node, **kwargs) -> [onnx.NodeProto, ...],
# node being the op's entry of the Symbol JSON ("name", "inputs", "attrs") and kwargs MXNet's exporter
# state (use node_io() for names; kwargs["initializer"] collects constant tensors).  Nodes in the
# "com.microsoft" domain make the file import that domain (ONNX Runtime's contrib ops).  The node
# writing the op's output names it node["name"] (a second output: node["name"] + "1").
FUSED_OP_EXPORTERS: Dict[str, Callable[..., list]] = {
    "fused_add_layer_norm": _export_fused_add_layer_norm,
    "fused_dense": _export_fused_dense,
    "fused_attention": _export_fused_attention,
    "fused_elemwise": _export_fused_elemwise,
    "fused_box_nms": _export_through_stock_ops,
    "fused_max_pool": _export_through_stock_ops,
    "fused_roi_align": _export_through_stock_ops,
    "fused_bilinear_resize": _export_bilinear_resize,
    "fused_region": _export_through_stock_ops,
}


def _basic(onnx_op: str):
    def conv(node, **kwargs):
        from onnx import helper
        name, inputs, _ = node_io(node, kwargs)
        return [helper.make_node(onnx_op, inputs, [name], name=name)]
    return conv


def _export_rsqrt(node, **kwargs):
    from onnx import helper
    name, inputs, _ = node_io(node, kwargs)
    return [helper.make_node("Sqrt", inputs, [name + "_sqrt"], name=name + "_sqrt"),
            helper.make_node("Reciprocal", [name + "_sqrt"], [name], name=name)]


def _export_trunc(node, **kwargs):
    """trunc(x) = sign(x)·floor(|x|) (ONNX has no Trunc; -0.0, NaN and ±inf come out as trunc gives them);
    of a graph input the file holds as integers (token ids read back from an int64 -> int32 Cast) the
    input itself: every value it can take is whole already."""
    from onnx import helper
    name, inputs, _ = node_io(node, kwargs)
    src = _st().nodes[node["inputs"][0][0]]
    if src["op"] == "null" and src["name"] in _st().int_inputs:
        return [helper.make_node("Identity", inputs[:1], [name], name=name)]
    a, f, sg = _fresh(name + "_abs"), _fresh(name + "_floor"), _fresh(name + "_sign")
    return [helper.make_node("Abs", inputs[:1], [a]), helper.make_node("Floor", [a], [f]),
            helper.make_node("Sign", inputs[:1], [sg]), helper.make_node("Mul", [sg, f], [name], name=name)]


def _scalar_input(node, kwargs, name: str) -> str:
    """An initializer holding the node's ``scalar`` attribute in the input's dtype; returns its name."""
    from onnx import helper
    from mxnet.onnx.mx2onnx._op_translations._op_translations_opset12 import get_input_dtypes
    dtype = np.dtype(get_input_dtypes(node, kwargs)[0])
    value = np.array(float(node.get("attrs", {}).get("scalar", "1")), dtype=dtype)
    name = _fresh(name)
    kwargs["initializer"].append(helper.make_tensor(name, helper.np_dtype_to_tensor_dtype(dtype), [],
                                                    [value.item()]))
    return name


def _scalar_op(onnx_op: str, reverse: bool):
    """x OP scalar, or scalar OP x.  MXNet's own converters decide "reversed" from the node's *name*
    (``_rminusscalar0``), so they export a renamed ``_rminus_scalar`` as x - s: we replace them."""
    def conv(node, **kwargs):
        from onnx import helper
        name, inputs, _ = node_io(node, kwargs)
        scalar = _scalar_input(node, kwargs, name + "_scalar")
        operands = [scalar, inputs[0]] if reverse else [inputs[0], scalar]
        return [helper.make_node(onnx_op, operands, [name], name=name)]
    return conv


def _export_where(node, **kwargs):
    from onnx import TensorProto, helper
    name, inputs, _ = node_io(node, kwargs)
    return [helper.make_node("Cast", [inputs[0]], [name + "_cond"], name=name + "_cond", to=TensorProto.BOOL),
            helper.make_node("Where", [name + "_cond", inputs[1], inputs[2]], [name], name=name)]


# MXNet ops that MXNet 1.9.1's exporter lacks or exports wrongly (under names it did not generate).
_EXTRA_EXPORTERS: Dict[str, Callable[..., list]] = {
    "erf": _basic("Erf"), "rsqrt": _export_rsqrt, "where": _export_where, "trunc": _export_trunc,
    "fix": _export_trunc,
    "_rminus_scalar": _scalar_op("Sub", True), "_rdiv_scalar": _scalar_op("Div", True),
    "_rpower_scalar": _scalar_op("Pow", True),
    "_maximum_scalar": _scalar_op("Max", False), "_minimum_scalar": _scalar_op("Min", False),
    "Reshape": _export_reshape, "LayerNorm": _export_layer_norm, "FullyConnected": _export_fully_connected,
    "_contrib_BilinearResize2D": _export_bilinear_resize,
}


# --------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------

def export_onnx(symbol: Any, arg_params: Mapping[str, Any], aux_params: Mapping[str, Any],
                input_shapes: Mapping[str, Sequence[int]], path: Any, *, opset: Optional[int] = None,
                target: str = "ort", input_dtypes: Optional[Mapping[str, Any]] = None,
                dynamic: bool = False, validate: bool = True, rtol: float = DEFAULT_RTOL,
                seed: int = 0, names: Optional[Mapping[str, str]] = None) -> Optional[VerifyResult]:
    """Write ``symbol`` with its params to the ONNX file ``path``; returns ONNX Runtime vs MXNet errors.

    ``target``: ``"ort"`` (default) writes ONNX Runtime's contrib ops (``com.microsoft``) for the fused
    ops, ``"standard"`` only ai.onnx ops.  ``opset`` (13–21, default ``DEFAULT_OPSET``) is the ai.onnx
    opset of the file.  ``input_dtypes`` gives inputs another dtype in the file than float32 (token
    ids as int64, as the ONNX file a model came from had them).  With ``validate`` (the default) the
    file is run in ONNX Runtime on random inputs drawn to fit their use and compared with MXNet
    before it is renamed into place; a mismatch beyond ``rtol`` raises VerificationError and leaves
    no file.  ``dynamic=True`` leaves every input and output dimension dynamic (Reshape targets are
    then computed from ``Shape`` where MXNet's codes copy input dims).  ``names`` renames graph inputs
    and outputs in the file (MXNet name -> ONNX name; those of the ONNX file a model came from; an
    output is named by its MXNet output name, e.g. ``fc1_output``).  A failure raises
    :class:`OnnxExportError` naming the node that stopped the export.
    """
    opset = DEFAULT_OPSET if opset is None else int(opset)
    lo, hi = OPSET_RANGE
    if not lo <= opset <= hi:
        raise FusionError("opset %d is not supported for export (opsets %d-%d)" % (opset, lo, hi))
    if target not in TARGETS:
        raise FusionError("unknown ONNX target %r (one of %s)" % (target, ", ".join(TARGETS)))
    params = {**{k: _nd(v) for k, v in arg_params.items()}, **{k: _nd(v) for k, v in aux_params.items()}}
    graph_json = _json_nodes(symbol)
    _check_exportable(graph_json)
    data_names = [n["name"] for n in graph_json["nodes"] if n["op"] == "null" and n["name"] not in params]
    missing = [n for n in data_names if n not in input_shapes]
    if missing:
        raise FusionError("no shape given for input(s) %s" % ", ".join(missing))
    input_dtypes = {k: np_dtype(v) for k, v in (input_dtypes or {}).items()}     # 'bfloat16' too

    sym = symbol
    unfused: List[str] = []
    for _ in range(2):
        # each graph converted: an un-fused op's stock form brings its own BatchNorms (a fused_region's)
        model, todo = _convert(sym, _fixed_gammas(_json_nodes(sym), params), input_shapes, data_names, opset,
                               target, dynamic, input_dtypes)
        if not todo and names:
            _rename_io(model, symbol, names)
        if not todo:
            break
        from ..api import unfuse
        try:
            sym = unfuse(sym, input_shapes, arg_params, aux_params, nodes=todo)
        except FusionError as e:
            raise OnnxExportError("no ONNX form, and no stock form: %s" % _first_line(e), node=todo[0],
                                  op="fused_attention") from None
        unfused += todo
    else:
        raise OnnxExportError("no ONNX form for %s" % ", ".join(todo), node=todo[0], op="fused_attention")

    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    except OSError as e:
        raise FusionError("cannot write ONNX file '%s': %s" % (path, e.strerror or e)) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(model.SerializeToString())
            f.flush()
            os.fsync(f.fileno())
        result = None
        if validate:
            result = _validate(tmp, symbol, arg_params, aux_params, input_shapes, seed, names or {})
            if not result.ok(rtol):
                raise VerificationError("ONNX Runtime disagrees with MXNet on the exported model: %s (rtol %g)"
                                        % (result, rtol))
        os.replace(tmp, path)
        return result
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _nd(v):
    import mxnet as mx
    return v if isinstance(v, mx.nd.NDArray) else mx.nd.array(np.asarray(v), dtype=np.asarray(v).dtype)


def _json_nodes(symbol) -> Dict[str, Any]:
    return json.loads(symbol.tojson())


def _fixed_gammas(graph_json: Mapping[str, Any], params: Dict[str, Any]) -> Dict[str, Any]:
    """``params`` with the γ of every BatchNorm with ``fix_gamma`` (MXNet's default) set to ones, as MXNet
    computes it whatever the array holds; ONNX's BatchNormalization reads the array (a random-weight
    ResNet-50 v2's first BatchNorm: the export's own check failed at 6.9e-3).  A γ another op also
    reads keeps its values (there is no one array to write then)."""
    from ..ir.attrs import parse_value
    from ..ir.opdefs import default

    nodes = graph_json["nodes"]
    readers: Dict[str, List[Tuple[Mapping[str, Any], int]]] = {}
    for nd in nodes:
        for slot, (src, _, *_) in enumerate(nd.get("inputs", [])):
            if nodes[src]["op"] == "null":
                readers.setdefault(nodes[src]["name"], []).append((nd, slot))
    out = dict(params)
    for name, uses in readers.items():
        if name not in params or not uses:
            continue
        fixed = [nd["op"] == "BatchNorm" and slot == 1
                 and parse_value(str(nd.get("attrs", {}).get("fix_gamma", default("BatchNorm", "fix_gamma")))) is True
                 for nd, slot in uses]
        if all(fixed):
            import mxnet as mx
            out[name] = mx.nd.ones(params[name].shape, dtype=params[name].dtype)
    return out


def _registry_known() -> set:
    from mxnet.onnx.mx2onnx._export_onnx import MXNetGraph
    import mxnet.onnx  # noqa: F401  (registers MXNet's converters)

    known = set(FUSED_OP_EXPORTERS) | set(_EXTRA_EXPORTERS)
    for version in range(_CONVERTER_OPSET, 11, -1):
        known |= set(MXNetGraph.registry_.get(version, {}))
    return known


def _check_exportable(graph_json) -> None:
    known = _registry_known()
    missing: Dict[str, str] = {}
    for node in graph_json["nodes"]:
        if node["op"] != "null" and node["op"] not in known:
            missing.setdefault(node["op"], node["name"])
    if missing:
        op, name = sorted(missing.items())[0]
        ops = ", ".join("%s (node '%s')" % kv for kv in sorted(missing.items()))
        hint = "; call fusion.unfuse first" if any(o.startswith("fused_") for o in missing) else ""
        raise OnnxExportError("no ONNX exporter for op(s) %s%s, or add one to fusion.onnx.export.FUSED_OP_EXPORTERS"
                              % (ops, hint), node=name, op=op)


def _facts(symbol, params, input_shapes, input_dtypes):
    """(shape, dtype) of every node output by (json node index, output index)."""
    from ..engine.facts import infer
    from ..ir.graph import Graph

    graph = Graph.from_symbol(symbol)
    given = {k: tuple(int(d) for d in v) for k, v in input_shapes.items()}
    given.update({k: tuple(v.shape) for k, v in params.items()})
    dt = {k: dtype_name(v.dtype) for k, v in params.items()}      # bfloat16: 'bfloat16' (NumPy says 'void16')
    shapes, dtypes = infer(graph, given, dt)
    index = {id(n): i for i, n in enumerate(graph.nodes)}
    names = [n["name"] for n in _json_nodes(symbol)["nodes"]]
    if [n.name for n in graph.nodes] != names:   # the graph reordered: map by unique names only
        by_name = {}
        for i, n in enumerate(names):
            by_name.setdefault(n, []).append(i)
        index = {id(n): by_name[n.name][0] for n in graph.nodes if len(by_name.get(n.name, [])) == 1}
    s_out = {(index[id(e.node)], e.index): tuple(s) for e, s in shapes.items() if id(e.node) in index}
    t_out = {(index[id(e.node)], e.index): t for e, t in dtypes.items() if id(e.node) in index}
    return s_out, t_out


def _wrap(op: str, fn: Callable[..., list]) -> Callable[..., list]:
    """``fn`` with its failures naming the node (and fused ops without a form put aside for un-fusing)."""
    def conv(node, **kwargs):
        from onnx import helper
        try:
            return fn(node, **kwargs)
        except _NeedsUnfuse:
            st = _st()
            st.unfuse.append(node["name"])
            name, inputs, attrs = node_io(node, kwargs)
            # a placeholder per output (MXNet's exporter names output k > 0 name + str(k)); the stock
            # ops take its place in the next conversion
            k = int(attrs.get("num_outputs", 1) or 1)
            outs = [name] + [name + str(i) for i in range(1, k)]
            return [helper.make_node("Identity", inputs[:1], [o], name=o) for o in outs]
        except OnnxExportError:
            raise
        except Exception as e:
            raise OnnxExportError("%s" % _first_line(e), node=node.get("name"), op=op) from None
    return conv


def _convert(symbol, params, input_shapes, data_names, opset: int, target: str, dynamic: bool,
             input_dtypes: Mapping[str, np.dtype]):
    """(the checked ONNX model, fused nodes that must be un-fused first)."""
    import onnx
    from mxnet.onnx.mx2onnx._export_onnx import MXNetGraph

    graph_json = _json_nodes(symbol)
    shapes, dtypes = _facts(symbol, params, input_shapes, input_dtypes)
    st = _State(graph_json, shapes, dtypes, target, opset, dynamic)
    st.names.update(n["name"] for n in graph_json["nodes"])
    st.int_inputs = {k for k, v in input_dtypes.items() if np.issubdtype(v, np.integer)}
    registry = MXNetGraph.registry_.setdefault(_CONVERTER_OPSET, {})
    saved = dict(registry)
    own = {**_EXTRA_EXPORTERS, **FUSED_OP_EXPORTERS}
    merged = {**MXNetGraph.registry_.get(12, {}), **saved, **own}
    for k, v in merged.items():
        registry[k] = _wrap(k, v)
    level = logging.getLogger().level
    logging.getLogger().setLevel(max(level, logging.WARNING))   # MXNet's exporter logs every node at INFO
    check_graph = onnx.checker.check_graph
    onnx.checker.check_graph = lambda *a, **k: None            # checked below, at the opset stamped
    _LOCAL.state = st
    try:
        # in the order of this symbol's own inputs (MXNet's exporter zips the shapes with them): a
        # graph with fused ops un-fused orders its inputs as the stock ops read them
        wanted = set(data_names)
        order = [n["name"] for n in graph_json["nodes"] if n["op"] == "null" and n["name"] in wanted]
        in_shapes = [tuple(int(d) for d in input_shapes[n]) for n in order]
        in_types = [onnx.TensorProto.FLOAT] * len(in_shapes)
        graph = MXNetGraph().create_onnx_graph_proto(symbol, params, in_shapes, in_types,
                                                     opset_version=_CONVERTER_OPSET, dynamic=dynamic)
    except FusionError:
        raise
    except Exception as e:
        raise OnnxExportError("MXNet's ONNX exporter failed: %s: %s" % (type(e).__name__, _first_line(e))) \
            from None
    finally:
        _LOCAL.state = None
        onnx.checker.check_graph = check_graph
        logging.getLogger().setLevel(level)
        registry.clear()
        registry.update(saved)
    if st.unfuse:
        return None, list(st.unfuse)
    heads = _head_names(graph_json)
    known = {}
    if not dynamic:      # shapes of the values named after their MXNet node (not renamed by MXNet)
        seen = set()
        for nid, n in enumerate(graph_json["nodes"]):
            if n["name"] in seen:
                continue
            seen.add(n["name"])
            for (i, k), shp in shapes.items():
                if i == nid:
                    known[n["name"] if k == 0 else n["name"] + str(k)] = list(shp)
    model = _finish(graph, heads, data_names, input_dtypes, opset, fold=not dynamic, known=known)
    model = passes.common_subexpressions(model)
    if not dynamic:
        model = passes.expand_into_constant(model, known)
    model = passes.flip_swapped_regions(model)
    if not dynamic:
        model = passes.drop_leading_unsqueeze(model)
    if target == "ort":
        model = passes.fused_gemm(model)
    if target == "ort" and not dynamic:
        model = passes.embed_layer_norm(model)
        model = passes.mask_index_from_embedding(model)
        model = _repeated_lengths_as_mask_index(model)
    return passes.drop_dead(model), []


# called through this module's name, so that a test can switch the pass off
_repeated_lengths_as_mask_index = passes.repeated_lengths_as_mask_index


def _head_names(graph_json) -> List[str]:
    """ONNX output names MXNet's exporter gives the symbol's outputs, in the symbol's order."""
    names, seen = [], set()
    nodes = graph_json["nodes"]
    renamed = {}
    for idx, n in enumerate(nodes):      # MXNet's exporter renames repeated node names
        renamed[idx] = n["name"] if n["name"] not in seen else "idx_%d_%s" % (idx, n["name"])
        seen.add(n["name"])
    for nid, index, _ in graph_json["heads"]:
        name = renamed[nid]
        names.append(name if index == 0 else name + str(index))
    return names


# --------------------------------------------------------------------------------------------
# the graph cleaned after conversion
# --------------------------------------------------------------------------------------------

_REDUCE_AXES_18 = ("ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                   "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")


def _finish(graph, heads: List[str], data_names: List[str], input_dtypes: Mapping[str, np.dtype], opset: int,
            fold: bool = True, known: Optional[Mapping[str, List[int]]] = None):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes = list(graph.node)
    inits = {t.name: t for t in graph.initializer}
    # single assignment: a name written twice gets a new name from its second writer on
    current: Dict[str, str] = {}
    written: set = set(inits) | {i.name for i in graph.input}
    for n in nodes:
        for i, name in enumerate(n.input):
            if name in current:
                n.input[i] = current[name]
        for i, name in enumerate(n.output):
            if not name:
                continue
            if name in written:
                k = 1
                while "%s__%d" % (name, k) in written:
                    k += 1
                current[name] = n.output[i] = "%s__%d" % (name, k)
            written.add(n.output[i])
    outputs = []
    by_name = {o.name: o for o in graph.output}
    for h in heads:
        o = onnx.ValueInfoProto()
        o.CopyFrom(by_name[h]) if h in by_name else o.CopyFrom(helper.make_empty_tensor_value_info(h))
        if h in current:      # the graph output is the last value written under its name
            nodes.append(helper.make_node("Identity", [current[h]], [h + "__out"]))
            o.name = h + "__out"
        outputs.append(o)
    # inputs: data only (weights are initializers), in their dtypes
    inputs = []
    for i in graph.input:
        if i.name in inits or i.name not in data_names:
            continue
        dt = input_dtypes.get(i.name)
        if dt is not None and dt != np.float32:
            elem = helper.np_dtype_to_tensor_dtype(dt)
            as_float = i.name + "__float"
            for n in nodes:
                for k, name in enumerate(n.input):
                    if name == i.name:
                        n.input[k] = as_float
            nodes.insert(0, helper.make_node("Cast", [i.name], [as_float], to=TensorProto.FLOAT))
            i.type.tensor_type.elem_type = elem
        inputs.append(i)
    nodes = passes.peephole(nodes, inits, {i.name: i.type.tensor_type.elem_type for i in inputs},
                      frozenset(o.name for o in outputs))
    nodes = passes.drop_identities(nodes, inits, {o.name for o in outputs})
    nodes = passes.slice_squeeze(nodes, inits, {o.name for o in outputs})
    # opset >= 18 spellings
    new_inits: List[Any] = []
    if opset >= 18:
        for n in nodes:
            if n.op_type in _REDUCE_AXES_18 and n.domain in ("", "ai.onnx"):
                axes = [a for a in n.attribute if a.name == "axes"]
                if axes:
                    name = "%s__axes" % (n.output[0])
                    new_inits.append(numpy_helper.from_array(np.array(list(axes[0].ints), np.int64), name))
                    n.attribute.remove(axes[0])
                    n.input.append(name)
            if n.op_type == "Split" and n.domain in ("", "ai.onnx") and len(n.input) < 2 and \
                    not any(a.name == "num_outputs" for a in n.attribute):
                n.attribute.append(helper.make_attribute("num_outputs", len(n.output)))
    g = helper.make_graph(nodes, "mxnet_fusion_export", inputs, outputs, list(inits.values()) + new_inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="mxnet-fusion")
    passes.drop_dead(model)       # dead nodes and unused initializers
    if any(n.domain == MS for n in model.graph.node):
        model.opset_import.append(helper.make_opsetid(MS, 1))
    model.ir_version = 8 if opset <= 15 else (9 if opset <= 19 else 10)
    if fold:
        # shapes by MXNet name only for names written once (a name written twice may not be the node's value)
        known = {k: v for k, v in (known or {}).items() if k not in current}
        for _ in range(4):
            before = len(model.graph.node)
            model = passes.fold_constants(model, known)
            if len(model.graph.node) == before:
                break
    if opset <= 19:       # the pinned onnx package knows the schemas up to opset 19
        try:
            onnx.checker.check_model(model)
        except Exception as e:
            raise OnnxExportError("the exported ONNX model is invalid at opset %d: %s" % (opset, _first_line(e))) \
                from None
    return model


def _rename_io(model, symbol, names: Mapping[str, str]) -> None:
    """Graph inputs and outputs renamed as ``names`` says (MXNet input / output name -> ONNX name)."""
    g = model.graph
    outputs = symbol.list_outputs()
    mapping = {i.name: names[i.name] for i in g.input if i.name in names}
    for o, mx_name in zip(g.output, outputs):
        if mx_name in names:
            mapping[o.name] = names[mx_name]
    taken = {x for n in g.node for x in list(n.input) + list(n.output)} | {t.name for t in g.initializer}
    mapping = {k: v for k, v in mapping.items() if k != v and (v not in taken or v in mapping)}
    if len(set(mapping.values())) != len(mapping):
        return
    for n in g.node:
        for i, x in enumerate(n.input):
            n.input[i] = mapping.get(x, x)
        for i, x in enumerate(n.output):
            n.output[i] = mapping.get(x, x)
    for v in list(g.input) + list(g.output):
        v.name = mapping.get(v.name, v.name)


def _validate(path: str, symbol, arg_params, aux_params, input_shapes, seed: int,
              names: Mapping[str, str]) -> VerifyResult:
    """ONNX Runtime on the file vs MXNet on the symbol, on inputs drawn to fit their use (token ids in
    range); an input the file takes as integers gets integer values (a 0/1 mask drawn as reals is rounded)."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise FusionError("onnxruntime is needed to validate the exported model "
                          "(pip install onnxruntime, or pass validate=False)") from None
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    types = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
             "tensor(double)": np.float64, "tensor(bool)": np.bool_, "tensor(uint8)": np.uint8}
    try:
        sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise VerificationError("ONNX Runtime cannot load the exported model: %s" % _first_line(e)) from None
    inputs = random_inputs(symbol, arg_params, input_shapes, seed)
    mx_name = {names.get(k, k): k for k in inputs}
    feed = {}
    for i in sess.get_inputs():
        dtype = types.get(i.type, np.float32)
        key = mx_name.get(i.name, i.name)
        value = np.asarray(inputs[key])
        if np.issubdtype(dtype, np.integer) and not np.array_equal(value, np.rint(value)):
            value = np.rint(value).astype(value.dtype)
            inputs[key] = value
        feed[i.name] = value.astype(dtype)
    reference = run(symbol, arg_params, aux_params, inputs)
    try:
        got = sess.run(None, feed)
    except Exception as e:
        raise VerificationError("ONNX Runtime cannot run the exported model: %s" % _first_line(e)) from None
    return compare(reference, got, symbol.list_outputs())
