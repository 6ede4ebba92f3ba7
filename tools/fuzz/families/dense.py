"""dense_act: FullyConnected [+ bias add] [+ activation], and MLPs of them.

Grammar::

    graph  := layer [layer]
    layer  := [pre-op →] FullyConnected(x, W[, b], flatten=True|False, no_bias?) [+ addend] [→ act]
    x      := (B, F) | (B, C, F') (flatten=True flattens it) | (B, S, F) | (B, S, T, F) (flatten=False)
              rows = B (flatten) or B·S·… : below and above fused_dense's 8-row threshold
    addend := parameter (N,) | (1, N) | (1, 1, N) | (N, 1) | (B, 1) | (B, N) | (1,)     broadcast_add, either order
              | a scalar (_plus_scalar) | a data input (N,) | a computed value (sigmoid(param), an input·2)
              | elemwise_add / + of a full-shape parameter
    act    := Activation(relu|sigmoid|tanh|softrelu|softsign) | relu/sigmoid/tanh ops | LeakyReLU(leaky, slope |
              gelu | elu | selu | prelu | rrelu) | clip | hard_sigmoid | GELU written out (erf: 4 arrangements;
              tanh: 3 cube forms, exact/short/wrong constants) | swish
"""
from __future__ import annotations

import numpy as np

from .pieces import I, S, activation, add


_ADDEND_SHAPES = {"N": ("n",), "1N": (1, "n"), "11N": (1, 1, "n"), "N1": ("n", 1), "B1": ("B", 1), "BN": ("B", "n"),
                  "one": (1,)}


def _addend(b, n: int, out_tmpl, rank: int):
    """(addend symbol or None for a scalar add, kind); shapes that would change the output's shape become (N,)."""
    d = b.d
    kind = d.choice(["N", "1N", "11N", "N1", "B1", "BN", "one", "scalar", "input", "computed", "full"],
                    [6, 3, 1, 2, 1, 1, 1, 2, 1, 1, 1], label="addend kind")
    if kind == "scalar":
        return None, kind
    if kind in _ADDEND_SHAPES:
        tmpl = tuple(n if t == "n" else t for t in _ADDEND_SHAPES[kind])
        out = b.shape(out_tmpl)
        try:
            ok = np.broadcast_shapes(out, b.shape(tmpl)) == out
        except ValueError:
            ok = False
        if not ok:
            kind, tmpl = "N", (n,)
        elif kind in ("N1", "B1", "BN"):
            b.pinned.update(b.dims)           # it lines up with these sizes only
        return b.param("bias", tmpl), kind
    if kind == "input":
        return b.input("addend", (n,)), kind
    if kind == "computed":
        p = b.param("bias", (n,))
        return (S.sigmoid(p) if d.maybe(0.5, label="computed form") else p * 2.0), kind
    return b.param("bias", tuple(out_tmpl), kind="normal"), kind


def layer(b, x, in_tmpl, label: str = "fc"):
    """One FullyConnected layer (+ addend, + act); returns (symbol, out template)."""
    d = b.d
    rank = len(in_tmpl)
    flatten = d.choice([False, True], label=label + " flatten") if rank > 2 else d.choice([True, False], label=label + " flatten")
    n = b.size([8, 4, 1, 3, 5, 7, 16, "rows"], [17, 65, 130, 64, 33], label=label + " hidden")
    if n == "rows":          # as many outputs as rows: a (N, 1) addend then lines up (and broadcasts to N×N)
        n = b.fixed(in_tmpl[0]) if isinstance(in_tmpl[0], str) else in_tmpl[0]
    fan = b.shape(in_tmpl[1:]) if flatten else b.shape(in_tmpl[-1:])
    fan_in = 1
    for f in fan:
        fan_in *= f
    if flatten:
        b.pinned.update(t for t in in_tmpl[1:] if isinstance(t, str))      # flattened sizes are in the weight
    no_bias = d.maybe(0.3, label=label + " no_bias")
    w = b.param(label + "_weight", (n, fan_in), kind="weight")
    args = [x, w] if no_bias else [x, w, b.param(label + "_bias", (n,))]
    kw = {"no_bias": True} if no_bias else ({"no_bias": False} if d.maybe(0.2, label=label + " explicit no_bias") else {})
    if flatten:
        if d.maybe(0.3, label=label + " explicit flatten"):
            kw["flatten"] = True
    else:
        kw["flatten"] = False
    y = S.FullyConnected(*args, num_hidden=n, name=b.name(label), **kw)
    out = (in_tmpl[0], n) if flatten else tuple(in_tmpl[:-1]) + (n,)
    if d.maybe(0.5, label=label + " bias add"):
        c, kind = _addend(b, n, out, len(out))
        if c is None:
            y = I._plus_scalar(y, scalar=d.choice([0.5, -1.0, 3.0], label=label + " scalar"))
        else:
            y = add(b, y, c, same_shape=kind == "full", label=label + " bias add")
    if d.maybe(0.7, label=label + " act"):
        y = activation(b, y, n if len(out) == 2 else None, label=label + " act")[0]
    return y, out


def build(b):
    d = b.d
    shape_kind = d.choice(["2d", "3d", "4d", "3d_flat"], [3, 4, 1, 1], label="input rank")
    b.dim("B", [2, 8, 1, 3, 9, 16], big=[33, 129, 8, 2])
    f = b.size([4, 5, 8, 3, 1], [65, 100, 257, 768], label="features")
    if shape_kind == "2d":
        tmpl = ("B", f)
    elif shape_kind == "3d":
        b.dim("S", [3, 5, 1, 4, 8])
        tmpl = ("B", "S", f)
    elif shape_kind == "4d":
        b.dim("S", [2, 3])
        tmpl = ("B", "S", 2, f)
    else:
        tmpl = ("B", 3, f)
    if d.maybe(0.05, label="float64"):       # not float32: fused_dense must stay away
        x = b.input("x", tmpl, dtype="float64")
        n = d.choice([8, 3], label="f64 hidden")
        w = b.param("w", (n, f), kind="weight", dtype="float64")
        y = S.FullyConnected(x, w, b.param("b", (n,), dtype="float64"), num_hidden=n, flatten=False,
                             name=b.name("fc"))
        return [S.relu(y)]
    x = b.input("x", tmpl)
    if d.maybe(0.2, label="pre op"):
        x = d.choice([S.tanh, S.relu, lambda t: t * 0.5], label="pre op kind")(x)
    y, out = layer(b, x, tmpl, "fc0")
    if d.maybe(0.3, label="second layer"):
        y, out = layer(b, y, out, "fc1")
    return [y]
