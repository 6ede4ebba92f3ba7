"""ONNX import/export (fusion/onnx/importer.py) against ONNX Runtime.

The models are built here with ``onnx.helper`` the way today's exporters
write them: initializers not listed as graph inputs, symbolic batch (and
sequence) dimensions, opset 13 and 17.  Each is imported, run in MXNet and
compared with ONNX Runtime on the same input; fused and compared again;
exported back and run in ONNX Runtime.  The exporters of the fused ops are
checked one by one against MXNet, in ONNX Runtime.  Two fixtures written by
torch.onnx.export (tests/data/make_onnx_fixtures.py) cover real exporter output;
torch is not needed to run these tests.  Tolerance: max|err| / max|ref| <= 1e-4.
"""
import os

import numpy as np
import pytest

from conftest import RTOL, ops

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import fusion  # noqa: E402
from fusion.ir.errors import FusionError, GraphError  # noqa: E402
from fusion.onnx.importer import DEFAULT_OPSET, export_onnx, import_onnx  # noqa: E402
from fusion.check.verify import compare, run  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


# ---------------------------------------------------------------------------------------------
# model builders
# ---------------------------------------------------------------------------------------------

class Builder:
    """Nodes and initializers of an ONNX graph; initializers stay out of the graph inputs."""

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits, self.n = [], [], 0

    def init(self, name, value):
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, name, shape, scale=None):
        scale = scale if scale is not None else 1.0 / np.sqrt(np.prod(shape[1:]) if len(shape) > 1 else shape[0])
        return self.init(name, self.rng.normal(0, scale, shape).astype(np.float32))

    def op(self, op_type, inputs, n_out=1, **attrs):
        self.n += 1
        name = "/%s_%d" % (op_type, self.n)          # exporters' names: not valid MXNet names
        outs = ["%s_out%d" % (name, i) for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, **attrs))
        return outs[0] if n_out == 1 else outs

    def model(self, inputs, outputs, opset):
        graph = helper.make_graph(self.nodes, "g", inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8
        onnx.checker.check_model(model)
        return model


def _out(name, out, rank):
    return helper.make_tensor_value_info(out, TensorProto.FLOAT, [None] * rank)


def resnet_block_model(opset):
    """Conv-BN-ReLU, Conv-BN + residual, ReLU, MaxPool, GAP, Flatten(1), Gemm; and Flatten(axis=2) -> MatMul."""
    b = Builder(1)
    x = "input"
    c = 8
    y = b.op("Conv", [x, b.weight("conv1.weight", (c, 3, 3, 3)), b.weight("conv1.bias", (c,), 0.1)],
             kernel_shape=[3, 3], pads=[1, 1, 1, 1])

    def bn(y, tag):
        return b.op("BatchNormalization", [y, b.init(tag + ".weight", b.rng.uniform(0.5, 1.5, c).astype(np.float32)),
                                           b.weight(tag + ".bias", (c,), 0.2),
                                           b.weight(tag + ".running_mean", (c,), 0.2),
                                           b.init(tag + ".running_var", b.rng.uniform(0.5, 2, c).astype(np.float32))],
                    epsilon=1e-5)
    y = b.op("Relu", [bn(y, "bn1")])
    z = b.op("Conv", [y, b.weight("conv2.weight", (c, c, 3, 3))], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
             strides=[1, 1])
    z = b.op("Relu", [b.op("Add", [bn(z, "bn2"), y])])
    p = b.op("MaxPool", [z], kernel_shape=[2, 2], strides=[2, 2])
    g = b.op("Flatten", [b.op("GlobalAveragePool", [p])], axis=1)
    logits = b.op("Gemm", [g, b.weight("fc.weight", (10, c)), b.weight("fc.bias", (10,), 0.1)], transB=1)
    f2 = b.op("Flatten", [p], axis=2)                                  # (N*8, 8*8)
    side = b.op("MatMul", [f2, b.weight("side.weight", (64, 5))])
    inp = helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", 3, 16, 16])
    return b.model([inp], [_out("logits", logits, 2), _out("side", side, 2)], opset)


def bert_layer_model(opset, hidden=32, heads=4, ffn=64, layer_norm_op=None):
    """One BERT encoder layer as torch exports it, with Shape/Gather/Concat-driven head-split reshapes."""
    layer_norm_op = opset >= 17 if layer_norm_op is None else layer_norm_op
    b = Builder(2)
    x, mask = "hidden_states", "attention_mask"
    d = hidden // heads

    def dense(y, tag, n_in, n_out):
        w = b.weight(tag + ".weight_T", (n_in, n_out))
        return b.op("Add", [b.weight(tag + ".bias", (n_out,), 0.1), b.op("MatMul", [y, w])])  # bias first, as torch

    def dim(i):
        return b.op("Unsqueeze", [b.op("Gather", [b.op("Shape", [x]), b.init("idx%d_%d" % (i, b.n), np.array(i))],
                                       axis=0), b.init("ax0_%d" % b.n, np.array([0]))])

    def split_heads(y, perm):
        shape = b.op("Concat", [dim(0), dim(1), b.init("h_%d" % b.n, np.array([heads])),
                                b.init("d_%d" % b.n, np.array([d]))], axis=0)
        return b.op("Transpose", [b.op("Reshape", [y, shape])], perm=perm)

    def layer_norm(y, tag):
        gamma = b.init(tag + ".weight", b.rng.uniform(0.5, 1.5, hidden).astype(np.float32))
        beta = b.weight(tag + ".bias", (hidden,), 0.1)
        if layer_norm_op:
            return b.op("LayerNormalization", [y, gamma, beta], axis=-1, epsilon=1e-12)
        mean = b.op("ReduceMean", [y], axes=[-1])
        cen = b.op("Sub", [y, mean])
        var = b.op("ReduceMean", [b.op("Pow", [cen, b.init("two_%d" % b.n, np.array(2.0, np.float32))])], axes=[-1])
        std = b.op("Sqrt", [b.op("Add", [var, b.init("eps_%d" % b.n, np.array(1e-12, np.float32))])])
        return b.op("Add", [b.op("Mul", [b.op("Div", [cen, std]), gamma]), beta])

    q = split_heads(dense(x, "query", hidden, hidden), [0, 2, 1, 3])
    k = split_heads(dense(x, "key", hidden, hidden), [0, 2, 3, 1])
    v = split_heads(dense(x, "value", hidden, hidden), [0, 2, 1, 3])
    scores = b.op("Div", [b.op("MatMul", [q, k]), b.init("sqrt_d", np.array(np.sqrt(d), np.float32))])
    probs = b.op("Softmax", [b.op("Add", [scores, mask])], axis=-1)
    ctx = b.op("Transpose", [b.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
    merge = b.op("Concat", [dim(0), dim(1), b.init("all_%d" % b.n, np.array([hidden]))], axis=0)
    ctx = b.op("Reshape", [ctx, merge])
    h1 = layer_norm(b.op("Add", [dense(ctx, "attn_out", hidden, hidden), x]), "ln1")
    inter = dense(h1, "inter", hidden, ffn)
    erf = b.op("Erf", [b.op("Div", [inter, b.init("sqrt2", np.array(np.sqrt(2.0), np.float32))])])
    gelu = b.op("Mul", [b.op("Mul", [inter, b.op("Add", [erf, b.init("one", np.array(1.0, np.float32))])]),
                        b.init("half", np.array(0.5, np.float32))])
    out = layer_norm(b.op("Add", [dense(gelu, "out", ffn, hidden), h1]), "ln2")
    inputs = [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", "seq", hidden]),
              helper.make_tensor_value_info(mask, TensorProto.FLOAT, ["batch", 1, 1, "seq"])]
    return b.model(inputs, [_out("last_hidden_state", out, 3)], opset)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def ort_run(model_or_path, feed):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    src = model_or_path if isinstance(model_or_path, str) else model_or_path.SerializeToString()
    sess = ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: feed[i.name] for i in sess.get_inputs()})


def inputs_for(shapes, seed=0):
    rng = np.random.default_rng(seed)
    feed = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    if "attention_mask" in feed:                     # additive mask: 0 keep, -10000 masked
        keep = rng.random(shapes["attention_mask"]) > 0.25
        keep[..., 0] = True
        feed["attention_mask"] = np.where(keep, 0.0, -10000.0).astype(np.float32)
    return feed


def check_export(model, feed, reference, tmp_path, name):
    """export_onnx (validated against MXNet inside), then the file against ORT on the original model."""
    sym, arg, aux = model
    shapes = {k: v.shape for k, v in feed.items()}
    out_path = str(tmp_path / (name + ".onnx"))
    check = export_onnx(sym, arg, aux, shapes, out_path)
    assert check.max_rel <= RTOL, check
    assert compare(reference, ort_run(out_path, feed), ["y"] * len(reference)).max_rel <= RTOL
    exported = onnx.load(out_path)
    assert [o.version for o in exported.opset_import if o.domain == ""] == [DEFAULT_OPSET]


def check_roundtrip(model, shapes, tmp_path):
    """import -> MXNet vs ORT -> export -> ORT; then fuse -> vs ORT -> export -> ORT."""
    feed = inputs_for(shapes)
    reference = ort_run(model, feed)
    names = ["out%d" % i for i in range(len(reference))]
    sym, arg, aux = import_onnx(model, input_shapes=shapes)
    assert compare(reference, run(sym, arg, aux, feed), names).max_rel <= RTOL
    check_export((sym, arg, aux), feed, reference, tmp_path, "imported")

    fused = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    got = run(fused.symbol, fused.arg_params, fused.aux_params, feed)
    assert compare(reference, got, names).max_rel <= RTOL, fused.report.to_text()
    check_export(fused, feed, reference, tmp_path, "fused")
    return sym, fused


# ---------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("opset", [13, 17])
def test_resnet_block_roundtrip(opset, tmp_path):
    sym, fused = check_roundtrip(resnet_block_model(opset), {"input": (2, 3, 16, 16)}, tmp_path)
    counts = ops(sym)
    assert counts["Convolution"] == 2 and counts["BatchNorm"] == 2 and counts["FullyConnected"] == 2
    assert counts.get("Flatten", 0) == 1 and counts.get("Reshape", 0) == 1      # Flatten(axis=2) -> Reshape
    assert ops(fused).get("BatchNorm", 0) == 0                                   # folded by conv_bn_act
    assert all(n.replace("_", "").isalnum() for n in sym.list_arguments())


@pytest.mark.parametrize("opset", [13, 17])
def test_bert_layer_roundtrip(opset, tmp_path):
    sym, fused = check_roundtrip(bert_layer_model(opset),
                                 {"hidden_states": (2, 8, 32), "attention_mask": (2, 1, 1, 8)}, tmp_path)
    # the imported form is the one the rule library matches: the whole layer fuses (and exports back)
    # (query, key and value: one product, qkv_projection)
    assert ops(fused) == {"fused_dense": 4, "fused_attention": 1, "fused_add_layer_norm": 2}, \
        fused.report.to_text(explain=True)
    counts = ops(sym)
    assert counts["FullyConnected"] == 6 and counts["batch_dot"] == 2 and counts["softmax"] == 1
    assert counts.get("LayerNorm", 0) == (2 if opset >= 17 else 0)
    assert "_div_scalar" in counts and "erf" in counts
    assert not {"Shape", "shape_array", "Concat", "Gather"} & set(counts)       # shape chains folded


def test_bert_layer_decomposed_layer_norm_at_opset17(tmp_path):
    model = bert_layer_model(17, layer_norm_op=False)
    shapes = {"hidden_states": (1, 5, 32), "attention_mask": (1, 1, 1, 5)}
    sym, _, _ = import_onnx(model, input_shapes=shapes)
    counts = ops(sym)
    assert counts["mean"] == 4 and counts["square"] == 2 and "LayerNorm" not in counts
    check_roundtrip(model, shapes, tmp_path)


def test_folded_reshape_keeps_batch_free():
    """Shape chains fold for the given shapes; leading sizes stay 0 (copy) so another batch size still runs."""
    model = bert_layer_model(17)
    sym, arg, aux = import_onnx(model, input_shapes={"hidden_states": (2, 8, 32), "attention_mask": (2, 1, 1, 8)})
    shapes = {"hidden_states": (3, 8, 32), "attention_mask": (3, 1, 1, 8)}
    feed = inputs_for(shapes, seed=1)
    assert compare(ort_run(model, feed), run(sym, arg, aux, feed), ["y"]).max_rel <= RTOL


def test_dynamic_export_runs_other_batch_and_sequence(tmp_path):
    model = bert_layer_model(17)
    shapes = {"hidden_states": (2, 8, 32), "attention_mask": (2, 1, 1, 8)}
    fused = fusion.fuse(*import_onnx(model, input_shapes=shapes), input_shapes=shapes)
    path = str(tmp_path / "dyn.onnx")
    export_onnx(fused.symbol, fused.arg_params, fused.aux_params, shapes, path, dynamic=True)
    feed = inputs_for({"hidden_states": (3, 5, 32), "attention_mask": (3, 1, 1, 5)}, seed=2)
    assert compare(ort_run(model, feed), ort_run(path, feed), ["y"]).max_rel <= RTOL


def test_old_style_initializers_as_inputs():
    model = resnet_block_model(13)
    model.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                             for t in model.graph.initializer)
    sym, arg, aux = import_onnx(model, input_shapes={"input": (1, 3, 16, 16)})
    assert set(sym.list_arguments()) - set(arg) == {"input"}


