"""ResNeSt's split attention (patterns/split_attention.py → fused_split_attention).

GluonCV's ``SplitAttentionConv`` at radix 1, 2 and 4 and several cardinalities, the
whole network, the op against NumPy, un-fusing, and the refusals with their reasons.
"""
import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.testing.gluoncv import _blocks, export, resnest

from conftest import assert_unfuse_round_trip, fuse_and_check, ops

RULES = ["split_attention"]
X = {"data": (2, 16, 7, 6)}


def fused_by(res):
    return {name: len(r.fused) for name, r in res.report.rules.items() if r.fused}


def rejections(res, rule):
    return " | ".join(res.report.rules[rule].rejected.values())


def splat(radix=2, groups=1, channels=16, r=2):
    """GluonCV's SplitAttentionConv over ``data`` (channels in and out)."""
    with mx.name.NameManager():
        net = _blocks()["SplitAttentionConv"](channels, 3, padding=1, groups=groups, radix=radix,
                                               in_channels=channels, r=r, use_bias=False)
        return export(net, X["data"])


def attention_sym(radix=2, card=1, C=8, hidden=4, softmax_axis=1, swap=(1, 2), pool="adaptive", temperature=None,
                  view=None):
    """The attention after a split map ``data`` (N, R·C, H, W), written with MXNet's ops."""
    x = mx.sym.var("data")
    split = mx.sym.reshape(mx.sym.expand_dims(x, axis=1), shape=(0, radix, C, 0, 0))
    gap = mx.sym.sum(split, axis=1)
    if pool == "adaptive":
        gap = mx.sym.contrib.AdaptiveAvgPooling2D(gap, output_size=1)
    else:
        gap = mx.sym.Pooling(gap, pool_type="avg", kernel=(3, 3))
    h = mx.sym.relu(mx.sym.Convolution(gap, kernel=(1, 1), num_filter=hidden, num_group=card, name="fc1"))
    a = mx.sym.Convolution(h, kernel=(1, 1), num_filter=radix * C, num_group=card, name="fc2")
    a = mx.sym.swapaxes(mx.sym.reshape(a, shape=view or (0, card, radix, -1)), dim1=swap[0], dim2=swap[1])
    kw = {"temperature": temperature} if temperature else {}
    a = mx.sym.reshape(mx.sym.softmax(a, axis=softmax_axis, **kw), shape=(0, radix, -1, 1, 1))
    return mx.sym.sum(mx.sym.broadcast_mul(a, split), axis=1)


@pytest.mark.parametrize("radix,groups,rule", [(2, 1, "split_attention_radix"), (2, 2, "split_attention_radix"),
                                               (4, 1, "split_attention_radix"), (4, 4, "split_attention_radix"),
                                               (1, 1, "split_attention_radix1"), (1, 2, "split_attention_radix1")])
def test_gluoncv_split_attention_fuses_exactly(radix, groups, rule):
    sym, arg, aux = splat(radix, groups)
    res = fusion.fuse(sym, arg, aux, input_shapes=X)
    assert fused_by(res).get(rule) == 1, res.report.to_text(explain=True)
    assert ops(res).get("fused_split_attention") == 1 and not {"sum", "softmax", "broadcast_mul"} & set(ops(res))
    for shape in (X["data"], (3, 16, 5, 9)):      # every size the original accepts
        v = fusion.verify((sym, arg, aux), res, input_shapes={"data": shape})
        assert v.max_rel <= 1e-4, v


def test_batchnorm_is_folded_when_the_rule_runs_alone():
    sym, arg, aux = splat(2, 2)
    res = fusion.fuse(sym, arg, aux, rules=RULES, input_shapes=X)
    assert fused_by(res) == {"split_attention_radix": 1}, res.report.to_text(explain=True)
    assert ops(res)["BatchNorm"] == 1            # the split convolution's own BatchNorm stays
    assert fusion.verify((sym, arg, aux), res, input_shapes=X).max_rel <= 1e-4


@pytest.mark.parametrize("kw,reason", [
    ({"softmax_axis": 2}, "not the radix axis 1"),
    ({"swap": (1, 3)}, "not 1 and 2"),
    ({"pool": "window"}, "is not global"),
    ({"temperature": 2.0}, "temperature"),
    ({"view": (0, 2, -1, 2)}, "not (N, A, R=2"),
])
def test_refusals(kw, reason):
    shapes = {"data": (2, 16, 3, 3)}
    res = fuse_and_check(attention_sym(**kw), shapes, rules=RULES)
    assert "fused_split_attention" not in ops(res)
    assert reason in rejections(res, "split_attention_radix"), res.report.to_text(explain=True)


def test_written_with_mxnet_ops_fuses():
    shapes = {"data": (2, 16, 3, 3)}
    res = fuse_and_check(attention_sym(card=2), shapes, rules=RULES)
    assert fused_by(res) == {"split_attention_radix": 1}, res.report.to_text(explain=True)


