r"""Grouped convolution of few channels per group → ``fused_grouped_conv`` (oneDNN 3.x).

Matched (anchor at the bottom)::

    x (N, C, H, W)   W (O, C/G, kh, kw)   [b (O,)]
        Convolution(num_group=G > 1, 2-D, NCHW)          4 ≤ C/G ≤ 16
        [Activation(relu)]

Rewrite: ``fused_grouped_conv(x, W, [b], act=…)`` with the convolution's own attributes:
the same convolution computed by the oneDNN 3.x this project ships, whose blocked kernels
for these shapes run at 49–128 GFLOP/s alone (benchmarks/grouped_conv_dnnl.cc; ResNeXt's 32 groups
of 4–16 channels).  A BatchNorm after the convolution is folded first
(``conv_bn_act``, which runs before this rule); the relu is oneDNN's post-op, as MXNet's own
oneDNN backend fuses it (NaN gives 0, as ``Activation(relu)`` through oneDNN).  The sums run in
another order (float32 error ~1e-7 relative).

Opt-in (``--rules grouped_convolution``): in ResNeXt's block (benchmarks/bench_grouped_conv.py)
the reorders from and to MXNet's layouts cost more than the kernel saves — measured 0.83–0.88× of
MXNet's default bind at 2 threads (0.76–0.99× at 1–2 threads under heavy load) on a shared 2-core machine.

Decided from the attributes and the weight (O, C/G, kh, kw) alone, so input shapes are not needed.
Refused: channels per group outside 4–16 (not measured: depthwise convolutions, wide groups),
kernels other than 2-D, layouts other than NCHW, values other than float32, and
``mode='training'`` (the op has no backward).  A ``relu`` op (NaN stays NaN) is
left after the fused convolution.
"""
from __future__ import annotations

from typing import List, Optional

from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.ir.pattern import Const, Pattern, Var, op
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from ._block_shapes import layout_reason, not_2d
from ._dtypes import float32_reason
from .region import taken_by_region

MIN_PER_GROUP, MAX_PER_GROUP = 4, 16


def _weight_shape(m: Match):
    """The weight's inferred shape, or its value's (a weight folded in this pass has no inferred shape yet)."""
    shape = m.ctx.shape(m["w"])
    if shape is None and m.value("w") is not None:
        shape = m.value("w").shape
    return shape


def grouped_conv_pattern(with_act: bool) -> Pattern:
    conv = op.Convolution(Var("x"), Const("w"), Const("b", optional=True), name="conv",
                          num_group=lambda g: int(g) > 1)
    return op.Activation(conv, act_type="relu", name="act") if with_act else conv


class GroupedConv(Rule):
    family = "grouped_convolution"
    key = "conv"
    inference_only = True
    training_reason = "fused_grouped_conv has no backward; refused in mode='training'"

    def __init__(self, name: str, benefit: int, with_act: bool):
        self.name, self.benefit, self.with_act = name, benefit, with_act
        self.description = "grouped Convolution (4-16 channels per group)%s → fused_grouped_conv (oneDNN 3.x)" % (
            " → Activation(relu)" if with_act else "")

    def pattern(self) -> Pattern:
        return grouped_conv_pattern(self.with_act)

    def check(self, m: Match) -> Optional[str]:
        taken = taken_by_region(m)
        if taken:
            return taken
        conv = m.node("conv")
        if len(tuple(conv.param("kernel"))) != 2:
            return not_2d(conv)
        reason = layout_reason(conv)
        if reason:
            return reason
        reason = float32_reason([m["x"], m["w"]] + ([m["b"]] if m.has("b") else []), m.ctx)
        if reason:
            return reason
        # a 2-D kernel takes an (N, C, H, W) input (MXNet checks it), and the weight (O, C/G, kh, kw)
        # gives the channels per group: nothing here depends on the input's sizes
        weight = _weight_shape(m)
        if weight is None:
            return "the weight shape of Convolution '%s' is unknown" % conv.name
        per_group = int(weight[1])
        if not MIN_PER_GROUP <= per_group <= MAX_PER_GROUP:
            return ("Convolution '%s' has %d channels per group, outside the measured range %d-%d"
                    % (conv.name, per_group, MIN_PER_GROUP, MAX_PER_GROUP))
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        conv = m.node("conv")
        kernel = tuple(conv.param("kernel"))
        attrs = {"kernel": kernel, "stride": tuple(conv.param("stride")) or (1, 1),
                 "pad": tuple(conv.param("pad")) or (0, 0), "dilate": tuple(conv.param("dilate")) or (1, 1),
                 "num_group": int(conv.param("num_group")), "num_filter": int(_weight_shape(m)[0]),
                 "act": "act_relu" if self.with_act else "none"}
        inputs = [m["x"], m["w"]]
        if m.has("b") and not conv.param("no_bias"):
            inputs.append(m["b"])
        else:
            attrs["no_bias"] = True
        return b.op("fused_grouped_conv", inputs, attrs=attrs, name=m.anchor.name)


RULES: List[Rule] = [
    GroupedConv("grouped_conv_relu", 16, with_act=True),    # after conv_bn_act (30) has folded the BatchNorm
    GroupedConv("grouped_conv", 15, with_act=False),
]
