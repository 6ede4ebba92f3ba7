"""Regions that give back several values (patterns/region.py: ``exported_nodes``; the engine's
``Rule.exported`` and its cycle check, fusion/engine/rewrite.py).

A value inside a region that is also read outside it, or is a graph output, is one of the region's
outputs; a backbone read by several heads is one region instead of a region per stretch between
branch points.  Refused (the region is cut there, with the reason): a value whose reader outside
leads back into the region, and past ``MAX_OUTPUTS``.
"""
import json
import types

import mxnet as mx
import numpy as np
import pytest

import fusion
import patterns.region as region
from fusion.check.cuts import cut_points
from fusion.engine.rewrite import _cycle_reason, implemented
from fusion.ir.graph import Entry, Graph
from fusion.ir.names import GIVES_BACK, gives_back

from conftest import ops, random_params
from test_region import S, X, assert_runs_like_the_stock_ops, bn, conv, fuse_graph, fuse_round_trip, relu

HAS_OP = implemented("fused_region", "cpu")
needs_op = pytest.mark.skipif(not HAS_OP, reason="this op library has no CPU fused_region")


@pytest.fixture(autouse=True)
def regions_on(monkeypatch):
    if not HAS_OP:
        monkeypatch.setattr(region, "op_available", lambda: True)


def backbone_with_heads():
    """Three stages; the second's and the third's outputs each feed a head of their own (a detector's
    shape: stage outputs read by a convolution inside and by a head outside), and one goes through an
    op no region takes."""
    x = relu(bn(conv(S.var("data"), "stem"), "stem_bn"), "stem_relu")
    s1 = relu(conv(relu(conv(x, "s1a")), "s1b") + x, "s1")
    s2 = relu(bn(conv(relu(conv(s1, "s2a", s=2)), "s2b"), "s2_bn"), "s2")
    s3 = relu(conv(relu(conv(s2, "s3a", s=2)), "s3b"), "s3")
    h2 = conv(relu(conv(s2, "h2a")), "h2b", f=4, k=1, p=0)
    h3 = conv(relu(conv(s3, "h3a")), "h3b", f=4, k=1, p=0)
    return S.Group([S.flatten(h2), h3, S.exp(s1)])


def test_a_backbone_read_by_several_heads_is_one_region_with_its_stage_outputs():
    y = backbone_with_heads()
    f = fuse_round_trip(y, rules=["region"])
    counts = sorted(n.num_outputs for n in f.regions())
    # the backbone and the head at its end: one region giving back s1 (read by exp) and s2 (read by
    # the other head); the other head is a region of its own reading s2
    assert len(f.regions()) == 2 and counts == [1, 3], (counts, f.text())
    big = max(f.regions(), key=lambda n: n.num_outputs)
    (d,) = [r["details"] for r in f.report.rules["region"].fused if r["anchor"] == big.name]
    given = " ".join(line for line in d["lines"] if line.startswith("gives back"))
    assert "'s1', read by exp" in given and "'s2', read by Convolution 'h2a'" in given, d["lines"]


def test_each_output_is_the_value_it_replaces_at_two_shapes():
    """Every head of the fused graph equals the original's (unfused: the program's stock ops)."""
    fuse_round_trip(backbone_with_heads(), rules=["region"])


def test_each_output_records_the_value_it_gives_back():
    """A region's name is one of its values; ``__gives_back__`` says which of the original's values
    each output is (fusion/ir/names.py), for verify to cut at them."""
    y = backbone_with_heads()
    f = fuse_round_trip(y, rules=["region"])
    big = max(f.regions(), key=lambda n: n.num_outputs)
    got = [gives_back(Entry(big, i)) for i in range(big.num_outputs)]
    assert {"s1", "s2"} <= {name for name, _ in got} and all(i == 0 for _, i in got), got
    assert len(set(got)) == big.num_outputs
    small = min(f.regions(), key=lambda n: n.num_outputs)
    assert GIVES_BACK not in small.attrs          # one output: its name says it
    assert gives_back(Entry(small)) == (small.name, 0)


def _peaks_head():
    """CenterNet's head: heat = sigmoid(conv(relu(conv(x)))), its peaks heat * (max_pool(heat) == heat)."""
    heat = S.sigmoid(conv(relu(conv(S.var("data"), "h1")), "h2", f=4), name="heat")
    pool = S.Pooling(heat, kernel=(3, 3), stride=(1, 1), pad=(1, 1), pool_type="max", name="peak_pool")
    return S.elemwise_mul(S.broadcast_equal(pool, heat, name="eq"), heat, name="keep")


def test_verify_cuts_where_a_region_gives_back_the_values_a_step_reads():
    """The region (convolutions, sigmoid, pooling) gives back the pooled map and the heat map; the
    comparison after them is inside a fused_elemwise: verify cuts at the original's two values, not
    at the region's name (the pooling) twice, and the cut stands for the comparison and the product
    only."""
    y = _peaks_head()
    f = fuse_graph(y, *random_params(y, X), rules=["region", "elementwise"])
    (r,) = f.regions()
    assert r.num_outputs == 2 and {gives_back(Entry(r, i)) for i in range(2)} == {("peak_pool", 0), ("heat", 0)}
    (cut,) = cut_points(Graph.from_symbol(y), f.graph)
    assert cut.kind == "fused" and cut.node == "keep", cut
    keep = next(n for n in f.graph.op_nodes() if n.name == "keep")
    assert [gives_back(keep.inputs[k]) for k in cut.inputs] == list(cut.at)
    assert set(cut.at) == {("peak_pool", 0), ("heat", 0)} and set(cut.members) == {"keep", "eq"}, cut


