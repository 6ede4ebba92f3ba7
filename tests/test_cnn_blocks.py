"""GluonCV CNN blocks: squeeze-excitation (patterns/squeeze_excitation.py → fused_se).

Every SE form GluonCV writes (SE-ResNeXt's 1×1 convs, SE-ResNet's Dense layers with
expand_dims, MobileNetV3's hard-sigmoid gate after a hard-swish, the pose networks' gate
broadcast_like'd to the map and multiplied elementwise), the spellings MXNet allows besides
(sigmoid/hard_sigmoid ops, mean/Pooling, Reshape, operands swapped, broadcast_like's axes),
and the refusals with their reasons.
"""
import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.testing.gluoncv import export, mobilenetv3, se_resnet, se_resnext

from conftest import assert_unfuse_round_trip, fuse_and_check, ops, random_params

# the block rules as they fuse where no region takes their blocks (tests/test_region.py: regions)
pytestmark = pytest.mark.usefixtures("no_regions")

SE_RULES = ["squeeze_excitation"]
X = {"data": (2, 8, 5, 6)}


def fused_by(res):
    return {name: len(r.fused) for name, r in res.report.rules.items() if r.fused}


def rejections(res, rule):
    return " | ".join(res.report.rules[rule].rejected.values())


def se_sym(pool="adaptive", fc="conv", act="Activation", gate="Activation", reshape=None, swap=False,
           bias=True, tail=None, hswish=False, hidden=4, like=None):
    """An SE block over ``data`` written with MXNet's ops, in the spelling chosen.  ``like``: the gate
    broadcast_like'd to the map first, then multiplied: ``elemwise`` (elemwise_mul), ``operator``
    (``*``), ``axes`` (lhs_axes = rhs_axes = (2, 3)), ``negative_axes`` (lhs_axes = rhs_axes = (-1, -2),
    then broadcast_mul), ``wrong_axes`` (the map's W repeated along the gate's H: (N, C, W, 1), then
    broadcast_mul), ``other`` (the shape taken from another input)."""
    z = mx.sym.var("data")
    x = z * (mx.sym.clip(z + 3., 0, 6) / 6.) if hswish else z
    if pool == "adaptive":
        p = mx.sym.contrib.AdaptiveAvgPooling2D(x, output_size=1)
    elif pool == "global":
        p = mx.sym.Pooling(x, global_pool=True, pool_type="avg", kernel=(1, 1))
    elif pool == "mean":
        p = mx.sym.mean(x, axis=(2, 3), keepdims=True)
    elif pool == "window":
        p = mx.sym.Pooling(x, pool_type="avg", kernel=(5, 6))
    elif pool == "mean_w":
        p = mx.sym.mean(x, axis=3, keepdims=True)

    def layer(v, units, k):
        if fc == "conv":
            return mx.sym.Convolution(v, kernel=(1, 1), num_filter=units, no_bias=not bias, name="fc%d" % k)
        if fc == "conv3":
            return mx.sym.Convolution(v, kernel=(3, 3), pad=(1, 1), num_filter=units, no_bias=not bias,
                                      name="fc%d" % k)
        return mx.sym.FullyConnected(v, num_hidden=units, no_bias=not bias, name="fc%d" % k)

    h = layer(p, hidden, 1)
    h = mx.sym.Activation(h, act_type="relu") if act == "Activation" else mx.sym.relu(h)
    g = layer(h, 8, 2)
    g = {"Activation": lambda v: mx.sym.Activation(v, act_type="sigmoid"), "sigmoid": mx.sym.sigmoid,
         "hard_sigmoid": lambda v: mx.sym.hard_sigmoid(v, alpha=0.25, beta=0.4),
         "clip": lambda v: mx.sym.clip(v + 3., 0, 6) / 6.}[gate](g)
    if reshape == "expand":
        g = g.expand_dims(axis=2).expand_dims(axis=2)
    elif reshape == "expand_last":                     # GluonCV's fast_pose SELayer
        g = g.expand_dims(-1).expand_dims(-1)
    elif reshape == "reshape":
        g = mx.sym.Reshape(g, shape=(0, 0, 1, 1))
    elif reshape == "channels_on_h":                   # (N, 1, C, 1): not a gate of the channels
        g = mx.sym.Reshape(g, shape=(0, 1, -1, 1))
    mul = mx.sym.broadcast_mul
    if like is not None:
        axes = {"axes": dict(lhs_axes=(2, 3), rhs_axes=(2, 3)), "negative_axes": dict(lhs_axes=(-1, -2), rhs_axes=(-1, -2)),
                "wrong_axes": dict(lhs_axes=(2,), rhs_axes=(3,))}.get(like, {})
        g = mx.sym.broadcast_like(g, mx.sym.var("other") if like == "other" else x, **axes)
        mul = {"elemwise": mx.sym.elemwise_mul, "operator": lambda a, b: a * b,
               "axes": mx.sym.elemwise_mul, "other": mx.sym.elemwise_mul}.get(like, mx.sym.broadcast_mul)
    y = mul(g, x) if swap else mul(x, g)
    if tail:
        y = y + mx.sym.var("res")
        if tail == "relu":
            y = mx.sym.Activation(y, act_type="relu")
    return y


