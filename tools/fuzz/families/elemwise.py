"""elementwise / gelu / dropout: chains and trees of elementwise, broadcast and scalar ops.

Grammar::

    graph  := a pool of leaves, then 2–16 steps each adding one value to the pool; outputs: the last value
              [and other values of the pool]
    leaf   := data input (normal | positive | [-1, 1]; NaN/inf sometimes) of a shape broadcastable to the full
              one (B,C) | (B,S,C) | (B,C,H,W) | parameter | int32 input (ids, 0/1 masks) used through Cast,
              a comparison or where
    step   := unary(v)        negative abs exp log sqrt rsqrt square reciprocal tanh sigmoid relu erf softsign
                              sin cos log1p expm1 sign
            | scalar(v, c)    _plus/_minus/_rminus/_mul/_div/_rdiv/_power/_rpower/_maximum/_minimum/
                              _greater/_greater_equal/_lesser/_lesser_equal/_equal/_not_equal/_mod _scalar
            | binary(v, w)    broadcast_{add,sub,mul,div,power,maximum,minimum,greater,…,equal,mod} |
                              elemwise_{add,sub,mul,div} and operators when shapes agree (v and w may be the same value)
            | clip | where(cond, v, w) (cond: a comparison, a 0/1 input, an int32 input, a 1-D row selector)
            | hard_sigmoid | Activation | LeakyReLU(leaky|gelu|elu|prelu) | GELU written out (erf/tanh, right/wrong)
            | swish | hard-swish x·clip(x+3,0,6)/6 | BatchNorm alone (inference: scale-shift)
            | Dropout(p, mode=training|always) | Cast to float16/float64/int32 [and back] | identity | BlockGrad
            | sum/mean/max(axis, keepdims=True) (a region boundary)
"""
from __future__ import annotations

from typing import List, Tuple

from .pieces import I, S, activation, gelu_erf, gelu_tanh

UNARY = ["tanh", "sigmoid", "relu", "exp", "negative", "abs", "square", "sqrt", "log", "rsqrt", "reciprocal", "erf",
         "softsign", "sin", "cos", "log1p", "expm1", "sign"]
UNARY_W = [5, 5, 5, 2, 3, 3, 3, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1]
SCALAR = ["_plus_scalar", "_minus_scalar", "_rminus_scalar", "_mul_scalar", "_div_scalar", "_rdiv_scalar",
          "_power_scalar", "_rpower_scalar", "_maximum_scalar", "_minimum_scalar", "_greater_scalar",
          "_greater_equal_scalar", "_lesser_scalar", "_lesser_equal_scalar", "_equal_scalar", "_not_equal_scalar",
          "_mod_scalar"]
SCALAR_W = [5, 3, 3, 5, 3, 1, 2, 1, 2, 2, 1, 1, 1, 1, 1, 1, 1]
BINARY = ["add", "sub", "mul", "div", "power", "maximum", "minimum", "greater", "greater_equal", "lesser",
          "lesser_equal", "equal", "not_equal", "mod"]
BINARY_W = [6, 4, 6, 2, 1, 2, 2, 1, 1, 1, 1, 1, 1, 1]


class Val:
    """A pool value: symbol, shape mask (True = the full size, False = 1), right-aligned to the full rank."""

    def __init__(self, sym, mask: Tuple[bool, ...], dtype: str = "float32"):
        self.sym, self.mask, self.dtype = sym, tuple(mask), dtype


def _bcast(a: Tuple[bool, ...], c: Tuple[bool, ...]) -> Tuple[bool, ...]:
    n = max(len(a), len(c))
    a = (False,) * (n - len(a)) + a
    c = (False,) * (n - len(c)) + c
    return tuple(x or y for x, y in zip(a, c))


def _tmpl(full, mask):
    return tuple(f if m else 1 for f, m in zip(full[len(full) - len(mask):], mask))


def _scalar_const(b, op: str):
    d = b.d
    if op == "_power_scalar":
        return d.choice([2.0, 3.0, 0.5, -1.0, 1.5], label="power")
    if op == "_rpower_scalar":
        return d.choice([2.0, 0.5, 1.5], label="rpower")
    if op in ("_div_scalar", "_mod_scalar"):
        return d.choice([2.0, 3.0, 0.7, -1.5], label="divisor")
    if op == "_rdiv_scalar":
        return d.choice([1.0, 2.0, -1.0], label="rdiv")
    if op in ("_equal_scalar", "_not_equal_scalar"):
        return d.choice([0.0, 1.0], label="eq const")
    return d.choice([0.5, 1.0, -1.0, 3.0, 0.0, 6.0, -0.25], label="scalar")


