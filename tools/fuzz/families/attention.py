"""attention / attention_heads / attention_interleaved(_encdec) / scores_shape.

Grammar::

    graph   := core3 | core4 | heads | packed | interleaved | encdec
    core    := q' = q | q·c | q/c | div_sqrt_dim(q)         (scalar ops, operators)
               s  = batch_dot(q', k, transpose_b=True) | batch_dot(q', kᵀ) | linalg_gemm2(q', k, transpose_b, alpha)
                  | near: batch_dot(qᵀ, k, transpose_a) | linalg_gemm2(…, axis=0) on (S, N, D)
               s  = s | s·c | s/c | s·t (1-element parameter: learnable temperature; or a data input: refused)
                  | div_sqrt_dim(s)
               s  = s | s + mask | where(cond, s, fill) | softmax lengths | causal mask from arange_like
               p  = softmax(s, axis=-1 | rank-1 | near: another axis, temperature) | log_softmax (near)
               p  = p | Dropout(p, p=0|0.1|0.5, mode=training|always)
               p  = p | identity(p)
               p  = p | squeeze(expand_dims(p)) | Reshape(Reshape(p, (-1, 1, 0, 0), reverse), (-1, 0, 0), reverse)
               o  = batch_dot(p, v) | linalg_gemm2(p, v) | near: alpha ≠ 1, v given transposed
    mask    := additive data input (0/−1e9, −inf, any values) of a shape broadcastable to the scores
               | additive parameter (a learned bias) | where(cond, s, ones_like(s)·c | zeros_like(s)+c),
               cond of the scores' shape, broadcast_like'd, or 1-D (selects batch rows in MXNet)
               | softmax(s, length, use_length=True), lengths 0…Sk (int32/float32/int64)
               | causal: positions from arange_like of q/k or of the scores, compared (≥, ≤, <, >,
                 shifted), as an additive (1−m)·−1e9 mask or where(m, s, fill); Sq ≤ Sk and Sq > Sk
               | GluonNLP's key-length mask: m = key positions (arange_like of k) < lengths (B,)
                 (broadcast_lesser | broadcast_greater swapped; float32 or int32 lengths), carried to
                 the scores (expand_dims, ones products, broadcast_like, broadcast_axis over heads),
                 where(m, s, fill) and the probabilities multiplied by m (either order, elemwise_mul |
                 broadcast_mul); its decoder form (i < length) · (j ≤ i) in self-attention;
                 near: query lengths, positions from 1, another mask multiplied, the band j < i;
                 or any mask m given as an input (GluonNLP's memory mask; 0/1 or any values, of the
                 scores' shape or broadcast_like'd) in the same where(m, s, fill) · m form
    heads   := x (B,S,E) → projections (FullyConnected or inputs; cross attention: memory (B,Sk,E'))
               → split chain (Reshape codes 0/-1/-2/-3/-4 | reverse, transpose, SwapAxis; 3-D or 4-D heads;
                  near: wrong head order, literal sizes) → core → merge chain → [output FullyConnected]
    packed  := FullyConnected(3E) → split | _split_v2 | slice_axis ×3 (maybe swapped) → heads as above
    interleaved := FC(3·H·D) on (S,B,E) → _contrib_interleaved_matmul_selfatt_qk → … → selfatt_valatt
    encdec  := q FC (Sq,B,E), kv FC (Sk,B,2E) → _contrib_interleaved_matmul_encdec_qk → … → encdec_valatt
"""
from __future__ import annotations

from typing import Tuple

from .pieces import I, S, scale


class Geo:
    """Shape templates of the attention operands: lead = (N,) or (B, H)."""

    def __init__(self, lead: Tuple, sq, sk, dh, dv):
        self.lead, self.sq, self.sk, self.dh, self.dv = tuple(lead), sq, sk, dh, dv

    @property
    def rank(self) -> int:
        return len(self.lead) + 2

    def scores(self):
        return self.lead + (self.sq, self.sk)


