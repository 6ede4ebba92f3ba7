"""float16 through the fused ops' MXNet type inference and their CPU paths (AMP's GPU graphs).

MXNet's AMP (convert_symbol(..., target_dtype="float16")) runs FullyConnected in float16 (data,
weight and bias cast), softmax and LayerNorm in float32 (their inputs cast up, LayerNorm's gamma
and beta kept float32), and the ops of its widest-type list (batch_dot, the interleaved attention
products, elemwise/broadcast add and mul) in the widest of their inputs' types.  The fused ops
take those dtypes and give the output the dtype AMP's graph had (out_dtype where it differs from
the default).  On the CPU a float16 call runs the float32 code on widened copies and rounds the
results once, so each float16 result is compared with the same op in float32 on the widened
inputs, rounded by NumPy (nearest even): bitwise equal (tolerance 0) wherever both runs take the
same path.  Exceptions, with their tolerances: fused_dense in an executor (the weight prepacked
from the second call on) against NumPy, rtol 2^-10; fused_attention's gradients, which read the
op's output -- float16 in the float16 run -- rtol 2^-8.
"""
import mxnet as mx
import numpy as np
import pytest
from mxnet.base import MXNetError

from kernel_fixtures import fused_ops  # noqa: F401  (builds + loads the library)

F16 = np.float16


def rng(seed):
    return np.random.default_rng(seed)


def nd(a):
    return mx.nd.array(a, dtype=a.dtype)


def same(got, want):
    np.testing.assert_array_equal(got.view(np.uint16) if got.dtype == F16 else got,
                                  want.view(np.uint16) if want.dtype == F16 else want)


def halves(r, *shapes, scale=1.0):
    return [(r.standard_normal(s) * scale).astype(F16) for s in shapes]


def out_type(sym, **types):
    return sym.infer_type(**types)[1][0]


# ---- fused_elemwise --------------------------------------------------------------------------------

EXPR = "mul(sigmoid(add(mul(x0, 1.5), 0.5)), tanh(sub(x1, 0.25)))"


def test_elemwise_float16_is_the_float32_result_rounded():
    r = rng(0)
    x0, x1 = halves(r, (4, 33), (33,), scale=3.0)
    x0[0, :4] = [np.inf, -np.inf, np.nan, 0]
    y = mx.nd.fused_elemwise(nd(x0), nd(x1), expr=EXPR, num_args=2)
    assert y.dtype == F16
    ref = mx.nd.fused_elemwise(nd(x0.astype(np.float32)), nd(x1.astype(np.float32)), expr=EXPR, num_args=2)
    same(y.asnumpy(), ref.asnumpy().astype(F16))


def test_elemwise_mixed_dtypes_give_float32_and_out_dtype_overrides():
    r = rng(1)
    (x0,), x1 = halves(r, (3, 8)), r.standard_normal(8).astype(np.float32)
    ref = mx.nd.fused_elemwise(nd(x0.astype(np.float32)), nd(x1), expr=EXPR, num_args=2).asnumpy()
    y = mx.nd.fused_elemwise(nd(x0), nd(x1), expr=EXPR, num_args=2)
    assert y.dtype == np.float32
    same(y.asnumpy(), ref)
    y16 = mx.nd.fused_elemwise(nd(x0), nd(x1), expr=EXPR, num_args=2, out_dtype="float16")
    same(y16.asnumpy(), ref.astype(F16))
    s = mx.sym.fused_elemwise(mx.sym.var("a"), mx.sym.var("b"), expr=EXPR, num_args=2)
    assert out_type(s, a="float16", b="float16") == F16
    assert out_type(s, a="float16", b="float32") == np.float32


def test_elemwise_float16_backward_is_the_float32_gradient_rounded():
    r = rng(2)
    x0, x1, dy = halves(r, (5, 16), (1, 16), (5, 16))
    expr = "mul(tanh(x0), add(x1, 1.0))"

    def grads(dtype):
        xs = [nd(x0.astype(dtype)), nd(x1.astype(dtype))]
        for x in xs:
            x.attach_grad()
        with mx.autograd.record():
            y = mx.nd.fused_elemwise(*xs, expr=expr, num_args=2)
        y.backward(nd(dy.astype(dtype)))
        return [x.grad.asnumpy() for x in xs]

    g16, g32 = grads(F16), grads(np.float32)
    assert all(g.dtype == F16 for g in g16)
    for a, b in zip(g16, g32):
        same(a, b.astype(F16))


def test_elemwise_refuses_other_dtypes_with_the_reason():
    x = mx.nd.ones((2, 3), dtype=np.float64)
    with pytest.raises(MXNetError, match="input x0 must be float32, float16 or bfloat16, got float64"):
        mx.nd.fused_elemwise(x, expr="exp(x0)")
    with pytest.raises(MXNetError, match="out_dtype.*must be one of"):
        mx.nd.fused_elemwise(mx.nd.ones(3), expr="exp(x0)", out_dtype="float64")


# ---- fused_dense -----------------------------------------------------------------------------------

