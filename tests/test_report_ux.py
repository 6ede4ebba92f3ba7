"""What mxfuse tells a person: --list-rules, --version, what a report records, the rule table of docs/rules.md."""
import json
import os
import re

import mxnet as mx
import pytest

import fusion
from patterns import FAMILIES, default_rules, rules_by_name

from conftest import random_params, run_mxfuse, small_cnn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


run_cli = run_mxfuse


def test_a_family_and_a_rule_never_share_a_name():
    rule_names = [r.name for r in default_rules()]
    assert len(set(rule_names)) == len(rule_names)
    assert not set(FAMILIES) & set(rule_names)
    known = rules_by_name()
    assert [r.name for r in known["attention"]] == ["attention"]        # the rule, as the report names it
    assert [r.name for r in known["conv_bn_act"]] == ["conv_bn_act"]
    assert [r.name for r in known["bn_folding"]] == ["conv_bn_add_act", "conv_bn_act", "conv_bn", "dense_bn"]
    assert "attention_interleaved" in [r.name for r in known["attention_fusion"]]


def test_docs_rule_table_lists_every_rule_with_its_family():
    text = open(os.path.join(ROOT, "docs", "rules.md"), encoding="utf-8").read()
    table = text[text.index("| rule | family | file |"):]
    table = table[: table.index("\n\n")]
    rows = [[c.strip().strip("`") for c in ln.strip("|").split("|")] for ln in table.splitlines()[2:]]
    listed = {row[0]: row[1] for row in rows}
    from patterns import family_of

    assert listed == {r.name: family_of(r.name) or "–" for r in default_rules()}


def test_list_rules_and_version(capsys):
    code, out, err = run_cli(capsys, "--list-rules")
    assert code == 0 and not err
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["rule", "family", "mode"]
    by_rule = {ln.split()[0]: ln for ln in lines[1:] if ln.strip() and not ln.startswith("--rules")}
    assert set(by_rule) == {r.name for r in default_rules()}
    assert re.match(r"dense_bn +bn_folding +inference only +fold BatchNorm", by_rule["dense_bn"])
    assert re.match(r"attention_heads +attention_fusion +inference and training ", by_rule["attention_heads"])
    code, out, err = run_cli(capsys, "--version")
    assert code == 0 and out == "mxfuse %s (MXNet %s, Python %s)\n" % (
        fusion.__version__, mx.__version__, __import__("platform").python_version())


def test_report_records_versions_shapes_and_command_line(tmp_model, tmp_path, capsys):
    sp, pp = tmp_model()
    report, page = tmp_path / "r.json", tmp_path / "r.html"
    code, _, err = run_cli(capsys, sp, "--params", pp, "-o", str(tmp_path / "out") + "/", "--shape", "data=1,3,8,8",
                           "--report", report, "--html", page, "--quiet")
    assert code == 0, err
    d = json.loads(report.read_text())
    assert d["versions"] == {"mxnet_fusion": fusion.__version__, "mxnet": mx.__version__,
                             "python": __import__("platform").python_version()}
    assert d["input_shapes"] == {"data": [1, 3, 8, 8]}
    assert d["command_line"] == "mxfuse %s --params %s -o %s/ --shape data=1,3,8,8 --report %s --html %s --quiet" % (
        sp, pp, tmp_path / "out", report, page)
    html = page.read_text()
    assert "MXNet %s" % mx.__version__ in html and "input shapes: data=1,3,8,8" in html
    assert "command: mxfuse " in html


def test_batch_reports_record_the_batch_command(tmp_path):
    import io

    from fusion.doors import batch

    sym = small_cnn()
    arg, aux = random_params(sym, {"data": (1, 3, 8, 8)})
    sym.save(str(tmp_path / "m-symbol.json"))
    mx.nd.save(str(tmp_path / "m-0000.params"), {**{"arg:" + k: v for k, v in arg.items()},
                                                  **{"aux:" + k: v for k, v in aux.items()}})
    argv = [str(tmp_path / "m-symbol.json"), str(tmp_path / "m-symbol.json"), "-o", str(tmp_path / "out"),
            "--reports", "--shape", "data=1,3,8,8"]
    assert batch.main_batch(argv, stdout=io.StringIO(), stderr=io.StringIO()) == 0
    d = json.loads((tmp_path / "out" / "m-report.json").read_text())
    assert d["command_line"] == "mxfuse " + " ".join(argv) and d["input_shapes"] == {"data": [1, 3, 8, 8]}