@pytest.mark.parametrize("kw,rule", [
    ({}, "se"),                                                               # SE-ResNeXt's SE
    ({"fc": "dense", "reshape": "expand"}, "se"),                             # SE-ResNet's SE
    ({"fc": "dense", "reshape": "reshape", "bias": False, "swap": True}, "se"),
    ({"pool": "global", "gate": "clip"}, "se"),                               # MobileNetV3's SE after relu
    ({"pool": "mean", "act": "relu", "gate": "sigmoid"}, "se"),
    ({"gate": "hard_sigmoid"}, "se"),
    ({"pool": "global", "gate": "clip", "hswish": True}, "se_hard_swish"),    # ... after hard-swish
    ({"tail": "relu"}, "se_add"),                                             # relu(SE(x) + residual)
    ({"fc": "dense", "reshape": "expand", "tail": "plain"}, "se_add"),        # SE-ResNet V2: SE(x) + residual
    # the gate broadcast_like'd to the map, then multiplied
    ({"fc": "dense", "reshape": "expand_last", "like": "operator", "swap": True}, "se"),   # GluonCV's fast_pose
    ({"like": "elemwise"}, "se"),
    ({"like": "elemwise", "swap": True, "gate": "sigmoid"}, "se"),
    ({"like": "operator", "fc": "dense", "reshape": "reshape"}, "se"),
    ({"like": "axes"}, "se"),
    ({"like": "negative_axes", "swap": True}, "se"),
    ({"like": "operator", "tail": "relu"}, "se_add"),
    ({"pool": "global", "gate": "clip", "hswish": True, "like": "operator"}, "se_hard_swish"),
])
def test_se_forms_fuse_exactly(kw, rule):
    shapes = dict(X, res=X["data"]) if kw.get("tail") else X
    res = fuse_and_check(se_sym(**kw), shapes, rules=SE_RULES)
    assert fused_by(res) == {rule: 1}, res.report.to_text(explain=True)
    assert ops(res) == {"fused_se": 1}, ops(res)
    # every size the original accepts: another batch and plane size
    other = {k: (3, 8, 7, 4) for k in shapes}
    arg, aux = random_params(se_sym(**kw), shapes)
    v = fusion.verify(se_sym(**kw), fusion.fuse(se_sym(**kw), arg, aux, rules=SE_RULES, input_shapes=shapes),
                      (arg, aux), other)
    assert v.max_rel <= 1e-4, v


@pytest.mark.parametrize("kw,reason", [
    ({"pool": "window"}, "is not global"),
    ({"pool": "mean_w"}, "is not over axes (2, 3)"),
    ({"fc": "conv3"}, "not 1×1"),
])
def test_se_refusals(kw, reason):
    res = fuse_and_check(se_sym(**kw), X, rules=SE_RULES)
    assert "fused_se" not in ops(res)
    assert reason in rejections(res, "se"), res.report.to_text(explain=True)