@pytest.mark.parametrize("fixture", ["torch_tiny_bert.onnx", "torch_tiny_bert_dynamo.onnx"])
def test_torch_exported_fixture(fixture, tmp_path):
    """Files written by torch.onnx.export (TorchScript opset 17; dynamo opset 20): tests/data/make_onnx_fixtures.py."""
    path = os.path.join(DATA, fixture)
    if not os.path.exists(path):
        pytest.skip("fixture not generated")
    shapes = {"hidden_states": (2, 8, 32), "attention_mask": (2, 8)}
    rng = np.random.default_rng(3)
    keep = (rng.random((2, 8)) > 0.3).astype(np.int64)
    keep[:, 0] = 1
    feed = {"hidden_states": rng.standard_normal((2, 8, 32)).astype(np.float32), "attention_mask": keep}
    mx_feed = {k: v.astype(np.float32) for k, v in feed.items()}    # integer inputs run as float32 in MXNet
    reference = ort_run(path, feed)
    sym, arg, aux = import_onnx(path, input_shapes=shapes)
    assert compare(reference, run(sym, arg, aux, mx_feed), ["y"]).max_rel <= RTOL
    counts = ops(sym)
    assert counts["FullyConnected"] == 6 and counts["LayerNorm"] == 2 and counts["batch_dot"] == 2
    assert all(n.replace("_", "").isalnum() for n in sym.list_arguments())
    fused = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    assert compare(reference, run(fused.symbol, fused.arg_params, fused.aux_params, mx_feed), ["y"]).max_rel <= RTOL
    # the in-graph mask, 1 - mask, is an _rminus_scalar, which MXNet's own converter exports as mask - 1
    out_path = str(tmp_path / "exported.onnx")
    check = export_onnx(fused.symbol, fused.arg_params, fused.aux_params, shapes, out_path)
    assert check.max_rel <= RTOL, check
    assert compare(reference, ort_run(out_path, {**feed, "attention_mask": mx_feed["attention_mask"]}),
                   ["y"]).max_rel <= RTOL


