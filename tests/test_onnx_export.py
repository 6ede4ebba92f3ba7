"""``--to-onnx`` / ``export_onnx`` (fusion/onnx/export.py) on the models people export, in ONNX Runtime.

Each model is fused, exported for each target (``ort``: ONNX Runtime's contrib ops; ``standard``:
ai.onnx only) and run in ONNX Runtime against MXNet (``export_onnx`` validates the file on inputs
drawn to fit their use before writing it; the tests also check the ops written).  Models: a GluonNLP
BERT (interleaved attention, valid lengths), the bundled MobileNetV2, a model-zoo ResNet-50 read
back from MXNet's own ONNX export, causal and masked attention blocks, a torch-style ONNX BERT with
int64 ``input_ids``; then Reshape's special codes, each fused op's forms, opset choice, weights as
initializers only, and a failed export that still writes the MXNet model (exit status 3).
"""
import collections
import os

import numpy as np
import pytest

from conftest import RTOL, random_params, run_mxfuse

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import mxnet as mx  # noqa: E402

import fusion  # noqa: E402
from fusion.onnx.export import DEFAULT_OPSET, OnnxExportError, export_onnx  # noqa: E402

S = mx.sym
MS = "com.microsoft"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def op_counts(path):
    m = onnx.load(path)
    return collections.Counter((n.domain or "", n.op_type) for n in m.graph.node)


def contrib(path):
    return {op for (domain, op) in op_counts(path) if domain == MS}


def export_checked(sym, arg, aux, shapes, path, **kw):
    check = export_onnx(sym, arg, aux, shapes, str(path), **kw)
    assert check.max_rel <= RTOL, check
    model = onnx.load(str(path))
    data = {n for n in sym.list_arguments() if n not in arg}
    # weights are initializers only; the graph inputs are the data inputs
    assert {i.name for i in model.graph.input} == data
    assert {t.name for t in model.graph.initializer}.isdisjoint(data)
    return model


def fused(sym, arg, aux, shapes):
    r = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    return r.symbol, r.arg_params, r.aux_params


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gluonnlp_bert():
    pytest.importorskip("gluonnlp")
    from fusion.testing import gluonnlp_bert as build

    sym, arg, aux, shapes = build(seq=8, layers=1, units=32, heads=4)
    return (sym, arg, aux, shapes), fused(sym, arg, aux, shapes)


@pytest.mark.parametrize("target", ["ort", "standard"])
def test_gluonnlp_bert(gluonnlp_bert, target, tmp_path):
    (sym, arg, aux, shapes), (fs, fa, fx) = gluonnlp_bert
    assert collections.Counter(n["op"] for n in __import__("json").loads(fs.tojson())["nodes"])["fused_attention"] == 1
    export_checked(fs, fa, fx, shapes, tmp_path / "bert.onnx", target=target)
    found = contrib(tmp_path / "bert.onnx")
    if target == "ort":     # the interleaved QKV projection packed into Attention's weight
        assert {"Attention", "SkipLayerNormalization", "BiasGelu"} <= found, found
        # GluonNLP's (S, B, C) layers computed in (B, S, C): no Transpose around Attention nor anywhere
        assert ("", "Transpose") not in op_counts(tmp_path / "bert.onnx")
        assert_valid_length_as_mask_index(tmp_path / "bert.onnx")
    else:
        assert not found
    # the un-fused model exports too (Reshape codes -3/-4, reverse, arange_like, softmax lengths)
    export_checked(sym, arg, aux, shapes, tmp_path / "plain.onnx", target=target)


def assert_valid_length_as_mask_index(path):
    """Every Attention reads the valid lengths (data2) as ONNX Runtime's mask_index (B,) lengths."""
    model = onnx.load(str(path))
    producer = {o: n for n in model.graph.node for o in n.output}
    for att in (n for n in model.graph.node if n.op_type == "Attention"):
        assert len(att.input) == 4 and producer[att.input[3]].op_type == "Cast", att
        assert producer[att.input[3]].input[0] == "data2"
        assert any(a.name == "mask_filter_value" for a in att.attribute)


def test_gluonnlp_bert_batch_of_two(tmp_path):
    """Batch 2, valid lengths 5 and 8 (one row padded): lengths as mask_index, Transposes only where a
    (B, 1) mask meets the swapped layout."""
    pytest.importorskip("gluonnlp")
    from fusion.testing import gluonnlp_bert as build

    sym, arg, aux, shapes = build(seq=8, batch=2, layers=2, units=32, heads=4)
    fs, fa, fx = fused(sym, arg, aux, shapes)
    path = tmp_path / "bert2.onnx"
    export_checked(fs, fa, fx, shapes, path)
    assert_valid_length_as_mask_index(path)
    counts = op_counts(path)
    assert counts[("", "Transpose")] <= 1, counts
    rng = np.random.default_rng(4)
    feed = {"data0": rng.integers(0, 100, (2, 8)).astype(np.float32),
            "data1": rng.integers(0, 2, (2, 8)).astype(np.float32), "data2": np.array([5, 8], np.float32)}
    from fusion.check.verify import run
    ref = run(fs, fa, fx, feed)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)
    for x, y in zip(ref, got):
        assert np.max(np.abs(x - y)) / np.max(np.abs(x)) <= RTOL