@pytest.mark.parametrize("kw,shape,reason", [
    # repeats the gate's W axis along H: (N, C, W, 1), a shape MXNet broadcasts over the square map only
    ({"like": "wrong_axes"}, (2, 8, 6, 6), "gives shape (2, 8, 6, 1), neither the map's (2, 8, 6, 6) nor the gate's"),
    # the channels' gate on the H axis (H = C here): broadcast_like fills the map, but not by channel
    ({"fc": "dense", "reshape": "channels_on_h", "like": "elemwise"}, (2, 8, 8, 6),
     "the gate has shape (2, 1, 8, 1) where the scale needs (2, 8, 1, 1)"),
    ({"like": "other"}, (2, 8, 5, 6), "takes its shape from 'other', not from the scaled map 'data'"),
])
def test_se_broadcast_like_refusals(kw, shape, reason):
    shapes = {"data": shape, "other": shape} if kw.get("like") == "other" else {"data": shape}
    res = fuse_and_check(se_sym(**kw), shapes, rules=SE_RULES)
    assert "fused_se" not in ops(res)
    assert reason in rejections(res, "se"), res.report.to_text(explain=True)


def test_hard_swish_of_other_constants_stays_outside():
    z = mx.sym.var("data")
    x = z * (mx.sym.clip(z + 2., 0, 6) / 6.)             # not hard-swish
    p = mx.sym.Pooling(x, global_pool=True, pool_type="avg", kernel=(1, 1))
    g = mx.sym.Convolution(mx.sym.relu(mx.sym.Convolution(p, kernel=(1, 1), num_filter=4)), kernel=(1, 1),
                           num_filter=8)
    y = mx.sym.broadcast_mul(x, mx.sym.sigmoid(g))
    res = fuse_and_check(y, X, rules=SE_RULES)
    assert fused_by(res) == {"se": 1}            # the SE alone: the hard-swish's ops stay
    assert {"_plus_scalar", "clip", "_div_scalar", "elemwise_mul"} <= set(ops(res)), ops(res)


def test_gate_used_elsewhere_is_refused():
    y = se_sym(gate="sigmoid")
    gate = y.get_internals()[[n for n in y.get_internals().list_outputs() if n.startswith("sigmoid")][-1]]
    res = fuse_and_check(mx.sym.Group([y, gate]), X, rules=SE_RULES)
    assert "fused_se" not in ops(res)
    assert "used" in rejections(res, "se") or "graph output" in rejections(res, "se")


def test_unknown_shapes_refuse_with_reason():
    sym = se_sym()
    arg, aux = random_params(sym, X)
    res = fusion.fuse(sym, arg, aux, rules=SE_RULES)
    assert "fused_se" not in ops(res)
    assert "unknown" in rejections(res, "se")


@pytest.mark.parametrize("kw", [{"tail": "relu"}, {"fc": "dense", "reshape": "expand", "bias": False},
                                {"fc": "dense", "reshape": "expand_last", "like": "operator", "swap": True},
                                {"pool": "global", "gate": "clip", "hswish": True},
                                {"gate": "hard_sigmoid", "act": "relu"}])
def test_unfuse_restores_stock_ops(kw):
    shapes = dict(X, res=X["data"]) if kw.get("tail") else X
    sym = se_sym(**kw)
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, rules=SE_RULES, input_shapes=shapes)
    assert "fused_se" in ops(res)
    assert_unfuse_round_trip(sym, arg, aux, res, shapes, "fused_se", rules=SE_RULES)


# ------------------------------------------------------------------ whole GluonCV-style networks
@pytest.mark.parametrize("make,shape,expect", [
    (lambda: se_resnext(layers=(1, 1), cardinality=4, channels=16, classes=10), (1, 3, 32, 32), {"se_add": 2}),
    (lambda: se_resnet(layers=(1, 1), channels=(16, 32, 64), classes=10), (1, 3, 32, 32), {"se_add": 2}),
    (lambda: se_resnet(layers=(1, 1), channels=(16, 32, 64), v2=True, classes=10), (1, 3, 32, 32),
     {"se_add": 2}),
    (lambda: mobilenetv3(multiplier=0.25, cls_ch_squeeze=64, cls_ch_expand=32, classes=10), (1, 3, 64, 64),
     {"se_hard_swish": 5, "se": 3}),
])
def test_gluoncv_networks(make, shape, expect):
    with mx.name.NameManager():
        sym, arg, aux = export(make(), shape)
    res = fusion.fuse(sym, arg, aux, input_shapes={"data": shape})
    got = {k: v for k, v in fused_by(res).items() if k.startswith("se")}
    assert got == expect, res.report.to_text(explain=True)
    for s in (shape, (2,) + shape[1:]):
        v = fusion.verify((sym, arg, aux), res, input_shapes={"data": s})
        assert v.max_rel <= 1e-4, v
    assert not {"broadcast_mul", "_contrib_AdaptiveAvgPooling2D"} & set(ops(res))


