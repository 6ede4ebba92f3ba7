"""The memory plan (fusion/engine/memory.py): the checks estimate their peak from the inferred shapes
before they run, hold at most what the budget (``--max-memory``, ``max_memory=``) allows, run smaller
where they must — and the report says so —, and stop with one line (exit status 2, nothing written)
where even their smallest plan would not fit."""
import json
import os

import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.doors import cli
from fusion.engine import memory
from fusion.engine.rule import Rule
from fusion.ir.errors import FusionError
from fusion.ir.graph import Graph
from fusion.ir.pattern import Var, op

from conftest import random_params, run_mxfuse as run_cli

S = mx.sym


def one_line_error(code, err, *fragments):
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("mxfuse: error: ") and "Traceback" not in err, err
    for f in fragments:
        assert f in err, (f, err)


def save(tmp_path, sym, shapes, name="model"):
    arg, aux = random_params(sym, shapes)
    sp, pp = tmp_path / (name + "-symbol.json"), tmp_path / (name + "-0000.params")
    sym.save(str(sp))
    mx.nd.save(str(pp), {**{"arg:" + k: v for k, v in arg.items()}, **{"aux:" + k: v for k, v in aux.items()}})
    return sp, pp


def conv_stack(layers=4, filters=16):
    y = S.var("data")
    for i in range(layers):
        y = S.Convolution(y, num_filter=filters, kernel=(3, 3), pad=(1, 1), name="conv%d" % i)
        y = S.BatchNorm(y, fix_gamma=False, eps=1e-5, name="bn%d" % i)
        y = S.Activation(y, act_type="relu", name="relu%d" % i)
    return S.Pooling(y, kernel=(1, 1), global_pool=True, pool_type="avg", name="pool")


def dense_net(units=1024):
    """Parameters (8 MiB) far larger than its values: MXNet's oneDNN backend, which keeps a reordered
    copy of the weights, takes about twice what a run without it takes."""
    y = S.FullyConnected(S.var("data"), num_hidden=units, name="fc0")
    y = S.Activation(y, act_type="relu", name="relu0")
    return S.FullyConnected(y, num_hidden=units, name="fc1")


# ---------------------------------------------------------------- sizes, the budget, the estimate

@pytest.mark.parametrize("text,value", [("4G", 4 << 30), ("500M", 500 << 20), ("1.5GiB", 3 << 29), ("64k", 64 << 10),
                                        ("123", 123), (" 2 t ", 2 << 40), ("300KB", 300 << 10), (4096, 4096)])
def test_sizes_are_read_as_mxfuse_takes_them(text, value):
    assert memory.parse_size(text) == value


@pytest.mark.parametrize("text", ["4Q", "", "G", "-1G", "0", "0.1", "1e9", "four", True])
def test_a_bad_size_is_one_line(text):
    with pytest.raises(FusionError) as e:
        memory.parse_size(text)
    assert "\n" not in str(e.value) and "--max-memory" in str(e.value)


@pytest.mark.parametrize("value,message", [("4Q", "'4Q' is not a size such as 4G or 500M"),
                                           ("0", "'0' is not a size"), ("-5M", "'-5M' is not a size")])
def test_max_memory_parsing_errors_are_one_line(tmp_path, capsys, value, message):
    sp, pp = save(tmp_path, conv_stack(1, 4), {"data": (1, 3, 8, 8)})
    before = sorted(os.listdir(tmp_path))
    code, _, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "o", "--shape", "data=1,3,8,8",
                           "--max-memory=%s" % value)
    one_line_error(code, err, "argument --max-memory: " + message)
    assert sorted(os.listdir(tmp_path)) == before


def test_the_default_budget_is_a_share_of_the_memory_available():
    avail, where = memory.available_memory()
    assert avail is not None and avail > 0, where
    b = memory.budget()
    assert b.limit is not None and abs(b.limit - memory.DEFAULT_SHARE * avail) < 0.05 * avail
    assert "60 % of the" in b.source
    assert memory.budget("2G").limit == 2 << 30 and memory.budget("2G").source == "max_memory=2G"
    assert memory.budget("2G", door="cli").source == "--max-memory 2G"


def test_the_live_peak_frees_each_value_after_its_last_reader():
    # a chain of three 1 MiB values: at most two alive at once (an op's input and its output)
    y = S.relu(S.sigmoid(S.tanh(S.var("x"), name="a"), name="b"), name="c")
    g = Graph.from_symbol(y)
    from fusion.engine.facts import infer
    shapes, types = infer(g, {"x": (256, 1024)}, {"x": "float32"})
    est = memory.graph_memory(g, shapes, types, set())
    mib = 1 << 20
    assert est.inputs == mib and est.outputs == mib and est.all_values == 3 * mib and est.live_peak == 2 * mib
    assert est.run() == int(memory.EXECUTOR_FACTOR * 2 * mib) + 2 * mib


