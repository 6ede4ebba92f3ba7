"""--verify / fusion.verify: NaN and inf are compared, inputs exercise the model, weak checks are said."""
import os

import mxnet as mx
import numpy as np
import pytest

from fusion import Rule
from fusion.doors import cli
from fusion.ir.pattern import Var, op
from fusion.check.verify import compare, input_domains, random_inputs, verify

from conftest import random_params


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def verify_cli(capsys, tmp_path, y, *extra):
    """``y`` (input data of (1, 3, 4, 4), random params) saved and given to ``mxfuse --verify``."""
    y.save(str(tmp_path / "m-symbol.json"))
    arg, aux = random_params(y, {"data": (1, 3, 4, 4)})
    mx.nd.save(str(tmp_path / "m-0000.params"), {"arg:" + k: v for k, v in arg.items()})
    return run_cli(capsys, tmp_path / "m-symbol.json", "--params", tmp_path / "m-0000.params",
                   "-o", tmp_path / "o", "--shape", "data=1,3,4,4", "--verify", *extra)


# ---------------------------------------------------------------- NaN / inf

def test_nan_does_not_hide_the_error_on_finite_values():
    # was: max(0.0, nan) -> "max rel error 0", OK, while the finite outputs differ by 3.19
    a = np.array([np.nan, 1.0, 2.0], np.float32)
    b = np.array([np.nan, 1.0, 5.19], np.float32)
    v = compare([a], [b], ["out"])
    assert not v.ok() and v.max_abs == pytest.approx(3.19, rel=1e-5)
    assert "the original computes NaN/inf at 1 of 3" in str(v)


@pytest.mark.parametrize("fused, expect", [
    ([np.nan, 1.0, 2.0], "1 NaN/inf where the original is finite"),
    ([1.0, np.inf, 2.0], "1 NaN/inf where the original is finite"),
    ([1.0, 1.0, -np.inf], "1 other NaN/inf than the original's"),
    ([1.0, 1.0, np.nan], "1 other NaN/inf than the original's"),
])
def test_nan_or_inf_positions_are_an_error_of_their_own(fused, expect):
    a = np.array([1.0, 1.0, np.inf], np.float32)
    v = compare([a], [np.array(fused, np.float32)], ["out"])
    assert not v.ok(rtol=10.0), v
    assert expect in v.failure(), v.failure()


def test_finite_where_the_original_is_nan_is_an_error():
    v = compare([np.array([np.nan, 1.0], np.float32)], [np.array([0.0, 1.0], np.float32)], ["o"])
    assert not v.ok() and "1 finite where the original is NaN/inf" in v.failure()


def test_same_nan_in_both_is_reported_not_hidden():
    a = np.array([np.nan, 1.0, 2.0], np.float32)
    v = compare([a], [a.copy()], ["out"])
    assert v.ok() and v.max_rel == 0
    assert any("NaN/inf at 1 of 3" in p for p in v.problems())


def test_verify_model_with_nan_outputs():
    x = mx.sym.var("data")
    v = verify((mx.sym.log(x, name="log"), {}, {}), (mx.sym.log(x, name="log") * 2, {}, {}),
               input_shapes={"data": (4, 5)})
    assert not v.ok() and v.max_rel > 0.5, v


class ReluToSqrt(Rule):
    """A wrong rule: relu(x) -> sqrt(x), NaN where x < 0."""

    name = "relu_to_sqrt"
    benefit = 1000

    def pattern(self):
        return op.Activation(Var("x"), name="act")

    def check(self, m):
        return None if m.node("act").attrs["act_type"] == "relu" else "not relu"

    def rewrite(self, m, b):
        return b.op("sqrt", [m["x"]])


NAN_RULES = [ReluToSqrt()]


def test_cli_nan_where_the_original_is_finite(tmp_path, capsys):
    x = mx.sym.var("data")
    y = mx.sym.Activation(mx.sym.Convolution(x, num_filter=2, kernel=(1, 1), name="c"), act_type="relu") + 1
    code, out, err = verify_cli(capsys, tmp_path, y, "--no-self-check", "--rules", "test_verify:NAN_RULES")
    assert code == 1 and "MISMATCH" in out
    assert "NaN/inf where the original is finite; nothing written" in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(str(tmp_path / "o") + "-symbol.json")


def test_cli_reports_nan_of_the_original(tmp_path, capsys):
    x = mx.sym.var("data")
    y = mx.sym.log(mx.sym.Convolution(x, num_filter=2, kernel=(1, 1), name="c"))
    code, out, err = verify_cli(capsys, tmp_path, y)
    assert code == 0, err
    assert "the original computes NaN/inf at" in out


# ---------------------------------------------------------------- inputs drawn to fit their use