def test_gluoncv_fast_pose_bottleneck_with_its_se_layer():
    """GluonCV's pose network (alpha_pose/fast_pose.py): its SELayer multiplies the map by the gate
    broadcast_like'd to it, ``gate.expand_dims(-1).expand_dims(-1).broadcast_like(x) * x``."""
    pytest.importorskip("gluoncv")
    from gluoncv.model_zoo.alpha_pose.fast_pose import Bottleneck

    shape = (1, 16, 8, 8)
    with mx.name.NameManager():
        sym, arg, aux = export(Bottleneck(16, 4, reduction=True), shape)
    assert "broadcast_like" in sym.tojson()
    res = fusion.fuse(sym, arg, aux, input_shapes={"data": shape})
    assert fused_by(res).get("se_add") == 1, res.report.to_text(explain=True)
    assert not {"broadcast_like", "_contrib_AdaptiveAvgPooling2D"} & set(ops(res)), ops(res)
    for s in (shape, (2, 16, 11, 7)):
        v = fusion.verify((sym, arg, aux), res, input_shapes={"data": s})
        assert v.max_rel <= 1e-4, v


# ------------------------------------------------------------------ the op itself
def test_fused_se_matches_numpy_and_rejects_bad_shapes():
    rng = np.random.default_rng(1)
    N, C, H, W, Cm = 2, 16, 5, 7, 4
    x, r = (rng.standard_normal((N, C, H, W)).astype(np.float32) for _ in range(2))
    w1, w2 = rng.standard_normal((Cm, C, 1, 1)).astype(np.float32), rng.standard_normal((C, Cm)).astype(np.float32)
    b1, b2 = rng.standard_normal(Cm).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    y = mx.nd.fused_se(*(mx.nd.array(v) for v in (x, w1, b1, w2, b2, r)), act="relu", gate="sigmoid",
                       residual=True, out_act="relu").asnumpy()
    h = np.maximum(x.mean((2, 3)) @ w1.reshape(Cm, C).T + b1, 0)
    g = 1 / (1 + np.exp(-(h @ w2.T + b2)))
    np.testing.assert_allclose(y, np.maximum(x * g[:, :, None, None] + r, 0), rtol=1e-5, atol=1e-5)
    with pytest.raises(mx.MXNetError, match="w2 must be"):
        mx.nd.fused_se(mx.nd.array(x), mx.nd.array(w1), mx.nd.array(w1), no_bias1=True, no_bias2=True).wait_to_read()


# ------------------------------------------------------------------ DenseNet: Concat → BatchNorm → relu
DENSE_RULES = ["dense_concat"]


def dense_block(layers=3, act="Activation", x_shape_c=2):
    """DenseNet's block as HybridConcurrent writes it: concat(x, layer(x)), layer = BN → relu → conv."""
    x = mx.sym.var("data")
    c = x
    for k in range(layers):
        h = mx.sym.BatchNorm(c, fix_gamma=False, name="bn%d" % k)
        h = mx.sym.Activation(h, act_type="relu") if act == "Activation" else mx.sym.relu(h)
        c = mx.sym.Concat(c, mx.sym.Convolution(h, num_filter=2, kernel=(3, 3), pad=(1, 1), name="conv%d" % k),
                          dim=1, name="cat%d" % k)
    y = mx.sym.BatchNorm(c, fix_gamma=False, name="bn_last")
    return mx.sym.Activation(y, act_type="relu") if act == "Activation" else mx.sym.relu(y)