@pytest.mark.parametrize("name", ["attention_fusion", "bn_folding", "inference_cleanup", "gelu", "conv_bn"])
def test_rules_option_takes_family_and_rule_names(name):
    sym = small_cnn()
    res = fusion.fuse(sym, rules=[name])
    assert set(res.report.rules) <= {r.name for r in rules_by_name()[name]}


def _residual_blocks(n):
    """n blocks of relu(BatchNorm(conv(x)) + x): each an Activation over an add, like dense_act's tail."""
    x = mx.sym.var("data")
    for i in range(n):
        y = mx.sym.Convolution(x, num_filter=3, kernel=(1, 1), name="conv%d" % i)
        y = mx.sym.BatchNorm(y, name="bn%d" % i)
        x = mx.sym.Activation(mx.sym.elemwise_add(y, x, name="plus%d" % i), act_type="relu", name="relu%d" % i)
    return x


@pytest.mark.usefixtures("no_regions")
def test_explain_groups_near_misses_by_rule_and_kind():
    sym = _residual_blocks(5)
    res = fusion.fuse(sym, *random_params(sym, {"data": (1, 3, 4, 4)}), input_shapes={"data": (1, 3, 4, 4)})
    assert len(res.report.rules["elementwise"].near_misses) == 10
    text = res.report.to_text(explain=True)
    tail = "is in the tail of a convolution or dense layer: left to MXNet's oneDNN backend, which fuses it there"
    assert [ln for ln in text.splitlines() if "near-miss" in ln or "×" in ln] == [
        "  near-misses of elementwise: 10, 2 kind(s)",
        "    5× Activation %s  (at relu4, relu3, relu2 (+2 more))" % tail,
        "    5× elemwise_add %s  (at plus4, plus3, plus2 (+2 more))" % tail,
        "  near-misses of inverted_residual: 9, 2 kind(s)",
        "    8× input 0 of Activation: expected Convolution, found elemwise_add  (at plus4, conv4, plus3 (+5 more))",
        "    1× input 0 of Convolution 'conv0': expected fused_se, found variable 'data'  (at plus0)"], text
    kinds = [r for r in res.report.to_dict()["rules"] if r["rule"] == "elementwise"][0]["near_miss_kinds"]
    assert [(k["count"], len(k["anchors"])) for k in kinds] == [(5, 5), (5, 5)]


def test_near_miss_reasons_name_no_pattern_internals():
    x = mx.sym.var("x")
    y = mx.sym.FullyConnected(x, num_hidden=8, name="fc")
    gate = mx.sym.sigmoid(mx.sym.FullyConnected(x, num_hidden=8, name="fc2"), name="gate")
    z = mx.sym.relu(mx.sym.broadcast_add(y, gate, name="add"), name="act")
    res = fusion.fuse(z, *random_params(z, {"x": (64, 16)}), rules=["dense_act"], input_shapes={"x": (64, 16)})
    reason = res.report.rules["dense_act"].near_misses["act"]
    assert reason == ("input 1 of broadcast_add 'add' must be a parameter (a value from the params), "
                      "but is computed by sigmoid 'gate'")


def test_an_input_of_the_graph_is_not_blamed_on_missing_params():
    x, r = mx.sym.var("x"), mx.sym.var("data")
    z = mx.sym.relu(mx.sym.broadcast_add(mx.sym.FullyConnected(x, num_hidden=8, name="fc"), r, name="residual"),
                    name="act")
    arg, aux = random_params(z, {"x": (64, 16), "data": (64, 8)}, inputs=["x", "data"])
    res = fusion.fuse(z, arg, aux, rules=["dense_act"], input_shapes={"x": (64, 16)})   # no shape for 'data'
    reason = res.report.rules["dense_act"].near_misses["act"]
    assert "(pass params)" not in reason and ("'data', read as a bias, is not a parameter (the params do not hold "
                                              "it: it is an input of the graph)") in reason, reason
    res = fusion.fuse(z, rules=["dense_act"], input_shapes={"x": (64, 16)})                 # no params at all
    assert "has neither a value nor a known shape (pass params)" in res.report.rules["dense_act"].near_misses["act"]


