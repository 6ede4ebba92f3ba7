"""patterns/qkv_projection.py: three projections of one input feeding an attention → one product.

Against the original graph (MXNet's own ops) at the float32 tolerance, against a NumPy float32
reference of the attention block, and under precision="bf16" against the same fusion without the
rule (only the GEMM's blocking may differ); refusals with their reasons.
"""
import math

import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.precision import policy as P
from patterns import default_rules

from conftest import ops, random_params

S = mx.sym
H, D, C = 4, 8, 32


def _block(act_q=None, widths=(C, C, C), mask=False):
    """Self-attention over x (B, S, C): q/k/v projections, head split, softmax, merge, output projection."""
    x = S.var("data")

    def split(t):
        return S.reshape(S.transpose(S.reshape(t, shape=(0, 0, H, -1)), axes=(0, 2, 1, 3)), shape=(-3, 0, 0))

    proj = {n: S.FullyConnected(x, num_hidden=w, flatten=False, name=n) for n, w in zip("qkv", widths)}
    if act_q:
        proj["q"] = S.Activation(proj["q"], act_type=act_q)
    s = S.batch_dot(split(proj["q"]), split(proj["k"]), transpose_b=True) / math.sqrt(D)
    if mask:
        s = S.broadcast_add(s, S.var("mask"))
    o = S.batch_dot(S.softmax(s, axis=-1), split(proj["v"]))
    o = S.reshape(S.transpose(S.reshape(o, shape=(-4, -1, H, 0, 0)), axes=(0, 2, 1, 3)), shape=(0, 0, -3))
    return S.FullyConnected(o, num_hidden=C, flatten=False, name="out")


def _numpy_block(x, p, mask=None):
    def proj(n):
        return x @ p[n + "_weight"].T + p[n + "_bias"]

    def split(t):
        b, s, _ = t.shape
        return t.reshape(b, s, H, -1).transpose(0, 2, 1, 3)

    q, k, v = (split(proj(n)) for n in "qkv")
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(D)
    if mask is not None:
        s = s + mask.reshape(s.shape[0], H, *s.shape[2:])
    e = np.exp(s - s.max(-1, keepdims=True))
    o = (e / e.sum(-1, keepdims=True)) @ v
    b, _, sq, _ = o.shape
    o = o.transpose(0, 2, 1, 3).reshape(b, sq, -1)
    return (o @ p["out_weight"].T + p["out_bias"]).astype(np.float32)


def _without_rule():
    return [r for r in default_rules() if r.name != "qkv_projection"]


@pytest.mark.parametrize("mask", [False, True])
def test_three_projections_become_one_product(mask):
    sym = _block(mask=mask)
    shapes = {"data": (2, 12, C)}
    if mask:
        shapes["mask"] = (2 * H, 12, 12)
    arg, aux = random_params(sym, shapes, inputs=["data", "mask"] if mask else None)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    assert ops(res) == {"fused_dense": 2, "fused_attention": 1}, res.report.to_text(explain=True)
    dense = [n for n in res.graph.op_nodes() if n.op == "fused_dense"]
    assert sorted(int(n.attrs["num_hidden"]) for n in dense) == [C, 3 * C]
    attn = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert attn.attrs.raw("layout") == "packed_qkv" and len(attn.inputs) == (2 if mask else 1)
    v = fusion.verify((sym, arg, aux), res, input_shapes=shapes)
    assert v.max_rel <= 1e-4, v
    rng = np.random.default_rng(4)
    feed = {"data": rng.standard_normal(shapes["data"]).astype(np.float32)}
    if mask:
        feed["mask"] = rng.standard_normal(shapes["mask"]).astype(np.float32)
    exe = res.symbol.bind(mx.cpu(), {**res.arg_params, **{k: mx.nd.array(x) for k, x in feed.items()}},
                          grad_req="null")
    want = _numpy_block(feed["data"], {k: a.asnumpy() for k, a in arg.items()}, feed.get("mask"))
    for _ in range(2):      # first call, then the weight prepacked
        got = exe.forward(is_train=False)[0].asnumpy()
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.skipif(P.native_bf16_reason() is not None, reason="CPU without native bfloat16")
def test_bf16_one_product_rounds_x_once_with_the_same_weight_bits():
    sym = _block()
    shapes = {"data": (1, 16, C)}
    arg, aux = random_params(sym, shapes)
    arg = {k: v * 0.3 for k, v in arg.items()}      # BERT-like scores (unit-normal weights saturate the softmax)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16")
    three = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16", rules=_without_rule())
    assert ops(res) == {"fused_dense": 2, "fused_attention": 1} and ops(three)["fused_dense"] == 4
    w = res.arg_params["q_weight_qkv_bf16"]
    assert w.dtype == P.BF16 and w.shape == (3 * C, C)
    want = np.concatenate([three.arg_params[n + "_weight_bf16"].asnumpy().view(np.uint16) for n in "qkv"])
    assert np.array_equal(w.asnumpy().view(np.uint16), want)
    assert not any(k in res.arg_params for k in ("q_weight_qkv", "q_weight", "k_weight_bf16"))
    x = np.random.default_rng(1).standard_normal(shapes["data"]).astype(np.float32)
    outs = []
    for r in (res, three):
        exe = r.symbol.bind(mx.cpu(), {**r.arg_params, "data": mx.nd.array(x)}, grad_req="null")
        outs.append([exe.forward(is_train=False)[0].asnumpy() for _ in range(2)])
    for a, b in zip(*outs):
        assert np.abs(a - b).max() <= 1e-3 * np.abs(b).max()     # the bf16 products' order only
    assert fusion.verify((sym, arg, aux), res, input_shapes=shapes).max_rel <= P.TOLERANCE[P.BFLOAT16]


def _rejections(res):
    return [r for rr in res.report.rules.values() for r in rr.rejected.values()]


def test_projection_with_an_activation_refused_with_reason():
    sym = _block(act_q="relu")
    shapes = {"data": (2, 12, C)}
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    assert ops(res).get("fused_dense") == 4, res.report.to_text(explain=True)
    assert any("has the activation act_relu" in r for r in _rejections(res)), _rejections(res)


def test_qkv_projection_refused_in_training():
    sym = _block()
    shapes = {"data": (2, 12, C)}
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, mode="training")
    assert "fused_dense" not in ops(res) or ops(res)["fused_dense"] != 2
    assert not any(n.attrs.raw("layout") == "packed_qkv" for n in res.graph.op_nodes())
