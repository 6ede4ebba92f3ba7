"""The fused model's outputs keep the names the original gave them (fusion/ir/names.py): a rewrite
that replaces the node computing an output (BatchNorm folded, Dropout or an identity removed,
a two-output fused op, a folded parameter) would otherwise rename it, and code reading outputs
by name (``executor.output_dict``, metrics' ``output_names``) would miss it."""
import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.ir.graph import Graph
from fusion.ir.names import keep_output_names

from conftest import fuse_and_check, ops, random_params

S = mx.sym


def _check(sym, shapes, arg=None, aux=None, mode="inference", **kw):
    if arg is None:
        arg, aux = random_params(sym, shapes)
    res = fuse_and_check(sym, shapes, arg, aux, mode=mode, **kw) if mode == "inference" else \
        fusion.fuse(sym, arg, aux, mode=mode, input_shapes={k: v for k, v in shapes.items() if k not in arg}, **kw)
    assert res.symbol.list_outputs() == sym.list_outputs(), (res.symbol.list_outputs(), res.report.to_text())
    plain = fusion.unfuse(res.symbol)
    assert plain.list_outputs() == sym.list_outputs()
    again = fusion.fuse(res.symbol, res.arg_params, res.aux_params,
                        input_shapes={k: v for k, v in shapes.items() if k not in arg})
    assert again.symbol.list_outputs() == sym.list_outputs()
    return res


def test_folded_batchnorm_output_keeps_its_name_by_renaming_the_convolution():
    y = S.BatchNorm(S.Convolution(S.var("x"), kernel=(3, 3), num_filter=4, name="conv0"), name="bn0")
    res = _check(y, {"x": (1, 3, 8, 8)}, rules=["conv_bn"])
    assert res.report.rules["conv_bn"].fused
    assert ops(res) == {"Convolution": 1}              # no copy: the convolution took the name
    assert res.graph.op_nodes()[0].name == "bn0"


def test_removed_dropout_and_identity_outputs_keep_their_names():
    x = S.var("x")
    a = S.Dropout(S.relu(x, name="r"), p=0.1, name="dr")
    b = S.identity(S.relu(x, name="r2"), name="idn")
    c = S.identity(x, name="idx")                       # a variable: handed out through a copy
    d = S.relu(x, name="r3")
    y = S.Group([a, b, c, d, S.identity(d, name="twice")])   # the same value two outputs
    res = _check(y, {"x": (2, 3)}, {}, {}, rules=["dropout", "identity"])
    assert res.report.rules["dropout"].fused and res.report.rules["identity"].fused


def test_two_output_fused_op_outputs_keep_their_names():
    """skip_layer_norm's fused_add_layer_norm writes y and the residual sum; both are model
    outputs here, named after the LayerNorm and the add: copies name them, the fused op is
    renamed <name>_fused, and the report names it so."""
    s = S.elemwise_add(S.var("a"), S.var("b"), name="res0")
    y = S.LayerNorm(s, S.var("g"), S.var("be"), name="ln0")
    sym = S.Group([y, s])
    res = _check(sym, {"a": (2, 5, 8), "b": (2, 5, 8)}, rules=["skip_layer_norm"])
    assert ops(res).get("fused_add_layer_norm") == 1
    fused = [n.name for n in res.graph.op_nodes() if n.op == "fused_add_layer_norm"]
    assert fused == [res.report.rules["skip_layer_norm"].fused[0]["new"][0]], res.report.rules["skip_layer_norm"].fused
    # and in training (the rule applies there too), with gradients unchanged
    tr = _check(sym, {"a": (2, 5, 8), "b": (2, 5, 8)}, mode="training", rules=["skip_layer_norm"])
    assert ops(tr).get("fused_add_layer_norm") == 1


def test_folded_parameter_output_keeps_its_name():
    w = S.reshape(S.var("w"), shape=(-1,), name="flat")
    y = S.Group([w, S.relu(S.var("x"), name="r")])
    _check(y, {"x": (3,), "w": (2, 3)}, {"w": mx.nd.ones((2, 3))}, {}, rules=["inference_cleanup"])


def test_identity_removed_in_training_with_gradients_unchanged():
    x, w = S.var("x"), S.var("w")
    y = S.FullyConnected(S.identity(S.relu(x)), w, num_hidden=4, no_bias=True, name="fc")
    shapes = {"x": (2, 3), "w": (4, 3)}
    arg, aux = random_params(y, shapes, inputs={"x"})
    res = fusion.fuse(y, arg, aux, mode="training", rules=["identity"], input_shapes={"x": (2, 3)})
    assert "_copy" not in ops(res)
    xv = mx.nd.array(np.random.default_rng(0).standard_normal((2, 3)))
    got = []
    for s in (y, res.symbol):
        grads = {"x": mx.nd.zeros((2, 3)), "w": mx.nd.zeros((4, 3))}
        e = s.bind(mx.cpu(), {"x": xv, "w": arg["w"]}, args_grad=grads)
        out = e.forward(is_train=True)[0].asnumpy()
        e.backward(mx.nd.ones((2, 4)))
        got.append((out, grads["x"].asnumpy(), grads["w"].asnumpy()))
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)


def test_a_name_no_node_can_spell_is_reported_not_forced():
    """An output name MXNet derives from an op's own output names (SliceChannel's second output,
    ``s_output1``) cannot be given to another node: keep_output_names leaves it and says so."""
    g = Graph.from_symbol(S.relu(S.var("x"), name="r"))
    lost, renamed = keep_output_names(g, ["s_output1"])
    assert lost == ["s_output1 -> r_output"] and renamed == {}
    assert g.to_symbol().list_outputs() == ["r_output"]


@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_names_kept_in_a_transformer_block(precision):
    from fusion.precision.policy import native_bf16_reason
    if precision == "bf16" and native_bf16_reason() is not None:
        pytest.skip(native_bf16_reason())
    x = S.var("data")
    h = S.LayerNorm(S.FullyConnected(x, num_hidden=16, flatten=False, name="fc1") + x, S.var("g1"), S.var("b1"),
                    name="ln1")
    y = S.LayerNorm(S.FullyConnected(S.Activation(S.FullyConnected(h, num_hidden=32, flatten=False, name="fc2"),
                                                  act_type="relu"), num_hidden=16, flatten=False, name="fc3") + h,
                    S.var("g2"), S.var("b2"), name="ln2")
    shapes = {"data": (2, 8, 16)}
    arg, aux = random_params(y, shapes)
    res = fusion.fuse(y, arg, aux, input_shapes=shapes, precision=precision, force=True)
    assert res.report.fused_count >= 3
    assert res.symbol.list_outputs() == ["ln2_output"]
