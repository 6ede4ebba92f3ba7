r"""DenseNet's dense block → ``fused_dense_block``: every layer of the block in one op, one buffer
(and, family ``densenet``, ``pool_before_pointwise_conv`` for its transitions: see below).

Matched (anchor: the block's last Concat), L ≥ 1 layers as GluonCV and MXNet's model zoo write
them (``HybridConcurrent(axis=1)`` of ``Identity`` and the layer: ``Concat(x, new, dim=1)``)::

    x (N, C0, H, W)
    per layer, cat = x for the first:
      BatchNorm(cat) | broadcast_add(broadcast_mul(cat, s), t) → relu
        → Convolution 1×1 [bias] [→ BatchNorm] → relu → Convolution 3×3 pad 1 [bias]
      cat = Concat(cat, ·, dim=1)

    [BatchNorm(cat) | broadcast_add(broadcast_mul(cat, s), t) → relu]      the next pre-activation

    relu: Activation(relu) | relu; s, t: (C, 1, 1) (what un-fusing writes).  The 1×1
    convolution's BatchNorm is usually folded already
    (``conv_bn_act``, which runs first); otherwise this rule folds it.

Rewrite: ``fused_dense_block(x, s_0, t_0, W1_0, b1_0, W2_0, b2_0, …)`` with ``num_layers``,
``growth`` (k) and ``bottleneck`` (B): the pre-activation BatchNorm as the exact per-channel
scale and shift (float64 → float32, shape (C, 1, 1))::

    s = γ / √(σ² + ε)   (γ := 1 when fix_gamma),   t = β − μ · s

the 1×1 convolution's BatchNorm folded into its weight and bias, absent biases as zeros; the
BatchNorm → relu reading the block's output (DenseNet's transition, or its last BatchNorm) as two
more inputs and ``post_act``, applied in the op's buffer before the output's reorder.  The op
keeps the concatenation as one NHWC buffer (oneDNN 3.x convolutions, NCHW reorders only at the
block's input and output), where MXNet's default bind reorders every piece out of its blocked
layout for each Concat and BatchNorm.  Measured (batch 1, 224², 2 threads, interleaved in one
process, on a shared 2-core machine; ``benchmarks/bench_cnn_blocks.py``): DenseNet-121's blocks
alone 1.3–2.9× of MXNet's default bind; the whole network 1.02–1.12× (427 → 20 ops), where the
default rules without this one give 0.89–1.05×; with the transitions' BatchNorm → relu taken in
(``post_act``) 1.10–1.13× (427 → 16 ops); with their pooling moved before their 1×1 convolution
(``pool_before_pointwise_conv``) 1.20–1.30× (two runs of 3 rounds; ResNet-50 0.96–1.04× in the
same runs).

Decided from inferred shapes and attributes at every probe shape: x is (N, C0, H, W); layer l
reads C0 + l·k channels, its 1×1 weight is (B, C0 + l·k, 1, 1) and its 3×3 weight (k, B, 3, 3)
with k and B the same in every layer; each Concat joins axis 1 and its first input is what the
layer's BatchNorm reads.  An intermediate concatenation read outside the block ends the run of
layers there (the layers after it form their own block).  Refused: ``mode='training'`` (no
backward; BatchNorm's moving statistics), a Dropout after a layer, pre-activations of both
kinds in one run and the ``relu`` op after the 1×1 convolution (``relu`` keeps NaN,
``Activation(relu)`` through oneDNN gives 0: the op does either in the pre-activation,
``pre_act``, and oneDNN's in the convolution's post-op), a Concat along another axis,
BatchNorm over another axis or returning its mean and variance, unknown BatchNorm parameters,
convolutions that are strided, dilated, grouped, padded otherwise or not NCHW, and values other
than float32.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np

from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.ir.pattern import Const, Pattern, Var, op
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from ._block_shapes import at_filled_sizes, layout_reason, nchw_block
from ._dtypes import float32_reason
from .elementwise import batchnorm_scale_shift
from .region import taken_by_region

MAX_LAYERS = 64          # per op (DenseNet-264's longest block: 48)


def _bn(v: Pattern, tag: str) -> Pattern:
    return op.BatchNorm(v, Const("gamma" + tag), Const("beta" + tag), Const("mean" + tag), Const("var" + tag),
                        name="bn" + tag)


def _relu(v: Pattern, name: str) -> Pattern:
    return op.Activation(v, act_type="relu", name=name) | op.relu(v, name=name)


def _scale_shift(v: Pattern, tag: str) -> Pattern:
    """BatchNorm, or the per-channel scale and shift un-fusing writes."""
    return _bn(v, tag) | op.broadcast_add(op.broadcast_mul(v, Const("s" + tag), name="scale" + tag), Const("t" + tag),
                                          name="shift" + tag)


def _layer(d: int) -> Pattern:
    """Layer d of the run, counted from the anchor (the last layer) inwards."""
    first: Pattern = Var("x")
    if d + 1 < MAX_LAYERS:
        first = _layer(d + 1) | first
    a = _relu(_scale_shift(Var("in%d" % d), "%d" % d), "act%d" % d)
    c1 = op.Convolution(a, Const("w1_%d" % d), Const("b1_%d" % d, optional=True), name="conv1_%d" % d)
    h = _relu(_bn(c1, "2_%d" % d) | c1, "act2_%d" % d)
    c2 = op.Convolution(h, Const("w2_%d" % d), Const("b2_%d" % d, optional=True), name="conv2_%d" % d)
    new = op.Dropout(c2, name="drop%d" % d) | c2
    return op.Concat(first, new, name="cat%d" % d)


def layers(m: Match) -> int:
    d = 0
    while m.has("cat%d" % d):
        d += 1
    return d


def _tuple(v, n: int, default: int) -> tuple:
    t = tuple(int(i) for i in (v or ()))
    return t if t else (default,) * n


def _batchnorm_reason(n, ctx) -> Optional[str]:
    """Why BatchNorm ``n`` is no exact per-channel scale and shift of axis 1 (None when it is)."""
    if int(n.param("axis")) % 4 != 1:
        return "BatchNorm '%s' normalizes axis %d, not the channel axis 1" % (n.name, n.param("axis"))
    if n.param("output_mean_var"):
        return "BatchNorm '%s' also returns its mean and variance" % n.name
    if batchnorm_scale_shift(n, ctx) is None:
        return ("BatchNorm '%s' is not a known scale and shift (its parameters are not all given, or a "
                "variance + eps is not positive)" % n.name)
    return None


class DenseBlock(Rule):
    name = "dense_block"
    benefit = 15            # after bn_folding (the 1×1 convolutions' BatchNorms), before elementwise
    key = "cat0"
    inference_only = True
    training_reason = ("fused_dense_block has no backward, and BatchNorm as a scale and shift uses the moving "
                       "statistics, which training updates; refused in mode='training'")
    description = ("DenseNet's dense block: L × [Concat(x, BN → relu → 1×1 conv [→ BN] → relu → 3×3 conv)] → "
                   "fused_dense_block (oneDNN 3.x, one concatenation buffer)")

    def pattern(self) -> Pattern:
        block = _layer(0)
        return _relu(_scale_shift(block, "post"), "actpost") | block

    def check(self, m: Match) -> Optional[str]:
        taken = taken_by_region(m)
        if taken:
            return taken
        L = layers(m)
        ins = [m["x"]] + [m[k] for k in m.bindings if k[:2] in ("w1", "b1", "w2", "b2")]
        reason = float32_reason(ins, m.ctx)
        if reason:
            return reason
        reason, xs, shapes, assumed = nchw_block(m)
        if reason:
            return reason
        C = int(xs[0][1])
        if m.has("actpost"):
            reason = self._post_reason(m, C + sum(m.shape("w2_%d" % d)[0] if m.shape("w2_%d" % d)
                                                   else 0 for d in range(L)))
            if reason:
                return reason
        kinds = {m.node("act%d" % d).op for d in range(L)}
        if len(kinds) > 1:
            return "the layers' pre-activations differ (Activation(relu) gives 0 for NaN, the relu op keeps it)"
        for d in range(L):
            if m.node("act2_%d" % d).op != "Activation":
                return ("relu '%s' after the 1×1 convolution keeps NaN; the op's relu (oneDNN's, as Activation(relu)) "
                        "gives 0" % m.node("act2_%d" % d).name)
        k = B = None
        for d in range(L - 1, -1, -1):          # innermost layer first
            reason = self._layer_reason(m, d, C)
            if reason:
                return reason
            w1, w2 = m.shape("w1_%d" % d), m.shape("w2_%d" % d)
            if k is None:
                B, k = w1[0], w2[0]
            if w1 != (B, C, 1, 1):
                return "Convolution '%s' has weight %s, not (%d, %d, 1, 1)" % (m.node("conv1_%d" % d).name, w1, B, C)
            if w2 != (k, B, 3, 3):
                return "Convolution '%s' has weight %s, not (%d, %d, 3, 3)" % (m.node("conv2_%d" % d).name, w2, k, B)
            cat = m.node("cat%d" % d)
            for s in shapes(Entry(cat)):
                if len(s) != 4 or int(s[1]) != C + k:
                    return at_filled_sizes("Concat '%s' has shape %s, not (N, %d, H, W)" % (cat.name, tuple(s), C + k),
                                           assumed)
            C += k
        return None

    @staticmethod
    def _post_reason(m: Match, C: int) -> Optional[str]:
        """The block's output scale-shift-relu (the next layer's pre-activation: DenseNet's transition)."""
        if m.has("bnpost"):
            reason = _batchnorm_reason(m.node("bnpost"), m.ctx)
            if reason:
                return reason
        else:
            for v in ("spost", "tpost"):
                if m.shape(v) != (C, 1, 1):
                    return "the output's %s '%s' has shape %s, not (%d, 1, 1)" % (
                        "scale" if v[0] == "s" else "shift", m[v].node.name, m.shape(v), C)
        return None

    @staticmethod
    def _layer_reason(m: Match, d: int, C: int) -> Optional[str]:
        cat = m.node("cat%d" % d)
        if int(cat.param("dim", 1)) % 4 != 1:
            return "Concat '%s' joins axis %d, not the channel axis 1" % (cat.name, cat.param("dim", 1))
        fed = Entry(m.node("cat%d" % (d + 1))) if m.has("cat%d" % (d + 1)) else m["x"]
        pre = m.node("bn%d" % d) if m.has("bn%d" % d) else m.node("scale%d" % d)
        if m["in%d" % d] != fed:
            return "%s '%s' reads '%s', not the input '%s' of Concat '%s'" % (
                pre.op, pre.name, m["in%d" % d].node.name, fed.node.name, cat.name)
        for v in ("s%d" % d, "t%d" % d):
            if m.has(v) and m.shape(v) != (C, 1, 1):
                return "the pre-activation's %s '%s' has shape %s, not (%d, 1, 1)" % (
                    "scale" if v[0] == "s" else "shift", m[v].node.name, m.shape(v), C)
        if m.has("drop%d" % d):
            return "Dropout '%s' follows the layer's 3×3 convolution" % m.node("drop%d" % d).name
        for tag in ("%d" % d, "2_%d" % d):
            if not m.has("bn" + tag):
                continue
            reason = _batchnorm_reason(m.node("bn" + tag), m.ctx)
            if reason:
                return reason
        if m.has("bn2_%d" % d) and (m.value("w1_%d" % d) is None
                                    or (m.has("b1_%d" % d) and m.value("b1_%d" % d) is None)):
            return ("folding BatchNorm '%s' needs the 1×1 convolution's weight and bias values"
                    % m.node("bn2_%d" % d).name)
        for tag, K in (("conv1_%d" % d, 1), ("conv2_%d" % d, 3)):
            conv = m.node(tag)
            reason = layout_reason(conv)
            if reason:
                return reason
            if tuple(conv.param("kernel")) != (K, K):
                return "Convolution '%s' has kernel %s, not (%d, %d)" % (conv.name, tuple(conv.param("kernel")), K, K)
            if _tuple(conv.param("stride"), 2, 1) != (1, 1):
                return "Convolution '%s' is strided (stride=%s)" % (conv.name, tuple(conv.param("stride")))
            if _tuple(conv.param("dilate"), 2, 1) != (1, 1):
                return "Convolution '%s' is dilated (dilate=%s)" % (conv.name, tuple(conv.param("dilate")))
            if _tuple(conv.param("pad"), 2, 0) != ((K - 1) // 2,) * 2:
                return "Convolution '%s' pads %s, not %d" % (conv.name, tuple(conv.param("pad")), (K - 1) // 2)
            if int(conv.param("num_group")) != 1:
                return "Convolution '%s' is grouped (num_group=%d)" % (conv.name, conv.param("num_group"))
            w = tag.replace("conv", "w")
            if m.value(w) is None and m.shape(w) is None:
                return "the weight of Convolution '%s' is unknown" % conv.name
        if m.shape("w1_%d" % d) is None or m.shape("w2_%d" % d) is None:
            return "the weight shapes of layer '%s' are unknown" % cat.name
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        L = layers(m)
        inputs: List[Entry] = [m["x"]]
        k = B = 0
        for d in range(L - 1, -1, -1):
            if m.has("bn%d" % d):
                bn = m.node("bn%d" % d)
                scale, shift, _, _ = batchnorm_scale_shift(bn, m.ctx)
                inputs.append(b.param(bn.name + "_scale", scale.reshape(-1, 1, 1).astype(np.float32)))
                inputs.append(b.param(bn.name + "_shift", shift.reshape(-1, 1, 1).astype(np.float32)))
            else:
                inputs += [m["s%d" % d], m["t%d" % d]]
            conv1, conv2 = m.node("conv1_%d" % d), m.node("conv2_%d" % d)
            B, k = m.shape("w1_%d" % d)[0], m.shape("w2_%d" % d)[0]
            if m.has("bn2_%d" % d):
                s2, t2, _, _ = batchnorm_scale_shift(m.node("bn2_%d" % d), m.ctx)
                w1 = m.value("w1_%d" % d).astype(np.float64) * s2.reshape(-1, 1, 1, 1)
                b1 = (m.value("b1_%d" % d).astype(np.float64) if m.has("b1_%d" % d) else 0.0) * s2 + t2
                inputs.append(b.param(conv1.name + "_folded_weight", w1.astype(np.float32)))
                inputs.append(b.param(conv1.name + "_folded_bias", np.asarray(b1, dtype=np.float32)))
            else:
                inputs.append(m["w1_%d" % d])
                inputs.append(m["b1_%d" % d] if m.has("b1_%d" % d)
                              else b.param(conv1.name + "_bias", np.zeros(B, dtype=np.float32)))
            inputs.append(m["w2_%d" % d])
            inputs.append(m["b2_%d" % d] if m.has("b2_%d" % d)
                          else b.param(conv2.name + "_bias", np.zeros(k, dtype=np.float32)))
        attrs: Dict[str, object] = {"num_layers": L, "growth": int(k), "bottleneck": int(B),
                                    "pre_act": "act_relu" if m.node("act0").op == "Activation" else "relu"}
        if m.has("actpost"):
            if m.has("bnpost"):
                bn = m.node("bnpost")
                scale, shift, _, _ = batchnorm_scale_shift(bn, m.ctx)
                inputs.append(b.param(bn.name + "_scale", scale.reshape(-1, 1, 1).astype(np.float32)))
                inputs.append(b.param(bn.name + "_shift", shift.reshape(-1, 1, 1).astype(np.float32)))
            else:
                inputs += [m["spost"], m["tpost"]]
            attrs["post_act"] = "act_relu" if m.node("actpost").op == "Activation" else "relu"
        return b.op("fused_dense_block", inputs, attrs=attrs, name=m.anchor.name)





class PoolBeforePointwiseConv(Rule):
    r"""``Pooling(avg)(Convolution 1×1(x))`` → ``Convolution 1×1(Pooling(avg)(x))``: DenseNet's transition
    (1×1 convolution, then 2×2 average pooling) with a quarter of the convolution's work.

    A 1×1 convolution is the same affine map at every pixel, so averaging its outputs over a window
    is applying it to the window's average: ``avg_q(W x_q + b) = W avg_q(x_q) + b`` — exact in real
    arithmetic (the float sums run in another order).  Decided from the attributes: the
    convolution is 1×1 with stride 1, no padding or dilation; the pooling averages
    (``pool_type='avg'``), is not global, pads nothing and uses the ``valid`` convention (a padded
    window would average the bias with zeros).  Refused otherwise, with the reason.
    """

    name = "pool_before_pointwise_conv"
    benefit = 19        # after bn_folding (20-40); before region (18), which then takes the cheaper form
    key = "pool"
    description = "Pooling(avg) of a 1×1 Convolution → the Convolution of the Pooling (fewer pixels to convolve)"

    def pattern(self) -> Pattern:
        return op.Pooling(op.Convolution(Var("x"), Const("w"), Const("b", optional=True), name="conv"), name="pool")

    def check(self, m: Match) -> Optional[str]:
        conv, pool = m.node("conv"), m.node("pool")
        k = tuple(conv.param("kernel"))
        if any(v != 1 for v in k):
            return "Convolution '%s' has kernel %s, not 1×1" % (conv.name, k)
        if any(v != 1 for v in _tuple(conv.param("stride"), len(k), 1)):
            return "Convolution '%s' is strided" % conv.name
        if any(v != 0 for v in _tuple(conv.param("pad"), len(k), 0)):
            return "Convolution '%s' pads" % conv.name
        if any(v != 1 for v in _tuple(conv.param("dilate"), len(k), 1)):
            return "Convolution '%s' is dilated" % conv.name
        if conv.param("layout") not in (None, "NCHW", "NCW", "NCDHW"):
            return "Convolution '%s' has layout %s" % (conv.name, conv.param("layout"))
        if pool.param("pool_type", "max") != "avg":
            return "Pooling '%s' is %s pooling, not avg" % (pool.name, pool.param("pool_type", "max"))
        if str(pool.param("global_pool", False)).lower() in ("true", "1"):
            return "Pooling '%s' is global (left to the rules that read it)" % pool.name
        if any(v != 0 for v in _tuple(pool.param("pad", ()), len(k), 0)):
            return "Pooling '%s' pads (a padded window averages the bias with zeros)" % pool.name
        if pool.param("pooling_convention", "valid") not in (None, "valid"):
            return "Pooling '%s' uses the %s convention, not valid" % (
                pool.name, pool.param("pooling_convention", "valid"))
        if pool.param("layout", None) not in (None, "NCHW", "NCW", "NCDHW"):
            return "Pooling '%s' has layout %s" % (pool.name, pool.param("layout", None))
        if len(tuple(pool.param("kernel"))) != len(k):
            return "Pooling '%s' pools %d axes, Convolution '%s' convolves %d" % (
                pool.name, len(tuple(pool.param("kernel"))), conv.name, len(k))
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        conv, pool = m.node("conv"), m.node("pool")
        p = b.op("Pooling", [m["x"]], attrs=pool.attrs, name=pool.name + "_first")
        return b.op("Convolution", [p, m["w"]] + ([m["b"]] if m.has("b") else []), attrs=conv.attrs,
                    name=pool.name)


RULES: List[Rule] = [DenseBlock(), PoolBeforePointwiseConv()]
