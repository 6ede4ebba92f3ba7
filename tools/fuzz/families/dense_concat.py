"""concat_flatten / concat_bn_act: DenseNet blocks, Concat → BatchNorm [→ relu].

Grammar::

    graph  := x (B, C, H, W) → layer × 1–4 → [BatchNorm [→ relu]] [→ a concatenation also returned]
    layer  := c ← Concat(c, conv(act(BN(c)))) (dim 1)          DenseNet's concat(x, layer(x))
            | c ← Concat(conv(…), c)                             the inner one second (not flattened)
    BN     := axis 1 | axis 2 (refused), fix_gamma either way
    act    := Activation(relu) | relu | none
    now and then a Concat along axis 2 (refused) or an inner concatenation read by another op too
"""
from __future__ import annotations

from .conv import batchnorm
from .pieces import S


def build(b):
    d = b.d
    b.dim("B", [1, 2])
    c = d.choice([2, 3], label="channels")
    b.dim("H", [3, 4, 5])
    x = b.input("data", ("B", c, "H", "H"))
    shape = [b.dims["B"], c, b.dims["H"], b.dims["H"]]
    cur, outs = x, []
    for k in range(d.int(1, 4, label="layers")):
        h, _ = batchnorm(b, cur, tuple(shape), 1, label="bn%d" % k, tmpl=("B", shape[1], "H", "H"))
        act = d.choice(["Activation", "op", "none"], [3, 2, 1], label="act%d" % k)
        h = S.Activation(h, act_type="relu") if act == "Activation" else (S.relu(h) if act == "op" else h)
        g = d.choice([1, 2], label="growth%d" % k)
        w = b.param(b.name("conv_weight"), (g, shape[1], 3, 3), kind="weight")
        new = S.Convolution(h, w, kernel=(3, 3), pad=(1, 1), num_filter=g, no_bias=True, name=b.name("conv"))
        if d.maybe(0.15, label="inner second%d" % k):
            cur = S.Concat(new, cur, dim=1)
        else:
            cur = S.Concat(cur, new, dim=1)
        shape[1] += g
        if d.maybe(0.1, label="escape%d" % k):
            outs.append(S.tanh(cur))
    if d.maybe(0.1, label="axis 2 concat"):
        cur = S.Concat(cur, cur, dim=2)
        shape[2] *= 2
        y, _ = batchnorm(b, cur, tuple(shape), 1, label="bn_last", tmpl=("B", shape[1], "H*2", "H"))
    else:
        y, _ = batchnorm(b, cur, tuple(shape), 1, label="bn_last", tmpl=("B", shape[1], "H", "H"))
    if d.maybe(0.7, label="last relu"):
        y = S.Activation(y, act_type="relu")
    return [y] + outs
