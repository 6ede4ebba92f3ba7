"""mxfuse: writes fused models atomically; bad input gives one line, exit 2, nothing written."""
import json
import os
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

from fusion.doors import cli

from conftest import random_params, small_cnn


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def written(folder):
    return sorted(p for p in os.listdir(folder) if not p.startswith("model-"))


@pytest.mark.usefixtures("no_regions")
def test_fuse_verify_and_report(tmp_model, tmp_path, capsys):
    sp, pp = tmp_model()
    out = tmp_path / "out" / "fused"
    code, stdout, err = run_cli(capsys, sp, "--params", pp, "-o", out, "--shape", "data=1,3,8,8",
                                "--verify", "--report", tmp_path / "r.json", "--explain")
    assert code == 0, err
    assert "conv_bn_act" in stdout and "OK" in stdout
    sym = mx.sym.load(str(out) + "-symbol.json")
    params = mx.nd.load(str(out) + "-0000.params")
    assert "BatchNorm" not in sym.tojson()
    assert set(params) == {"arg:" + n for n in sym.list_arguments() if n != "data"}
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["fused"] == 2 and report["verify"]["ok"]
    assert not [p for p in os.listdir(tmp_path / "out") if p.startswith(".mxfuse-")]   # no temp files left


def test_output_folder_keeps_model_name(tmp_model, tmp_path, capsys):
    sp, pp = tmp_model(name="net")
    code, _, err = run_cli(capsys, sp, "--params", pp, "-o", str(tmp_path / "o") + "/")
    assert code == 0, err
    assert sorted(os.listdir(tmp_path / "o")) == ["net-0000.params", "net-symbol.json"]


def test_verify_mismatch_refuses_to_write(tmp_model, tmp_path, capsys, monkeypatch):
    sp, pp = tmp_model()
    real_fuse = cli.fuse

    def broken_fuse(*a, **kw):
        res = real_fuse(*a, **kw)
        name = sorted(res.arg_params)[0]
        res.arg_params[name] = res.arg_params[name] * 1.01
        return res

    monkeypatch.setattr(cli, "fuse", broken_fuse)
    code, _, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "x", "--shape", "data=1,3,8,8", "--verify")
    assert code == 1 and "nothing written" in err
    assert not (tmp_path / "x-symbol.json").exists() and not (tmp_path / "x-0000.params").exists()


def _mutated_json(tmp_path, mutate, name):
    d = json.loads(small_cnn().tojson())
    mutate(d)
    p = tmp_path / (name + "-symbol.json")
    p.write_text(json.dumps(d))
    return p


def _params_file(tmp_path, arg, aux):
    p = tmp_path / ("bad%d-0000.params" % len(os.listdir(tmp_path)))
    mx.nd.save(str(p), {**{"arg:" + k: v for k, v in arg.items()}, **{"aux:" + k: v for k, v in aux.items()}})
    return p


