r"""Squeeze-excitation → ``fused_se``: pool, two small layers, a gate, and the scaled map in two passes.

Matched (anchor at the bottom), every form GluonCV writes::

    x                                   [x = z · (clip(z + 3, 0, 6) / 6)]   hard-swish before it (MobileNetV3)
    ├──────────────────────────┐
    │   AdaptiveAvgPooling2D(output_size=1) | Pooling(global_pool, avg) | mean(axis=(2, 3), keepdims)
    │   Convolution 1×1 | FullyConnected        W1 [b1]
    │   Activation(relu|sigmoid|tanh|softrelu) | relu
    │   Convolution 1×1 | FullyConnected        W2 [b2]
    │   Activation(sigmoid) | sigmoid | hard_sigmoid(α, β) | clip(· + a, lo, hi) / d
    │   [expand_dims | Reshape]…               back to (N, C, 1, 1)
    │   [broadcast_like(·, x[, lhs_axes, rhs_axes])]   the gate repeated over the plane (GluonCV's pose nets)
    y = broadcast_mul | elemwise_mul | _mul (x, g), either order
    [y = add(y, residual)  [→ Activation(relu) | relu]]

Rewrite: ``fused_se(z|x, W1, [b1], W2, [b2], [residual])`` computing::

    p = mean_{h,w} x[n, c, h, w]            pass 1 over the map
    h = act(W1 · p + b1);  g = gate(W2 · h + b2)
    y = out_act(x · g [+ residual])          pass 2 over the map

The arithmetic is the matched ops'; the pool's and the products' sums are in
another order (float32 error ~1e-7 relative).  The hard-swish, when matched, is
computed again in each pass instead of being written out.

Decided from the inferred shapes at every probe shape: ``x`` is (N, C, H, W); the
pool's output is (N, C, 1, 1) — a mean over the whole plane; the gate has that shape
again once reshaped (a reshape of (N, C) to (N, C, 1, 1) keeps the element order);
the product and the residual have ``x``'s shape.  ``broadcast_like(g, x)`` only repeats axes of
size 1: with g (N, C, 1, 1) and its output of ``x``'s shape (or g's, whatever ``lhs_axes`` /
``rhs_axes`` say) every value it gives is ``g[n, c]``, and ``x · broadcast_like(g, x)`` is ``x · g``;
refused where it gives another shape (axes that repeat the gate along other axes), or takes its
shape from another value than ``x``.  Refused: a ``Pooling`` that is
not global (its window is fixed while the plane's size is not), a 1×1 convolution
with stride, padding, dilation or groups, ``FullyConnected(flatten=False)`` on the
pooled map (it would read the last axis), layouts other than NCHW, values other
than float32, and ``mode='training'`` (the op has no backward).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np

from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.ir.pattern import Chain, Const, OneOf, Pattern, Var, op, scalar
from fusion.engine.reasons import NeedsShapes
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from ._block_shapes import at_filled_sizes, block_shapes, broadcasting_add, layout_reason
from ._dtypes import float32_reason
from .region import taken_by_region

HIDDEN_ACTS = ("relu", "sigmoid", "tanh", "softrelu")
RESHAPES = ("expand_dims", "Reshape", "reshape")


def _f32(v) -> float:
    return float(np.float32(float(v)))


def hard_swish_pattern(z: Pattern, prefix: str) -> Pattern:
    """GluonCV's HardSwish: ``z * (clip(z + 3, 0, 6) / 6)`` (the scalars are checked)."""
    gate = scalar("div", op.clip(scalar("add", z, name=prefix + "add"), name=prefix + "clip"), name=prefix + "div")
    return op.mul(z, gate, name=prefix + "mul")


def average_pool(x: Pattern) -> Pattern:
    return (op._contrib_AdaptiveAvgPooling2D(x, name="pool")
            | op.Pooling(x, name="pool", pool_type="avg")
            | op.mean(x, name="pool"))


def _layer(x: Pattern, k: int) -> Pattern:
    return op("Convolution", "FullyConnected")(x, Const("w%d" % k), Const("b%d" % k, optional=True),
                                               name="fc%d" % k)


