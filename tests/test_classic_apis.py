"""Fused models through MXNet's classic APIs, bound from the data's shapes alone: ``Module.bind(
data_shapes=...)`` + ``fit``-style steps, ``simple_bind``, and ``gluon.SymbolBlock`` with deferred
initialisation and ``set_data``; and each library op inferring its parameters' shapes (both ways)."""
import json

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon, nd

import fusion

S = mx.sym
X_SHAPE = (2, 5, 8)


def _transformer_block():
    """Dense → GELU → Dense with a residual LayerNorm: fused_dense (with GELU) and fused_add_layer_norm."""
    x = S.var("data")
    h = S.FullyConnected(x, num_hidden=16, flatten=False, name="ffn1")
    h = S.LeakyReLU(h, act_type="gelu")
    h = S.FullyConnected(h, num_hidden=8, flatten=False, name="ffn2")
    y = S.LayerNorm(S.elemwise_add(h, x), axis=-1, name="ln")
    return S.FullyConnected(y, num_hidden=4, flatten=False, name="head")


def _params(sym, seed=0):
    rng = np.random.default_rng(seed)
    shapes, _, _ = sym.infer_shape(data=X_SHAPE)
    return {n: nd.array(rng.normal(0, 0.4, s) + (1.0 if n.endswith("gamma") else 0.0))
            for n, s in zip(sym.list_arguments(), shapes) if n != "data"}


def _fused(mode):
    sym = _transformer_block()
    arg = _params(sym)
    res = fusion.fuse(sym, arg, {}, mode=mode, input_shapes={"data": X_SHAPE})
    ops = [n["op"] for n in json.loads(res.symbol.tojson())["nodes"]]
    assert "fused_dense" in ops and "fused_add_layer_norm" in ops, ops
    return sym, arg, res


def _module_step(sym, arg, x, label):
    """Module bound from data and label shapes only, one forward-backward and SGD update."""
    out = S.LinearRegressionOutput(sym, S.var("label"))
    mod = mx.mod.Module(out, data_names=["data"], label_names=["label"], context=mx.cpu())
    mod.bind(data_shapes=[("data", X_SHAPE)], label_shapes=[("label", label.shape)], for_training=True)
    mod.init_params(arg_params={k: v.copy() for k, v in arg.items()}, aux_params={})
    mod.init_optimizer(optimizer="sgd", optimizer_params={"learning_rate": 0.1})
    batch = mx.io.DataBatch([x], [label])
    mod.forward_backward(batch)
    first = mod.get_outputs()[0].asnumpy()
    mod.update()
    mod.forward(batch, is_train=False)
    return first, mod.get_outputs()[0].asnumpy(), mod.get_params()[0]


def test_module_binds_and_trains_a_fused_model_like_the_original():
    sym, arg, res = _fused("training")
    rng = np.random.default_rng(1)
    x, label = nd.array(rng.normal(size=X_SHAPE)), nd.array(rng.normal(size=X_SHAPE[:2] + (4,)))
    ref_first, ref_after, ref_params = _module_step(sym, arg, x, label)
    got_first, got_after, got_params = _module_step(res.symbol, res.arg_params, x, label)
    np.testing.assert_allclose(got_first, ref_first, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_after, ref_after, rtol=1e-5, atol=1e-6)       # the update was the same
    for k in ref_params:
        np.testing.assert_allclose(got_params[k].asnumpy(), ref_params[k].asnumpy(), rtol=1e-5, atol=1e-6)


def test_module_inference_and_simple_bind_of_an_inference_fused_model():
    sym, arg, res = _fused("inference")
    x = nd.array(np.random.default_rng(2).normal(size=X_SHAPE))
    mod = mx.mod.Module(res.symbol, data_names=["data"], label_names=None, context=mx.cpu())
    mod.bind(data_shapes=[("data", X_SHAPE)], for_training=False)
    mod.set_params(res.arg_params, res.aux_params)
    mod.forward(mx.io.DataBatch([x]), is_train=False)
    ref = sym.bind(mx.cpu(), {**arg, "data": x}).forward()[0].asnumpy()
    np.testing.assert_allclose(mod.get_outputs()[0].asnumpy(), ref, rtol=1e-5, atol=1e-6)
    exe = res.symbol.simple_bind(mx.cpu(), data=(7, 3, 8), grad_req="null")     # another batch and length
    assert exe.outputs[0].shape == (7, 3, 4)


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_symbolblock_deferred_init_set_data_forward_backward(mode):
    sym, arg, res = _fused(mode)
    x = nd.array(np.random.default_rng(3).normal(size=X_SHAPE))
    outs, grads = [], []
    for s, params in ((sym, arg), (res.symbol, res.arg_params)):
        blk = gluon.SymbolBlock(s, [S.var("data")])
        blk.collect_params().initialize()                   # shapes unknown until the first call
        for k, p in blk.collect_params().items():
            p.set_data(params[k])
        with autograd.record():
            y = blk(x)
        y.backward()
        outs.append(y.asnumpy())
        grads.append({k: p.grad().asnumpy() for k, p in blk.collect_params().items()})
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    if mode == "training":          # the same parameters, the same gradients
        for k in grads[0]:
            np.testing.assert_allclose(grads[1][k], grads[0][k], rtol=1e-4, atol=1e-5)


