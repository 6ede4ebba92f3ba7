"""conv_bn_act / dense_bn: Conv | Deconv | FullyConnected → BatchNorm [→ act] [→ residual add [→ act]].

Grammar::

    graph    := block [block] [head]
    block    := producer → BatchNorm [→ act] [→ add(·, residual) [→ act]]
    producer := Convolution(1-D/2-D/3-D, kernel 1|3, stride, pad, dilate, groups 1|2|depthwise, no_bias?, layout?)
              | Deconvolution(kernel, stride, pad, adj, groups, no_bias?)
              | FullyConnected(flatten True|False, no_bias?)                        (dense_bn)
    BatchNorm:  axis = the channel axis (spelt ±) | now and then another axis; fix_gamma, eps, momentum,
                use_global_stats, output_mean_var (rare); moving variance sometimes tiny; γ of either sign
    residual := data input of the output shape | (1, C, 1…) input | a parameter | another conv → BN
              | the block's input (when shapes agree) | the same value (add(y, y))
    act      := Activation(relu|sigmoid|tanh|softrelu|softsign) | LeakyReLU kinds | clip | relu op | …
    head     := [Pooling(global) →] [Flatten →] FullyConnected → BatchNorm [→ act]
"""
from __future__ import annotations

from .pieces import S, activation, add

CONV_ACTS = ["Activation", "op", "leaky", "gelu", "elu", "selu", "prelu", "clip"]


def _bn(b, x, rank: int, channel_axis: int, label: str = "bn"):
    d = b.d
    axis_kind = d.choice(["default", "pos", "neg", "other"], [3, 3, 2, 1], label=label + " axis")
    kw = {}
    if axis_kind == "default":
        if channel_axis != 1:
            kw["axis"] = channel_axis
    elif axis_kind == "pos":
        kw["axis"] = channel_axis
    elif axis_kind == "neg":
        kw["axis"] = channel_axis - rank
    else:
        others = [a for a in range(rank) if a != channel_axis]
        kw["axis"] = d.choice(others, label=label + " other axis")
        if d.maybe(0.3, label=label + " other axis neg"):
            kw["axis"] -= rank
        b.flag("no_subgraph")     # MXNet's oneDNN backend crashes binding conv → BN(non-channel axis)
    fg = d.choice([None, False, True], [1, 3, 1], label=label + " fix_gamma")
    if fg is not None:
        kw["fix_gamma"] = fg
    eps = d.choice([None, 1e-5, 1e-3, 0.1, 2e-5], label=label + " eps")
    if eps is not None:
        kw["eps"] = eps
    if d.maybe(0.2, label=label + " momentum"):
        kw["momentum"] = d.choice([0.9, 0.5, 0.0], label=label + " momentum value")
    if d.maybe(0.25, label=label + " use_global_stats"):
        kw["use_global_stats"] = d.choice([True, False], label=label + " ugs value")
    name = b.name(label)
    return name, kw


def batchnorm(b, x, shape, channel_axis: int, label: str = "bn", tmpl=None):
    """BatchNorm with explicit parameters; returns (symbol, channels).

    ``tmpl``: the shape template of x (default: only axis 0 is a dimension, "B"); the parameters'
    size pins the dimension of the normalized axis.
    """
    rank = len(shape)
    name, kw = _bn(b, x, rank, channel_axis, label)
    axis = kw.get("axis", 1) % rank
    c = shape[axis]
    b.shape(((tmpl or ("B",) + tuple(shape[1:]))[axis],), pin=True)
    var_kind = b.d.choice(["var", "tiny"], [5, 1], label=label + " var kind")
    gamma = b.param(name + "_gamma", (c,), kind="gamma")
    beta = b.param(name + "_beta", (c,), kind="normal")
    mean = b.param(name + "_mean", (c,), kind="normal")
    if var_kind == "tiny":
        var = b.param(name + "_var", (c,), value=b.np.uniform(0, 1e-4, c))
    else:
        var = b.param(name + "_var", (c,), kind="var")
    omv = b.d.maybe(0.04, label=label + " output_mean_var")
    y = S.BatchNorm(x, gamma=gamma, beta=beta, moving_mean=mean, moving_var=var, name=name,
                    output_mean_var=omv, **kw)
    return (y[0] if omv else y), c