def test_inputs_fit_their_use():
    tok, seg, vl, cond, mask = (mx.sym.var(n) for n in ("tok", "seg", "vl", "cond", "mask"))
    x = mx.sym.var("x")
    e = mx.sym.Embedding(mx.sym.reshape(mx.sym.Cast(tok, dtype="int32"), shape=(2, 8)),
                         input_dim=50, output_dim=4, name="emb")
    e = e + mx.sym.Embedding(mx.sym.slice_axis(seg, axis=1, begin=0, end=8), input_dim=2, output_dim=4, name="semb")
    s = mx.sym.softmax(mx.sym.sum(e, axis=-1), length=vl, use_length=True, axis=-1)      # (2, 8)
    s = mx.sym.where(cond, s, mx.sym.zeros_like(s))
    y = mx.sym.broadcast_mul(s, mask) + x
    y = mx.sym.broadcast_add(y, (1 - mx.sym.var("amask")) * -10000.0)            # an additive mask, BERT's way
    shapes = {"tok": (16,), "seg": (2, 10), "vl": (2,), "cond": (2, 8), "mask": (2, 1), "x": (2, 8), "amask": (1, 8)}
    arg, aux = random_params(y, shapes)
    dom = input_domains(y, arg, aux, shapes)
    assert dom == {"tok": ("int", 0, 49), "seg": ("int", 0, 1), "vl": ("int", 1, 8), "cond": ("bool",),
                   "mask": ("bool",), "x": ("real",), "amask": ("bool",)}
    for seed in range(3):
        feed = random_inputs(y, arg, shapes, seed)
        assert feed["tok"].min() >= 0 and feed["tok"].max() <= 49 and np.all(feed["tok"] == np.round(feed["tok"]))
        assert set(np.unique(feed["seg"])) <= {0, 1} and set(np.unique(feed["mask"])) <= {0, 1}
        assert feed["vl"].min() >= 1 and feed["vl"].max() <= 8
        assert np.unique(feed["x"]).size == feed["x"].size


def test_what_counts_as_a_multiplied_mask():
    """A multiplier of the same size is a feature; one that broadcasts into a larger tensor and is
    read only by masking ops is drawn 0/1 (so is a per-row gate: still exercised, rows zeroed)."""
    x = mx.sym.var("x")
    y = mx.sym.FullyConnected(mx.sym.broadcast_mul(x, mx.sym.var("scale")), num_hidden=3, name="fc")
    y = y + mx.sym.broadcast_mul(mx.sym.var("gate"), mx.sym.var("feat"))      # (2, 1) gate of (2, 3) features
    shapes = {"x": (2, 4), "scale": (2, 4), "gate": (2, 1), "feat": (2, 3)}
    arg, aux = random_params(y, shapes)
    assert input_domains(y, arg, aux, shapes) == {"x": ("real",), "scale": ("real",), "gate": ("bool",),
                                                  "feat": ("real",)}


def test_bert_inputs():
    from fusion.testing import gluonnlp_bert

    pytest.importorskip("gluonnlp")
    sym, arg, aux, shapes = gluonnlp_bert(seq=16)
    assert input_domains(sym, arg, aux, shapes) == {"data0": ("int", 0, 104), "data1": ("int", 0, 1),
                                                    "data2": ("int", 1, 16)}


# ---------------------------------------------------------------- weak verification

def test_constant_output_is_weak_not_ok():
    x = mx.sym.var("data")
    y = mx.sym.zeros_like(x) + 1
    v = verify((y, {}, {}), (y, {}, {}), input_shapes={"data": (3, 4)})
    assert v.ok() and v.weak and v.status() == "WEAK"
    assert "verification is weak: output 0 ('%s') is constant" % y.list_outputs()[0] in str(v)
    # varying outputs are not weak
    v = verify((x * 2, {}, {}), (x * 2, {}, {}), input_shapes={"data": (3, 4)})
    assert v.status() == "OK" and not v.problems()


def test_cli_says_weak(tmp_path, capsys):
    x = mx.sym.var("data")
    y = mx.sym.relu(mx.sym.Convolution(x, num_filter=2, kernel=(1, 1), name="c")) * 0
    code, out, err = verify_cli(capsys, tmp_path, y)
    assert code == 0, err
    assert "WEAK" in out and "verification is weak: output 0" in out and ": OK" not in out


# ---------------------------------------------------------------- --inputs FILE.npz

@pytest.fixture
def small_model(tmp_model):
    return tmp_model()


def test_inputs_file(small_model, tmp_path, capsys):
    sp, pp = small_model
    np.savez(tmp_path / "in.npz", data=np.random.default_rng(0).standard_normal((2, 3, 8, 8)))
    code, out, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "o", "--inputs", tmp_path / "in.npz",
                             "--verify")
    assert code == 0, err
    assert ": OK" in out and os.path.exists(str(tmp_path / "o") + "-symbol.json")