# ---------------------------------------------------------------------------------------------
# errors: one line, naming the problem
# ---------------------------------------------------------------------------------------------

def one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg and msg
    return msg


def test_unsupported_op_names_op_and_node():
    b = Builder()
    y = b.op("Relu", ["x"])
    b.op("NonMaxSuppression", [y, y])
    b.nodes[-1].output[0] = "boxes"
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 4])],
                    [helper.make_tensor_value_info("boxes", TensorProto.INT64, [None, 3])], 13)
    with pytest.raises(GraphError) as e:
        import_onnx(model)
    msg = one_line(e)
    assert "NonMaxSuppression" in msg and "/NonMaxSuppression_2" in msg


def test_symbolic_dims_need_input_shapes():
    with pytest.raises(GraphError) as e:
        import_onnx(bert_layer_model(17))
    assert "seq" in one_line(e) and "input_shapes" in str(e.value)


@pytest.mark.parametrize("content", ["truncated", "text", "empty", "missing"])
def test_bad_files(content, tmp_path):
    path = tmp_path / "model.onnx"
    data = resnet_block_model(13).SerializeToString()
    if content == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif content == "text":
        path.write_text("this is not an ONNX model\n" * 20)
    elif content == "empty":
        path.write_bytes(b"")
    with pytest.raises(GraphError) as e:
        import_onnx(str(path), input_shapes={"input": (1, 3, 16, 16)})
    assert "model.onnx" in one_line(e)