# ---------------------------------------------------------------- the self-check

def test_a_self_check_over_a_small_budget_runs_in_groups_and_says_so(tmp_path, capsys):
    sp, pp = save(tmp_path, conv_stack(), {"data": (1, 3, 256, 256)})
    rep = tmp_path / "r.json"
    # each rewrite, checked on its own at 8x8, needs about 20 KiB; the five of them together more than 60
    code, out, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "o" / "m", "--shape", "data=1,3,256,256",
                             "--max-memory", "60K", "--report", rep)
    assert code == 0, err
    assert "note: self-check: rewrites run a few at a time (on their own), not all in one MXNet executor" in out, out
    assert "self-check: 5 rewrite(s) checked" in out
    report = json.loads(rep.read_text())
    assert report["memory"]["limit_bytes"] == 60 << 10 and report["memory"]["source"] == "--max-memory 60K"
    assert any("a few at a time" in n for n in report["memory"]["reductions"])
    assert sorted(os.listdir(tmp_path / "o")) == ["m-0000.params", "m-symbol.json"]


def test_a_self_check_that_cannot_fit_at_all_is_one_line_and_writes_nothing(tmp_path, capsys):
    sp, pp = save(tmp_path, conv_stack(), {"data": (1, 3, 256, 256)})
    before = sorted(os.listdir(tmp_path))
    code, out, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "o" / "m", "--shape", "data=1,3,256,256",
                             "--max-memory", "2K", "--report", tmp_path / "r.json")
    one_line_error(code, err, "the self-check needs about", "KiB (to run one rewrite, conv_bn_act at",
                   "over the memory budget of 2.0 KiB (--max-memory 2K)", "raise --max-memory or pass --no-self-check")
    assert out == "" and sorted(os.listdir(tmp_path)) == before
    # the flag that helps does
    code, _, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "o" / "m", "--shape", "data=1,3,256,256",
                           "--max-memory", "2K", "--no-self-check")
    assert code == 0, err


class ReluToClip50(Rule):
    """relu(x) -> clip(x, 0, 50): right for inputs up to 50.  It names 50, so it is checked on the graph's
    own values at the small probes (not on its own at 8x8)."""
    name = "relu_to_clip50"

    def pattern(self):
        return op.relu(Var("x"), name="r")

    def rewrite(self, m, b):
        return b.op("clip", [m["x"]], attrs={"a_min": 0, "a_max": 50}, name=m.anchor.name)


def test_where_the_graph_cannot_be_run_the_rewrite_reads_drawn_inputs_and_the_report_says_so():
    # the graph's values at the small probes take MiBs (64 channels); the rewrite's, a few dozen KiB
    y = S.tanh(S.Convolution(S.var("data"), num_filter=64, kernel=(3, 3), pad=(1, 1), name="wide"))
    y = S.relu(S.tanh(S.Convolution(y, num_filter=2, kernel=(3, 3), pad=(1, 1), name="narrow")), name="last")
    shapes = {"data": (1, 3, 256, 256)}
    arg, aux = random_params(y, shapes)
    full = fusion.fuse(y, arg, aux, rules=[ReluToClip50()], input_shapes=shapes)
    assert full.report.fused_count == 1 and full.report.self_check.checked == 1, full.report.to_text()
    assert "not computed" not in full.report.to_text()
    assert {"data": (1, 3, 64, 64)} in full.report.self_check.probes        # the graph's own values there
    small = fusion.fuse(y, arg, aux, rules=[ReluToClip50()], input_shapes=shapes, max_memory="400K")
    assert small.report.fused_count == 1 and small.report.self_check.checked == 1
    text = small.report.to_text()
    assert "the graph's own values at input shapes data=1,3,64,64 not computed" in text, text
    assert "the rewrites checked there read drawn inputs" in text
    assert small.report.extra["memory"]["limit_bytes"] == 400 << 10
    # and a wrong rewrite is still refused on the drawn inputs
    class ReluToClipHalf(ReluToClip50):
        name = "relu_to_clip_half"

        def rewrite(self, m, b):
            return b.op("clip", [m["x"]], attrs={"a_min": 0, "a_max": 0.5}, name=m.anchor.name)

    wrong = fusion.fuse(y, arg, aux, rules=[ReluToClipHalf()], input_shapes=shapes, max_memory="400K")
    assert wrong.report.fused_count == 0 and wrong.report.self_check.refused == 1


