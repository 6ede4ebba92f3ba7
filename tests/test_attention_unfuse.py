"""unfuse is total for fused_attention: every layout, mask kind and rank, causal mode has a stock
form that matches the op — forward and gradients — and runs at other shapes too.

Each case builds a fused_attention symbol, un-fuses it at one set of input shapes, and compares
the two at those shapes and at another batch size / sequence length: outputs within 1e-5 and
gradients within 1e-4 of their scale (fp32), NaN where the op has NaN.
"""
import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.ir.graph import Graph

from test_attention import _run, assert_same

S = mx.sym
H, D = 2, 4


def data_shapes(layout, b, sq, sk, rank=3):
    if layout == "plain":
        lead = (b,) if rank == 3 else (b, H) if rank == 4 else () if rank == 2 else (b, 2, H)
        return {"q": lead + (sq, D), "k": lead + (sk, D), "v": lead + (sk, D + 1)}
    if layout == "bshd":
        return {"q": (b, sq, H * D), "k": (b, sk, H * D), "v": (b, sk, H * D)}
    if layout == "packed_qkv":
        return {"x": (b, sq, 3 * H * D)}
    if layout == "interleaved":
        return {"x": (sq, b, 3 * H * D)}
    return {"q": (sq, b, H * D), "kv": (sk, b, 2 * H * D)}


def scores_lead(layout, b, rank, mask_rank):
    """The scores' leading dims a mask of ``mask_rank`` is aligned with."""
    if layout == "plain":
        return data_shapes(layout, b, 1, 1, rank)["q"][:-2]
    return (b, H) if mask_rank == 4 else (b * H,)


def mask_shape(kind, layout, b, sq, sk, rank, form):
    if kind == "valid_length":
        lead = scores_lead(layout, b, rank, 4 if form == "bh" else 3)
        return {"rows": lead + (sq,), "bh": (b, H, sq), "n": (int(np.prod(lead)),), "b": (b,)}[form]
    lead = scores_lead(layout, b, rank, len(form))
    full = lead + (sq, sk)
    # form: which axes the mask keeps ("1" = broadcast), aligned from the last axis
    return tuple(full[len(full) - len(form) + i] if c == "x" else 1 for i, c in enumerate(form))


def make_inputs(shapes, kind, rng, sk):
    vals = {}
    for n, sh in shapes.items():
        if n != "mask":
            vals[n] = rng.standard_normal(sh).astype(np.float32)
        elif kind == "additive":
            vals[n] = np.where(rng.random(sh) > 0.3, rng.standard_normal(sh), -1e9).astype(np.float32)
        elif kind == "boolean":
            vals[n] = (rng.random(sh) > 0.3).astype(np.float32)
        else:
            vals[n] = rng.integers(0, sk + 1, sh).astype(np.int32)
    return vals


def build(layout, kind, causal, mode, rank):
    names = {"plain": "qkv", "bshd": "qkv", "packed_qkv": ["x"], "interleaved": ["x"],
             "interleaved_encdec": ["q", "kv"]}[layout]
    ins = [S.var(n) for n in names]
    if kind != "none":
        ins.append(S.var("mask", dtype="int32") if kind == "valid_length" else S.var("mask"))
    attrs = dict(scale=0.45, layout=layout, mask_kind=kind)
    if layout != "plain":
        attrs["heads"] = H
    if causal:
        attrs["causal"] = True
        if mode != "exclude":
            attrs.update(causal_mode=mode, mask_value=-1e9 if mode == "add" else -1e18)
    return S.fused_attention(*ins, **attrs)


def check_roundtrip(sym, shapes, others, kind, sks, train=True):
    """``sks``: the key count at ``shapes`` and at each of ``others`` (lengths stay within it)."""
    rng = np.random.default_rng(0)
    first = make_inputs(shapes, kind, rng, sks[0])
    plain = fusion.unfuse(sym, input_shapes=shapes, arg_params={}, aux_params={})
    assert not any(op.startswith("fused_") for op in Graph.from_symbol(plain).count_ops())
    for k, shp in enumerate([shapes] + list(others)):
        vals = first if k == 0 else make_inputs(shp, kind, rng, sks[k])
        want, wgrad = _run(sym, vals, train, k)
        got, ggrad = _run(plain, vals, train, k)
        assert_same(got[0], want[0], 1e-5, "output at %s" % shp)
        for n, w in wgrad.items():
            assert_same(ggrad[n], w, 1e-4, "gradient of %s at %s" % (n, shp))
    return plain


