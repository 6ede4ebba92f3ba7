"""split_attention: ResNeSt's radix sum → pool → grouped layers → r-softmax → weighted sum.

Grammar::

    graph  := x (B, R·C, H, W) → [relu] → SA [→ head]
    SA     := R > 1: s = Reshape(expand_dims(x, 1), (0, R, C, 0, 0)) | Reshape(x, (0, -4, R, -1, -2)); sum(s, axis=1)
              R = 1: x
              → pool → Convolution 1×1 (num_group G) [→ BatchNorm] → act → Convolution 1×1 (num_group G)
              → Reshape(0, A, R, -1) → SwapAxis(1, 2) → softmax(axis=1) | sigmoid (R = 1)
              → Reshape(0, R, -1, 1, 1) | Reshape(0, -1, 1, 1) (R = 1)
              → sum(broadcast_mul(att, s), axis=1) | broadcast_mul(att, x) (either operand order)
    R      := 1 | 2 | 4;  G, A := 1 | 2 (GluonCV's cardinality; A may differ from G)
    pool   := AdaptiveAvgPooling2D(1) | Pooling(global avg) | mean(axis=(2, 3), keepdims)
            | Pooling(fixed avg window)                                                (refused)
    act    := Activation(relu|sigmoid|tanh|softrelu) | relu
    wrong  := softmax over axis 2 | SwapAxis(1, 3) | softmax temperature 2            (refused)
    head   := sometimes the radix view is also read by another op (an interior value escapes: refused)
"""
from __future__ import annotations

from .pieces import S
from .se import global_avg_pool


def build(b):
    d = b.d
    b.dim("B", [1, 2])
    R = d.choice([2, 1, 4], [3, 4, 2], label="radix")
    G = d.choice([1, 2], label="groups")
    A = d.choice([G, 1, 2], [4, 1, 1], label="attention groups")
    C = d.choice([4, 8], label="channels")
    b.dim("H", [3, 5, 4, 1])
    b.dim("W", [4, 6, 5])
    x = b.input("data", ("B", R * C, "H", "W"))
    if d.maybe(0.5, label="relu first"):
        x = S.relu(x)
    split = None
    if R > 1:
        split = (S.reshape(S.expand_dims(x, axis=1), shape=(0, R, C, 0, 0)) if d.maybe(0.8, label="expand")
                 else S.reshape(x, shape=(0, -4, R, -1, -2)))
        gap = S.sum(split, axis=1)
    else:
        gap = x
    p = global_avg_pool(b, gap, [4, 3, 2, 1], [(2, 3)])
    cm = d.choice([4, 8], label="hidden")

    def layer(v, cin, units, k):
        no_bias = d.maybe(0.3, label="layer %d no_bias" % k)
        name = b.name("sa_fc")
        w = b.param(name + "_weight", (units, cin // G, 1, 1), kind="weight")
        bias = None if no_bias else b.param(name + "_bias", (units,), kind="normal")
        return S.Convolution(*([v, w] + ([bias] if bias is not None else [])), kernel=(1, 1), num_filter=units,
                             num_group=G, no_bias=no_bias, name=name)

    h = layer(p, C, cm, 1)
    if d.maybe(0.5, label="batchnorm"):
        name = b.name("sa_bn")
        h = S.BatchNorm(h, b.param(name + "_gamma", (cm,), kind="gamma"), b.param(name + "_beta", (cm,)),
                        b.param(name + "_mean", (cm,)), b.param(name + "_var", (cm,), kind="var"),
                        fix_gamma=False, name=name)
    act = d.choice(["relu", "sigmoid", "tanh", "softrelu", "op"], [4, 1, 1, 1, 2], label="hidden act")
    h = S.relu(h) if act == "op" else S.Activation(h, act_type=act)
    a = layer(h, cm, R * C, 2)
    wrong = d.choice(["none", "axis", "swap", "temperature"], [12, 1, 1, 1], label="wrong")
    a = S.swapaxes(S.reshape(a, shape=(0, A, R, -1)), dim1=1, dim2=3 if wrong == "swap" else 2)
    if R > 1 or wrong in ("axis", "temperature"):
        kw = {"temperature": 2.0} if wrong == "temperature" else {}
        att = S.softmax(a, axis=2 if wrong == "axis" else 1, **kw)
    else:
        att = S.sigmoid(a)
    if R > 1:
        att = S.reshape(att, shape=(0, R, -1, 1, 1))
        prod = S.broadcast_mul(split, att) if d.maybe(0.3, label="swap operands") else S.broadcast_mul(att, split)
        y = S.sum(prod, axis=1)
    else:
        att = S.reshape(att, shape=(0, -1, 1, 1))
        y = S.broadcast_mul(x, att) if d.maybe(0.3, label="swap operands") else S.broadcast_mul(att, x)
    if split is not None and d.maybe(0.08, label="view escapes"):
        return [y, S.tanh(split)]
    return [y]
