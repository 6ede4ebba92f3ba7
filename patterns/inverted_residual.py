r"""MobileNet's inverted-residual block → ``fused_inverted_residual``: three convolutions in one op, one layout.

Matched (anchor at the bottom), the block as it stands once the BatchNorms are folded
(``conv_bn_act``), hard-swish is one ``fused_elemwise`` (``elementwise``) and the SE is one
``fused_se`` (``squeeze_excitation``) — all of which run before this rule::

    x (N, C, H, W)
    [Convolution 1×1 (We, be) → act]                                 expand (absent when E = C)
    Convolution K×K depthwise (Wd, bd; num_group = E, stride S, pad (K-1)/2) → act
    [fused_se(in_act = hard_swish) of the depthwise output | fused_se of its act]
    Convolution 1×1 (Wp, bp)
    [elemwise_add(·, x)]                                              residual

    act: Activation(relu) | fused_elemwise  x0 · clip(x0 + 3, 0, 6) / 6  (GluonCV's hard-swish)

Rewrite: ``fused_inverted_residual(x, [We, be], Wd, bd, [W1, b1, W2, b2], Wp, bp)``: the convolutions run by
oneDNN 3.x with bias, activation and residual add as post-ops and the activations kept in one
layout (NHWC) from the block's input to its output — one reorder in, one out — where MXNet's
default bind pays a reorder at every op boundary and has no hard-swish post-op
(benchmarks/bench_cnn_blocks.py, MobileNetV3-Large).  The SE (global mean, 1×1 → relu → 1×1 →
clip(· + a, lo, hi) / d, scale) runs on the NHWC map in place.  The sums run in another order,
and oneDNN's hard-swish is x · min(max(x/6 + 1/2, 0), 1) (float32 error ~1e-7 relative).

Decided from the inferred shapes at every probe shape: ``x`` is (N, C, H, W); the weights are
(E, C, 1, 1), (E, 1, K, K), (O, E, 1, 1); the residual, when added, is ``x`` itself with the
output's shape.  Refused: a convolution without bias, with dilation, padding other than
(K-1)/2, unequal kernel/stride sides, a depthwise convolution whose groups are not its channels,
activations that differ between the two layers, an SE whose hidden activation is not
``Activation(relu)`` or whose gate is not clip-and-divide, or that adds a residual itself,
layouts other than NCHW, values other than float32, and ``mode='training'`` (no backward).
"""
from __future__ import annotations

from typing import Dict, List, Optional

from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.ir.pattern import Const, Pattern, Var, op
from fusion.engine.reasons import NearMiss
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from ._block_shapes import at_filled_sizes, layout_reason, nchw_block, not_2d
from ._dtypes import float32_reason
from .region import taken_by_region
from .squeeze_excitation import pointwise_conv_reason

#: GluonCV's HardSwish as the elementwise rule writes it into one fused_elemwise.
HARD_SWISH_EXPR = "mul(x0, div(clip(add(x0, 3.0), 0.0, 6.0), 6.0))"


def _act(v: Pattern, name: str) -> Pattern:
    return (op.Activation(v, act_type="relu", name=name)
            | op.fused_elemwise(v, name=name, expr=lambda e: str(e) == HARD_SWISH_EXPR))


def _conv(v: Pattern, tag: str) -> Pattern:
    return op.Convolution(v, Const("w" + tag), Const("b" + tag, optional=True), name=tag)


def _se(v: Pattern) -> Pattern:
    return op.fused_se(v, Const("w1"), Const("b1"), Const("w2"), Const("b2"),
                       name="se")


def inverted_residual_pattern() -> Pattern:
    x = Var("x")
    body = _act(_conv(x, "expand"), "act1") | x
    dw = _conv(body, "dw")
    mid = _se(dw) | _se(_act(dw, "act2")) | _act(dw, "act2")
    proj = _conv(mid, "project")
    return op.add(proj, x, name="add") | proj


def _true(v) -> bool:
    return v is True or str(v).lower() in ("true", "1")


def _kind(nd) -> str:
    return "relu" if nd.op == "Activation" else "hard_swish"


