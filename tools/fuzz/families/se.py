"""squeeze_excitation: pool → layer → act → layer → gate → [reshape] → scale [→ residual add [→ relu]].

Grammar::

    graph   := x (B, C, H, W) → [hard-swish (3, 0, 6, 6) | a clip form of other constants] → SE [→ head]
    SE      := pool → layer → act → layer → gate → [expand_dims ×2 | Reshape(0, 0, 1, 1)] → product
               [→ add(·, residual) [→ Activation(relu) | relu]]
    product := broadcast_mul(x, g) | broadcast_mul(g, x)
             | m(x, broadcast_like(g, x[, lhs_axes=rhs_axes=(2, 3) | (-1, -2)])) | m(broadcast_like(…), x)
                   m: elemwise_mul | * | broadcast_mul        (GluonCV's pose networks: g repeated over the plane)
               (one decision, PRODUCTS: a seed's other decisions stay what they were before it came)
    pool    := AdaptiveAvgPooling2D(1) | Pooling(global avg) | mean(axis=(2, 3), keepdims)
             | Pooling(fixed avg window)                                               (refused)
    layer   := Convolution 1×1 [no_bias] | FullyConnected [no_bias]  (a dense layer needs the reshape)
             | Convolution 1×1 with num_group 2                                       (refused)
    act     := Activation(relu|sigmoid|tanh|softrelu) | relu
    gate    := Activation(sigmoid) | sigmoid | hard_sigmoid(α, β) | clip(· + a, lo, hi) / d
    residual:= a data input of x's shape | x itself
    head    := sometimes the gate is also an output (an interior value escapes: refused)
"""
from __future__ import annotations

from .pieces import S, without_regions_sometimes


def global_avg_pool(b, x, weights, mean_axes):
    """An (N, C, 1, 1) average of ``x`` over H and W, written one of the ways networks write it
    (drawn with ``weights`` over adaptive pooling, global pooling, mean over ``mean_axes`` (one drawn
    when several), a pooling window the size of the map)."""
    d = b.d
    pool = d.choice(["adaptive", "global", "mean", "window"], weights, label="pool")
    if pool == "adaptive":
        return S.contrib.AdaptiveAvgPooling2D(x, output_size=1)
    if pool == "global":
        return S.Pooling(x, global_pool=True, pool_type="avg", kernel=(1, 1))
    if pool == "mean":
        axes = d.choice(mean_axes, label="mean axes") if len(mean_axes) > 1 else mean_axes[0]
        return S.mean(x, axis=axes, keepdims=True)
    b.fixed("H"), b.fixed("W")
    return S.Pooling(x, pool_type="avg", kernel=(b.dims["H"], b.dims["W"]))


