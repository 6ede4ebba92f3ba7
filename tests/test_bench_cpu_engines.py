"""benchmarks/bench_cpu_engines.py in its quickest mode on its tiny model, so that it does not rot:
every engine gives a figure, a correctness line, or says why not (n/a, or its error in its cell)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fusion.precision import policy as P

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import bench_cpu_engines as B  # noqa: E402


def _run(tmp_path, capsys, *extra):
    """The benchmark in a process of its own: the engines it loads (OpenVINO's runtime among them) stay
    out of the test process -- after OpenVINO had compiled two models in it, a later test's SIGTERM to
    itself crashed the process (a segmentation fault inside kill)."""
    out = tmp_path / "engines.json"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "bench_cpu_engines.py"), "--models", B.TINY, "--quick",
                        "--rounds", "2", "--json", str(out), *extra], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text()), r.stdout


def _have(module):
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def test_every_engine_reports_on_the_tiny_model(tmp_path, capsys):
    data, text = _run(tmp_path, capsys)
    assert data["cpu"] and data["threads"] and data["versions"]["mxnet"] == "1.9.1"
    assert "CPU: " in text and "vs mx" in text and "max|Δ|/max|ref|" in text
    cells = data["results"][0]["engines"]
    assert set(cells) == set(B.ENGINES)
    for k in ("mx", "mx_off", "fused"):
        assert cells[k]["calls"] == 2 and cells[k]["median_ms"] > 0, cells[k]
        assert cells[k]["rel_err"] <= 1e-4 and cells[k]["within_tolerance"], cells[k]
    assert cells["mx"]["vs_mx"] == pytest.approx(1.0)
    bf16 = ("fused_bf16", "amp_bf16")
    if P.native_bf16_reason() is None:
        for k in bf16:
            assert cells[k]["rel_err"] <= P.TOLERANCE[P.BFLOAT16], cells[k]
    else:
        for k in bf16:
            assert cells[k]["na"] == "n/a: no bf16 on this CPU"
    if _have("onnxruntime"):
        assert cells["ort"]["rel_err"] <= 1e-4 and "export+validate" in cells["ort"]["note"], cells["ort"]
    else:
        assert "onnxruntime not installed" in cells["ort"]["na"]
    for k in ("ov_f32", "ov_default"):
        if _have("openvino"):
            assert "median_ms" in cells[k] and "runs in" in cells[k]["note"], cells[k]
        else:
            assert cells[k]["na"].startswith("n/a: openvino not installed"), cells[k]
    if _have("openvino"):
        assert cells["ov_f32"]["rel_err"] <= 1e-4 and "runs in f32" in cells["ov_f32"]["note"]
    assert B.TINY in text.splitlines()[-2]      # the summary table's row


def test_a_failing_engine_prints_its_error_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no session today\nsecond line")

    monkeypatch.setattr(B, "ort_engine", broken)
    out = tmp_path / "engines.json"        # in this process (the engine is broken by monkeypatching), no OpenVINO
    assert B.main(["--models", B.TINY, "--quick", "--rounds", "2", "--json", str(out), "--engines", "mx,fused,ort"]) == 0
    data, text = json.loads(out.read_text()), capsys.readouterr().out
    cells = data["results"][0]["engines"]
    assert set(cells) == {"mx", "fused", "ort"}
    assert cells["ort"]["error"] == "RuntimeError: no session today"
    assert "ERROR RuntimeError: no session today" in text
    assert cells["fused"]["median_ms"] > 0 and cells["mx"]["median_ms"] > 0


def test_unknown_model_or_engine_is_a_usage_error(capsys):
    for argv in (["--models", "no_such_model"], ["--engines", "mx,tvm"]):
        with pytest.raises(SystemExit) as e:
            B.main(argv)
        assert e.value.code == 2
    assert "unknown engine(s) tvm" in capsys.readouterr().err