def test_benchmark_figures_spread_like_for_like_and_slower_warning():
    from fusion.check import bench
    from fusion.engine.report import benchmark_lines

    ms = [i / 1e3 for i in range(1, 11)]                     # 1..10 ms: median 5.5, p10 1.9, p90 9.1
    b = bench.figures({"original": ms, "fused": [t * 2 for t in ms],
                       "original_no_subgraph": [t * 4 for t in ms], "fused_no_subgraph": [t + 1e-4 for t in ms]})
    assert b["median_ms"]["original"] == 5.5 and b["p10_ms"]["original"] == 1.9 and b["p90_ms"]["original"] == 9.1
    assert b["rounds"] == 10
    assert (b["speedup_vs_mxnet_default"], b["speedup_both_subgraph_off"]) == (0.5, 3.929)
    # slower, but the spreads overlap (fused p10 3.8 ms <= original p90 9.1 ms): noise, no warning
    assert b["warnings"] == []
    assert b["within_noise"] == ["with the subgraph backend on (MXNet's default bind) the fused model's median is "
                                 "11.000 ms vs 5.500 ms (0.50x), within the p10-p90 spreads (noise; rerun with more "
                                 "--repeats to tell)"]
    far = bench.figures({"original": ms, "fused": [t + 0.1 for t in ms],
                         "original_no_subgraph": ms, "fused_no_subgraph": ms})
    assert far["warnings"] == ["with the subgraph backend on (MXNet's default bind) the fused model is slower: "
                               "105.500 ms vs 5.500 ms (0.05x); the p10-p90 ranges do not overlap: keep the "
                               "original for this input shape"]
    # 3943.8 vs 3939.1 ms, each within the other's spread: not a warning
    close = bench.figures({"original": [3.9391 + d for d in (-0.02, 0, 0.02)] * 4,
                           "fused": [3.9438 + d for d in (-0.02, 0, 0.02)] * 4,
                           "original_no_subgraph": ms, "fused_no_subgraph": ms})
    assert close["warnings"] == [] and len(close["within_noise"]) == 1
    lines = benchmark_lines(b)
    assert lines[0].startswith("benchmark (ms, median [p10-p90] of 10 interleaved rounds): original 5.500 "
                               "[1.900-9.100], fused 11.000 [3.800-18.200]")
    assert lines[1] == ("speed-up, like for like: 0.50x with the subgraph backend on (MXNet's default bind), "
                        "3.93x with it off on both")
    assert lines[-1].startswith("with the subgraph backend on (MXNet's default bind) the fused model's median")
    assert not any(ln.startswith("WARNING") for ln in lines)
    assert benchmark_lines(far)[-1].startswith("WARNING: with the subgraph backend on")


def test_cli_benchmark_prints_like_for_like_and_warns_when_slower(tmp_model, tmp_path, capsys, monkeypatch):
    from fusion.check import bench

    real = bench.time_samples

    def slower(systems, repeats=30, warmup=3):           # the fused model timed slower, as on a bad day
        got = real(systems, 2, 0)                        # (every system still binds and runs)
        return {k: [0.002 if k.startswith("fused") else 0.001] * 5 for k in got}

    monkeypatch.setattr(bench, "time_samples", slower)
    sp, pp = tmp_model()
    code, out, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "o", "--shape", "data=1,3,8,8",
                             "--benchmark", "--report", tmp_path / "r.json", "--html", tmp_path / "r.html")
    assert code == 0, err
    assert "speed-up, like for like: 0.50x with the subgraph backend on (MXNet's default bind), 0.50x with it off " \
           "on both" in out
    assert "WARNING: with the subgraph backend on (MXNet's default bind) the fused model is slower" in out
    assert err.count("mxfuse: warning: ") == 2 and "slower: 2.000 ms vs 1.000 ms (0.50x)" in err
    b = json.loads((tmp_path / "r.json").read_text())["benchmark"]
    assert set(b["p10_ms"]) == set(b["p90_ms"]) == {"original", "fused", "original_no_subgraph", "fused_no_subgraph"}
    assert len(b["warnings"]) == 2
    assert "Warning: with the subgraph backend on" in (tmp_path / "r.html").read_text()


def test_progress_on_a_pipe_only_with_verbose(tmp_model, tmp_path, capsys):
    sp, pp = tmp_model()
    argv = [sp, "--params", pp, "-o", tmp_path / "o", "--shape", "data=1,3,8,8", "--verify"]
    code, _, err = run_cli(capsys, *argv)
    assert code == 0 and "mxfuse: fusing" not in err                      # a pipe, by default: silent
    code, _, err = run_cli(capsys, *argv, "--verbose")
    mine = [ln for ln in err.splitlines() if ln.startswith("mxfuse: ")]
    assert [ln.split(" done in")[0] for ln in mine] == [
        "mxfuse: fusing...", "mxfuse: fusing", "mxfuse: verifying...", "mxfuse: verifying"], err
    assert re.fullmatch(r"mxfuse: verifying done in \d+\.\d s \(\d+\.\d s in all; peak memory so far "
                        r"[\d.]+ [KMG]iB\)", mine[-1])
    code, _, err = run_cli(capsys, *argv, "--verbose", "--quiet")
    assert "mxfuse: fusing" not in err