# ---------------------------------------------------------------- --verify and --benchmark

def test_verify_leaves_out_the_backends_run_where_it_does_not_fit(tmp_path, capsys):
    sp, pp = save(tmp_path, dense_net(), {"data": (1, 1024)})
    code, out, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "o" / "m", "--shape", "data=1,1024",
                             "--verify", "--max-memory", "10M")
    assert code == 0, err
    assert "verify: max abs error" in out and "OK" in out
    assert "verify: the original's own spread (a run with MXNet's oneDNN backend on" in out, out
    assert "the original's own spread (its outputs with" not in out          # not measured
    code, out, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "o2" / "m", "--shape", "data=1,1024",
                             "--verify")
    assert code == 0 and "the original's own spread (its outputs with" in out, out


def test_benchmark_binds_one_executor_at_a_time_where_a_pair_does_not_fit(tmp_path, capsys):
    from fusion.check.bench import benchmark_plan
    from fusion.engine.memory import Budget

    sym, shapes = dense_net(), {"data": (1, 1024)}
    args = {n: mx.nd.ones(s) for n, s in zip(sym.list_arguments(), sym.infer_shape(**shapes)[0]) if n != "data"}
    budget = Budget(1 << 40, "test")
    assert benchmark_plan(sym, args, {}, None, shapes, budget) == [["original", "fused"],
                                                                  ["original_no_subgraph", "fused_no_subgraph"]]
    pair, one = budget.estimates["benchmark"]["one_pair"], budget.estimates["benchmark"]["one"]
    assert one < pair
    sp, pp = save(tmp_path, sym, shapes)
    code, out, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "o" / "m", "--shape", "data=1,1024",
                             "--benchmark", "--repeats", "2")
    assert code == 0 and "note: benchmark:" not in out, out           # the pairs: the usual plan
    code, out, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "o2" / "m", "--shape", "data=1,1024",
                             "--benchmark", "--repeats", "2", "--max-memory", str((one + pair) // 2))
    assert code == 0, err
    assert "note: benchmark: one executor at a time" in out, out
    assert "speed-up, like for like" in out


def test_verify_that_cannot_fit_one_run_stops_before_fusing(tmp_path, capsys, monkeypatch):
    sp, pp = save(tmp_path, dense_net(), {"data": (1, 1024)})
    monkeypatch.setattr(cli, "fuse", lambda *a, **k: pytest.fail("fused although --verify cannot run"))
    before = sorted(os.listdir(tmp_path))
    code, out, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "o" / "m", "--shape", "data=1,1024",
                             "--verify", "--max-memory", "1M")
    one_line_error(code, err, "--verify needs about", "(one run of the model at data=1,1024, one executor at a time)",
                   "over the memory budget of 1.0 MiB (--max-memory 1M); raise --max-memory or drop --verify")
    code, out, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "o" / "m", "--shape", "data=1,1024",
                             "--benchmark", "--max-memory", "1M")
    one_line_error(code, err, "--benchmark needs about", "raise --max-memory or drop --benchmark")
    assert sorted(os.listdir(tmp_path)) == before


def test_verify_in_python_takes_max_memory():
    sym = dense_net(256)
    shapes = {"data": (2, 256)}
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    v = fusion.verify((sym, arg, aux), res, input_shapes=shapes)
    assert v.ok() and v.spread is not None and not v.memory_notes
    with pytest.raises(memory.OverBudget, match=r"verify\(\) needs about .* \(max_memory=10K\); raise max_memory="):
        fusion.verify((sym, arg, aux), res, input_shapes=shapes, max_memory="10K")


def test_the_gluon_backend_takes_max_memory_and_self_check():
    from mxnet import gluon

    def net():
        mx.random.seed(0)
        n = gluon.nn.HybridSequential()
        n.add(gluon.nn.Conv2D(8, 3, padding=1), gluon.nn.BatchNorm(), gluon.nn.Activation("relu"))
        n.initialize(mx.init.Xavier())
        return n

    x = mx.nd.array(np.random.default_rng(0).standard_normal((1, 3, 16, 16)))
    small = net()
    small.hybridize(backend="fusion", backend_opts={"max_memory": "1K"})
    with pytest.raises(memory.OverBudget, match=r"the self-check needs about .* \(max_memory=1K\); raise "
                                                r"max_memory= or pass self_check=False"):
        small(x)
    off = net()
    off.hybridize(backend="fusion", backend_opts={"max_memory": "1K", "self_check": False})
    off(x)
    assert off.fusion_report.fused_count == 1 and off.fusion_report.self_check is None
