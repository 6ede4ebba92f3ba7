"""Decomposed LayerNorm / GELU / softmax → MXNet's built-in ops (patterns/layer_norm.py, gelu.py, softmax.py)."""
import math

import mxnet as mx
import numpy as np
import pytest

import fusion

from conftest import fuse_and_check, ops, random_params

S = mx.sym
SHAPE = {"x": (2, 5, 16)}


def ln_written(x, form, eps=1e-5, gamma=True, beta=True, axis=-1):
    mean = S.mean(x, axis=axis, keepdims=True)
    d = S.broadcast_sub(x, mean)
    sq = S.square(d)
    if form == "mul":
        sq = d * d
    elif form == "pow":
        sq = d ** 2
    elif form == "second_sub":                         # variance from a second x - mean node
        sq = S.square(S.broadcast_sub(x, mean))
    var = S.mean(sq, axis=axis, keepdims=True)
    if form == "rsqrt":
        y = S.broadcast_mul(d, S.rsqrt(var + eps))
    elif form == "eps_param":
        y = S.broadcast_div(d, S.sqrt(S.broadcast_add(var, S.var("eps_c", shape=(1,)))))
    else:
        y = S.broadcast_div(d, S.sqrt(var + eps))
    if gamma:
        y = S.broadcast_mul(S.var("gamma"), y)
    if beta:
        y = S.broadcast_add(y, S.var("beta"))
    return y


def ln_params(sym, shape, eps_value=1e-5):
    arg, aux = random_params(sym, shape, inputs={"x"})
    if "eps_c" in arg:
        arg["eps_c"] = mx.nd.array([eps_value])
    return arg, aux


@pytest.mark.parametrize("form", ["square", "mul", "pow", "rsqrt", "eps_param", "second_sub"])
def test_layer_norm_forms(form):
    y = ln_written(S.var("x"), form)
    arg, aux = ln_params(y, dict(SHAPE, gamma=(16,), beta=(16,), eps_c=(1,)) if form == "eps_param"
                         else dict(SHAPE, gamma=(16,), beta=(16,)))
    res = fuse_and_check(y, SHAPE, arg, aux)
    assert ops(res) == {"LayerNorm": 1}, res.report.to_text()


def test_layer_norm_axis_and_partial_affine():
    y = ln_written(S.var("x"), "square", gamma=True, beta=False, axis=2)
    arg, aux = random_params(y, dict(SHAPE, gamma=(1, 1, 16)), inputs={"x"})
    res = fuse_and_check(y, SHAPE, arg, aux)
    # β = 0 (zeros_like of the axis' positions); γ (1,1,16) reshaped, then constant-folded
    assert ops(res) == {"LayerNorm": 1, "_contrib_arange_like": 1, "zeros_like": 1}
    assert [n for n in res.graph.op_nodes() if n.op == "LayerNorm"][0].attrs["axis"] == 2
    train = fuse_and_check(y, SHAPE, arg, aux, mode="training")
    assert ops(train) == {"LayerNorm": 1, "Reshape": 1, "_contrib_arange_like": 1, "zeros_like": 1}   # γ: a view
    assert set(train.arg_params) == {"gamma"}


def test_layer_norm_refusals():
    # variance over a different axis than the mean
    x = S.var("x")
    mean = S.mean(x, axis=-1, keepdims=True)
    d = S.broadcast_sub(x, mean)
    y = S.broadcast_add(S.broadcast_mul(S.broadcast_div(d, S.sqrt(S.mean(S.square(d), axis=1, keepdims=True) + 1e-5)),
                                        S.var("gamma")), S.var("beta"))
    arg, aux = random_params(y, dict(SHAPE, gamma=(16,), beta=(16,)), inputs={"x"})
    res = fuse_and_check(y, SHAPE, arg, aux)
    assert "LayerNorm" not in ops(res)
    assert "different axes" in res.report.rules["layer_norm"].rejected[res.graph.nodes[-1].name]
    # no params: γ's shape cannot be checked
    res2 = fusion.fuse(ln_written(x, "square"), rules=["layer_norm"])
    assert "needs the value or shape of 'gamma'" in list(res2.report.rules["layer_norm"].rejected.values())[0]


