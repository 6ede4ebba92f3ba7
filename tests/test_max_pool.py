"""max_pool: ``Pooling(max)`` of a plain-layout value → ``fused_max_pool``, the same values bit for bit, and its refusals."""
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


@pytest.mark.parametrize("seed", range(8))
def test_library_op_equals_mxnet_bit_for_bit(seed):
    rng = np.random.RandomState(seed)
    done = 0
    while done < 40:
        k = (rng.randint(1, 5), rng.randint(1, 5))
        s = (rng.randint(1, 4), rng.randint(1, 4))
        p = (rng.randint(0, k[0]), rng.randint(0, k[1]))
        conv = str(rng.choice(["valid", "full"]))
        # maps down to one row or column, smaller than the kernel where the padding makes it fit
        lo = (max(1, k[0] - 2 * p[0]), max(1, k[1] - 2 * p[1]))
        shape = (rng.randint(1, 3), rng.randint(1, 4), rng.randint(lo[0], 14), rng.randint(lo[1], 40))
        x = rng.standard_normal(shape).astype(np.float32)
        kind = rng.rand()
        if kind < 0.5:                       # NaN and ±inf here and there
            flat = x.reshape(-1)
            idx = rng.randint(flat.size, size=rng.randint(1, 8))
            flat[idx] = rng.choice([np.nan, np.inf, -np.inf], size=idx.size)
        elif kind < 0.6:                     # windows of only -inf / NaN
            x[:] = rng.choice([-np.inf, np.nan])
        attrs = dict(kernel=k, stride=s, pad=p, pooling_convention=conv)
        ref = mx.nd.Pooling(mx.nd.array(x), pool_type="max", **attrs).asnumpy()
        got = mx.nd.fused_max_pool(mx.nd.array(x), **attrs).asnumpy()
        assert ref.shape == got.shape and np.array_equal(ref, got, equal_nan=True), (shape, attrs)
        done += 1


def heatmap_peaks(pre="sigmoid"):
    """CenterNet's decoder head: sigmoid heatmap, 3×3 stride-1 max pooling, keep the peaks."""
    x = S.var("data")
    h = S.Convolution(x, kernel=(1, 1), num_filter=5, name="hm")
    heat = {"sigmoid": S.sigmoid(h), "conv": h, "activation": S.Activation(h, act_type="sigmoid")}[pre]
    peak = S.Pooling(heat, kernel=(3, 3), stride=(1, 1), pad=(1, 1), pool_type="max", name="pool")
    return S.broadcast_mul(S.broadcast_equal(peak, heat), heat, name="peaks")


#: the heatmap's convolution, sigmoid and pooling are a region where regions are made (the region gives
#: back the heatmap for the peak test): these tests are of the max_pool rule, so without regions
NO_REGIONS = ["default", "-region"]


def test_where_regions_are_made_the_heatmap_head_is_one():
    """Convolution → sigmoid → pooling in one fused_region giving back the heatmap and its pooling (one
    buffer inside: the peak test compares the values the region made), within the contract's tolerance;
    the ties of the peak test judged as verify judges steps."""
    from fusion.engine.rewrite import implemented
    if not implemented("fused_region", "cpu"):
        pytest.skip("this op library has no CPU fused_region")
    sym = heatmap_peaks()
    shape = (1, 4, 20, 24)
    arg = params(sym, shape)
    res = fusion.fuse(sym, arg, {}, input_shapes={"data": shape})
    regions = [n for n in res.graph.op_nodes() if n.op == "fused_region"]
    assert len(regions) == 1 and regions[0].num_outputs == 2 and "Pooling" not in ops(res), ops(res)
    v = fusion.verify(sym, res, (arg, {}), {"data": shape})
    assert v.ok(1e-4), v


def bind_run(sym, arg, x):
    return sym.bind(mx.cpu(), dict(arg, data=mx.nd.array(x))).forward()[0].asnumpy()


def rejected(res):
    """Refusal reasons, near-misses (listed under --explain) included."""
    return [r for rr in res.report.rules.values() for r in list(rr.rejected.values()) + list(rr.near_misses.values())]


def loud(res):
    return [r for rr in res.report.rules.values() for r in rr.rejected.values()]


def params(sym, shape):
    rng = np.random.RandomState(0)
    shapes, _, _ = sym.infer_shape(data=shape)
    return {n: mx.nd.array(rng.standard_normal(s).astype(np.float32))
            for n, s in zip(sym.list_arguments(), shapes) if n != "data"}


