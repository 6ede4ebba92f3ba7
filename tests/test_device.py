"""fuse(..., device=): library ops are emitted only where the op library implements them.

The library's own capability query (``fusion.native.library.capabilities()``) decides; tests that
need a particular set of GPU implementations give the engine that table (the real one
depends on whether the library was built with nvcc), and one test checks the real table.
"""
import json

import mxnet as mx
import pytest

import fusion
from fusion.native import library as _native
from fusion.doors import cli

from conftest import fuse_and_check, ops, random_params

S = mx.sym
GPU_KERNELS = {"fused_dense", "fused_attention", "fused_add_layer_norm", "fused_elemwise"}
CPU_ONLY = {"fused_se", "fused_concat_scale_act", "fused_box_nms", "fused_max_pool", "fused_roi_align",
            "fused_bilinear_resize"}


def caps_table(gpu_forward=(), gpu_backward=()):
    """A capability table: every library op on the CPU (forward; backward where the real library
    has one), and on the GPU only the ops named."""
    real = _native.capabilities()
    return {op: {"forward": frozenset({"cpu"} | ({"gpu"} if op in gpu_forward else set())),
                 "backward": frozenset((real[op]["backward"] & {"cpu"})
                                       | ({"gpu"} if op in gpu_backward else set()))}
            for op in real}


@pytest.fixture
def gpu_caps(monkeypatch):
    """Install a capability table: gpu_caps(gpu_forward=..., gpu_backward=...)."""
    def install(**kw):
        monkeypatch.setattr(_native, "_capabilities", caps_table(**kw))
    return install


def se_dense_model():
    """A squeeze-excitation block (fused_se: CPU only) feeding a dense layer + relu (fused_dense)."""
    x = S.var("data")
    p = S.contrib.AdaptiveAvgPooling2D(x, output_size=1)
    h = S.Activation(S.Convolution(p, kernel=(1, 1), num_filter=4, name="fc1"), act_type="relu")
    g = S.Activation(S.Convolution(h, kernel=(1, 1), num_filter=8, name="fc2"), act_type="sigmoid")
    y = S.broadcast_mul(x, g)
    return S.Activation(S.FullyConnected(y, num_hidden=16, name="fc"), act_type="relu")


SHAPES = {"data": (8, 8, 5, 5)}


def rejected(res):
    """Every refusal reason of the report (of every rule)."""
    return [r for rr in res.report.rules.values() for r in rr.rejected.values()]


def test_capability_query_reads_the_library():
    caps = _native.capabilities()
    assert GPU_KERNELS | CPU_ONLY <= set(caps)
    assert all("cpu" in c["forward"] for c in caps.values())
    gpu_ops = {op for op, c in caps.items() if "gpu" in c["forward"]}
    gpu_backward = {op for op, c in caps.items() if "gpu" in c["backward"]}
    if _native.built_with_gpu():        # built with nvcc: the four ops with a CUDA kernel
        assert gpu_ops == GPU_KERNELS
        assert gpu_backward == GPU_KERNELS      # fused_elemwise: its generated (NVRTC) backward
    else:
        assert gpu_ops == gpu_backward == set()
    assert not gpu_ops & CPU_ONLY


def test_real_capabilities_decide_what_gpu_gets():
    res = fuse_and_check(se_dense_model(), SHAPES, device="gpu")
    caps = _native.capabilities()
    for op in ops(res):
        if op in caps:
            assert "gpu" in caps[op]["forward"], op
    assert res.report.device == "gpu" and json.loads(res.report.to_json())["device"] == "gpu"
    assert "device=gpu" in res.report.to_text()
    assert any(r == "rewrite failed: fused_se has no gpu implementation in this build"
               for r in rejected(res)), rejected(res)