def _leaf(b, full, label: str) -> Val:
    d = b.d
    rank = len(full)
    kind = d.choice(["full", "bcast", "param", "int", "mask"], [6, 4, 2, 1, 1], label=label)
    if kind in ("full", "int", "mask"):
        mask = (True,) * rank
    else:
        how = d.choice(["trailing", "ones", "scalar"], [3, 3, 1], label=label + " bshape")
        if how == "trailing":
            k = d.int(1, rank, label=label + " keep")
            mask = (True,) * k
        elif how == "scalar":
            mask = (False,)
        else:
            mask = tuple(d.maybe(0.5, label=label + " keep %d" % i) for i in range(rank))
    tmpl = _tmpl(full, mask)
    if kind == "param":
        return Val(b.param("p", tmpl, kind=d.choice(["normal", "pos"], label=label + " pkind")), mask)
    if kind == "int":
        x = b.input("ids", tmpl, kind="ids", dtype="int32", hi=d.choice([2, 5], label=label + " id range"))
        use = d.choice(["cast", "compare", "where_cond"], label=label + " int use")
        if use == "cast":
            return Val(S.Cast(x, dtype=b.float_dtype), mask)
        if use == "compare":
            return Val(S.Cast(I._greater_scalar(x, scalar=1.0), dtype=b.float_dtype), mask)
        return Val(x, mask, "int32")
    if kind == "mask":
        return Val(b.input("m", tmpl, kind="mask01"), mask)
    vk = d.choice(["normal", "pos", "unit"], [5, 2, 2], label=label + " values")
    return Val(b.input("x", tmpl, kind=vk), mask)


def _pick(b, pool: List[Val], label: str, float_only: bool = True) -> Val:
    cands = [v for v in pool if v.dtype != "int32"] if float_only else pool
    # recent values more often: chains as well as trees
    i = b.d.choice(list(range(len(cands)))[::-1], [3 if j == 0 else 1 for j in range(len(cands))], label=label)
    return cands[i]


def _to_full(b, v: Val, rank: int):
    """``v`` at the full shape: as it is, broadcast_like'd (same rank) or added to zeros (lower rank)."""
    if v.mask == (True,) * rank:
        return v.sym
    if len(v.mask) == rank and b.d.maybe(0.7, label="broadcast_like"):
        return S.broadcast_like(v.sym, b.full_sym)
    return S.broadcast_add(S.zeros_like(b.full_sym), v.sym)


