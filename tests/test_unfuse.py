"""unfuse: every fused_* op back into stock MXNet ops; the round trip keeps the numbers."""
import math

import mxnet as mx
import pytest

import fusion
from fusion.ir.graph import Graph

from conftest import random_params

S = mx.sym


def roundtrip(y, shapes, inputs=None, rules=None, **kw):
    """fuse → unfuse; the un-fused symbol has no fused op and matches the original."""
    arg, aux = random_params(y, shapes, inputs=inputs)
    data = {k: v for k, v in shapes.items() if k not in arg}
    res = fusion.fuse(y, arg, aux, input_shapes=data, rules=rules, **kw)
    assert any(op.startswith("fused_") for op in res.graph.count_ops()), res.report.to_text()
    plain = fusion.unfuse(res.symbol, data, res.arg_params, res.aux_params)
    assert not any(op.startswith("fused_") for op in Graph.from_symbol(plain).count_ops())
    v = fusion.verify(y, (plain, res.arg_params, res.aux_params), (arg, aux), data)
    assert v.max_rel <= 1e-5, v
    return plain


B, L, H, D = 2, 5, 3, 4
E = H * D


def mha(x, packed=False, mask=False):
    fc = lambda t, n, k=E: S.FullyConnected(t, num_hidden=k, flatten=False, name=n)

    def split(t):
        return S.reshape(S.transpose(S.reshape(t, shape=(0, 0, H, -1)), axes=(0, 2, 1, 3)), shape=(-3, 0, 0))

    if packed:
        parts = S.split(fc(x, "qkv", 3 * E), num_outputs=3, axis=-1)
        q, k, v = (split(parts[i]) for i in range(3))
    else:
        q, k, v = split(fc(x, "q")), split(fc(x, "k")), split(fc(x, "v"))
    s = S.batch_dot(q, k, transpose_b=True) / math.sqrt(D)
    if mask:
        s = S.broadcast_add(s, S.var("mask"))
    o = S.batch_dot(S.softmax(s, axis=-1), v)
    return S.reshape(S.transpose(S.reshape(o, shape=(-4, -1, H, 0, 0)), axes=(0, 2, 1, 3)), shape=(0, 0, -3))


@pytest.mark.parametrize("packed,mask", [(False, False), (True, False), (False, True)])
def test_attention_layouts(packed, mask):
    shapes = {"x": (B, L, 7)}
    if mask:
        shapes["mask"] = (B * H, 1, L)
    roundtrip(mha(S.var("x"), packed, mask), shapes, inputs=set(shapes))


def test_transformer_layer_all_ops():
    x = S.var("x")
    h = S.LayerNorm(mha(x) + S.FullyConnected(x, num_hidden=E, flatten=False, name="res"),
                    S.var("g"), S.var("b"), name="ln")
    f = S.FullyConnected(h, num_hidden=2 * E, flatten=False, name="f1")
    f = (f * 0.5) * (1 + S.tanh((f + 0.044715 * f ** 3) * math.sqrt(2 / math.pi)))
    y = S.FullyConnected(f, num_hidden=E, flatten=False, name="f2") * S.clip(h + 3, 0, 6) / 6
    roundtrip(y, {"x": (B, L, 7)}, inputs={"x"})


@pytest.mark.parametrize("act", ["relu", "sigmoid", "tanh", "softrelu"])
def test_dense(act):
    y = S.Activation(S.FullyConnected(S.var("x"), num_hidden=6, name="fc"), act_type=act)
    roundtrip(y, {"x": (10, 4)})


def test_elemwise_with_where_and_broadcast():
    x, z = S.var("x"), S.var("z")
    y = S.where(x > 0.0, S.exp(-x), S.square(x)) + S.broadcast_maximum(x, z) * 2
    roundtrip(y, {"x": (2, 3, 4), "z": (1, 4)}, inputs={"x", "z"}, rules=["elementwise"])


def test_interleaved_selfatt():
    x = S.var("x")
    qkv = S.FullyConnected(x, num_hidden=3 * E, flatten=False, name="qkv")
    s = S.contrib.interleaved_matmul_selfatt_qk(qkv, heads=H)
    y = S.contrib.interleaved_matmul_selfatt_valatt(qkv, S.softmax(s, axis=-1), heads=H)
    roundtrip(y, {"x": (L, B, 7)}, rules=["attention_fusion"])


def test_folded_conv_stays_folded_and_plain_graph_unchanged():
    x = S.var("data")
    y = S.BatchNorm(S.Convolution(x, num_filter=4, kernel=(3, 3), name="c"), name="bn")
    arg, aux = random_params(y, {"data": (1, 3, 6, 6)})
    res = fusion.fuse(y, arg, aux)
    assert fusion.unfuse(res.symbol).tojson() == res.symbol.tojson()


def test_add_layer_norm_whose_sum_is_a_graph_output():
    a, b = S.var("a"), S.var("b")
    s = a + b
    y = S.Group([S.LayerNorm(s, S.var("g"), S.var("be")), s])
    plain = roundtrip(y, {"a": (2, 3, 8), "b": (2, 3, 8), "g": (8,), "be": (8,)}, inputs={"a", "b"})
    assert "LayerNorm" in plain.tojson()


def test_add_layer_norm_sum_feeding_another_fused_op():
    a, b = S.var("a"), S.var("b")
    s = a + b
    h = S.LayerNorm(s, S.var("g1"), S.var("b1"))
    y = S.LayerNorm(S.FullyConnected(h, num_hidden=8, flatten=False, name="fc") + s, S.var("g2"), S.var("b2"))
    roundtrip(y, {"a": (2, 9, 8), "b": (2, 9, 8), "g1": (8,), "b1": (8,), "g2": (8,), "b2": (8,)},
              inputs={"a", "b"})