def test_an_output_keeps_its_value_where_a_step_would_run_in_place_over_it():
    """s = conv + x is read outside, and relu(s) inside: the relu cannot be the add's post step."""
    x = relu(conv(S.var("data"), "c0"))
    s = conv(x, "c1") + x
    y = S.Group([conv(relu(s), "c2"), S.exp(s)])
    f = fuse_round_trip(y, rules=["region"])
    (p,) = f.programs()
    assert len(p["outputs"]) == 2
    given = p["outputs"][1] - 1            # one data input: values past it are ops
    assert not any(st.get("eltwise") == "relu" for st in p["ops"][given].get("post", [])), p


def test_a_reader_outside_that_leads_back_in_is_not_given_back():
    r = relu(conv(S.var("data"), "c1"), name="r1")
    y = conv(relu(conv(r, "c2")) + S.exp(r), "c3")
    f = fuse_graph(y, *random_params(y, X), rules=["region"])
    assert all(n.num_outputs == 1 for n in f.regions())
    assert "leads back into it" in f.text()


def test_outputs_past_the_limit_cut_the_region(monkeypatch):
    import fusion.engine.rewrite as rewrite
    monkeypatch.setattr(region, "MAX_OUTPUTS", 2)
    monkeypatch.setattr(rewrite, "_PATTERNS", {})      # the rule's pattern, made again with the limit
    f = fuse_graph(backbone_with_heads(), *random_params(backbone_with_heads(), X), rules=["region"])
    assert max(n.num_outputs for n in f.regions()) == 2, f.text()


def _graph_two_branches():
    x = S.var("data")
    a = relu(conv(x, "a"), "ra")
    b = relu(conv(x, "b"), "rb")
    return Graph.from_symbol(S.Group([conv(a, "a2") + conv(b, "b2"), conv(a, "a3") + conv(b, "b3")]))


def test_two_matches_that_read_each_other_are_a_cycle_neither_shows_alone():
    """Match 1 = {a, a2-sum, b3-sum...}: taken apart so that each match reads a value the other gives
    back: the engine's check sees the pair as one cycle."""
    g = _graph_two_branches()
    by = {n.name: n for n in g.nodes}
    add1 = next(n for n in g.op_nodes() if n.op.endswith("add") and by["a2"] in [e.node for e in n.inputs])
    add2 = next(n for n in g.op_nodes() if n.op.endswith("add") and by["a3"] in [e.node for e in n.inputs])
    # match 1 holds branch a (read outside by a3) and the first sum; match 2 holds branch b (read
    # outside by b2, in match 1's sum) and the second sum
    m1 = types.SimpleNamespace(nodes=(by["a"], by["ra"], by["a2"], by["b2"], add1))
    m2 = types.SimpleNamespace(nodes=(by["b"], by["rb"], by["a3"], by["b3"], add2))
    users = g.consumers()
    assert _cycle_reason(m1, users, []) is None and _cycle_reason(m2, users, []) is None
    why = _cycle_reason(m2, users, [m1])
    assert why is not None and "cycle" in why


# ---------------------------------------------------------------- the op

@needs_op
def test_fused_region_gives_back_each_value():
    res = assert_runs_like_the_stock_ops(backbone_with_heads(), regions=2)
    assert sorted(n.num_outputs for n in res.graph.op_nodes() if n.op == "fused_region") == [1, 3]


@needs_op
def test_graph_outputs_inside_a_region_save_load_and_bind(tmp_path):
    r = relu(conv(S.var("data"), "c1"), name="r1")
    y = S.Group([relu(conv(relu(conv(r, "c2")), "c3"), name="out"), r])
    arg, aux = random_params(y, X)
    res = fusion.fuse(y, arg, aux, input_shapes=X)
    assert ops(res).get("fused_region") == 1, res.report.to_text(explain=True)
    res.symbol.save(str(tmp_path / "m-symbol.json"))
    sym = mx.sym.load(str(tmp_path / "m-symbol.json"))
    assert sym.list_outputs() == y.list_outputs()      # the graph's output names stay
    (given,) = [a[GIVES_BACK] for a in sym.attr_dict().values() if GIVES_BACK in a]
    assert sorted(n for n, _ in json.loads(given)) == ["out", "r1"]     # the values the region gives back
    mod = mx.mod.Module(sym, data_names=["data"], label_names=None)
    mod.bind(data_shapes=[("data", X["data"])], for_training=False)
    mod.set_params(res.arg_params, res.aux_params)
    x = mx.nd.random.normal(shape=X["data"])
    mod.forward(mx.io.DataBatch([x]), is_train=False)
    ref = y.bind(mx.cpu(), {"data": x, **arg}, aux_states=aux)
    want = [o.asnumpy() for o in ref.forward()]
    got = [o.asnumpy() for o in mod.get_outputs()]
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max())


@needs_op
def test_onnx_export_of_a_region_with_several_outputs(tmp_path):
    pytest.importorskip("onnxruntime")
    from fusion.onnx.export import export_onnx
    y = backbone_with_heads()
    arg, aux = random_params(y, X)
    res = fusion.fuse(y, arg, aux, input_shapes=X)
    assert ops(res).get("fused_region") == 2
    path = str(tmp_path / "m.onnx")
    export_onnx(res.symbol, res.arg_params, res.aux_params, X, path)
    import onnxruntime as ort
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).normal(size=X["data"]).astype(np.float32)
    got = sess.run(None, {sess.get_inputs()[0].name: x})
    ref = y.bind(mx.cpu(), {"data": mx.nd.array(x), **arg}, aux_states=aux)
    want = [o.asnumpy() for o in ref.forward()]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max())