def test_layer_norm_interior_used_outside():
    x = S.var("x")
    mean = S.mean(x, axis=-1, keepdims=True)
    d = S.broadcast_sub(x, mean)
    var = S.mean(S.square(d), axis=-1, keepdims=True)
    y = S.broadcast_add(S.broadcast_mul(S.broadcast_div(d, S.sqrt(var + 1e-5)), S.var("gamma")), S.var("beta"))
    out = S.Group([y, var])
    arg, aux = random_params(out, dict(SHAPE, gamma=(16,), beta=(16,)), inputs={"x"})
    res = fuse_and_check(out, SHAPE, arg, aux)
    assert "LayerNorm" not in ops(res)
    assert any("graph output" in r or "outside the match" in r for r in res.report.rules["layer_norm"].rejected.values())


GELU_FORMS = {
    "half_x": lambda x: (x * 0.5) * (S.erf(x / math.sqrt(2)) + 1),
    "half_outside": lambda x: (x * (1 + S.erf(x * (1 / math.sqrt(2))))) * 0.5,
    "half_bracket": lambda x: x * ((S.erf(x / math.sqrt(2)) + 1) * 0.5),
    "split": lambda x: x * (0.5 + 0.5 * S.erf(x / math.sqrt(2))),
    "bracket_first": lambda x: S.broadcast_mul(S.erf(x / math.sqrt(2)) + 1, x * 0.5),
}


@pytest.mark.parametrize("form", sorted(GELU_FORMS))
def test_gelu_erf_forms(form):
    y = GELU_FORMS[form](S.var("x"))
    res = fuse_and_check(y, SHAPE, {}, {}, rtol=1e-5)
    assert ops(res) == {"LeakyReLU": 1}, res.report.to_text(explain=True)


def test_gelu_wrong_constant_refused():
    x = S.var("x")
    y = (x * 0.5) * (S.erf(x / 1.5) + 1)
    res = fusion.fuse(y, rules=["gelu"])
    assert res.report.fused_count == 0
    assert "not x/√2" in list(res.report.rules["gelu_erf"].rejected.values())[0]


@pytest.mark.parametrize("axis", [-1, 1])
def test_softmax_written_out(axis):
    x = S.var("x")
    e = S.exp(S.broadcast_sub(x, S.max(x, axis=axis, keepdims=True)))
    y = S.broadcast_div(e, S.sum(e, axis=axis, keepdims=True))
    res = fuse_and_check(y, SHAPE, {}, {}, rtol=1e-5)
    assert ops(res) == {"softmax": 1, "max": 1, "fused_elemwise": 1}      # softmax(x) + (max - max)
    # the same on rows of huge, tiny, ±inf and NaN values (whole rows of NaN where the written form has them)
    rows = np.array([[1e4, 1.0, -2.0], [-1e4, -1e4 - 1, -1e4 - 2], [np.inf, 0, 1], [-np.inf, 0, 1],
                     [np.nan, 0, 1]], np.float32)
    data = np.broadcast_to(rows.T[None] if axis == 1 else rows[None], (2,) + (rows.T.shape if axis == 1 else rows.shape))
    v = fusion.verify(y, res, ({}, {}), inputs={"x": np.ascontiguousarray(data)})
    assert v.max_rel <= 1e-6, v


def test_softmax_without_max_shift_refused():
    # exp(x)/sum(exp(x)) gives inf/NaN on rows softmax keeps finite (x > 88, or all x < -87)
    for shifted_axis in (None, 1):
        x = S.var("x")
        z = x if shifted_axis is None else S.broadcast_sub(x, S.max(x, axis=shifted_axis, keepdims=True))
        e = S.exp(z)
        y = S.broadcast_div(e, S.sum(e, axis=-1, keepdims=True))
        res = fuse_and_check(y, SHAPE, {}, {}, rtol=1e-5)
        assert "softmax" not in ops(res)
        want = "not the same function" if shifted_axis is None else "different axes"
        assert any(want in r for r in res.report.rules["softmax"].rejected.values()), res.report.to_text()