def test_lengths_read_as_mask_index_only_when_they_repeat_one_length(gluonnlp_bert, tmp_path, monkeypatch):
    """The (B, 1) valid lengths plus a (1, S) constant are one length per row only when the constant is
    zeros: with a nonzero constant the attention bias stays a bias."""
    from onnx import numpy_helper

    from fusion.onnx import export as onnx_export
    (_, _, _, shapes), (fs, fa, fx) = gluonnlp_bert
    monkeypatch.setattr(onnx_export, "_repeated_lengths_as_mask_index", lambda m: m)
    path = tmp_path / "bias.onnx"
    export_checked(fs, fa, fx, shapes, path)
    monkeypatch.undo()
    model = onnx.load(str(path))
    assert all(len(n.input) == 6 for n in model.graph.node if n.op_type == "Attention")
    producer = {o: n for n in model.graph.node for o in n.output}
    add = next(n for n in model.graph.node if n.op_type == "Add" and n.input[0] in producer and
               producer[n.input[0]].op_type == "Reshape" and producer[n.input[0]].input[0] == "data2")
    zeros = next(t for t in model.graph.initializer if t.name in add.input)
    again = onnx_export._repeated_lengths_as_mask_index(onnx.load(str(path)))
    assert all(len(n.input) == 4 for n in again.graph.node if n.op_type == "Attention")
    z = numpy_helper.to_array(zeros).copy()
    z[0, 3] = 1.0
    zeros.CopyFrom(numpy_helper.from_array(z, zeros.name))
    kept = onnx_export._repeated_lengths_as_mask_index(model)
    assert all(len(n.input) == 6 for n in kept.graph.node if n.op_type == "Attention")


def test_bundled_mobilenet(tmp_path):
    sym, arg, aux = mx.model.load_checkpoint(os.path.join(ROOT, "examples", "models", "mobilenetv2_0.25"), 0)
    shapes = {"data": (1, 3, 64, 64)}
    export_checked(*fused(sym, arg, aux, shapes), shapes, tmp_path / "m.onnx")


def test_resnet50_roundtrip_through_mxnet_export(tmp_path, capsys):
    """mx.onnx.export_model's file read back, fused and written again (its FullyConnected's Flatten used
    to be written twice under one name: not single static assignment)."""
    from fusion.testing import zoo_model

    sym, arg, aux = zoo_model("resnet50_v1", (1, 3, 32, 32))
    src = str(tmp_path / "resnet50.onnx")
    mx.onnx.export_model(sym, {**arg, **aux}, [(1, 3, 32, 32)], [np.float32], src)
    out = str(tmp_path / "r50.onnx")
    code, stdout, err = run_mxfuse(capsys, src, "-o", tmp_path / "r50", "--shape", "data=1,3,32,32",
                                   "--to-onnx", out, "--no-self-check")
    assert code == 0, err
    assert "ONNX Runtime vs MXNet" in stdout and os.path.exists(out)
    model = onnx.load(out)
    # the file's opset is kept (MXNet's exporter stamps the newest its onnx knows)
    assert [o.version for o in model.opset_import if o.domain == ""] == \
        [[o.version for o in onnx.load(src).opset_import if o.domain == ""][0]]


def gpt_block(style, seq=8):
    from test_transformer_models import gpt_block as block
    x = S.var("data")
    y = block(x, 0, style)
    shapes = {"data": (2, seq, 32)}
    arg, aux = random_params(y, shapes)
    return y, arg, aux, shapes


@pytest.mark.parametrize("style", ["where", "additive"])
@pytest.mark.parametrize("target", ["ort", "standard"])
def test_causal_attention_block(style, target, tmp_path):
    sym, arg, aux, shapes = gpt_block(style)
    fs, fa, fx = fused(sym, arg, aux, shapes)
    model = export_checked(fs, fa, fx, shapes, tmp_path / "gpt.onnx", target=target)
    attention = [n for n in model.graph.node if n.op_type == "Attention"]
    if target == "ort":
        assert len(attention) == 1
        assert {a.name: a.i for a in attention[0].attribute}.get("unidirectional") == 1
    else:
        assert not attention and not contrib(tmp_path / "gpt.onnx")


