"""NumPy references shared by the CPU op tests and the CUDA tests (float64, MXNet's
semantics).  No MXNet import: the CUDA tests run on GPU machines without MXNet."""
import math

import numpy as np

_erf = np.vectorize(math.erf)


def _f32_add(s, m):
    with np.errstate(invalid="ignore", over="ignore"):
        return (s.astype(np.float32) + np.float32(m) if np.isscalar(m) else
                s.astype(np.float32) + np.asarray(m, np.float32)).astype(np.float64)


def ref_attention(q, k, v, scale, mask=None, mask_kind="none", causal=False, mask_value=-1e18,
                  causal_mode="exclude"):
    """NumPy reference on plain (N,Sq,D) inputs, float64, MXNet softmax semantics.

    causal_mode "exclude" drops the keys after each query's band (j > i + Sk - Sq) like
    softmax lengths (a row with none left gives 0); "add" adds mask_value to their scores,
    "fill" replaces their scores by mask_value (the additive and where() masks of a graph).
    """
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    N, Sq, _ = q.shape
    Sk = k.shape[1]
    s = np.einsum("nqd,nkd->nqk", q, k) * scale
    keep = np.ones((N, Sq, Sk), bool)
    if mask_kind == "additive":     # the sum rounded to float32, as MXNet adds: s - 1e9 loses s
        s = _f32_add(s, np.broadcast_to(mask, s.shape))
    elif mask_kind == "boolean":
        s = np.where(np.broadcast_to(mask, s.shape) != 0, s, mask_value)
    elif mask_kind == "valid_length":
        L = mask.astype(np.int64)
        L = L[:, :, None] if L.ndim == 2 else L[:, None, None]
        keep &= np.arange(Sk)[None, None, :] < L
    if causal:
        band = np.arange(Sk)[None, None, :] <= np.arange(Sq)[None, :, None] + (Sk - Sq)
        if causal_mode == "add":
            s = np.where(band, s, _f32_add(s, mask_value))
        elif causal_mode == "fill":
            s = np.where(band, s, mask_value)
        else:
            keep &= band
    with np.errstate(invalid="ignore", over="ignore"):
        sm = np.where(keep, s, -np.inf)
        mx_ = sm.max(-1, keepdims=True)
        e = np.where(keep, np.exp(sm - mx_), 0.0)
        den = e.sum(-1, keepdims=True)
        p = np.where(keep.any(-1, keepdims=True), e / den, 0.0)
    return np.einsum("nqk,nkd->nqd", p, v)


def np_act(z, act, slope=0.25):
    if act in ("relu", "act_relu"):   # equal on numbers; NaN: see tests/kernels/test_dense_ln_semantics.py
        return np.maximum(z, 0)
    if act == "sigmoid":
        return 1 / (1 + np.exp(-z))
    if act == "tanh":
        return np.tanh(z)
    if act == "softrelu":
        return np.where(z > 20, z, np.log1p(np.exp(np.minimum(z, 20))))
    if act == "leaky":
        return np.where(z > 0, z, slope * z)
    if act == "gelu_erf":
        return 0.5 * z * (1 + _erf(z / np.sqrt(2)))
    if act == "gelu_tanh":
        return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
    return z


# ------------------------------------------------------------------ fused_elemwise semantics
# MXNet's own (mshadow) semantics of each fused_elemwise function in NumPy, NaN, inf and the
# sign of zero included: the CUDA kernels follow them (the GPU has no oneDNN), and so does
# the CPU op at rank >= 6.  EXACT functions are IEEE-exact in float32 here (bitwise
# comparisons); the others are computed in float64 (compare within a few ulps).

def _f32(f):
    def g(*a):
        with np.errstate(all="ignore"):
            return np.asarray(f(*[np.asarray(x, np.float32) for x in a]), np.float32)
    return g


def _f64(f):
    def g(*a):
        with np.errstate(all="ignore"):
            return np.asarray(f(*[np.asarray(x, np.float32).astype(np.float64) for x in a])).astype(np.float32)
    return g


def _sigmoid64(x):
    e = np.exp(-x).astype(np.float32).astype(np.float64)   # expf overflows to inf below -88.72
    return 1.0 / (1.0 + e)


def _max(a, b):
    return np.where(np.isnan(a) | (a > b), a, b)


def _min(a, b):
    return np.where(np.isnan(a) | (a < b), a, b)


def _relu(a):
    return np.where(np.isnan(a) | (a > 0), a, np.float32(0))


def _clip(x, lo, hi):
    return np.where(x > hi, hi, np.where(x < lo, lo, x))


def _hard_sigmoid(x, al, be):
    r = al * x + be          # float32: the product and the sum rounded separately
    r = np.where(np.float32(1) < r, np.float32(1), r)
    return np.where(np.float32(0) > r, np.float32(0), r)


ELEMWISE_EXACT = {
    "neg": _f32(np.negative), "abs": _f32(np.abs), "sqrt": _f32(np.sqrt),
    "rsqrt": _f32(lambda a: np.float32(1) / np.sqrt(a)), "square": _f32(lambda a: a * a),
    "relu": _f32(_relu), "act_relu": _f32(_relu),
    "softsign": _f32(lambda a: a / (np.float32(1) + np.abs(a))),
    "add": _f32(np.add), "sub": _f32(np.subtract), "mul": _f32(np.multiply), "div": _f32(np.divide),
    "max": _f32(_max), "min": _f32(_min),
    "lt": _f32(lambda a, b: (a < b).astype(np.float32)), "le": _f32(lambda a, b: (a <= b).astype(np.float32)),
    "gt": _f32(lambda a, b: (a > b).astype(np.float32)), "ge": _f32(lambda a, b: (a >= b).astype(np.float32)),
    "eq": _f32(lambda a, b: (a == b).astype(np.float32)), "ne": _f32(lambda a, b: (a != b).astype(np.float32)),
    "leaky": _f32(lambda a, s: np.where(a > 0, a, a * s)),
    "where": _f32(lambda c, a, b: np.where(c != 0, a, b)),
    "clip": _f32(_clip), "hard_sigmoid": _f32(_hard_sigmoid),
}
ELEMWISE_APPROX = {
    "exp": _f64(np.exp), "log": _f64(np.log), "tanh": _f64(np.tanh), "sigmoid": _f64(_sigmoid64),
    "erf": _f64(_erf), "log1p": _f64(np.log1p), "expm1": _f64(np.expm1), "pow": _f64(np.power),
    "softrelu": _f64(lambda a: np.where(a > 20, a, np.log1p(np.exp(np.minimum(a, 20))))),
    "gelu": _f64(lambda a: 0.5 * a * (1 + _erf(a / np.sqrt(2)))),
}
