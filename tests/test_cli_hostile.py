"""mxfuse against hostile input and a hostile system (issue 10): every mistake is one line and exit 2,
nothing is written or half-written, and native code never sees a graph it would crash on."""
import os
import subprocess
import sys

import pytest

from fusion import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mxfuse(capsys, *argv):
    """(exit status, stdout, stderr) of an in-process mxfuse run; argparse's exits included."""
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, *fragments):
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("mxfuse: error: ") and "Traceback" not in err, err
    for f in fragments:
        assert f in err, (f, err)


def listing(folder):
    return sorted(os.listdir(folder))


def subprocess_mxfuse(*argv, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "fusion.cli", *map(str, argv)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, **kw)


def native_noise_free(stderr):
    """stderr without MXNet's own log lines (e.g. the legacy-JSON upgrade notes)."""
    return "\n".join(ln for ln in stderr.splitlines() if "legacy_json_util" not in ln)


# ---------------------------------------------------------------- options (issue 10, bugs 10, 15, "Also")

@pytest.mark.parametrize("option,value,message", [
    ("--repeats", "0", "argument --repeats: '0' must be at least 1"),
    ("--repeats", "-3", "'-3' must be at least 1"),
    ("--repeats", "many", "'many' is not a whole number"),
    ("--rtol", "nan", "'nan' must be a finite number above 0"),
    ("--rtol", "0", "'0' must be a finite number above 0"),
    ("--rtol", "-1e-4", "must be a finite number above 0"),
    ("--rtol", "inf", "'inf' must be a finite number above 0"),
])
def test_numeric_options_are_checked_when_parsed(tmp_model, tmp_path, capsys, option, value, message):
    sp, pp = tmp_model()
    before = listing(tmp_path)
    code, _, err = mxfuse(capsys, sp, "--params", pp, "-o", tmp_path / "o", "--shape", "data=1,3,8,8",
                          "--benchmark", "--verify", "%s=%s" % (option, value))
    one_line_error(code, err, message)
    assert listing(tmp_path) == before


def test_batch_numeric_options_are_checked_when_parsed(tmp_model, tmp_path, capsys):
    sp, _ = tmp_model(name="a")
    sp2, _ = tmp_model(name="b")
    for argv, message in (([sp, sp2, "-o", tmp_path / "out", "-j", "0"], "argument -j/--jobs: '0' must be at least 1"),
                          ([sp, sp2, "-o", tmp_path / "out", "--repeats", "0"], "'0' must be at least 1")):
        code, _, err = mxfuse(capsys, *argv)
        one_line_error(code, err, message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("shape,message", [
    ("data=4294967297,3,8,8", "MXNet 1.9.1 takes at most 2147483647 (2^31 - 1) per tensor"),
    ("data=65536,65536,3,8", "has 103079215104 elements"),
    ("data=1,3,8,8.5", "cannot parse --shape"),
    ("data=1,3,8,0x8", "cannot parse --shape"),
    ("data=1,-3,8,8", "cannot parse --shape"),
])
def test_shapes_are_validated(tmp_model, tmp_path, capsys, shape, message):
    sp, pp = tmp_model()
    code, _, err = mxfuse(capsys, sp, "--params", pp, "-o", tmp_path / "o", "--shape", shape)
    one_line_error(code, err, message)
    assert not (tmp_path / "o-symbol.json").exists()


def test_a_shape_given_twice_is_refused(tmp_model, tmp_path, capsys):
    sp, pp = tmp_model()
    code, _, err = mxfuse(capsys, sp, "--params", pp, "-o", tmp_path / "o", "--shape", "data=1,3,8,8",
                          "--shape", "data=2,3,8,8")
    one_line_error(code, err, "--shape gives 'data' twice (1,3,8,8 and 2,3,8,8)")


def test_empty_output_prefix_is_refused(tmp_model, tmp_path, capsys, monkeypatch):
    sp, pp = tmp_model()
    monkeypatch.chdir(tmp_path)
    before = listing(tmp_path)
    code, _, err = mxfuse(capsys, sp, "--params", pp, "-o", "")
    one_line_error(code, err, "-o '' names no output")
    assert listing(tmp_path) == before


def test_a_reader_that_goes_away_is_no_error(tmp_model, tmp_path):
    """``mxfuse ... | head``: the report cannot be printed, the model is still written, no traceback."""
    sp, pp = tmp_model()
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-m", "fusion.cli", str(sp), "--params", str(pp), "-o", str(tmp_path / "o"),
                          "--explain"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()                       # the reader is gone before mxfuse prints anything
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert (tmp_path / "o-symbol.json").exists() and (tmp_path / "o-0000.params").exists()
