"""layer_norm / skip_layer_norm / softmax: normalizations, built in or written out.

Grammar::

    graph   := builtin | skip | written_ln | skip_written | written_softmax | prenorm
    builtin := LayerNorm(x, γ, β, axis = -1 | rank-1 | near: another axis, eps, output_mean_var (rare))
    skip    := s = add(a, b) → LayerNorm(s)          a, b of (B,S,C)+(B,S,C) | +(C,) | +(1,1,C) | (C,)+… (first
               operand broadcast) | +(1,S,C) | near: +(B,1,C), +(B,S,1); add(x, x); the sum also used / an output
    written_ln := μ = mean(x, axis=a, keepdims=True | near: False)     a = -1 | rank-1 | (a,) | near: another axis
               d = broadcast_sub(x, μ)   (the variance may use a second, identical centering node)
               q = square(d) | d·d | d**2 | broadcast_power(d, 2) | near: d**3
               σ² = mean(q, axis=a, keepdims=True); v = σ² + ε (_plus_scalar | + 1-element parameter; ε = 0 refused)
               n = d / sqrt(v) | d · rsqrt(v) | near: d / v**0.5
               y = n [· γ] [+ β]   γ, β parameters of (C,) | (1,C) | (1,1,C) | (C,1) | data inputs
    written_softmax := e = exp(x − max(x, axis, keepdims)) | exp(x);  y = e / sum(e, axis, keepdims)
                       (near: other axes for max and sum, keepdims False, large inputs without the max)
    prenorm := x → LN → [FC] → add back to x → LN (pre-LN residual stream, the sum used twice)
"""
from __future__ import annotations

from .pieces import I, S, add, broadcasts, mul


def _x(b, rank_weights=(1, 6, 1)):
    d = b.d
    rank = d.choice([2, 3, 4], rank_weights, label="rank")
    b.dim("B", [2, 1, 3, 4])
    c = b.size([8, 4, 5, 1, 2, 3, 16], [768, 65, 1000, 33], label="channels")
    if rank == 2:
        tmpl = ("B", c)
    elif rank == 3:
        b.dim("S", [3, 1, 2, 5, 7])
        tmpl = ("B", "S", c)
    else:
        b.dim("S", [3, 2])
        tmpl = ("B", "S", 2, c)
    return tmpl, c


def _affine(b, c: int, rank: int, label: str, kind: str, tmpl=None):
    """γ (kind "gamma") or β: a parameter of (C,) | (1,C) | (1,1,C) | (C,1), or now and then a data input."""
    d = b.d
    if d.maybe(0.08, label=label + " as data"):
        return b.input(kind, (c,), kind="pos" if kind == "gamma" else "normal")
    shapes = [(c,), (1, c), (1, 1, c), (c, 1)]
    w = [6, 2, 1 if rank >= 3 else 0, 1]
    shape = d.choice(shapes, w, label=label + " shape")
    if tmpl is not None and not broadcasts(b, tmpl, shape):
        shape = (c,)
    if shape == (c, 1):
        b.pinned.update(b.dims)     # (C, 1) lines up with the other axes only at these sizes
    return b.param(kind, shape, kind="gamma" if kind == "gamma" else "normal")


def builtin_ln(b, x, tmpl, c, label="ln"):
    d = b.d
    rank = len(tmpl)
    ax = d.choice(["default", "-1", "pos", "other"], [4, 2, 2, 1], label=label + " axis")
    kw = {}
    n = c
    if ax == "-1":
        kw["axis"] = -1
    elif ax == "pos":
        kw["axis"] = rank - 1
    elif ax == "other":
        kw["axis"] = d.choice(list(range(rank - 1)), label=label + " other axis")
        n = b.shape((tmpl[kw["axis"]],), pin=True)[0]
    if d.maybe(0.5, label=label + " eps"):
        kw["eps"] = d.choice([1e-5, 1e-12, 1e-3], label=label + " eps value")
    if d.maybe(0.1, label=label + " gamma/beta as data"):
        g, be = b.input("gamma", (n,), kind="pos"), b.input("beta", (n,))
    else:
        g, be = b.param("gamma", (n,), kind="gamma"), b.param("beta", (n,))
    if d.maybe(0.04, label=label + " output_mean_var"):
        return S.LayerNorm(x, g, be, output_mean_var=True, **kw)[0]
    return S.LayerNorm(x, g, be, **kw)


