r"""ResNeSt's split attention → ``fused_split_attention``: radix sum, pool, two grouped 1×1 layers,
r-softmax and the weighted sum in two passes over the map.

Matched (anchor at the bottom), as GluonCV's ``SplitAttentionConv`` writes it after its
convolution, BatchNorm and relu (``x``)::

    radix R > 1                                          radix 1
    x (N, R·C, H, W)                                     x (N, C, H, W)
    s = Reshape(expand_dims(x, 1), (0, R, C, 0, 0))      │
    sum(s, axis=1)                                       │
    AdaptiveAvgPooling2D(1) | Pooling(global avg) | mean(axis=(2, 3), keepdims)
    Convolution 1×1, num_group=G1       W1 [b1]
    [BatchNorm]                         (folded into W1, b1: exact scale and shift)
    Activation(relu|sigmoid|tanh|softrelu) | relu
    Convolution 1×1, num_group=G2       W2 [b2]          (N, R·C, 1, 1)
    Reshape → (N, A, R, C/A);  SwapAxis(1, 2)
    softmax(axis=1)                                      sigmoid | Activation(sigmoid)
    Reshape → (N, R, C, 1, 1)                            Reshape → (N, C, 1, 1)
    sum(broadcast_mul(·, s), axis=1)                     broadcast_mul(·, x)

Rewrite: ``fused_split_attention(x, W1, [b1], W2, [b2])`` computing::

    p   = mean_{h,w} Σ_r x[:, r·C + c]                 pass 1 over the map
    h   = act(W1 ⊛ p + b1);  a = W2 ⊛ h + b2           ⊛: the grouped 1×1 convolutions
    att = softmax_r a[(k·R + r)·D + d]  (c = k·D + d, D = C/A);  sigmoid(a) at radix 1
    y   = Σ_r att[r, c] · x[:, r·C + c]                pass 2 over the map

The reshapes never move an element; what they mean is decided from the inferred
shapes at every probe shape: ``s`` is (N, R, C, H, W) with R·C the channels of ``x``
(so ``s[n, r, c] = x[n, r·C + c]``), the attention logits are viewed as (N, A, R, D)
with A·D = C, the swap exchanges axes 1 and 2, the softmax runs over axis 1 (R) and
the weights are viewed as (N, R, C, 1, 1).  At radix 1 the swapped axis 2 has size 1
(the swap moves nothing).  The pool's and the products' sums are in another order
(float32 error ~1e-7 relative).  A BatchNorm between the first layer and its
activation is folded in float64, as ``conv_bn`` folds it.

Refused: a ``Pooling`` that is not global, a 1×1 layer with stride, padding,
dilation or another layout, a softmax with a temperature or lengths, other shapes
than above, values other than float32, and ``mode='training'`` (the op has no backward).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.ir.pattern import Const, OneOf, Pattern, Var, op
from fusion.engine.reasons import NeedsShapes
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from ._block_shapes import at_filled_sizes, block_shapes
from ._dtypes import float32_reason
from .elementwise import batchnorm_scale_shift
from .squeeze_excitation import pointwise_conv_reason
from .squeeze_excitation import HIDDEN_ACTS, SqueezeExcitation, average_pool, same_shapes

RESHAPE = ("Reshape", "reshape")
SWAP = ("SwapAxis", "swapaxes")


def _axes(node, key: str = "axis") -> Optional[Tuple[int, ...]]:
    v = node.param(key, None)
    if v is None:
        return None
    return tuple(int(a) for a in v) if isinstance(v, (tuple, list)) else (int(v),)


def split_attention_pattern(radix: bool) -> Pattern:
    x = Var("x")

    def split() -> Pattern:
        return (op(*RESHAPE)(op.expand_dims(x, name="expand"), name="split")
                | op(*RESHAPE)(x, name="split"))

    gap = op.sum(split(), name="radix_sum") if radix else x
    h = op.Convolution(average_pool(gap), Const("w1"), Const("b1", optional=True), name="fc1")
    h = h.optional(lambda v: op.BatchNorm(v, Const("gamma"), Const("beta"), Const("mean"), Const("var"),
                                          name="bn1"))
    h = op.Activation(h, act_type=OneOf(*HIDDEN_ACTS), name="act") | op.relu(h, name="act")
    a = op.Convolution(h, Const("w2"), Const("b2", optional=True), name="fc2")
    a = op(*SWAP)(op(*RESHAPE)(a, name="att_shape"), name="swap")
    if radix:
        g = op.softmax(a, name="gate")
    else:
        g = op.sigmoid(a, name="gate") | op.Activation(a, act_type="sigmoid", name="gate")
    g = op(*RESHAPE)(g, name="att_view")
    if radix:
        return op.sum(op.mul(g, split(), name="mul"), name="wsum")
    return op.mul(g, x, name="mul")


class SplitAttention(Rule):
    family = "split_attention"
    inference_only = True
    training_reason = "fused_split_attention has no backward; refused in mode='training'"

    def __init__(self, name: str, benefit: int, radix: bool):
        self.name, self.benefit, self.radix = name, benefit, radix
        self.key = "wsum" if radix else "mul"
        self.description = ("%s → pool → grouped 1×1 conv [→ BN] → act → grouped 1×1 conv → %s → weighted "
                            "sum → fused_split_attention" % ("radix sum" if radix else "(radix 1)",
                                                             "r-softmax" if radix else "sigmoid"))

    def pattern(self) -> Pattern:
        return split_attention_pattern(self.radix)

    # -- check -----------------------------------------------------------------
    def check(self, m: Match) -> Optional[str]:
        ins = [m["x"], m["w1"], m["w2"]] + [m[k] for k in ("b1", "b2") if m.has(k)]
        reason = float32_reason(ins, m.ctx)
        if reason:
            return reason
        for check in (SqueezeExcitation._pool_reason, self._layers_reason, self._reduce_reason, self._gate_reason,
                      self._shapes_reason, self._bn_reason):
            reason = check(m)
            if reason:
                return reason
        return None

    @staticmethod
    def _layers_reason(m: Match) -> Optional[str]:
        for k in (1, 2):
            reason = pointwise_conv_reason(m.node("fc%d" % k))
            if reason:
                return reason
        return None

    @staticmethod
    def _bn_reason(m: Match) -> Optional[str]:
        if not m.has("bn1"):
            return None
        bn = m.node("bn1")
        if bn.param("axis") % 4 != 1:
            return "BatchNorm '%s' normalizes axis %d, not the channel axis 1" % (bn.name, bn.param("axis"))
        if bn.param("output_mean_var"):
            return "BatchNorm '%s' also returns its mean and variance" % bn.name
        if batchnorm_scale_shift(bn, m.ctx) is None or m.value("w1") is None or (
                m.has("b1") and not m.node("fc1").param("no_bias") and m.value("b1") is None):
            return ("BatchNorm '%s' cannot be folded: its parameters or the layer's are not all given, or a "
                    "variance + eps is not positive" % bn.name)
        return None

    def _reduce_reason(self, m: Match) -> Optional[str]:
        if not self.radix:
            return None
        for name in ("radix_sum", "wsum"):
            nd = m.node(name)
            if nd.param("exclude", False) or nd.param("keepdims", False):
                return "sum '%s' has exclude or keepdims set" % nd.name
        return None

    def _gate_reason(self, m: Match) -> Optional[str]:
        if not self.radix:
            return None
        sm = m.node("gate")
        temperature = sm.param("temperature", None)
        if temperature not in (None, 1.0, 1):
            return "softmax '%s' has temperature %s" % (sm.name, temperature)
        if sm.param("use_length", False):
            return "softmax '%s' uses lengths" % sm.name
        if sm.param("dtype", None) not in (None, "None", "float32"):
            return "softmax '%s' casts to %s" % (sm.name, sm.param("dtype"))
        return None

    #: the checks of ``_shapes_reason`` that compare values' shapes (the others read weights and attributes)
    SIZED = ("the radix view", "the channels change", "the pool's output", "the logits are viewed",
             "the attention groups change", "the attention weights have shape", "the result has shape")

    def _shapes_reason(self, m: Match) -> Optional[str]:
        # without input shapes: the block's own ops at filled-in sizes (its channels from the weights)
        shapes, assumed = block_shapes(m, m["x"])
        reason = self._relations_reason(m, shapes)
        if reason and not isinstance(reason, NeedsShapes) and reason.startswith(self.SIZED):
            return at_filled_sizes(reason, assumed)
        return reason

    def _relations_reason(self, m: Match, shapes) -> Optional[str]:
        ctx = m.ctx
        xs = shapes(m["x"]) if shapes is not None else ()
        if not xs:
            return NeedsShapes("the shape of the split map is unknown")
        if any(len(s) != 4 for s in xs):
            return "the split map has shape %s, not (N, R·C, H, W)" % (xs[0],)
        shp = lambda name: shapes(Entry(m.node(name)))  # noqa: E731
        if self.radix:
            split = shp("split")
            if not split or len(split) != len(xs) or any(
                    len(s) != 5 or s[1] < 1 or s[1] * s[2] != x[1] or (s[0], s[3], s[4]) != (x[0], x[2], x[3])
                    for s, x in zip(split, xs)):
                return "the radix view has shape %s, not (N, R, C, H, W) of the map %s" % (
                    split[0] if split else None, xs[0])
            R, C = split[0][1], split[0][2]
            if any((s[1], s[2]) != (R, C) for s in split):
                return "the radix view changes with the input shape"
            if _axes(m.node("radix_sum")) not in ((1,), (-4,)) or _axes(m.node("wsum")) not in ((1,), (-4,)):
                return "the sums are not over the radix axis 1"
            if R < 2:
                return "radix %d: the split view has one group (the radix-1 rule takes it)" % R
        else:
            R, C = 1, xs[0][1]
            if any(s[1] != C for s in xs):
                return "the channels change with the input shape"
        n_hw = [(x[0], C, x[2], x[3]) for x in xs]
        pooled = tuple((x[0], C, 1, 1) for x in xs)
        if not same_shapes(shp("pool"), pooled):
            return "the pool's output is %s, not the whole-plane mean %s" % ((shp("pool") or (None,))[0],
                                                                              pooled[0])
        w1, w2 = ctx.shape(m["w1"]), ctx.shape(m["w2"])
        if w1 is None or w2 is None:
            return "the layers' weight shapes are unknown"
        g1, g2 = int(m.node("fc1").param("num_group")), int(m.node("fc2").param("num_group"))
        cm = w1[0]
        if tuple(w1) != (cm, C // g1, 1, 1) or C % g1:
            return "the first layer's weight %s does not read C=%d channels in %d groups" % (w1, C, g1)
        if tuple(w2) != (R * C, cm // g2, 1, 1) or cm % g2:
            return "the second layer's weight %s does not give R·C=%d channels from %d in %d groups" % (
                w2, R * C, cm, g2)
        view = shp("att_shape")
        if not view or any(len(v) != 4 or v[0] != x[0] or v[2] != R or v[1] * v[3] != C for v, x in zip(view, xs)):
            return "the logits are viewed as %s, not (N, A, R=%d, C/A) with C=%d" % (view[0] if view else None, R, C)
        A = view[0][1]
        if any(v[1] != A for v in view):
            return "the attention groups change with the input shape"
        swap = m.node("swap")
        if sorted((int(swap.param("dim1", 0)), int(swap.param("dim2", 0)))) != [1, 2]:
            return "SwapAxis '%s' exchanges axes %s, not 1 and 2" % (
                swap.name, (swap.param("dim1", 0), swap.param("dim2", 0)))
        if self.radix:
            axis = m.node("gate").param("axis")
            if int(axis) % 4 != 1:
                return "softmax '%s' runs over axis %s, not the radix axis 1" % (m.node("gate").name, axis)
            want = tuple((x[0], R, C, 1, 1) for x in xs)
        else:
            want = pooled
        if not same_shapes(shp("att_view"), want):
            return "the attention weights have shape %s where the product needs %s" % (
                (shp("att_view") or (None,))[0], want[0])
        out = shp("wsum" if self.radix else "mul")
        if not same_shapes(out, tuple(n_hw)):
            return "the result has shape %s, not (N, C, H, W) %s" % (out[0] if out else None, n_hw[0])
        return None

    # -- rewrite ---------------------------------------------------------------
    def rewrite(self, m: Match, b: Builder) -> Entry:
        act = m.node("act")
        kind = act.attrs["act_type"] if act.op == "Activation" else "relu"
        fc1, fc2 = m.node("fc1"), m.node("fc2")
        shapes, _ = block_shapes(m, m["x"])     # (A, R, C/A) do not depend on the sizes: the first probe's
        view = shapes(Entry(m.node("att_shape")))[0]
        attrs = {"radix": int(view[2]), "att_groups": int(view[1]),
                 "num_group1": int(fc1.param("num_group")), "num_group2": int(fc2.param("num_group")),
                 "act": "act_relu" if (act.op == "Activation" and kind == "relu") else kind,
                 "gate": "softmax" if self.radix else "sigmoid",
                 "num_hidden": int(m.ctx.shape(m["w1"])[0]), "num_channels": int(view[1] * view[3])}
        has_b1 = m.has("b1") and not fc1.param("no_bias")
        w1 = m["w1"]
        b1 = m["b1"] if has_b1 else None
        if m.has("bn1"):
            scale, shift, _, _ = batchnorm_scale_shift(m.node("bn1"), m.ctx)
            w = m.value("w1").astype(np.float64)
            bias = m.value("b1").astype(np.float64).ravel() if has_b1 else np.zeros(w.shape[0])
            w1 = b.param(fc1.name + "_folded_weight", (w * scale.reshape(-1, 1, 1, 1)).astype(np.float32))
            b1 = b.param(fc1.name + "_folded_bias", (bias * scale + shift).astype(np.float32))
        inputs = [m["x"], w1]
        if b1 is not None:
            inputs.append(b1)
        else:
            attrs["no_bias1"] = True
        inputs.append(m["w2"])
        if m.has("b2") and not fc2.param("no_bias"):
            inputs.append(m["b2"])
        else:
            attrs["no_bias2"] = True
        return b.op("fused_split_attention", inputs, attrs=attrs, name=m.anchor.name)


RULES: List[Rule] = [
    SplitAttention("split_attention_radix", 95, radix=True),
    SplitAttention("split_attention_radix1", 94, radix=False),
]