# ---------------------------------------------------------------------------- masks
def _causal_positions(b, q, k, s, geo: Geo, label: str):
    """(allowed (Sq, Sk) 0/1 float, exact?) built from arange_like of q/k or of the scores."""
    d = b.d
    src = d.choice(["qk", "scores"], [2, 3], label=label + " pos source")
    rank = geo.rank
    neg_axis = d.maybe(0.6, label=label + " negative axes")
    qa = -2 if neg_axis else rank - 2
    if src == "qk":
        qpos = S.contrib.arange_like(q, axis=qa)
        kpos = S.contrib.arange_like(k, axis=qa)
    else:
        qpos = S.contrib.arange_like(s, axis=qa)
        kpos = S.contrib.arange_like(s, axis=-1 if neg_axis else rank - 1)
    qpos = S.reshape(qpos, shape=(-1, 1))
    kpos = S.reshape(kpos, shape=(1, -1))
    offset = d.choice(["none", "exact", "wrong"], [4, 2, 1], label=label + " offset")
    if offset == "exact":
        off = b.fixed("Sk") - b.fixed("Sq") if "Sk" in b.dims and "Sq" in b.dims else 0
        if off:
            qpos = I._plus_scalar(qpos, scalar=float(off))
    elif offset == "wrong":
        qpos = I._plus_scalar(qpos, scalar=float(d.choice([1, -1, 2], label=label + " wrong offset")))
    cmp = d.choice(["ge", "le_rev", "lt_plus1", "gt", "le"], [4, 3, 1, 1, 1], label=label + " compare")
    if cmp == "ge":
        allowed = S.broadcast_greater_equal(qpos, kpos)
    elif cmp == "le_rev":
        allowed = S.broadcast_lesser_equal(kpos, qpos)
    elif cmp == "lt_plus1":
        allowed = S.broadcast_lesser(kpos, I._plus_scalar(qpos, scalar=1.0))
    elif cmp == "gt":        # strict: not causal (the diagonal is masked)
        allowed = S.broadcast_greater(qpos, kpos)
    else:                    # looks ahead: not causal
        allowed = S.broadcast_lesser_equal(qpos, kpos)
    return allowed


def _to_rank(b, m, rank: int, label: str):
    """A rank-2 mask made rank ``rank`` (expand_dims on the front) or left to broadcasting."""
    for _ in range(rank - 2):
        if b.d.maybe(0.7, label=label + " expand"):
            m = S.expand_dims(m, axis=0)
        else:
            return m, False
    return m, True


def _fill(b, s, label: str):
    d = b.d
    c = d.choice([-1e9, -1e18, -1e4, -10000.5, -100.0, 0.0, float("-inf")], [6, 1, 1, 1, 1, 1, 1], label=label + " fill")
    form = d.choice(["ones_mul", "zeros_add", "zeros_sub", "operator"], [4, 3, 1, 1], label=label + " fill form")
    if form == "ones_mul":
        return I._mul_scalar(S.ones_like(s), scalar=c)
    if form == "zeros_add":
        return I._plus_scalar(S.zeros_like(s), scalar=c)
    if form == "zeros_sub":
        return I._minus_scalar(S.zeros_like(s), scalar=-c)
    return S.ones_like(s) * c


def _mask_shape(b, geo: Geo, label: str):
    d = b.d
    sc = geo.scores()
    if geo.rank == 3:
        n = sc[0]
        opts = [(n, 1, geo.sk), sc, (1, geo.sq, geo.sk), (1, 1, geo.sk), (geo.sk,), (geo.sq, geo.sk), (n, geo.sq, 1)]
        w = [4, 3, 2, 2, 1, 1, 1]
    else:
        bb, h = sc[0], sc[1]
        opts = [(bb, 1, 1, geo.sk), sc, (1, h, geo.sq, geo.sk), (1, 1, geo.sq, geo.sk), (bb, 1, geo.sq, geo.sk),
                (1, geo.sk), (geo.sk,)]
        w = [4, 3, 1, 1, 1, 1, 1]
    return d.choice(opts, w, label=label + " shape")


