"""dense_act (patterns/dense_act.py): FullyConnected + bias + activation → fused_dense."""
import math

import mxnet as mx
import numpy as np
import pytest

import fusion

from conftest import fuse_and_check, ops, random_params

S = mx.sym
X3 = {"x": (40, 3, 12)}     # ≥ 8 GEMM rows: dense_act leaves smaller ones to MXNet


def fc(x, n=16, **kw):
    return S.FullyConnected(x, num_hidden=n, name="fc", **kw)


ACTS = {
    "none": lambda z: z,
    "relu": lambda z: S.Activation(z, act_type="relu"),
    "sigmoid": lambda z: S.Activation(z, act_type="sigmoid"),
    "tanh": lambda z: S.tanh(z),
    "softrelu": lambda z: S.Activation(z, act_type="softrelu"),
    "leaky": lambda z: S.LeakyReLU(z, act_type="leaky", slope=0.2),
    "gelu": lambda z: S.LeakyReLU(z, act_type="gelu"),
    "gelu_erf_written": lambda z: (z * 0.5) * (S.erf(z / math.sqrt(2)) + 1),
    "gelu_tanh_written": lambda z: (z * 0.5) * (1 + S.tanh((z + 0.044715 * z ** 3) * math.sqrt(2 / math.pi))),
}


@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("flatten", [False, True])
def test_dense_activation(act, flatten):
    y = ACTS[act](fc(S.var("x"), flatten=flatten))
    res = fuse_and_check(y, X3, rules=["dense_act"], rtol=2e-5)
    assert ops(res) == {"fused_dense": 1}, res.report.to_text(explain=True)


def test_separate_bias_add_is_folded_into_the_op():
    z = fc(S.var("x"), no_bias=True, flatten=False)
    y = S.Activation(S.broadcast_add(z, S.var("b2")), act_type="relu")
    arg, aux = random_params(y, dict(X3, b2=(16,)), inputs={"x"})
    res = fuse_and_check(y, X3, arg, aux, rules=["dense_act"])
    assert ops(res) == {"fused_dense": 1}
    assert "fc_fused_bias" in res.arg_params and "b2" not in res.arg_params


def test_bias_and_extra_bias_are_summed():
    y = S.broadcast_add(fc(S.var("x"), flatten=False), S.var("b2"))
    arg, aux = random_params(y, dict(X3, b2=(1, 1, 16)), inputs={"x"})
    res = fuse_and_check(y, X3, arg, aux, rules=["dense_act"])
    assert ops(res) == {"fused_dense": 1}


def test_bias_of_wrong_size_not_folded():
    y = S.broadcast_add(fc(S.var("x"), flatten=False, no_bias=True), S.var("b2"))
    arg, aux = random_params(y, dict(X3, b2=(3, 1)), inputs={"x"})
    res = fuse_and_check(y, X3, arg, aux, rules=["dense_act"])
    # the FullyConnected alone is still fused; the add stays, and the report says why
    assert ops(res) == {"fused_dense": 1, "broadcast_add": 1}
    why = " ".join(res.report.rules["dense_act"].near_misses.values())
    assert "smaller form" in why and "not one value per output feature" in why, why


def test_prelu_not_fused_into_dense():
    y = S.LeakyReLU(fc(S.var("x")), S.var("alpha"), act_type="prelu")
    shapes = {"x": (40, 12)}
    arg, aux = random_params(y, dict(shapes, alpha=(16,)), inputs={"x"})
    res = fuse_and_check(y, shapes, arg, aux, rules=["dense_act"])
    assert ops(res) == {"fused_dense": 1, "LeakyReLU": 1}


def test_activation_output_shared_keeps_activation_outside():
    z = fc(S.var("x"), flatten=False)
    y = S.Group([S.relu(z), z])
    res = fuse_and_check(y, X3, rules=["dense_act"])
    assert ops(res) == {"fused_dense": 1, "relu": 1}
    why = " ".join(res.report.rules["dense_act"].near_misses.values())
    assert "smaller form" in why and "graph output" in why, why


def test_dense_backward_matches_unfused():
    y = S.Activation(fc(S.var("x"), flatten=False), act_type="tanh")
    arg, _ = random_params(y, X3)
    res = fusion.fuse(y, arg, {}, rules=["dense_act"], mode="training")
    assert ops(res) == {"fused_dense": 1}
    x = mx.nd.array(np.random.default_rng(0).standard_normal(X3["x"]))
    grads = []
    for sym, params in ((y, arg), (res.symbol, res.arg_params)):
        args = dict(params, x=x)
        g = {k: mx.nd.zeros(v.shape) for k, v in args.items()}
        exe = sym.bind(mx.cpu(), args, args_grad=g)
        exe.forward(is_train=True)
        exe.backward(mx.nd.ones(exe.outputs[0].shape))
        grads.append({k: v.asnumpy() for k, v in g.items()})
    for k in grads[0]:
        np.testing.assert_allclose(grads[1][k], grads[0][k], rtol=1e-4, atol=1e-5)


def test_few_rows_left_to_mxnet():
    y = fc(S.var("x"))
    res = fuse_and_check(y, {"x": (4, 12)}, rules=["dense_act"])
    assert ops(res) == {"FullyConnected": 1}
    assert "4 rows" in list(res.report.rules["dense_act"].rejected.values())[0]


