r"""Un-fusing: every ``fused_*`` op back into stock MXNet ops (``fusion.unfuse``, ``mxfuse --unfuse``).

A fused model then loads where mxnet-fusion is not installed.  Parameter
transforms stay applied (folded convolutions remain folded); parameters keep
their names, so the fused model's params file goes with the un-fused symbol.

=========================  ==========================================================
fused op                   stock ops
=========================  ==========================================================
fused_dense                FullyConnected [→ Activation | LeakyReLU | tanh-GELU ops]
fused_add_layer_norm       broadcast_add → LayerNorm (the sum is the 2nd output)
fused_elemwise             the program's ops (broadcast_*, scalar ops, where on broadcast_like'd operands)
fused_attention            head split (Reshape/transpose/slice_axis) → batch_dot(q, k, transpose_b) ·scale
                           [+ mask | where] → softmax [use_length] → batch_dot(·, v) → head merge
=========================  ==========================================================
"""
from __future__ import annotations

from typing import List

from fusion.errors import FusionError
from fusion.graph import Entry
from fusion.matcher import Match
from fusion.rewrite import Builder
from fusion.rule import Rule

from ._unfuse_base import _Unfuse
from .unfuse_elemwise import ElemwiseProgram, UnfuseElemwise
from .unfuse_attention import UnfuseAttention


# ---------------------------------------------------------------- fused_dense

def _activation(b: Builder, x: Entry, act: str, slope: float, name: str) -> Entry:
    if act in ("none", "", None):
        return x
    if act == "act_relu":
        return b.op("Activation", [x], attrs={"act_type": "relu"}, name=name)
    if act == "relu":
        return b.op("relu", [x], name=name)
    if act in ("sigmoid", "tanh", "softrelu"):
        return b.op("Activation", [x], attrs={"act_type": act}, name=name)
    if act == "leaky":
        return b.op("LeakyReLU", [x], attrs={"act_type": "leaky", "slope": slope}, name=name)
    if act == "gelu_erf":
        return b.op("LeakyReLU", [x], attrs={"act_type": "gelu"}, name=name)
    if act == "gelu_tanh":
        return ElemwiseProgram(b, [x], name).build(
            "mul(mul(x0, 0.5), add(tanh(mul(add(x0, mul(mul(mul(x0, x0), x0), 0.044715)), 0.7978845608028654)), 1))")
    raise FusionError("fused_dense activation %r has no stock equivalent" % act)


def _is_bf16_weight(m: Match, w: Entry) -> bool:
    from fusion.precision import BF16_CODE, is_bf16
    if m.ctx.dtype(w) == "bfloat16":
        return True
    value = m.ctx.value(w)
    if value is not None:
        return is_bf16(value.dtype)
    return w.node.is_variable and str(w.node.attrs.get("__dtype__")) == str(BF16_CODE)


class UnfuseDense(_Unfuse):
    def __init__(self):
        super().__init__("fused_dense", 3)

    def rewrite(self, m: Match, b: Builder) -> Entry:
        f = m.node("f")
        ins = self.inputs(m)
        no_bias = bool(f.param("no_bias", False))
        attrs = {"num_hidden": int(f.attrs["num_hidden"]), "flatten": bool(f.param("flatten", True)),
                 "no_bias": no_bias}
        if _is_bf16_weight(m, ins[1]):   # precision="bf16": FullyConnected takes it widened back to float32
            ins = [ins[0], b.op("amp_cast", [ins[1]], attrs={"dtype": "float32"}, name=f.name + "_weight_fp32")] + ins[2:]
        fc = b.op("FullyConnected", ins[:2] if no_bias else ins[:3], attrs=attrs, name=f.name + "_fc")
        return _activation(b, fc, f.attrs.get("act", "none"), float(f.param("slope", 0.25)), f.name)


# ---------------------------------------------------------------- fused_add_layer_norm

class UnfuseAddLayerNorm(_Unfuse):
    def __init__(self):
        super().__init__("fused_add_layer_norm", 4)

    def rewrite(self, m: Match, b: Builder):
        f = m.node("f")
        a, bb, g, be = self.inputs(m)
        s = b.op("broadcast_add", [a, bb], name=f.name + "_sum")
        y = b.op("LayerNorm", [s, g, be], attrs={"axis": -1, "eps": float(f.param("eps", 1e-5))}, name=f.name)
        if f.param("output_sum", False):
            return {Entry(f, 0): y, Entry(f, 1): s}
        return y


RULES: List[Rule] = [UnfuseDense(), UnfuseAddLayerNorm(), UnfuseElemwise(), UnfuseAttention()]
