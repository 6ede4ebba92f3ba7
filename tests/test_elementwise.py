"""elementwise: maximal regions of elementwise/broadcast/scalar ops → one fused_elemwise."""
import math

import mxnet as mx
import numpy as np
import pytest

import fusion

from conftest import fuse_and_check, ops, random_params

S = mx.sym
X = {"x": (2, 3, 4, 5)}


def only_fused(res, n=1):
    counts = ops(res)
    assert counts.get("fused_elemwise") == n, res.report.to_text(explain=True)
    return counts


FORMS = {
    "hard_swish": lambda x: x * S.clip(x + 3, 0, 6) / 6,
    "hard_sigmoid_gate": lambda x: x * S.hard_sigmoid(x),
    "swish": lambda x: S.broadcast_mul(x, S.sigmoid(x)),
    "bias_act_chain": lambda x: S.Activation(S.broadcast_add(x, S.var("bias")), act_type="tanh") * 2.0,
    "leaky_then_scale": lambda x: S.LeakyReLU(x * 1.5 - 0.25, act_type="leaky", slope=0.1),
    "gelu_leaky": lambda x: S.LeakyReLU(x / 3.0, act_type="gelu"),
    "comparisons_where": lambda x: S.where(x > 0.5, S.exp(-x), S.square(x)),
    "reverse_scalars": lambda x: S.sqrt(S.abs(1.0 / (2.0 - x))) ** 0.5,
    "max_min": lambda x: S.broadcast_minimum(S.broadcast_maximum(x, S.var("lo")), S.var("hi")) + 1,
}
EXTRA = {"bias": (1, 3, 1, 1), "lo": (5,), "hi": (1, 1, 1, 5)}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_forms_fuse_into_one_pass(form):
    x = S.var("x")
    y = FORMS[form](x)
    shapes = dict(X, **{k: v for k, v in EXTRA.items() if k in y.list_arguments()})
    rng = np.random.default_rng(0)
    inputs = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    res = fusion.fuse(y, rules=["elementwise"], input_shapes=shapes)   # where needs its ranks
    counts = only_fused(res)
    assert counts == {"fused_elemwise": 1}
    v = fusion.verify(y, res, ({}, {}), inputs=inputs)
    assert v.max_rel <= 1e-5, v


def test_se_gating_tail():
    x = S.var("x")
    pooled = S.Pooling(x, kernel=(1, 1), global_pool=True, pool_type="avg")
    gate = S.sigmoid(S.FullyConnected(pooled, num_hidden=3, name="fc") * 1.0 + 0.5)
    y = S.broadcast_mul(x, S.reshape(gate, shape=(0, 0, 1, 1)))
    res = fuse_and_check(y, X, rules=["elementwise"], rtol=1e-5)
    only_fused(res)


def test_batchnorm_as_scale_shift_then_activation():
    x = S.var("x")
    y = S.Activation(S.BatchNorm(S.Pooling(x, kernel=(2, 2), pool_type="max"), fix_gamma=False, name="bn"),
                     act_type="relu")
    res = fuse_and_check(y, X, rules=["elementwise"], rtol=1e-5)
    assert ops(res) == {"Pooling": 1, "fused_elemwise": 1}
    assert {"bn_scale", "bn_shift"} <= set(res.arg_params)


def test_single_op_left_alone():
    res = fusion.fuse(S.exp(S.var("x")), rules=["elementwise"])
    assert res.report.fused_count == 0 and ops(res) == {"exp": 1}


def test_interior_value_used_elsewhere_splits_region():
    x = S.var("x")
    a = S.exp(x) * 2.0
    y = S.Group([S.tanh(a) + 1.0, S.sum(a)])
    res = fuse_and_check(y, X, rules=["elementwise"], rtol=1e-5)
    # exp·2 (used by the sum too) and tanh+1 become two regions; nothing escapes a region
    assert ops(res) == {"fused_elemwise": 2, "sum": 1}


def test_conv_tail_left_to_onednn():
    x = S.var("x")
    c = S.Convolution(x, num_filter=3, kernel=(1, 1), name="c")
    y = S.Activation(S.Activation(c, act_type="relu") + x, act_type="relu")
    res = fuse_and_check(y, X, rules=["elementwise"])
    assert res.report.fused_count == 0
    reasons = res.report.rules["elementwise"].near_misses
    assert any("tail of a convolution" in r and "oneDNN" in r for r in reasons.values()), reasons


def test_fused_ops_compose():
    # tanh-GELU becomes fused_elemwise first; the bias add before it joins the same pass
    x = S.var("x")
    z = S.broadcast_add(x, S.var("bias"))
    y = (z * 0.5) * (1 + S.tanh((z + 0.044715 * z ** 3) * math.sqrt(2 / math.pi)))
    shapes = dict(X, bias=(1, 3, 1, 1))
    arg, aux = random_params(y, shapes, inputs={"x"})
    res = fuse_and_check(y, X, arg, aux, rules=["gelu_tanh", "elementwise"], rtol=1e-5)
    assert ops(res) == {"fused_elemwise": 1}


def test_expression_is_readable():
    x = S.var("x")
    res = fusion.fuse(x * S.clip(x + 3, 0, 6) / 6, rules=["elementwise"])
    node = res.graph.op_nodes()[0]
    assert node.attrs["expr"] == "div(mul(x0, clip(add(x0, 3.0), 0.0, 6.0)), 6.0)"


def test_integer_inputs_stay_out():
    # a padding mask built from int32 token ids: the comparison reads ints, so it is not fused;
    # the float part after the Cast still is
    ids = S.var("ids", dtype="int32")
    m = S.Cast(ids != 0, dtype="float32")
    y = (1.0 - m) * -10000.0
    res = fusion.fuse(y, rules=["elementwise"])
    counts = ops(res)
    assert counts.get("_not_equal_scalar") == 1 and counts.get("fused_elemwise") == 1, counts
    reasons = res.report.rules["elementwise"].near_misses
    assert any("reads 'ids', which is not float32" in r for r in reasons.values()), reasons
    ids_val = np.array([[5, 0, 3], [0, 0, 7]], np.int32)
    ref = y.bind(mx.cpu(), {"ids": mx.nd.array(ids_val, dtype="int32")}).forward()[0].asnumpy()
    out = res.symbol.bind(mx.cpu(), {"ids": mx.nd.array(ids_val, dtype="int32")}).forward()[0].asnumpy()
    np.testing.assert_array_equal(out, ref)