def test_softmax_over_two_axes_refused():
    x = S.var("x")
    e = S.exp(S.broadcast_sub(x, S.max(x, axis=(1, 2), keepdims=True)))
    y = S.broadcast_div(e, S.sum(e, axis=(1, 2), keepdims=True))
    res = fuse_and_check(y, SHAPE, {}, {})
    assert "softmax" not in ops(res)
    assert "one axis" in list(res.report.rules["softmax"].rejected.values())[0]


def test_gelu_tanh_form_and_wrong_constant():
    x = S.var("x")
    y = (x * 0.5) * (1 + S.tanh((x + 0.044715 * x ** 3) * math.sqrt(2 / math.pi)))
    res = fuse_and_check(y, SHAPE, {}, {}, rules=["gelu_tanh"], rtol=1e-5)
    assert ops(res) == {"fused_elemwise": 1}
    bad = (x * 0.5) * (1 + S.tanh((x + 0.5 * x ** 3) * math.sqrt(2 / math.pi)))
    res = fusion.fuse(bad, rules=["gelu_tanh"])
    assert res.report.fused_count == 0
    assert "not GELU's" in list(res.report.rules["gelu_tanh"].rejected.values())[0]


@pytest.mark.parametrize("axis,gamma_shape,x_shape", [(1, (4,), (2, 4, 4)), (-1, (16, 1), (1, 16)),
                                                      (1, (4, 1), (2, 4, 3)), (0, (3, 1, 1), (3, 5, 2))])
def test_layer_norm_gamma_follows_mxnet_broadcasting(axis, gamma_shape, x_shape):
    """broadcast_mul aligns trailing axes: γ (4,) scales the LAST axis even when the normalized axis is 1
    ((2,4,4): not LayerNorm(axis=1)'s γ), and γ (16, 1) turns a (1, 16) input into (16, 16)."""
    x, g = S.var("x"), S.var("gamma")
    d = S.broadcast_sub(x, S.mean(x, axis=axis, keepdims=True))
    v = S.mean(S.square(d), axis=axis, keepdims=True)
    y = S.broadcast_mul(S.broadcast_div(d, S.sqrt(v + 1e-5)), g)
    arg = {"gamma": mx.nd.array(np.random.default_rng(0).uniform(0.5, 1.5, gamma_shape))}
    res = fuse_and_check(y, {"x": x_shape}, arg, {}, rtol=1e-5)
    ln = [n for n in res.graph.op_nodes() if n.op == "LayerNorm"]
    padded = (1,) * (len(x_shape) - len(gamma_shape)) + gamma_shape
    acts_on_axis = all(d_ == 1 for i, d_ in enumerate(padded) if i != axis % len(x_shape))
    if acts_on_axis and padded[axis % len(x_shape)] == x_shape[axis]:
        assert ln and "broadcast_mul" not in ops(res), res.report.to_text()
    else:   # normalized without γ, γ kept as the broadcast_mul it is (or nothing fused)
        assert "broadcast_mul" in ops(res) or not ln, res.report.to_text()


def test_gelu_tanh_on_float64_refused():
    x = S.var("x", dtype="float64")
    y = (x * 0.5) * (1 + S.tanh((x + 0.044715 * x ** 3) * math.sqrt(2 / math.pi)))
    res = fusion.fuse(y, rules=["gelu_tanh"], input_shapes={"x": (2, 3)}, input_dtypes={"x": "float64"})
    assert res.report.fused_count == 0
    assert "is not float32" in list(res.report.rules["gelu_tanh"].rejected.values())[0]


def test_layer_norm_without_affine_over_an_axis_that_changes_size():
    """LayerNorm over axis 1 of (1, 1, 8) with no γ/β: the ones/zeros follow the axis at run time."""
    x = S.var("x")
    d = S.broadcast_sub(x, S.mean(x, axis=1, keepdims=True))
    y = S.broadcast_div(d, S.sqrt(S.broadcast_add(S.mean(S.square(d), axis=1, keepdims=True), S.var("eps"))))
    arg = {"eps": mx.nd.array([1e-5])}
    res = fusion.fuse(y, arg, {}, input_shapes={"x": (1, 1, 8)})
    assert "LayerNorm" in ops(res)
    for shape in ((1, 1, 8), (2, 2, 8), (3, 5, 4)):
        v = fusion.verify(y, res, (arg, {}), {"x": shape})
        assert v.max_rel <= 1e-5, (shape, v)
