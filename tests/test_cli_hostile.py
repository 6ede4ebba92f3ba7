"""mxfuse against hostile input and a hostile system (issue 10): every mistake is one line and exit 2,
nothing is written or half-written, and native code never sees a graph it would crash on."""
import os
import subprocess
import sys

import pytest

from fusion.doors import cli

from conftest import run_mxfuse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


mxfuse = run_mxfuse


def one_line_error(code, err, *fragments):
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("mxfuse: error: ") and "Traceback" not in err, err
    for f in fragments:
        assert f in err, (f, err)


def listing(folder):
    return sorted(os.listdir(folder))


def subprocess_mxfuse(*argv, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "fusion.doors.mxfuse", *map(str, argv)], cwd=ROOT, env=env,
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
    ("data=" + ",".join(["1"] * 40), "has 40 dimensions; at most 32"),
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
    p = subprocess.Popen([sys.executable, "-m", "fusion.doors.mxfuse", str(sp), "--params", str(pp), "-o", str(tmp_path / "o"),
                          "--explain"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()                       # the reader is gone before mxfuse prints anything
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert (tmp_path / "o-symbol.json").exists() and (tmp_path / "o-0000.params").exists()


# ---------------------------------------------------------------- the symbol file (bugs 3, 9, 12)

def _cnn_json():
    import json

    from conftest import small_cnn
    return json.loads(small_cnn().tojson())


def _write_json(path, d):
    import json
    path.write_text(json.dumps(d))
    return path


def _last_op(d):
    return len(d["nodes"]) - 1


_CRASHERS = {   # each crashed MXNet (SIGSEGV/SIGABRT) or wrote a model that crashes on bind
    "head": (lambda d: d.__setitem__("heads", [[_last_op(d), 5, 0]]),
             "head 0 uses output 5 of node 17 ('pool', Pooling), which has 1 output"),
    "input": (lambda d: d["nodes"][_last_op(d)]["inputs"][0].__setitem__(1, 3),
              "node 17 ('pool') input 0 uses output 3 of node 16 ('bn1', BatchNorm), which has 3 outputs"),
    "input-no-row-ptr": (lambda d: (d.pop("node_row_ptr"), d["nodes"][_last_op(d)]["inputs"][0].__setitem__(1, 3)),
                         "uses output 3 of node 16 ('bn1', BatchNorm), which has 3 outputs"),
    "row-ptr-lies": (lambda d: (d.__setitem__("node_row_ptr", list(range(0, 3 * len(d["nodes"]) + 1, 3))),
                                d.__setitem__("heads", [[_last_op(d), 2, 0]])),
                     "head 0 uses output 2 of node 17 ('pool', Pooling), which has 1 output"),
    "variable-output": (lambda d: d["nodes"][3]["inputs"][0].__setitem__(1, 1),
                        "node 3 ('conv0') input 0 uses output 1 of node 0 ('data', a variable), which has 1 output"),
}


def test_entries_naming_missing_outputs_are_refused_before_mxnet_sees_them(tmp_path):
    """Run in a subprocess: before the fix these crashed the process (exit 134/139)."""
    import json
    for name, (mutate, _) in _CRASHERS.items():
        d = _cnn_json()
        mutate(d)
        _write_json(tmp_path / ("%s-symbol.json" % name), d)
    script = (
        "import contextlib, io, json, sys\n"
        "from fusion.doors import cli\n"
        "out = {}\n"
        "for name in %r:\n"
        "    for extra in ([], ['--verify', '--shape', 'data=1,3,8,8']):\n"
        "        err = io.StringIO()\n"
        "        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):\n"
        "            code = cli.main([%r + '/' + name + '-symbol.json', '-o', %r + '/out-' + name] + extra)\n"
        "        out[name + str(len(extra))] = (code, err.getvalue())\n"
        "print(json.dumps(out))\n" % (list(_CRASHERS), str(tmp_path), str(tmp_path)))
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    results = json.loads(p.stdout.strip().splitlines()[-1])
    for name, (_, message) in _CRASHERS.items():
        for key in (name + "0", name + "3"):
            code, err = results[key]
            one_line_error(code, err, message)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("out-")]


def test_api_refuses_json_naming_missing_outputs():
    import fusion
    from fusion.ir.errors import GraphError
    d = _cnn_json()
    d["heads"] = [[_last_op(d), 1, 0]]
    with pytest.raises(GraphError, match="head 0 uses output 1 of node 17"):
        fusion.fuse(d)


def test_deeply_nested_json_is_one_line(tmp_path, capsys):
    p = tmp_path / "deep-symbol.json"
    p.write_text("[" * 200000 + "]" * 200000)
    code, _, err = mxfuse(capsys, p, "-o", tmp_path / "o")
    one_line_error(code, err, "nests JSON arrays or objects too deep")
    p.write_text('{"nodes": [], "heads": [], "x": ' + "[" * 5000 + "]" * 5000 + "}")
    code, _, err = mxfuse(capsys, p, "-o", tmp_path / "o")
    one_line_error(code, err, "too deep")


@pytest.mark.parametrize("where,mutate,message", [
    ("input", lambda d: d["nodes"][3]["inputs"][0].__setitem__(0, True),
     "node 3 ('conv0') input 0 is malformed: expected [node_id, output_index(, version)] of whole numbers, "
     "got [true, 0, 0]"),
    ("input index", lambda d: d["nodes"][3]["inputs"][0].__setitem__(1, False), "got [0, false, 0]"),
    ("version", lambda d: d["nodes"][3]["inputs"][0].__setitem__(2, True), "got [0, 0, true]"),
    ("negative version", lambda d: d["nodes"][3]["inputs"][0].__setitem__(2, -1), "got [0, 0, -1]"),
    ("float", lambda d: d["nodes"][3]["inputs"][0].__setitem__(0, 0.0), "got [0.0, 0, 0]"),
    ("head", lambda d: d["heads"][0].__setitem__(0, True), "head 0 is malformed"),
    ("arg_nodes", lambda d: d["arg_nodes"].__setitem__(0, True), "'arg_nodes' must be a list of node numbers"),
    ("node_row_ptr", lambda d: d["node_row_ptr"].__setitem__(1, True), "'node_row_ptr' must be a list"),
    ("attrs", lambda d: d.__setitem__("attrs", ["int", 10901]), "the graph's 'attrs' must be an object"),
    ("attr value", lambda d: d["nodes"][3]["attrs"].__setitem__("kernel", [3, 3]),
     "node 3 ('conv0') attribute 'kernel' is list, not a string"),
])
def test_structural_fields_are_type_checked(tmp_path, capsys, where, mutate, message):
    d = _cnn_json()
    mutate(d)
    p = _write_json(tmp_path / "bad-symbol.json", d)
    code, _, err = mxfuse(capsys, p, "-o", tmp_path / "o")
    one_line_error(code, err, message)
    assert not (tmp_path / "o-symbol.json").exists()


def test_too_deep_fused_elemwise_expression_in_a_file_is_refused(tmp_path, capsys):
    import json
    expr = "x0"
    for _ in range(5000):
        expr = "act_relu(%s)" % expr
    d = {"nodes": [{"op": "null", "name": "x", "inputs": []},
                   {"op": "fused_elemwise", "name": "f", "attrs": {"expr": expr, "num_args": "1"},
                    "inputs": [[0, 0, 0]]}],
         "arg_nodes": [0], "node_row_ptr": [0, 1, 2], "heads": [[1, 0, 0]]}
    p = tmp_path / "f-symbol.json"
    p.write_text(json.dumps(d))
    code, _, err = mxfuse(capsys, p, "-o", tmp_path / "o")
    one_line_error(code, err, "fused_elemwise 'f' has an expression nested 5000 deep, more than the 4096")


# ---------------------------------------------------------------- writing (bugs 4, 5, 6, "Also")

def _old_pair(tmp_path, name="o"):
    """An earlier model at OUT: a failed run must leave it as it was."""
    sym, params = tmp_path / (name + "-symbol.json"), tmp_path / (name + "-0000.params")
    sym.write_text("old symbol")
    params.write_bytes(b"old params")
    return sym, params


def _unchanged(tmp_path, before, sym, params):
    assert listing(tmp_path) == before
    assert sym.read_text() == "old symbol" and params.read_bytes() == b"old params"


@pytest.mark.parametrize("case", ["report-is-input", "report-is-params", "report-is-own-symbol", "report-is-own-params",
                                  "html-is-report", "onnx-is-own-symbol", "symbol-is-folder", "params-is-folder",
                                  "report-is-folder", "report-under-file", "html-under-file",
                                  "onnx-under-dangling-link"])
def test_every_output_is_checked_before_anything_is_written(tmp_model, tmp_path, capsys, case):
    sp, pp = tmp_model()
    sym, params = _old_pair(tmp_path)
    (tmp_path / "file").write_text("x")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    out = str(tmp_path / "o")
    extra, message = {
        "report-is-input": (["--report", sp], "refusing to write '%s' over an input file; choose another --report" % sp),
        "report-is-params": (["--report", pp], "over an input file"),
        "report-is-own-symbol": (["--report", sym], "--report '%s' is also the model's symbol file" % sym),
        "report-is-own-params": (["--report", params], "is also the model's params file"),
        "html-is-report": (["--report", tmp_path / "r", "--html", tmp_path / "r"], "--html '%s' is also --report"
                           % (tmp_path / "r")),
        "onnx-is-own-symbol": (["--to-onnx", sym, "--shape", "data=1,3,8,8"], "--to-onnx '%s' is also" % sym),
        "symbol-is-folder": ([], "cannot write the model's symbol file '%s': it is a folder" % sym),
        "params-is-folder": ([], "cannot write the model's params file '%s': it is a folder" % params),
        "report-is-folder": (["--report", tmp_path], "cannot write --report '%s': it is a folder" % tmp_path),
        "report-under-file": (["--report", tmp_path / "file" / "r.json"], "'%s' is a file, not a folder"
                              % (tmp_path / "file")),
        "html-under-file": (["--html", tmp_path / "file" / "sub" / "r.html"], "'%s' is a file, not a folder"
                            % (tmp_path / "file")),
        "onnx-under-dangling-link": (["--to-onnx", tmp_path / "dangling" / "m.onnx", "--shape", "data=1,3,8,8"],
                                     "'%s' is a symbolic link to nothing" % (tmp_path / "dangling")),
    }[case]
    if case.endswith("-is-folder") and not case.startswith("report"):
        target = sym if case.startswith("symbol") else params
        target.unlink()
        target.mkdir()
    before = listing(tmp_path)
    code, _, err = mxfuse(capsys, sp, "--params", pp, "-o", out, *extra)
    one_line_error(code, err, message)
    assert listing(tmp_path) == before
    for f in (sym, params):
        if f.is_file():
            assert f.read_bytes() in (b"old symbol", b"old params")


@pytest.mark.parametrize("where", ["under-a-file", "dangling-link", "dangling-link-deeper"])
def test_unwritable_output_prefix_is_one_line(tmp_model, tmp_path, capsys, where):
    sp, pp = tmp_model()
    (tmp_path / "file").write_text("x")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    out = {"under-a-file": tmp_path / "file" / "o", "dangling-link": tmp_path / "dangling" / "o",
           "dangling-link-deeper": tmp_path / "dangling" / "a" / "b" / "o"}[where]
    before = listing(tmp_path)
    code, _, err = mxfuse(capsys, sp, "--params", pp, "-o", out)
    one_line_error(code, err, "cannot write the model's symbol file")
    assert listing(tmp_path) == before


def _big_params_model(tmp_model):
    """A model whose params (~150 KB) are much larger than its symbol file (~2 KB)."""
    import mxnet as mx

    from conftest import random_params
    x = mx.sym.var("data")
    y = mx.sym.Convolution(x, num_filter=64, kernel=(3, 3), pad=(1, 1), name="conv0")
    y = mx.sym.Activation(y, act_type="relu", name="relu0")
    y = mx.sym.Convolution(y, num_filter=64, kernel=(3, 3), pad=(1, 1), name="conv1")
    arg, aux = random_params(y, {"data": (1, 64, 4, 4)})
    return tmp_model(y, arg, aux, name="big")


def test_file_size_limit_is_one_line_and_loses_nothing(tmp_model, tmp_path):
    """RLIMIT_FSIZE (``ulimit -f``): the params file cannot be written; the earlier pair stays as it was."""
    import resource
    import signal

    sp, pp = _big_params_model(tmp_model)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    sym, params = _old_pair(out_dir)
    before = listing(out_dir)

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # the write fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (40000, 40000))

    for extra in ([], ["--report", out_dir / "r.json"]):
        p = subprocess_mxfuse(sp, "--params", pp, "-o", out_dir / "o", *extra, preexec_fn=limit)
        err = native_noise_free(p.stderr)
        one_line_error(p.returncode, err + "\n" if not err.endswith("\n") else err,
                       "cannot write the model's params file", "no space left on the device, or a file size limit")
        _unchanged(out_dir, before, sym, params)


def test_a_failed_rename_puts_back_what_was_replaced(tmp_path, monkeypatch):
    from fusion.files import publish as pub
    from fusion.ir.errors import FusionError

    (tmp_path / "a").write_text("old a")
    real_replace = os.replace
    calls = []

    def failing_replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:                  # the second target's rename fails
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(pub.os, "replace", failing_replace)
    files = [("first", str(tmp_path / "a"), lambda t: open(t, "w").write("new a")),
             ("second", str(tmp_path / "b"), lambda t: open(t, "w").write("new b"))]
    with pytest.raises(FusionError, match="cannot write second '.*b': No space left on device"):
        pub.publish(files)
    monkeypatch.setattr(pub.os, "replace", real_replace)
    assert listing(tmp_path) == ["a"] and (tmp_path / "a").read_text() == "old a"


def test_folders_made_for_a_failed_write_are_removed(tmp_path):
    from fusion.files import publish as pub
    from fusion.ir.errors import FusionError

    def fail(tmp):
        raise OSError(27, "File too large")

    with pytest.raises(FusionError, match="cannot write it '.*x': File too large"):
        pub.publish([("it", str(tmp_path / "new" / "deeper" / "x"), fail)])
    assert listing(tmp_path) == []


_SLOW_WRITE = """
import os, sys, time
import mxnet as mx
marker = sys.argv.pop(1)
real_save = mx.nd.save
def slow_save(path, data):           # the params temp file is written; then the run is stopped
    real_save(path, data)
    open(marker, "w").close()
    time.sleep(120)
mx.nd.save = slow_save
from fusion.doors import cli
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_term_and_hup_while_writing_leave_no_temp_files(tmp_model, tmp_path, signame):
    import signal
    import time

    sp, pp = tmp_model()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    sym, params = _old_pair(out_dir)
    before = listing(out_dir)
    marker = tmp_path / "writing"
    p = subprocess.Popen([sys.executable, "-c", _SLOW_WRITE, str(marker), str(sp), "--params", str(pp),
                          "-o", str(out_dir / "o"), "--quiet"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not marker.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert marker.exists(), p.stderr.read()
    assert [n for n in os.listdir(out_dir) if n.startswith(".mxfuse-")]      # caught in the middle of writing
    sig = getattr(signal, signame)
    p.send_signal(sig)
    err = native_noise_free(p.stderr.read())
    assert p.wait(timeout=60) == 128 + sig
    assert err.strip() == "mxfuse: terminated by %s; nothing written" % signame
    _unchanged(out_dir, before, sym, params)


def test_a_signal_during_the_renames_waits_until_all_are_in_place(tmp_path, monkeypatch):
    import signal

    from fusion.files import publish as pub
    real_replace = os.replace

    def replace_then_signal(src, dst):
        real_replace(src, dst)
        os.kill(os.getpid(), signal.SIGTERM)      # arrives between the two renames

    files = [("symbol", str(tmp_path / "o-symbol.json"), lambda t: open(t, "w").write("s")),
             ("params", str(tmp_path / "o-0000.params"), lambda t: open(t, "w").write("p"))]
    published = []
    previous = signal.signal(signal.SIGTERM, cli._terminate)
    monkeypatch.setattr(pub.os, "replace", replace_then_signal)
    try:
        with pytest.raises(cli.Terminated):
            pub.publish(files, published=published)
    finally:
        signal.signal(signal.SIGTERM, previous)
        monkeypatch.setattr(pub.os, "replace", real_replace)
    assert published == [str(tmp_path / "o-symbol.json"), str(tmp_path / "o-0000.params")]
    assert (tmp_path / "o-symbol.json").read_text() == "s" and (tmp_path / "o-0000.params").read_text() == "p"
    assert listing(tmp_path) == ["o-0000.params", "o-symbol.json"]


def test_stale_temp_files_of_dead_runs_are_removed(tmp_model, tmp_path, capsys):
    import time

    from fusion.files import publish as pub

    sp, pp = tmp_model()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        tag = pub._host_tag()
        names = {
            "dead": ".mxfuse-%d-%s-abcd1234.params" % (dead.pid, tag),
            "alive": ".mxfuse-%d-%s-abcd1234.params" % (alive.pid, tag),
            "reused": ".mxfuse-%d-%s-efgh5678.json" % (alive.pid, tag),      # written before that process began
            "other-host": ".mxfuse-%d-ffffff-abcd1234.json" % dead.pid,
            "old-style": ".mxfuse-q1w2e3r4.json",
            "onnx-dead": "..mxfuse-%d-%s-abcd1234.onnx.x1y2.tmp" % (dead.pid, tag),   # the exporter's own temp
        }
        if tag == "ffffff":
            names.pop("other-host")
        for n in names.values():
            (out_dir / n).write_text("half")
        hour_ago = time.time() - 3600
        os.utime(out_dir / names["reused"], (hour_ago, hour_ago))
        time.sleep(0.05)
        code, _, err = mxfuse(capsys, sp, "--params", pp, "-o", out_dir / "o")
        assert code == 0, err
        left = set(listing(out_dir))
        assert names["dead"] not in left and names["reused"] not in left and names["onnx-dead"] not in left
        assert {names["alive"], names["old-style"]} <= left
        assert names.get("other-host", names["alive"]) in left
        assert {"o-symbol.json", "o-0000.params"} <= left
        assert not [n for n in left if n.endswith(".lock")]
    finally:
        alive.kill()
        alive.wait()


def test_publishing_waits_for_another_run_holding_the_prefix(tmp_path):
    """Concurrent runs writing one prefix publish their pairs one after the other (flock per prefix)."""
    import fcntl
    import threading
    import time

    from fusion.files import publish as pub

    lock = tmp_path / ".o.mxfuse.lock"
    assert pub.lock_path(str(tmp_path / "o-symbol.json")) == str(lock)
    assert pub.lock_path(str(tmp_path / "o-0000.params")) == str(lock)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)            # another run is publishing o-*
    files = [("symbol", str(tmp_path / "o-symbol.json"), lambda t: open(t, "w").write("s")),
             ("params", str(tmp_path / "o-0000.params"), lambda t: open(t, "w").write("p"))]
    worker = threading.Thread(target=pub.publish, args=(files,))
    worker.start()
    time.sleep(1.0)
    try:
        assert worker.is_alive()
        assert not (tmp_path / "o-symbol.json").exists() and not (tmp_path / "o-0000.params").exists()
    finally:
        os.close(fd)                          # that run is done
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert (tmp_path / "o-symbol.json").read_text() == "s" and (tmp_path / "o-0000.params").read_text() == "p"
    assert listing(tmp_path) == ["o-0000.params", "o-symbol.json"]      # lock file and temps gone


# ---------------------------------------------------------------- ONNX (bug 16, "Also")

BERT_ONNX = os.path.join(ROOT, "tests", "data", "torch_tiny_bert.onnx")
BERT_SHAPES = ["--shape", "hidden_states=1,8,32", "--shape", "attention_mask=1,8"]


def test_truncated_external_onnx_data_names_the_initializer(tmp_path, capsys):
    import onnx

    model = onnx.load(BERT_ONNX)
    onnx.save_model(model, str(tmp_path / "ext.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="ext.data", size_threshold=0)
    data = (tmp_path / "ext.data").read_bytes()
    (tmp_path / "ext.data").write_bytes(data[:-1000])
    code, _, err = mxfuse(capsys, tmp_path / "ext.onnx", "-o", tmp_path / "o", *BERT_SHAPES)
    one_line_error(code, err, "initializer '", "holds 7192 bytes, needs 8192 (its external data file is truncated?)")
    assert not (tmp_path / "o-symbol.json").exists()


@pytest.mark.parametrize("opset", [11, 12, 22, None])
def test_onnx_opset_outside_the_supported_range_is_refused(tmp_path, capsys, opset):
    import onnx

    model = onnx.load(BERT_ONNX)
    del model.opset_import[:]
    if opset is not None:
        model.opset_import.append(onnx.helper.make_opsetid("", opset))
    onnx.save(model, str(tmp_path / "m.onnx"))
    code, _, err = mxfuse(capsys, tmp_path / "m.onnx", "-o", tmp_path / "o", *BERT_SHAPES)
    one_line_error(code, err, "uses ONNX opset %s; the importer supports opsets 13-21" % (opset or "(none)"))


def test_shape_errors_print_no_dump_of_every_argument(tmp_model, tmp_path, capsys):
    """MXNet's Symbol.infer_shape prints every argument's shape to stdout before raising."""
    code, out, err = mxfuse(capsys, BERT_ONNX, "-o", tmp_path / "o", "--shape", "hidden_states=1,8,33",
                            "--shape", "attention_mask=1,8")
    one_line_error(code, err, "MXNet rejects it")
    assert out == ""
    sp, pp = tmp_model()
    code, out, err = mxfuse(capsys, sp, "--params", pp, "-o", tmp_path / "o", "--shape", "data=1,5,8,8")
    one_line_error(code, err, "do not fit the graph")
    assert out == ""


# ---------------------------------------------------------------- deep graphs (bug 8)

def _relu_chain_json(n):
    nodes = [{"op": "null", "name": "data", "inputs": []}]
    for i in range(n):
        nodes.append({"op": "Activation", "name": "relu%d" % i, "attrs": {"act_type": "relu"},
                      "inputs": [[i, 0, 0]]})
    return {"nodes": nodes, "arg_nodes": [0], "node_row_ptr": list(range(n + 2)), "heads": [[n, 0, 0]],
            "attrs": {"mxnet_version": ["int", 10901]}}


def _expr_depths(symbol_json):
    from fusion.ir.graph import expr_depth
    return [expr_depth(n["attrs"]["expr"]) for n in symbol_json["nodes"] if n["op"] == "fused_elemwise"]


def test_a_30000_op_chain_fuses_into_programs_mxnet_can_load(tmp_path):
    """Was one fused_elemwise with a 30,000-deep expression: SIGSEGV in MXNet's load_json."""
    import json
    import time

    import mxnet as mx
    import numpy as np
    p = _write_json(tmp_path / "chain-symbol.json", _relu_chain_json(30000))
    start = time.time()
    r = subprocess_mxfuse(p, "-o", tmp_path / "fused", "--shape", "data=2,5")
    seconds = time.time() - start
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert seconds < 240, seconds
    fused = json.loads((tmp_path / "fused-symbol.json").read_text())
    depths = _expr_depths(fused)
    assert max(depths) <= 256 and sum(depths) == 30000 and len(depths) <= 30000 // 256 + 8, depths
    sym = mx.sym.load(str(tmp_path / "fused-symbol.json"))
    x = np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32)
    np.testing.assert_array_equal(sym.eval(data=mx.nd.array(x))[0].asnumpy(), np.maximum(x, 0))