def test_progress_redraws_one_line_on_a_terminal():
    import io
    import time

    from fusion.doors import progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    stages = progress.Stages(stream, tty=True, interval=0.05)
    with stages.stage("fusing"):
        time.sleep(0.3)
        progress.message("mxfuse: warning: spoken in the middle", stream)   # no session: plain line
    text = stream.getvalue()
    assert text.count("\rmxfuse: fusing... 0 s") >= 3, text              # redrawn while it runs
    assert re.search(r"\rmxfuse: fusing done in 0\.\d s \(0\.\d s in all; peak memory so far [\d.]+ [KMG]iB\)\n$",
                     text), text


def test_progress_through_a_real_terminal(tmp_model, tmp_path):
    import pty
    import subprocess
    import sys

    sp, pp = tmp_model()
    master, slave = pty.openpty()
    proc = subprocess.run([sys.executable, "-m", "fusion.doors.mxfuse", str(sp), "--params", str(pp), "-o", str(tmp_path / "o"),
                           "--shape", "data=1,3,8,8", "--verify"], cwd=ROOT, stdout=subprocess.PIPE, stderr=slave,
                          timeout=300)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    err = b"".join(chunks).decode()
    assert proc.returncode == 0, err
    assert "\rmxfuse: fusing done in" in err and "\rmxfuse: verifying done in" in err, err


LN_BLOCK_SHAPES = {"data": (8, 16, 64), "res": (8, 16, 64)}


def _write_ln_block(folder):
    x, r = mx.sym.var("data"), mx.sym.var("res")
    y = mx.sym.LayerNorm(mx.sym.FullyConnected(x, num_hidden=64, flatten=False, name="fc") + r, name="ln")
    arg, aux = random_params(y, LN_BLOCK_SHAPES)
    y.save(str(folder / "block-symbol.json"))
    mx.nd.save(str(folder / "block-0000.params"), {"arg:" + k: v for k, v in arg.items()})
    return folder / "block-symbol.json", folder / "block-0000.params"


SERVE = """
import json, sys
import numpy as np
import mxnet as mx
how, prefix = sys.argv[1], sys.argv[2]
if how == "fusion":
    sys.path.insert(0, %r)
    import fusion
    sym, arg, aux = fusion.load_model(prefix)
else:
    sym, arg, aux = mx.model.load_checkpoint(prefix, 0)
rng = np.random.default_rng(0)
feed = {k: mx.nd.array(rng.normal(size=s)) for k, s in json.loads(sys.argv[3]).items()}
out = sym.bind(mx.cpu(), {**arg, **feed}, aux_states=aux).forward()[0].asnumpy()
print(json.dumps({"ops": sorted({n["op"] for n in json.loads(sym.tojson())["nodes"]} - {"null"}),
                  "sum": float(out.sum()), "fusion_loaded": "fusion" in sys.modules}))
""" % ROOT