def test_export_refuses_op_without_exporter(tmp_path):
    import mxnet as mx

    sym = mx.sym.relu(mx.sym.gammaln(mx.sym.var("data"), name="chop"))
    with pytest.raises(GraphError) as e:
        export_onnx(sym, {}, {}, {"data": (2, 3)}, str(tmp_path / "m.onnx"))
    assert "gammaln (node 'chop')" in one_line(e)
    assert not os.listdir(tmp_path)


def test_export_refuses_fused_op_without_exporter(tmp_path, monkeypatch):
    import mxnet as mx   # `import fusion` loaded the fused ops

    from fusion.onnx import importer as onnx_io
    monkeypatch.delitem(onnx_io.FUSED_OP_EXPORTERS, "fused_elemwise")
    sym = mx.sym.fused_elemwise(mx.sym.var("a"), mx.sym.var("b"), expr="add(x0, x1)", num_args=2, name="ew")
    with pytest.raises(GraphError) as e:
        export_onnx(sym, {}, {}, {"a": (2, 4), "b": (2, 4)}, str(tmp_path / "m.onnx"))
    msg = one_line(e)
    assert "fused_elemwise (node 'ew')" in msg and "unfuse" in msg and "FUSED_OP_EXPORTERS" in msg
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("expr", [
    "mul(sub(1, x0), -10000)",
    "where(gt(x0, 0), x0, mul(x1, 0.01))",
    "clip(add(mul(x0, rsqrt(add(square(x1), 1e-5))), neg(x1)), -1.5, inf)",
    "div(exp(x0), add(1, exp(x1)))",
    "add(mul(ne(x0, x1), sigmoid(x0)), min(tanh(x1), relu(erf(x0))))",
])
def test_fused_elemwise_exports(expr, tmp_path):
    import mxnet as mx

    sym = mx.sym.fused_elemwise(mx.sym.var("a"), mx.sym.var("b"), expr=expr, num_args=2, name="ew")
    check = export_onnx(sym, {}, {}, {"a": (2, 3, 4), "b": (1, 3, 4)}, str(tmp_path / "ew.onnx"))
    assert check.max_rel <= RTOL, check