def _bad_inputs(tmp_path, tmp_model):
    """(argv, expected message) for each kind of bad input."""
    sp, pp = tmp_model()
    arg, aux = random_params(small_cnn(), {"data": (1, 3, 8, 8)})
    truncated = tmp_path / "trunc-symbol.json"
    truncated.write_text(sp.read_text()[:200])
    binary = tmp_path / "bin-symbol.json"
    binary.write_bytes(b"\x89PNG\x00\xff\xfe")
    short_params = tmp_path / "short-0000.params"
    short_params.write_bytes(pp.read_bytes()[:100])
    nan_arg = dict(arg, conv0_weight=mx.nd.array(np.full((4, 3, 3, 3), np.nan)))
    neg_aux = dict(aux, bn0_moving_var=mx.nd.array([1.0, -0.5, 1.0, 1.0]))
    wrong_shape = dict(arg, conv0_weight=mx.nd.ones((4, 3, 5, 5)))
    return [
        ([tmp_path / "missing-symbol.json"], "cannot read symbol file"),
        ([truncated], "not valid JSON"),
        ([binary], "not UTF-8"),
        ([_mutated_json(tmp_path, lambda d: d["nodes"][2].__setitem__("inputs", [[77, 0, 0]]), "past")],
         "points to node 77, past the node list"),
        ([_mutated_json(tmp_path, lambda d: d["nodes"][2].__setitem__("op", "ConvolutionV9"), "unknown")], "unknown op(s) ConvolutionV9"),
        ([sp, "--params", tmp_path / "nope.params"], "no such file"),
        ([sp, "--params", short_params], "truncated or not an MXNet params file"),
        ([sp, "--params", _params_file(tmp_path, dict(arg, extra_weight=mx.nd.ones(3)), aux)],
         "'extra_weight' is not an argument of the graph"),
        ([sp, "--params", _params_file(tmp_path, dict(arg, bn0_moving_mean=aux["bn0_moving_mean"]),
                                       {k: v for k, v in aux.items() if k != "bn0_moving_mean"})],
         "it is an auxiliary state"),
        ([sp, "--params", _params_file(tmp_path, wrong_shape, aux)],
         "'conv0_weight' has shape (4, 3, 5, 5) but Convolution 'conv0' (num_filter=4, kernel=(3, 3)) needs (4, ?, 3, 3)"),
        ([sp, "--params", _params_file(tmp_path, dict(arg, bn0_gamma=mx.nd.ones(5)), aux), "--shape", "data=1,3,8,8"],
         "parameter shapes do not fit the graph"),
        ([sp, "--params", _params_file(tmp_path, nan_arg, aux)], "'conv0_weight' contains NaN"),
        ([sp, "--params", _params_file(tmp_path, arg, neg_aux)], "negative moving variance in 'bn0_moving_var'"),
        ([sp, "--params", pp, "--shape", "data=1,3,x"], "cannot parse --shape 'data=1,3,x'"),
        ([sp, "--params", pp, "--shape", "data"], "cannot parse --shape"),
        ([sp, "--params", pp, "--shape", "image=1,3,8,8", "--verify"], "not an input of the graph"),
        ([sp, "--params", pp, "--verify"], "need the input shapes"),
    ]


def test_bad_inputs_one_line_exit_2_nothing_written(tmp_model, tmp_path, capsys):
    cases = _bad_inputs(tmp_path, tmp_model)
    before = sorted(os.listdir(tmp_path))
    for argv, message in cases:
        code, out, err = run_cli(capsys, *argv, "-o", tmp_path / "never")
        assert code == 2, (argv, err)
        assert message in err, (message, err)
        assert err.count("\n") == 1 and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == before


def test_never_writes_over_inputs(tmp_model, tmp_path, capsys):
    sp, pp = tmp_model()
    before = (sp.read_bytes(), pp.read_bytes())
    code, _, err = run_cli(capsys, sp, "--params", pp, "-o", str(sp)[: -len("-symbol.json")])
    assert code == 2 and "over an input file" in err
    assert (sp.read_bytes(), pp.read_bytes()) == before