def test_dense_float16_is_the_float32_result_rounded():
    r = rng(3)
    x, w, b = halves(r, (6, 3, 40), (24, 40), (24,))
    attrs = dict(num_hidden=24, flatten=False, act="gelu_erf")
    y = mx.nd.fused_dense(nd(x), nd(w), nd(b), **attrs)
    assert y.dtype == F16 and y.shape == (6, 3, 24)
    ref = mx.nd.fused_dense(*(nd(t.astype(np.float32)) for t in (x, w, b)), **attrs)
    same(y.asnumpy(), ref.asnumpy().astype(F16))
    # float32 data and bias with a float16 weight (the CPU widens all three); out_dtype float32
    y32 = mx.nd.fused_dense(nd(x.astype(np.float32)), nd(w), nd(b.astype(np.float32)), out_dtype="float32", **attrs)
    assert y32.dtype == np.float32
    same(y32.asnumpy(), ref.asnumpy())


def test_dense_float16_weight_follows_its_updates_in_an_executor():
    """The weight is widened once per weight version (and packed on the second call): writing new
    values into the weight array must reach the next forward."""
    r = rng(4)
    x, w, b = halves(r, (8, 32), (16, 32), (16,))
    s = mx.sym.fused_dense(mx.sym.var("x"), mx.sym.var("w"), mx.sym.var("b"), num_hidden=16)
    ex = s.bind(mx.cpu(), {"x": nd(x), "w": nd(w), "b": nd(b)})
    for step in range(3):
        out = ex.forward()[0].asnumpy()
        ref = (x.astype(np.float32) @ w.astype(np.float32).T + b.astype(np.float32)).astype(F16)
        np.testing.assert_allclose(out.astype(np.float32), ref.astype(np.float32), rtol=2 ** -10, atol=1e-3)
        w = (w.astype(np.float32) * -0.5 + 0.1).astype(F16)
        ex.arg_dict["w"][:] = nd(w)


def test_dense_float16_backward():
    r = rng(5)
    x, w, b, dy = halves(r, (7, 20), (12, 20), (12,), (7, 12))

    def grads(dtype):
        xs = [nd(t.astype(dtype)) for t in (x, w, b)]
        for t in xs:
            t.attach_grad()
        with mx.autograd.record():
            y = mx.nd.fused_dense(*xs, num_hidden=12, act="relu")  # its gradient reads only the sign of y
        y.backward(nd(dy.astype(dtype)))
        return [t.grad.asnumpy() for t in xs]

    for a, b_ in zip(grads(F16), grads(np.float32)):
        assert a.dtype == F16
        same(a, b_.astype(F16))


def test_dense_refuses_a_float16_data_with_a_float32_weight():
    s = mx.sym.fused_dense(mx.sym.var("x"), mx.sym.var("w"), mx.sym.var("b"), num_hidden=4)
    assert out_type(s, x="float16", w="float16", b="float16") == F16
    with pytest.raises(MXNetError, match="input 0 \\(data\\) must be float32.*float16 with a float16 weight"):
        s.infer_type(x="float16", w="float32", b="float32")
    with pytest.raises(MXNetError, match="out_dtype='float16' needs a float16 weight"):
        mx.sym.fused_dense(mx.sym.var("x"), mx.sym.var("w"), num_hidden=4, no_bias=True,
                           out_dtype="float16").infer_type(x="float32", w="float32")


# ---- fused_add_layer_norm ---------------------------------------------------------------------------

def test_add_layer_norm_amp_dtypes():
    """AMP: a float16 projection plus a float32 residual, LayerNorm in float32 (gamma, beta float32)."""
    r = rng(6)
    (a,) = halves(r, (4, 5, 64))
    b, g, be = r.standard_normal((4, 5, 64)).astype(np.float32), r.uniform(0.5, 1.5, 64).astype(np.float32), \
        r.standard_normal(64).astype(np.float32)
    ref = mx.nd.fused_add_layer_norm(nd(a.astype(np.float32)), nd(b), nd(g), nd(be), output_sum=True)
    y, s = mx.nd.fused_add_layer_norm(nd(a), nd(b), nd(g), nd(be), output_sum=True, out_dtype="float32")
    assert y.dtype == np.float32
    same(y.asnumpy(), ref[0].asnumpy())
    same(s.asnumpy(), ref[1].asnumpy())
    y16 = mx.nd.fused_add_layer_norm(nd(a), nd(b.astype(F16)), nd(g), nd(be))  # a's dtype by default
    ref16 = mx.nd.fused_add_layer_norm(nd(a.astype(np.float32)), nd(b.astype(F16).astype(np.float32)), nd(g), nd(be))
    assert y16.dtype == F16
    same(y16.asnumpy(), ref16.asnumpy().astype(F16))
    sym = mx.sym.fused_add_layer_norm(*(mx.sym.var(n) for n in "abgh"), out_dtype="float32")
    assert out_type(sym, a="float16", b="float32", g="float32", h="float32") == np.float32


