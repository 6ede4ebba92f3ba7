r"""Transposed convolution [→ relu] → ``fused_deconv`` (oneDNN 3.x), where this CPU's costs say it pays.

Matched (anchor at the bottom)::

    x (N, C, H, W)   W (C, O, kh, kw)   [b (O,)]
        Deconvolution(2-D, NCHW, num_group=1, no target_shape, adj ≤ pad)
        [Activation(relu)]

Rewrite: ``fused_deconv(x, W, [b], act=…)`` with the deconvolution's own attributes::

    y[n, o, oh, ow] = b[o] + Σ_{c, kh, kw} x[n, c, ih, iw] · W[c, o, kh, kw],   oh = ih·S − P + kh·D
    OH = (H − 1)·S − 2P + D·(kh − 1) + 1 + adj                                  (MXNet's Deconvolution)

computed by the oneDNN 3.x this project ships, whose blocked brgemm kernels run the 4×4
stride-2 deconvolutions of GluonCV's pose and CenterNet heads about three times as fast as
MXNet 1.9.1's GEMM-based Deconvolution.  A BatchNorm after the deconvolution is folded first
(``conv_bn_act``, which runs before this rule); the relu is oneDNN's post-op (NaN gives 0, as
``Activation(relu)`` through oneDNN).  The sums run in another order (float32 error ~1e-7).

Cost: the op reads and writes NCHW, so next to MXNet's oneDNN convolutions it pays layout
reorders on both sides.  Made only where this CPU's cost table (``fusion/engine/cost.py``, measured by
``tools/measure_cpu_costs.py``: the deconvolution between two convolutions, fused against
MXNet's default bind) says it wins at the nearest measured size; without a table the
conservative rule declines it.  Both reasons land in the report.

Refused: grouped or non-2-D deconvolutions, layouts other than NCHW, ``target_shape``, ``adj``
larger than ``pad``, values other than float32, unknown input shapes, ``mode='training'`` (no
backward), and the GPU (no CUDA kernel).
"""
from __future__ import annotations

from typing import Dict, List, Optional

from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.ir.pattern import Const, Pattern, Var, op
from fusion.engine.reasons import NearMiss
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from ._block_shapes import layout_reason, not_2d
from ._dtypes import float32_reason
from .region import taken_by_region


def _pair(v, default) -> tuple:
    t = tuple(v) if v else ()
    return t or (default, default)


def deconv_pattern(with_act: bool) -> Pattern:
    deconv = op.Deconvolution(Var("x"), Const("w"), Const("b", optional=True), name="deconv")
    return op.Activation(deconv, act_type="relu", name="act") if with_act else deconv


def cost_case(m: Match, with_act: bool) -> Dict[str, object]:
    """The features the cost of ``fused_deconv`` depends on (``fusion.engine.cost``'s case)."""
    d = m.node("deconv")
    kernel, stride = _pair(d.param("kernel"), 1), _pair(d.param("stride"), 1)
    x, y = m.ctx.shape(m["x"]), m.ctx.shape(Entry(d))
    return {"kernel": "%dx%d/%d" % (kernel[0], kernel[1], stride[0]), "relu": with_act, "adds_reorders": True,
            "c_in": int(x[1]), "c_out": int(y[1]), "out_pixels": int(y[2] * y[3])}


class DeconvAct(Rule):
    family = "deconvolution"
    key = "deconv"
    inference_only = True
    training_reason = "fused_deconv has no backward; refused in mode='training'"

    def __init__(self, name: str, benefit: int, with_act: bool):
        self.name, self.benefit, self.with_act = name, benefit, with_act
        self.description = "Deconvolution%s → fused_deconv (oneDNN 3.x), where the CPU's cost table says it pays" % (
            " → Activation(relu)" if with_act else "")

    def pattern(self) -> Pattern:
        return deconv_pattern(self.with_act)

    def check(self, m: Match) -> Optional[str]:
        taken = taken_by_region(m)
        if taken:
            return taken
        d = m.node("deconv")
        if m.ctx.device != "cpu":
            return "fused_deconv has no %s implementation" % m.ctx.device
        kernel = tuple(d.param("kernel"))
        if len(kernel) != 2:
            return not_2d(d)
        reason = layout_reason(d)
        if reason:
            return reason
        if int(d.param("num_group")) != 1:
            return "Deconvolution '%s' is grouped (num_group=%d)" % (d.name, d.param("num_group"))
        if any(int(v) for v in tuple(d.param("target_shape") or ())):
            return "Deconvolution '%s' sets target_shape (its padding is then computed by MXNet)" % d.name
        pad, adj = _pair(d.param("pad"), 0), _pair(d.param("adj"), 0)
        if any(a > p for a, p in zip(adj, pad)):
            return "Deconvolution '%s' has adj %s larger than pad %s" % (d.name, adj, pad)
        reason = float32_reason([m["x"], m["w"]] + ([m["b"]] if m.has("b") else []), m.ctx)
        if reason:
            return reason
        shapes = m.ctx.shapes(m["x"])
        if not shapes:
            return "the input shape of Deconvolution '%s' is unknown (pass input shapes)" % d.name
        if any(len(s) != 4 for s in shapes):
            return NearMiss("the input of Deconvolution '%s' has shape %s, not (N, C, H, W)" % (d.name, shapes[0]))
        if m.ctx.shape(Entry(d)) is None:
            return "the output shape of Deconvolution '%s' is unknown" % d.name
        from fusion.engine import cost
        decision = cost.decide("fused_deconv", "float32", "forward", cost_case(m, self.with_act), kind="cpu")
        if not decision.fuse:
            return "Deconvolution '%s' stays MXNet's: %s" % (d.name, decision.reason)
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        d = m.node("deconv")
        attrs = {"kernel": tuple(d.param("kernel")), "stride": _pair(d.param("stride"), 1),
                 "pad": _pair(d.param("pad"), 0), "adj": _pair(d.param("adj"), 0),
                 "dilate": _pair(d.param("dilate"), 1), "num_filter": int(d.param("num_filter")),
                 "act": "relu" if self.with_act else "none"}
        inputs = [m["x"], m["w"]]
        if m.has("b") and not d.param("no_bias"):
            inputs.append(m["b"])
        else:
            attrs["no_bias"] = True
        return b.op("fused_deconv", inputs, attrs=attrs, name=m.anchor.name)


RULES: List[Rule] = [
    DeconvAct("deconv_relu", 17, with_act=True),     # after conv_bn_act (30) has folded the BatchNorm
    DeconvAct("deconv", 16, with_act=False),
]