def test_fused_add_layer_norm_exports_as_skip_layer_norm(tmp_path):
    import mxnet as mx   # `import fusion` loaded the fused ops

    a, b = mx.sym.var("a"), mx.sym.var("b")
    sym = mx.sym.fused_add_layer_norm(a, b, mx.sym.var("ln_gamma"), mx.sym.var("ln_beta"), eps=1e-5, name="aln")
    rng = np.random.default_rng(0)
    arg = {"ln_gamma": mx.nd.array(rng.uniform(0.5, 1.5, 32)), "ln_beta": mx.nd.array(rng.normal(0, 0.1, 32))}
    path = str(tmp_path / "aln.onnx")
    check = export_onnx(sym, arg, {}, {"a": (2, 8, 32), "b": (2, 8, 32)}, path)
    assert check.max_rel <= RTOL, check
    model = onnx.load(path)
    assert [(n.domain, n.op_type) for n in model.graph.node] == [("com.microsoft", "SkipLayerNormalization")]


def test_export_refuses_bad_opset(tmp_path):
    import mxnet as mx

    with pytest.raises(FusionError) as e:
        export_onnx(mx.sym.relu(mx.sym.var("data")), {}, {}, {"data": (2, 3)}, str(tmp_path / "m.onnx"), opset=12)
    assert "12" in one_line(e)


