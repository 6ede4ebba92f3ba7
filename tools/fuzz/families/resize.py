"""bilinear_resize: producer → BilinearResize2D (every mode) → consumer.

Grammar::

    graph    := producer → resize [→ consumer] | near
    producer := x (B, C, H, W) | Convolution 3×3 pad 1 [→ Activation(relu)] of x
    resize   := BilinearResize2D(mode, align_corners True | False | default)
    mode     := size (height, width) | size with scale_height and scale_width (≥ 1, or < 1 on pinned sizes)
              | size with scale_width alone (MXNet ignores it) | odd_scale (scales) | like (a second input
              of any H, W, or the producer's other branch) | to_even_down | to_even_up | to_odd_down | to_odd_up
    consumer := Concat(resize, a second resize of another input with the same attributes, dim=1)
              | add(resize, that second resize) | Concat(resize, like, dim=1) (mode like)
              | relu | the resize also an output beside the consumer
    near     := float16 data (refused: not float32) | no input shapes given (refused: unknown shapes)
    (a 5-D input, which MXNet infers but cannot run, is tests/test_bilinear_resize.py's: not a valid graph here)
"""
from __future__ import annotations

import numpy as np

from .pieces import S, add


def _producer(b, x, c):
    d = b.d
    if not d.maybe(0.6, label="conv producer"):
        return x, c
    name = b.name("conv")
    co = d.choice([4, 3, 8], label="conv channels")
    w = b.param(name + "_weight", (co, c, 3, 3), kind="weight")
    bias = b.param(name + "_bias", (co,), kind="normal")
    y = S.Convolution(x, w, bias, kernel=(3, 3), pad=(1, 1), num_filter=co, name=name)
    if d.maybe(0.4, label="conv relu"):
        y = S.Activation(y, act_type="relu")
    return y, co


def _attrs(b, mode):
    """The resize's attributes for ``mode`` (and pins the input sizes where they could shrink to nothing)."""
    d = b.d
    kw = {}
    ac = d.choice([None, True, False], label="align_corners")
    if ac is not None:
        kw["align_corners"] = ac
    if mode == "size":
        form = d.choice(["size", "scales", "scale_width alone"], [3, 3, 1], label="size form")
        if form == "scales":
            sh = d.choice([2.0, 1.5, 0.5, 3.0, 1.0, 0.37], label="scale_height")
            sw = d.choice([2.0, 0.75, 4.0, 1.0, 2.6], label="scale_width")
            # below 1: on these sizes only, pinned (and never down to nothing)
            if sh < 1:
                sh = sh if int(np.float32(sh) * b.fixed("H")) >= 1 else 2.0
            if sw < 1:
                sw = sw if int(np.float32(sw) * b.fixed("W")) >= 1 else 2.0
            kw.update(scale_height=sh, scale_width=sw)
        else:
            kw.update(height=b.size([8, 5, 1, 13], [97, 64], label="height"),
                      width=b.size([6, 1, 9, 4], [71, 130], label="width"))
            if form == "scale_width alone":
                kw["scale_width"] = 2.0
    elif mode == "odd_scale":
        kw.update(scale_height=d.choice([2.0, 3.0, 1.0], label="odd scale_height"),
                  scale_width=d.choice([2.0, 0.5, 1.5], label="odd scale_width"))
    elif mode == "to_even_down":
        b.fixed("H"), b.fixed("W")      # a side of 1 would become 0
    kw["mode"] = mode
    return kw


def build(b):
    d = b.d
    b.dim("B", [1, 2])
    c = d.choice([3, 2, 5], label="channels")
    b.dim("H", [5, 4, 7, 2, 1], big=[33, 60])
    b.dim("W", [6, 3, 9, 1], big=[47, 64])
    near = d.choice(["none", "float16", "no_shapes"], [12, 1, 1], label="near variant")
    if near == "float16":
        x = b.input("data", ("B", c, "H", "W"), dtype="float16")
        y = S.contrib.BilinearResize2D(x, height=d.choice([8, 3], label="f16 height"), width=5,
                                       align_corners=d.maybe(0.5, label="f16 align_corners"))
        return [S.Cast(y, dtype="float32")]
    if near == "no_shapes":
        b.flag("no_shapes")
    x = b.input("data", ("B", c, "H", "W"))
    p, cp = _producer(b, x, c)
    mode = d.choice(["size", "like", "odd_scale", "to_even_down", "to_even_up", "to_odd_down", "to_odd_up"],
                    [4, 3, 2, 1, 1, 1, 1], label="mode")
    kw = _attrs(b, mode)
    like = None
    if mode == "like":
        if d.maybe(0.8, label="like is an input"):
            b.dim("H2", [10, 3, 1, 16], big=[120, 97])
            b.dim("W2", [12, 7, 1], big=[130, 61])
            like = b.input("like", ("B", d.choice([2, 1], label="like channels"), "H2", "W2"))
        else:               # another branch of the input: its own size
            like = S.Pooling(x, kernel=(1, 1), pool_type="max")
        r = S.contrib.BilinearResize2D(p, like, **kw)
    else:
        r = S.contrib.BilinearResize2D(p, **kw)
    consumer = d.choice(["none", "concat", "add", "relu"], [2, 3, 2, 1], label="consumer")
    if consumer == "none":
        return [r]
    if consumer == "relu":
        y = S.relu(r)
    elif mode == "like" and d.maybe(0.5, label="concat with like"):
        y = S.Concat(r, like, dim=1)
    else:
        x2 = b.input("other", ("B", cp, "H", "W"))
        r2 = S.contrib.BilinearResize2D(x2, like, **kw) if mode == "like" else S.contrib.BilinearResize2D(x2, **kw)
        y = S.Concat(r, r2, dim=1) if consumer == "concat" else add(b, r, r2, same_shape=True)
    if d.maybe(0.15, label="resize escapes"):
        return [y, r]
    return [y]