@pytest.mark.parametrize("mask_shape", [(8, 6, 6), (1, 1, 6), (1, 6, 6)])
@pytest.mark.parametrize("target", ["ort", "standard"])
def test_masked_attention_block(mask_shape, target, tmp_path):
    from test_transformer_models import bert_layer
    sym = bert_layer(S.var("data"), 0, "plain")
    shapes = {"data": (2, 6, 32), "mask": mask_shape}
    arg, aux = random_params(sym, shapes)
    fs, fa, fx = fused(sym, arg, aux, shapes)
    export_checked(fs, fa, fx, shapes, tmp_path / "layer.onnx", target=target)
    found = contrib(tmp_path / "layer.onnx")
    assert found == ({"Attention", "SkipLayerNormalization", "BiasGelu"} if target == "ort" else set()), found


def test_attention_layouts_without_projection(tmp_path):
    """bshd / packed_qkv attention on plain inputs: MultiHeadAttention (packed: after a Split); valid
    lengths per batch element as its key padding mask; per head as an attention bias."""
    q, k, v, n = (S.var(x) for x in ("q", "k", "v", "n"))
    cases = [
        (S.fused_attention(q, k, v, n, scale=0.3, layout="bshd", heads=2, mask_kind="valid_length"),
         {"q": (2, 5, 8), "k": (2, 7, 8), "v": (2, 7, 8), "n": (2,)}),
        (S.fused_attention(q, n, scale=0.3, layout="packed_qkv", heads=2, mask_kind="valid_length"),
         {"q": (2, 5, 24), "n": (4, 5)}),
        (S.fused_attention(q, k, v, n, scale=0.3, layout="bshd", heads=2, mask_kind="boolean", mask_value=-1e9),
         {"q": (2, 5, 8), "k": (2, 5, 8), "v": (2, 5, 8), "n": (2, 1, 5, 5)}),
    ]
    for i, (sym, shapes) in enumerate(cases):
        path = tmp_path / ("a%d.onnx" % i)
        export_checked(sym, {}, {}, shapes, path)
        assert "MultiHeadAttention" in contrib(path)


def test_onnx_bert_with_integer_ids(tmp_path, capsys):
    """The README's example: an ONNX BERT with int64 input_ids in, fused, and out again with int64 inputs
    (validated on ids drawn as integers in range), at the file's opset, as ORT contrib ops."""
    from fusion.testing import onnx_bert
    src = str(tmp_path / "bert.onnx")
    onnx.save(onnx_bert(layers=1, hidden=32, heads=4, ffn=64, vocab_size=50, max_positions=16, opset=17), src)
    out = str(tmp_path / "fused.onnx")
    shapes = [a for n in ("input_ids", "token_type_ids", "attention_mask") for a in ("--shape", n + "=2,8")]
    code, stdout, err = run_mxfuse(capsys, src, "-o", tmp_path / "b", *shapes, "--to-onnx", out, "--no-self-check")
    assert code == 0, err
    model = onnx.load(out)
    assert [(i.name, i.type.tensor_type.elem_type) for i in model.graph.input] == \
        [(n, onnx.TensorProto.INT64) for n in ("input_ids", "token_type_ids", "attention_mask")]
    assert [o.version for o in model.opset_import if o.domain == ""] == [17]
    assert [o.name for o in model.graph.output] == ["last_hidden_state", "pooler_output"]   # the file's names
    assert {"Attention", "SkipLayerNormalization", "BiasGelu"} <= contrib(out)
    # ORT on our file matches ORT on the original file
    rng = np.random.default_rng(1)
    mask = np.ones((2, 8), np.int64)
    mask[1, 5:] = 0
    feed = {"input_ids": rng.integers(0, 50, (2, 8)), "token_type_ids": rng.integers(0, 2, (2, 8)),
            "attention_mask": mask}
    a = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feed)
    b = ort.InferenceSession(out, providers=["CPUExecutionProvider"]).run(None, feed)
    for x, y in zip(a, b):
        assert np.max(np.abs(x - y)) / np.max(np.abs(x)) <= RTOL
    # --opset overrides the file's; the standard target writes no contrib op
    code, _, err = run_mxfuse(capsys, src, "-o", tmp_path / "c", *shapes, "--to-onnx", out, "--no-self-check",
                              "--opset", "20", "--onnx-target", "standard")
    assert code == 0, err
    model = onnx.load(out)
    assert [o.version for o in model.opset_import if o.domain == ""] == [20] and not contrib(out)
    assert "Gelu" in {n.op_type for n in model.graph.node}       # opset 20's Gelu


# ---------------------------------------------------------------------------------------------
# ops
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dynamic", [False, True])
def test_reshape_special_codes(dynamic, tmp_path):
    x = S.var("x")
    y = S.reshape(x, shape=(-4, 2, -1, -2))               # (6, 4, 5) -> (2, 3, 4, 5)
    y = S.reshape(y, shape=(0, -3, 0))                    # (2, 12, 5)
    y = S.reshape(y, shape=(-1, 0), reverse=True)          # (24, 5)
    y = S.reshape(y * 2, shape=(-2, 1))                   # (24, 5, 1)
    export_checked(y, {}, {}, {"x": (6, 4, 5)}, tmp_path / "r.onnx", dynamic=dynamic)