def skip(b, written: bool = False):
    d = b.d
    tmpl, c = _x(b)
    rank = len(tmpl)
    a = b.input("a", tmpl)
    kind = d.choice(["same", "C", "11C", "C_first", "1SC", "B1C", "BS1", "self", "param_C"], [6, 2, 1, 1, 1, 1, 1, 1, 1],
                    label="residual shapes")
    if kind == "same":
        s = add(b, a, b.input("r", tmpl), same_shape=True, label="residual add")
    elif kind == "self":
        s = add(b, a, a, same_shape=True, label="residual add")
    elif kind == "C":
        s = S.broadcast_add(a, b.input("r", (c,)))
    elif kind == "param_C":
        s = S.broadcast_add(a, b.param("r", (c,)))
    elif kind == "11C":
        s = S.broadcast_add(a, b.input("r", (1,) * (rank - 1) + (c,)))
    elif kind == "C_first":
        s = S.broadcast_add(b.input("r", (c,)), a)
    elif kind == "1SC":
        s = S.broadcast_add(a, b.input("r", (1,) + tuple(tmpl[1:])))
    elif kind == "B1C":
        s = S.broadcast_add(a, b.input("r", ("B",) + (1,) * (rank - 2) + (c,)))
    else:
        s = S.broadcast_add(a, b.input("r", tuple(tmpl[:-1]) + (1,)))
    y = written_ln(b, s, tmpl, c) if written else builtin_ln(b, s, tmpl, c)
    outs = [y]
    if d.maybe(0.06, label="second LayerNorm of the sum"):
        outs.append(builtin_ln(b, s, tmpl, c, "ln_b"))
    if d.maybe(0.3, label="sum also used"):
        use = d.choice(["head", "consumer"], label="sum use")
        extra = s if use == "head" else S.relu(s)
        outs = [extra, y] if d.maybe(0.5, label="sum first") else [y, extra]
    return outs


def _mean(b, x, axis, keepdims: bool, label: str):
    d = b.d
    form = d.choice(["int", "tuple"], [4, 1], label=label + " axis form")
    ax = (axis,) if form == "tuple" else axis
    return S.mean(x, axis=ax, keepdims=keepdims)


def written_ln(b, x, tmpl, c, label: str = "wln"):
    d = b.d
    rank = len(tmpl)
    ax = d.choice(["-1", "pos", "other"], [6, 3, 1], label=label + " axis")
    axis = -1 if ax == "-1" else (rank - 1 if ax == "pos" else d.choice(list(range(1, rank - 1)) or [0], label=label + " other"))
    keep = not d.maybe(0.01, label=label + " keepdims false")
    mu = _mean(b, x, axis, keep, label + " mean")
    dd = S.broadcast_sub(x, mu)
    dv = dd
    if d.maybe(0.2, label=label + " second centering"):
        dv = S.broadcast_sub(x, mu if d.maybe(0.5, label=label + " same mean") else _mean(b, x, axis, keep, label + " mean2"))
    sq = d.choice(["square", "mul", "pow", "bpow", "pow3"], [4, 3, 2, 1, 1], label=label + " square")
    if sq == "square":
        q = S.square(dv)
    elif sq == "mul":
        q = mul(b, dv, dv, same_shape=True, label=label + " sq mul")
    elif sq == "pow":
        q = dv ** 2
    elif sq == "bpow":
        q = S.broadcast_power(dv, b.param("two", (1,), value=[2.0]))
    else:
        q = dv ** 3
    var = _mean(b, q, axis, True if d.maybe(0.99, label=label + " var keepdims") else False, label + " var")
    eps = d.choice([1e-5, 1e-6, 1e-12, 0.0], [5, 2, 1, 1], label=label + " eps")
    if d.maybe(0.7, label=label + " eps scalar"):
        v = I._plus_scalar(var, scalar=eps)
    else:
        v = add(b, var, b.param("eps", (1,), value=[eps]), label=label + " eps add")
    form = d.choice(["div_sqrt", "mul_rsqrt", "pow_half"], [4, 3, 1], label=label + " normalize")
    if form == "div_sqrt":
        n = S.broadcast_div(dd, S.sqrt(v))
    elif form == "mul_rsqrt":
        n = mul(b, dd, S.rsqrt(v), label=label + " rsqrt mul")
    else:
        n = S.broadcast_div(dd, v ** 0.5)
    if d.maybe(0.8, label=label + " gamma"):
        n = mul(b, n, _affine(b, c, rank, label + " gamma", "gamma", tmpl), label=label + " gamma mul")
    if d.maybe(0.75, label=label + " beta"):
        n = add(b, n, _affine(b, c, rank, label + " beta", "beta", tmpl), label=label + " beta add")
    return n


