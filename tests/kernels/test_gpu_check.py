"""tools/gpu_check.py's judgements, without a GPU: a pytest step that skipped everything is NOT RUN,
any skip fails the step, cost-table fragments merge into one file in the shared schema, and the
bundle of what a GPU machine lacks fits what a GPU session may carry."""
import importlib.util
import json
import os

import pytest

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", os.path.join(_REPO, "tools", "gpu_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_all_skipped_is_not_run(gc):
    text = "SKIPPED [771] tests/kernels/test_cuda_kernels.py:34: could not import 'torch'\n771 skipped in 2.1s\n"
    assert gc.pytest_status(0, text)[0] == "NOT RUN"
    text = "SKIPPED [23] tests/kernels/test_libapi_harness.py:32: the op library cannot be built here\n" \
           "=== 23 skipped in 0.5s ===\n"
    assert gc.pytest_status(0, text)[0] == "NOT RUN"


def test_a_skip_fails_the_step_and_passes_are_ok(gc):
    text = "SKIPPED [1] x.py:3: oneDNN (libdnnl.so.3) not found\n=== 20 passed, 1 skipped in 3s ===\n"
    status, what = gc.pytest_status(0, text)
    assert status == "FAIL" and "20 passed, 1 skipped" in what
    assert gc.pytest_status(0, "=== 21 passed in 3s ===\n") == ("ok", "21 passed in 3s")
    assert gc.pytest_status(1, "=== 21 passed, 2 failed in 3s ===\n")[0] == "FAIL"
    assert gc.pytest_status(1, "=== 1 error in 0.3s ===\n")[0] == "FAIL"
    assert gc.pytest_status("timeout 90s", "..........")[0] == "FAIL"


def test_cost_fragments_merge_into_one_table(gc, tmp_path):
    head = {"device": "NVIDIA H200", "kind": "gpu", "driver": "580.1", "cuda": "13.0", "date": "2025-01-01",
            "command": "bench_cuda.py --quick"}
    e1 = {"op": "fused_elemwise", "dtype": "float16", "pass": "forward", "case": {"expr": "relu(add(x0, x1))"},
          "fused_ms": 0.1, "unfused_ms": 0.2, "reference": "PyTorch eager ops"}
    e2 = dict(e1, op="fused_dense", reference="PyTorch addmm + gelu")
    (tmp_path / "bench.costs.json").write_text(json.dumps(dict(head, entries=[e1])))
    (tmp_path / "other.costs.json").write_text(json.dumps(dict(head, entries=[e2])))
    merged = gc.merge_costs(str(tmp_path))
    on_disk = json.loads((tmp_path / "costs-gpu.json").read_text())
    assert merged == on_disk
    assert set(on_disk) == {"device", "kind", "driver", "cuda", "date", "command", "entries"}
    assert on_disk["entries"] == [e1, e2] and on_disk["command"] == "make gpu-check"


def test_bundle_fits_what_a_gpu_session_carries(gc, monkeypatch, tmp_path, capsys):
    try:
        parts = gc.bundle_parts()
    except RuntimeError as e:
        pytest.skip("MXNet's or oneDNN's files are not here: %s" % e)
    dests = {d for _, d, _ in parts}
    assert {"mxnet/include/mxnet/lib_api.h", "mxnet/src/lib_api.cc", "dnnl/include/oneapi/dnnl/dnnl.h"} <= dests
    monkeypatch.setattr(gc, "BUNDLE", str(tmp_path / "gpu-bundle"))
    assert gc.bundle() == 0
    out = capsys.readouterr().out
    assert "carry: " in out and "MiB" in out and "OVER" not in out
    gc.unpack_bundle()
    if any(d.endswith("libdnnl.so.3") for d in dests):
        lib = tmp_path / "gpu-bundle" / "dnnl" / "lib" / "libdnnl.so.3"
        assert lib.exists() and lib.stat().st_size > 1 << 20
