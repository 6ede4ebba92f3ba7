"""A batch stopped by Ctrl-C or SIGTERM stops at once, publishes nothing after the signal, and says
exactly which models were written (a real signal to a real mxfuse batch process)."""
import os
import signal
import subprocess
import sys
import time

import mxnet as mx
import pytest

from fusion.doors import batch

from conftest import random_params, small_cnn

X = {"data": (1, 3, 8, 8)}
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def slow_after_a(argv, report, keep):
    """run_job, then (for every model but 'a') a long wait before handing the result back: such a model
    is fused and staged, but the batch must not publish it once a signal has come."""
    result = batch.run_job(argv, report, keep)
    name = os.path.basename(argv[0])[: -len("-symbol.json")]
    with open(os.path.join(os.environ["MXFUSE_TEST_MARKS"], name), "w") as f:
        f.write(str(os.getpid()))
    if name != "a":
        time.sleep(300)
    return result


def late_writer_after_a(argv, report, keep):
    """slow_after_a, whose workers (all but 'a') take a moment to stop on SIGTERM and then write into
    the staging folder, as publish() does (it makes the folder again): what a worker in the middle of
    writing a large model did when the batch removed the folder while it still ran."""
    name = os.path.basename(argv[0])[: -len("-symbol.json")]
    if name != "a":
        staging = argv[argv.index("-o") + 1]

        def finish_late(signum, frame):
            time.sleep(1.0)
            os.makedirs(staging, exist_ok=True)
            with open(os.path.join(staging, name + "-0000.params"), "w") as f:
                f.write("a model written after the signal")
            os._exit(128 + signum)

        signal.signal(signal.SIGTERM, finish_late)
    return slow_after_a(argv, report, keep)


DRIVER = """
import sys
sys.path[:0] = [%r, %r]
from fusion.doors import batch
import test_batch_signals
job = getattr(test_batch_signals, sys.argv.pop(1))
sys.exit(batch.main_batch(sys.argv[1:], _job=job))
""" % (ROOT, HERE)


def _alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(cond, seconds, what):
    deadline = time.time() + seconds
    while not cond():
        assert time.time() < deadline, "timed out waiting for " + what
        time.sleep(0.05)


@pytest.mark.parametrize("target,sig,job", [("group", signal.SIGINT, "slow_after_a"),
                                            ("parent", signal.SIGINT, "slow_after_a"),
                                            ("parent", signal.SIGTERM, "slow_after_a"),
                                            ("group", signal.SIGINT, "late_writer_after_a")])
def test_signal_stops_the_batch_and_the_message_is_true(tmp_path, target, sig, job):
    models, out, marks = tmp_path / "models", tmp_path / "out", tmp_path / "marks"
    models.mkdir()
    marks.mkdir()
    sym = small_cnn()
    arg, aux = random_params(sym, X)
    for name in "abc":
        sym.save(str(models / (name + "-symbol.json")))
        mx.nd.save(str(models / (name + "-0000.params")),
                   {**{"arg:" + k: v for k, v in arg.items()}, **{"aux:" + k: v for k, v in aux.items()}})
    env = dict(os.environ, MXFUSE_TEST_MARKS=str(marks))
    # like a shell's foreground job: its own process group, SIGINT handled (not inherited as ignored)
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, job, str(models), "-o", str(out), "-j", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # 'a' is published; 'b' is fused and staged, its worker still busy: the signal comes now
        _wait_for(lambda: (out / "a-symbol.json").exists() and (marks / "b").exists(), 240, "models a and b")
        worker_b = int((marks / "b").read_text())
        sent = time.time()
        if target == "group":
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        stdout, stderr = proc.communicate(timeout=60)
        took = time.time() - sent
        _wait_for(lambda: not _alive(worker_b), 10, "the worker of b to end")    # terminated, not orphaned
    finally:
        try:                     # whatever happened, leave no process of this test behind
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert took < 10, took
    assert proc.returncode == 128 + sig, (proc.returncode, stderr)
    assert sorted(os.listdir(out)) == ["a-0000.params", "a-symbol.json"]      # no staging folder left either
    assert stderr.splitlines()[-1] == (
        "mxfuse: interrupted by %s: 1 model(s) written to %s (a); 2 not written (b, c)"
        % (signal.Signals(sig).name, out)), stderr
    assert "Traceback" not in stderr, stderr
    rows = {ln.split()[0]: ln.split()[1] for ln in stdout.splitlines()[1:-1]}
    assert rows == {"a": "ok", "b": "interrupted", "c": "interrupted"}, stdout


def test_staging_folder_of_a_killed_batch_is_removed_by_the_next_run(tmp_path):
    """A batch killed outright (SIGKILL: no cleanup runs) leaves its staging folder, named as publish's
    temporary files: the next run into that folder removes it, and not one of a batch still running."""
    from fusion.files import publish

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tag = publish._host_tag()
    stale = tmp_path / (".mxfuse-%d-%s-batch-abcd1234" % (dead.pid, tag))
    live = tmp_path / (".mxfuse-%d-%s-batch-efgh5678" % (os.getpid(), tag))     # this process: alive
    for folder in (stale, live):
        folder.mkdir()
        (folder / "m-0000.params").write_text("a staged model")
    removed = publish.remove_stale_temps(str(tmp_path))
    assert removed == [stale.name] and not stale.exists() and (live / "m-0000.params").exists()
