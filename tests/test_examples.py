"""Every example runs (quick mode), so the documented doors never rot."""
import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
SCRIPTS = ["exported_files.py", "fuse_before_bind.py", "gluon_hybridize.py", "onnx_model.py", "unfuse_model.py",
           "custom_rule.py", os.path.join("custom_library_op", "rules.py")]


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script):
    env = dict(os.environ, MXFUSION_AUTOBUILD="1")
    p = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), "--quick"], cwd=EXAMPLES, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.strip()