def build(b):
    d = b.d
    b.dim("B", [1, 2])
    C = d.choice([4, 6, 8], label="channels")
    b.dim("H", [3, 5, 4, 1])
    b.dim("W", [4, 6, 5])
    tmpl = ("B", C, "H", "W")
    z = b.input("data", tmpl)
    hs = d.choice(["none", "hard_swish", "other"], [4, 4, 1], label="input act")
    if hs == "hard_swish":
        x = z * (S.clip(z + 3., 0, 6) / 6.)
    elif hs == "other":
        x = z * (S.clip(z + 2., 0, 6) / 6.)
    else:
        x = z
    p = global_avg_pool(b, x, [4, 4, 3, 1], [(2, 3), (-2, -1), (3, 2)])
    dense = d.maybe(0.35, label="dense layers")
    cm = d.choice([2, 3, 4], label="hidden")

    def layer(v, units, k):
        kind = "dense" if dense else d.choice(["conv", "grouped"], [9, 1], label="layer %d kind" % k)
        if kind == "grouped" and (units % 2 or v_channels[0] % 2):
            kind = "conv"
        no_bias = d.maybe(0.3, label="layer %d no_bias" % k)
        name = b.name("se_fc")
        w_shape = (units, v_channels[0]) if kind == "dense" else (
            units, v_channels[0] // (2 if kind == "grouped" else 1), 1, 1)
        w = b.param(name + "_weight", w_shape, kind="weight")
        bias = None if no_bias else b.param(name + "_bias", (units,), kind="normal")
        ins = [v, w] + ([bias] if bias is not None else [])
        v_channels[0] = units
        if kind == "dense":
            return S.FullyConnected(*ins, num_hidden=units, no_bias=no_bias, name=name)
        return S.Convolution(*ins, kernel=(1, 1), num_filter=units, no_bias=no_bias,
                             num_group=2 if kind == "grouped" else 1, name=name)

    v_channels = [C]
    h = layer(p, cm, 1)
    act = d.choice(["relu", "sigmoid", "tanh", "softrelu", "op"], [4, 1, 1, 1, 2], label="hidden act")
    h = S.relu(h) if act == "op" else S.Activation(h, act_type=act)
    g = layer(h, C, 2)
    gate = d.choice(["Activation", "sigmoid", "hard_sigmoid", "clip"], label="gate")
    if gate == "Activation":
        g = S.Activation(g, act_type="sigmoid")
    elif gate == "sigmoid":
        g = S.sigmoid(g)
    elif gate == "hard_sigmoid":
        g = S.hard_sigmoid(g, alpha=d.choice([0.2, 1 / 6.], label="alpha"), beta=0.5)
    else:
        g = S.clip(g + d.choice([3., 1.], label="gate add"), 0, 6) / 6.
    if dense:
        g = (g.expand_dims(axis=2).expand_dims(axis=2) if d.maybe(0.5, label="expand")
             else S.Reshape(g, shape=(0, 0, 1, 1)))
    y = product(b, x, g)
    if d.maybe(0.5, label="residual"):
        r = z if d.maybe(0.2, label="residual is input") else b.input("res", tmpl)
        y = y + r
        tail = d.choice(["none", "Activation", "op"], label="tail")
        if tail == "Activation":
            y = S.Activation(y, act_type="relu")
        elif tail == "op":
            y = S.relu(y)
    outs = [y, g] if d.maybe(0.08, label="gate escapes") else [y]
    without_regions_sometimes(b)
    return outs


# (gate spelling, product op, operands swapped, weight).  One decision, drawn where the product's
# operand order alone was drawn (maybe(0.3)), with its weights split the same way (0.7 in order, 0.3
# swapped): every later decision, the generator's too, stays what it was for a seed.  No refused
# spelling here: the SE rules fire too rarely at CI size to give graphs away (tests/test_cnn_blocks.py
# holds the refusals of broadcast_like's other shapes).
PRODUCTS = [
    ("as is", "broadcast_mul", False, 0.35),
    ("like", "elemwise_mul", False, 0.13),
    ("like", "operator", False, 0.07),
    ("like", "broadcast_mul", False, 0.04),
    ("like (2, 3)", "elemwise_mul", False, 0.06),
    ("like (-1, -2)", "operator", False, 0.05),
    ("as is", "broadcast_mul", True, 0.15),
    ("like", "operator", True, 0.06),                 # GluonCV's fast_pose: gate.broadcast_like(x) * x
    ("like", "elemwise_mul", True, 0.03),
    ("like (2, 3)", "broadcast_mul", True, 0.03),
    ("like (-1, -2)", "elemwise_mul", True, 0.03),
]


def product(b, x, g):
    """x · g, the gate as it is or broadcast_like'd to x first (see the grammar), either order."""
    gate, op, swap, _ = b.d.choice(PRODUCTS, [w for *_, w in PRODUCTS], label="product")
    if gate.startswith("like ("):
        axes = (2, 3) if gate == "like (2, 3)" else (-1, -2)
        g = S.broadcast_like(g, x, lhs_axes=axes, rhs_axes=axes)
    elif gate == "like":
        g = S.broadcast_like(g, x)
    mul = {"broadcast_mul": S.broadcast_mul, "elemwise_mul": S.elemwise_mul, "operator": lambda a, c: a * c}[op]
    return mul(g, x) if swap else mul(x, g)
