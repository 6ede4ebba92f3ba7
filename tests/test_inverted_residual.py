"""MobileNet's inverted-residual block (patterns/inverted_residual.py → fused_inverted_residual).

Every form MobileNetV3 writes (expand or not, relu or hard-swish, with or without SE, with or
without the residual add, strides 1 and 2, kernels 3 and 5), checked against MXNet at the
fusing shapes and at another batch and plane size, through oneDNN and through the op's direct
loops; the refusals with their reasons; un-fusing.
"""
import mxnet as mx
import pytest

import fusion
from fusion.testing.gluoncv import _blocks, export, mobilenetv3

from conftest import assert_unfuse_round_trip, fuse_and_check, ops, random_params

# the block rules as they fuse where no region takes their blocks (tests/test_region.py: regions)
pytestmark = pytest.mark.usefixtures("no_regions")


def unit(cin, e, cout, k=3, act="hard_swish", se=False, s=1):
    with mx.name.NameManager():
        return export(_blocks()["ResUnit"](cin, e, cout, k, act, se, s, prefix="u_"), (1, cin, 9, 9))


def rejections(res):
    r = res.report.rules.get("inverted_residual")
    return " | ".join(r.rejected.values()) if r else ""


CASES = [  # cin, exp, cout, kernel, act, se, stride
    (8, 24, 8, 3, "hard_swish", True, 1),      # expand, SE after hard-swish, residual
    (8, 24, 16, 5, "hard_swish", False, 2),    # stride 2, no residual
    (8, 8, 8, 3, "relu", False, 1),            # no expand (MobileNetV3's first block)
    (8, 16, 12, 5, "relu", True, 2),           # SE after relu
    (12, 20, 12, 3, "relu", True, 1),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("direct", [False, True], ids=["onednn", "direct"])
def test_blocks_fuse_exactly(case, direct, monkeypatch):
    if direct:
        monkeypatch.setenv("MXFUSION_NO_DNNL_CONV", "1")
    sym, arg, aux = unit(*case)
    shapes = {"data": (1, case[0], 9, 9)}
    res = fuse_and_check(sym, shapes, arg, aux)
    assert ops(res) == {"fused_inverted_residual": 1}, res.report.to_text(explain=True)
    for other in ((2, case[0], 9, 9), (3, case[0], 12, 7)):   # every size the original accepts
        v = fusion.verify((sym, arg, aux), res, input_shapes={"data": other})
        assert v.max_rel <= 1e-4, (other, v)


def conv(x, name, f, k=1, s=1, p=0, g=1, dilate=1):
    return mx.sym.Convolution(x, kernel=(k, k), stride=(s, s), pad=(p, p), num_filter=f, num_group=g,
                              dilate=(dilate, dilate), name=name)


def hswish(z):
    return z * (mx.sym.clip(z + 3., 0, 6) / 6.)


def relu(z):
    return mx.sym.Activation(z, act_type="relu")


def block(act1=hswish, act2=hswish, k=3, pad=1, dilate=1, residual=True):
    x = mx.sym.var("data")
    y = act1(conv(x, "expand", 16))
    y = act2(conv(y, "dw", 16, k=k, p=pad, g=16, dilate=dilate))
    y = conv(y, "project", 8)
    return y + x if residual else y


X = {"data": (1, 8, 7, 7)}


def test_stock_block_fuses():
    res = fuse_and_check(block(), X)
    assert ops(res) == {"fused_inverted_residual": 1}, res.report.to_text(explain=True)


@pytest.mark.parametrize("kw,reason", [
    ({"dilate": 2, "pad": 2}, "is dilated"),
    ({"pad": 0, "residual": False}, "not (K-1)/2"),
])
def test_refusals(kw, reason):
    res = fuse_and_check(block(**kw), X)
    assert "fused_inverted_residual" not in ops(res)
    assert reason in rejections(res), res.report.to_text(explain=True)


def test_layers_of_different_activations_are_not_one_block():
    # the whole block is refused; the depthwise layer and the projection, read from the relu, still
    # form a block without expansion (and without the residual, which adds the block's input)
    res = fuse_and_check(block(act1=relu), X)
    assert "activations differ" in res.report.to_text(explain=True)
    assert ops(res) == {"Convolution": 1, "Activation": 1, "fused_inverted_residual": 1, "elemwise_add": 1}, ops(res)


def test_broadcasting_residual_add_is_refused():
    x = mx.sym.var("data")
    y = conv(relu(conv(relu(conv(x, "expand", 16)), "dw", 16, k=3, p=1, g=16)), "project", 1)
    res = fuse_and_check(mx.sym.broadcast_add(y, x), X)
    assert "residual add broadcasts" in res.report.to_text(explain=True), res.report.to_text(explain=True)
    assert ops(res).get("broadcast_add") == 1, ops(res)


def test_interior_value_used_elsewhere_is_refused():
    y = block()
    inner = y.get_internals()["dw_output"]
    res = fuse_and_check(mx.sym.Group([y, inner]), X)
    assert "fused_inverted_residual" not in ops(res)


def test_fuses_without_input_shapes_and_is_right_at_other_sizes():
    """Channels come from the weights, the plane is kept by the stride-1 "same" convolutions: no
    input shapes needed (more in tests/test_no_input_shapes.py)."""
    sym = block()
    arg, aux = random_params(sym, X)
    res = fusion.fuse(sym, arg, aux)
    assert ops(res) == {"fused_inverted_residual": 1}, res.report.to_text(explain=True)
    for shape in ((1, 8, 7, 7), (3, 8, 5, 11)):
        v = fusion.verify((sym, arg, aux), res, input_shapes={"data": shape})
        assert v.max_rel <= 1e-4, (shape, v)


def test_training_mode_is_refused():
    sym = block()
    arg, aux = random_params(sym, X)
    res = fusion.fuse(sym, arg, aux, mode="training", input_shapes=X)
    assert "fused_inverted_residual" not in ops(res)
    assert "fused_inverted_residual has no backward" in res.report.to_text(explain=True)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3]])
