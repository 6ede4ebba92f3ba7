"""fuse(..., device="gpu") on MXNet AMP float16 graphs (fusion/precision/half.py): read as their
float32 model, fused, then given the dtypes AMP gave them.

MXNet's CPU cannot run AMP's float16 graph itself (no float16 FullyConnected or interleaved
attention products on the CPU), so the reference is AMP's graph as a GPU runs it, emulated on the
CPU (``fusion.check.verify.run`` does so through ``precision.half.as_the_gpu_computes``: those ops
computed in float32 from their float16 inputs and rounded to float16 once, as cuBLAS's float16
GEMMs with float32 accumulation do), and the float32 model.
Tolerances, max|Δ|/max|ref|: 1e-3 against either (a 2-layer BERT measured 9e-5 and 6e-5; the
policy's float16 tolerance is 1e-2).  The fused ops' float16 CPU paths are exercised here (float32
arithmetic on widened copies, rounded once); none of the GPU code runs here.
"""
import json

import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.engine import cost
from fusion.precision import half as H
from fusion.check.verify import run as run_model

from conftest import ops

gluonnlp = pytest.importorskip("gluonnlp")
S = mx.sym
TOL = 1e-3
INPUTS = ("data0", "data1", "data2")


@pytest.fixture(autouse=True)
def no_gpu_table(monkeypatch, tmp_path):
    """No GPU is named and no GPU table is found: the GPU's conservative rule decides."""
    monkeypatch.delenv("MXFUSION_GPU", raising=False)
    monkeypatch.delenv("MXFUSION_NO_COST", raising=False)
    monkeypatch.setattr(cost, "_nvidia_smi_name", lambda: None)
    monkeypatch.setenv("MXFUSION_COST_TABLES", str(tmp_path / "tables"))
    cost._tables.cache_clear()
    yield
    cost._tables.cache_clear()


@pytest.fixture(scope="module")
def bert():
    """A 2-layer GluonNLP BERT (sequence output), its AMP float16 conversion and a feed."""
    from fusion.testing import gluonnlp_bert
    from mxnet.contrib import amp

    sym, arg, aux, shapes = gluonnlp_bert(seq=16, layers=2, units=64, heads=4)
    sym = sym[0]
    asym, aarg, aaux = amp.convert_model(sym, {k: v.copy() for k, v in arg.items()},
                                         {k: v.copy() for k, v in aux.items()}, target_dtype="float16",
                                         cast_optional_params=True)
    rng = np.random.default_rng(0)
    feed = {"data0": rng.integers(0, 100, (1, 16)).astype(np.float32),
            "data1": rng.integers(0, 2, (1, 16)).astype(np.float32), "data2": np.array([11], np.float32)}
    return sym, arg, aux, shapes, asym, aarg, aaux, feed


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def node_dtypes(sym, params, inputs):
    """name -> (input dtypes, output dtype) of every op of ``sym`` by MXNet's type inference."""
    nodes = json.loads(sym.tojson(remove_amp_cast=False))["nodes"]
    internals = sym.get_internals()
    given = {**{k: v.dtype for k, v in params.items()}, **inputs}
    names = internals.list_arguments()
    _, types, _ = internals.infer_type_partial(**{k: v for k, v in given.items() if k in names})
    by_name = {n: np.dtype(t).name for n, t in zip(internals.list_outputs(), types) if t is not None}

    def out(i):
        n = nodes[i]
        if n["op"] == "null":
            return by_name.get(n["name"])
        return by_name.get(n["name"] + "_output", by_name.get(n["name"] + "_output0"))

    return {n["name"]: (n["op"], [out(i[0]) for i in n["inputs"]], out(k)) for k, n in enumerate(nodes)}


