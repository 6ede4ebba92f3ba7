"""Error bounds of fused_elemwise's forward programs, derived from the elementary functions' errors.

A float32 program's result differs from the exact value of the same expression by the rounding of
every step.  Each elementary function the CPU op and the generated kernels call has an error
bound in float32 ulps of its result, per CPU path (``ELEMENTARY_ULPS``; measured over the float
range on each path by ``test_elemwise_codegen.py::test_elementary_functions_within_their_bounds``,
and those sweeps are what hold the table to the code):

  ``portable``  the loops every x86-64 CPU runs (``common/act.h``, glibc's libm), also what the
                generated kernels compile to as host C++; ``MXFUSION_DISABLE_AVX512=1`` forces them
  ``avx512``    the hand-written AVX-512 loops (``common/vmath_avx512.h``) for exp, sigmoid, tanh,
                erf and gelu, picked at run time on CPUs with AVX-512 F/DQ (AMX CPUs included);
                every other function as ``portable``

The bound of a whole program follows by interval arithmetic in float64 (``bounds``): every value is
an interval [lo, hi] that holds whatever a float32 implementation within those errors can give --
an IEEE operation rounds to nearest (half an ulp), a library function within its ulps, and the
composite functions step by step as MXNet writes them (gelu = 0.5 x (1 + erf(x / sqrt 2)), where
the sum cancels for x << 0 and the error of erf becomes many ulps of the result: a bound in ulps of
the result cannot hold there, an interval does).  Where an interval is unbounded -- a division by
an interval holding 0, a comparison the errors could flip, an endpoint that is NaN -- the element
is not checked against it (``bounded`` says which); the NaN/inf pattern is compared exactly anyway.
"""
from __future__ import annotations

import math
import re
from typing import Dict, List, Tuple, Union

import numpy as np

#: Largest error of each elementary function, in float32 ulps of its result against the exact value
#: at the float32 input, per CPU path.  IEEE operations (+ - * /, sqrt) round to nearest: 0.5.
#: ``recip`` is sigmoid's 1 / d: a division on the portable path; on the AVX-512 one vrcp14ps (relative
#: error 2^-14) refined by one Newton step r (2 - d r) (2^-28, plus the rounding of the fused 2 - d r,
#: at most 2^-24 relative, and of the product, half an ulp: 1.5 ulps) (sigmoid is 1 / (1 + exp(-x)) as MXNet writes it, so that it is exactly 0 where
#: exp(-x) overflows; a bound of sigmoid in ulps of its result would not hold there).
ELEMENTARY_ULPS: Dict[str, Dict[str, float]] = {
    # measured over test_elementary_functions_within_their_bounds' sweep (every 4096th float32 and
    # 150k points near 0 and the branch points), the largest error in ulps of the exact result:
    #   portable  exp 1.002  tanh 1.27  erf 2.39  log 0.76  log1p 0.81  expm1 0.77
    #   avx512    exp 0.835  tanh 1.50  erf 2.39  (the others are the portable loops)
    # each bound is the next half ulp above, with half an ulp to spare for points the sweep misses
    "portable": {"exp": 1.5, "log": 1.0, "log1p": 1.5, "expm1": 1.0, "pow": 1.0,
                 "tanh": 2.0, "erf": 3.0, "recip": 0.5},
    "avx512": {"exp": 1.5, "log": 1.0, "log1p": 1.5, "expm1": 1.0, "pow": 1.0,
               "tanh": 2.0, "erf": 3.0, "recip": 1.5},
}
PATHS = tuple(ELEMENTARY_ULPS)

FLT_MAX = float(np.finfo(np.float32).max)
_EPS64 = float(np.finfo(np.float64).eps)


# ---- the expression language (fused_elemwise's README) ------------------------------------------

Expr = Union[Tuple[str, list], int, float]      # (function, args) | input index | number


def parse(text: str) -> Expr:
    tokens = re.findall(r"[A-Za-z_][A-Za-z_0-9]*|-?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)|[(),]",
                        text)
    pos = 0

    def expr() -> Expr:
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok in ("inf", "-inf", "nan"):
            return float(np.float32(tok))
        if re.fullmatch(r"x\d+", tok):
            return int(tok[1:])
        if re.fullmatch(r"[A-Za-z_][A-Za-z_0-9]*", tok):
            assert tokens[pos] == "(", text
            pos += 1
            args = [expr()]
            while tokens[pos] == ",":
                pos += 1
                args.append(expr())
            assert tokens[pos] == ")", text
            pos += 1
            return (tok, args)
        return float(np.float32(float(tok)))      # numbers are float32, as the op reads them

    out = expr()
    assert pos == len(tokens), text
    return out