def _key_length_mask(b, s, q, k, geo: Geo, label: str, near: str):
    """GluonNLP's mask of the keys before each batch element's length, of the scores' shape."""
    d = b.d
    rank = geo.rank
    int_len = d.maybe(0.3, label=label + " int lengths")
    lead = geo.lead[:1]
    heads = None
    if rank == 3 and isinstance(lead[0], str) and lead[0].startswith("B*") and d.maybe(0.6, label=label + " per batch"):
        heads = int(lead[0][2:])            # GluonNLP: (B,) lengths, the mask repeated over the heads
        lead = ("B",)
    ln = b.input("vlen", lead, kind="len", dtype="int32" if int_len else "float32", lo=0, hi=geo.sk)
    axis = -2 if d.maybe(0.5, label=label + " neg axis") else rank - 2
    pos = S.contrib.arange_like(k, axis=axis, start=1.0) if near == "start1" else S.contrib.arange_like(k, axis=axis)
    if int_len:
        pos = S.Cast(pos, dtype="int32")
    pos, lr = S.reshape(pos, shape=(1, -1)), S.reshape(ln, shape=(-1, 1))
    m = S.broadcast_lesser(pos, lr) if d.maybe(0.6, label=label + " lesser") else S.broadcast_greater(lr, pos)
    if int_len:
        m = S.Cast(m, dtype="float32")
    if near == "query":                     # lengths along the queries (positions of k read as rows)
        m = S.expand_dims(m, axis=2)        # (N, Sk→rows, 1): not a key mask
    elif near in ("decoder", "decoder_strict"):   # GluonNLP's decoder: (i < length) · (j ≤ i) (strict: j < i)
        p0 = S.contrib.arange_like(k, axis=axis)
        band = (S.broadcast_lesser if near == "decoder_strict" else S.broadcast_lesser_equal)(
            S.reshape(p0, shape=(1, -1)), S.reshape(p0, shape=(-1, 1)))
        m = S.broadcast_mul(S.expand_dims(m, axis=2), S.expand_dims(band, axis=0))
    else:
        m = S.expand_dims(m, axis=1)        # (lead0, 1, Sk)
    if rank == 4:
        m = S.expand_dims(m, axis=1)        # (B, 1, 1, Sk)
    elif heads is not None:                 # (B, 1, Sk) → (B·H, 1, Sk), n = b·H + h
        m = S.broadcast_axis(S.expand_dims(m, axis=1), axis=1, size=heads)
        m = S.reshape(m, shape=(-1, 0, 0), reverse=True)
    how = d.choice(["broadcast_like", "ones"], label=label + " carry")
    if how == "ones" and near not in ("query", "decoder", "decoder_strict") and geo.sq == geo.sk:     # GluonNLP's encoder: ones of the keys
        ones = S.ones_like(S.contrib.arange_like(k, axis=axis))
        m = S.broadcast_mul(m, S.broadcast_mul(ones, S.reshape(ones, shape=(-1, 1))))   # (…, Sk, Sk)
    return S.broadcast_like(m, s)


def apply_mask(b, s, q, k, geo: Geo, label: str = "mask"):
    """Returns (masked scores, lengths or None, the mask the probabilities are multiplied by or None)."""
    d = b.d
    kind = d.choice(["none", "additive", "param_bias", "where", "where_1d", "length", "causal_add", "causal_where",
                     "data_gate_causal", "key_length"], [5, 5, 1, 3, 1, 3, 4, 2, 1, 3], label=label)
    if kind == "key_length":
        selfatt = geo.sq == geo.sk
        near = d.choice(["none", "query", "start1", "other", "decoder", "decoder_strict", "input"],
                        [8, 1 if selfatt else 0, 1, 1, 3 if selfatt else 0, 1 if selfatt else 0, 3],
                        label=label + " kl near")
        if near == "input":             # any mask, an input of the graph (GluonNLP's memory mask)
            vk = d.choice(["mask01", "rowmask01", "normal"], [4, 1, 1], label=label + " input mask values")
            if d.maybe(0.3, label=label + " input mask broadcast_like"):
                m = S.broadcast_like(b.input("cond", geo.scores()[:1] + (1,) * (geo.rank - 2) + (geo.sk,), kind=vk), s)
            else:
                m = b.input("cond", geo.scores(), kind=vk)
            return S.where(m, s, _fill(b, s, label)), None, m
        m = _key_length_mask(b, s, q, k, geo, label, near)
        post = m if near != "other" else S.broadcast_like(b.input("cond", geo.scores(), kind="mask01"), s)
        return S.where(m, s, _fill(b, s, label)), None, post
    s, length = _apply_mask(b, s, q, k, geo, label, kind)
    return s, length, None