def test_fuse_the_centernet_peaks_and_unfuse():
    sym = heatmap_peaks()
    shape = (1, 4, 20, 24)
    arg = params(sym, shape)
    res = fusion.fuse(sym, arg, {}, input_shapes={"data": shape}, rules=NO_REGIONS)
    assert ops(res).get("fused_max_pool") == 1 and "Pooling" not in ops(res), ops(res)
    x = np.random.RandomState(1).standard_normal(shape).astype(np.float32)
    assert np.array_equal(bind_run(sym, arg, x), bind_run(res.symbol, res.arg_params, x))
    # other input shapes: the rewrite is shape-general
    x2 = np.random.RandomState(2).standard_normal((2, 4, 7, 9)).astype(np.float32)
    assert np.array_equal(bind_run(sym, arg, x2), bind_run(res.symbol, res.arg_params, x2))
    plain = fusion.unfuse(res.symbol)
    nodes = json.loads(plain.tojson())["nodes"]
    pools = [n for n in nodes if n["op"] == "Pooling"]
    assert len(pools) == 1 and pools[0]["attrs"]["pool_type"] == "max" and pools[0]["attrs"]["kernel"] == "(3, 3)"
    assert not any(n["op"].startswith("fused_") for n in nodes)
    assert np.array_equal(bind_run(sym, arg, x), bind_run(plain, res.arg_params, x))


def test_a_graph_input_and_the_full_convention():
    sym = S.Pooling(S.var("data"), kernel=(2, 3), stride=(2, 2), pooling_convention="full", pool_type="max")
    res = fusion.fuse(sym, {}, {}, input_shapes={"data": (2, 3, 9, 10)})
    assert ops(res).get("fused_max_pool") == 1
    x = np.random.RandomState(3).standard_normal((2, 3, 9, 10)).astype(np.float32)
    assert np.array_equal(bind_run(sym, {}, x), bind_run(res.symbol, {}, x))


@pytest.mark.parametrize("pre", ["conv", "activation"])
def test_a_pooling_of_a_onednn_ops_output_stays(pre):
    sym = heatmap_peaks(pre)
    res = fusion.fuse(sym, params(sym, (1, 4, 8, 8)), {}, input_shapes={"data": (1, 4, 8, 8)}, rules=NO_REGIONS)
    assert "fused_max_pool" not in ops(res) and ops(res).get("Pooling") == 1
    assert any("which MXNet runs in oneDNN's layout" in r for r in rejected(res)), rejected(res)
    assert not any("oneDNN's layout" in r for r in loud(res)), loud(res)    # a near-miss: --explain only


@pytest.mark.parametrize("attrs, reason", [
    (dict(kernel=(3, 3), pool_type="avg"), "is avg pooling (only max)"),
    (dict(kernel=(3, 3), pool_type="max", global_pool=True), "is global"),
    (dict(kernel=(3,), pool_type="max"), "is not 2-D"),
    (dict(kernel=(3, 3), pool_type="max", pooling_convention="same"), "uses the 'same' convention"),
])
def test_refusals(attrs, reason):
    x = S.var("data")
    shape = (1, 2, 8) if len(attrs["kernel"]) == 1 else (1, 2, 8, 8)
    sym = S.Pooling(S.sigmoid(x), **attrs)
    res = fusion.fuse(sym, {}, {}, input_shapes={"data": shape})
    assert "fused_max_pool" not in ops(res)
    assert any(reason in r for r in rejected(res)), rejected(res)


def test_training_float16_and_gpu_refused():
    sym = heatmap_peaks()
    shape = (1, 4, 8, 8)
    arg = params(sym, shape)
    res = fusion.fuse(sym, arg, {}, input_shapes={"data": shape}, mode="training")
    assert any("fused_max_pool has no backward" in r for r in loud(res)), loud(res)
    res = fusion.fuse(sym, arg, {}, input_shapes={"data": shape}, device="gpu")
    assert any("fused_max_pool has no gpu implementation" in r for r in rejected(res)), rejected(res)
    half = S.Pooling(S.cast(S.var("data"), dtype="float16"), kernel=(3, 3), pool_type="max")
    res = fusion.fuse(half, {}, {}, input_shapes={"data": shape})
    assert any("is not float32" in r for r in rejected(res)), rejected(res)


def test_onnx_export_through_mxnets_pooling(tmp_path):
    from fusion.onnx.export import export_onnx
    sym = heatmap_peaks()
    shape = (1, 4, 10, 12)
    arg = params(sym, shape)
    res = fusion.fuse(sym, arg, {}, input_shapes={"data": shape}, rules=NO_REGIONS)
    assert ops(res).get("fused_max_pool") == 1
    v = export_onnx(res.symbol, res.arg_params, res.aux_params, {"data": shape}, str(tmp_path / "m.onnx"))
    assert v is not None and v.max_rel < 1e-5, v
    import onnx
    assert "MaxPool" in {n.op_type for n in onnx.load(str(tmp_path / "m.onnx")).graph.node}
