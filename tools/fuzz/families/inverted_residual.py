"""inverted_residual: MobileNet's block — [1×1 expand → act] → depthwise K×K → act [→ SE] → 1×1 [+ x].

Grammar::

    graph   := x (B, C, H, W) → [layer(1×1, E) → act] → layer(K×K depthwise, E, stride s) → act2
               [→ SE] → layer(1×1, O) [→ add(·, x)]          (the add when O = C and s = 1)
    layer   := Convolution no_bias → BatchNorm(axis 1) | Convolution with bias
             | Convolution no_bias                                                     (refused)
    K×K     := pad (K-1)/2 | pad 0 (refused) | dilate 2, pad K-1 (refused)
    act     := Activation(relu) | hard-swish z · clip(z + 3, 0, 6) / 6
    act2    := act | the other one (the whole block refused; a smaller block may fuse)
    SE      := Pooling(global avg) → Convolution 1×1 → Activation(relu) → Convolution 1×1
               → clip(· + 3, 0, 6) / 6 → broadcast_mul                  (MobileNetV3's)
    head    := sometimes the depthwise output is also an output (an interior value escapes)
"""
from __future__ import annotations

from .pieces import S, without_regions_sometimes


def build(b):
    d = b.d
    b.dim("B", [1, 2])
    C = d.choice([4, 8], label="channels")
    b.dim("H", [5, 6, 7, 4])
    b.dim("W", [5, 6, 3])
    x = b.input("data", ("B", C, "H", "W"))
    act = d.choice(["relu", "hard_swish"], label="act")

    def activate(v, kind):
        if kind == "relu":
            return S.Activation(v, act_type="relu")
        return v * (S.clip(v + 3., 0, 6) / 6.)

    def layer(v, cin, cout, label, kernel=1, stride=1, pad=0, dilate=1, groups=1):
        form = d.choice(["bn", "bias", "bare"], [5, 3, 1], label=label + " form")
        name = b.name(label)
        w = b.param(name + "_weight", (cout, cin // groups, kernel, kernel), kind="weight")
        ins = [v, w] + ([b.param(name + "_bias", (cout,))] if form == "bias" else [])
        y = S.Convolution(*ins, kernel=(kernel, kernel), stride=(stride, stride), pad=(pad, pad),
                          dilate=(dilate, dilate), num_filter=cout, num_group=groups, no_bias=form != "bias",
                          name=name)
        if form == "bn":       # over the channels (the conv family draws BatchNorm's other spellings)
            bn = b.name(label + "_bn")
            y = S.BatchNorm(y, gamma=b.param(bn + "_gamma", (cout,), kind="gamma"),
                            beta=b.param(bn + "_beta", (cout,)), moving_mean=b.param(bn + "_mean", (cout,)),
                            moving_var=b.param(bn + "_var", (cout,), kind="var"), fix_gamma=False,
                            eps=d.choice([1e-5, 1e-3], label=label + " eps"), name=bn)
        return y

    expand = d.maybe(0.75, label="expand")
    E = d.choice([2 * C, 3 * C], label="expanded") if expand else C
    y = activate(layer(x, C, E, "expand"), act) if expand else x
    K = d.choice([3, 5], label="kernel")
    s = d.choice([1, 2], [2, 1], label="stride")
    pad_form = d.choice(["same", "none", "dilated"], [12, 1, 1], label="depthwise padding")
    if pad_form == "none":
        b.fixed("H"), b.fixed("W")
        pad, dil = 0, 1
        if min(b.dims["H"], b.dims["W"]) < K:
            pad = (K - 1) // 2 + 1     # still not (K-1)/2, and the kernel fits
    else:
        pad, dil = ((K - 1) // 2, 1) if pad_form == "same" else (K - 1, 2)
    dw = layer(y, E, E, "dw", kernel=K, stride=s, pad=pad, dilate=dil, groups=E)
    act2 = act if d.maybe(0.9, label="same act") else ("relu" if act == "hard_swish" else "hard_swish")
    y = activate(dw, act2)
    if d.maybe(0.5, label="se"):
        M = max(2, E // 4)
        p = S.Pooling(y, global_pool=True, pool_type="avg", kernel=(1, 1))
        n1, n2 = b.name("se_fc"), b.name("se_fc")
        h = S.Convolution(p, b.param(n1 + "_weight", (M, E, 1, 1), kind="weight"), b.param(n1 + "_bias", (M,)),
                          kernel=(1, 1), num_filter=M, name=n1)
        h = S.Activation(h, act_type="relu")
        g = S.Convolution(h, b.param(n2 + "_weight", (E, M, 1, 1), kind="weight"), b.param(n2 + "_bias", (E,)),
                          kernel=(1, 1), num_filter=E, name=n2)
        y = S.broadcast_mul(y, S.clip(g + 3., 0, 6) / 6.)
    O = C if d.maybe(0.6, label="keep channels") else d.choice([C + 4, 2 * C], label="out channels")
    y = layer(y, E, O, "project")
    if O == C and s == 1 and pad_form == "same" and d.maybe(0.85, label="residual"):
        y = y + x
    outs = [y, dw] if d.maybe(0.06, label="depthwise output escapes") else [y]
    without_regions_sometimes(b)
    return outs