def _step(b, pool: List[Val], full, label: str) -> Val:
    d = b.d
    rank = len(full)
    kind = d.choice(["unary", "scalar", "binary", "clip", "where", "hard_sigmoid", "act", "gelu", "swish_hswish",
                     "batchnorm", "dropout", "cast", "identity", "reduce"],
                    [6, 7, 7, 1, 2, 1, 3, 3, 1, 1, 1, 1, 1, 1], label=label)
    a = _pick(b, pool, label + " a")
    if kind == "unary":
        op = d.choice(UNARY, UNARY_W, label=label + " op")
        return Val(getattr(S, op)(a.sym), a.mask)
    if kind == "scalar":
        op = d.choice(SCALAR, SCALAR_W, label=label + " op")
        return Val(getattr(I, op)(a.sym, scalar=_scalar_const(b, op)), a.mask)
    if kind == "binary":
        c = a if d.maybe(0.1, label=label + " same operand") else _pick(b, pool, label + " b")
        op = d.choice(BINARY, BINARY_W, label=label + " op")
        mask = _bcast(a.mask, c.mask)
        same = a.mask == c.mask
        spelled = d.choice(["broadcast", "elemwise", "operator"], [5, 2, 2] if same and op in ("add", "sub", "mul", "div") else [1, 0, 0],
                           label=label + " spelling")
        if spelled == "elemwise":
            return Val(getattr(S, "elemwise_" + op)(a.sym, c.sym), mask)
        if spelled == "operator":
            return Val({"add": a.sym + c.sym, "sub": a.sym - c.sym, "mul": a.sym * c.sym, "div": a.sym / c.sym}[op], mask)
        return Val(getattr(S, "broadcast_" + op)(a.sym, c.sym), mask)
    if kind == "clip":
        lo = d.choice([0.0, -1.0, -0.5], label=label + " lo")
        return Val(S.clip(a.sym, a_min=lo, a_max=lo + d.choice([6.0, 1.0, 2.0], label=label + " width")), a.mask)
    if kind == "where":
        how = d.choice(["compare", "mask", "int", "row"], [4, 2, 1, 1], label=label + " cond")
        c = _pick(b, pool, label + " other")
        # where takes equal shapes: both branches and the condition at the full shape
        full_mask = (True,) * rank
        xa, xc = _to_full(b, a, rank), _to_full(b, c, rank)
        if how == "compare":
            t = d.choice([0.0, 0.5], label=label + " t")
            cond = _to_full(b, Val(I._greater_scalar(a.sym, scalar=t), a.mask), rank)
        elif how == "mask":
            cond = b.input("m", tuple(full), kind="mask01")
        elif how == "int":
            cond = b.input("ids", tuple(full), kind="ids", dtype="int32", hi=2)
        else:            # 1-D: selects rows of axis 0
            cond = b.input("rows", (full[0],), kind="mask01")
        return Val(S.where(cond, xa, xc), full_mask)
    if kind == "hard_sigmoid":
        return Val(S.hard_sigmoid(a.sym) if d.maybe(0.5, label=label + " default") else
                   S.hard_sigmoid(a.sym, alpha=1 / 6.0, beta=0.5), a.mask)
    if kind == "act":
        ch = full[1] if rank >= 2 and len(a.mask) == rank and a.mask[1] and isinstance(full[1], int) else None
        return Val(activation(b, a.sym, ch, ["Activation", "op", "leaky", "gelu", "elu", "prelu", "clip"],
                              label=label + " act")[0], a.mask)
    if kind == "gelu":
        form = d.choice(["erf", "tanh", "erf_wrong", "tanh_wrong"], [4, 3, 1, 1], label=label + " gelu")
        f = gelu_erf if form.startswith("erf") else gelu_tanh
        return Val(f(b, a.sym, wrong=form.endswith("wrong"), label=label + " gelu"), a.mask)
    if kind == "swish_hswish":
        if d.maybe(0.5, label=label + " hswish"):
            return Val(a.sym * S.clip(a.sym + 3.0, a_min=0.0, a_max=6.0) / 6.0, a.mask)
        return Val(a.sym * S.sigmoid(a.sym), a.mask)
    if kind == "batchnorm":
        if rank < 2 or len(a.mask) != rank or not all(a.mask):
            return Val(S.relu(a.sym), a.mask)
        from .conv import batchnorm
        return Val(batchnorm(b, a.sym, b.shape(full), 1 if d.maybe(0.7, label=label + " bn ch1") else rank - 1,
                             label="bn", tmpl=full)[0], a.mask)
    if kind == "dropout":
        p = d.choice([0.5, 0.0, 0.1], label=label + " p")
        if d.maybe(0.2, label=label + " always"):
            if p > 0:
                b.flag("random")
            return Val(S.Dropout(a.sym, p=p, mode="always"), a.mask)
        if p > 0:
            b.flag("random_train")
        return Val(S.Dropout(a.sym, p=p), a.mask)
    if kind == "cast":
        to = d.choice(["float16", "float64" if b.float_dtype == "float32" else "float32", "int32"], label=label + " to")
        y = S.Cast(a.sym, dtype=to)
        y = d.choice([S.tanh, S.relu, lambda t: t * 2], label=label + " op in dtype")(y) if to != "int32" else y
        if to == "float16":
            b.flag("half")
        return Val(S.Cast(y, dtype=b.float_dtype), a.mask)
    if kind == "identity":
        op = d.choice(["identity", "_copy", "BlockGrad"], label=label + " which")
        return Val({"identity": S.identity, "_copy": I._copy, "BlockGrad": S.BlockGrad}[op](a.sym), a.mask)
    # reduce with keepdims: a boundary between regions
    if len(a.mask) != rank:
        return Val(S.sigmoid(a.sym), a.mask)
    axis = d.int(0, rank - 1, label=label + " axis")
    op = d.choice(["sum", "mean", "max"], label=label + " reduce")
    mask = tuple(m and i != axis for i, m in enumerate(a.mask))
    return Val(getattr(S, op)(a.sym, axis=axis, keepdims=True), mask)


def build(b):
    d = b.d
    if d.maybe(0.04, label="float64"):        # not float32: fused_elemwise must stay away
        b.float_dtype = "float64"
    rank = d.choice([3, 2, 4, 1], [4, 3, 2, 1], label="rank")
    b.dim("B", [2, 1, 3, 5])
    if rank == 1:
        full = ("B",)
    elif rank == 2:
        full = ("B", b.size([4, 3, 1, 7, 8], [17, 1000, 4097, 33], label="C"))
    elif rank == 3:
        b.dim("S", [3, 1, 2, 5], big=[9, 65])
        full = ("B", "S", b.size([4, 3, 1, 7, 8], [17, 33, 100], label="C"))
    else:
        full = ("B", d.choice([3, 2], label="C"), d.choice([3, 4], label="H"), d.choice([3, 5], label="W"))
    b.full_sym = None
    pool = [_leaf(b, full, "leaf0")]
    if pool[0].mask != (True,) * rank or pool[0].dtype != "float32":
        pool.insert(0, Val(b.input("x", full), (True,) * rank))
    b.full_sym = pool[0].sym
    for i in range(d.int(0, 2, label="more leaves")):
        pool.append(_leaf(b, full, "leaf%d" % (i + 1)))
    for i in range(d.int(2, 14, label="steps")):
        pool.append(_step(b, pool, full, "step%d" % i))
    outs = [pool[-1].sym]
    if d.maybe(0.2, label="second output"):
        outs.append(_pick(b, pool[:-1], "second output").sym)
    return outs