@pytest.mark.parametrize("kw, x_shape", [
    (dict(act="relu"), (4, 2, 3)),                                   # flatten=True, rank 3 -> (4, 6)
    (dict(act="gelu_erf", flatten=False), (2, 5, 6)),
    (dict(act="gelu_tanh", flatten=False, out_layout="heads_bhsd", heads=2), (2, 5, 6)),
    (dict(act="leaky", slope=0.1, flatten=False, no_bias=True), (2, 5, 6)),
])
def test_fused_dense_exports(kw, x_shape, tmp_path):
    import mxnet as mx   # `import fusion` loaded the fused ops

    rng = np.random.default_rng(0)
    args = [mx.sym.var("x"), mx.sym.var("w")] + ([] if kw.get("no_bias") else [mx.sym.var("b")])
    sym = mx.sym.fused_dense(*args, num_hidden=8, name="fd", **kw)
    arg = {"w": mx.nd.array(rng.normal(0, 0.5, (8, 6))), "b": mx.nd.array(rng.normal(0, 0.5, 8))}
    arg = {k: v for k, v in arg.items() if k in sym.list_arguments()}
    check = export_onnx(sym, arg, {}, {"x": x_shape}, str(tmp_path / "fd.onnx"))
    assert check.max_rel <= RTOL, check


@pytest.mark.parametrize("layout", ["plain", "bshd"])
def test_fused_attention_exports(layout, tmp_path):
    import mxnet as mx   # `import fusion` loaded the fused ops

    q, k, v, m = (mx.sym.var(n) for n in ("q", "k", "v", "mask"))
    if layout == "plain":
        sym = mx.sym.fused_attention(q, k, v, scale=0.35, name="attn")
        shapes = {n: (4, 5, 8) for n in "qkv"}
    else:
        sym = mx.sym.fused_attention(q, k, v, m, scale=0.35, layout="bshd", heads=2, mask_kind="additive",
                                     name="attn")
        shapes = {**{n: (2, 5, 16) for n in "qkv"}, "mask": (2, 1, 1, 5)}
    check = export_onnx(sym, {}, {}, shapes, str(tmp_path / "attn.onnx"))
    assert check.max_rel <= RTOL, check


def test_reversed_scalar_ops_export_by_op_not_name(tmp_path):
    """MXNet's converters tell 1 - x from x - 1 by the node's auto-generated name; ours by the op."""
    import mxnet as mx

    x = mx.sym.var("x")
    y = mx.sym._internal._rminus_scalar(x, scalar=1.0, name="one_minus")
    y = mx.sym._internal._rdiv_scalar(mx.sym.abs(y) + 1, scalar=2.0, name="two_over")
    check = export_onnx(y, {}, {}, {"x": (3, 4)}, str(tmp_path / "r.onnx"))
    assert check.max_rel <= RTOL, check