def _gate(v: Pattern) -> Pattern:
    return (op.Activation(v, act_type="sigmoid", name="gate")
            | op.sigmoid(v, name="gate")
            | op.hard_sigmoid(v, name="gate")
            | scalar("div", op.clip(scalar("add", v, name="gate_add"), name="gate_clip"), name="gate"))


def se_pattern(in_hard_swish: bool, with_add: bool) -> Pattern:
    def feature() -> Pattern:
        return hard_swish_pattern(Var("z"), "hs_") if in_hard_swish else Var("x")

    h = _layer(average_pool(feature()), 1)
    h = op.Activation(h, act_type=OneOf(*HIDDEN_ACTS), name="act") | op.relu(h, name="act")
    g = Chain(RESHAPES, _gate(_layer(h, 2)), "gate_shape")
    g = op.broadcast_like(g, Var("like"), name="gate_like") | g
    y = op.mul(feature(), g, name="mul")
    if with_add:
        y = op.add(y, Var("residual"), name="add")
        y = y.optional(lambda v: op.Activation(v, act_type="relu", name="out_act") | op.relu(v, name="out_act"))
    return y


def same_shapes(shapes_a, shapes_b) -> bool:
    return bool(shapes_a) and len(shapes_a) == len(shapes_b) and all(
        tuple(a) == tuple(b) for a, b in zip(shapes_a, shapes_b))


