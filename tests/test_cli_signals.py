"""mxfuse ends within two seconds of SIGINT/SIGTERM at any stage, even inside one long native call
(MXNet running a large model), with no temporary file left and nothing half-written."""
import os
import signal
import subprocess
import sys
import time

import mxnet as mx
import pytest

from conftest import random_params, small_cnn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: mxfuse with the stage named by argv[1] replaced by MXNet computing for a minute or more inside
#: one native call (waiting for its engine, which a signal does not interrupt): Python's own
#: handlers cannot run meanwhile.
DRIVER = """
import sys
sys.path[:0] = [%r]
import mxnet as mx
from fusion.doors import cli
stage, mark = sys.argv.pop(1), sys.argv.pop(1)

def stuck(*a, **kw):
    a = mx.nd.ones((3000, 3000)) * 1e-4
    for _ in range(40):
        a = mx.nd.dot(a, a)
    open(mark, "w").close()                   # the test's mark: the stage has begun
    a.wait_to_read()

if stage == "verify":
    import fusion.check.verify as v
    v.verify = stuck
elif stage == "fuse":
    cli.fuse = stuck
elif stage == "write":
    import fusion.files.modelio as m
    real = m.model_files
    def slow_files(*a, **kw):
        files = real(*a, **kw)
        what, path, write = files[-1]
        def slow_write(tmp):
            write(tmp)
            stuck()
        return files[:-1] + [(what, path, slow_write)]
    cli.model_files = slow_files
sys.exit(cli.main(sys.argv[1:]))
""" % ROOT


@pytest.mark.parametrize("stage,sig", [("verify", signal.SIGTERM), ("fuse", signal.SIGINT),
                                       ("write", signal.SIGTERM)])
def test_a_signal_ends_mxfuse_within_two_seconds(tmp_path, stage, sig):
    sym = small_cnn()
    arg, aux = random_params(sym, {"data": (1, 3, 8, 8)})
    sp, pp = tmp_path / "m-symbol.json", tmp_path / "m-0000.params"
    sym.save(str(sp))
    mx.nd.save(str(pp), {**{"arg:" + k: v for k, v in arg.items()}, **{"aux:" + k: v for k, v in aux.items()}})
    out, mark = tmp_path / "out", tmp_path / "mark"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, stage, str(mark), str(sp), "--params", str(pp),
                             "-o", str(out / "f"), "--shape", "data=1,3,8,8", "--verify",
                             "--report", str(out / "r.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 120
        while not mark.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "the stage never began"
            time.sleep(0.05)
        time.sleep(0.3)
        sent = time.time()
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=30)
        took = time.time() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took < 2.0, took
    assert proc.returncode == 128 + sig, (proc.returncode, stderr)
    name = signal.Signals(sig).name
    assert stderr.strip().splitlines()[-1] == ("mxfuse: interrupted; nothing written" if sig == signal.SIGINT
                                               else "mxfuse: terminated by %s; nothing written" % name), stderr
    assert os.listdir(out) == [], os.listdir(out)        # no model, no report, no temporary file
