"""mxfuse on many models: worker processes, a bad model is reported and never stops the others."""
import io
import json
import os

import mxnet as mx
import numpy as np

from fusion.doors import batch

from conftest import RTOL, random_params, small_cnn

X = {"data": (1, 3, 8, 8)}


def save_model(folder, name, sym, arg, aux, epoch=0):
    sym.save(str(folder / (name + "-symbol.json")))
    mx.nd.save(str(folder / ("%s-%04d.params" % (name, epoch))),
               {**{"arg:" + k: v for k, v in arg.items()}, **{"aux:" + k: v for k, v in aux.items()}})


def run(sym, arg, aux, x):
    exe = sym.bind(mx.cpu(), args={**arg, "data": mx.nd.array(x)}, aux_states=aux)
    return exe.forward(is_train=False)[0].asnumpy()


def test_folder_and_file_inputs_bad_models_reported(tmp_path):
    models, other, out = tmp_path / "models", tmp_path / "other", tmp_path / "out"
    models.mkdir()
    other.mkdir()
    sym = small_cnn()
    arg, aux = random_params(sym, X)
    save_model(models, "good", sym, arg, aux, epoch=3)
    (models / "good-0001.params").write_bytes(b"an older epoch: never read")
    (models / "broken-symbol.json").write_text('{"nodes": [')
    save_model(models, "mismatch", sym, *random_params(small_cnn(), {"data": (1, 5, 8, 8)}))   # conv0 wants 5 channels
    arg2, aux2 = random_params(sym, X, seed=1)
    save_model(other, "good2", sym, arg2, aux2)
    stdout, stderr = io.StringIO(), io.StringIO()

    code = batch.main_batch([str(models), str(other / "good2-symbol.json"), "-o", str(out), "-j", "2",
                             "--shape", "data=1,3,8,8", "--verify", "--reports"], stdout=stdout, stderr=stderr)

    assert code == 1
    assert sorted(os.listdir(out)) == ["good-0000.params", "good-report.json", "good-symbol.json",
                                       "good2-0000.params", "good2-report.json", "good2-symbol.json"]
    progress = stderr.getvalue().splitlines()         # not a terminal: one line per finished model
    assert len(progress) == 4 and all(ln.startswith("[") for ln in progress), stderr.getvalue()
    rows = {ln.split()[0]: ln for ln in stdout.getvalue().splitlines()[1:-1]}
    assert sorted(rows) == ["broken", "good", "good2", "mismatch"]
    status, fused, before, arrow, after = rows["good"].split()[1:6]
    assert status == "ok" and int(fused) >= 2 and arrow == "->" and int(after) < int(before) == 6
    assert "failed" in rows["broken"] and "not valid JSON" in rows["broken"]
    assert "failed" in rows["mismatch"] and "shape" in rows["mismatch"]
    assert stdout.getvalue().splitlines()[-1] == "4 model(s): 2 ok, 2 failed"
    assert json.loads((out / "good-report.json").read_text())["verify"]["ok"]
    x = np.random.default_rng(0).normal(size=X["data"])
    for name, (a, b) in {"good": (arg, aux), "good2": (arg2, aux2)}.items():
        fused = mx.sym.load(str(out / (name + "-symbol.json")))
        params = mx.nd.load(str(out / (name + "-0000.params")))
        assert "BatchNorm" not in fused.tojson()
        got = run(fused, {k[4:]: v for k, v in params.items() if k.startswith("arg:")},
                  {k[4:]: v for k, v in params.items() if k.startswith("aux:")}, x)
        want = run(sym, a, b, x)
        assert np.abs(got - want).max() <= RTOL * np.abs(want).max()


def test_find_models(tmp_path):
    (tmp_path / "a-symbol.json").write_text("{}")
    for epoch in (2, 10, 7):
        (tmp_path / ("a-%04d.params" % epoch)).write_bytes(b"")
    (tmp_path / "ab-0099.params").write_bytes(b"")           # another model's params
    (tmp_path / "b.onnx").write_bytes(b"")
    (tmp_path / "c-symbol.json").write_text("{}")            # no params: fused without them
    (tmp_path / "notes.json").write_text("{}")               # in a folder only *-symbol.json counts
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a-symbol.json").write_text("{}")
    models, problems = batch.find_models([str(tmp_path), str(tmp_path / "a-symbol.json"),
                                          str(tmp_path / "sub" / "a-symbol.json"), str(tmp_path / "nope"),
                                          str(tmp_path / "a-0002.params")])
    assert [(m.name, os.path.basename(m.params or "-")) for m in models] == [
        ("a", "a-0010.params"), ("b", "-"), ("c", "-")]
    assert [(p.model.name, p.error.split(":")[0]) for p in problems] == [
        ("nope", "no such file or folder"), ("a-0002.params", "not a model"),
        ("a", "same name as '%s'" % (tmp_path / "a-symbol.json"))]
    assert all(not p.ok for p in problems)


def test_progress_redraws_one_line_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    bar = batch.Progress(2, stream)
    for name, ok in (("a", True), ("b", False)):
        bar.update(batch.Outcome(batch.Model(name, name), ok, "" if ok else "boom", seconds=0.5))
    bar.close()
    text = stream.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    assert "2/2 models, 1 failed" in text and "#" * 24 in text