def _serve(how, prefix):
    import subprocess
    import sys

    shapes = json.dumps({k: list(v) for k, v in LN_BLOCK_SHAPES.items()})
    p = subprocess.run([sys.executable, "-c", SERVE, how, str(prefix), shapes], cwd="/", capture_output=True,
                       text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def test_serving_a_fused_model_with_and_without_mxnet_fusion(tmp_path, capsys):
    sp, pp = _write_ln_block(tmp_path)
    fused, plain = tmp_path / "fused" / "block", tmp_path / "plain" / "block"
    code, out, err = run_cli(capsys, sp, "--params", pp, "-o", fused, "--shape", "data=8,16,64",
                             "--shape", "res=8,16,64", "--report", tmp_path / "r.json")
    assert code == 0, err
    note = ("note: the fused model uses mxnet-fusion's operators (fused_add_layer_norm, fused_dense): load it after "
            "`import fusion`, or in one line with `fusion.load_model('%s')`; for stock MXNet without mxnet-fusion, "
            "write a copy in stock ops with `mxfuse %s-symbol.json --params %s-0000.params --unfuse -o PLAIN`"
            % (fused, fused, fused))
    assert note in out
    assert note[len("note: "):] in json.loads((tmp_path / "r.json").read_text())["notes"]
    code, _, err = _serve("stock", fused)                       # the failure users met, without import fusion
    assert code != 0 and "is not registered" in err
    code, out, err = _serve("fusion", fused)                    # the one-line loader
    assert code == 0, err
    served = json.loads(out)
    assert served["ops"] == ["fused_add_layer_norm", "fused_dense"] and served["fusion_loaded"]
    code, _, err = run_cli(capsys, str(fused) + "-symbol.json", "--params", str(fused) + "-0000.params", "--unfuse",
                           "-o", plain, "--shape", "data=8,16,64", "--shape", "res=8,16,64")
    assert code == 0, err
    code, out, err = _serve("stock", plain)                     # stock MXNet, no mxnet-fusion imported
    assert code == 0, err
    stock = json.loads(out)
    assert not stock["fusion_loaded"] and not [op for op in stock["ops"] if op.startswith("fused_")]
    assert abs(stock["sum"] - served["sum"]) <= 1e-3 * max(1.0, abs(served["sum"]))


@pytest.mark.usefixtures("no_regions")
def test_no_serving_note_for_stock_ops_only(tmp_model, tmp_path, capsys):
    sp, pp = tmp_model()
    code, out, _ = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "o", "--shape", "data=1,3,8,8")
    assert code == 0 and "mxnet-fusion's operators" not in out


