"""constant_fold / dropout: computations on parameters alone, Dropout at inference.

Grammar::

    graph   := consumer(data, W')
    W'      := chain of 1–4 ops over parameters: Reshape | transpose | SwapAxis | expand_dims → squeeze |
               Concat / stack of several parameters | slice_axis | Flatten | Cast(float64 → float32) |
               broadcast_to | tile | arithmetic with another parameter or a scalar | Dropout (identity at
               inference) | near: a random op on a parameter (uniform_like: never folded)
               | GluonNLP's interleaved QKV weight: Concat(Reshape(Wq), Reshape(Wk), Reshape(Wv)) → Reshape
    consumer := FullyConnected(x, W') [→ act] | broadcast_add(x, W') | LayerNorm(x, W'γ, β)
              | the GluonNLP self-attention with the interleaved weight
    also:    the raw parameter used a second time (not folded away), Dropout on data (removed at inference,
             kept with mode='always')
"""
from __future__ import annotations

import numpy as np

from .attention import _probabilities, Geo
from .pieces import S, maybe_activation


def _chain(b, shape, label: str):
    """A parameter-only computation producing ``shape`` (a 2-D (n, f) or 1-D (n,) target)."""
    d = b.d
    n = int(np.prod(shape))
    how = d.choice(["reshape", "transpose", "concat", "stack", "slice", "arith", "cast", "expand_squeeze",
                    "dropout", "broadcast_to", "tile", "flatten", "random"], [4, 3, 3, 1, 2, 3, 1, 1, 1, 1, 1, 1, 1],
                   label=label)
    if how == "reshape":
        return S.reshape(b.param("w", (n,), kind="normal"), shape=shape)
    if how == "transpose" and len(shape) == 2:
        p = b.param("w", (shape[1], shape[0]), kind="normal")
        return S.transpose(p) if d.maybe(0.6, label=label + " transpose op") else S.swapaxes(p, dim1=0, dim2=1)
    if how == "concat" and shape[0] > 1:
        k = d.int(1, shape[0] - 1, label=label + " split at")
        a = b.param("w", (k,) + tuple(shape[1:]), kind="normal")
        c = b.param("w", (shape[0] - k,) + tuple(shape[1:]), kind="normal")
        return S.Concat(a, c, dim=0) if d.maybe(0.5, label=label + " Concat") else S.concat(a, c, dim=0)
    if how == "stack":
        parts = [b.param("w", tuple(shape[1:]) or (1,), kind="normal") for _ in range(shape[0])]
        y = S.stack(*parts, axis=0)
        return y if len(shape) > 1 else S.reshape(y, shape=shape)
    if how == "slice":
        big = b.param("w", (shape[0] + 2,) + tuple(shape[1:]), kind="normal")
        return S.slice_axis(big, axis=0, begin=1, end=shape[0] + 1)
    if how == "arith":
        p = b.param("w", shape, kind="normal")
        op = d.choice(["mul_scalar", "add_param", "sqrt_pos", "neg", "rdiv"], label=label + " arith")
        if op == "mul_scalar":
            return p * 0.5
        if op == "add_param":
            return S.broadcast_add(p, b.param("w", shape[-1:], kind="normal"))
        if op == "sqrt_pos":
            return S.sqrt(S.square(p) + 0.1)
        if op == "neg":
            return S.negative(p)
        return 1.0 / (S.abs(p) + 1.0)
    if how == "cast":
        return S.Cast(b.param("w", shape, kind="normal", dtype="float64"), dtype="float32")
    if how == "expand_squeeze":
        return S.squeeze(S.expand_dims(b.param("w", shape, kind="normal"), axis=0), axis=0)
    if how == "dropout":
        return S.Dropout(b.param("w", shape, kind="normal"), p=0.5)
    if how == "broadcast_to":
        return S.broadcast_to(b.param("w", (1,) + tuple(shape[1:]), kind="normal"), shape=shape)
    if how == "tile" and shape[0] % 2 == 0:
        return S.tile(b.param("w", (shape[0] // 2,) + tuple(shape[1:]), kind="normal"), reps=(2,) + (1,) * (len(shape) - 1))
    if how == "flatten" and len(shape) == 2:
        return S.Flatten(b.param("w", (shape[0], shape[1], 1), kind="normal"))
    if how == "random":
        b.flag("random")
        return S.random.uniform_like(b.param("w", shape, kind="normal"))
    return b.param("w", shape, kind="normal")


def _deep(b, shape, label: str):
    y = _chain(b, shape, label)
    for i in range(b.d.int(0, 2, label=label + " more")):
        how = b.d.choice(["scale", "reshape_twice", "transpose_twice"], label=label + " more %d" % i)
        if how == "scale":
            y = y * 2.0
        elif how == "reshape_twice":
            y = S.reshape(S.reshape(y, shape=(-1,)), shape=shape)
        elif len(shape) == 2:
            y = S.transpose(S.transpose(y))
    return y


def gluonnlp_selfatt(b):
    d = b.d
    b.dim("B", [2, 1, 3])
    b.dim("Sq", [4, 1, 3, 5])
    h = d.choice([2, 1, 3], label="heads")
    dh = d.choice([2, 4, 3], label="head dim")
    f = d.choice([6, 4], label="width")
    e = h * dh
    ws = [b.param(n, (e, f), kind="weight") for n in ("wq", "wk", "wv")]
    w = S.reshape(S.concat(*[S.reshape(t, shape=(h, 1, dh, f)) for t in ws], dim=1), shape=(-1, f))
    x = b.input("x", ("Sq", "B", f))
    qkv = S.FullyConnected(x, w, num_hidden=3 * e, no_bias=True, flatten=False, name=b.name("qkv"))
    s = S.contrib.interleaved_matmul_selfatt_qk(qkv, heads=h)
    p = _probabilities(b, s, None, None, Geo(("B*%d" % h,), "Sq", "Sq", dh, dh))
    return [S.contrib.interleaved_matmul_selfatt_valatt(qkv, p, heads=h)]


def build(b):
    d = b.d
    form = d.choice(["fc", "add", "layernorm", "gluonnlp", "dropout_data", "shared"], [5, 2, 1, 2, 2, 1], label="form")
    if form == "gluonnlp":
        return gluonnlp_selfatt(b)
    b.dim("B", [8, 2, 3, 1])
    f = d.choice([4, 3, 6], label="features")
    n = d.choice([4, 5, 2, 8], label="hidden")
    x = b.input("x", ("B", f))
    if form == "fc":
        w = _deep(b, (n, f), "weight")
        bias = _deep(b, (n,), "bias") if d.maybe(0.5, label="computed bias") else b.param("bias", (n,))
        y = S.FullyConnected(x, w, bias, num_hidden=n, name=b.name("fc"))
        return [maybe_activation(b, y, channels=n)]
    if form == "add":
        return [S.relu(S.broadcast_add(x, _deep(b, (f,), "addend")))]
    if form == "layernorm":
        g = _deep(b, (f,), "gamma")
        return [S.LayerNorm(x, g, b.param("beta", (f,)))]
    if form == "shared":       # a parameter both folded (through a chain) and used as it is
        p = b.param("w", (n, f), kind="weight")
        y1 = S.FullyConnected(x, S.transpose(S.transpose(p)), no_bias=True, num_hidden=n, name=b.name("fc"))
        y2 = S.FullyConnected(x, p, no_bias=True, num_hidden=n, name=b.name("fc"))
        return [y1 + y2]
    y = S.tanh(x)
    mode = d.choice(["training", "always"], [3, 1], label="dropout mode")
    p = d.choice([0.5, 0.0, 0.2], label="dropout p")
    y = S.Dropout(y, p=p, mode=mode)
    if p > 0:
        b.flag("random" if mode == "always" else "random_train")
    return [S.sigmoid(y) if d.maybe(0.5, label="after") else y]