def _apply_mask(b, s, q, k, geo: Geo, label: str, kind: str):
    d = b.d
    if kind == "none":
        return s, None
    if kind == "additive":
        vk = d.choice(["addmask", "normal", "neginf", "rowmask"], [5, 2, 1, 2], label=label + " values")
        m = b.input("mask", _mask_shape(b, geo, label), kind=vk)
        if d.maybe(0.15, label=label + " broadcast_like"):
            shape = _mask_shape(b, geo, label + " bl")
            if len(shape) == geo.rank:
                m = S.broadcast_like(b.input("mask", shape, kind=vk), s)
        return (S.broadcast_add(s, m) if d.maybe(0.8, label=label + " bcast") else S.broadcast_add(m, s)), None
    if kind == "param_bias":
        shape = d.choice([(1, geo.sq, geo.sk), geo.scores()[1:] if geo.rank == 4 else (geo.sq, geo.sk)],
                         label=label + " bias shape")
        return S.broadcast_add(s, b.param("attn_bias", shape, kind="normal")), None
    if kind == "where":
        fill = _fill(b, s, label)
        ck = d.choice(["mask01", "rowmask01"], [3, 1], label=label + " cond values")
        if d.maybe(0.5, label=label + " full cond"):
            cond = b.input("cond", geo.scores(), kind=ck)
        else:
            shape = _mask_shape(b, geo, label)
            if len(shape) != geo.rank:
                shape = geo.scores()[:1] + (1,) * (geo.rank - 2) + (geo.sk,)
            cond = S.broadcast_like(b.input("cond", shape, kind=ck), s)
        return S.where(cond, s, fill), None
    if kind == "where_1d":          # MXNet: a 1-D condition selects whole rows of axis 0
        cond = b.input("cond", geo.scores()[:1], kind="mask01")
        return S.where(cond, s, _fill(b, s, label)), None
    if kind == "length":
        dtype = d.choice(["int32", "int64"], [3, 1], label=label + " len dtype")     # MXNet refuses float lengths
        lo = d.choice([0, 1], label=label + " len lo")
        ln = b.input("len", geo.lead + (geo.sq,), kind="len", dtype=dtype, lo=lo, hi=geo.sk)
        return s, ln
    if kind in ("causal_add", "causal_where", "data_gate_causal"):
        allowed = _causal_positions(b, q, k, s, geo, label)
        if kind == "data_gate_causal":     # depends on the data: never causal
            gate = b.input("gate", (3,))
            allowed = S.broadcast_mul(allowed, S.reshape(S.sum(gate) > 0, shape=(1, 1)))
        if kind == "causal_where":
            m, full_rank = _to_rank(b, allowed, geo.rank, label)
            if not full_rank:
                m = allowed
                for _ in range(geo.rank - 2):
                    m = S.expand_dims(m, axis=0)
            return S.where(S.broadcast_like(m, s), s, _fill(b, s, label)), None
        form = d.choice(["rminus", "minus_mul", "where_add"], [4, 2, 1], label=label + " additive form")
        if form == "rminus":
            add = I._mul_scalar(I._rminus_scalar(allowed, scalar=1.0), scalar=d.choice([-1e9, -1e4, -1e30], label=label + " big"))
        elif form == "minus_mul":
            add = (allowed - 1.0) * 1e9
        else:
            add = S.where(allowed, S.zeros_like(allowed), S.ones_like(allowed) * -1e9)
        add, _ = _to_rank(b, add, geo.rank, label)
        return S.broadcast_add(s, add), None
    raise AssertionError(kind)