def test_training_is_refused():
    """(Without input shapes the block fuses: tests/test_no_input_shapes.py.)"""
    sym, arg, aux = splat()
    res = fusion.fuse(sym, arg, aux, rules=RULES, mode="training", input_shapes=X)
    assert "fused_split_attention" not in ops(res)
    assert "no backward" in res.report.to_text(explain=True)


def test_split_view_used_elsewhere_is_refused():
    shapes = {"data": (2, 16, 3, 3)}
    y = attention_sym()
    split = y.get_internals()[[n for n in y.get_internals().list_outputs() if n.startswith("reshape")][0]]
    res = fuse_and_check(mx.sym.Group([y, mx.sym.tanh(split)]), shapes, rules=RULES)
    assert "fused_split_attention" not in ops(res)


@pytest.mark.parametrize("radix,groups", [(2, 2), (1, 2), (4, 1)])
def test_unfuse_restores_stock_ops(radix, groups):
    sym, arg, aux = splat(radix, groups)
    res = fusion.fuse(sym, arg, aux, input_shapes=X)
    assert "fused_split_attention" in ops(res)
    assert_unfuse_round_trip(sym, arg, aux, res, X, "fused_split_attention")


def test_resnest_network():
    shape = (1, 3, 64, 64)
    with mx.name.NameManager():
        sym, arg, aux = export(resnest(layers=(1, 1), stem_width=8, classes=10), shape)
    res = fusion.fuse(sym, arg, aux, input_shapes={"data": shape})
    assert fused_by(res).get("split_attention_radix") == 2, res.report.to_text(explain=True)
    assert not {"sum", "softmax", "expand_dims", "SwapAxis", "BatchNorm"} & set(ops(res)), ops(res)
    for s in (shape, (2, 3, 64, 64)):
        assert fusion.verify((sym, arg, aux), res, input_shapes={"data": s}).max_rel <= 1e-4


# ------------------------------------------------------------------ the op itself
def reference(x, w1, b1, w2, b2, R, A, g1, g2):
    N, RC, H, W = x.shape
    C, Cm = RC // R, w1.shape[0]
    p = x.reshape(N, R, C, H, W).sum(1).mean((2, 3))
    h = np.concatenate([p[:, g * C // g1:(g + 1) * C // g1] @ w1[g * Cm // g1:(g + 1) * Cm // g1, :, 0, 0].T
                        for g in range(g1)], 1) + b1
    h = np.maximum(h, 0)
    a = np.concatenate([h[:, g * Cm // g2:(g + 1) * Cm // g2] @ w2[g * RC // g2:(g + 1) * RC // g2, :, 0, 0].T
                        for g in range(g2)], 1) + b2
    a = a.reshape(N, A, R, C // A).transpose(0, 2, 1, 3)
    if R > 1:
        e = np.exp(a - a.max(1, keepdims=True))
        att = (e / e.sum(1, keepdims=True)).reshape(N, R, C, 1, 1)
    else:
        att = (1 / (1 + np.exp(-a))).reshape(N, 1, C, 1, 1)
    return (att * x.reshape(N, R, C, H, W)).sum(1)


@pytest.mark.parametrize("R,A,g1,g2", [(2, 1, 1, 1), (2, 2, 2, 2), (4, 2, 1, 2), (1, 4, 4, 4), (3, 1, 1, 1)])
def test_op_matches_numpy(R, A, g1, g2):
    rng = np.random.default_rng(R * 10 + A)
    N, C, H, W, Cm = 2, 8, 5, 7, 8
    x = rng.standard_normal((N, R * C, H, W)).astype(np.float32)
    w1 = rng.standard_normal((Cm, C // g1, 1, 1)).astype(np.float32)
    w2 = rng.standard_normal((R * C, Cm // g2, 1, 1)).astype(np.float32)
    b1, b2 = rng.standard_normal(Cm).astype(np.float32), rng.standard_normal(R * C).astype(np.float32)
    y = mx.nd.fused_split_attention(*(mx.nd.array(v) for v in (x, w1, b1, w2, b2)), radix=R, att_groups=A,
                                    num_group1=g1, num_group2=g2, act="relu",
                                    gate="softmax" if R > 1 else "sigmoid").asnumpy()
    np.testing.assert_allclose(y, reference(x, w1, b1, w2, b2, R, A, g1, g2), rtol=1e-5, atol=1e-5)


def test_op_rejects_bad_shapes():
    x = mx.nd.zeros((1, 16, 3, 3))
    with pytest.raises(mx.MXNetError, match="w2 must be"):
        mx.nd.fused_split_attention(x, mx.nd.zeros((4, 8, 1, 1)), mx.nd.zeros((8, 4, 1, 1)), radix=2,
                                    no_bias1=True, no_bias2=True).wait_to_read()
    with pytest.raises(mx.MXNetError, match="needs radix=1"):
        mx.nd.fused_split_attention(x, mx.nd.zeros((4, 8, 1, 1)), mx.nd.zeros((16, 4, 1, 1)), radix=2,
                                    gate="sigmoid", no_bias1=True, no_bias2=True).wait_to_read()