class SqueezeExcitation(Rule):
    family = "squeeze_excitation"
    key = "mul"
    inference_only = True
    training_reason = "fused_se has no backward; refused in mode='training'"

    def __init__(self, name: str, benefit: int, in_hard_swish: bool, with_add: bool):
        self.name, self.benefit = name, benefit
        self.in_hard_swish, self.with_add = in_hard_swish, with_add
        self.description = ("%spool → 1×1 conv/dense → act → 1×1 conv/dense → sigmoid/hard-sigmoid → scale%s "
                            "→ fused_se" % ("hard-swish → " if in_hard_swish else "",
                                            " → residual add [→ relu]" if with_add else ""))

    def pattern(self) -> Pattern:
        return se_pattern(self.in_hard_swish, self.with_add)

    # -- check -----------------------------------------------------------------
    def check(self, m: Match) -> Optional[str]:
        taken = taken_by_region(m)
        if taken:
            return taken
        x = Entry(m.node("hs_mul")) if self.in_hard_swish else m["x"]
        ins = [m["z"] if self.in_hard_swish else x, m["w1"], m["w2"]] + \
            [m[k] for k in ("b1", "b2", "residual") if m.has(k)]
        reason = float32_reason(ins, m.ctx)
        if reason:
            return reason
        for check in (self._hard_swish_reason, self._pool_reason, self._layers_reason, self._gate_reason,
                      self._shapes_reason):
            reason = check(m)
            if reason:
                return reason
        return None

    def _hard_swish_reason(self, m: Match) -> Optional[str]:
        if not self.in_hard_swish:
            return None
        add, clip, div = m.node("hs_add"), m.node("hs_clip"), m.node("hs_div")
        got = (_f32(add.attrs["scalar"]), _f32(clip.param("a_min")), _f32(clip.param("a_max")),
               _f32(div.attrs["scalar"]))
        if got != (3.0, 0.0, 6.0, 6.0):
            return "z · clip(z + %g, %g, %g) / %g is not hard-swish (3, 0, 6, 6)" % got
        return None

    @staticmethod
    def _pool_reason(m: Match) -> Optional[str]:
        pool = m.node("pool")
        if pool.op == "Pooling":
            if not pool.param("global_pool", False):
                return ("Pooling '%s' is not global: its window is fixed while the plane's size is not"
                        % pool.name)
            reason = layout_reason(pool)
            if reason:
                return reason
        if pool.op == "mean":
            axis = pool.param("axis", None)
            axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
            if sorted(a % 4 for a in axes if a is not None) != [2, 3] or pool.param("exclude", False):
                return "mean '%s' is not over axes (2, 3)" % pool.name
            if not pool.param("keepdims", False):
                return "mean '%s' drops the pooled axes (keepdims=False)" % pool.name
        return None

    @staticmethod
    def _layers_reason(m: Match) -> Optional[str]:
        for k in (1, 2):
            fc = m.node("fc%d" % k)
            if fc.op == "FullyConnected":
                if not fc.param("flatten"):
                    return ("FullyConnected '%s' has flatten=False: it reads the last axis, not the channels"
                            % fc.name)
                continue
            reason = pointwise_conv_reason(fc)
            if reason:
                return reason
            if fc.param("num_group") != 1:
                return "Convolution '%s' is grouped (num_group=%d)" % (fc.name, fc.param("num_group"))
        return None

    @staticmethod
    def _gate_reason(m: Match) -> Optional[str]:
        for e in m["gate_shape"]:
            nd = e.node
            if nd.op == "Reshape" and nd.param("reverse", False):
                return "Reshape '%s' with reverse=True before the scale" % nd.name
        return None

    def _shapes_reason(self, m: Match) -> Optional[str]:
        ctx = m.ctx
        x = Entry(m.node("hs_mul")) if self.in_hard_swish else m["x"]
        # without input shapes: the block's own ops at filled-in sizes (C from the weights)
        shapes, assumed = block_shapes(m, x, [m["residual"]] if m.has("residual") else [])
        xs = shapes(x) if shapes is not None else ()
        if not xs:
            return NeedsShapes("the shape of the scaled map is unknown")
        if any(len(s) != 4 for s in xs):
            return "the scaled map has shape %s, not (N, C, H, W)" % (xs[0],)
        pooled = tuple((s[0], s[1], 1, 1) for s in xs)
        if not same_shapes(shapes(Entry(m.node("pool"))), pooled):
            return at_filled_sizes("the pool's output is %s, not the whole-plane mean %s" % (
                (shapes(Entry(m.node("pool"))) or (None,))[0], pooled[0]), assumed)
        gate = m["gate_shape"][0] if m["gate_shape"] else Entry(m.node("gate"))
        if not same_shapes(shapes(gate), pooled):
            return at_filled_sizes("the gate has shape %s where the scale needs %s (one value per sample and channel)"
                                   % ((shapes(gate) or (None,))[0], pooled[0]), assumed)
        if m.has("gate_like"):
            reason = self._broadcast_like_reason(m, x, xs, pooled, shapes, assumed)
            if reason:
                return reason
        w1, w2 = ctx.shape(m["w1"]), ctx.shape(m["w2"])
        if w1 is None or w2 is None:
            return "the layers' weight shapes are unknown"
        if not same_shapes(shapes(Entry(m.node("mul"))), xs):
            return at_filled_sizes("the product does not have the map's shape", assumed)
        if m.has("residual"):
            if m["residual"] == Entry(m.node("mul")):
                return "the residual is the product itself"
            if assumed and broadcasting_add(m.node("add").op):
                # the residual was filled in at the map's sizes: whether it broadcasts over the map at
                # some input size is for the input shapes to say (the fused op adds it elementwise)
                return NeedsShapes("%s '%s' may broadcast the residual at some input sizes"
                                   % (m.node("add").op, m.node("add").name))
            if not same_shapes(shapes(m["residual"]), xs):
                return at_filled_sizes("the residual has shape %s, not the map's %s" % (
                    (shapes(m["residual"]) or (None,))[0], xs[0]), assumed)
        return None

    @staticmethod
    def _broadcast_like_reason(m: Match, x: Entry, xs, pooled, shapes, assumed) -> Optional[str]:
        """Why ``broadcast_like(g, ·)`` is not the gate g (N, C, 1, 1) repeated over x's plane: it takes
        its shape from another value, or gives a shape other than x's or g's at some probe."""
        like = m.node("gate_like")
        if m["like"] != x:
            return ("broadcast_like '%s' takes its shape from '%s', not from the scaled map '%s'"
                    % (like.name, m["like"].node.name, x.node.name))
        outs = shapes(Entry(like))
        if len(outs) != len(xs) or any(tuple(o) not in (tuple(s), p) for o, s, p in zip(outs, xs, pooled)):
            got = next((tuple(o) for o, s, p in zip(outs, xs, pooled) if tuple(o) not in (tuple(s), p)),
                       (outs or (None,))[0])
            return at_filled_sizes(
                "broadcast_like '%s' (lhs_axes=%s, rhs_axes=%s) gives shape %s, neither the map's %s nor the "
                "gate's %s: not the gate repeated over the plane" % (
                    like.name, like.attrs.get("lhs_axes"), like.attrs.get("rhs_axes"), got, xs[0], pooled[0]),
                assumed)
        return None

    # -- rewrite ---------------------------------------------------------------
    def rewrite(self, m: Match, b: Builder) -> Entry:
        attrs: Dict[str, object] = {}
        act = m.node("act")
        kind = act.attrs["act_type"] if act.op == "Activation" else "relu"
        attrs["act"] = "act_relu" if (act.op == "Activation" and kind == "relu") else kind
        gate = m.node("gate")
        if gate.op in ("Activation", "sigmoid"):
            attrs["gate"] = "sigmoid"
            if gate.op == "sigmoid":     # spelled as it was, for unfuse: MXNet's oneDNN backend takes a
                attrs["gate_op"] = "sigmoid"     # Convolution → Activation(sigmoid) in and turns NaN into 0
        elif gate.op == "hard_sigmoid":
            attrs.update(gate="hard_sigmoid", alpha=_f32(gate.param("alpha", 0.2)), beta=_f32(gate.param("beta", 0.5)))
        else:
            clip = m.node("gate_clip")
            attrs.update(gate="clip", gate_add=_f32(m.node("gate_add").attrs["scalar"]),
                         gate_min=_f32(clip.param("a_min")), gate_max=_f32(clip.param("a_max")),
                         gate_div=_f32(gate.attrs["scalar"]))
        if self.in_hard_swish:
            attrs["in_act"] = "hard_swish"
        inputs = [m["z"] if self.in_hard_swish else m["x"], m["w1"]]
        if m.has("b1") and not m.node("fc1").param("no_bias"):
            inputs.append(m["b1"])
        else:
            attrs["no_bias1"] = True
        inputs.append(m["w2"])
        if m.has("b2") and not m.node("fc2").param("no_bias"):
            inputs.append(m["b2"])
        else:
            attrs["no_bias2"] = True
        # what the stock ops were: un-fusing restores them (weights keep their shapes)
        attrs["fc1"] = "conv" if m.node("fc1").op == "Convolution" else "dense"
        attrs["fc2"] = "conv" if m.node("fc2").op == "Convolution" else "dense"
        attrs["num_hidden"] = int(m.ctx.shape(m["w1"])[0])
        attrs["num_channels"] = int(m.ctx.shape(m["w2"])[0])
        if m.has("residual"):
            inputs.append(m["residual"])
            attrs["residual"] = True
            if m.has("out_act"):
                oa = m.node("out_act")
                attrs["out_act"] = "act_relu" if oa.op == "Activation" else "relu"
        return b.op("fused_se", inputs, attrs=attrs, name=m.anchor.name)


RULES: List[Rule] = [
    SqueezeExcitation("se_hard_swish_add", 99, in_hard_swish=True, with_add=True),
    SqueezeExcitation("se_hard_swish", 98, in_hard_swish=True, with_add=False),
    SqueezeExcitation("se_add", 97, in_hard_swish=False, with_add=True),
    SqueezeExcitation("se", 96, in_hard_swish=False, with_add=False),
]


def pointwise_conv_reason(fc) -> Optional[str]:
    """Why Convolution ``fc`` is not a plain 1×1 layer over NCHW (stride 1, no dilation, no padding)."""
    kernel = tuple(fc.param("kernel"))
    if kernel != (1, 1):
        return "Convolution '%s' has kernel %s, not 1×1" % (fc.name, kernel)
    for key in ("stride", "dilate"):
        v = tuple(fc.param(key))
        if v and any(s != 1 for s in v):
            return "Convolution '%s' has %s=%s" % (fc.name, key, v)
    pad = tuple(fc.param("pad"))
    if pad and any(p != 0 for p in pad):
        return "Convolution '%s' pads its input (pad=%s)" % (fc.name, pad)
    reason = layout_reason(fc)
    if reason:
        return reason
    return None