@pytest.mark.parametrize("act, target, opset, expect", [
    ("gelu_erf", "ort", 17, {"BiasGelu"}),
    ("gelu_tanh", "ort", 17, {"FastGelu"}),
    ("gelu_erf", "standard", 20, {"Gelu"}),
    ("gelu_tanh", "standard", 20, {"Gelu"}),
    ("gelu_erf", "standard", 17, {"Erf"}),
    ("gelu_tanh", "standard", 13, {"Tanh"}),
    ("relu", "ort", 13, {"Relu"}),
])
def test_fused_dense_forms(act, target, opset, expect, tmp_path):
    rng = np.random.default_rng(0)
    sym = S.fused_dense(S.var("x"), S.var("w"), S.var("b"), num_hidden=8, act=act, flatten=False, name="fd")
    arg = {"w": mx.nd.array(rng.normal(0, 0.5, (8, 6))), "b": mx.nd.array(rng.normal(0, 0.5, 8))}
    model = export_checked(sym, arg, {}, {"x": (2, 5, 6)}, tmp_path / "fd.onnx", target=target, opset=opset)
    types = {n.op_type for n in model.graph.node}
    assert expect <= types and "MatMul" in types and "Transpose" not in types, types
    assert not (contrib(tmp_path / "fd.onnx") and target == "standard")


@pytest.mark.parametrize("target, opset, expect", [
    ("ort", 17, ["SkipLayerNormalization"]),
    ("standard", 17, ["Add", "LayerNormalization"]),
    ("standard", 13, ["Add", "ReduceMean", "Sub", "Mul", "ReduceMean", "Add", "Sqrt", "Div", "Mul", "Add"]),
    ("standard", 18, ["Add", "LayerNormalization"]),
])
def test_fused_add_layer_norm_forms(target, opset, expect, tmp_path):
    rng = np.random.default_rng(0)
    sym = S.fused_add_layer_norm(S.var("a"), S.var("b"), S.var("g"), S.var("be"), eps=1e-5, name="aln")
    arg = {"g": mx.nd.array(rng.uniform(0.5, 1.5, 16)), "be": mx.nd.array(rng.normal(0, 0.1, 16))}
    model = export_checked(sym, arg, {}, {"a": (2, 4, 16), "b": (2, 4, 16)}, tmp_path / "aln.onnx",
                           target=target, opset=opset)
    assert [n.op_type for n in model.graph.node] == expect


def test_matmul_bias_folded_into_skip_layer_norm(tmp_path):
    rng = np.random.default_rng(0)
    x = S.var("x")
    d = S.fused_dense(x, S.var("w"), S.var("b"), num_hidden=16, flatten=False, name="fd")
    sym = S.fused_add_layer_norm(d, x, S.var("g"), S.var("be"), eps=1e-5, name="aln")
    arg = {"w": mx.nd.array(rng.normal(0, 0.3, (16, 16))), "b": mx.nd.array(rng.normal(0, 0.3, 16)),
           "g": mx.nd.array(rng.uniform(0.5, 1.5, 16)), "be": mx.nd.array(rng.normal(0, 0.1, 16))}
    model = export_checked(sym, arg, {}, {"x": (2, 4, 16)}, tmp_path / "s.onnx")
    assert [n.op_type for n in model.graph.node] == ["MatMul", "SkipLayerNormalization"]
    assert len(model.graph.node[1].input) == 5          # the bias as SkipLayerNormalization's 5th input


@pytest.mark.parametrize("opset", [13, 17, 18, 21])
def test_opset_spellings(opset, tmp_path):
    """ReduceMean's axes are an attribute to 17 and an input from 18; the file is stamped as asked."""
    x = S.var("x")
    sym = S.broadcast_sub(x, S.mean(x, axis=-1, keepdims=True))
    model = export_checked(sym, {}, {}, {"x": (3, 4)}, tmp_path / "m.onnx", opset=opset)
    assert [o.version for o in model.opset_import if o.domain == ""] == [opset]
    rm = [n for n in model.graph.node if n.op_type == "ReduceMean"][0]
    assert (len(rm.input) == 2) == (opset >= 18)


def test_default_opset_and_bad_target(tmp_path):
    x = S.var("x")
    model = export_checked(S.relu(x), {}, {}, {"x": (3, 4)}, tmp_path / "m.onnx")
    assert [o.version for o in model.opset_import if o.domain == ""] == [DEFAULT_OPSET]
    with pytest.raises(fusion.FusionError) as e:
        export_onnx(S.relu(x), {}, {}, {"x": (3, 4)}, str(tmp_path / "n.onnx"), target="tensorrt")
    assert "tensorrt" in str(e.value)


