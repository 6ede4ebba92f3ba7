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


class UnfuseDense(_Unfuse):
    def __init__(self):
        super().__init__("fused_dense", 3)

    def rewrite(self, m: Match, b: Builder) -> Entry:
        f = m.node("f")
        ins = self.inputs(m)
        no_bias = bool(f.param("no_bias", False))
        attrs = {"num_hidden": int(f.attrs["num_hidden"]), "flatten": bool(f.param("flatten", True)),
                 "no_bias": no_bias}
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


class _OnlyNodes(Rule):
    """``rule`` restricted to the fused nodes named in ``names`` (the others are kept)."""

    def __init__(self, rule: Rule, names: set):
        self._rule, self._names = rule, names
        self.name, self.family, self.benefit = rule.name, rule.family, rule.benefit
        self.description = rule.description
        self.inference_only = rule.inference_only

    def __getattr__(self, key):
        return getattr(self._rule, key)

    def pattern(self):
        return self._rule.pattern()

    def check(self, m: Match):
        if m.node("f").name not in self._names:
            return "kept fused (not selected)"
        return self._rule.check(m)

    def outside_use_ok(self, m: Match, entry: Entry, user) -> bool:
        return self._rule.outside_use_ok(m, entry, user)

    def rewrite(self, m: Match, b: Builder):
        return self._rule.rewrite(m, b)


def only_nodes(rule: Rule, names: set) -> Rule:
    """``rule`` applied only to the fused nodes named in ``names``."""
    return _OnlyNodes(rule, names)