def test_fused_graph_carries_every_parameter_shape():
    _, arg, res = _fused("training")
    nodes = json.loads(res.symbol.tojson())["nodes"]
    hints = {n["name"]: n.get("attrs", {}).get("__shape__") for n in nodes if n["op"] == "null"}
    assert hints.pop("data") is None                        # an input stays free
    for name, hint in hints.items():
        assert hint == str(tuple(res.arg_params[name].shape)), (name, hint)


def _infer(sym, **shapes):
    arg, out, _ = sym.infer_shape(**shapes)
    return dict(zip(sym.list_arguments(), arg)), out


def _var(name, rank):
    """A parameter MXNet knows only the rank of (as Gluon exports a deferred layer's: 0 = unknown)."""
    return S.var(name, shape=(0,) * rank)


CASES = {
    "fused_dense": (lambda: S.fused_dense(S.var("data"), _var("w", 2), _var("b", 1), num_hidden=16, flatten=False),
                    {"data": (2, 5, 8)}, {"w": (16, 8), "b": (16,)}, (2, 5, 16)),
    "fused_dense_flatten": (lambda: S.fused_dense(S.var("data"), _var("w", 2), _var("b", 1), num_hidden=3),
                            {"data": (2, 4, 5)}, {"w": (3, 20), "b": (3,)}, (2, 3)),
    "fused_add_layer_norm": (lambda: S.fused_add_layer_norm(S.var("data"), S.var("r"), _var("g", 1), _var("be", 1)),
                             {"data": (2, 5, 8), "r": (2, 5, 8)}, {"g": (8,), "be": (8,)}, (2, 5, 8)),
    "fused_grouped_conv": (lambda: S.fused_grouped_conv(S.var("data"), _var("w", 4), _var("b", 1), kernel=(3, 3),
                                                        pad=(1, 1), num_filter=8, num_group=4),
                           {"data": (1, 8, 5, 5)}, {"w": (8, 2, 3, 3), "b": (8,)}, (1, 8, 5, 5)),
    "fused_se": (lambda: S.fused_se(S.var("data"), _var("w1", 4), _var("b1", 1), _var("w2", 2), _var("b2", 1),
                                    num_hidden=2, fc1="conv", fc2="dense", act="relu"),
                 {"data": (1, 4, 3, 3)}, {"w1": (2, 4, 1, 1), "b1": (2,), "w2": (4, 2), "b2": (4,)}, (1, 4, 3, 3)),
    "fused_split_attention": (lambda: S.fused_split_attention(S.var("data"), _var("w1", 4), _var("b1", 1),
                                                              _var("w2", 4), _var("b2", 1), radix=2, num_hidden=6,
                                                              act="relu"),
                              {"data": (1, 8, 3, 3)},
                              {"w1": (6, 4, 1, 1), "b1": (6,), "w2": (8, 6, 1, 1), "b2": (8,)}, (1, 4, 3, 3)),
    "fused_concat_scale_act": (lambda: S.fused_concat_scale_act(S.var("data"), S.var("p"), _var("s", 3),
                                                                _var("t", 3), num_args=2),
                               {"data": (1, 2, 3, 3), "p": (1, 3, 3, 3)}, {"s": (5, 1, 1), "t": (5, 1, 1)},
                               (1, 5, 3, 3)),
    "fused_inverted_residual": (lambda: S.fused_inverted_residual(
        S.var("data"), _var("we", 4), _var("be", 1), _var("wd", 4), _var("bd", 1), _var("wp", 4), _var("bp", 1),
        num_expand=8, num_filter=4, kernel=3),
        {"data": (1, 4, 5, 5)},
        {"we": (8, 4, 1, 1), "be": (8,), "wd": (8, 1, 3, 3), "bd": (8,), "wp": (4, 8, 1, 1), "bp": (4,)}, (1, 4, 5, 5)),
    "fused_dense_block": (lambda: S.fused_dense_block(
        S.var("data"), _var("s", 3), _var("t", 3), _var("w1", 4), _var("b1", 1), _var("w2", 4), _var("b2", 1),
        num_layers=1, growth=4, bottleneck=8),
        {"data": (1, 4, 5, 5)},
        {"s": (4, 1, 1), "t": (4, 1, 1), "w1": (8, 4, 1, 1), "b1": (8,), "w2": (4, 8, 3, 3), "b2": (4,)}, (1, 8, 5, 5)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_library_op_infers_its_parameters_from_the_data(case):
    make, data, want, out = CASES[case]
    shapes, outs = _infer(make(), **data)
    assert {k: v for k, v in shapes.items() if k in want} == want
    assert outs == [out]


def test_unknown_data_and_contradicting_hints_are_named():
    w = S.var("w", shape=(0, 0))
    with pytest.raises(mx.MXNetError, match=r"input 1 \(weight\) is given as \(5,\?\) but must be \(16,8\)"):
        S.fused_dense(S.var("data"), S.var("w", shape=(5, 0)), no_bias=True, num_hidden=16,
                      flatten=False).infer_shape(data=(2, 5, 8))
    y = S.fused_dense(S.FullyConnected(S.var("data"), w, no_bias=True, num_hidden=8), _var("w2", 2), no_bias=True,
                      num_hidden=4)
    with pytest.raises(mx.MXNetError, match=r"input 0 \(data\) is unknown"):   # the op infers from data, not the reverse
        y.infer_shape_partial()