# ---------------------------------------------------------------------------------------------
# a failed export
# ---------------------------------------------------------------------------------------------

def test_export_error_names_the_node(tmp_path):
    sym = S.relu(S.gammaln(S.var("data"), name="chop"))
    with pytest.raises(OnnxExportError) as e:
        export_onnx(sym, {}, {}, {"data": (2, 3)}, str(tmp_path / "m.onnx"))
    assert e.value.node == "chop" and e.value.op == "gammaln" and "'chop'" in str(e.value)
    assert not os.listdir(tmp_path)


def test_cli_failed_export_still_writes_the_mxnet_model(tmp_path, capsys):
    data = S.var("data")
    sym = S.relu(S.gammaln(S.FullyConnected(data, num_hidden=8, name="fc"), name="chop"))
    arg, aux = random_params(sym, {"data": (16, 4)})
    prefix = str(tmp_path / "model")
    sym.save(prefix + "-symbol.json")
    mx.nd.save(prefix + "-0000.params", {"arg:" + k: v for k, v in arg.items()})
    out = tmp_path / "out"
    code, stdout, err = run_mxfuse(capsys, prefix + "-symbol.json", "--params", prefix + "-0000.params",
                                   "-o", out, "--shape", "data=16,4", "--verify", "--to-onnx", tmp_path / "m.onnx",
                                   "--report", tmp_path / "r.json")
    assert code == 3, err
    assert os.path.exists(str(out) + "-symbol.json") and os.path.exists(str(out) + "-0000.params")
    assert os.path.exists(tmp_path / "r.json") and not os.path.exists(tmp_path / "m.onnx")
    line = err.strip().splitlines()[-1]
    assert "node 'chop'" in line and "gammaln" in line and "m.onnx not written" in line
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]       # no temporary file left
    # the exit codes are documented in --help
    code, stdout, _ = run_mxfuse(capsys, "--help")
    assert code == 0 and "exit status is 3" in " ".join(stdout.split())


def test_op_without_a_contrib_form_is_exported_unfused(tmp_path):
    """A causal band over unequal query/key lengths (bottom-right aligned) has no ONNX Runtime form: that
    node alone is un-fused and exported as stock ops; encoder-decoder interleaved attention likewise."""
    q, k, v = S.var("q"), S.var("k"), S.var("v")
    sym = S.fused_attention(q, k, v, scale=0.3, layout="bshd", heads=2, causal=True, name="attn")
    shapes = {"q": (2, 3, 8), "k": (2, 5, 8), "v": (2, 5, 8)}
    export_checked(sym, {}, {}, shapes, tmp_path / "c.onnx")
    assert not contrib(tmp_path / "c.onnx")
    sym = S.fused_attention(q, k, scale=0.3, layout="interleaved_encdec", heads=2, name="encdec")
    export_checked(sym, {}, {}, {"q": (3, 2, 8), "k": (5, 2, 16)}, tmp_path / "e.onnx")


def test_unfused_node_reading_its_inputs_in_another_order(tmp_path):
    """fused_attention(q, k, v, mask) un-fused for the export reads the mask before v (where() on the
    scores, then the value product): the shapes go with the un-fused graph's own input order."""
    q, k, v, m = (S.var(n) for n in "qkvm")
    sym = S.fused_attention(q, k, v, m, scale=0.5, mask_kind="boolean", mask_value=-1e9, name="attn")
    export_checked(sym, {}, {}, {"q": (4, 5, 8), "k": (4, 6, 8), "v": (4, 6, 3), "m": (4, 5, 6)},
                   tmp_path / "m.onnx")


def test_dynamic_export_of_a_fused_layer_runs_at_other_sizes(tmp_path):
    from test_transformer_models import bert_layer
    sym = bert_layer(S.var("data"), 0, "plain")
    shapes = {"data": (2, 6, 32), "mask": (1, 1, 6)}
    arg, aux = random_params(sym, shapes)
    fs, fa, fx = fused(sym, arg, aux, shapes)
    path = str(tmp_path / "d.onnx")
    export_checked(fs, fa, fx, shapes, path, dynamic=True)
    rng = np.random.default_rng(0)
    feed = {"data": rng.standard_normal((3, 9, 32)).astype(np.float32),
            "mask": rng.standard_normal((1, 1, 9)).astype(np.float32)}
    from fusion.check.verify import run
    ref = run(fs, fa, fx, feed)
    got = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feed)
    assert np.max(np.abs(ref[0] - got[0])) / np.max(np.abs(ref[0])) <= RTOL