def sizes(layout):
    """(b, sq, sk) at the unfuse shapes and at another shape; self-attention layouts have sq = sk."""
    if layout in ("packed_qkv", "interleaved"):
        return (2, 6, 6), (3, 9, 9)
    return (2, 6, 5), (3, 4, 9)


CASES = []
for layout in ("plain", "bshd", "packed_qkv", "interleaved", "interleaved_encdec"):
    for kind, forms in (("none", [None]), ("additive", ["x", "xx", "1x", "xxx", "x1x", "xxxx", "x11x"]),
                        ("boolean", ["xx", "xxx", "x1x1", "xxxx"]), ("valid_length", ["rows", "bh", "n", "b"])):
        for form in forms:
            if layout == "plain" and form in ("bh", "b"):
                continue
            CASES.append((layout, kind, form))


@pytest.mark.parametrize("layout,kind,form", CASES)
def test_every_layout_and_mask(layout, kind, form):
    (b, sq, sk), (b2, sq2, sk2) = sizes(layout)
    rank = 4 if layout == "plain" and form and len(form) == 4 else 3
    shapes = data_shapes(layout, b, sq, sk, rank)
    others = data_shapes(layout, b2, sq2, sk2, rank)
    if kind != "none":
        shapes["mask"] = mask_shape(kind, layout, b, sq, sk, rank, form)
        others["mask"] = mask_shape(kind, layout, b2, sq2, sk2, rank, form)
    check_roundtrip(build(layout, kind, False, None, rank), shapes, [others], kind, [sk, sk2])


@pytest.mark.parametrize("layout", ["plain", "bshd", "packed_qkv", "interleaved", "interleaved_encdec"])
@pytest.mark.parametrize("mode", ["exclude", "add", "fill"])
def test_causal_modes(layout, mode):
    """Built from positions: the band holds at every length, rows that see no key (Sq > Sk) included."""
    (b, sq, sk), (b2, sq2, sk2) = sizes(layout)
    others = [data_shapes(layout, b2, sq2, sk2)]
    if layout not in ("packed_qkv", "interleaved"):
        others.append(data_shapes(layout, 1, sq + 4, sk))
    check_roundtrip(build(layout, "none", True, mode, 3), data_shapes(layout, b, sq, sk), others, "none",
                    [sk, sk2, sk])


@pytest.mark.parametrize("kind,form", [("valid_length", "rows"), ("additive", "xxx"), ("boolean", "xx")])
def test_causal_exclude_with_a_mask(kind, form):
    (b, sq, sk), (b2, sq2, sk2) = sizes("plain")
    shapes = dict(data_shapes("plain", b, sq, sk), mask=mask_shape(kind, "plain", b, sq, sk, 3, form))
    others = dict(data_shapes("plain", b2, sq2, sk2), mask=mask_shape(kind, "plain", b2, sq2, sk2, 3, form))
    check_roundtrip(build("plain", kind, True, "exclude", 3), shapes, [others], kind, [sk, sk2])


@pytest.mark.parametrize("rank", [2, 4, 5])
def test_plain_other_ranks(rank):
    shapes = data_shapes("plain", 2, 5, 7, rank)
    others = data_shapes("plain", 3, 3, 4, rank)
    shapes["mask"] = shapes["q"][:-2] + (5, 7)
    others["mask"] = others["q"][:-2] + (3, 4)
    check_roundtrip(build("plain", "additive", False, None, rank), shapes, [others], "additive", [7, 4])