# ------------------------------------------------------------------------------------ BERT
def test_amp_float16_bert_fuses_into_float16_ops_on_gpu(bert):
    sym, arg, aux, shapes, asym, aarg, aaux, feed = bert
    res = fusion.fuse(asym, aarg, aaux, input_shapes=shapes, device="gpu")
    counts = ops(res)
    assert counts.get("fused_attention") == 2 and counts.get("fused_dense") == 8, counts
    assert counts.get("fused_add_layer_norm") == 4, counts
    assert "FullyConnected" not in counts and "softmax" not in counts, counts
    assert res.report.precision == "float16"
    types = node_dtypes(res.symbol, {**res.arg_params, **res.aux_params}, {k: "float32" for k in INPUTS})
    fused = {name: t for name, t in types.items() if t[0].startswith("fused_")}
    for name, (op, ins, out) in fused.items():
        if op == "fused_dense":         # AMP's float16 FullyConnected: data, weight, bias and output float16
            assert ins == ["float16"] * 3 and out == "float16", (name, ins, out)
        elif op == "fused_attention":   # q, k, v packed (interleaved) in float16, the output float16
            assert ins[0] == "float16" and out == "float16", (name, ins, out)
        else:                           # LayerNorm in float32 (AMP's) on a float16 projection + the residual
            assert ins[:2] == ["float16", "float32"] and out == "float32", (name, ins, out)
    # the model's output keeps AMP's dtype, and the float16 parameters are the caller's own arrays
    assert res.symbol.infer_type(**{k: "float32" for k in INPUTS})[1] == asym.infer_type(
        **{k: "float32" for k in INPUTS})[1]
    for k, v in res.arg_params.items():
        if k in aarg:
            assert v.dtype == aarg[k].dtype, k
    text = res.report.to_text()
    assert "float16 graph for the GPU (MXNet's AMP: " in text and "2 fused_attention, 8 fused_dense" in text, text


def test_fused_float16_bert_computes_what_amp_computes(bert):
    sym, arg, aux, shapes, asym, aarg, aaux, feed = bert
    res = fusion.fuse(asym, aarg, aaux, input_shapes=shapes, device="gpu")
    fused = run_model(res.symbol, res.arg_params, res.aux_params, feed)[0]
    amp_cpu = run_model(asym, aarg, aaux, feed)[0]     # its float16 products as the GPU computes them
    f32 = run_model(sym, arg, aux, feed)[0]
    assert 0 < rel(fused, amp_cpu) <= TOL
    assert rel(fused, f32) <= TOL
    assert rel(amp_cpu, f32) <= TOL           # the reference itself: AMP's float16 error


def test_gluon_backend_for_a_gpu_context_reads_the_float16_graph(bert):
    """optimize_for (the Gluon backend's door) for mx.gpu(): the block's own float16 parameters stay."""
    sym, arg, aux, shapes, asym, aarg, aaux, feed = bert
    args = dict(aarg)
    fused = asym.optimize_for("fusion", args, dict(aaux), ctx=mx.gpu(0), shape_dict=shapes)
    counts = ops(fused)
    assert counts.get("fused_attention") == 2 and counts.get("fused_dense") == 8, counts
    for k, v in args.items():                 # the block's own keep their dtypes; the packed q/k/v weights
        assert v.dtype == (aarg[k].dtype if k in aarg else np.float16), k     # the rules made: float16
    out = run_model(fused, args, aaux, feed)[0]
    assert rel(out, run_model(sym, arg, aux, feed)[0]) <= TOL


def test_cpu_device_keeps_amp_graphs_as_before(bert):
    sym, arg, aux, shapes, asym, aarg, aaux, feed = bert
    res = fusion.fuse(asym, aarg, aaux, input_shapes=shapes, device="cpu")
    assert "fused_attention" not in ops(res) and res.report.precision == "float32"


# ------------------------------------------------------------------------------ small graphs
def _dense_ln(name="fc"):
    x, r = S.var("x"), S.var("r")
    y = S.FullyConnected(x, num_hidden=16, flatten=False, name=name)
    return S.LayerNorm(y + r, S.var("g"), S.var("b"), name="ln")


def _amp(sym, shapes, seed=0):
    from mxnet.contrib import amp
    rng = np.random.default_rng(seed)
    arg_shapes, _, _ = sym.infer_shape(**shapes)
    arg = {n: mx.nd.array(rng.standard_normal(s) * 0.3) for n, s in zip(sym.list_arguments(), arg_shapes)
           if n not in shapes}
    asym, aarg, aaux = amp.convert_model(sym, {k: v.copy() for k, v in arg.items()}, {}, target_dtype="float16",
                                         cast_optional_params=True)
    return arg, asym, aarg, aaux