class InvertedResidual(Rule):
    name = "inverted_residual"
    benefit = 8                 # after bn_folding, squeeze_excitation and elementwise have run
    key = "project"
    inference_only = True
    training_reason = "fused_inverted_residual has no backward; refused in mode='training'"
    description = ("[1×1 conv → act] → depthwise conv → act [→ fused_se] → 1×1 conv [+ x] → fused_inverted_residual "
                   "(oneDNN 3.x, one layout)")

    def pattern(self) -> Pattern:
        return inverted_residual_pattern()

    # -- check -----------------------------------------------------------------
    def check(self, m: Match) -> Optional[str]:
        taken = taken_by_region(m)
        if taken:
            return taken
        ins = [m["x"]] + [m[k] for k in ("wexpand", "bexpand", "wdw", "bdw", "w1", "b1", "w2", "b2",
                                          "wproject", "bproject") if m.has(k)]
        reason = float32_reason(ins, m.ctx)
        if reason:
            return reason
        for check in (self._convs_reason, self._acts_reason, self._se_reason, self._shapes_reason):
            reason = check(m)
            if reason:
                return reason
        return None

    @staticmethod
    def _convs_reason(m: Match) -> Optional[str]:
        for tag in ("expand", "dw", "project"):
            if tag == "expand" and not m.has("wexpand"):
                continue
            conv = m.node(tag)
            if not m.has("b" + tag) or conv.param("no_bias"):
                return "Convolution '%s' has no bias (the block's BatchNorms fold into biases)" % conv.name
            reason = layout_reason(conv)
            if reason:
                return reason
            if tag != "dw":
                reason = pointwise_conv_reason(conv)
                if reason:      # not this block's 1×1 layer (a ResNet bottleneck's strided or 3×3 one)
                    return NearMiss(reason)
                if conv.param("num_group") != 1:
                    return NearMiss("Convolution '%s' is grouped (num_group=%d)" % (conv.name, conv.param("num_group")))
                continue
            if int(conv.param("num_group")) != int(conv.param("num_filter")):
                # not a depthwise layer: every ResNet-style block looks like this; --explain lists them
                return NearMiss("Convolution '%s' is not depthwise (num_group=%d, num_filter=%d)" % (
                    conv.name, conv.param("num_group"), conv.param("num_filter")))
            kernel, stride = tuple(conv.param("kernel")), tuple(conv.param("stride")) or (1, 1)
            pad, dilate = tuple(conv.param("pad")) or (0, 0), tuple(conv.param("dilate")) or (1, 1)
            if len(kernel) != 2:
                return not_2d(conv)
            if kernel[0] != kernel[1]:
                return "Convolution '%s' has kernel %s, not square" % (conv.name, kernel)
            if len(stride) != 2 or stride[0] != stride[1]:
                return "Convolution '%s' has unequal strides %s" % (conv.name, stride)
            if any(d != 1 for d in dilate):
                return "Convolution '%s' is dilated (dilate=%s)" % (conv.name, dilate)
            if pad != ((kernel[0] - 1) // 2,) * 2:
                return "Convolution '%s' pads %s, not (K-1)/2 = %d" % (conv.name, pad, (kernel[0] - 1) // 2)
        return None

    @staticmethod
    def _acts_reason(m: Match) -> Optional[str]:
        kinds = []
        if m.has("wexpand"):
            kinds.append(_kind(m.node("act1")))
        if m.has("act2"):
            kinds.append(_kind(m.node("act2")))
        else:
            kinds.append("hard_swish" if m.node("se").attrs.get("in_act") == "hard_swish" else "none")
        if "none" in kinds:
            return "the depthwise convolution's output is not activated"
        if len(set(kinds)) > 1:
            return "the two layers' activations differ (%s)" % ", ".join(kinds)
        if kinds[0] == "relu" and not m.has("w1") and not m.has("add"):
            # MXNet's oneDNN already runs each convolution with its relu: as one op such chains
            # measured slower (MobileNet 1.0's depthwise-separable pairs: 21.7 ms against 14.3)
            return "a plain relu block (no squeeze-excitation, no residual): left to MXNet's oneDNN convolutions"
        return None

    @staticmethod
    def _se_reason(m: Match) -> Optional[str]:
        if not m.has("w1"):
            return None
        se = m.node("se")
        a = se.attrs
        if m.has("act2") and a.get("in_act", "none") not in ("none", None):
            return "fused_se '%s' applies its own input activation after the block's" % se.name
        if a.get("act") != "act_relu":
            return "fused_se '%s' has hidden activation %s, not Activation(relu)" % (se.name, a.get("act"))
        if a.get("gate") != "clip":
            return "fused_se '%s' has gate %s, not clip(· + a, lo, hi) / d" % (se.name, a.get("gate"))
        if _true(se.attrs.get("residual", False)):
            return "fused_se '%s' adds a residual itself" % se.name
        if _true(a.get("no_bias1", False)) or _true(a.get("no_bias2", False)) or not (m.has("b1") and m.has("b2")):
            return "fused_se '%s' has a layer without bias" % se.name
        if a.get("fc1") != "conv" or a.get("fc2") != "conv":
            return "fused_se '%s' has dense layers (only 1×1 convolutions)" % se.name
        return None

    def _shapes_reason(self, m: Match) -> Optional[str]:
        reason, xs, shapes, assumed = nchw_block(m)
        if reason:
            return reason
        C = int(xs[0][1])
        wd, wp = m.shape("wdw"), m.shape("wproject")
        we = m.shape("wexpand") if m.has("wexpand") else None
        if wd is None or wp is None or (m.has("wexpand") and we is None):
            return "the block's weight shapes are unknown"
        E, K = wd[0], wd[2]
        if m.has("wexpand") and we != (E, C, 1, 1):
            return "the expand weight is %s, not (%d, %d, 1, 1)" % (we, E, C)
        if not m.has("wexpand") and C != E:
            return "the depthwise convolution reads %d channels, not its %d" % (C, E)
        if wd != (E, 1, K, K):
            return "the depthwise weight is %s, not (%d, 1, %d, %d)" % (wd, E, K, K)
        if wp[1:] != (E, 1, 1):
            return "the projection weight is %s, not (O, %d, 1, 1)" % (wp, E)
        if m.has("w1"):
            w1, w2 = m.shape("w1"), m.shape("w2")
            if w1 is None or w2 is None or w1[1:] != (E, 1, 1) or w2 != (E, w1[0], 1, 1):
                return "the SE's weights are %s and %s, not (M, %d, 1, 1) and (%d, M, 1, 1)" % (w1, w2, E, E)
        if m.has("add"):
            for entry in (Entry(m.node("add")), Entry(m.node("project"))):
                # the sum adds the block's input itself: at filled-in sizes too, what the convolutions
                # make of any plane (stride 1, "same" padding) decides it
                got = shapes(entry)
                if len(got) != len(xs) or any(tuple(a) != tuple(b) for a, b in zip(got, xs)):
                    return at_filled_sizes("the residual add broadcasts: the projection and the sum must have the "
                                           "block input's shape", assumed)
        return None

    # -- rewrite ---------------------------------------------------------------
    def rewrite(self, m: Match, b: Builder) -> Entry:
        dw = m.node("dw")
        expand = m.has("wexpand")
        act = _kind(m.node("act1")) if expand else (
            _kind(m.node("act2")) if m.has("act2") else "hard_swish")
        attrs: Dict[str, object] = {
            "expand": expand, "se": m.has("w1"), "residual": m.has("add"), "act": act,
            "kernel": int(tuple(dw.param("kernel"))[0]), "stride": int((tuple(dw.param("stride")) or (1,))[0]),
            "pad": int((tuple(dw.param("pad")) or (0,))[0]), "num_expand": int(m.shape("wdw")[0]),
            "num_filter": int(m.shape("wproject")[0])}
        inputs = [m["x"]]
        if expand:
            inputs += [m["wexpand"], m["bexpand"]]
        inputs += [m["wdw"], m["bdw"]]
        if m.has("w1"):
            se = m.node("se")
            inputs += [m["w1"], m["b1"], m["w2"], m["b2"]]
            attrs["num_hidden"] = int(m.shape("w1")[0])     # un-fusing rebuilds the SE's layers
            attrs.update(gate_add=float(se.attrs.get("gate_add", 3.0)), gate_min=float(se.attrs.get("gate_min", 0.0)),
                         gate_max=float(se.attrs.get("gate_max", 6.0)), gate_div=float(se.attrs.get("gate_div", 6.0)))
        inputs += [m["wproject"], m["bproject"]]
        return b.op("fused_inverted_residual", inputs, attrs=attrs, name=m.anchor.name)


RULES: List[Rule] = [InvertedResidual()]