def test_no_loading_note_when_verify_refuses_and_nothing_is_written(tmp_model, tmp_path, capsys, monkeypatch):
    from fusion.doors import cli

    x = mx.sym.var("data")
    y = mx.sym.Convolution(x, num_filter=4, kernel=(3, 3), pad=(1, 1), name="conv0")
    y = mx.sym.sigmoid(mx.sym.tanh(y) * 2 + 1)                                # one fused_elemwise
    arg, aux = random_params(y, {"data": (1, 3, 8, 8)})
    sp, pp = tmp_model(y, arg, aux)
    argv = [sp, "--params", pp, "-o", tmp_path / "o", "--shape", "data=1,3,8,8", "--verify"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0 and "fusion.load_model(" in out, err                   # written: how to load it
    real_fuse = cli.fuse

    def broken_fuse(*a, **kw):                                              # a fused model 1 % off
        res = real_fuse(*a, **kw)
        name = sorted(res.arg_params)[0]
        res.arg_params[name] = res.arg_params[name] * 1.01
        return res

    monkeypatch.setattr(cli, "fuse", broken_fuse)
    code, out, err = run_cli(capsys, *argv[:4], tmp_path / "x", *argv[5:])
    assert code == 1 and "nothing written" in err and "MISMATCH" in out
    assert "load_model" not in out and "load it" not in out and "--unfuse" not in out, out
    assert not os.path.exists(tmp_path / "x-symbol.json")


@pytest.mark.usefixtures("no_regions")
def test_near_misses_of_other_blocks_only_under_explain():
    """A ResNet bottleneck looks like a MobileNet block to inverted_residual (1×1 → 3×3 → 1×1): its 3×3
    convolution is not depthwise.  That is a near-miss (--explain), not a rejection on every report."""
    x = mx.sym.var("data")
    y = x
    for i, (f, k, p, s) in enumerate([(8, 1, 0, 1), (8, 3, 1, 1), (16, 1, 0, 1)]):
        y = mx.sym.Convolution(y, num_filter=f, kernel=(k, k), pad=(p, p), stride=(s, s), name="c%d" % i)
        y = mx.sym.BatchNorm(y, name="bn%d" % i)
        if i < 2:
            y = mx.sym.Activation(y, act_type="relu", name="r%d" % i)
    y = mx.sym.Activation(y + x, act_type="relu")
    arg, aux = random_params(y, {"data": (1, 16, 8, 8)})
    res = fusion.fuse(y, arg, aux, input_shapes={"data": (1, 16, 8, 8)})
    text, explained = res.report.to_text(), res.report.to_text(explain=True)
    assert "inverted_residual" not in text and "not depthwise" not in text, text
    assert "near-misses of inverted_residual" in explained and "is not depthwise" in explained, explained
    near = res.report.to_dict()["rules"]
    assert any("not depthwise" in n["reason"] for r in near if r["rule"] == "inverted_residual"
               for n in r["near_misses"])


@pytest.mark.parametrize("layout", ["NCDHW", None])
def test_3d_networks_are_look_alikes_of_the_2d_block_rules(layout):
    """A 3-D convolution network (video models: NCDHW, with or without the layout attribute) only looks
    like the 2-D blocks (MobileNet's inverted residual, a max pooling of plain arrays…): the default
    report says nothing of them, --explain lists them as near-misses."""
    x = mx.sym.Variable("data")

    def conv(v, nf, k, g=1, name=None):
        kw = {"layout": layout} if layout else {}
        return mx.sym.Convolution(v, num_filter=nf, kernel=(k,) * 3, pad=((k - 1) // 2,) * 3, num_group=g,
                                  name=name, **kw)

    a = mx.sym.Activation(conv(x, 32, 1, name="c1"), act_type="relu")
    a = mx.sym.Activation(conv(a, 32, 3, g=32, name="c2"), act_type="relu")
    y = mx.sym.Pooling(conv(a, 16, 1, name="c3") + x, kernel=(1, 2, 2), stride=(1, 2, 2), pool_type="max")
    shapes = {"data": (1, 16, 4, 8, 8)}
    arg, aux = random_params(y, shapes)
    report = fusion.fuse(y, arg, aux, input_shapes=shapes).report
    plain, explained = report.to_text(), report.to_text(explain=True)
    assert not [ln for ln in plain.splitlines() if ln.strip().startswith("rejected ")], plain
    assert "NCDHW" not in plain and "2-D" not in plain and "inverted_residual" not in plain, plain
    assert "near-misses of inverted_residual" in explained


def _conv_bn(producer: str = "conv", dropout: bool = False):
    x = mx.sym.var("data")
    if dropout:
        x = mx.sym.Dropout(x, p=0.5, name="drop")
    if producer == "conv":
        y = mx.sym.Convolution(x, num_filter=8, kernel=(3, 3), pad=(1, 1), name="conv")
    elif producer == "deconv":
        y = mx.sym.Deconvolution(x, num_filter=8, kernel=(2, 2), stride=(2, 2), no_bias=False, name="conv")
    else:
        y = mx.sym.FullyConnected(x, num_hidden=8, name="conv")
    y = mx.sym.BatchNorm(y, fix_gamma=False, name="bn")
    return mx.sym.Activation(y, act_type="relu", name="relu")


NOTHING = "nothing to fuse beyond MXNet's own bind"


@pytest.mark.parametrize("case, rules, device, plain", [
    ("conv", ["bn_folding"], "cpu", True),                  # MXNet's oneDNN backend folds it at bind too
    ("conv+dropout", ["bn_folding", "dropout"], "cpu", True),
    ("deconv", ["bn_folding"], "cpu", False),                # MXNet's bind does not fold a Deconvolution's
    ("dense", ["bn_folding"], "cpu", False),                 # nor a FullyConnected's
    ("conv", ["bn_folding"], "gpu", False),                  # nor anything on the GPU
    ("conv", ["dense_act"], "cpu", True),                    # nothing fused at all
])
def test_first_line_says_when_nothing_fuses_beyond_mxnets_own_bind(case, rules, device, plain):
    producer = case.split("+")[0]
    sym = _conv_bn(producer, dropout="dropout" in case)
    shape = {"data": (1, 4, 6, 6)} if producer != "dense" else {"data": (2, 12)}
    arg, aux = random_params(sym, shape)
    res = fusion.fuse(sym, arg, aux, rules=rules, input_shapes=shape, device=device)
    first = res.report.to_text().splitlines()[0]
    d = res.report.to_dict()
    assert (NOTHING in first) is plain and d["nothing_beyond_bind"] is plain, first
    if "bn_folding" in rules:
        assert res.report.fused_count == 1 + ("dropout" in case), res.report.to_text()
        assert d["fused_beyond_bind"] == (0 if plain else 1)
    if plain and res.report.fused_count:
        assert first.endswith("(only 1 BatchNorm fold(s) into convolutions, which MXNet's oneDNN backend makes at "
                              "bind too%s)" % ("; 1 no-op(s) removed (Dropout at inference, identity copies or "
                                                "reshapes), which MXNet's bind passes through" if "dropout" in case
                                                else "")), first


def test_nothing_beyond_bind_is_not_claimed_where_no_fusion_ran():
    from fusion.engine.report import FusionReport

    assert not FusionReport().nothing_beyond_bind()    # mxfuse --unfuse's report: no fusion pass ran
    assert NOTHING not in FusionReport().to_text()
