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
    if act == "relu":
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