def _conv(b, x, shape, label: str):
    """A Convolution/Deconvolution on x of shape (B, C, spatial…); returns (symbol, out shape)."""
    d = b.d
    nd = len(shape) - 2
    c = shape[1]
    op = d.choice(["Convolution", "Deconvolution"], [3, 1], label=label + " op")
    k = d.choice([1, 3, 2], label=label + " kernel")
    s = d.choice([1, 2], [3, 1], label=label + " stride")
    pad = d.int(0, k // 2, label=label + " pad")
    groups_kind = d.choice(["1", "2", "depthwise"], [4, 1, 1], label=label + " groups")
    g = 2 if groups_kind == "2" and c % 2 == 0 else (c if groups_kind == "depthwise" else 1)
    f = g * d.int(1, 3, label=label + " filters per group")
    no_bias = d.choice([None, True, False], label=label + " no_bias")
    kw = {} if no_bias is None else {"no_bias": no_bias}
    if d.maybe(0.1, label=label + " explicit layout"):
        kw["layout"] = {1: "NCW", 2: "NCHW", 3: "NCDHW"}[nd]
    name = b.name("conv" if op == "Convolution" else "deconv")
    spatial = shape[2:]
    if op == "Convolution" and nd >= 2 and d.maybe(0.3, label=label + " explicit Pad"):
        # "same" padding written as a Pad op (Xception, exported graphs): pad_into_conv's forms and
        # near-misses (another mode or value, uneven amounts)
        mode = d.choice(["constant", "edge", "reflect"], [6, 1, 1], label=label + " Pad mode")
        value = 0.0 if mode != "constant" or d.maybe(0.9, label=label + " Pad zero") else 1.5
        before = d.int(1, 2, label=label + " Pad before")
        after = before if d.maybe(0.8, label=label + " Pad even") else d.int(0, 2, label=label + " Pad after")
        if mode == "reflect" and min(spatial) <= max(before, after):
            mode = "edge"       # reflect pads less than the axis is long
        x = S.Pad(x, mode=mode, pad_width=(0, 0, 0, 0) + (before, after) * nd, constant_value=value,
                  name=b.name("pad"))
        spatial = tuple(w + before + after for w in spatial)
    if op == "Convolution":
        dil = 2 if k == 3 and d.maybe(0.2, label=label + " dilate") and min(spatial) + 2 * pad >= 5 else 1
        if dil > 1:
            kw["dilate"] = (dil,) * nd
        if min(spatial) + 2 * pad < dil * (k - 1) + 1:
            pad = k // 2
        out = tuple((w + 2 * pad - dil * (k - 1) - 1) // s + 1 for w in spatial)
        y = S.Convolution(x, kernel=(k,) * nd, stride=(s,) * nd, pad=(pad,) * nd, num_filter=f, num_group=g,
                          name=name, **kw)
    else:
        adj = 1 if s == 2 and d.maybe(0.2, label=label + " adj") else 0
        if adj:
            kw["adj"] = (adj,) * nd
        dil = 2 if k >= 2 and d.maybe(0.15, label=label + " deconv dilate") else 1
        if dil > 1:
            kw["dilate"] = (dil,) * nd
        out = tuple((w - 1) * s - 2 * pad + dil * (k - 1) + 1 + adj for w in spatial)
        if not adj and d.maybe(0.1, label=label + " target_shape"):
            kw["target_shape"] = out      # MXNet then computes the padding (a region refuses it)
        y = S.Deconvolution(x, kernel=(k,) * nd, stride=(s,) * nd, pad=(pad,) * nd, num_filter=f, num_group=g,
                            name=name, **kw)
    if min(out) < 1:
        raise ValueError("empty convolution output")
    return y, (shape[0], f) + out


def block(b, x, shape, label: str):
    """producer → BN [→ act] [→ add [→ act]]; returns (symbol, shape)."""
    d = b.d
    prod, out = _conv(b, x, shape, label)
    y, _ = batchnorm(b, prod, out, 1, label=label + "bn")
    if d.maybe(0.6, label=label + " act"):
        y = activation(b, y, out[1], CONV_ACTS, label=label + " act")[0]
    if d.maybe(0.45, label=label + " residual"):
        kind = d.choice(["input", "broadcast", "other_conv", "identity", "self", "param"], label=label + " res kind")
        if kind == "identity" and tuple(shape) != tuple(out):
            kind = "input"
        full = ("B",) + tuple(out[1:])
        if kind == "input":
            b.pinned.update(n for n in b.dims if n != "B")
            r = b.input("res", full)
        elif kind == "broadcast":
            r = b.input("res", (1, out[1]) + (1,) * (len(out) - 2))
        elif kind == "param":
            r = b.param("res", (1,) + tuple(out[1:]))
        elif kind == "identity":
            r = x
        elif kind == "self":
            r = y
        else:
            r_prod, r_out = _conv(b, x, shape, label + " rconv")
            if r_out != out:
                r = b.input("res", ("B",) + tuple(out[1:]))
                b.pinned.update(n for n in b.dims if n != "B")
            else:
                r, _ = batchnorm(b, r_prod, r_out, 1, label=label + "rbn")
        y = add(b, y, r, same_shape=kind in ("identity", "self", "other_conv"), label=label + " res add")
        if d.maybe(0.6, label=label + " act2"):
            y = activation(b, y, out[1], CONV_ACTS, label=label + " act2")[0]
    return y, out


def dense_bn(b, x, shape, label: str = "head"):
    """[Flatten →] FullyConnected → BatchNorm [→ act]."""
    d = b.d
    flatten = d.choice([True, False], label=label + " flatten")
    if flatten and len(shape) > 2 and d.maybe(0.3, label=label + " Flatten op"):
        x = S.Flatten(x)
    n = d.choice([4, 1, 3, 8], label=label + " hidden")
    no_bias = d.maybe(0.3, label=label + " no_bias")
    fc = S.FullyConnected(x, b.param("fc_weight", (n, _fan_in(shape, flatten)), kind="weight"),
                          None if no_bias else b.param("fc_bias", (n,)), num_hidden=n, flatten=flatten,
                          no_bias=no_bias, name=b.name("fc"))
    out = (shape[0], n) if flatten else tuple(shape[:-1]) + (n,)
    axis = 1 if flatten and d.maybe(0.5, label=label + " bn axis 1") else len(out) - 1
    y, _ = batchnorm(b, fc, out, axis, label=label + "bn")
    if d.maybe(0.5, label=label + " act"):
        y = activation(b, y, None, CONV_ACTS, label=label + " act")[0]
    return y, out


def _fan_in(shape, flatten: bool) -> int:
    if flatten:
        n = 1
        for s in shape[1:]:
            n *= s
        return n
    return shape[-1]


def build(b):
    d = b.d
    nd = d.choice([2, 1, 3], [5, 3, 1], label="spatial dims")
    B = b.dim("B", [1, 2, 3])
    c = d.choice([1, 2, 3, 4, 6], label="channels")
    w = d.choice([3, 4, 5, 7, 8], label="spatial")
    if nd == 3:
        w = min(w, 5)
    shape = (B, c) + (w,) * nd
    if d.maybe(0.2, label="dense_bn only"):
        if d.maybe(0.5, label="dense_bn input rank 3"):
            y, _ = dense_bn(b, b.input("data", ("B", c, w)), (B, c, w))
        else:
            f = d.choice([5, 8, 3], label="features")
            y, _ = dense_bn(b, b.input("x", ("B", f)), (B, f))
        return [y]
    x = b.input("data", ("B", c) + (w,) * nd)
    if d.maybe(0.05, label="two convolutions sharing a weight"):
        weight = b.param("shared_weight", (4, c) + (3,) * nd, kind="weight")
        outs = []
        for i in range(2):
            y = S.Convolution(x, weight, kernel=(3,) * nd, pad=(1,) * nd, num_filter=4, no_bias=True,
                              name=b.name("conv"))
            outs.append(batchnorm(b, y, (B, 4) + (w,) * nd, 1, label="sbn%d" % i)[0])
        return outs
    y, shape = block(b, x, shape, "b0")
    if d.maybe(0.35, label="second block"):
        y, shape = block(b, y, shape, "b1")
    outs = [y]
    if d.maybe(0.3, label="head"):
        h = y
        if d.maybe(0.5, label="global pool"):
            h = S.Pooling(h, kernel=(1,) * nd, global_pool=True, pool_type=d.choice(["avg", "max"], label="pool"))
            shape = shape[:2] + (1,) * nd
        hy, _ = dense_bn(b, h, shape)
        outs = [hy] if d.maybe(0.5, label="drop body output") else [y, hy]
    return outs