@pytest.mark.usefixtures("no_regions")
def test_gpu_emits_only_ops_with_a_gpu_implementation(gpu_caps):
    gpu_caps(gpu_forward={"fused_dense"})
    res = fuse_and_check(se_dense_model(), SHAPES, device="gpu")
    assert ops(res).get("fused_dense") == 1 and "fused_se" not in ops(res), ops(res)
    assert ("device gpu: library ops with a gpu implementation in this op library: fused_dense; the "
            "self-check runs on the CPU") in res.report.notes, res.report.notes
    assert "rewrite failed: fused_se has no gpu implementation in this build" in rejected(res)
    cpu = fuse_and_check(se_dense_model(), SHAPES)          # the same library, device cpu: both
    assert ops(cpu).get("fused_se") == 1 and ops(cpu).get("fused_dense") == 1, ops(cpu)


def test_no_gpu_implementations_no_library_ops(gpu_caps):
    gpu_caps()
    res = fuse_and_check(se_dense_model(), SHAPES, device="gpu")
    assert not [op for op in ops(res) if op.startswith("fused_")], ops(res)
    assert any("implementation in this op library: none (built without nvcc)" in n for n in res.report.notes)
    reasons = set(rejected(res))
    assert {"rewrite failed: fused_se has no gpu implementation in this build",
            "rewrite failed: fused_dense has no gpu implementation in this build"} <= reasons, reasons


def test_training_needs_a_gpu_backward(gpu_caps):
    y = S.Activation(S.FullyConnected(S.var("x"), num_hidden=16, name="fc"), act_type="relu")
    shapes = {"x": (40, 12)}
    gpu_caps(gpu_forward={"fused_dense"})
    res = fusion.fuse(y, mode="training", device="gpu", input_shapes=shapes)
    assert "fused_dense" not in ops(res)
    assert ("rewrite failed: fused_dense has no gpu backward in this build (training needs one)"
            in rejected(res)), rejected(res)
    gpu_caps(gpu_forward={"fused_dense"}, gpu_backward={"fused_dense"})
    assert ops(fusion.fuse(y, mode="training", device="gpu", input_shapes=shapes)) == {"fused_dense": 1}


def test_conv_tail_is_not_left_to_onednn_on_gpu(gpu_caps):
    gpu_caps(gpu_forward=GPU_KERNELS)
    x = S.var("x")
    c = S.Convolution(x, num_filter=3, kernel=(1, 1), name="c")
    y = S.Activation(S.Activation(c, act_type="relu") + x, act_type="relu")
    shapes = {"x": (2, 3, 4, 4)}
    cpu = fuse_and_check(y, shapes, rules=["elementwise"])
    assert cpu.report.fused_count == 0
    gpu = fuse_and_check(y, shapes, rules=["elementwise"], device="gpu")
    assert ops(gpu).get("fused_elemwise") == 1, gpu.report.to_text(explain=True)


def test_bn_folding_stays_on_gpu(gpu_caps):
    gpu_caps()
    x = S.BatchNorm(S.Convolution(S.var("data"), num_filter=4, kernel=(3, 3), name="c"), name="bn")
    res = fuse_and_check(S.Activation(x, act_type="relu"), {"data": (1, 3, 8, 8)}, device="gpu")
    assert "BatchNorm" not in ops(res), ops(res)


@pytest.mark.parametrize("bad", ["tpu", "GPU", "", None, 0])
def test_bad_device_is_one_clear_error(bad):
    with pytest.raises(ValueError) as info:
        fusion.fuse(S.relu(S.var("x")), device=bad)
    msg = str(info.value)
    assert "device must be one of cpu, gpu" in msg and "\n" not in msg


def test_context_objects_are_accepted():
    assert fusion.api.check_device(mx.gpu(0)) == "gpu"
    assert fusion.api.check_device(mx.cpu()) == "cpu"