def test_add_layer_norm_float16_backward():
    r = rng(7)
    a, b, dy = halves(r, (6, 32), (32,), (6, 32))
    g, be = r.uniform(0.5, 1.5, 32).astype(np.float32), r.standard_normal(32).astype(np.float32)

    def grads(dtype):
        xs = [nd(a.astype(dtype)), nd(b.astype(dtype)), nd(g), nd(be)]
        for t in xs:
            t.attach_grad()
        with mx.autograd.record():
            y = mx.nd.fused_add_layer_norm(*xs)
        y.backward(nd(dy.astype(dtype)))
        return [t.grad.asnumpy() for t in xs]

    g16, g32 = grads(F16), grads(np.float32)
    for got, want in zip(g16[:2], g32[:2]):
        assert got.dtype == F16
        same(got, want.astype(F16))
    for got, want in zip(g16[2:], g32[2:]):  # gamma and beta stay float32: dy was float16 here
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_add_layer_norm_refuses_float64_gamma():
    sym = mx.sym.fused_add_layer_norm(*(mx.sym.var(n) for n in "abgh"))
    with pytest.raises(MXNetError, match="input 2 \\(gamma/beta\\) must be float32 or float16, got float64"):
        sym.infer_type(a="float16", b="float16", g="float64", h="float32")


# ---- fused_attention --------------------------------------------------------------------------------

def test_attention_float16_and_amp_float32_output():
    r = rng(8)
    q, k, v = halves(r, (6, 10, 16), (6, 12, 16), (6, 12, 16))
    attrs = dict(scale=0.25, layout="plain")
    ref = mx.nd.fused_attention(*(nd(t.astype(np.float32)) for t in (q, k, v)), **attrs).asnumpy()
    o16 = mx.nd.fused_attention(nd(q), nd(k), nd(v), **attrs)
    assert o16.dtype == F16
    same(o16.asnumpy(), ref.astype(F16))
    o32 = mx.nd.fused_attention(nd(q), nd(k), nd(v), out_dtype="float32", **attrs)
    assert o32.dtype == np.float32
    same(o32.asnumpy(), ref)


def test_attention_float16_mask_and_backward():
    """The forward bitwise as elsewhere; the gradients within float16's rounding of the output,
    which the backward reads (tolerance: rtol 2^-8, atol 2e-3 of the largest gradient)."""
    r = rng(9)
    q, k, v, do = halves(r, (2, 7, 8), (2, 7, 8), (2, 7, 8), (2, 7, 8))
    mask = np.where(r.random((2, 7, 7)) < 0.3, -1e4, 0).astype(np.float32)
    attrs = dict(scale=0.35, layout="plain", mask_kind="additive")

    def run(dtype):
        xs = [nd(t.astype(dtype)) for t in (q, k, v)] + [nd(mask.astype(dtype))]
        for t in xs:
            t.attach_grad()
        with mx.autograd.record():
            o = mx.nd.fused_attention(*xs, **attrs)
        o.backward(nd(do.astype(dtype)))
        return [o.asnumpy()] + [t.grad.asnumpy() for t in xs]

    got, want = run(F16), run(np.float32)
    assert all(g.dtype == F16 for g in got)
    same(got[0], want[0].astype(F16))
    # the backward reads the op's output, float16 here: the gradients move by its rounding
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_allclose(g.astype(np.float32), w, rtol=2 ** -8, atol=2e-3 * (1 + np.abs(w).max()))


def test_attention_refuses_mixed_data_dtypes():
    sym = mx.sym.fused_attention(mx.sym.var("q"), mx.sym.var("k"), mx.sym.var("v"), scale=0.5, layout="plain")
    assert out_type(sym, q="float16", k="float16", v="float16") == F16
    with pytest.raises(MXNetError, match="the data inputs must have one dtype.*input 1 float32"):
        sym.infer_type(q="float16", k="float32", v="float16")


# ---- the conversions themselves ----------------------------------------------------------------------

def test_float16_rounding_is_ieee_nearest_even(fused_ops):  # noqa: F811
    import ctypes
    lib = ctypes.CDLL(fused_ops.library_path())
    x = np.concatenate([np.array([0, -0.0, 1, 65504, 65519.99, 65520, 1e-8, 2 ** -24, 3 * 2 ** -26, 5.96e-8,
                                  np.inf, -np.inf, np.nan], np.float32),
                        rng(10).standard_normal(1000).astype(np.float32) * 1e3,
                        (rng(11).standard_normal(1000) * 1e-5).astype(np.float32)])
    h = np.empty(x.size, np.uint16)
    lib.mxf_to_f16(x.ctypes.data_as(ctypes.c_void_p), h.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
    want = x.astype(F16)
    assert np.array_equal(np.isnan(h.view(F16)), np.isnan(want))
    ok = ~np.isnan(want)
    same(h.view(F16)[ok], want[ok])
    back = np.empty(x.size, np.float32)
    lib.mxf_from_f16(h.ctypes.data_as(ctypes.c_void_p), back.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
    np.testing.assert_array_equal(back[ok], want[ok].astype(np.float32))