def test_console_script_runs_without_traceback(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "mxfuse")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "fusion.doors.mxfuse"]
    p = subprocess.run(cmd + [str(tmp_path / "missing.json"), "-o", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["mxfuse: error: cannot read symbol file '%s': No such file or directory"
                                             % (tmp_path / "missing.json")]


def test_onnx_in_onnx_out_and_unfuse(tmp_path, capsys):
    onnx_file = os.path.join(os.path.dirname(__file__), "data", "torch_tiny_bert.onnx")
    shapes = ["--shape", "hidden_states=1,8,32", "--shape", "attention_mask=1,8"]
    code, out, err = run_cli(capsys, onnx_file, "-o", tmp_path / "fused", "--verify", "--to-onnx",
                             tmp_path / "fused.onnx", *shapes)
    assert code == 0, err
    assert "fused_attention" in (tmp_path / "fused-symbol.json").read_text()
    assert (tmp_path / "fused.onnx").exists() and "ONNX Runtime vs MXNet" in out
    code, out, err = run_cli(capsys, tmp_path / "fused-symbol.json", "--params", tmp_path / "fused-0000.params",
                             "--unfuse", "-o", tmp_path / "plain", "--verify", *shapes)
    assert code == 0, err
    plain = json.loads((tmp_path / "plain-symbol.json").read_text())
    assert not [n["op"] for n in plain["nodes"] if n["op"].startswith("fused_")]


def test_onnx_with_params_is_an_error(tmp_path, capsys):
    onnx_file = os.path.join(os.path.dirname(__file__), "data", "torch_tiny_bert.onnx")
    code, _, err = run_cli(capsys, onnx_file, "--params", "x.params", "-o", tmp_path / "o")
    assert code == 2 and "drop --params" in err


def test_to_onnx_into_a_folder_that_does_not_exist(tmp_model, tmp_path, capsys):
    sp, pp = tmp_model()
    target = tmp_path / "new" / "deeper" / "m.onnx"
    code, out, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "fused", "--shape", "data=1,3,8,8",
                             "--to-onnx", target, "--no-self-check")
    assert code == 0, err
    assert "Traceback" not in err and target.exists() and "ONNX Runtime vs MXNet" in out
    assert os.listdir(tmp_path / "new" / "deeper") == ["m.onnx"]       # no staged file left anywhere
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".mxfuse-")]


def test_weights_without_params_are_named_not_taken_for_inputs(tmp_model, tmp_path, capsys):
    """--verify / --benchmark without --params say that the weights have no values (not that their
    shapes are missing, as if they were inputs), and a model with weights is not written without
    them (its params file would be empty); a graph without weights still is."""
    sp, _ = tmp_model()
    out = tmp_path / "o"
    for flag in ("--verify", "--benchmark"):
        code, stdout, err = run_cli(capsys, sp, "-o", out / "m", "--shape", "data=1,3,8,8", flag)
        assert code == 2 and not stdout
        line = err.strip()
        assert "\n" not in line and line.startswith("mxfuse: error: %s needs --params: " % flag), line
        assert "weights have no values (conv0_weight" in line and "no shape given" not in line
    code, _, err = run_cli(capsys, sp, "-o", out / "m")
    assert code == 2 and "no --params: the model has" in err and "pass --params" in err
    assert not out.exists()
    x = mx.sym.Variable("data")
    plain = tmp_path / "plain-symbol.json"
    mx.sym.relu(x * 2.0 + 1.0, name="y").save(str(plain))
    code, _, err = run_cli(capsys, plain, "-o", out / "p", "--shape", "data=2,3", "--verify")
    assert code == 0, err


def test_stdout_carries_the_report_only(tmp_model, tmp_path, capsys, monkeypatch):
    """What MXNet prints while shapes are probed (every argument of a shape inference that failed, which the
    engine provokes on purpose at other batch sizes) stays off stdout; the JSON report counts it."""
    sp, pp = tmp_model()
    real_fuse = cli.fuse

    def probing_fuse(sym, *a, **kw):
        try:                        # a probe MXNet refuses, as the self-check's at other shapes may be
            sym.infer_shape(data=(1, 3, 8))
        except mx.base.MXNetError:
            pass
        return real_fuse(sym, *a, **kw)

    monkeypatch.setattr(cli, "fuse", probing_fuse)
    code, stdout, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "o", "--shape", "data=1,3,8,8",
                                "--verify", "--report", tmp_path / "r.json")
    assert code == 0, err
    assert "infer_shape error" not in stdout and "#0" not in stdout
    assert stdout.startswith("mxnet-fusion report") and stdout.rstrip().splitlines()[-1].startswith("wrote ")
    said = json.loads((tmp_path / "r.json").read_text())["mxnet_stdout"]
    assert said["lines"] >= 2 and said["first"][0] == "infer_shape error. Arguments:"