def test_dense_layer_norm_in_float16_and_casts_kept_for_stock_readers():
    """A FullyConnected AMP runs in float16 whose output MXNet's own op (a float16 scaling and Reshape AMP leaves
    as it comes) also reads: fused_dense writes float16, they read it as before."""
    x = S.var("x")
    fc = S.FullyConnected(x, num_hidden=16, flatten=False, name="fc")
    sym = S.Group([S.LayerNorm(fc + S.var("r"), S.var("g"), S.var("b"), name="ln"),
                   S.Reshape(fc * 2.0, shape=(0, -1), name="act")])
    shapes = {"x": (2, 12, 16), "r": (2, 12, 16)}
    arg, asym, aarg, aaux = _amp(sym, shapes)
    res = fusion.fuse(asym, aarg, aaux, input_shapes=shapes, device="gpu")
    assert ops(res).get("fused_dense") == 1, res.report.to_text()
    types = node_dtypes(res.symbol, res.arg_params, {"x": "float32", "r": "float32"})
    dense = [t for t in types.values() if t[0] == "fused_dense"]
    assert dense[0][1] == ["float16"] * 3 and dense[0][2] == "float16"
    assert res.symbol.infer_type(x="float32", r="float32")[1] == asym.infer_type(x="float32", r="float32")[1]
    rng = np.random.default_rng(1)
    feed = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    got = run_model(res.symbol, res.arg_params, res.aux_params, feed)
    want = run_model(sym, arg, {}, feed)        # (MXNet's CPU cannot run AMP's graph of this one: oneDNN
    for g, w in zip(got, want):                 # takes no float16 after the emulated product)
        assert g.dtype == w.dtype and rel(g, w) <= TOL


def test_a_bfloat16_cast_in_a_float16_graph_is_not_read():
    """A cast this reading does not know (to bfloat16): the graph is fused as it is, with the reason."""
    sym = _dense_ln()
    shapes = {"x": (2, 12, 16), "r": (2, 12, 16)}
    arg, asym, aarg, aaux = _amp(sym, shapes)
    from fusion.precision.policy import BF16
    asym = S.amp_cast(asym, dtype=BF16, name="to_bf16")
    res = fusion.fuse(asym, aarg, aaux, input_shapes=shapes, device="gpu")
    text = res.report.to_text()
    assert ("float16 graph not read for device='gpu' (amp_cast 'to_bf16' casts to bfloat16: only float16 graphs "
            "(and their float32 parts) are read for the GPU)") in text, text
    assert "fused_dense" not in ops(res) and res.report.precision == "float32"


def test_float16_graphs_are_read_for_inference_only():
    sym = _dense_ln()
    shapes = {"x": (2, 12, 16), "r": (2, 12, 16)}
    arg, asym, aarg, aaux = _amp(sym, shapes)
    res = fusion.fuse(asym, aarg, aaux, input_shapes=shapes, device="gpu", mode="training")
    assert "float16 graph not read for device='gpu' (float16 graphs are read for inference only)" in \
        res.report.to_text()


def test_a_lowering_mxnet_refuses_falls_back_to_the_amp_graph(monkeypatch):
    sym = _dense_ln()
    shapes = {"x": (2, 12, 16), "r": (2, 12, 16)}
    arg, asym, aarg, aaux = _amp(sym, shapes)
    monkeypatch.setattr(H, "check_lowered", lambda *a: "output 0 would be float16 where AMP's graph gives float32")
    res = fusion.fuse(asym, aarg, aaux, input_shapes=shapes, device="gpu")
    text = res.report.to_text()
    assert ("float16 graph not read for device='gpu' (output 0 would be float16 where AMP's graph gives float32): "
            "fused as it is") in text, text
    assert "fused_dense" not in ops(res)


# ------------------------------------------------------------------------------ GPU costs
def _gpu_table(tmp_path, entries, device="NVIDIA H200"):
    folder = tmp_path / "tables"
    folder.mkdir(exist_ok=True)
    (folder / "gpu.json").write_text(json.dumps({
        "device": device, "kind": "gpu", "date": "2026-01-01", "command": "python3 benchmarks/bench_cuda.py --costs x",
        "entries": entries}))
    cost._tables.cache_clear()