@pytest.mark.parametrize("content, shape, expect", [
    ({"x": np.zeros((1, 3, 8, 8))}, None, "does not name the model's inputs: missing data; not inputs: x"),
    ({"data": np.zeros((1, 3, 8, 8))}, "data=2,3,8,8", "has shape 1,3,8,8 but --shape gives 2,3,8,8"),
    ({"data": np.array(["a"] * 3)}, None, "has dtype <U1; expected numbers"),
    (None, None, "cannot read inputs file"),
    ("garbage", None, "cannot read inputs file"),
])
def test_inputs_file_errors(small_model, tmp_path, capsys, content, shape, expect):
    sp, pp = small_model
    path = tmp_path / "in.npz"
    if isinstance(content, dict):
        np.savez(path, **content)
    elif content is not None:
        path.write_text(content)
    argv = [sp, "--params", pp, "-o", tmp_path / "o", "--inputs", path, "--verify"]
    code, _, err = run_cli(capsys, *argv + (["--shape", shape] if shape else []))
    assert code == 2 and expect in err, err
    assert len(err.strip().splitlines()) == 1
    assert not os.path.exists(str(tmp_path / "o") + "-symbol.json")


# ---------------------------------------------------------------- acceptance: BERT, one LayerNorm off by 1 %

class ScaleOneLayerNorm(Rule):
    """A wrong rule: the first LayerNorm of the encoder, times 1.01."""

    name = "scale_one_layer_norm"
    benefit = 1000
    target = "bertencoder0_layernorm0_layernorm0"

    def pattern(self):
        return op.LayerNorm(Var("x"), Var("g"), Var("b"), name="ln")

    def check(self, m):
        return None if m.node("ln").name == self.target else "not the target"

    def rewrite(self, m, b):
        ln = m.node("ln")
        y = b.op("LayerNorm", [m["x"], m["g"], m["b"]], attrs=ln.attrs, name="scaled_layernorm")
        return b.op("_mul_scalar", [y], attrs={"scalar": 1.01})


SCALE_RULES = [ScaleOneLayerNorm()]


@pytest.fixture(scope="module")
def bert_files(tmp_path_factory):
    pytest.importorskip("gluonnlp")
    from fusion.testing import gluonnlp_bert

    sym, arg, aux, shapes = gluonnlp_bert(seq=16)
    folder = tmp_path_factory.mktemp("bert")
    sym.save(str(folder / "bert-symbol.json"))
    mx.nd.save(str(folder / "bert-0000.params"), {**{"arg:" + k: v for k, v in arg.items()},
                                                   **{"aux:" + k: v for k, v in aux.items()}})
    return folder / "bert-symbol.json", folder / "bert-0000.params"


def test_bert_verify_catches_a_layer_norm_scaled_by_one_percent(bert_files, tmp_path, capsys):
    sp, pp = bert_files
    shapes = ["--shape", "data0=1,16", "--shape", "data1=1,16", "--shape", "data2=1"]
    code, out, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "bad", *shapes, "--verify",
                             "--no-self-check", "--rules", "test_verify:SCALE_RULES")
    assert "scale_one_layer_norm" in out
    assert code == 1, (out, err)
    assert "nothing written" in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(str(tmp_path / "bad") + "-symbol.json")


def test_bert_verify_ok(bert_files, tmp_path, capsys):
    sp, pp = bert_files
    shapes = ["--shape", "data0=1,16", "--shape", "data1=1,16", "--shape", "data2=1"]
    code, out, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "ok", *shapes, "--verify")
    assert code == 0, err
    assert "verify:" in out and ": OK" in out and "NaN" not in out


def test_verify_never_runs_the_backend_where_it_aborts():
    """MXNet's oneDNN backend aborts the process (SIGABRT, no exception) on a Convolution read by a
    BatchNorm over a non-channel axis: verify's backend-on run (the original's own spread) is left out
    there, in a child process so that a regression cannot take the test run down."""
    import subprocess
    import sys
    code = (
        "import mxnet as mx, numpy as np, fusion\n"
        "from fusion.check.verify import _backend_aborts\n"
        "x = mx.sym.var('data')\n"
        "c = mx.sym.Convolution(x, num_filter=4, kernel=(3, 3), pad=(1, 1), name='c')\n"
        "y = mx.sym.BatchNorm(c, axis=2, name='bn')\n"
        "ok = mx.sym.BatchNorm(c, name='bn1')\n"
        "assert _backend_aborts(y) and not _backend_aborts(ok)\n"
        "rng = np.random.default_rng(0)\n"
        "arg = {'c_weight': mx.nd.array(rng.standard_normal((4, 3, 3, 3))), 'c_bias': mx.nd.zeros(4),\n"
        "       'bn_gamma': mx.nd.ones(6), 'bn_beta': mx.nd.zeros(6)}\n"
        "aux = {'bn_moving_mean': mx.nd.zeros(6), 'bn_moving_var': mx.nd.ones(6)}\n"
        "res = fusion.fuse(y, arg, aux, input_shapes={'data': (1, 3, 6, 6)})\n"
        "v = fusion.verify((y, arg, aux), res, input_shapes={'data': (1, 3, 6, 6)})\n"
        "assert v.spread is None and v.max_rel <= 1e-5, v\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
