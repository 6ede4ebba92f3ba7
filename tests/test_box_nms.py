"""box_nms: ``_contrib_box_nms`` → ``fused_box_nms``, the same output bit for bit (both outputs), and its refusals."""
import json

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

import fusion
from fusion.native import library as _native

from conftest import ops

S = mx.sym


@pytest.fixture(scope="module", autouse=True)
def _library():
    _native.load()


def boxes(rng, shape, fmt="corner", classes=4, tie_levels=None, nan=False, coord_start=2, score_index=1,
          id_index=0):
    """Rows [id, score, 4 coordinates (, extra)] (indices as given): scores in [0, 1) (rounded to
    ``tie_levels`` levels: many ties), boxes of width/height in [-0.5, 4) around [0, 10)²."""
    x = rng.uniform(0, 1, size=shape).astype(np.float32)
    if tie_levels:
        x[..., score_index] = np.floor(x[..., score_index] * tie_levels) / tie_levels
    if id_index >= 0:
        x[..., id_index] = rng.randint(-1, classes, size=x.shape[:-1])
    c = rng.uniform(0, 10, size=x.shape[:-1] + (2,))
    wh = rng.uniform(-0.5, 4, size=c.shape)
    x[..., coord_start:coord_start + 2] = c
    x[..., coord_start + 2:coord_start + 4] = c + wh if fmt == "corner" else wh
    if nan:
        flat = x.reshape(-1)
        flat[rng.randint(flat.size, size=3)] = np.nan
    return x


def with_hidden_output(sym):
    """``sym`` (one NMS node ``nms`` somewhere) with the NMS's hidden second output (each kept row's
    input position) appended to its outputs: a symbol's Python API does not reach it, its JSON does."""
    js = json.loads(sym.tojson())
    nms = [i for i, n in enumerate(js["nodes"]) if n["name"] == "nms"][0]
    js["heads"].append([nms, 1, 0])
    return mx.sym.load_json(json.dumps(js))


def both_outputs(op, x, attrs):
    """(output, hidden second output) of ``op`` on ``x``, through a bound symbol."""
    exe = with_hidden_output(op(S.var("data"), name="nms", **attrs)).bind(mx.cpu(), {"data": mx.nd.array(x)})
    return [o.asnumpy() for o in exe.forward()]


def random_attrs(rng, fmt):
    return dict(overlap_thresh=float(rng.choice([0.0, 0.1, 0.45, 0.7, 1.0])),
                valid_thresh=float(rng.choice([0.0, 0.01, 0.5])),
                topk=int(rng.choice([-1, 0, 1, 7, 100])),
                id_index=int(rng.choice([-1, 0])), background_id=int(rng.choice([-1, 0, 2])),
                force_suppress=bool(rng.randint(2)), in_format=fmt,
                out_format=str(rng.choice(["corner", "center"])))


@pytest.mark.parametrize("seed", range(12))
def test_library_op_equals_mxnet_bit_for_bit(seed):
    rng = np.random.RandomState(seed)
    for _ in range(12):
        fmt = str(rng.choice(["corner", "center"]))
        shape = [(40, 6), (2, 300, 6), (2, 3, 50, 7), (1, 1, 6), (3, 2, 6)][rng.randint(5)]
        x = boxes(rng, shape, fmt, tie_levels=[None, 4, 20][rng.randint(3)], nan=rng.rand() < 0.3)
        attrs = random_attrs(rng, fmt)
        ref = both_outputs(S.contrib.box_nms, x, attrs)
        got = both_outputs(S.fused_box_nms, x, attrs)
        for r, g in zip(ref, got):
            assert r.shape == g.shape and np.array_equal(r, g, equal_nan=True), (shape, attrs)