def test_unfuse_restores_stock_ops(case):
    sym, arg, aux = unit(*case)
    shapes = {"data": (1, case[0], 9, 9)}
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    assert "fused_inverted_residual" in ops(res)
    assert_unfuse_round_trip(sym, arg, aux, res, shapes, "fused_inverted_residual", rtol=1e-4)


def test_mobilenetv3_every_block_fuses():
    shape = (1, 3, 64, 64)
    with mx.name.NameManager():
        sym, arg, aux = export(mobilenetv3(multiplier=0.25, cls_ch_squeeze=64, cls_ch_expand=32, classes=10), shape)
    res = fusion.fuse(sym, arg, aux, input_shapes={"data": shape})
    # 15 blocks; the plain relu block (expand, no SE, no residual) is left to MXNet's oneDNN
    assert ops(res).get("fused_inverted_residual") == 14, res.report.to_text(explain=True)
    assert "a plain relu block" in res.report.to_text(explain=True)
    for s in (shape, (2, 3, 48, 48)):
        v = fusion.verify((sym, arg, aux), res, input_shapes={"data": s})
        assert v.max_rel <= 1e-4, v


def test_new_weight_values_are_packed_again():
    """The op keeps its weights in oneDNN's layouts between calls: writing new values into the
    bound weight arrays (a new version of each) must be seen by the next call."""
    import numpy as np
    sym, arg, aux = unit(8, 24, 8, 3, "hard_swish", True, 1)
    shapes = {"data": (1, 8, 9, 9)}
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    assert ops(res) == {"fused_inverted_residual": 1}
    x = mx.nd.random.normal(shape=shapes["data"])
    args = dict(res.arg_params, data=x)
    exe = res.symbol.bind(mx.cpu(), {n: args[n].copy() for n in res.symbol.list_arguments()},
                          aux_states={n: v.copy() for n, v in res.aux_params.items()}, grad_req="null")
    first = exe.forward(is_train=False)[0].asnumpy()
    exe.forward(is_train=False)                              # the second call packs the weights
    for name, w in exe.arg_dict.items():
        if name != "data":
            w[:] = w * 0.5
    got = exe.forward(is_train=False)[0].asnumpy()
    half = {n: (v * 0.5 if n != "data" else v) for n, v in args.items()}
    ref = res.symbol.bind(mx.cpu(), {n: half[n] for n in res.symbol.list_arguments()},
                          aux_states=res.aux_params, grad_req="null").forward(is_train=False)[0].asnumpy()
    assert not np.allclose(first, got)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_weights_updated_in_place_beside_a_stock_executor():
    """A stock executor bound for inference on the same arrays keeps its convolutions' weights in oneDNN's
    layout (MXNet reorders them in place); the library op then gets a plain copy of each per call, version 0,
    often at one address: an update of the weights must still reach it (ParamVersion, mxf_common.h)."""
    from fusion.native.env import subgraph_backend

    sym, arg, aux = unit(8, 24, 8, 3, "hard_swish", True, 1)
    shapes = {"data": (1, 8, 9, 9)}
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    assert ops(res) == {"fused_inverted_residual": 1}
    shared = {**arg, **aux, **res.arg_params, **res.aux_params}
    x = mx.nd.random.uniform(-1, 1, shapes["data"])

    def bind(s, backend=True):
        with subgraph_backend(backend):
            return s.bind(mx.cpu(), {k: shared[k] for k in s.list_arguments() if k != "data"} | {"data": x},
                          aux_states={k: shared[k] for k in s.list_auxiliary_states()}, grad_req="null")

    stock, fused = bind(sym), bind(res.symbol)
    for step in range(3):
        stock.forward(is_train=False)[0].wait_to_read()            # keeps the weights in oneDNN's layout
        got = fused.forward(is_train=False)[0].asnumpy()
        with subgraph_backend(False):
            want = res.symbol.eval(ctx=mx.cpu(), data=x, **{k: shared[k].copy() for k in res.arg_params})[0]
        want = want.asnumpy()
        assert abs(got - want).max() <= 1e-4 * abs(want).max(), step
        for name in res.arg_params:                                  # the user updates every weight in place
            if name.endswith("weight"):
                shared[name][:] = shared[name] * 1.25