def test_dynamic_bert_export_reads_lengths_from_the_packed_input(tmp_path):
    """A dynamic export takes the sequence length the attention bias is expanded to from Attention's own
    input (no q / k projection kept alive only for its Shape), and runs at another batch size."""
    from fusion.onnx.importer import import_onnx
    from fusion.testing import onnx_bert
    src = str(tmp_path / "bert.onnx")
    onnx.save(onnx_bert(layers=2, hidden=32, heads=4, ffn=64, vocab_size=50, max_positions=16, opset=17), src)
    shapes = {n: (2, 8) for n in ("input_ids", "token_type_ids", "attention_mask")}
    sym, arg, aux = import_onnx(src, input_shapes=shapes)
    out = str(tmp_path / "dyn.onnx")
    export_checked(*fused(sym, arg, aux, shapes), shapes, out, dynamic=True, input_dtypes={k: np.int64 for k in shapes})
    counts = op_counts(out)
    assert counts[("", "MatMul")] == 6 and counts[("", "Shape")] == 1 and counts[(MS, "Attention")] == 2, counts
    rng = np.random.default_rng(2)
    mask = np.ones((3, 8), np.int64)
    mask[1, 6:] = 0
    feed = {"input_ids": rng.integers(0, 50, (3, 8)), "token_type_ids": rng.integers(0, 2, (3, 8)),
            "attention_mask": mask}
    a = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feed)
    b = ort.InferenceSession(out, providers=["CPUExecutionProvider"]).run(None, feed)
    for x, y in zip(a, b):
        assert np.max(np.abs(x - y)) / np.max(np.abs(x)) <= RTOL


def test_ort_optimized_bert_roundtrip(tmp_path, capsys):
    """A BERT optimized by ONNX Runtime's transformers optimizer (EmbedLayerNormalization, Attention,
    SkipLayerNormalization, BiasGelu; its int64 -> int32 Casts read back as trunc) in, fused, and out."""
    from fusion.testing import onnx_bert
    src, opt = str(tmp_path / "bert.onnx"), str(tmp_path / "opt.onnx")
    onnx.save(onnx_bert(layers=1, hidden=32, heads=4, ffn=64, vocab_size=50, max_positions=16), src)
    _ort_optimize(src, opt, 4, 32)
    assert "EmbedLayerNormalization" in contrib(opt)
    out = str(tmp_path / "out.onnx")
    shapes = [a for n in ("input_ids", "token_type_ids", "attention_mask") for a in ("--shape", n + "=2,8")]
    code, _, err = run_mxfuse(capsys, opt, "-o", tmp_path / "b", *shapes, "--to-onnx", out, "--no-self-check")
    assert code == 0, err
    assert {"Attention", "SkipLayerNormalization", "BiasGelu", "EmbedLayerNormalization"} <= contrib(out)
    model = onnx.load(out)
    types = collections.Counter(n.op_type for n in model.graph.node)
    # ORT's own mask again: the count of ones as EmbedLayerNormalization's mask_index read by Attention
    # (not rebuilt from Equal / ReduceSum / a key range); the int64 -> int32 Casts read back as trunc are
    # no Abs / Floor / Sign of the ids
    assert not {"ReduceSum", "Equal", "GreaterOrEqual", "Floor", "Sign"} & set(types), types
    eln = next(n for n in model.graph.node if n.op_type == "EmbedLayerNormalization")
    att = next(n for n in model.graph.node if n.op_type == "Attention")
    assert list(att.input[3:]) == [eln.output[1]]
    assert len(model.graph.node) <= len(onnx.load(opt).graph.node)
    rng = np.random.default_rng(3)
    mask = np.array([[1, 1, 1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 2, 1, 0, 1]], np.int64)    # not only right-padded
    feed = {"input_ids": rng.integers(0, 50, (2, 8)), "token_type_ids": rng.integers(0, 2, (2, 8)),
            "attention_mask": mask}
    a = ort.InferenceSession(opt, providers=["CPUExecutionProvider"]).run(None, feed)
    b = ort.InferenceSession(out, providers=["CPUExecutionProvider"]).run(None, feed)
    for x, y in zip(a, b):
        assert np.max(np.abs(x - y)) / np.max(np.abs(x)) <= RTOL


def _ort_optimize(src, dst, heads, hidden):
    optimizer = pytest.importorskip("onnxruntime.transformers.optimizer")
    from onnxruntime.transformers.fusion_options import FusionOptions
    options = FusionOptions("bert")
    options.enable_shape_inference = False
    optimizer.optimize_model(src, model_type="bert", num_heads=heads, hidden_size=hidden, opt_level=0,
                             optimization_options=options, use_gpu=False).save_model_to_file(dst)