@pytest.mark.parametrize("act", ["Activation", "relu"])
def test_dense_block_writes_no_concatenation(act):
    res = fuse_and_check(dense_block(act=act), X, rules=DENSE_RULES)
    assert fused_by(res) == {"concat_flatten": 1, "concat_bn_act": 3}, res.report.to_text(explain=True)
    assert "Concat" not in ops(res) and ops(res)["fused_concat_scale_act"] == 3
    assert res.report.passes <= 3


def test_concat_read_elsewhere_is_rebuilt_and_kept():
    x = mx.sym.var("data")
    c0 = mx.sym.Concat(x, mx.sym.relu(x), dim=1)
    c1 = mx.sym.Concat(c0, mx.sym.sigmoid(c0), dim=1)
    y = mx.sym.Group([mx.sym.relu(mx.sym.BatchNorm(c1, fix_gamma=False)), mx.sym.tanh(c0)])
    res = fuse_and_check(y, {"data": (1, 2, 3, 3)}, rules=DENSE_RULES)
    assert ops(res)["Concat"] == 1 and ops(res)["fused_concat_scale_act"] == 1, ops(res)


def test_concat_read_by_another_op_is_rebuilt_for_it():
    x = mx.sym.var("data")
    c0 = mx.sym.Concat(x, mx.sym.relu(x), dim=1)
    y = mx.sym.Group([mx.sym.relu(mx.sym.BatchNorm(c0, fix_gamma=False)), mx.sym.tanh(c0)])
    res = fuse_and_check(y, {"data": (1, 2, 3, 3)}, rules=DENSE_RULES)
    assert ops(res) == {"Concat": 1, "fused_concat_scale_act": 1, "relu": 1, "tanh": 1}, ops(res)


@pytest.mark.parametrize("dim,axis,reason", [(2, 2, "not the channel axis 1"), (1, 2, "normalizes axis 2")])
def test_concat_bn_refusals(dim, axis, reason):
    x = mx.sym.var("data")
    y = mx.sym.relu(mx.sym.BatchNorm(mx.sym.Concat(x, mx.sym.relu(x), dim=dim), axis=axis, fix_gamma=False))
    res = fuse_and_check(y, {"data": (1, 3, 3, 3)}, rules=DENSE_RULES)
    assert "fused_concat_scale_act" not in ops(res)
    assert reason in rejections(res, "concat_bn_act"), res.report.to_text(explain=True)


@pytest.mark.parametrize("build,rules,fused,reason", [
    (se_sym, SE_RULES, "fused_se", "no backward"),
    (dense_block, DENSE_RULES, "fused_concat_scale_act", "moving statistics"),
], ids=["se", "concat_bn"])
def test_training_mode_is_refused(build, rules, fused, reason):
    sym = build()
    arg, aux = random_params(sym, X)
    res = fusion.fuse(sym, arg, aux, rules=rules, mode="training", input_shapes=X)
    assert fused not in ops(res)
    assert reason in res.report.to_text(explain=True)


def test_concat_unfuse_restores_stock_ops():
    sym = dense_block()
    arg, aux = random_params(sym, X)
    res = fusion.fuse(sym, arg, aux, rules=DENSE_RULES, input_shapes=X)
    assert_unfuse_round_trip(sym, arg, aux, res, X, None)


def test_densenet_like_network():
    from mxnet.gluon.model_zoo.vision.densenet import DenseNet
    shape = (1, 3, 224, 224)
    with mx.name.NameManager():
        sym, arg, aux = export(DenseNet(8, 4, [3, 2], classes=10), shape)
    assert "fused_concat_scale_act" not in ops(fusion.fuse(sym, arg, aux, input_shapes={"data": shape}))  # opt-in
    res = fusion.fuse(sym, arg, aux, rules=DENSE_RULES + ["default"], input_shapes={"data": shape})
    assert "Concat" not in ops(res) and ops(res)["fused_concat_scale_act"] == 5, ops(res)
    for s in (shape, (2, 3, 224, 224)):
        assert fusion.verify((sym, arg, aux), res, input_shapes={"data": s}).max_rel <= 1e-4