def test_usage_errors():
    err = io.StringIO()
    assert batch.main_batch(["a", "b", "-o", "x", "-j", "0"], stderr=err) == 2 and "-j" in err.getvalue()
    assert batch.main_batch(["a", "b", "-o", "x", "--params", "p"], stderr=err) == 2
    assert batch.is_batch(["a-symbol.json", "b-symbol.json", "-o", "out/"])
    assert not batch.is_batch(["a-symbol.json", "--params", "a-0000.params", "-o", "out"])


def crash_on_name(argv, report, keep):
    """run_job, except that a model named 'crash' kills its worker like a segfault in native code
    would, in the middle of writing its output (a temp file of an atomic write is left)."""
    if os.path.basename(argv[0]).startswith("crash"):
        outdir = argv[argv.index("-o") + 1]
        with open(os.path.join(outdir, ".mxfuse-half-written.json"), "w") as f:
            f.write("{")
        os._exit(134)
    return batch.run_job(argv, report, keep)


def test_a_crashing_worker_takes_only_its_model_down(tmp_path):
    sym = small_cnn()
    arg, aux = random_params(sym, X)
    for name in ("crash", "fine"):
        save_model(tmp_path, name, sym, arg, aux)
    outcomes = batch.run_batch([str(tmp_path)], str(tmp_path / "out"), jobs=2, progress=io.StringIO(),
                               _job=crash_on_name)
    assert [(o.model.name, o.ok) for o in outcomes] == [("crash", False), ("fine", True)]
    assert "worker process died" in outcomes[0].error
    assert sorted(os.listdir(tmp_path / "out")) == ["fine-0000.params", "fine-symbol.json"]


def test_per_model_shapes_file(tmp_path):
    """NAME.shapes.json beside a model gives its input shapes, in place of --shape (models' inputs differ)."""
    models, out = tmp_path / "models", tmp_path / "out"
    models.mkdir()
    sym = small_cnn()
    save_model(models, "cnn", sym, *random_params(sym, X))
    x = mx.sym.var("x")
    mlp = mx.sym.Activation(mx.sym.FullyConnected(x, num_hidden=8, name="fc"), act_type="relu")
    save_model(models, "mlp", mlp, *random_params(mlp, {"x": (2, 16)}))
    save_model(models, "bad", sym, *random_params(sym, X))
    (models / "cnn.shapes.json").write_text('{"data": [1, 3, 8, 8]}')
    (models / "mlp.shapes.json").write_text('{"x": [2, 16]}')
    (models / "bad.shapes.json").write_text('{"data": [1, 3, 0, 8]}')
    outcomes = batch.run_batch([str(models), str(models / "mlp.shapes.json")], str(out), jobs=2,
                               options=["--verify", "--shape", "data=1,3,8,8"], reports=True, progress=io.StringIO())
    assert outcomes[0].error.startswith("not a model: a NAME.shapes.json file gives")   # inputs naming no model
    by_name = {o.model.name: o for o in outcomes[1:]}
    assert by_name["cnn"].ok and by_name["mlp"].ok, [(o.model.name, o.error) for o in outcomes]
    assert not by_name["bad"].ok and by_name["bad"].error == (
        "shapes file '%s': the shape of 'data' must be a list of positive integers, not [1, 3, 0, 8]"
        % (models / "bad.shapes.json"))
    for name in ("cnn", "mlp"):         # verified: the shapes reached each model
        assert json.loads((out / (name + "-report.json")).read_text())["verify"]["ok"]
    assert sorted(os.listdir(out)) == ["cnn-0000.params", "cnn-report.json", "cnn-symbol.json",
                                       "mlp-0000.params", "mlp-report.json", "mlp-symbol.json"]
    assert batch.shape_options(str(models / "mlp.shapes.json")) == ["--shape", "x=2,16"]


def test_help_lists_batch_mode(capsys):
    from fusion.doors import cli

    text = cli.build_parser().format_help()
    for flag in ("-j N, --jobs N", "--reports", "--verbose", "NAME.shapes.json", "batch mode"):
        assert flag in text, flag
    err = io.StringIO()
    assert batch.main_batch(["a", "b", "-o", "x", "-j", "0"], stderr=err) == 2
    try:      # batch options with one model: one line, exit 2
        cli.main(["m-symbol.json", "-o", "out", "--reports"])
    except SystemExit as e:
        assert e.code == 2
    assert capsys.readouterr().err == ("mxfuse: error: --reports: only for several models or a folder (batch mode) "
                                       "(see mxfuse --help)\n")


def test_output_folder_holding_the_inputs_is_refused_per_model(tmp_path):
    sym = small_cnn()
    save_model(tmp_path, "m", sym, *random_params(sym, X))
    before = sorted(os.listdir(tmp_path))
    outcomes = batch.run_batch([str(tmp_path)], str(tmp_path), progress=io.StringIO())
    assert [o.error for o in outcomes] == [
        "refusing to write '%s' over an input file; choose another -o" % (tmp_path / "m-0000.params")]
    assert sorted(os.listdir(tmp_path)) == before