def test_fewer_nodes_than_ort_optimizer(tmp_path, capsys):
    """A torch-style ONNX BERT (2 layers, batch 1) through import -> fuse -> export has fewer nodes than
    ONNX Runtime's transformers optimizer writes for it, and so has the optimizer's file read back: the
    (1, S) mask is not unsqueezed (broadcasting puts its 1s in front), the pooler's Gemm and Tanh are one
    FusedGemm, the optimizer's mask_index is kept."""
    from fusion.testing import onnx_bert
    src, opt = str(tmp_path / "bert.onnx"), str(tmp_path / "opt.onnx")
    onnx.save(onnx_bert(layers=2, hidden=32, heads=4, ffn=64, vocab_size=50, max_positions=16, opset=17), src)
    _ort_optimize(src, opt, 4, 32)
    shapes = [a for n in ("input_ids", "token_type_ids", "attention_mask") for a in ("--shape", n + "=1,8")]
    counts = {}
    for name, path in (("ours", src), ("again", opt)):
        out = str(tmp_path / (name + ".onnx"))
        code, _, err = run_mxfuse(capsys, path, "-o", tmp_path / name, *shapes, "--to-onnx", out, "--no-self-check")
        assert code == 0, err
        counts[name] = op_counts(out)
        assert ("", "Unsqueeze") not in counts[name] and ("", "Tanh") not in counts[name]
        assert counts[name][(MS, "FusedGemm")] == 1 and counts[name][(MS, "Attention")] == 2
    n_opt = len(onnx.load(opt).graph.node)
    assert sum(counts["ours"].values()) < n_opt and sum(counts["again"].values()) < n_opt, (counts, n_opt)


@pytest.mark.parametrize("act", ["tanh", "relu", "sigmoid"])
def test_gemm_and_activation_as_fused_gemm(act, tmp_path):
    rng = np.random.default_rng(0)
    y = S.Activation(S.FullyConnected(S.var("x"), num_hidden=6, name="fc"), act_type=act, name="act")
    arg = {"fc_weight": mx.nd.array(rng.normal(0, 0.5, (6, 5))), "fc_bias": mx.nd.array(rng.normal(0, 0.5, 6))}
    for target in ("ort", "standard"):
        model = export_checked(y, arg, {}, {"x": (3, 5)}, tmp_path / "g.onnx", target=target)
        types = [n.op_type for n in model.graph.node]
        assert types == (["FusedGemm"] if target == "ort" else ["Gemm", act.capitalize()]), types
    # a Gemm whose result is read elsewhere too stays a Gemm
    fc = S.FullyConnected(S.var("x"), num_hidden=6, name="fc")
    model = export_checked(S.Group([S.tanh(fc), fc]), arg, {}, {"x": (3, 5)}, tmp_path / "h.onnx")
    assert "FusedGemm" not in {n.op_type for n in model.graph.node}


def test_unsqueeze_kept_where_broadcasting_would_not_restore_it(tmp_path):
    """(2, 8) -> (2, 1, 1, 8) puts the batch in front of inserted dims: kept; (1, 8) -> (1, 1, 1, 8) read by
    a sum with a rank-4 value: dropped; one read by an op whose output rank follows it alone: kept."""
    m, w = S.var("m"), S.var("w")
    arg = {"w": mx.nd.array(np.random.default_rng(0).normal(0, 1, (1, 1, 8, 1)))}
    sym = S.broadcast_add(S.expand_dims(S.expand_dims(1 - m, axis=1), axis=1), w)
    for shape, kept in (((2, 8), True), ((1, 8), False)):
        model = export_checked(sym, arg, {}, {"m": shape}, tmp_path / "u.onnx")
        assert ("Unsqueeze" in {n.op_type for n in model.graph.node}) == kept
    alone = S.exp(S.expand_dims(S.expand_dims(m, axis=1), axis=1))
    model = export_checked(alone, {}, {}, {"m": (1, 8)}, tmp_path / "v.onnx")
    assert "Unsqueeze" in {n.op_type for n in model.graph.node}
    assert [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim] in ([1, 1, 1, 8], [])


def test_swapped_regions(tmp_path):
    """Row-wise ops between (1, 0, 2) transposes run in the other layout when that takes Transposes away (a
    graph input read inside the region is swapped once); when it would not, the graph stays as it is."""
    rng = np.random.default_rng(0)
    arg = {"fc_weight": mx.nd.array(rng.normal(0, 0.5, (8, 8))), "fc_bias": mx.nd.array(rng.normal(0, 0.5, 8))}
    x, y = S.var("x"), S.var("y")
    fc = S.FullyConnected(x + S.transpose(y, axes=(1, 0, 2)), num_hidden=8, flatten=False, name="fc")
    model = export_checked(S.transpose(fc, axes=(1, 0, 2)), arg, {}, {"x": (4, 2, 8), "y": (2, 4, 8)},
                           tmp_path / "s.onnx")
    assert [n.op_type for n in model.graph.node] == ["Transpose", "Add", "MatMul", "Add"]
    assert model.graph.node[0].input[0] == "x"
    # one Transpose in, none out: left alone
    fc = S.FullyConnected(S.transpose(y, axes=(1, 0, 2)), num_hidden=8, flatten=False, name="fc")
    model = export_checked(fc, arg, {}, {"y": (2, 4, 8)}, tmp_path / "t.onnx")
    assert [n.op_type for n in model.graph.node] == ["Transpose", "MatMul", "Add"]


