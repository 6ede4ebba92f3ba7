"""Stock-op pieces the un-fusing rules share (see ``patterns/unfuse.py``): a fused op's activation
written out, and whether a value between ops is held in bfloat16."""
from __future__ import annotations

from fusion.engine.rewrite import Builder
from fusion.ir.errors import FusionError
from fusion.ir.graph import Entry
from fusion.ir.matcher import Match

from .unfuse_elemwise import ElemwiseProgram


def activation(b: Builder, x: Entry, act: str, slope: float, name: str) -> Entry:
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


def is_bf16_value(m: Match, e: Entry) -> bool:
    """A value between ops held in bfloat16 (fusion.precision.policy.between_ops), fused or unfused already."""
    if m.ctx.dtype(e) == "bfloat16":
        return True
    from fusion.precision.policy import is_bf16_copy
    if is_bf16_copy(e):
        return True
    src = e.node
    key = {"fused_dense": "out_dtype", "fused_attention": "out_dtype", "amp_cast": "dtype"}.get(src.op)
    return key is not None and str(src.attrs.raw(key)) == "bfloat16"