# ---- intervals --------------------------------------------------------------------------------------

class Interval:
    """Elementwise [lo, hi] in float64; an endpoint of NaN or an empty interval means unbounded."""

    def __init__(self, lo, hi=None):
        self.lo = np.asarray(lo, np.float64)
        self.hi = np.asarray(self.lo if hi is None else hi, np.float64)

    @property
    def point(self) -> np.ndarray:
        return self.lo == self.hi


def _ulp32(v: np.ndarray) -> np.ndarray:
    """The spacing of float32 numbers at |v| (0 at ±inf, where nothing rounds)."""
    a = np.abs(v)
    finite = np.isfinite(a) & (a <= FLT_MAX)
    with np.errstate(over="ignore", invalid="ignore"):
        sp = np.spacing(np.where(finite, a, 1.0).astype(np.float32)).astype(np.float64)
    return np.where(finite, sp, 0.0)


def _rounded(lo, hi, ulps: float, scale=None) -> Interval:
    """[lo, hi] widened by ``ulps`` float32 ulps at each end (and by float64's own rounding of the
    endpoints, relative to ``scale``, the operands' size); past FLT_MAX a float32 result overflows."""
    lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
    slack = 0.0 if scale is None else 8 * _EPS64 * np.abs(scale)
    with np.errstate(invalid="ignore", over="ignore"):
        lo2 = lo - ulps * np.maximum(_ulp32(lo), _ulp32(hi)) - slack
        hi2 = hi + ulps * np.maximum(_ulp32(lo), _ulp32(hi)) + slack
    hi2 = np.where(hi > FLT_MAX, np.inf, hi2)
    lo2 = np.where(lo < -FLT_MAX, -np.inf, lo2)
    # an overflow at one end: the float32 result may be FLT_MAX or inf
    lo2 = np.where((lo > FLT_MAX) & np.isfinite(lo), FLT_MAX, lo2)
    hi2 = np.where((hi < -FLT_MAX) & np.isfinite(hi), -FLT_MAX, hi2)
    return Interval(lo2, hi2)


def _hull(a: Interval, b: Interval) -> Interval:
    return Interval(np.minimum(a.lo, b.lo), np.maximum(a.hi, b.hi))


def _select(cond_true, cond_false, a: Interval, b: Interval) -> Interval:
    """a where cond_true, b where cond_false, their hull elsewhere (the errors could go either way)."""
    h = _hull(a, b)
    lo = np.where(cond_true, a.lo, np.where(cond_false, b.lo, h.lo))
    hi = np.where(cond_true, a.hi, np.where(cond_false, b.hi, h.hi))
    return Interval(lo, hi)


def _unbounded_where(mask, iv: Interval) -> Interval:
    return Interval(np.where(mask, np.nan, iv.lo), np.where(mask, np.nan, iv.hi))


def _monotone(f, x: Interval, ulps: float, increasing: bool = True) -> Interval:
    with np.errstate(all="ignore"):
        a, b = f(x.lo), f(x.hi)
    return _rounded(a, b, ulps) if increasing else _rounded(b, a, ulps)


def _corners(f, a: Interval, b: Interval, ulps: float, scale=None) -> Interval:
    with np.errstate(all="ignore"):
        cs = np.stack([f(a.lo, b.lo), f(a.lo, b.hi), f(a.hi, b.lo), f(a.hi, b.hi)])
    bad = np.isnan(cs).any(axis=0)
    out = _rounded(cs.min(axis=0), cs.max(axis=0), ulps, scale)
    return _unbounded_where(bad, out)


def _add(a: Interval, b: Interval) -> Interval:
    with np.errstate(all="ignore"):
        return _rounded(a.lo + b.lo, a.hi + b.hi, 0.5,
                        np.maximum(np.maximum(abs(a.lo), abs(a.hi)), np.maximum(abs(b.lo), abs(b.hi))))