def test_other_column_layouts_equal_mxnet():
    """Faster R-CNN's proposals: [score, 4 coordinates], no class; scores at the end of wider rows."""
    rng = np.random.RandomState(3)
    for layout in (dict(coord_start=1, score_index=0, id_index=-1), dict(coord_start=0, score_index=6, id_index=4)):
        x = boxes(rng, (2, 500, 7), **layout)
        for force in (False, True):
            attrs = dict(layout, overlap_thresh=0.7, topk=60, force_suppress=force)
            ref = both_outputs(S.contrib.box_nms, x, attrs)
            got = both_outputs(S.fused_box_nms, x, attrs)
            for r, g in zip(ref, got):
                assert np.array_equal(r, g, equal_nan=True), attrs


def detector(topk=50):
    """A toy detection head: scores and boxes from a dense layer, sigmoid, concatenated to
    [id, score, box] rows, NMS, the first 10 rows out."""
    x = S.var("data")
    h = S.FullyConnected(x, num_hidden=6 * 64, name="head")
    rows = S.reshape(h, shape=(0, 64, 6))
    ids = S.floor(S.slice_axis(rows, axis=2, begin=0, end=1).abs() * 2)
    score = S.sigmoid(S.slice_axis(rows, axis=2, begin=1, end=2))
    xy = S.slice_axis(rows, axis=2, begin=2, end=4) * 5
    wh = S.exp(S.slice_axis(rows, axis=2, begin=4, end=6))
    dets = S.concat(ids, score, xy, xy + wh, dim=2)
    nms = S.contrib.box_nms(dets, overlap_thresh=0.3, valid_thresh=0.2, topk=topk, id_index=0, name="nms")
    return S.slice_axis(nms, axis=1, begin=0, end=10, name="top")


def params(sym, shape, seed=0):
    rng = np.random.RandomState(seed)
    arg_shapes, _, _ = sym.infer_shape(data=shape)
    return {n: mx.nd.array(rng.standard_normal(s).astype(np.float32))
            for n, s in zip(sym.list_arguments(), arg_shapes) if n != "data"}


def run(sym, arg, x):
    exe = sym.bind(mx.cpu(), dict(arg, data=mx.nd.array(x)))
    return [o.asnumpy() for o in exe.forward()]


def test_fuse_replaces_the_op_and_keeps_outputs_and_names():
    sym = detector()
    arg = params(sym, (2, 16))
    res = fusion.fuse(sym, arg, {}, input_shapes={"data": (2, 16)})
    assert ops(res).get("fused_box_nms") == 1 and "_contrib_box_nms" not in ops(res)
    assert len(res.report.rules["box_nms"].fused) == 1
    x = np.random.RandomState(1).standard_normal((2, 16)).astype(np.float32)
    for r, g in zip(run(sym, arg, x), run(res.symbol, res.arg_params, x)):
        assert np.array_equal(r, g)
    # the op as a graph output: its name is kept (a node of two outputs: nms_output0)
    head = S.contrib.box_nms(S.var("data"), topk=5, name="nms")
    fused = fusion.fuse(head, {}, {}, input_shapes={"data": (3, 20, 6)})
    assert fused.symbol.list_outputs() == head.list_outputs() == ["nms_output0"]
    assert ops(fused).get("fused_box_nms") == 1


def test_a_graph_reading_the_hidden_output_is_fused_exactly():
    nms = S.contrib.box_nms(S.var("data"), topk=20, id_index=0, name="nms")
    sym = with_hidden_output(S.slice_axis(nms, axis=1, begin=0, end=5))
    assert sym.list_outputs() == ["slice_axis0_output", "nms_output1"] or len(sym.list_outputs()) == 2
    res = fusion.fuse(sym, {}, {}, input_shapes={"data": (2, 30, 6)})
    assert ops(res).get("fused_box_nms") == 1
    x = boxes(np.random.RandomState(2), (2, 30, 6), tie_levels=5)
    for r, g in zip(run(sym, {}, x), run(res.symbol, {}, x)):
        assert np.array_equal(r, g)


