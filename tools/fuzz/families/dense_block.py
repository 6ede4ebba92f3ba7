"""dense_block: DenseNet's dense block — layers of Concat(c, 3×3(relu(1×1(relu(BN(c)))))) along the channels.

Grammar::

    graph   := x (B, C, H, W) → layer × 1–4 [→ BN → act (the next pre-activation) [→ transition]]
               [→ an intermediate concatenation also returned]
    transition := 1×1 Convolution [bias] → Pooling(avg, 2×2 stride 2)
               | … Pooling(max) | Pooling(avg, pad 1) | Pooling(avg, full convention)    (refused)
    layer   := c ← Concat(c, new, dim 1)              (dim 2 now and then: refused)
    new     := BN(c) → act → 1×1 (no bias) → BN → act → 3×3 pad 1 [→ Dropout]
    BN      := BatchNorm over the channels, fix_gamma either way (conv's family draws the other spellings)
    act     := Activation(relu) | relu
    widths  := growth and bottleneck the same in every layer, multiples of 16 (the op's blocked
               layout) or not (its NHWC one); now and then a layer with another growth (a shorter run)
"""
from __future__ import annotations

from .conv import batchnorm
from .pieces import S, without_regions_sometimes


def build(b):
    d = b.d
    b.dim("B", [1, 2])
    C = d.choice([4, 16], label="channels")
    b.dim("H", [3, 4, 5])
    b.dim("W", [3, 6])
    x = b.input("data", ("B", C, "H", "W"))
    k = d.choice([2, 16], label="growth")
    B = d.choice([4, 16], label="bottleneck")
    shape = [b.dims["B"], C, b.dims["H"], b.dims["W"]]
    cur, outs = x, []

    def act(v, label):
        return S.Activation(v, act_type="relu") if d.maybe(0.7, label=label) else S.relu(v)

    for l in range(d.int(1, 4, label="layers")):
        g = k if d.maybe(0.9, label="same growth%d" % l) else k + 2
        h, _ = batchnorm(b, cur, tuple(shape), 1, label="bn%d" % l, tmpl=("B", shape[1], "H", "W"))
        h = act(h, "act%d" % l)
        n1 = b.name("conv1_")
        h = S.Convolution(h, b.param(n1 + "_weight", (B, shape[1], 1, 1), kind="weight"), kernel=(1, 1),
                          num_filter=B, no_bias=True, name=n1)
        h, _ = batchnorm(b, h, (shape[0], B, shape[2], shape[3]), 1, label="bn2_%d" % l, tmpl=("B", B, "H", "W"))
        h = act(h, "act2_%d" % l)
        n2 = b.name("conv2_")
        new = S.Convolution(h, b.param(n2 + "_weight", (g, B, 3, 3), kind="weight"), kernel=(3, 3), pad=(1, 1),
                            num_filter=g, no_bias=True, name=n2)
        if d.maybe(0.05, label="dropout%d" % l):
            new = S.Dropout(new, p=0.3)
        if d.maybe(0.04, label="axis 2 concat%d" % l) and g == shape[1]:
            cur = S.Concat(cur, new, dim=2)
            without_regions_sometimes(b)
            return [cur] + outs
        cur = S.Concat(cur, new, dim=1)
        shape[1] += g
        if d.maybe(0.08, label="escape%d" % l):
            outs.append(S.tanh(cur))
    if d.maybe(0.4, label="post"):
        y, _ = batchnorm(b, cur, tuple(shape), 1, label="bn_post", tmpl=("B", shape[1], "H", "W"))
        cur = act(y, "act_post")
        if d.maybe(0.6, label="transition"):
            b.fixed("H"), b.fixed("W")
            nt = b.name("transition")
            bias = d.maybe(0.3, label="transition bias")
            ins = [cur, b.param(nt + "_weight", (8, shape[1], 1, 1), kind="weight")] + (
                [b.param(nt + "_bias", (8,))] if bias else [])
            cur = S.Convolution(*ins, kernel=(1, 1), num_filter=8, no_bias=not bias, name=nt)
            form = d.choice(["avg", "max", "pad", "full"], [8, 1, 1, 1], label="transition pooling")
            cur = S.Pooling(cur, kernel=(2, 2), stride=(2, 2), pool_type="max" if form == "max" else "avg",
                            pad=(1, 1) if form == "pad" else (0, 0),
                            pooling_convention="full" if form == "full" else "valid")
    without_regions_sometimes(b)
    return [cur] + outs
