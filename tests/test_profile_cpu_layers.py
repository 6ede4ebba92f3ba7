"""benchmarks/profile_cpu_layers.py: its parsers pair the same convolution on both sides, and the whole
tool runs on the benchmark's tiny model (where the op library has fused_region and ONNX Runtime is
installed), so that it does not rot."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import profile_cpu_layers as P  # noqa: E402

VERBOSE = [
    "onednn_verbose,info,oneDNN v3.2.0",
    "onednn_verbose,exec,cpu,convolution,brg:avx2,forward_inference,src_f32:a:blocked:aBcd8b::f0 "
    "wei_f32:a:blocked:ABcd8b8a::f0 dst_f32:a:blocked:aBcd8b::f0,attr-post-ops:eltwise_relu ,alg:convolution_direct,"
    "mb1_ic64oc64_ih56oh56kh3sh1dh0ph1_iw56ow56kw3sw1dw0pw1,0.5",
    "onednn_verbose,exec,cpu,convolution,jit_dw:avx2,forward_inference,src_f32::blocked:aBcd8b::f0,,"
    "alg:convolution_direct,g32mb1_ic32oc32_ih112oh56kh3sh2dh0ph1_iw112ow56kw3sw2dw0pw1,0.25",
    "onednn_verbose,exec,cpu,reorder,jit:uni,undef,src_f32::blocked:abcd::f0 dst_f32::blocked:aBcd8b::f0,,,1x3x224x224,0.1",
    "dnnl_verbose,exec,cpu,inner_product,gemm:jit,forward_inference,src_f32::blocked:ab::f0,,,mb1ic2048oc1000,0.2",
    "not a verbose line",
]


def test_verbose_lines_give_each_convolution_its_layer_and_the_rest_their_kind():
    got = P.parse_verbose(VERBOSE)
    assert got["conv 3x3 64->64 56x56->56x56"] == [0.5, 1]
    assert got["conv 3x3 32->32 g32 112x112->56x56"] == [0.25, 1]
    assert got["fused_region reorder"] == [0.1, 1] and got["MXNet inner_product"] == [0.2, 1]
    assert len(got) == 4


def test_ort_profile_pairs_its_convolutions_with_the_same_keys(tmp_path):
    events = [
        {"cat": "Session", "name": "model_run", "dur": 9000},
        {"cat": "Node", "name": "conv1_kernel_time", "dur": 400,
         "args": {"op_name": "FusedConv", "input_type_shape": [{"float": [1, 64, 56, 56]}, {"float": [64, 64, 3, 3]},
                                                               {"float": [64]}],
                  "output_type_shape": [{"float": [1, 64, 56, 56]}]}},
        {"cat": "Node", "name": "dw_kernel_time", "dur": 300,
         "args": {"op_name": "Conv", "input_type_shape": [{"float": [1, 32, 112, 112]}, {"float": [32, 1, 3, 3]}],
                  "output_type_shape": [{"float": [1, 32, 56, 56]}]}},
        {"cat": "Node", "name": "pool_kernel_time", "dur": 100, "args": {"op_name": "MaxPool"}},
        {"cat": "Node", "name": "pool_fence_before", "dur": 0, "args": {"op_name": "MaxPool"}},
    ]
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(events))
    got = P.parse_ort_profile(str(path))
    assert got["conv 3x3 64->64 56x56->56x56"] == [0.4, 1]
    assert got["conv 3x3 32->32 g32 112x112->56x56"] == [0.3, 1]
    assert got["ORT MaxPool"] == [0.1, 1] and len(got) == 3
    cmp = P.compare(P.parse_verbose(VERBOSE), got, runs=1, top=1)
    assert cmp["conv_ours_ms"] == pytest.approx(0.75) and cmp["conv_ort_ms"] == pytest.approx(0.7)
    assert cmp["top"][0]["layer"] == "conv 3x3 64->64 56x56->56x56"      # ours 0.1 ms behind there


def test_the_tool_runs_on_the_tiny_model(tmp_path):
    pytest.importorskip("onnxruntime")
    from fusion.engine.rewrite import implemented
    if not implemented("fused_region", "cpu"):
        pytest.skip("this op library has no CPU fused_region")
    out = tmp_path / "prof.json"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "profile_cpu_layers.py"), "--model", "tiny_cnn",
                        "--runs", "2", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["convolutions"] and got["conv_ours_ms"] > 0 and got["conv_ort_ms"] > 0, r.stdout
    assert "all convolutions" in r.stdout


def test_against_mxnet_keys_its_columns_by_the_baseline():
    cmp = P.compare(P.parse_verbose(VERBOSE), P.parse_verbose(VERBOSE[:2]), runs=1, top=2, against="mxnet")
    assert cmp["against"] == "mxnet" and cmp["conv_mxnet_ms"] == pytest.approx(0.5)
    assert {r["layer"]: r["mxnet_ms"] for r in cmp["convolutions"]} == {"conv 3x3 64->64 56x56->56x56": 0.5,
                                                                        "conv 3x3 32->32 g32 112x112->56x56": 0.0}
    assert "other_mxnet" in cmp and "conv_ort_ms" not in cmp


def test_the_tool_runs_against_mxnet_on_the_tiny_model(tmp_path):
    from fusion.engine.rewrite import implemented
    if not implemented("fused_region", "cpu"):
        pytest.skip("this op library has no CPU fused_region")
    out = tmp_path / "prof.json"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "profile_cpu_layers.py"), "--model", "tiny_cnn",
                        "--runs", "2", "--against", "mxnet", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["against"] == "mxnet" and got["conv_ours_ms"] > 0 and got["conv_mxnet_ms"] > 0, r.stdout
    assert "MXNet/ours" in r.stdout and "where ours loses most to MXNet's default bind" in r.stdout
