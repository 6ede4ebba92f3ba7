"""pad_into_conv: a zero, even Pad before a Convolution becomes the convolution's own padding."""
import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.native.env import subgraph_backend

from conftest import fuse_and_check, ops, random_params

S = mx.sym


def padded(width=(1, 1, 1, 1), mode="constant", value=0.0, nd=2, conv_pad=0, stride=1, dilate=1, groups=1,
           no_bias=False, kernel=3, layout=None):
    x = S.var("data")
    p = S.Pad(x, mode=mode, pad_width=(0, 0, 0, 0) + tuple(width), constant_value=value, name="pad")
    kw = {"layout": layout} if layout else {}
    return S.Convolution(p, kernel=(kernel,) * nd, pad=(conv_pad,) * nd, stride=(stride,) * nd,
                         dilate=(dilate,) * nd, num_group=groups, num_filter=4, no_bias=no_bias, name="conv", **kw)


def rejected(res):
    return res.report.to_text(explain=True)


@pytest.mark.parametrize("kw", [
    {},
    {"width": (2, 2, 1, 1), "conv_pad": 1},
    {"stride": 2, "no_bias": True},
    {"dilate": 2, "width": (2, 2, 2, 2)},
    {"groups": 4, "kernel": 3},
    {"kernel": 1, "width": (1, 1, 0, 0)},
])
def test_pad_becomes_the_convolutions_padding(kw):
    y = padded(**kw)
    res = fuse_and_check(y, {"data": (2, 4, 9, 8)}, rules=["pad_into_conv"])
    assert ops(res) == {"Convolution": 1}, ops(res)
    conv = next(n for n in res.graph.nodes if n.op == "Convolution")
    width = kw.get("width", (1, 1, 1, 1))
    own = kw.get("conv_pad", 0)
    assert tuple(conv.param("pad")) == (own + width[0], own + width[2])
    assert conv.name == "conv"
    # the same at another shape: the rule decided from attributes alone
    v = fusion.verify((y, res.arg_params, res.aux_params), res, input_shapes={"data": (1, 4, 11, 6)})
    assert v.max_rel <= 1e-5, v


def test_three_dimensional():
    y = padded(width=(1, 1, 1, 1, 1, 1), nd=3)
    res = fuse_and_check(y, {"data": (1, 4, 5, 6, 5)}, rules=["pad_into_conv"])
    assert ops(res) == {"Convolution": 1}


def _train(sym, arg, inputs, head):
    args = {k: mx.nd.array(v) for k, v in {**arg, **inputs}.items() if k in sym.list_arguments()}
    grads = {k: mx.nd.zeros(v.shape) for k, v in args.items()}
    with subgraph_backend(False):
        exe = sym.bind(mx.cpu(), args, args_grad=grads, grad_req="write")
    out = exe.forward(is_train=True)[0].asnumpy()
    exe.backward([mx.nd.array(head)])
    return out, {k: g.asnumpy() for k, g in grads.items()}


def test_training_gradients_are_the_same():
    y = padded(stride=2)
    shapes = {"data": (2, 4, 9, 8)}
    arg, aux = random_params(y, shapes)
    res = fusion.fuse(y, arg, aux, input_shapes=shapes, mode="training", rules=["pad_into_conv"])
    assert ops(res) == {"Convolution": 1}
    rng = np.random.default_rng(0)
    inputs = {"data": rng.standard_normal(shapes["data"]).astype(np.float32)}
    arg_np = {k: v.asnumpy() for k, v in arg.items()}
    head = rng.standard_normal((2, 4, 5, 4)).astype(np.float32)
    out0, g0 = _train(y, arg_np, inputs, head)
    out1, g1 = _train(res.symbol, {k: v.asnumpy() for k, v in res.arg_params.items()}, inputs, head)
    np.testing.assert_allclose(out1, out0, rtol=1e-5, atol=1e-5)
    assert sorted(g0) == sorted(g1)
    for k in g0:
        np.testing.assert_allclose(g1[k], g0[k], rtol=1e-4, atol=1e-4, err_msg=k)


@pytest.mark.parametrize("kw,reason", [
    ({"mode": "edge"}, "pads in mode 'edge', not with a constant"),
    ({"mode": "reflect"}, "pads in mode 'reflect'"),
    ({"value": 1.5}, "pads with 1.5, not 0"),
    ({"width": (0, 1, 0, 1)}, "pads its spatial axes unevenly"),
    ({"width": (1, 1, 2, 1)}, "pads its spatial axes unevenly"),
    ({"layout": "NHWC"}, "not channels first"),
])
def test_refusals(kw, reason):
    y = padded(**kw)
    if kw.get("layout") == "NHWC":
        # MXNet's CPU Convolution does not run NHWC: the report is what is checked (MXNet's Pad pads
        # axes 2 and 3 whatever the convolution's layout: H and W of (N, H, W, C) here)
        res = fusion.fuse(y, input_shapes={"data": (2, 9, 8, 4)}, rules=["pad_into_conv"])
    else:
        res = fuse_and_check(y, {"data": (2, 4, 9, 8)}, rules=["pad_into_conv"])
    assert ops(res) == {"Pad": 1, "Convolution": 1}, ops(res)
    assert reason in rejected(res), rejected(res)


def test_batch_or_channel_padding_refused():
    """MXNet's Pad refuses such a graph when it runs; the rule, deciding from attributes, refuses too."""
    y = S.Convolution(S.Pad(S.var("data"), mode="constant", pad_width=(0, 0, 1, 1, 1, 1, 1, 1), name="pad"),
                      kernel=(3, 3), num_filter=4, name="conv")
    res = fusion.fuse(y, rules=["pad_into_conv"])
    assert ops(res) == {"Pad": 1, "Convolution": 1}
    assert "pads the batch or channel axis" in rejected(res), rejected(res)


def test_pad_read_elsewhere_stays():
    x = S.var("data")
    p = S.Pad(x, mode="constant", pad_width=(0, 0, 0, 0, 1, 1, 1, 1), name="pad")
    y = S.Group([S.Convolution(p, kernel=(3, 3), num_filter=4, name="conv"), S.relu(p)])
    res = fuse_and_check(y, {"data": (1, 3, 6, 6)}, rules=["pad_into_conv"])
    assert ops(res).get("Pad") == 1


def test_xception_style_chain_is_one_region():
    """GluonCV's Xception pads explicitly before every depthwise convolution: without this rule each
    Pad cut the region there (Xception: 64 regions of 2-3 convolutions, 0.73x of MXNet on AVX2)."""
    from fusion.engine.rewrite import implemented
    if not implemented("fused_region", "cpu"):
        pytest.skip("this op library has no CPU fused_region")
    x = S.var("data")
    h = x
    for i in range(3):
        h = S.Pad(S.relu(h), mode="constant", pad_width=(0, 0, 0, 0, 1, 1, 1, 1), name="pad%d" % i)
        h = S.Convolution(h, kernel=(3, 3), num_filter=8, num_group=8, no_bias=True, name="dw%d" % i)
        h = S.Convolution(h, kernel=(1, 1), num_filter=8, no_bias=True, name="pw%d" % i)
        h = S.BatchNorm(h, fix_gamma=False, name="bn%d" % i)
    res = fuse_and_check(h, {"data": (1, 8, 10, 10)})
    assert ops(res) == {"fused_region": 1}, res.report.to_text(explain=True)
    without = fuse_and_check(h, {"data": (1, 8, 10, 10)}, rules=["default", "-pad_into_conv"])
    assert "Pad" in ops(without) and ops(without).get("fused_region", 0) > 1