def _entry(op, case, fused, unfused, dtype="float16"):
    return {"op": op, "dtype": dtype, "pass": "forward", "case": case, "fused_ms": fused, "unfused_ms": unfused,
            "reference": "PyTorch addmm + gelu"}


def test_a_gpu_table_declines_a_slower_fused_dense_with_the_measured_figures(bert, tmp_path, monkeypatch):
    sym, arg, aux, shapes, asym, aarg, aaux, feed = bert
    monkeypatch.setenv("MXFUSION_GPU", "NVIDIA H200")
    # the FFN's first product (16 rows, 64 -> 128, GELU) measured slower; the others have no entry of their kind
    _gpu_table(tmp_path, [_entry("fused_dense", {"M": 16, "K": 64, "N": 128, "act": "gelu_erf"}, 0.02, 0.01)])
    res = fusion.fuse(asym, aarg, aaux, input_shapes=shapes, device="gpu")
    text = res.report.to_text()
    assert ("declined for speed on the GPU (float16 fused_dense): slower or no faster than what it replaces "
            "(measured on NVIDIA H200, 2026-01-01: fused_dense 0.020 ms vs 0.010 ms for the ops it replaces under "
            "PyTorch addmm + gelu)") in text, text
    assert "GPU costs: the cost table of NVIDIA H200 measured 2026-01-01" in text and "2 rewrite(s) declined" in text
    assert ops(res).get("fused_dense") == 6         # the two GELU products stay MXNet's FullyConnected
    fused = run_model(res.symbol, res.arg_params, res.aux_params, feed)[0]
    assert rel(fused, run_model(sym, arg, aux, feed)[0]) <= TOL
    # measured at least as fast (a tie is enough on a GPU): made
    _gpu_table(tmp_path, [_entry("fused_dense", {"M": 16, "K": 64, "N": 128, "act": "gelu_erf"}, 0.01, 0.01)])
    assert ops(fusion.fuse(asym, aarg, aaux, input_shapes=shapes, device="gpu")).get("fused_dense") == 8


def test_without_a_table_the_gpu_rule_declines_float32_attention():
    assert not cost.decide("fused_attention", "float32", "forward", {}, kind="gpu").fuse
    d = cost.decide("fused_attention", "float16", "forward", {}, kind="gpu", device="NVIDIA A100")
    assert d.fuse and "no cost table measured on this GPU (NVIDIA A100)" in d.reason
    d = cost.decide("fused_elemwise", "float16", "forward", {}, kind="gpu")
    assert not d.fuse and "0.62-0.63x" in d.reason and "no GPU named" in d.reason
    assert cost.decide("fused_elemwise", "float32", "forward", {}, kind="gpu").fuse
    assert not cost.decide("fused_elemwise", "float32", "backward", {}, kind="gpu").fuse
    assert cost.decide("fused_add_layer_norm", "float16", "forward", {}, kind="gpu").fuse
    assert cost.decide("fused_dense", "float32", "backward", {}, kind="gpu").fuse


def test_a_table_without_an_entry_of_the_kind_falls_back(tmp_path, monkeypatch):
    _gpu_table(tmp_path, [_entry("fused_dense", {"M": 16, "K": 64, "N": 128, "act": "gelu_erf"}, 0.01, 0.02)])
    d = cost.decide("fused_attention", "float32", "forward", {"B": 1}, kind="gpu", device="NVIDIA H200")
    assert not d.fuse and "the cost table of NVIDIA H200 has no fused_attention float32 forward entry" in d.reason
    d = cost.decide("fused_dense", "float16", "forward", {"M": 16, "K": 64, "N": 128, "act": "relu"}, kind="gpu",
                    device="NVIDIA H200")
    assert d.fuse and "has no fused_dense float16 forward entry" in d.reason


def test_float32_bert_on_gpu_declines_attention_for_speed():
    from fusion.testing import gluonnlp_bert
    sym, arg, aux, shapes = gluonnlp_bert(seq=16, layers=1, units=32, heads=2)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, device="gpu", self_check=False)
    assert "fused_attention" not in ops(res) and ops(res).get("fused_dense", 0) >= 3
    assert ("declined for speed on the GPU (float32 fused_attention): no GPU named for the cost table"
            in res.report.to_text())