def test_float16_dense_left_to_mxnet():
    y = S.Activation(S.FullyConnected(S.Cast(S.var("x"), dtype="float16"), num_hidden=16, flatten=False, name="fc"),
                     act_type="relu")
    res = fusion.fuse(y, rules=["dense_act"], input_shapes=X3)
    assert res.report.fused_count == 0
    assert "not float32" in list(res.report.rules["dense_act"].rejected.values())[0]


# ---------------------------------------------------------------- the added bias: MXNet's broadcasting decides

@pytest.mark.parametrize("c_shape,fused", [((16,), True), ((1, 16), True), ((1, 1, 16), False),
                                           ((40, 1), False), ((40, 16), False)])
def test_added_bias_is_per_feature_only_when_it_broadcasts_like_one(c_shape, fused):
    """broadcast_add(FC(x) (40, 16), c): c (40, 1) adds one value per row, (40, 16) one per element,
    (1, 1, 16) makes the sum (1, 40, 16); only a c that is 1 but along the feature axis, with the sum
    keeping the layer's shape, is a bias (else the layer alone is fused and the add stays)."""
    x, c = S.var("x"), S.var("c")
    y = S.broadcast_add(S.FullyConnected(x, num_hidden=16, no_bias=True, name="fc"), c)
    arg, aux = random_params(y, {"x": (40, 12), "c": c_shape}, inputs={"x"})
    res = fuse_and_check(y, {"x": (40, 12)}, arg, aux, rules=["dense_act"], rtol=2e-5)
    assert ("broadcast_add" not in ops(res)) == fused, res.report.to_text(explain=True)
    if not fused:
        reasons = " ".join(res.report.rules["dense_act"].rejected.values()) + " ".join(
            res.report.rules["dense_act"].near_misses.values())
        assert "not one value per output feature" in reasons or "broadcasts the layer's output" in reasons, reasons


def test_added_bias_batch_dependent_refused_at_probe_shapes():
    """c (1, 1, 16) added to FC(x, flatten=False) of x (1, 5, 12): the sum keeps the layer's shape at
    every batch size — but c (1, 5, 16) only at sequence length 5: not a per-feature bias."""
    x, c = S.var("x"), S.var("c")
    y = S.broadcast_add(S.FullyConnected(x, num_hidden=16, flatten=False, name="fc"), c)
    arg, aux = random_params(y, {"x": (1, 8, 12), "c": (1, 8, 16)}, inputs={"x"})
    res = fusion.fuse(y, arg, aux, input_shapes={"x": (1, 8, 12)}, rules=["dense_act"])
    assert "fused_dense" in ops(res) and "broadcast_add" in ops(res)    # the add stays outside
    assert "not one value per output feature" in " ".join(res.report.rules["dense_act"].near_misses.values())


def test_training_bias_sum_keeps_both_parameters_trained():
    """In training the merged bias is b + c computed in the graph: no new parameter, both keep gradients."""
    x, w, b, c = (S.var(n) for n in ("x", "w", "b", "c"))
    y = S.relu(S.broadcast_add(S.FullyConnected(x, w, b, num_hidden=8, flatten=False), c))
    arg = {"w": mx.nd.array(np.random.default_rng(0).standard_normal((8, 4))),
           "b": mx.nd.array(np.ones(8)), "c": mx.nd.array(np.arange(8.0).reshape(1, 8))}
    res = fusion.fuse(y, arg, {}, input_shapes={"x": (2, 8, 4)}, mode="training")
    assert ops(res).get("fused_dense") == 1, res.report.to_text()
    assert set(res.arg_params) == {"w", "b", "c"} and res.report.self_check.checked == 1
    xs = mx.nd.array(np.random.default_rng(1).standard_normal((2, 8, 4)))
    grads = []
    for sym, params in ((y, arg), (res.symbol, res.arg_params)):
        args = {"x": xs, **{k: v.copy() for k, v in params.items()}}
        g = {k: mx.nd.zeros(v.shape) for k, v in args.items()}
        exe = sym.bind(mx.cpu(), args, args_grad=g)
        exe.forward(is_train=True)
        exe.backward(mx.nd.ones((2, 8, 8)))
        grads.append({k: v.asnumpy() for k, v in g.items()})
    for k in ("x", "w", "b", "c"):
        np.testing.assert_allclose(grads[1][k], grads[0][k], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k,act", [(1024, 64, "gelu_erf"), (48, 96, "none")])
def test_fused_dense_in_an_executor_keeps_its_values_call_after_call(n, k, act):
    """The first call reads W as it is; later calls use the weight oneDNN's matmul prepared (packed
    into a blocked layout, or W read in place where its GEMM takes a plain one — AVX2 CPUs: a
    (K, N) copy aliases in the cache at N = 1024); a new weight version is read, not the old."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    kw = {} if act == "none" else {"act": act}
    y = S.fused_dense(S.var("x"), S.var("w"), S.var("b"), num_hidden=n, **kw)
    args = {"x": mx.nd.array(x), "w": mx.nd.array(w), "b": mx.nd.array(b)}
    exe = y.bind(mx.cpu(), args, grad_req="null")

    def want(wv):
        z = x @ wv.T + b
        if act == "gelu_erf":
            z = 0.5 * z * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
        return z

    for call in range(4):
        if call == 3:           # a new weight: the op must not keep reading the old one
            w = w[::-1].copy()
            exe.arg_dict["w"][:] = w
        got = exe.forward(is_train=False)[0].asnumpy()
        ref = want(w)
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max(), call
