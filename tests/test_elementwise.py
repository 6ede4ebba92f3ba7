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


# --- exact semantics: NaN, where's rows, sampling dropout, other shapes ------------------
# (every op against MXNet on special values: test_elementwise_semantics.py; random graphs
# fused and un-fused at two batch sizes: test_elementwise_roundtrip.py)

def _run(sym, inputs, arg=None):
    from fusion.check.verify import run
    return run(sym, arg or {}, {}, inputs)


def _same(a, b):
    """Bitwise equal, NaN as NaN."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and bool(np.all((np.isnan(a) & np.isnan(b)) | (a.view(np.uint32) == b.view(np.uint32))))


@pytest.mark.parametrize("name,f", [
    ("relu", S.relu),
    ("clip", lambda a: S.clip(a, -1, 1)),
    ("maximum_scalar", lambda a: S._internal._maximum_scalar(a, scalar=0.0)),
    ("minimum", lambda a: S.broadcast_minimum(a, S.zeros_like(S.var("x")))),
    ("hard_sigmoid", S.hard_sigmoid),
])
def test_nan_propagates_as_in_mxnet(name, f):
    # MXNet keeps NaN through relu, clip, maximum/minimum and hard_sigmoid; the fused op
    # did not (a > 0 ? a : 0 and min(max(...)) turn NaN into a number)
    x = S.var("x")
    y = f(x * 1.0)
    xv = np.array([np.nan, -1, 2, np.inf, -np.inf, -0.0], np.float32)
    res = fusion.fuse(y, rules=["elementwise"], input_shapes={"x": xv.shape})
    assert "fused_elemwise" in ops(res)
    assert _same(_run(res.symbol, {"x": xv})[0], _run(y, {"x": xv})[0])


def test_activation_relu_takes_mxnets_onednn_semantics():
    # Activation(relu) runs through oneDNN at ranks 1-5 (NaN -> 0) and through MXNet's relu
    # at rank 6 (NaN kept): the fused op decides per rank, at run time
    x = S.var("x")
    y = S.Activation(x * 1.0, act_type="relu")
    res = fusion.fuse(y, rules=["elementwise"], input_shapes={"x": (6,)})
    assert "act_relu(" in res.graph.op_nodes()[-1].attrs["expr"]
    xv = np.array([np.nan, -1, 2, np.inf, -np.inf, -0.0], np.float32)
    for shape in ((6,), (6, 1), (1, 6, 1, 1, 1), (6, 1, 1, 1, 1, 1)):
        v = xv.reshape(shape)
        assert _same(_run(res.symbol, {"x": v})[0], _run(y, {"x": v})[0]), shape


@pytest.mark.parametrize("shape", [(3, 3), (3, 4), (5, 2, 3)])
def test_where_with_1d_condition_selects_rows(shape):
    # MXNet's where(c, x, y) with c of shape (N,) picks whole rows; NumPy broadcasting would
    # align c with the last axis.  The condition reaches the kernel as (N, 1, ..., 1).
    c, a, b = S.var("c"), S.var("a"), S.var("b")
    y = S.sigmoid(S.where(c, S.tanh(a), b))
    shapes = {"c": shape[:1], "a": shape, "b": shape}
    res = fusion.fuse(y, rules=["elementwise"], input_shapes=shapes)
    assert ops(res) == {"Reshape": 1, "fused_elemwise": 1}, ops(res)
    plain = fusion.unfuse(res.symbol, shapes)
    for n in (shape[0], 7):      # at the batch size fused at and at another
        rng = np.random.default_rng(n)
        inputs = {"c": np.array([1, 0, np.nan, -0.0, 2, 0, 1][:n] + [1] * max(0, n - 7), np.float32),
                  "a": rng.standard_normal((n,) + shape[1:]).astype(np.float32),
                  "b": rng.standard_normal((n,) + shape[1:]).astype(np.float32)}
        want = _run(y, inputs)[0]
        np.testing.assert_allclose(_run(res.symbol, inputs)[0], want, rtol=1e-6, atol=0)
        np.testing.assert_array_equal(_run(plain, inputs)[0], want)


def test_where_row_condition_computed_in_the_graph_stays_outside():
    # the condition's producer (a comparison of a 1-D value) would be evaluated at the
    # output's shape inside the region: it stays out and feeds the Reshape
    c, a = S.var("c"), S.var("a")
    y = S.where(S._internal._greater_scalar(c * 2.0, scalar=0.0), S.exp(a), a * 3.0)
    shapes = {"c": (4,), "a": (4, 6)}
    res = fusion.fuse(y, rules=["elementwise"], input_shapes=shapes)
    assert ops(res).get("fused_elemwise", 0) >= 1 and ops(res).get("Reshape") == 1, ops(res)
    rng = np.random.default_rng(0)
    inputs = {"c": np.array([1, -1, 0, 2], np.float32), "a": rng.standard_normal((4, 6)).astype(np.float32)}
    np.testing.assert_allclose(_run(res.symbol, inputs)[0], _run(y, inputs)[0], rtol=1e-6)


def test_where_of_unknown_rank_is_refused():
    c, a = S.var("c"), S.var("a")
    y = S.sigmoid(S.where(c, S.tanh(a), a))
    res = fusion.fuse(y, rules=["elementwise"])
    assert "where" in ops(res)
    reasons = res.report.rules["elementwise"].near_misses
    assert any("ranks of its condition and branches are unknown" in r for r in reasons.values()), reasons


def test_sampling_dropout_is_not_absorbed():
    # Dropout(mode='always') samples at inference (Monte-Carlo dropout): not the identity
    x = S.var("x")
    y = S.sigmoid(S.Dropout(S.tanh(x), p=0.5, mode="always"))
    res = fusion.fuse(y, rules=["elementwise"], input_shapes={"x": (4, 8)})
    assert ops(res).get("Dropout") == 1 and "always" in res.symbol.tojson()
    reasons = res.report.rules["elementwise"].near_misses
    assert any("samples a mask at inference (mode='always')" in r for r in reasons.values()), reasons


def test_inference_dropout_with_axes_is_the_identity():
    x = S.var("x")
    y = S.sigmoid(S.Dropout(S.tanh(x), p=0.5, axes=(1,)))
    res = fuse_and_check(y, {"x": (4, 8)}, {}, {}, rules=["elementwise"], rtol=1e-6)
    assert ops(res) == {"fused_elemwise": 1}


def test_dropout_in_training_mode_is_not_absorbed():
    x = S.var("x")
    y = S.sigmoid(S.Dropout(S.tanh(x), p=0.5))
    res = fusion.fuse(y, rules=["elementwise"], mode="training", input_shapes={"x": (4, 8)})
    assert ops(res).get("Dropout") == 1


@pytest.mark.parametrize("form", sorted(FORMS))
def test_forms_run_at_another_batch_size(form):
    x = S.var("x")
    y = FORMS[form](x)
    shapes = dict(X, **{k: v for k, v in EXTRA.items() if k in y.list_arguments()})
    res = fusion.fuse(y, rules=["elementwise"], input_shapes=shapes)
    other = {k: ((7,) + v[1:] if k == "x" else v) for k, v in shapes.items()}
    rng = np.random.default_rng(1)
    inputs = {k: rng.standard_normal(v).astype(np.float32) for k, v in other.items()}
    want = _run(y, inputs)[0]
    got = _run(res.symbol, inputs)[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_batchnorm_runs_at_other_batch_and_spatial_sizes():
    # scale and shift are (C, 1, 1): they broadcast at any N, H, W
    x = S.var("x")
    y = S.Activation(S.BatchNorm(x, fix_gamma=False, name="bn") * 1.0, act_type="relu")
    arg, aux = random_params(y, {"x": (2, 3, 4, 5)}, inputs={"x"})
    res = fusion.fuse(y, arg, aux, rules=["elementwise"], input_shapes={"x": (2, 3, 4, 5)})
    assert ops(res) == {"fused_elemwise": 1}
    assert res.arg_params["bn_scale"].shape == (3, 1, 1)
    for shape in ((2, 3, 4, 5), (6, 3, 2, 9)):
        inputs = {"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
        v = fusion.verify(y, res, (arg, aux), inputs=inputs)
        assert v.max_rel <= 1e-5, (shape, v)


def test_broadcast_ops_broadcast_as_mxnet_at_other_shapes():
    # MXNet's broadcast_* ops take different ranks, aligned on the right, as NumPy does
    a, b = S.var("a"), S.var("b")
    y = S.tanh(S.broadcast_mul(S.broadcast_add(a, b), b))
    res = fusion.fuse(y, rules=["elementwise"], input_shapes={"a": (2, 3, 4), "b": (4,)})
    for sa, sb in (((2, 3, 4), (4,)), ((5, 3, 4), (3, 1)), ((4,), (6, 1, 4))):
        rng = np.random.default_rng(2)
        inputs = {"a": rng.standard_normal(sa).astype(np.float32), "b": rng.standard_normal(sb).astype(np.float32)}
        want = _run(y, inputs)[0]
        got = _run(res.symbol, inputs)[0]
        assert got.shape == want.shape, (sa, sb)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_fused_op_with_an_unread_input_is_not_inlined():
    # its output broadcasts against the unread input: the program alone would be smaller
    a, b = S.var("a"), S.var("b")
    f = S.fused_elemwise(a, b, expr="mul(x0, 2.0)", num_args=2)
    y = S.tanh(S.exp(f))
    res = fusion.fuse(y, rules=["elementwise"], input_shapes={"a": (2, 3), "b": (4, 1, 3)})
    inputs = {"a": np.ones((2, 3), np.float32), "b": np.ones((4, 1, 3), np.float32)}
    assert _run(res.symbol, inputs)[0].shape == _run(y, inputs)[0].shape == (4, 2, 3)


def test_training_two_nodes_computing_the_same_value_are_not_merged():
    """Two nodes computing x / relu(6 - x): MXNet backpropagates each (g / 0 + 0 / 0 = NaN where
    x >= 6); the fused program would compute them once and sum first (inf). In training the region
    is refused with that reason; at inference (no gradient) it fuses."""
    x = mx.sym.var("x")
    d1 = mx.sym.broadcast_div(x, mx.sym.relu(6 - x))
    d2 = mx.sym.broadcast_div(x, mx.sym.relu(6 - x))
    y = mx.sym.broadcast_maximum(d1, d2)
    train = fusion.fuse(y, input_shapes={"x": (2, 3)}, mode="training")
    assert "fused_elemwise" not in train.graph.count_ops()
    assert "compute the same value" in train.report.to_text(explain=True)
    assert "fused_elemwise" in fusion.fuse(y, input_shapes={"x": (2, 3)}).graph.count_ops()


def test_dtypes_decided_without_shapes():
    """Without input shapes MXNet's type inference still runs (types need none): a comparison of
    positions of a float64 tensor is float64 and stays out of the float32 fused op."""
    q = mx.sym.Cast(mx.sym.var("q"), dtype="float64")
    pos = mx.sym.contrib.arange_like(q, axis=1)
    m = mx.sym.broadcast_greater_equal(mx.sym.reshape(pos, shape=(-1, 1)), mx.sym.reshape(pos, shape=(1, -1)))
    y = mx.sym.broadcast_add(mx.sym.batch_dot(q, q, transpose_b=True), 1 - m)
    res = fusion.fuse(y)
    assert "fused_elemwise" not in res.graph.count_ops(), res.graph.count_ops()
    exe = res.symbol.bind(mx.cpu(), {"q": mx.nd.ones((2, 3, 4))})
    assert exe.forward()[0].dtype == np.float64