@pytest.mark.parametrize("op, attrs, shapes, dtype, case", [
    ("fused_dense", {"num_hidden": "3072", "flatten": "False", "act": "gelu_erf"}, [(8, 128, 768)], "float16",
     {"M": 1024, "K": 768, "N": 3072, "act": "gelu_erf"}),
    ("fused_add_layer_norm", {}, [(8, 128, 768), (8, 128, 768)], "float16", {"rows": 1024, "cols": 768}),
    ("fused_attention", {"layout": "interleaved", "heads": "12", "mask_kind": "valid_length"},
     [(128, 8, 2304), (96,)], "float16",
     {"B": 8, "H": 12, "Sq": 128, "Sk": 128, "D": 64, "causal": False, "mask": "valid_length", "backend": "cudnn"}),
    ("fused_attention", {"layout": "plain"}, [(24, 128, 64), (24, 128, 64), (24, 128, 64)], "float32",
     {"B": 24, "H": 1, "Sq": 128, "Sk": 128, "D": 64, "causal": False, "mask": "none", "backend": "gemm_softmax"}),
    ("fused_elemwise", {"expr": "relu(add(x0, x1))"}, [(65536, 1024), (1024,)], "float16",
     {"elements": 65536 * 1024, "ops": 2, "kind": "broadcast row"}),
])
def test_gpu_cases_speak_the_benchmark_s_features(op, attrs, shapes, dtype, case):
    got, unseen = cost.gpu_case(op, attrs, shapes, dtype)
    assert got == case
    assert unseen == (("expr", "shapes") if op == "fused_elemwise" else ())
    assert cost.gpu_case(op, attrs, [None], dtype) == ({}, ())


def test_a_table_as_gpu_check_writes_it_decides(tmp_path, monkeypatch):
    """costs-gpu.json as tools/gpu_check.py merges bench_cuda.py's entries (extra fields: driver, cuda,
    sdpa_ms; one attention entry per backend): the backend the op runs on decides."""
    case = {"B": 32, "H": 12, "Sq": 128, "Sk": 128, "D": 64, "causal": False, "mask": "none"}
    entries = [dict(_entry("fused_attention", dict(case, backend=be), fused, 0.30), sdpa_ms=0.2,
                    reference="unfused cuBLAS path") for be, fused in (("cudnn", 0.12), ("own", 0.45))]
    folder = tmp_path / "tables"
    folder.mkdir()
    (folder / "costs-gpu.json").write_text(json.dumps({
        "device": "NVIDIA H200", "kind": "gpu", "driver": "580.65", "cuda": "13.0", "date": "2027-01-02",
        "command": "make gpu-check", "entries": entries}))
    cost._tables.cache_clear()
    monkeypatch.setenv("MXFUSION_GPU", "NVIDIA H200")
    got, unseen = cost.gpu_case("fused_attention", {"layout": "packed_qkv", "heads": "12"}, [(32, 128, 2304)],
                                "float16")
    d = cost.decide("fused_attention", "float16", "forward", got, kind="gpu", unseen=unseen)
    assert d.fuse and "fused_attention 0.120 ms vs 0.300 ms" in d.reason, d.reason