# ---------------------------------------------------------------------------- the core
def core(b, q, k, v, geo: Geo, label: str = "core", k_transposed=None):
    """scores → [scale] → [mask] → softmax → [Dropout] → value product.  ``k_transposed``: kᵀ if available."""
    d = b.d
    rank = geo.rank
    if d.maybe(0.25, label=label + " q scale"):
        if d.maybe(0.2, label=label + " q div_sqrt_dim"):      # GluonNLP's DotProductAttentionCell
            q = S.contrib.div_sqrt_dim(q)
        else:
            q = scale(b, q, d.choice([0.5, 0.125, 0.35355339, 2.0], label=label + " q c"), label=label + " q scale")
    form = d.choice(["bd", "bd_kt", "gemm", "gemm_kt", "bd_ta"], [6, 2, 3, 1, 1], label=label + " qk form")
    if form in ("bd_kt", "gemm_kt"):
        kt = k_transposed if k_transposed is not None else S.swapaxes(k, dim1=rank - 2, dim2=rank - 1)
        s = S.batch_dot(q, kt) if form == "bd_kt" else S.linalg.gemm2(q, kt)
    elif form == "bd":
        s = S.batch_dot(q, k, transpose_b=True)
    elif form == "gemm":
        alpha = d.choice([1.0, 0.5, 0.125], label=label + " alpha")
        s = S.linalg.gemm2(q, k, transpose_b=True, alpha=alpha) if alpha != 1.0 or d.maybe(0.5, label=label + " explicit alpha") \
            else S.linalg.gemm2(q, k, transpose_b=True)
    else:       # q given transposed: not the pattern
        s = S.batch_dot(S.swapaxes(q, dim1=rank - 2, dim2=rank - 1), k, transpose_a=True, transpose_b=True)
    sc = d.choice(["none", "scalar", "param", "data", "div_sqrt_dim", "both"], [4, 5, 2, 1, 1, 1], label=label + " s scale")
    if sc in ("scalar", "both"):
        s = scale(b, s, d.choice([0.5, 0.125, 0.35355339, 2.0], label=label + " s c"), allow_param=False,
                  label=label + " s scale")
    if sc in ("param", "both"):        # a learnable temperature
        shape = d.choice([(1,), (1, 1, 1)], label=label + " temp shape")
        t = b.param("temperature", shape, value=[d.choice([0.5, 0.25, 2.0], label=label + " t value")])
        s = S.broadcast_mul(s, t) if d.maybe(0.6, label=label + " temp mul") else S.broadcast_div(s, t)
    elif sc == "data":
        s = S.broadcast_mul(s, b.input("tscale", (1,), kind="pos"))
    elif sc == "div_sqrt_dim":
        s = S.contrib.div_sqrt_dim(s)
    s, length, post = apply_mask(b, s, q, k, geo, label + " mask")
    ax = d.choice(["default", "-1", "last_pos", "query", "head"], [5, 2, 2, 1, 1 if rank == 4 else 0],
                  label=label + " softmax axis")
    kw = {}
    if ax == "-1":
        kw["axis"] = -1
    elif ax == "last_pos":
        kw["axis"] = rank - 1
    elif ax == "query":
        kw["axis"] = d.choice([-2, rank - 2], label=label + " query axis")
    elif ax == "head":
        kw["axis"] = 1
    temp = d.choice([None, 1.0, 0.5, 2.0], [8, 1, 1, 1], label=label + " temperature")
    if temp is not None:
        kw["temperature"] = temp
    if length is not None:
        if "axis" in kw and kw["axis"] not in (-1, rank - 1):
            kw["axis"] = -1
        p = S.softmax(s, length, use_length=True, **kw)
    elif d.maybe(0.04, label=label + " log_softmax"):
        p = S.log_softmax(s, **kw)
    else:
        p = S.softmax(s, **kw)
    if post is not None:                   # GluonNLP: the probabilities multiplied by the mask
        mul = S.elemwise_mul if d.maybe(0.6, label=label + " post elemwise") else S.broadcast_mul
        p = mul(p, post) if d.maybe(0.6, label=label + " post order") else mul(post, p)
    if d.maybe(0.3, label=label + " dropout"):
        prob = d.choice([0.1, 0.0, 0.5], label=label + " dropout p")
        mode = d.choice(["training", "always"], [5, 1], label=label + " dropout mode")
        if mode == "always":
            p = S.Dropout(p, p=prob, mode="always")
            if prob > 0:
                b.flag("random")
        else:
            p = S.Dropout(p, p=prob)
            if prob > 0:
                b.flag("random_train")
    if d.maybe(0.1, label=label + " p identity"):             # Gluon's Dropout(0.0)
        p = S.identity(p)
    view = d.choice(["none", "expand_squeeze", "reverse_pair"], [8, 1, 1 if rank == 3 else 0], label=label + " p view")
    if view == "expand_squeeze":        # a view of p that gives its shape back
        p = S.squeeze(S.expand_dims(p, axis=1), axis=1)
    elif view == "reverse_pair":        # GluonNLP: split (N, Sq, Sk) into (N/1, 1, Sq, Sk) and back
        p = S.reshape(S.reshape(p, shape=(-1, 1, 0, 0), reverse=True), shape=(-1, 0, 0), reverse=True)
    pv = d.choice(["bd", "gemm", "gemm_alpha", "bd_vt"], [6, 3, 1, 1], label=label + " pv form")
    if pv == "bd":
        return S.batch_dot(p, v)
    if pv == "gemm":
        return S.linalg.gemm2(p, v)
    if pv == "gemm_alpha":
        return S.linalg.gemm2(p, v, alpha=2.0)
    return S.batch_dot(p, S.swapaxes(v, dim1=rank - 2, dim2=rank - 1), transpose_b=True)


# ---------------------------------------------------------------------------- forms
def core3(b):
    d = b.d
    b.dim("N", [2, 1, 3, 4, 6], big=[2, 3])
    sq = b.dim("Sq", [4, 1, 3, 5, 7, 8], big=[33, 65, 130, 257, 9])
    same = d.maybe(0.5, label="self attention")
    if same:
        b.dims["Sk"] = sq
        b.alt["Sk"] = b.alt["Sq"]
        skn = "Sq"
    else:
        b.dim("Sk", [4, 1, 3, 5, 7, 8], big=[33, 65, 130, 257, 300])
        skn = "Sk"
    dh = b.size([4, 1, 2, 3, 5, 8], [64, 65, 33, 96, 17], label="head dim")
    dv = dh if d.maybe(0.7, label="dv = d") else b.size([3, 1, 6], [70, 64, 7], label="dv")
    geo = Geo(("N",), "Sq", skn, dh, dv)
    qk_kind = "large" if d.maybe(0.1, label="large scores") else "normal"
    if d.maybe(0.05, label="gemm2 axis=0 form"):       # (S, N, D) operands, matrices along axes 0 and 1
        q = b.input("q", ("Sq", "N", dh))
        k = b.input("k", ("Sq", "N", dh))
        vv = b.input("v", ("Sq", "N", dh))
        s = S.linalg.gemm2(q, k, transpose_b=True, axis=0)
        return [S.linalg.gemm2(S.softmax(s, axis=-1), vv, axis=0)]
    q = b.input("q", ("N", "Sq", dh), kind=qk_kind)
    kt = None
    if same and dv == dh and d.maybe(0.08, label="q = k = v"):      # one tensor in every role
        return [core(b, q, q, q, geo)]
    if d.maybe(0.15, label="k input transposed"):
        kt = b.input("kt", ("N", dh, skn), kind=qk_kind)
        k = S.swapaxes(kt, dim1=1, dim2=2)
    else:
        k = b.input("k", ("N", skn, dh), kind=qk_kind)
    v = b.input("v", ("N", skn, dv))
    if d.maybe(0.15, label="pre ops"):
        q = S.tanh(q)
    if d.maybe(0.06, label="float64"):           # not float32: the fused op must stay away
        q, k, v = (S.Cast(t, dtype="float64") for t in (q, k, v))
        b.float_dtype = "float64"
        y = core(b, q, k, v, geo)
        b.float_dtype = "float32"
        return [S.Cast(y, dtype="float32")]
    if d.maybe(0.08, label="two attentions on the same q, k, v"):
        return [core(b, q, k, v, geo, "core a"), core(b, q, k, v, geo, "core b")]
    return [core(b, q, k, v, geo, k_transposed=kt)]