def test_cli_device_flag(tmp_path, capsys, gpu_caps):
    gpu_caps(gpu_forward={"fused_dense"})
    sym = se_dense_model()
    arg, aux = random_params(sym, SHAPES)
    sp, pp = tmp_path / "m-symbol.json", tmp_path / "m-0000.params"
    sym.save(str(sp))
    mx.nd.save(str(pp), {**{"arg:" + k: v for k, v in arg.items()}, **{"aux:" + k: v for k, v in aux.items()}})
    code = cli.main([str(sp), "--params", str(pp), "-o", str(tmp_path / "out"), "--shape", "data=8,8,5,5",
                     "--device", "gpu", "--verify", "--report", str(tmp_path / "r.json")])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["device"] == "gpu" and report["verify"]["ok"]
    fused = mx.sym.load(str(tmp_path / "out") + "-symbol.json").tojson()
    assert "fused_dense" in fused and "fused_se" not in fused


def test_cli_bad_device_one_line(tmp_path, capsys):
    sp = tmp_path / "m-symbol.json"
    S.relu(S.var("x")).save(str(sp))
    try:
        code = cli.main([str(sp), "-o", str(tmp_path / "out"), "--device", "tpu"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "--device" in err and "invalid choice" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out-symbol.json").exists()


@pytest.mark.usefixtures("no_regions")
def test_optimize_for_takes_the_device_of_its_context(gpu_caps):
    gpu_caps(gpu_forward={"fused_dense"})
    sym = se_dense_model()
    arg, aux = random_params(sym, SHAPES)
    on_cpu = sym.optimize_for("fusion", dict(arg), dict(aux), ctx=mx.cpu(), shape_dict=SHAPES)
    on_gpu = sym.optimize_for("fusion", dict(arg), dict(aux), ctx=mx.gpu(0), shape_dict=SHAPES)
    assert "fused_se" in on_cpu.tojson()
    assert "fused_se" not in on_gpu.tojson() and "fused_dense" in on_gpu.tojson()
    forced = sym.optimize_for("fusion", dict(arg), dict(aux), ctx=mx.cpu(), shape_dict=SHAPES, device="gpu")
    assert "fused_se" not in forced.tojson()
    with pytest.raises(ValueError, match="device must be one of cpu, gpu"):
        sym.optimize_for("fusion", dict(arg), dict(aux), shape_dict=SHAPES, device="tpu")


def test_gluon_block_device_from_its_inputs_and_options(gpu_caps):
    gpu_caps()      # nothing on the GPU: a block fused for it keeps its Dense

    class Net(mx.gluon.HybridBlock):
        def __init__(self):
            super().__init__()
            self.dense = mx.gluon.nn.Dense(16, activation="relu", flatten=False)

        def hybrid_forward(self, F, x):
            return self.dense(x)

    x = mx.nd.random.uniform(shape=(4, 10, 12))
    for opts, device in (({}, "cpu"), ({"device": "gpu"}, "gpu")):
        net = Net()
        net.initialize()
        want = net(x).asnumpy()
        net.hybridize(backend="fusion", backend_opts=opts)
        got = net(x).asnumpy()
        assert abs(got - want).max() <= 1e-5 * max(1.0, abs(want).max())
        report = net.fusion_report
        assert report.device == device
        assert (report.fused_count == 1) == (device == "cpu"), report.to_text()
        if device == "gpu":
            assert "rewrite failed: fused_dense has no gpu implementation in this build" in [
                r for rr in report.rules.values() for r in rr.rejected.values()]


def test_bf16_precision_is_refused_for_gpu(tmp_path, capsys):
    with pytest.raises(fusion.FusionError, match="fuse for device='gpu' in float32"):
        fusion.fuse(S.relu(S.var("x")), device="gpu", precision="bf16")
    sp = tmp_path / "m-symbol.json"
    S.relu(S.var("x")).save(str(sp))
    code = cli.main([str(sp), "-o", str(tmp_path / "out"), "--device", "gpu", "--precision", "bf16"])
    err = capsys.readouterr().err
    assert code == 2 and "device='gpu' in float32" in err and err.count("\n") == 1, err