def test_fused_causal_model_unfuses_and_runs_at_other_lengths():
    """fuse → unfuse of a causal attention (positions taken off the scores, counted from their
    ends: the band aligned bottom-right, causal at every (Sq, Sk))."""
    q, k, v = S.var("q"), S.var("k"), S.var("v")
    s = S.batch_dot(q, k, transpose_b=True)
    qpos = S.reshape(S.reverse(S.contrib.arange_like(s, axis=-2), axis=0), shape=(-1, 1))
    kpos = S.reshape(S.reverse(S.contrib.arange_like(s, axis=-1), axis=0), shape=(1, -1))
    y = S.batch_dot(S.softmax(S.broadcast_add(s, (1 - S.broadcast_lesser_equal(qpos, kpos)) * -1e9)), v)
    shapes = {n: (2, 5, 4) for n in "qkv"}
    res = fusion.fuse(y, input_shapes=shapes)
    assert Graph.from_symbol(res.symbol).count_ops() == {"fused_attention": 1}
    plain = fusion.unfuse(res.symbol, input_shapes=shapes)
    rng = np.random.default_rng(3)
    for shp in (shapes, {n: (3, 8, 4) for n in "qkv"}, {"q": (2, 3, 4), "k": (2, 7, 4), "v": (2, 7, 4)}):
        vals = {n: rng.standard_normal(sh).astype(np.float32) for n, sh in shp.items()}
        want, wgrad = _run(y, vals, True, 0)
        got, ggrad = _run(plain, vals, True, 0)
        assert_same(got[0], want[0], 1e-5, str(shp))
        for n in wgrad:
            assert_same(ggrad[n], wgrad[n], 1e-4, n)


@pytest.mark.parametrize("kind,form", [("additive", "xxx"), ("additive", "x"), ("boolean", "xxx"), ("boolean", "1xx"),
                                       ("valid_length", "rows")])
def test_plain_rank4_lower_rank_masks(kind, form):
    """On (B, H, Sq, Sk) scores a rank-3 mask is per head, (H, Sq, Sk), as broadcast_add aligns it."""
    shapes = dict(data_shapes("plain", 2, 6, 5, 4), mask=mask_shape(kind, "plain", 2, 6, 5, 4, form))
    others = dict(data_shapes("plain", 3, 4, 9, 4), mask=mask_shape(kind, "plain", 3, 4, 9, 4, form))
    check_roundtrip(build("plain", kind, False, None, 4), shapes, [others], kind, [5, 9])


@pytest.mark.parametrize("layout", ["plain", "bshd", "packed_qkv", "interleaved", "interleaved_encdec"])
@pytest.mark.parametrize("form", ["n", "nsq"])
def test_lengths_read_per_head_or_per_batch_as_the_kernel_reads_them(layout, form):
    """(N,) / (N, Sq) lengths are one per head when N = B·H and one per batch element when N = B,
    told apart by the sizes of each call: unfused at B = 1, H = 2 with N = 2 (per head), the
    stock graph reads the same (2, ·) lengths per batch element at B = 2, and per head again at
    B = 4 with N = 8."""
    (_, sq, sk), (_, sq2, sk2) = sizes(layout)
    rank = 4 if layout == "plain" else 3

    def shapes(b, n, q, k):
        d = data_shapes(layout, b, q, k, rank)
        d["mask"] = (n,) if form == "n" else (n, q)
        return d

    sym = build(layout, "valid_length", False, None, rank)
    check_roundtrip(sym, shapes(1, H, sq, sk), [shapes(2, 2, sq2, sk2), shapes(4, 4 * H, sq, sk)],
                    "valid_length", [sk, sk2, sk])


@pytest.mark.parametrize("probs", ["auto", "row"])
def test_nan_rows_unfuse_to_the_softmax_the_op_mirrors(probs):
    """nan_probs="row" unfuses to softmax(temperature=1): MXNet's own kernel, whose NaN rows have
    every probability NaN; "auto" to the plain softmax (oneDNN's): dV of NaN rows as the op's."""
    q, k, v = S.var("q"), S.var("k"), S.var("v")
    sym = S.fused_attention(q, k, v, scale=0.5, nan_probs=probs)
    shapes = {"q": (2, 6, 4), "k": (2, 33, 4), "v": (2, 33, 4)}
    plain = fusion.unfuse(sym, input_shapes=shapes, arg_params={}, aux_params={})
    assert ("temperature" in plain.tojson()) == (probs == "row")
    rng = np.random.default_rng(1)
    vals = {n: rng.standard_normal(sh).astype(np.float32) for n, sh in shapes.items()}
    vals["k"][0, 32, 1] = np.nan
    vals["k"][1, 7, 0] = np.inf
    want, wgrad = _run(sym, vals, True, 0)
    got, ggrad = _run(plain, vals, True, 0)
    assert_same(got[0], want[0], 1e-5, "output")
    for n, w in wgrad.items():
        assert_same(ggrad[n], w, 1e-4, "gradient of %s" % n)