def _neg(a: Interval) -> Interval:
    return Interval(-a.hi, -a.lo)


def _mul(a: Interval, b: Interval) -> Interval:
    return _corners(np.multiply, a, b, 0.5)


def _div(a: Interval, b: Interval) -> Interval:
    out = _corners(np.divide, a, b, 0.5)
    return _unbounded_where((b.lo <= 0) & (b.hi >= 0) & ~((b.lo == 0) & (b.hi == 0) & a.point), out)


def _abs(a: Interval) -> Interval:
    lo = np.where(a.lo >= 0, a.lo, np.where(a.hi <= 0, -a.hi, 0.0))
    return Interval(lo, np.maximum(abs(a.lo), abs(a.hi)))


def _square(a: Interval) -> Interval:
    m = _abs(a)
    with np.errstate(over="ignore"):
        return _rounded(m.lo * m.lo, m.hi * m.hi, 0.5)


def _const(v: float, like: np.ndarray) -> Interval:
    return Interval(np.full(like.shape, v, np.float64))


_VERF = np.frompyfunc(math.erf, 1, 1)


def _erf(v):
    return _VERF(v).astype(np.float64)


def _sigmoid(x: Interval, E) -> Interval:
    """1 / (1 + exp(-x)), step by step (exp(-x) overflows to inf for x < -88.72: the result is 0)."""
    d = _add(_const(1.0, x.lo), _monotone(np.exp, _neg(x), E["exp"]))
    with np.errstate(divide="ignore"):
        return _rounded(1.0 / d.hi, 1.0 / d.lo, E["recip"])


def _softrelu(x: Interval, E) -> Interval:
    """MXNet's softrelu: x > 20 ? x : log1p(exp(x))."""
    inner = _monotone(np.log1p, _monotone(np.exp, x, E["exp"]), E["log1p"])
    return _select(x.lo > 20, x.hi <= 20, x, inner)


def _gelu(x: Interval, E) -> Interval:
    """0.5 x (1 + erf(x / sqrt 2)), in float32 step by step: x / float32(sqrt 2) (or x times
    float32(1 / sqrt 2)) is within 1 ulp of x / sqrt 2 (the constant's own rounding is at most
    half an ulp), 0.5 x is exact but in the subnormal range, then the sum and the product."""
    t = _rounded(x.lo / math.sqrt(2.0), x.hi / math.sqrt(2.0), 1.0)
    s = _add(_const(1.0, x.lo), _monotone(_erf, t, E["erf"]))
    h = _rounded(0.5 * x.lo, 0.5 * x.hi, 0.5)
    return _mul(h, s)


def _tanh(x: Interval, E) -> Interval:
    return _monotone(np.tanh, x, E["tanh"])


def _compare(kind: str, a: Interval, b: Interval) -> Interval:
    """1.0 / 0.0 where the errors cannot flip the comparison, [0, 1] where they can."""
    if kind in ("lt", "gt"):
        if kind == "gt":
            a, b = b, a
        true, false = a.hi < b.lo, a.lo >= b.hi
    elif kind in ("le", "ge"):
        if kind == "ge":
            a, b = b, a
        true, false = a.hi <= b.lo, a.lo > b.hi
    else:
        same = a.point & b.point & (a.lo == b.lo)
        apart = (a.hi < b.lo) | (b.hi < a.lo)
        true, false = (same, apart) if kind == "eq" else (apart, same)
    return Interval(np.where(true, 1.0, 0.0), np.where(false, 0.0, 1.0))