def core4(b):
    d = b.d
    b.dim("B", [2, 1, 3])
    h = d.choice([2, 1, 3], label="heads")
    sq = b.dim("Sq", [4, 1, 3, 5, 7], big=[33, 65, 129])
    if d.maybe(0.6, label="self attention"):
        b.dims["Sk"], b.alt["Sk"], skn = sq, b.alt["Sq"], "Sq"
    else:
        b.dim("Sk", [4, 1, 3, 5, 7], big=[33, 64, 257])
        skn = "Sk"
    dh = b.size([4, 2, 3, 5], [64, 65, 33], label="head dim")
    geo = Geo(("B", h), "Sq", skn, dh, dh)
    q = b.input("q", ("B", h, "Sq", dh))
    k = b.input("k", ("B", h, skn, dh))
    v = b.input("v", ("B", h, skn, dh))
    return [core(b, q, k, v, geo)]


def split_heads(b, t, h: int, kind: str, transposed: bool = False):
    """(B, S, H·D) → (B·H, S, D) | (B, H, S, D); ``transposed``: keys as (B·H, D, S)."""
    if kind == "std":
        t = S.transpose(S.reshape(t, shape=(0, 0, h, -1)), axes=(0, 2, 3, 1) if transposed else (0, 2, 1, 3))
        return S.reshape(t, shape=(-3, 0, 0))
    if kind == "codes":
        t = S.reshape(t, shape=(0, 0, -4, h, -1))
        t = S.swapaxes(t, dim1=1, dim2=2)
        if transposed:
            t = S.swapaxes(t, dim1=2, dim2=3)
        return S.reshape(t, shape=(-1, 0, 0), reverse=True)
    if kind == "m2":
        t = S.transpose(S.reshape(t, shape=(0, 0, h, -1)), axes=(0, 2, 3, 1) if transposed else (0, 2, 1, 3))
        return S.reshape(t, shape=(-3, -2))
    if kind == "four":
        return S.transpose(S.reshape(t, shape=(0, 0, h, -1)), axes=(0, 2, 3, 1) if transposed else (0, 2, 1, 3))
    if kind == "literal":
        t = S.reshape(t, shape=(b.fixed("B"), -1, h, b.dims["_D"]))
        t = S.transpose(t, axes=(0, 2, 3, 1) if transposed else (0, 2, 1, 3))
        return S.reshape(t, shape=(-3, 0, 0))
    if kind == "expand":        # (B, S, H·D) with H = 1 written as expand_dims
        t = S.expand_dims(t, axis=1)
        if transposed:
            t = S.swapaxes(t, dim1=2, dim2=3)
        return S.reshape(t, shape=(-3, 0, 0))
    # "bad": heads taken from the wrong factor of the width
    t = S.transpose(S.reshape(t, shape=(0, 0, -1, h)), axes=(0, 3, 2, 1) if transposed else (0, 3, 1, 2))
    return S.reshape(t, shape=(-3, 0, 0))


def merge_heads(b, o, h: int, kind: str, four: bool):
    if four:
        t = S.transpose(o, axes=(0, 2, 1, 3)) if kind != "swap" else S.swapaxes(o, dim1=1, dim2=2)
        return S.reshape(t, shape=(0, 0, -3))
    if kind == "std":
        return S.reshape(S.transpose(S.reshape(o, shape=(-4, -1, h, 0, 0)), axes=(0, 2, 1, 3)), shape=(0, 0, -3))
    if kind == "codes":
        return S.reshape(S.swapaxes(S.reshape(o, shape=(-1, h, 0, 0), reverse=True), dim1=1, dim2=2), shape=(0, 0, -1))
    if kind == "swap":
        return S.reshape(S.swapaxes(S.reshape(o, shape=(-4, -1, h, -2)), dim1=1, dim2=2), shape=(0, 0, -3))
    # "bad": head-major merge (n = h·B + b): the merge of another split
    return S.reshape(S.transpose(S.reshape(o, shape=(-4, h, -1, 0, 0)), axes=(1, 2, 0, 3)), shape=(0, 0, -3))


