"""bilinear_resize: _contrib_BilinearResize2D → fused_bilinear_resize, MXNet's results bit for bit.

The op is compared with MXNet's own (``mx.nd.contrib.BilinearResize2D``) on the bits of every output
element: every mode, align_corners True and False, up- and downscaling by integer and other ratios, odd
sizes, sides of 1, batches, NaN and ±inf; then inside graphs fused with ``fusion.fuse`` and bound with
MXNet, through the Gluon door, un-fused and exported to ONNX; and every refusal with its reason.
"""
import itertools

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

import fusion

from conftest import assert_unfuse_round_trip, ops

S = mx.sym
MODES = ("size", "odd_scale", "like", "to_even_down", "to_even_up", "to_odd_down", "to_odd_up")


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal element by element to the bit, NaN where NaN (its payload aside)."""
    if a.shape != b.shape:
        return False
    nan = np.isnan(a)
    return bool((nan == np.isnan(b)).all() and (a.view(np.uint32)[~nan] == b.view(np.uint32)[~nan]).all())


def both(x: np.ndarray, like_shape=None, **kw):
    """(MXNet's output, the fused op's) on ``x`` with attributes ``kw``."""
    ins = [mx.nd.array(x, dtype=np.float32)]
    if like_shape is not None:
        ins.append(mx.nd.zeros(like_shape))
    ref = mx.nd.contrib.BilinearResize2D(*ins, **kw).asnumpy()
    got = mx.nd.fused_bilinear_resize(*ins, **{k: str(v) for k, v in kw.items()}).asnumpy()
    return ref, got


def check(x, like_shape=None, **kw):
    ref, got = both(x, like_shape, **kw)
    assert bits_equal(ref, got), (x.shape, kw, ref.shape, got.shape,
                                  np.nanmax(np.abs(ref - got)) if ref.shape == got.shape else None)
    return ref


def data(shape, seed=0):
    return np.random.RandomState(seed).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------- the op against MXNet's
SIZES = [(1, 1), (1, 6), (5, 1), (2, 3), (7, 9), (16, 16), (13, 17)]
OUTS = [(1, 1), (1, 7), (6, 1), (3, 4), (14, 18), (32, 32), (61, 59), (13, 17), (100, 3)]


@pytest.mark.parametrize("align_corners", [True, False])
@pytest.mark.parametrize("hw", SIZES)
def test_size_mode_matches_mxnet_bitwise(hw, align_corners):
    x = data((2, 3) + hw)
    for oh, ow in OUTS:     # up, down, equal (a copy), integer and other ratios, sides of 1
        check(x, height=oh, width=ow, align_corners=align_corners)


@pytest.mark.parametrize("align_corners", [True, False])
@pytest.mark.parametrize("scales", [(0.5, 1.5), (2.0, 2.0), (1 / 3., 3.7), (8.0, 8.0), (0.26, 1.0)])
def test_scales_match_mxnet_bitwise(scales, align_corners):
    for hw in [(7, 9), (16, 16), (13, 17), (4, 5)]:
        if int(np.float32(scales[0]) * hw[0]) >= 1 and int(np.float32(scales[1]) * hw[1]) >= 1:
            check(data((1, 4) + hw), scale_height=scales[0], scale_width=scales[1], align_corners=align_corners)
        check(data((1, 4) + hw), mode="odd_scale", scale_height=max(scales[0], 1.0), scale_width=scales[1],
              align_corners=align_corners)


@pytest.mark.parametrize("align_corners", [True, False])
@pytest.mark.parametrize("mode", ["like", "to_even_down", "to_even_up", "to_odd_down", "to_odd_up"])
def test_shape_modes_match_mxnet_bitwise(mode, align_corners):
    for hw in [(2, 3), (7, 9), (16, 16), (13, 17), (1, 5)]:
        if mode.endswith("_down") and min(hw) == 1 and (mode == "to_even_down"):
            continue        # MXNet would make a side of 0
        like = (1, 1, 11, 23) if mode == "like" else None
        check(data((3, 2) + hw), like, mode=mode, align_corners=align_corners)


@pytest.mark.parametrize("align_corners", [True, False])
@pytest.mark.parametrize("shape, out", [((1, 150, 60, 60), (480, 480)),     # PSPNet / DeepLab's last resize
                                        ((1, 512, 1, 1), (60, 60)),         # DeepLab's image pooling
                                        ((1, 2, 60, 60), (480, 480)),       # few planes: rows shared out
                                        ((1, 64, 60, 60), (30, 45))])
def test_large_maps_on_every_thread_match_mxnet_bitwise(shape, out, align_corners):
    check(data(shape), height=out[0], width=out[1], align_corners=align_corners)


@pytest.mark.parametrize("align_corners", [True, False])
def test_nan_and_inf_propagate_as_in_mxnet(align_corners):
    x = data((2, 3, 9, 11))
    x[0, 0, 3, 4] = np.nan
    x[0, 1, 0, 0] = np.inf
    x[1, 2, 8, 10] = -np.inf
    x[1, 0, 4, :] = np.inf          # a whole row: inf - inf and 0 · inf in the weights give NaN
    for oh, ow in [(18, 22), (5, 6), (9, 11), (1, 1), (17, 21)]:
        ref = check(x, height=oh, width=ow, align_corners=align_corners)
        if (oh, ow) != (1, 1):
            assert np.isnan(ref).any() and np.isinf(ref).any()


# ---------------------------------------------------------------------------- in graphs
def bind_run(sym, args, inputs):
    """The outputs of ``sym`` bound by MXNet (default bind, CPU)."""
    ex = sym.bind(mx.cpu(), {**args, **{k: mx.nd.array(v) for k, v in inputs.items()}}, grad_req="null")
    return [o.asnumpy() for o in ex.forward(is_train=False)]


def conv(x, name, c=4):
    return S.Convolution(x, num_filter=c, kernel=(3, 3), pad=(1, 1), name=name)


def conv_params(names, c_in=3, c=4, seed=0):
    r = np.random.RandomState(seed)
    out = {}
    for n in names:
        out[n + "_weight"] = mx.nd.array(r.standard_normal((c, c_in, 3, 3)) / 5)
        out[n + "_bias"] = mx.nd.array(r.standard_normal(c))
    return out


def head(mode, align_corners):
    """Convolution → resize (of ``mode``) → Concat with another branch, and an add."""
    x = S.var("data")
    c = conv(x, "c")
    kw = {"size": dict(height=19, width=12), "odd_scale": dict(scale_height=2.0, scale_width=0.5),
          "like": {}}.get(mode, {})
    if mode == "like":
        r = S.contrib.BilinearResize2D(c, conv(x, "c2"), mode="like", align_corners=align_corners, name="r")
        other = conv(x, "c3")
    else:
        r = S.contrib.BilinearResize2D(c, mode=mode, align_corners=align_corners, name="r", **kw)
        other = S.contrib.BilinearResize2D(conv(x, "c3"), mode=mode, align_corners=align_corners, **kw)
    return S.Group([S.Concat(r, other, dim=1), r + 1.0]), conv_params(["c", "c2", "c3"])


@pytest.mark.parametrize("align_corners", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_fused_graph_bound_by_mxnet_is_bitwise_equal(mode, align_corners):
    sym, args = head(mode, align_corners)
    shapes = {"data": (2, 3, 9, 11)}
    res = fusion.fuse(sym, args, {}, input_shapes=shapes)
    assert "_contrib_BilinearResize2D" not in ops(res), res.report.to_text(explain=True)
    assert ops(res)["fused_bilinear_resize"] == (1 if mode == "like" else 2)
    for shape in [(2, 3, 9, 11), (1, 3, 16, 7)]:       # and at another shape than the one it was fused at
        inputs = {"data": data(shape, 1)}
        ref, got = bind_run(sym, args, inputs), bind_run(res.symbol, res.arg_params, inputs)
        assert all(bits_equal(a, b) for a, b in zip(ref, got)), mode


def test_resize_of_a_region_holding_a_batchnorm_fuses():
    """A fused_region that runs a BatchNorm reads its moving mean and variance, which MXNet's graph
    lists as version 1 of their variables: the shapes after the region must still be known (the
    resize was refused "input shape unknown" in ResidualAttentionNet's attention stages)."""
    x = S.var("data")
    pre = S.Activation(S.BatchNorm(x, fix_gamma=False, name="bn"), act_type="relu")
    y = S.Activation(conv(pre, "c") + conv(pre, "c2"), act_type="relu")
    sym = S.contrib.BilinearResize2D(y, height=14, width=10, name="r")
    args = conv_params(["c", "c2"])
    r = np.random.RandomState(3)
    args.update({"bn_gamma": mx.nd.array(r.uniform(0.5, 1.5, 3)), "bn_beta": mx.nd.array(r.standard_normal(3))})
    aux = {"bn_moving_mean": mx.nd.array(r.standard_normal(3)),
           "bn_moving_var": mx.nd.array(r.uniform(0.5, 2, 3))}
    res = fusion.fuse(sym, args, aux, input_shapes={"data": (1, 3, 9, 11)})
    assert ops(res).get("fused_region") == 1, res.report.to_text(explain=True)
    assert ops(res).get("fused_bilinear_resize") == 1, res.report.to_text(explain=True)
    x = mx.nd.array(data((1, 3, 9, 11), 2))
    ref = sym.bind(mx.cpu(), {**args, "data": x}, aux_states=aux).forward()[0].asnumpy()
    got = res.symbol.bind(mx.cpu(), {**res.arg_params, "data": x}, aux_states=res.aux_params).forward()[0].asnumpy()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_unfuse_gives_back_the_stock_op():
    sym, args = head("like", False)
    shapes = {"data": (2, 3, 9, 11)}
    res = fusion.fuse(sym, args, {}, input_shapes=shapes)
    assert_unfuse_round_trip(sym, args, {}, res, shapes, None, rtol=0)
    plain = fusion.unfuse(res.symbol)
    assert ops(plain)["_contrib_BilinearResize2D"] == 1
    again = fusion.fuse(plain, res.arg_params, res.aux_params, input_shapes=shapes)
    assert ops(again)["fused_bilinear_resize"] == 1


def test_gluon_door():
    class Head(gluon.HybridBlock):
        def __init__(self):
            super().__init__()
            with self.name_scope():
                self.conv = gluon.nn.Conv2D(6, 3, padding=1)

        def hybrid_forward(self, F, x):
            y = self.conv(x)
            return F.contrib.BilinearResize2D(y, height=24, width=20, align_corners=False) + 1

    ref, net = Head(), Head()
    x = mx.nd.array(data((2, 3, 8, 10)))
    for b in (ref, net):
        b.initialize(mx.init.Xavier())
        b(x)
    for p, q in zip(ref.collect_params().values(), net.collect_params().values()):
        q.set_data(p.data())
    ref.hybridize()
    net.hybridize(backend="fusion")
    assert bits_equal(ref(x).asnumpy(), net(x).asnumpy())
    assert len(net.fusion_report.rules["bilinear_resize"].fused) == 1


def test_onnx_export_of_a_fused_graph():
    pytest.importorskip("onnxruntime")
    from fusion.onnx.export import OnnxExportError, export_onnx
    import os
    import tempfile

    folder = tempfile.mkdtemp()
    for mode, ac in [("like", False), ("size", True), ("to_odd_up", False)]:
        sym, args = head(mode, ac)
        shapes = {"data": (2, 3, 9, 11)}
        res = fusion.fuse(sym, args, {}, input_shapes=shapes)
        assert "fused_bilinear_resize" in ops(res)
        r = export_onnx(res.symbol, res.arg_params, {}, shapes, os.path.join(folder, "m.onnx"))
        assert r.max_rel <= 1e-5, (mode, ac, r)
    sym, args = head("to_odd_up", False)
    res = fusion.fuse(sym, args, {}, input_shapes=shapes)
    with pytest.raises(OnnxExportError, match="follows the input's.*no dynamic ONNX form"):
        export_onnx(res.symbol, res.arg_params, {}, shapes, os.path.join(folder, "d.onnx"), dynamic=True)


# ---------------------------------------------------------------------------- refusals
def rejected(res):
    return [r for rr in res.report.rules.values() for r in rr.rejected.values()]


def one_resize(data_var=None, **kw):
    x = data_var if data_var is not None else S.var("data")
    return S.contrib.BilinearResize2D(x, name="r", **kw)


def test_refuses_float16():
    sym = one_resize(S.var("data", dtype="float16"), height=8, width=8)
    res = fusion.fuse(sym, input_shapes={"data": (1, 2, 4, 4)}, input_dtypes={"data": "float16"})
    assert "fused_bilinear_resize" not in ops(res)
    assert "'data' is not float32; the fused op computes in float32" in rejected(res), rejected(res)


def test_refuses_unknown_shapes():
    res = fusion.fuse(one_resize(height=8, width=8))
    assert "fused_bilinear_resize" not in ops(res)
    assert any("the input shape of BilinearResize2D 'r' is unknown (pass input shapes)" in r
               for r in rejected(res)), rejected(res)


def test_refuses_an_unknown_like_shape():
    sym = S.contrib.BilinearResize2D(S.var("data"), S.var("ref"), mode="like", name="r")
    res = fusion.fuse(sym, input_shapes={"data": (1, 2, 4, 4)})
    assert "fused_bilinear_resize" not in ops(res)
    assert any("the shape of the like input of BilinearResize2D 'r' is unknown" in r for r in rejected(res)), \
        rejected(res)


def test_refuses_data_that_is_not_4d():
    res = fusion.fuse(one_resize(height=8, width=8), input_shapes={"data": (1, 2, 4, 4, 3)})
    assert "fused_bilinear_resize" not in ops(res)
    assert "the input of BilinearResize2D 'r' has shape (1, 2, 4, 4, 3), not 4-D (N, C, H, W)" in rejected(res)


def test_refuses_what_mxnet_fails_on():
    res = fusion.fuse(one_resize(height=8, width=8, scale_height=2.0), input_shapes={"data": (1, 2, 4, 4)})
    assert "fused_bilinear_resize" not in ops(res)
    assert ("BilinearResize2D 'r' sets scale_height without scale_width (MXNet's shape inference fails on it)"
            in rejected(res)), rejected(res)
    res = fusion.fuse(one_resize(scale_height=0.1, scale_width=1.5), input_shapes={"data": (1, 2, 7, 9)})
    assert "BilinearResize2D 'r' would make a 0x13 output" in rejected(res), rejected(res)


def test_refuses_training_and_the_gpu():
    shapes = {"data": (1, 2, 4, 4)}
    res = fusion.fuse(one_resize(height=8, width=8), input_shapes=shapes, mode="training")
    assert "fused_bilinear_resize" not in ops(res)
    assert "fused_bilinear_resize has no backward; refused in mode='training'" in rejected(res), rejected(res)
    res = fusion.fuse(one_resize(height=8, width=8), input_shapes=shapes, device="gpu")
    assert "fused_bilinear_resize" not in ops(res)
    assert "rewrite failed: fused_bilinear_resize has no gpu implementation in this build" in rejected(res)


def test_a_fused_graph_refuses_training_clearly():
    res = fusion.fuse(one_resize(height=8, width=8), input_shapes={"data": (1, 2, 4, 4)})
    x = mx.nd.array(data((1, 2, 4, 4)))
    x.attach_grad()
    with mx.autograd.record():
        y = mx.nd.fused_bilinear_resize(x, height="8", width="8")
    with pytest.raises(mx.base.MXNetError, match="fused for inference"):
        y.backward()
        mx.nd.waitall()
    assert ops(res)["fused_bilinear_resize"] == 1


@pytest.mark.parametrize("attrs, message", [
    (dict(mode="odd_scale"), "mode odd_scale needs scale_height and scale_width"),
    (dict(height="0"), "height and width must be in"),
    (dict(mode="bicubic"), "attribute 'mode' must be one of"),
    (dict(scale_height="0.1", scale_width="1"), "the output would be 0x9"),
])
def test_op_errors_name_the_problem(attrs, message):
    with pytest.raises(mx.base.MXNetError, match=message):
        mx.nd.fused_bilinear_resize(mx.nd.zeros((1, 1, 7, 9)), **attrs).wait_to_read()


def test_every_mode_and_option_in_one_sweep():
    """A coarse sweep over everything at once (sizes 1 to 9, both align_corners, every mode)."""
    r = np.random.RandomState(3)
    for mode, ac, h, w in itertools.product(MODES, (True, False), (1, 2, 5, 8), (1, 3, 9)):
        x = r.standard_normal((1, 2, h, w)).astype(np.float32)
        kw = dict(mode=mode, align_corners=ac)
        like = None
        if mode == "size":
            kw.update(height=int(r.randint(1, 12)), width=int(r.randint(1, 12)))
        elif mode == "odd_scale":
            kw.update(scale_height=float(r.choice([1.0, 2.0, 3.5])), scale_width=float(r.choice([1.0, 2.0, 2.5])))
        elif mode == "like":
            like = (1, 1, int(r.randint(1, 12)), int(r.randint(1, 12)))
        elif mode.endswith("_down") and (h == 1 or w == 1) and mode == "to_even_down":
            continue
        check(x, like, **kw)
