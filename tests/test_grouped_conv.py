"""Grouped convolutions of few channels per group (patterns/grouped_conv.py → fused_grouped_conv)."""
import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.testing.gluoncv import export, se_resnext

from conftest import assert_unfuse_round_trip, fuse_and_check, ops, random_params

RULES = ["grouped_convolution"]


def fused_by(res):
    return {name: len(r.fused) for name, r in res.report.rules.items() if r.fused}


def gconv(C=32, G=8, O=None, kernel=(3, 3), stride=(1, 1), pad=(1, 1), dilate=(1, 1), bias=True, act=None,
          bn=False):
    x = mx.sym.var("data")
    y = mx.sym.Convolution(x, kernel=kernel, stride=stride, pad=pad, dilate=dilate, num_filter=O or C, num_group=G,
                           no_bias=not bias, name="gconv")
    if bn:
        y = mx.sym.BatchNorm(y, fix_gamma=False, name="bn")
    if act == "Activation":
        y = mx.sym.Activation(y, act_type="relu")
    elif act == "relu":
        y = mx.sym.relu(y)
    return y


@pytest.mark.parametrize("kw", [
    {}, {"bias": False}, {"act": "Activation"}, {"stride": (2, 2)}, {"O": 64}, {"kernel": (5, 3), "pad": (2, 1)},
    {"dilate": (2, 2), "pad": (2, 2)}, {"C": 128, "G": 32}, {"C": 64, "G": 4},
])
def test_grouped_convolutions_fuse_exactly(kw):
    shapes = {"data": (2, kw.get("C", 32), 9, 7)}
    res = fuse_and_check(gconv(**kw), shapes, rules=RULES)
    assert ops(res).get("fused_grouped_conv") == 1 and "Convolution" not in ops(res), ops(res)
    if kw.get("act"):
        assert fused_by(res) == {"grouped_conv_relu": 1} and "Activation" not in ops(res)
    other = {"data": (1, kw.get("C", 32), 12, 5)}     # another batch and plane size
    sym = gconv(**kw)
    arg, aux = random_params(sym, shapes)
    v = fusion.verify(sym, fusion.fuse(sym, arg, aux, rules=RULES, input_shapes=shapes), (arg, aux), other)
    assert v.max_rel <= 1e-4, v


def test_batchnorm_folded_first_then_relu_fused():
    shapes = {"data": (1, 32, 8, 8)}
    res = fuse_and_check(gconv(bn=True, act="Activation", bias=False), shapes, rules=RULES + ["default"])
    assert fused_by(res).get("conv_bn_act") == 1 and fused_by(res).get("grouped_conv_relu") == 1, \
        res.report.to_text(explain=True)
    assert ops(res) == {"fused_grouped_conv": 1}, ops(res)


def test_relu_op_stays_outside():
    res = fuse_and_check(gconv(act="relu"), {"data": (1, 32, 5, 5)}, rules=RULES)
    assert ops(res) == {"fused_grouped_conv": 1, "relu": 1}, ops(res)


def test_ungrouped_convolution_is_no_candidate():
    res = fuse_and_check(gconv(G=1), {"data": (1, 32, 5, 5)}, rules=RULES)
    assert "fused_grouped_conv" not in ops(res) and not res.report.rules["grouped_conv"].rejected


@pytest.mark.parametrize("kw,reason", [
    ({"C": 32, "G": 32}, "1 channels per group"),          # depthwise: not measured
    ({"C": 64, "G": 2}, "32 channels per group"),
])
def test_refusals(kw, reason):
    res = fuse_and_check(gconv(**kw), {"data": (1, kw["C"], 5, 5)}, rules=RULES)
    assert "fused_grouped_conv" not in ops(res)
    assert reason in " | ".join(res.report.rules["grouped_conv"].rejected.values()), res.report.to_text(explain=True)


def test_training_is_refused():
    """(Without input shapes it fuses: the weight gives the channels per group; tests/test_no_input_shapes.py.)"""
    sym = gconv()
    arg, aux = random_params(sym, {"data": (1, 32, 5, 5)})
    res = fusion.fuse(sym, arg, aux, rules=RULES, mode="training", input_shapes={"data": (1, 32, 5, 5)})
    assert "fused_grouped_conv" not in ops(res) and "no backward" in res.report.to_text(explain=True)


@pytest.mark.parametrize("kw", [{"act": "Activation", "stride": (2, 2)}, {"bias": False, "dilate": (2, 2),
                                                                             "pad": (2, 2)}])
def test_unfuse_restores_stock_ops(kw):
    shapes = {"data": (1, 32, 7, 7)}
    sym = gconv(**kw)
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, rules=RULES, input_shapes=shapes)
    assert_unfuse_round_trip(sym, arg, aux, res, shapes, "fused_grouped_conv", rules=RULES)


@pytest.mark.usefixtures("no_regions")
def test_se_resnext_network():
    shape = (1, 3, 32, 32)
    with mx.name.NameManager():
        sym, arg, aux = export(se_resnext(layers=(1, 1), cardinality=4, channels=64, classes=10), shape)
    assert "fused_grouped_conv" not in ops(fusion.fuse(sym, arg, aux, input_shapes={"data": shape}))  # opt-in
    res = fusion.fuse(sym, arg, aux, rules=RULES + ["default"], input_shapes={"data": shape})
    assert fused_by(res).get("grouped_conv_relu") == 2, res.report.to_text(explain=True)
    for s in (shape, (2, 3, 32, 32)):
        assert fusion.verify((sym, arg, aux), res, input_shapes={"data": s}).max_rel <= 1e-4


@pytest.mark.parametrize("env", ["0", "1"])
def test_op_matches_mxnet_convolution(env, monkeypatch):
    monkeypatch.setenv("MXFUSION_NO_DNNL_CONV", env)      # oneDNN 3.x, and the direct loop without it
    rng = np.random.default_rng(3)
    x = mx.nd.array(rng.standard_normal((2, 16, 6, 5)))
    w = mx.nd.array(rng.standard_normal((24, 4, 3, 3)))
    b = mx.nd.array(rng.standard_normal(24))
    kw = dict(kernel=(3, 3), stride=(2, 1), pad=(1, 1), num_group=4, num_filter=24)
    want = mx.nd.relu(mx.nd.Convolution(x, w, b, **kw)).asnumpy()
    got = mx.nd.fused_grouped_conv(x, w, b, act="act_relu", **kw).asnumpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(mx.MXNetError, match="weight must be"):
        mx.nd.fused_grouped_conv(x, w, b, kernel=(3, 3), num_group=2, num_filter=24).wait_to_read()