def heads(b, packed: bool = False):
    d = b.d
    b.dim("B", [2, 1, 3])
    h = d.choice([2, 1, 3, 4], label="heads")
    dh = b.size([4, 2, 3, 1, 5], [64, 33, 65], label="head dim")
    b.dims["_D"] = dh
    b.pinned.add("_D")
    b.alt["_D"] = dh
    e = h * dh
    sq = b.dim("Sq", [5, 1, 3, 4, 7, 8], big=[33, 65, 130])
    cross = (not packed) and d.maybe(0.3, label="cross attention")
    if cross:
        b.dim("Sk", [7, 1, 3, 4, 5], big=[33, 257, 64])
        skn = "Sk"
    else:
        b.dims["Sk"], b.alt["Sk"], skn = sq, b.alt["Sq"], "Sq"
    fin = d.choice([e, 6, 4, 9], label="model width")
    x = b.input("x", ("B", "Sq", fin))
    mem = b.input("mem", ("B", "Sk", d.choice([fin, 5], label="memory width"))) if cross else x
    bias = lambda lbl: not d.maybe(0.25, label=lbl + " no_bias")
    fc = lambda t, n, lbl: (S.FullyConnected(t, num_hidden=n, flatten=False, name=b.name(lbl), no_bias=not bias(lbl)))
    split_kind = d.choice(["std", "codes", "m2", "four", "literal", "bad", "expand"], [5, 3, 1, 3, 1, 1, 1 if h == 1 else 0],
                          label="split chain")
    if split_kind == "literal":
        b.fixed("Sq")
    four = split_kind == "four"
    if packed:
        qkv = fc(x, 3 * e, "qkv")
        how = d.choice(["split", "split_v2", "slice_axis", "slice_axis_swapped", "split_swapped"], [3, 1, 3, 1, 1],
                       label="packed split")
        if how.startswith("split"):
            parts = S.split(qkv, num_outputs=3, axis=-1) if how != "split_v2" else S.split_v2(qkv, 3, axis=-1)
            parts = [parts[0], parts[1], parts[2]]
        else:
            parts = [S.slice_axis(qkv, axis=d.choice([-1, 2], label="slice axis"), begin=i * e,
                                  end=(i + 1) * e if (i < 2 or d.maybe(0.5, label="end given")) else None)
                     for i in range(3)]
        if how.endswith("swapped"):
            parts = [parts[1], parts[0], parts[2]]
        qp, kp, vp = parts
    else:
        # one shared value is self-attention: not with a memory (its keys would be Sq long while the
        # lengths drawn for them run to Sk, which MXNet's softmax reads past the row: heap corruption)
        direct = d.choice(["fc", "inputs", "shared"], [9, 2, 0 if cross else 1], label="projections")
        if direct == "shared":            # q, k and v the same value (not a packed projection)
            qp = kp = vp = fc(x, e, "qkv") if d.maybe(0.5, label="shared fc") else x
            if qp is x and fin != e:
                qp = kp = vp = fc(x, e, "qkv")
        elif direct == "inputs":
            qp = b.input("qp", ("B", "Sq", e))
            kp = b.input("kp", ("B", skn, e))
            vp = b.input("vp", ("B", skn, e))
        elif not cross and d.maybe(0.7, label="one bias choice for q, k, v"):   # as models write them
            nb = not bias("qkv")
            qp, kp, vp = (S.FullyConnected(x, num_hidden=e, flatten=False, name=b.name(n), no_bias=nb) for n in "qkv")
        else:
            qp, kp, vp = fc(x, e, "q"), fc(mem, e, "k"), fc(mem, e, "v")
    k_split = split_kind if d.maybe(0.85, label="same split for k") else d.choice(["std", "codes", "bad"], label="k split")
    if four:
        k_split = "four"
    q = split_heads(b, qp, h, split_kind)
    kt = None
    if d.maybe(0.15, label="keys split transposed"):
        kt = split_heads(b, kp, h, k_split, transposed=True)
        rank = 4 if four else 3
        k = S.swapaxes(kt, dim1=rank - 2, dim2=rank - 1)
    else:
        k = split_heads(b, kp, h, k_split)
    v = split_heads(b, vp, h, split_kind)
    geo = Geo(("B", h) if four else ("B*%d" % h,), "Sq", skn, dh, dh)
    o = core(b, q, k, v, geo, k_transposed=kt)
    merge_kind = d.choice(["std", "codes", "swap", "bad"], [5, 3, 2, 1], label="merge chain")
    y = merge_heads(b, o, h, merge_kind, four)
    if d.maybe(0.6, label="output projection"):
        y = fc(y, d.choice([e, 4], label="out width"), "o")
    return [y]