def test_elementwise_regions_stop_at_256_program_ops():
    import json

    import mxnet as mx

    import fusion
    from conftest import ops
    from patterns.elementwise import MAX_PROGRAM_OPS, program_ops
    assert MAX_PROGRAM_OPS == 256
    x = mx.sym.var("data")
    y = x
    for i in range(600):
        y = mx.sym.Activation(y, act_type="relu", name="r%d" % i) if i % 2 else mx.sym.sigmoid(y, name="s%d" % i)
    result = fusion.fuse(y)
    depths = _expr_depths(json.loads(result.symbol.tojson()))
    assert max(depths) <= 256 and sum(depths) == 600 and len(depths) == 3, depths
    assert set(ops(result)) == {"fused_elemwise"}
    # a fused op of 256 ops takes nothing more in; fusing again changes nothing
    again = fusion.fuse(result.symbol)
    assert _expr_depths(json.loads(again.symbol.tojson())) == depths
    node = next(n for n in result.graph.nodes if n.op == "fused_elemwise")
    assert program_ops(node) == node.attrs.raw("expr").count("(")


def test_a_model_without_parameters_reads_back(tmp_path, capsys):
    """mx.nd.save writes an empty list for no parameters; reading it back was 'an unnamed list' error."""
    p = _write_json(tmp_path / "chain-symbol.json", _relu_chain_json(3))
    code, _, err = mxfuse(capsys, p, "-o", tmp_path / "f")
    assert code == 0, err
    code, _, err = mxfuse(capsys, tmp_path / "f-symbol.json", "--params", tmp_path / "f-0000.params", "--unfuse",
                          "-o", tmp_path / "u", "--shape", "data=2,3", "--verify")
    assert code == 0, err