def _eval(e: Expr, xs: List[np.ndarray], E: Dict[str, float]) -> Interval:
    like = xs[0]
    if isinstance(e, int):
        return Interval(xs[e].astype(np.float64))
    if isinstance(e, float):
        return _const(e, like)
    name, args = e
    v = [_eval(a, xs, E) for a in args]
    if name == "neg":
        return _neg(v[0])
    if name == "abs":
        return _abs(v[0])
    if name == "square":
        return _square(v[0])
    if name in ("exp", "log", "log1p", "expm1"):
        return _monotone(getattr(np, name), v[0], E[name])
    if name == "sqrt":
        return _monotone(np.sqrt, v[0], 0.5)
    if name == "rsqrt":                       # 1 / sqrt(x): two IEEE roundings
        return _div(_const(1.0, like), _monotone(np.sqrt, v[0], 0.5))
    if name == "tanh":
        return _tanh(v[0], E)
    if name == "sigmoid":
        return _sigmoid(v[0], E)
    if name == "erf":
        return _monotone(_erf, v[0], E["erf"])
    if name in ("relu", "act_relu"):
        return Interval(np.maximum(v[0].lo, 0.0), np.maximum(v[0].hi, 0.0))
    if name == "softrelu":
        return _softrelu(v[0], E)
    if name == "softsign":                    # x / (1 + |x|)
        return _div(v[0], _add(_const(1.0, like), _abs(v[0])))
    if name == "log_sigmoid":                 # -softrelu(-x)
        return _neg(_softrelu(_neg(v[0]), E))
    if name == "mish":                        # x tanh(softrelu(x))
        return _mul(v[0], _tanh(_softrelu(v[0], E), E))
    if name == "gelu":
        return _gelu(v[0], E)
    if name == "add":
        return _add(v[0], v[1])
    if name == "sub":
        return _add(v[0], _neg(v[1]))
    if name == "mul":
        return _mul(v[0], v[1])
    if name == "div":
        return _div(v[0], v[1])
    if name == "pow":
        a, b = v
        out = _corners(np.power, a, b, E["pow"])
        exact = a.point & b.point
        with np.errstate(all="ignore"):
            p = np.power(a.lo, b.lo)
        pe = _rounded(p, p, E["pow"])
        lo = np.where(exact, pe.lo, out.lo)
        hi = np.where(exact, pe.hi, out.hi)
        return _unbounded_where(~exact & (a.lo <= 0), Interval(lo, hi))
    if name == "max":
        return Interval(np.maximum(v[0].lo, v[1].lo), np.maximum(v[0].hi, v[1].hi))
    if name == "min":
        return Interval(np.minimum(v[0].lo, v[1].lo), np.minimum(v[0].hi, v[1].hi))
    if name in ("lt", "le", "gt", "ge", "eq", "ne"):
        return _compare(name, v[0], v[1])
    if name == "leaky":                       # x > 0 ? x : x * slope
        x, s = v
        return _select(x.lo > 0, x.hi <= 0, x, _mul(x, s))
    if name == "where":                       # c != 0 ? a : b
        c, a, b = v
        return _select((c.lo > 0) | (c.hi < 0), (c.lo == 0) & (c.hi == 0), a, b)
    if name == "clip":                        # monotone in x, lo and hi while lo <= hi
        x, lo, hi = v
        out = Interval(np.minimum(np.maximum(x.lo, lo.lo), hi.lo), np.minimum(np.maximum(x.hi, lo.hi), hi.hi))
        exact = x.point & lo.point & hi.point
        xv, lv, hv = x.lo, lo.lo, hi.lo
        e = np.where(xv > hv, hv, np.where(xv < lv, lv, xv))
        out = Interval(np.where(exact, e, out.lo), np.where(exact, e, out.hi))
        return _unbounded_where(~exact & (lo.hi > hi.lo), out)
    if name == "hard_sigmoid":                # r = alpha x + beta (two roundings), clamped to [0, 1]
        x, alpha, beta = v
        r = _add(_mul(alpha, x), beta)
        return Interval(np.clip(r.lo, 0.0, 1.0), np.clip(r.hi, 0.0, 1.0))
    raise KeyError("no bound for function %r" % name)


def bounds(expr: str, xs: List[np.ndarray], path: str) -> Interval:
    """The interval each element of ``expr`` over the float32 inputs ``xs`` (same shape) lies in, on
    CPU path ``path`` ('portable' or 'avx512')."""
    return _eval(parse(expr), [np.asarray(x, np.float32) for x in xs], ELEMENTARY_ULPS[path])


def bounded(iv: Interval) -> np.ndarray:
    """The elements whose interval is a finite, non-empty range."""
    return np.isfinite(iv.lo) & np.isfinite(iv.hi) & (iv.lo <= iv.hi)


def outside(got: np.ndarray, iv: Interval) -> np.ndarray:
    """Bounded elements of ``got`` (finite) that lie outside their interval."""
    g = np.asarray(got, np.float64)
    ok = bounded(iv) & np.isfinite(g)
    return ok & ((g < iv.lo) | (g > iv.hi))