def test_trunc_exports(tmp_path):
    x = S.var("x")
    export_checked(S.trunc(x * 3), {}, {}, {"x": (4, 5)}, tmp_path / "t.onnx")


@pytest.mark.parametrize("opset", [13, 17])
def test_layer_norm_form_by_opset(opset, tmp_path):
    rng = np.random.default_rng(0)
    sym = S.LayerNorm(S.var("x"), S.var("g"), S.var("b"), eps=1e-5, name="ln")
    arg = {"g": mx.nd.array(rng.uniform(0.5, 1.5, 8)), "b": mx.nd.array(rng.normal(0, 0.1, 8))}
    model = export_checked(sym, arg, {}, {"x": (2, 3, 8)}, tmp_path / "ln.onnx", opset=opset)
    assert ("LayerNormalization" in {n.op_type for n in model.graph.node}) == (opset >= 17)


def test_fused_elemwise_program_nested_as_deep_as_mxnet_loads(tmp_path):
    """A program nested 4095 deep (written by hand or by another tool) exports and matches: the
    program is read and written out without recursion."""
    from fusion.ir.graph import MAX_EXPR_DEPTH

    expr = "x0"
    for i in range(MAX_EXPR_DEPTH - 1):
        expr = ("add(%s, x1)" if i % 2 else "mul(%s, 0.999)") % expr
    sym = S.fused_elemwise(S.var("x0"), S.var("x1"), expr=expr, num_args=2)
    model = export_checked(sym, {}, {}, {"x0": (2, 3), "x1": (2, 3)}, tmp_path / "deep.onnx")
    assert len(model.graph.node) >= MAX_EXPR_DEPTH - 1


def test_batchnorm_fix_gamma_exports_gamma_as_one(tmp_path):
    """MXNet ignores a stored γ under fix_gamma=True (its default); the ONNX file must too.  A random-weight
    ResNet-50 v2's first BatchNorm (fix_gamma, γ != 1) failed the export's own ONNX Runtime check (6.9e-3)."""
    x = mx.sym.Variable("data")
    y = mx.sym.Convolution(mx.sym.BatchNorm(x, name="bn0"), num_filter=4, kernel=(3, 3), name="c")
    y = mx.sym.BatchNorm(y, name="bn1", fix_gamma=False)
    shapes = {"data": (1, 3, 8, 8)}
    arg, aux = random_params(y, shapes)
    arg["bn0_gamma"] = mx.nd.array(np.full(3, 2.5, np.float32))      # ignored by MXNet (fix_gamma)
    arg["bn1_gamma"] = mx.nd.array(np.full(4, 2.5, np.float32))      # read by MXNet
    v = export_onnx(y, arg, aux, shapes, tmp_path / "m.onnx")
    assert v.ok(RTOL), v
    assert float(arg["bn0_gamma"].asnumpy()[0]) == 2.5               # the caller's arrays stay as they were


def test_batchnorm_fix_gamma_inside_a_fused_region_exports_gamma_as_one(tmp_path):
    """The same BatchNorm taken into a fused_region: the export un-fuses the region to stock ops, whose
    fix_gamma BatchNorm must again read γ as ones (ResNet-50 v2 fused failed the export's check at 6.9e-3)."""
    from fusion.native.library import capabilities
    if "cpu" not in (capabilities().get("fused_region") or {}).get("forward", ()):
        pytest.skip("this op library has no fused_region")
    x = mx.sym.Variable("data")
    y = mx.sym.Convolution(mx.sym.BatchNorm(x, name="bn0"), num_filter=4, kernel=(3, 3), pad=(1, 1), name="c")
    y = mx.sym.Convolution(mx.sym.relu(mx.sym.BatchNorm(y, name="bn1", fix_gamma=False)), num_filter=4,
                           kernel=(3, 3), pad=(1, 1), name="c2")
    shapes = {"data": (1, 3, 8, 8)}
    arg, aux = random_params(y, shapes)
    arg["bn0_gamma"] = mx.nd.array(np.full(3, 2.5, np.float32))      # ignored by MXNet (fix_gamma)
    res = fusion.fuse(y, arg, aux, input_shapes=shapes)
    assert "fused_region" in res.symbol.tojson(), res.report.to_text()
    v = export_onnx(res.symbol, res.arg_params, res.aux_params, shapes, tmp_path / "m.onnx")
    assert v.ok(RTOL), v