def test_unfuse_gives_back_mxnets_op():
    sym = detector()
    arg = params(sym, (2, 16))
    res = fusion.fuse(sym, arg, {}, input_shapes={"data": (2, 16)})
    plain = fusion.unfuse(res.symbol)
    nodes = json.loads(plain.tojson())["nodes"]
    nms = [n for n in nodes if n["op"] == "_contrib_box_nms"]
    assert len(nms) == 1 and not any(n["op"].startswith("fused_") for n in nodes)
    assert nms[0]["attrs"]["topk"] == "50" and nms[0]["attrs"]["id_index"] == "0"
    x = np.random.RandomState(4).standard_normal((2, 16)).astype(np.float32)
    for r, g in zip(run(sym, arg, x), run(plain, res.arg_params, x)):
        assert np.array_equal(r, g)


def test_gluon_door():
    sym = detector()
    arg = params(sym, (2, 16))
    x = mx.nd.array(np.random.RandomState(5).standard_normal((2, 16)).astype(np.float32))
    ref = gluon.SymbolBlock(sym, [S.var("data")])
    net = gluon.SymbolBlock(sym, [S.var("data")])
    for blk in (ref, net):
        for name, p in blk.collect_params().items():
            p.set_data(arg[name]) if p._data is not None else (p.initialize(), p.set_data(arg[name]))
    net.hybridize(backend="fusion")
    got = net(x).asnumpy()
    # the head's other fused ops (dense, elementwise) round as fused ops do: equal to float rounding
    np.testing.assert_allclose(got, ref(x).asnumpy(), rtol=1e-5, atol=1e-6)
    assert len(net.fusion_report.rules["box_nms"].fused) == 1
    assert ops(net._cached_graph[1]).get("fused_box_nms") == 1


def rejected(res):
    return [r for rr in res.report.rules.values() for r in rr.rejected.values()]


def test_refusals():
    # float16 boxes: the library op computes in float32
    d = S.var("data")
    half = S.contrib.box_nms(S.cast(d, dtype="float16"), topk=5, name="nms")
    res = fusion.fuse(half, {}, {}, input_shapes={"data": (1, 20, 6)})
    assert "_contrib_box_nms" in ops(res)
    assert any("is not float32" in r for r in rejected(res)), rejected(res)
    # training: the library op has no backward
    res = fusion.fuse(detector(), {}, {}, input_shapes={"data": (2, 16)}, mode="training")
    assert "_contrib_box_nms" in ops(res)
    assert any("fused_box_nms has no backward" in r for r in rejected(res)), rejected(res)
    # the GPU: no implementation there
    res = fusion.fuse(detector(), {}, {}, input_shapes={"data": (2, 16)}, device="gpu")
    assert "_contrib_box_nms" in ops(res)
    assert any("fused_box_nms has no gpu implementation" in r for r in rejected(res)), rejected(res)


def test_bad_rows_get_a_clear_error():
    x = mx.nd.zeros((1, 10, 6))
    with pytest.raises(mx.base.MXNetError, match="fused_box_nms: coordinates \\[4, 7\\] out of range"):
        mx.nd.fused_box_nms(x, coord_start=4).wait_to_read()
    with pytest.raises(mx.base.MXNetError, match="fused_box_nms: the last dimension must have at least 6"):
        mx.nd.fused_box_nms(mx.nd.zeros((1, 10, 5)), id_index=0).wait_to_read()


def test_onnx_export_goes_through_mxnets_converter(tmp_path):
    """fused_box_nms is exported un-fused: MXNet 1.9.1's own converter for _contrib_box_nms writes it
    (what it writes, and whether ONNX Runtime runs it, is MXNet's: the same as for the original)."""
    from fusion.onnx.export import export_onnx
    from fusion.ir.errors import FusionError
    sym = detector()
    arg = params(sym, (2, 16))
    res = fusion.fuse(sym, arg, {}, input_shapes={"data": (2, 16)})
    outcomes = []
    for s, a in ((sym, arg), (res.symbol, res.arg_params)):
        try:
            export_onnx(s, a, {}, {"data": (2, 16)}, str(tmp_path / ("m%d.onnx" % len(outcomes))))
            outcomes.append("ok")
        except FusionError as e:
            outcomes.append(type(e).__name__ + ": " + str(e).split(":")[0])
    assert outcomes[0] == outcomes[1], outcomes