def interleaved(b):
    d = b.d
    b.dim("B", [2, 1, 3])
    sl = b.dim("Sq", [5, 1, 3, 4, 7], big=[33, 65, 130])
    b.dims["Sk"], b.alt["Sk"] = sl, b.alt["Sq"]
    h = d.choice([2, 1, 3], label="heads")
    dh = b.size([4, 2, 3, 1], [64, 33], label="head dim")
    e = h * dh
    x = b.input("x", ("Sq", "B", d.choice([6, e, 4], label="width")))
    qkv = S.FullyConnected(x, num_hidden=3 * e, flatten=False, name=b.name("qkv")) if d.maybe(0.8, label="projection") \
        else b.input("qkv", ("Sq", "B", 3 * e))
    s = S.contrib.interleaved_matmul_selfatt_qk(qkv, heads=h)
    geo = Geo(("B*%d" % h,), "Sq", "Sq", dh, dh)
    p = _probabilities(b, s, None, None, geo)
    return [S.contrib.interleaved_matmul_selfatt_valatt(qkv, p, heads=h)]


def encdec(b):
    d = b.d
    b.dim("B", [2, 1, 3])
    b.dim("Sq", [4, 1, 3, 5])
    b.dim("Sk", [5, 1, 3, 7])
    h = d.choice([2, 1, 3], label="heads")
    dh = d.choice([4, 2, 3], label="head dim")
    e = h * dh
    x = b.input("x", ("Sq", "B", d.choice([6, e], label="width")))
    mem = b.input("mem", ("Sk", "B", d.choice([5, e], label="mem width")))
    q = S.FullyConnected(x, num_hidden=e, flatten=False, name=b.name("q"))
    kv = S.FullyConnected(mem, num_hidden=2 * e, flatten=False, name=b.name("kv"))
    s = S.contrib.interleaved_matmul_encdec_qk(q, kv, heads=h)
    geo = Geo(("B*%d" % h,), "Sq", "Sk", dh, dh)
    p = _probabilities(b, s, None, None, geo)
    return [S.contrib.interleaved_matmul_encdec_valatt(kv, p, heads=h)]


def _probabilities(b, s, q, k, geo):
    """scale → mask (no causal: positions come off the scores here) → softmax → Dropout, for the interleaved ops."""
    d = b.d
    if d.maybe(0.4, label="il scale"):
        s = scale(b, s, d.choice([0.5, 2.0, 0.125], label="il c"), label="il scale")
    kind = d.choice(["none", "additive", "length", "where", "causal"], [3, 3, 3, 1, 1], label="il mask")
    length = None
    if kind == "additive":
        s = S.broadcast_add(s, b.input("mask", _mask_shape(b, geo, "il mask"), kind="addmask"))
    elif kind == "where":
        s = S.where(b.input("cond", geo.scores(), kind="mask01"), s, _fill(b, s, "il"))
    elif kind == "length":
        length = b.input("len", geo.lead + (geo.sq,), kind="len", dtype=d.choice(["int32", "int64"], label="il len dtype"),
                         lo=d.choice([0, 1], label="il len lo"), hi=geo.sk)
    elif kind == "causal":
        qpos = S.reshape(S.contrib.arange_like(s, axis=-2), shape=(-1, 1))
        kpos = S.reshape(S.contrib.arange_like(s, axis=-1), shape=(1, -1))
        allowed = S.broadcast_greater_equal(qpos, kpos)
        s = S.broadcast_add(s, S.expand_dims(I._mul_scalar(I._rminus_scalar(allowed, scalar=1.0), scalar=-1e9), axis=0))
    p = S.softmax(s, length, axis=-1, use_length=True) if length is not None else S.softmax(s, axis=-1)
    if d.maybe(0.3, label="il dropout"):
        prob = d.choice([0.1, 0.0], label="il dropout p")
        p = S.Dropout(p, p=prob)
        if prob:
            b.flag("random_train")
    return p


def build(b):
    form = b.d.choice(["core3", "heads", "core4", "packed", "interleaved", "encdec"], [5, 9, 2, 4, 3, 3], label="form")
    if form == "core3":
        return core3(b)
    if form == "core4":
        return core4(b)
    if form == "heads":
        return heads(b)
    if form == "packed":
        return heads(b, packed=True)
    if form == "interleaved":
        return interleaved(b)
    return encdec(b)
