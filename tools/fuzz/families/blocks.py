"""Whole blocks, where rules compose and compete: transformer layers and small CNNs.

Grammar::

    transformer := x (B,S,E) → [LN (built in | written) →] MHA (projections, head split, core, merge,
                   output FC) → [Dropout] → residual add → LN | add+LN → FFN: FC → act (GELU written
                   out | LeakyReLU(gelu) | relu) → FC → [Dropout] → residual add → LN          (post- or pre-LN)
    cnn         := 1–2 conv blocks → global pooling → Flatten → FC → [act] → [softmax written out]
"""
from __future__ import annotations

from . import attention, conv, norm
from .pieces import S, activation, add


def transformer(b):
    d = b.d
    b.dim("B", [1, 2])
    h = d.choice([2, 1, 3], label="heads")
    dh = d.choice([4, 2, 3], label="head dim")
    e = h * dh
    b.dims["_D"], b.alt["_D"] = dh, dh
    b.pinned.add("_D")
    b.dim("Sq", [5, 3, 1, 4, 8])
    b.dims["Sk"], b.alt["Sk"] = b.dims["Sq"], b.alt["Sq"]
    tmpl = ("B", "Sq", e)
    x = b.input("x", tmpl)
    pre = d.maybe(0.4, label="pre-LN")

    def ln(t, label):
        if d.maybe(0.5, label=label + " written"):
            return norm.written_ln(b, t, tmpl, e, label)
        return norm.builtin_ln(b, t, tmpl, e, label)

    fc = lambda t, n, lbl: S.FullyConnected(t, num_hidden=n, flatten=False, name=b.name(lbl))
    hin = ln(x, "ln0") if pre else x
    if d.maybe(0.3, label="packed qkv"):
        parts = S.split(fc(hin, 3 * e, "qkv"), num_outputs=3, axis=-1)
        qp, kp, vp = parts[0], parts[1], parts[2]
    else:
        qp, kp, vp = fc(hin, e, "q"), fc(hin, e, "k"), fc(hin, e, "v")
    split = d.choice(["std", "codes", "four"], [3, 2, 1], label="split")
    q, k, v = (attention.split_heads(b, t, h, split) for t in (qp, kp, vp))
    geo = attention.Geo(("B", h) if split == "four" else ("B*%d" % h,), "Sq", "Sq", dh, dh)
    o = attention.core(b, q, k, v, geo)
    o = fc(attention.merge_heads(b, o, h, d.choice(["std", "codes"], label="merge"), split == "four"), e, "o")
    if d.maybe(0.3, label="attn dropout"):
        o = S.Dropout(o, p=0.1)
        b.flag("random_train")
    s1 = add(b, x, o, same_shape=True, label="res1")
    y = ln(s1, "ln1") if not pre else s1
    hid = d.choice([2 * e, e, 8], label="ffn width")
    f1 = fc(ln(y, "ln2") if pre else y, hid, "ffn1")
    f1 = activation(b, f1, None, ["gelu_erf", "gelu_tanh", "gelu", "Activation", "gelu_erf_wrong"], label="ffn act")[0]
    f2 = fc(f1, e, "ffn2")
    s2 = add(b, y, f2, same_shape=True, label="res2")
    return [ln(s2, "ln3") if not pre else s2]


def cnn(b):
    d = b.d
    B = b.dim("B", [1, 2])
    c = d.choice([3, 2, 4], label="channels")
    w = d.choice([6, 5, 8], label="size")
    x = b.input("data", ("B", c, w, w))
    y, shape = conv.block(b, x, (B, c, w, w), "b0")
    if d.maybe(0.5, label="second block"):
        y, shape = conv.block(b, y, shape, "b1")
    y = S.Flatten(S.Pooling(y, kernel=(1, 1), global_pool=True, pool_type="avg"))
    n = d.choice([5, 3, 10], label="classes")
    y = S.FullyConnected(y, num_hidden=n, name=b.name("fc"))
    if d.maybe(0.3, label="head act"):
        y = S.relu(y)
    if d.maybe(0.7, label="softmax written"):
        y = norm.written_softmax(b, y, ("B", n))
    return [y]


def build(b):
    if b.d.choice(["transformer", "cnn"], [3, 1], label="form") == "transformer":
        return transformer(b)
    return cnn(b)