def test_mxfuse_verifies_an_amp_float16_model_for_the_gpu(bert, tmp_path, capsys):
    """--verify on the CPU: the original's float16 FullyConnected computed as the GPU computes it."""
    from fusion.doors.cli import main
    sym, arg, aux, shapes, asym, aarg, aaux, feed = bert
    asym.save(str(tmp_path / "m-symbol.json"), remove_amp_cast=False)
    names = set(asym.list_arguments())
    mx.nd.save(str(tmp_path / "m-0000.params"), {"arg:" + k: v for k, v in aarg.items() if k in names})
    code = main([str(tmp_path / "m-symbol.json"), "--params", str(tmp_path / "m-0000.params"), "--shape", "data0=1,16",
                 "--shape", "data1=1,16", "--shape", "data2=1", "--device", "gpu", "-o", str(tmp_path / "out"),
                 "--verify", "--report", str(tmp_path / "r.json")])
    assert code == 0, capsys.readouterr()
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["precision"] == "float16" and rep["verify"]["ok"] and rep["verify"]["max_rel"] <= TOL, rep["verify"]
    assert rep["verify"]["rtol"] == 1e-2
    # --benchmark times on this CPU, which cannot run the float16 model: said in one line, the model written
    code = main([str(tmp_path / "m-symbol.json"), "--params", str(tmp_path / "m-0000.params"), "--shape", "data0=1,16",
                 "--shape", "data1=1,16", "--shape", "data2=1", "--device", "gpu", "-o", str(tmp_path / "out2"),
                 "--benchmark", "--no-self-check"])
    err = capsys.readouterr().err
    assert code == 0 and "mxfuse: warning: --benchmark not run: the model is float16 for the GPU" in err, err
    assert (tmp_path / "out2" / "m-symbol.json").exists() or (tmp_path / "out2-symbol.json").exists()


def test_as_the_gpu_computes_leaves_float32_graphs_alone():
    sym = S.FullyConnected(S.var("x"), num_hidden=4, name="fc")
    assert H.as_the_gpu_computes(sym, {"fc_weight": mx.nd.ones((4, 3))}, {}, {"x": "float32"}) is sym


def test_a_float16_model_without_amp_casts_fuses_in_float16():
    """A model cast to float16 as a whole (parameters and inputs float16, no AMP casts) reads the same way."""
    x = S.var("x")
    fc = S.FullyConnected(x, num_hidden=16, flatten=False, name="fc")
    sym = S.LayerNorm(S.relu(fc) + S.var("r"), S.var("g"), S.var("b"), name="ln")
    shapes = {"x": (2, 12, 16), "r": (2, 12, 16)}
    arg, _, _, _ = _amp(sym, shapes)
    arg16 = {k: v.astype("float16") for k, v in arg.items()}
    res = fusion.fuse(sym, arg16, {}, input_shapes=shapes, input_dtypes={"x": "float16", "r": "float16"},
                      device="gpu")
    assert ops(res) == {"fused_dense": 1, "fused_add_layer_norm": 1}, res.report.to_text()
    types = node_dtypes(res.symbol, res.arg_params, {"x": "float16", "r": "float16"})
    assert {t[0]: t[2] for t in types.values() if t[0].startswith("fused_")} == {
        "fused_dense": "float16", "fused_add_layer_norm": "float16"}
    rng = np.random.default_rng(2)
    feed = {k: rng.standard_normal(v).astype(np.float16) for k, v in shapes.items()}
    got = run_model(res.symbol, res.arg_params, {}, feed)[0]
    want = run_model(sym, {k: v.astype("float32") for k, v in arg16.items()}, {},
                     {k: v.astype(np.float32) for k, v in feed.items()})[0]
    assert got.dtype == np.float16 and rel(got, want) <= TOL


def test_float16_elementwise_chains_are_declined_without_a_table():
    """An elementwise chain AMP runs in float16 (after a float16 product): the GPU's conservative rule
    declines fused_elemwise in float16 (its interpreter measured 0.62-0.63x), with the reason."""
    fc = S.FullyConnected(S.var("x"), num_hidden=16, flatten=False, name="fc")
    sym = S.broadcast_mul(fc, S.sigmoid(fc * 1.5 + 0.5, name="sig"), name="swish")
    shapes = {"x": (2, 12, 16)}
    arg, asym, aarg, aaux = _amp(sym, shapes)
    res = fusion.fuse(asym, aarg, aaux, input_shapes=shapes, device="gpu")
    text = res.report.to_text()
    assert "declined for speed on the GPU (float16 fused_elemwise)" in text and "0.62-0.63x" in text, text
    assert "fused_elemwise" not in ops(res) and ops(res).get("fused_dense") == 1
    # the float32 model on the GPU: the same chain is made (its float32 kernel measured 1.11-1.18x)
    res32 = fusion.fuse(sym, arg, {}, input_shapes=shapes, device="gpu")
    assert ops(res32).get("fused_elemwise") == 1, res32.report.to_text()