def written_softmax(b, x, tmpl, label: str = "wsm"):
    d = b.d
    rank = len(tmpl)
    axis = d.choice([-1, rank - 1, 1, 0], [5, 2, 2, 1], label=label + " axis")
    keep = not d.maybe(0.03, label=label + " keepdims false")
    if d.maybe(0.7, label=label + " max"):
        max_axis = axis if d.maybe(0.93, label=label + " same max axis") else d.choice([1, -1], label=label + " max axis")
        e = S.exp(S.broadcast_sub(x, S.max(x, axis=max_axis, keepdims=True)))
    else:
        e = S.exp(x)
    other = S.exp(x) if d.maybe(0.03, label=label + " sum of another exp") else e
    tot = S.sum(other, axis=axis, keepdims=keep)
    return S.broadcast_div(e, tot)


def prenorm(b):
    d = b.d
    tmpl, c = _x(b, (0, 1, 0))
    x = b.input("x", tmpl)
    h = builtin_ln(b, x, tmpl, c, "ln1") if d.maybe(0.6, label="ln1 builtin") else written_ln(b, x, tmpl, c, "wln1")
    if d.maybe(0.6, label="ffn"):
        h = S.FullyConnected(h, num_hidden=c, flatten=False, name=b.name("ffn"))
    s = add(b, x, h, same_shape=True, label="stream add")
    y = builtin_ln(b, s, tmpl, c, "ln2")
    return [y, s] if d.maybe(0.5, label="stream is output") else [S.broadcast_add(y, s)]


def post_norm(b):
    """A post-norm transformer's sublayers (BERT's): y1 = LayerNorm(a + x), a product of y1, and
    y2 = LayerNorm(product + y1) — y1 read by a matrix product and by the residual stream."""
    d = b.d
    tmpl, c = _x(b, (0, 1, 0))
    y1 = builtin_ln(b, add(b, b.input("a", tmpl), b.input("x", tmpl), same_shape=True, label="first add"), tmpl, c,
                    "ln1")
    hidden = d.choice([c, 2 * c, 4], label="ffn width")
    h = S.FullyConnected(y1, num_hidden=hidden, flatten=False, no_bias=d.maybe(0.2, label="ffn1 no bias"),
                         name=b.name("ffn1"))
    act = d.choice(["none", "relu", "gelu"], [1, 1, 2], label="ffn act")
    if act == "relu":
        h = S.relu(h)
    elif act == "gelu":
        h = S.LeakyReLU(h, act_type="gelu", name=b.name("gelu"))
    if hidden != c or d.maybe(0.5, label="ffn2"):
        h = S.FullyConnected(h, num_hidden=c, flatten=False, name=b.name("ffn2"))
    outs = [builtin_ln(b, add(b, h, y1, same_shape=True, label="second add"), tmpl, c, "ln2")]
    if d.maybe(0.2, label="y1 also read by a second product"):
        outs.append(S.FullyConnected(y1, num_hidden=3, flatten=False, name=b.name("side")))
    if d.maybe(0.15, label="y1 is an output"):
        outs.append(y1)
    return outs


def build(b):
    d = b.d
    if d.maybe(0.04, label="float64"):        # not float32: the fused ops must stay away
        b.float_dtype = "float64"
    form = d.choice(["builtin", "skip", "written_ln", "skip_written", "written_softmax", "prenorm", "post_norm"],
                    [2, 4, 5, 2, 5, 2, 2], label="form")
    if form == "post_norm":
        return post_norm(b)
    if form == "skip":
        return skip(b)
    if form == "skip_written":
        return skip(b, written=True)
    if form == "prenorm":
        return prenorm(b)
    tmpl, c = _x(b)
    kind = "big" if form == "written_softmax" and d.maybe(0.05, label="large inputs") else "normal"
    x = b.input("x", tmpl)
    if kind == "big":
        x = x * 60.0
    if form == "builtin":
        return [builtin_ln(b, x, tmpl, c)]
    if form == "written_ln":
        if d.maybe(0.2, label="pre op"):
            x = S.tanh(x) * 3.0
        return [written_ln(b, x, tmpl, c)]
    return [written_softmax(b, x, tmpl)]
