"""roi_align: ``_contrib_ROIAlign`` → ``fused_roi_align``, the same values bit for bit, and its refusals."""
import json

import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.native import library as _native

from conftest import ops

S = mx.sym


@pytest.fixture(scope="module", autouse=True)
def _library():
    _native.load()


def random_rois(rng, n_batch, R, H, W, scale, aligned=False):
    """RoIs in image coordinates, some partly or wholly outside the map, some tiny."""
    xy = rng.uniform(-10, max(H, W) / scale, size=(R, 2))
    wh = rng.uniform(0, 40, size=(R, 2)) * rng.choice([1, 0.01], size=(R, 1))
    if aligned:
        wh = np.maximum(wh, 0.5)
    return np.concatenate([rng.randint(0, n_batch, (R, 1)), xy, xy + wh], 1).astype(np.float32)


@pytest.mark.parametrize("seed", range(6))
def test_library_op_equals_mxnet_bit_for_bit(seed):
    rng = np.random.RandomState(seed)
    for _ in range(25):
        N, C, H, W = rng.randint(1, 3), int(rng.choice([1, 3, 64, 70, 130])), rng.randint(1, 20), rng.randint(1, 20)
        scale = float(rng.choice([1.0, 0.5, 0.0625, 0.25]))
        aligned = bool(rng.rand() < 0.3)
        x = rng.standard_normal((N, C, H, W)).astype(np.float32)
        if rng.rand() < 0.2:
            x.reshape(-1)[rng.randint(x.size, size=3)] = rng.choice([np.nan, np.inf], 3)
        rois = random_rois(rng, N, rng.randint(1, 12), H, W, scale, aligned)
        attrs = dict(pooled_size=(int(rng.randint(1, 8)), int(rng.randint(1, 8))), spatial_scale=scale,
                     sample_ratio=int(rng.choice([-1, 1, 2, 3])), aligned=aligned)
        ref = mx.nd.contrib.ROIAlign(mx.nd.array(x), mx.nd.array(rois), **attrs).asnumpy()
        got = mx.nd.fused_roi_align(mx.nd.array(x), mx.nd.array(rois), **attrs).asnumpy()
        assert np.array_equal(ref, got, equal_nan=True), ((N, C, H, W), attrs)


def box_head():
    feat = S.Convolution(S.var("data"), kernel=(1, 1), num_filter=8, name="feat")
    pooled = S.contrib.ROIAlign(feat, S.var("rois"), pooled_size=(3, 3), spatial_scale=0.25, sample_ratio=2,
                                name="roi")
    return S.FullyConnected(pooled, num_hidden=5, name="cls")


def run(sym, arg, feed):
    return sym.bind(mx.cpu(), dict(arg, **{k: mx.nd.array(v) for k, v in feed.items()})).forward()[0].asnumpy()


def test_fuse_unfuse_and_refusals():
    sym = box_head()
    rng = np.random.RandomState(0)
    shapes = {"data": (2, 4, 9, 11), "rois": (6, 5)}
    arg_shapes, _, _ = sym.infer_shape(**shapes)
    arg = {n: mx.nd.array(rng.standard_normal(s).astype(np.float32))
           for n, s in zip(sym.list_arguments(), arg_shapes) if n not in shapes}
    res = fusion.fuse(sym, arg, {}, input_shapes=shapes)
    assert ops(res).get("fused_roi_align") == 1 and "_contrib_ROIAlign" not in ops(res)
    feed = {"data": rng.standard_normal(shapes["data"]).astype(np.float32),
            "rois": random_rois(rng, 2, 6, 9, 11, 0.25)}
    np.testing.assert_allclose(run(res.symbol, res.arg_params, feed), run(sym, arg, feed), rtol=1e-5, atol=1e-6)
    plain = fusion.unfuse(res.symbol)
    nodes = json.loads(plain.tojson())["nodes"]
    assert [n["attrs"]["pooled_size"] for n in nodes if n["op"] == "_contrib_ROIAlign"] == ["(3, 3)"]
    assert not any(n["op"].startswith("fused_") for n in nodes)

    def reasons(r):
        return [x for rr in r.report.rules.values() for x in rr.rejected.values()]
    res = fusion.fuse(sym, arg, {}, input_shapes=shapes, mode="training")
    assert any("fused_roi_align has no backward" in r for r in reasons(res))
    res = fusion.fuse(sym, arg, {}, input_shapes=shapes, device="gpu")
    assert any("fused_roi_align has no gpu implementation" in r for r in reasons(res))
    ps = S.contrib.ROIAlign(S.var("data"), S.var("rois"), pooled_size=(2, 2), spatial_scale=1.0,
                            position_sensitive=True, name="roi")
    res = fusion.fuse(ps, {}, {}, input_shapes={"data": (1, 8, 6, 6), "rois": (3, 5)})
    assert any("is position-sensitive" in r for r in reasons(res))


def test_negative_batch_index_gives_zeros_and_one_past_the_data_an_error():
    x = mx.nd.array(np.random.RandomState(1).standard_normal((1, 3, 8, 8)).astype(np.float32))
    rois = mx.nd.array(np.array([[-1, 0, 0, 4, 4], [0, 1, 1, 6, 6]], np.float32))
    got = mx.nd.fused_roi_align(x, rois, pooled_size=(2, 2), spatial_scale=1.0).asnumpy()
    ref = mx.nd.contrib.ROIAlign(x, rois, pooled_size=(2, 2), spatial_scale=1.0).asnumpy()
    assert not got[0].any() and np.array_equal(got[1], ref[1])
    with pytest.raises(mx.base.MXNetError, match="RoI 0 has batch index 1, the data holds 1"):
        mx.nd.fused_roi_align(x, mx.nd.array(np.array([[1, 0, 0, 4, 4]], np.float32)), pooled_size=(2, 2),
                              spatial_scale=1.0).wait_to_read()
