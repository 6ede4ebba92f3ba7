"""ONNX import of the files people have: single ops at every legal attribute (against ONNX Runtime),
files written by MXNet's own exporter (mx.onnx.export_model), files optimized by ONNX Runtime's
transformers optimizer (com.microsoft contrib ops), and the opset range.  Tolerance as everywhere:
max|err| / max|ref| <= 1e-4 (RTOL)."""
import os

import numpy as np
import pytest

from conftest import RTOL, ops

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import fusion  # noqa: E402
from fusion.ir.errors import GraphError  # noqa: E402
from fusion.onnx.importer import import_onnx  # noqa: E402
from fusion.check.verify import compare, run  # noqa: E402


from test_onnx import ort_run  # noqa: E402  (ONNX Runtime on one thread, CPU)


def one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg and msg
    return msg


def single_op_model(op_type, inputs, inits=(), opset=13, domain="", n_out=1, **attrs):
    """One node reading graph inputs ``inputs`` ({name: shape}) and initializers ``inits`` ({name: array})."""
    names = list(inputs) + [n for n, _ in inits]
    outs = ["y"] + ["y%d" % i for i in range(1, n_out)]
    node = helper.make_node(op_type, names, outs, name="/the/" + op_type, domain=domain, **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
                                        for n, s in inputs.items()],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs],
                          [numpy_helper.from_array(np.asarray(v), n) for n, v in inits])
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    m = helper.make_model(g, opset_imports=imports)
    m.ir_version = 8
    return m


def check_vs_ort(model, feed, shapes=None, rtol=RTOL):
    reference = ort_run(model, feed)
    sym, arg, aux = import_onnx(model, input_shapes=shapes)
    got = run(sym, arg, aux, {k: v.astype(np.float32) for k, v in feed.items()})
    result = compare(reference, got, ["y%d" % i for i in range(len(reference))])
    assert result.max_rel <= rtol, result
    for r, g in zip(reference, got):
        assert r.shape == g.shape
    return sym, arg, aux, result


rng = np.random.default_rng(0)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Flatten, Gemm, Reshape at every legal attribute
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("axis", [-3, -2, -1, 0, 1, 2, 3])
@pytest.mark.parametrize("const", [False, True])
def test_flatten_every_axis(axis, const):
    """ONNX: (prod(dims[:axis]), prod(dims[axis:])), a negative axis counting from the back."""
    x = randn(2, 3, 4)
    if const:    # folded with NumPy, then read by a run-time op
        m = single_op_model("Flatten", {}, [("x", x)], axis=axis)
        node = helper.make_node("Relu", ["y"], ["z"])
        m.graph.node.append(node)
        m.graph.output[0].name = "z"
        m.graph.node[0].output[0] = "y"
        m.graph.input.append(helper.make_tensor_value_info("d", TensorProto.FLOAT, [1]))
        m.graph.node.append(helper.make_node("Add", ["z", "d"], ["w"]))
        m.graph.output[0].name = "w"
        check_vs_ort(m, {"d": randn(1)})
    else:
        check_vs_ort(single_op_model("Flatten", {"x": [2, 3, 4]}, axis=axis), {"x": x})


def test_flatten_axis_out_of_range():
    with pytest.raises(GraphError) as e:
        import_onnx(single_op_model("Flatten", {"x": [2, 3, 4]}, axis=-4))
    msg = one_line(e)
    assert "/the/Flatten" in msg and "-4" in msg


GEMM_C = [None, (), (1,), (5,), (1, 5), (3, 5), (3, 1), (1, 1)]


@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("c_shape", GEMM_C)
@pytest.mark.parametrize("alpha, beta", [(1.0, 1.0), (0.5, 2.0), (1.0, 0.0)])
def test_gemm_every_attribute(trans_a, trans_b, c_shape, alpha, beta):
    a_shape = (4, 3) if trans_a else (3, 4)
    b = randn(*((5, 4) if trans_b else (4, 5)))
    inits = [("B", b)] + ([] if c_shape is None else [("C", randn(*c_shape))])
    m = single_op_model("Gemm", {"A": list(a_shape)}, inits, transA=trans_a, transB=trans_b, alpha=alpha, beta=beta)
    sym, _, _, _ = check_vs_ort(m, {"A": randn(*a_shape)})
    if not trans_a:
        assert "FullyConnected" in ops(sym)


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("c_shape", [None, (5,), (3, 5), (3, 1)])
def test_gemm_runtime_b_and_c(trans_b, c_shape):
    """B and C computed at run time (graph inputs): dot, then alpha and beta·C."""
    inputs = {"A": [3, 4], "B": [5, 4] if trans_b else [4, 5]}
    if c_shape is not None:
        inputs["C"] = list(c_shape)
    m = single_op_model("Gemm", inputs, transB=trans_b, alpha=0.75, beta=1.5)
    check_vs_ort(m, {k: randn(*s) for k, s in inputs.items()})


def test_gemm_after_matmul_is_not_merged_into_it():
    """A MatMul whose FullyConnected waits for a bias Add must not take the Gemm's C as that bias."""
    w = randn(6, 3)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("Gemm", ["h", "B", "C"], ["y"], transB=1)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(randn(4, 3), "B"),
                           numpy_helper.from_array(randn(2, 4), "C")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    check_vs_ort(m, {"x": randn(2, 6)})


@pytest.mark.parametrize("target, allowzero", [
    ([0, -1], 0), ([0, 0, 2, 2], 0), ([-1, 4], 0), ([2, 0, -1], 0), ([6, 4], 1), ([2, -1, 2], 1),
    ([0, 12], 1), ([24], 0), ([-1], 1),
])
def test_reshape_special_values(target, allowzero):
    """0 copies the input's dim (allowzero=0), -1 is inferred; allowzero=1 without zeros as plain sizes."""
    opset = 14 if allowzero else 13
    kw = {"allowzero": allowzero} if allowzero else {}
    if allowzero and 0 in target:
        m = single_op_model("Reshape", {"x": [2, 3, 4]}, [("s", np.array(target, np.int64))], opset=opset, **kw)
        with pytest.raises(GraphError) as e:
            import_onnx(m)
        assert "/the/Reshape" in one_line(e) and "allowzero" in str(e.value)
        return
    m = single_op_model("Reshape", {"x": [2, 3, 4]}, [("s", np.array(target, np.int64))], opset=opset, **kw)
    check_vs_ort(m, {"x": randn(2, 3, 4)})


@pytest.mark.parametrize("target", [[-2, 12], [2, -3], [-1, -1]])
def test_reshape_invalid_target_is_refused(target):
    """MXNet's reshape reads -2/-3/-4 as codes of its own: an ONNX file with them is invalid, not run."""
    m = single_op_model("Reshape", {"x": [2, 3, 4]}, [("s", np.array(target, np.int64))])
    with pytest.raises(GraphError) as e:
        import_onnx(m)
    assert "/the/Reshape" in one_line(e)


# ---------------------------------------------------------------------------------------------
# files written by MXNet's own exporter
# ---------------------------------------------------------------------------------------------

def mx_bert_block(seq=8, hidden=32, heads=4, ffn=64):
    """A BERT-like encoder layer without embeddings: dense, attention written with batch_dot/softmax,
    LayerNorm, GELU; the additive mask is per (batch·head, 1, key)."""
    import mxnet as mx

    x, mask = mx.sym.var("data"), mx.sym.var("mask")
    d = hidden // heads

    def dense(y, n, name):
        return mx.sym.FullyConnected(y, num_hidden=n, flatten=False, name=name)

    def split(y):
        y = mx.sym.transpose(mx.sym.reshape(y, shape=(0, 0, heads, d)), axes=(0, 2, 1, 3))
        return mx.sym.reshape(y, shape=(-1, seq, d))

    q, k, v = (split(dense(x, hidden, n)) for n in ("q", "k", "v"))
    s = mx.sym.broadcast_add(mx.sym.batch_dot(q, k, transpose_b=True) / np.sqrt(d), mask)
    c = mx.sym.batch_dot(mx.sym.softmax(s, axis=-1), v)
    c = mx.sym.reshape(mx.sym.transpose(mx.sym.reshape(c, shape=(-1, heads, seq, d)), axes=(0, 2, 1, 3)),
                       shape=(0, 0, hidden))
    h1 = mx.sym.LayerNorm(dense(c, hidden, "o") + x, axis=-1, eps=1e-12, name="ln1")
    f = mx.sym.LeakyReLU(dense(h1, ffn, "i"), act_type="gelu", name="gelu")
    return mx.sym.LayerNorm(dense(f, hidden, "f") + h1, axis=-1, eps=1e-12, name="ln2")


def mx_small_cnn():
    import mxnet as mx

    x = mx.sym.var("data")

    def cbr(y, n, name, act=True):
        y = mx.sym.Convolution(y, num_filter=n, kernel=(3, 3), pad=(1, 1), name=name)
        y = mx.sym.BatchNorm(y, fix_gamma=False, eps=1e-5, name=name + "_bn")
        return mx.sym.Activation(y, act_type="relu", name=name + "_relu") if act else y

    y = cbr(x, 8, "c1")
    y = mx.sym.Activation(cbr(y, 8, "c2", act=False) + y, act_type="relu")
    y = mx.sym.Pooling(y, kernel=(2, 2), stride=(2, 2), pool_type="max")
    g = mx.sym.Pooling(y, kernel=(1, 1), global_pool=True, pool_type="avg")
    # flatten written out: MXNet's exporter reads a missing flatten attribute as False (an invalid file)
    return mx.sym.FullyConnected(g, num_hidden=10, flatten=True, name="fc")     # Flatten(axis=1) -> Gemm


def mx_params(sym, shapes, seed=0):
    import mxnet as mx

    r = np.random.default_rng(seed)
    arg_shapes, _, aux_shapes = sym.infer_shape(**shapes)
    params = {}
    for n, s in list(zip(sym.list_arguments(), arg_shapes)) + list(zip(sym.list_auxiliary_states(), aux_shapes)):
        if n in shapes:
            continue
        value = r.uniform(0.5, 1.5, s) if n.endswith(("gamma", "var")) else r.normal(0, 0.3, s)
        params[n] = mx.nd.array(value)
    return params


def mx_export(sym, params, shapes, path, opset, monkeypatch, **kwargs):
    """mx.onnx.export_model as it writes files with an onnx release whose newest opset is ``opset``
    (onnx 1.14.1, pinned here, stamps 19 and then fails its own check of ReduceMean's axes)."""
    import onnx.checker
    import onnx.defs
    import mxnet as mx

    monkeypatch.setattr(onnx.defs, "onnx_opset_version", lambda: opset)
    monkeypatch.setattr(onnx.checker, "check_graph", lambda *a, **k: None)
    mx.onnx.export_model(sym, params, [shapes[n] for n in shapes], [np.float32] * len(shapes), path, **kwargs)
    monkeypatch.undo()
    model = onnx.load(path)
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [opset]
    return model


def import_fuse_compare(path, shapes, feed):
    reference = ort_run(path, feed)
    names = ["y%d" % i for i in range(len(reference))]
    sym, arg, aux = import_onnx(path, input_shapes=shapes)
    imported = compare(reference, run(sym, arg, aux, feed), names)
    assert imported.max_rel <= RTOL, imported
    fused = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    result = compare(reference, run(fused.symbol, fused.arg_params, fused.aux_params, feed), names)
    assert result.max_rel <= RTOL, (result, fused.report.to_text())
    print("%s: imported rel err %.2e, fused %.2e" % (os.path.basename(path), imported.max_rel, result.max_rel))
    return sym, fused, imported, result


@pytest.mark.parametrize("opset", [13, 17])
def test_mxnet_exported_bert_block(opset, tmp_path, monkeypatch):
    # (at 19, what onnx 1.14.1 stamps, MXNet's exporter refuses its own LayerNorm: ReduceMean's axes)
    """Flatten(axis=-1) -> Gemm -> Reshape (FullyConnected(flatten=False)), LayerNorm written out with
    "- (-beta)", GELU written out: imported as FullyConnected(flatten=False) and LayerNorm forms,
    and the whole layer fuses."""
    shapes = {"data": (2, 8, 32), "mask": (8, 1, 8)}
    sym = mx_bert_block()
    path = str(tmp_path / "bert.onnx")
    model = mx_export(sym, mx_params(sym, shapes), shapes, path, opset, monkeypatch)
    written = {n.op_type for n in model.graph.node}
    assert {"Flatten", "Gemm", "ReduceMean", "Erf", "Softmax"} <= written
    assert any(n.op_type == "Flatten" and n.attribute[0].i == -1 for n in model.graph.node)
    feed = {"data": randn(2, 8, 32), "mask": np.where(rng.random((8, 1, 8)) > 0.3, 0, -10000).astype(np.float32)}
    sym, fused, _, _ = import_fuse_compare(path, shapes, feed)
    assert ops(sym)["FullyConnected"] == 6 and "Flatten" not in ops(sym)
    assert ops(fused) == {"fused_dense": 4, "fused_attention": 1, "fused_add_layer_norm": 2}, \
        fused.report.to_text(explain=True)


def test_mxnet_exported_dynamic_batch(tmp_path, monkeypatch):
    """MXNet's dynamic export (symbolic batch): imported at batch 2, the same symbols run at batch 3."""
    shapes = {"data": (2, 8, 32), "mask": (8, 1, 8)}
    sym = mx_bert_block()
    path = str(tmp_path / "bert_dyn.onnx")
    model = mx_export(sym, mx_params(sym, shapes), shapes, path, 13, monkeypatch, dynamic=True,
                      dynamic_input_shapes=[(None, 8, 32), (None, 1, 8)])
    assert not model.graph.input[0].type.tensor_type.shape.dim[0].dim_value
    sym, fused, _, _ = import_fuse_compare(path, shapes, {"data": randn(2, 8, 32), "mask": np.zeros((8, 1, 8),
                                                                                                   np.float32)})
    feed = {"data": randn(3, 8, 32), "mask": np.where(rng.random((12, 1, 8)) > 0.3, 0, -10000).astype(np.float32)}
    reference = ort_run(path, feed)
    for s, a, x in ((sym, *import_onnx(path, input_shapes=shapes)[1:]),
                    (fused.symbol, fused.arg_params, fused.aux_params)):
        result = compare(reference, run(s, a, x, feed), ["y"])
        assert result.max_rel <= RTOL, result


@pytest.mark.parametrize("opset", [13, 17, 19])      # 19: what the pinned onnx 1.14.1 stamps
def test_mxnet_exported_small_cnn(opset, tmp_path, monkeypatch):
    shapes = {"data": (2, 3, 16, 16)}
    sym = mx_small_cnn()
    path = str(tmp_path / "cnn.onnx")
    mx_export(sym, mx_params(sym, shapes), shapes, path, opset, monkeypatch)
    sym, fused, _, _ = import_fuse_compare(path, shapes, {"data": randn(2, 3, 16, 16)})
    assert ops(sym)["Convolution"] == 2 and ops(sym)["FullyConnected"] == 1
    assert "BatchNorm" not in ops(fused)


# ---------------------------------------------------------------------------------------------
# ONNX Runtime contrib ops (com.microsoft), one node at a time against ONNX Runtime
# ---------------------------------------------------------------------------------------------

MS = "com.microsoft"


def contrib_model(op_type, inputs, inits=(), names=None, n_out=1, opset=17, **attrs):
    """One com.microsoft node; ``names`` orders graph inputs and initializers ("" for an absent input)."""
    init_names = [n for n, _ in inits]
    names = names if names is not None else list(inputs) + init_names
    outs = ["y"] + ["y%d" % i for i in range(1, n_out)]
    node = helper.make_node(op_type, names, outs, name="/the/" + op_type, domain=MS, **attrs)
    vis = [helper.make_tensor_value_info(n, TensorProto.INT32 if n.startswith("i32_") else TensorProto.FLOAT, s)
           for n, s in inputs.items()]
    g = helper.make_graph([node], "g", vis, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs],
                          [numpy_helper.from_array(np.asarray(v), n) for n, v in inits])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    m.ir_version = 8
    return m


def check_contrib(model, feed, shapes=None):
    reference = ort_run(model, feed)
    sym, arg, aux = import_onnx(model, input_shapes=shapes)
    got = run(sym, arg, aux, {k: v.astype(np.float32) for k, v in feed.items()})
    result = compare(reference[:len(got)], got, ["y%d" % i for i in range(len(got))])
    assert result.max_rel <= RTOL, result
    return sym, arg, aux, result


@pytest.mark.parametrize("beta, bias, skip_shape, sum_out", [
    (True, True, (2, 5, 16), False), (False, False, (2, 5, 16), False), (True, False, (1, 5, 16), False),
    (True, True, (5, 16), True),
])
def test_skip_layer_normalization(beta, bias, skip_shape, sum_out):
    inits = [("gamma", rng.uniform(0.5, 1.5, 16).astype(np.float32))]
    names = ["x", "skip", "gamma", "beta" if beta else "", "bias" if bias else ""]
    if beta:
        inits.append(("beta", randn(16)))
    if bias:
        inits.append(("bias", randn(16)))
    while names[-1] == "":
        names.pop()
    m = contrib_model("SkipLayerNormalization", {"x": [2, 5, 16], "skip": list(skip_shape)}, inits, names=names,
                      n_out=4 if sum_out else 1, epsilon=1e-5)
    if sum_out:
        m.graph.node[0].output[1] = m.graph.node[0].output[2] = ""
        del m.graph.output[1:3]
    sym, _, _, _ = check_contrib(m, {"x": randn(2, 5, 16), "skip": randn(*skip_shape)})
    assert ops(sym)["LayerNorm"] == 1


# the mean output (ORT's second output), and an attribute the importer does not know
@pytest.mark.parametrize("kw,word", [(dict(n_out=2), "mean"), (dict(simplified=1), "simplified")])
def test_skip_layer_normalization_refusals(kw, word):
    m = contrib_model("SkipLayerNormalization", {"x": [2, 5, 16], "skip": [2, 5, 16]},
                      [("gamma", np.ones(16, np.float32))], **kw)
    with pytest.raises(GraphError) as e:
        import_onnx(m)
    msg = one_line(e)
    assert "/the/SkipLayerNormalization" in msg and word in msg


def test_bias_gelu_and_fast_gelu():
    x = randn(2, 5, 16) * 3
    check_contrib(contrib_model("BiasGelu", {"x": [2, 5, 16]}, [("b", randn(16))]), {"x": x})
    check_contrib(contrib_model("FastGelu", {"x": [2, 5, 16]}, [("b", randn(16))]), {"x": x})
    check_contrib(contrib_model("FastGelu", {"x": [2, 5, 16]}), {"x": x})
    check_contrib(contrib_model("Gelu", {"x": [2, 5, 16]}), {"x": x})


@pytest.mark.parametrize("trans_a, trans_b, alpha, const_b", [
    (0, 0, 1.0, True), (0, 1, 0.5, True), (1, 0, 2.0, False), (1, 1, 1.0, False), (0, 1, 0.125, False),
])
def test_fused_matmul(trans_a, trans_b, alpha, const_b):
    a_shape = [2, 6, 4] if trans_a else [2, 4, 6]
    b_shape = [5, 6] if trans_b else [6, 5]
    if const_b:
        m = contrib_model("FusedMatMul", {"a": a_shape}, [("b", randn(*b_shape))], transA=trans_a, transB=trans_b,
                          alpha=alpha)
        feed = {"a": randn(*a_shape)}
    else:
        b_shape = [2] + b_shape
        m = contrib_model("FusedMatMul", {"a": a_shape, "b": b_shape}, transA=trans_a, transB=trans_b, alpha=alpha)
        feed = {"a": randn(*a_shape), "b": randn(*b_shape)}
    check_contrib(m, feed)


def test_fused_matmul_refuses_trans_batch():
    m = contrib_model("FusedMatMul", {"a": [2, 4, 6], "b": [2, 6, 5]}, transBatchA=1)
    with pytest.raises(GraphError) as e:
        import_onnx(m)
    assert "transBatchA" in one_line(e) and "/the/FusedMatMul" in str(e.value)


def right_padded_lengths(batch, seq):
    return np.array([seq, max(1, seq - 2)] + [seq - 1] * (batch - 2), np.int32)[:batch]


ATTN_MASKS = ["none", "lengths", "left_padding", "raw2d", "raw3d", "raw_first_masked"]


def attention_mask(kind, batch, sq, sk):
    if kind == "lengths":
        return right_padded_lengths(batch, sk)
    if kind == "left_padding":
        return np.array([sk, sk - 1, 0, 2], np.int32)             # ends, then starts
    keep = (rng.random((batch, sk) if kind == "raw2d" else (batch, sq, sk)) > 0.3).astype(np.int32)
    keep[..., 0] = 1
    if kind == "raw_first_masked":          # batch 1 masks keys 0 and 1: causal rows 0-1 see only padding
        keep = np.ones((batch, sk), np.int32)
        keep[1, :2] = 0
    return keep


@pytest.mark.parametrize("mask", ATTN_MASKS)
@pytest.mark.parametrize("variant", ["plain", "unidirectional", "qkv_sizes", "scale_filter", "attention_bias"])
def test_attention(mask, variant):
    b, s, k_in, heads = 2, 5, 12, 2
    sizes = [8, 8, 12] if variant == "qkv_sizes" else [8, 8, 8]
    attrs = {"num_heads": heads}
    if variant == "unidirectional":
        attrs["unidirectional"] = 1
    if variant == "qkv_sizes":
        attrs["qkv_hidden_sizes"] = sizes
    if variant == "scale_filter":
        attrs.update(scale=0.3, mask_filter_value=-1e9)
    inputs = {"x": [b, s, k_in]}
    names = ["x", "w", "bias"]
    feed = {"x": randn(b, s, k_in)}
    if mask != "none":
        value = attention_mask(mask, b, s, s)
        inputs["i32_mask"] = list(value.shape)
        feed["i32_mask"] = value
        names.append("i32_mask")
    if variant == "attention_bias":
        names += [""] * (4 - len(names)) + ["", "ab"]
        inputs["ab"] = [1, heads, s, s]
        feed["ab"] = randn(1, heads, s, s)
    m = contrib_model("Attention", inputs, [("w", randn(k_in, sum(sizes)) * 0.5), ("bias", randn(sum(sizes)))],
                      names=names, **attrs)
    sym, _, _, _ = check_contrib(m, feed)
    assert ops(sym)["FullyConnected"] == 3 and ops(sym)["softmax"] == 1


@pytest.mark.parametrize("what, attrs, extra", [
    ("past", {}, "past"),
    ("present", {}, "present"),
    ("rotary", {"do_rotary": 1}, "do_rotary"),
    ("mask4d", {}, "mask"),
])
def test_attention_refusals(what, attrs, extra):
    b, s = 2, 4
    inputs = {"x": [b, s, 8]}
    names = ["x", "w", "bias"]
    n_out = 1
    if what == "past":
        inputs["past"] = [2, b, 2, 3, 4]
        names += ["", "past"]
    if what == "present":
        n_out = 2
    if what == "mask4d":
        inputs["i32_mask"] = [b, 1, s, s]
        names.append("i32_mask")
    m = contrib_model("Attention", inputs, [("w", randn(8, 24)), ("bias", randn(24))], names=names, n_out=n_out,
                      num_heads=2, **attrs)
    with pytest.raises(GraphError) as e:
        import_onnx(m)
    msg = one_line(e)
    assert "/the/Attention" in msg and extra in msg


@pytest.mark.parametrize("mask", ["none", "lengths", "raw2d", "raw3d", "raw_first_masked"])
@pytest.mark.parametrize("variant", ["self", "cross", "no_bias", "attention_bias", "unidirectional"])
def test_multi_head_attention(mask, variant):
    b, sq, heads = 2, 5, 2
    sk = 7 if variant == "cross" else sq
    inputs = {"q": [b, sq, 8], "k": [b, sk, 8], "v": [b, sk, 12]}
    feed = {n: randn(*s) for n, s in inputs.items()}
    names = ["q", "k", "v", "" if variant == "no_bias" else "bias"]
    inits = [] if variant == "no_bias" else [("bias", randn(28))]
    if mask != "none":
        value = attention_mask(mask, b, sq, sk)
        inputs["i32_mask"] = list(value.shape)
        feed["i32_mask"] = value
        names.append("i32_mask")
    if variant == "attention_bias":
        names += [""] * (5 - len(names)) + ["ab"]
        inputs["ab"] = [b, 1, sq, sk]
        feed["ab"] = randn(b, 1, sq, sk)
    attrs = {"num_heads": heads}
    if variant == "unidirectional":
        attrs["unidirectional"] = 1
    while names[-1] == "":
        names.pop()
    m = contrib_model("MultiHeadAttention", inputs, inits, names=names, **attrs)
    check_contrib(m, feed)


def test_multi_head_attention_refuses_packed_qkv():
    m = contrib_model("MultiHeadAttention", {"qkv": [2, 4, 2, 3, 4]}, names=["qkv"], num_heads=2)
    with pytest.raises(GraphError) as e:
        import_onnx(m)
    assert "/the/MultiHeadAttention" in one_line(e) and "packed" in str(e.value)


# ---------------------------------------------------------------------------------------------
# files optimized by ONNX Runtime's transformers optimizer
# ---------------------------------------------------------------------------------------------

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def ort_optimized(src, dst, options):
    """onnxruntime.transformers.optimizer.optimize_model with the fusion options API (no symbolic shape
    inference: it needs sympy, which the pinned environment does not have)."""
    optimizer = pytest.importorskip("onnxruntime.transformers.optimizer")
    from onnxruntime.transformers.fusion_options import FusionOptions

    opts = FusionOptions("bert")
    opts.enable_shape_inference = False
    if options in ("raw_mask", "mha_raw_mask"):
        opts.use_raw_attention_mask(True)
    if options.startswith("mha"):
        opts.use_multi_head_attention = True
    if options == "fast_gelu":
        opts.enable_gelu_approximation = True
    model = optimizer.optimize_model(src, model_type="bert", num_heads=4, hidden_size=32, opt_level=0,
                                     optimization_options=opts, use_gpu=False)
    model.save_model_to_file(dst)
    return onnx.load(dst)


@pytest.mark.parametrize("options, contrib", [
    ("default", {"Attention", "SkipLayerNormalization", "BiasGelu"}),
    ("raw_mask", {"Attention", "SkipLayerNormalization", "BiasGelu"}),
    ("fast_gelu", {"Attention", "SkipLayerNormalization", "FastGelu"}),
    ("mha", {"MultiHeadAttention", "SkipLayerNormalization", "BiasGelu"}),
    ("mha_raw_mask", {"MultiHeadAttention", "SkipLayerNormalization", "BiasGelu"}),
])
def test_ort_optimized_tiny_bert(options, contrib, tmp_path):
    """The torch-exported tiny BERT layer, optimized by ORT into contrib ops, imported: it matches ORT
    on the original file (right-padded masks: ORT's mask_index of lengths assumes right padding), and
    fuses into our ops."""
    src = os.path.join(DATA, "torch_tiny_bert.onnx")
    optimized = ort_optimized(src, str(tmp_path / "opt.onnx"), options)
    found = {n.op_type for n in optimized.graph.node if n.domain == MS}
    assert found == contrib, found
    shapes = {"hidden_states": (2, 8, 32), "attention_mask": (2, 8)}
    keep = np.zeros((2, 8), np.int64)
    keep[0, :8], keep[1, :5] = 1, 1
    feed = {"hidden_states": randn(2, 8, 32), "attention_mask": keep}
    reference = ort_run(src, feed)
    approx = options == "fast_gelu"      # the tanh GELU for the file's erf GELU (2.4e-5 apart in ORT itself)
    mx_feed = {k: v.astype(np.float32) for k, v in feed.items()}
    sym, arg, aux = import_onnx(str(tmp_path / "opt.onnx"), input_shapes=shapes)
    imported = compare(reference, run(sym, arg, aux, mx_feed), ["y"])
    assert imported.max_rel <= RTOL, imported
    if approx:                           # and against ORT running the optimized file itself
        assert compare(ort_run(str(tmp_path / "opt.onnx"), feed), run(sym, arg, aux, mx_feed),
                       ["y"]).max_rel <= RTOL
        reference = ort_run(str(tmp_path / "opt.onnx"), feed)
    fused = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    result = compare(reference, run(fused.symbol, fused.arg_params, fused.aux_params, mx_feed), ["y"])
    assert result.max_rel <= RTOL, (result, fused.report.to_text())
    counts = ops(fused)
    qkv = len(fused.report.rules["qkv_projection"].fused)    # query/key/value as one product where separate
    assert counts.get("fused_dense", 0) + 2 * qkv == 6 and counts.get("fused_add_layer_norm", 0) == 2 \
        and counts.get("fused_attention", 0) == 1, \
        fused.report.to_text(explain=True)
    print("%s: imported rel err %.2e, fused %.2e, fused ops %s" % (options, imported.max_rel, result.max_rel,
                                                                  counts))
    # the file's symbolic batch and sequence stay free: the same symbols run at (3, 6)
    keep = np.ones((3, 6), np.int64)
    keep[1, 4:], keep[2, 1:] = 0, 0
    feed = {"hidden_states": randn(3, 6, 32), "attention_mask": keep}
    reference = ort_run(str(tmp_path / "opt.onnx") if approx else src, feed)
    mx_feed = {k: v.astype(np.float32) for k, v in feed.items()}
    for s, a, x in ((sym, arg, aux), (fused.symbol, fused.arg_params, fused.aux_params)):
        other = compare(reference, run(s, a, x, mx_feed), ["y"])
        assert other.max_rel <= RTOL, other


# ---------------------------------------------------------------------------------------------
# opsets 13-21
# ---------------------------------------------------------------------------------------------

def versioned_model(opset):
    """Ops whose spelling changed between 13 and 21, each in the form of ``opset``."""
    nodes, inits = [], []

    def init(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(op, ins, n_out=1, **attrs):
        outs = ["%s_%d_%d" % (op, len(nodes), i) for i in range(n_out)]
        nodes.append(helper.make_node(op, ins, outs, name="/%s_%d" % (op, len(nodes)), **attrs))
        return outs[0] if n_out == 1 else outs

    x = "x"                                                          # (2, 6, 8)
    if opset >= 18:
        mean = node("ReduceMean", [x, init("axes", np.array([-1], np.int64))], keepdims=1)
        parts = node("Split", [x], 2, axis=1, num_outputs=2)
    else:
        mean = node("ReduceMean", [x], axes=[-1], keepdims=1)
        parts = node("Split", [x, init("split", np.array([3, 3], np.int64))], 2, axis=1)
    y = node("Add", [node("Sub", [x, mean]), node("Concat", [parts[1], parts[0]], axis=1)])
    if opset >= 17:
        y = node("LayerNormalization", [y, init("g", rng.uniform(0.5, 1.5, 8).astype(np.float32)),
                                        init("b", randn(8))], axis=-1, epsilon=1e-5)
    if opset >= 20:
        y = node("Gelu", [y], approximate="tanh")
    else:
        y = node("Tanh", [y])
    shape_kw = {"start": -2} if opset >= 15 else {}
    tail = node("Shape", [y], **shape_kw)                             # [6, 8] (or [2, 6, 8])
    target = node("Concat", [init("lead", np.array([-1], np.int64)),
                             node("Slice", [tail, init("s0", np.array([-1], np.int64)),
                                            init("s1", np.array([100], np.int64))])], axis=0)
    reshape_kw = {"allowzero": 1} if opset >= 14 else {}
    y = node("Reshape", [y, target], **reshape_kw)                   # (12, 8)
    y = node("Flatten", [node("Unsqueeze", [y, init("ax", np.array([0], np.int64))])], axis=-1)
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6, 8])],
                          [helper.make_tensor_value_info(y, TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8 if opset <= 19 else 9 if opset == 20 else 10
    return m


@pytest.mark.parametrize("opset", list(range(13, 22)))
def test_opsets_13_to_21(opset):
    check_vs_ort(versioned_model(opset), {"x": randn(2, 6, 8)}, shapes={"x": (2, 6, 8)})


@pytest.mark.parametrize("opset", [11, 12, 22])
def test_opset_outside_range_is_refused(opset):
    m = versioned_model(13)
    m.opset_import[0].version = opset
    with pytest.raises(GraphError) as e:
        import_onnx(m, input_shapes={"x": (2, 6, 8)})
    msg = one_line(e)
    assert ("opset %d" % opset) in msg and "13-21" in msg


@pytest.mark.parametrize("noop", [0, 1])
def test_reduce_with_empty_axes_input(noop):
    """Opset 18: an empty axes input reduces over everything, or (noop_with_empty_axes) nothing."""
    m = single_op_model("ReduceSum", {"x": [2, 3]}, [("axes", np.zeros(0, np.int64))], opset=18,
                        noop_with_empty_axes=noop, keepdims=1)
    m.graph.node.append(helper.make_node("Relu", ["y"], ["z"]))
    m.graph.output[0].name = "z"
    check_vs_ort(m, {"x": randn(2, 3)})


@pytest.mark.parametrize("segments, mask, position_ids", [
    (True, True, None), (False, False, None), (True, False, "batch"), (True, True, "shared"),
])
def test_embed_layer_normalization(segments, mask, position_ids):
    b, s, hidden = 2, 6, 16
    inits = [("word", randn(30, hidden)), ("pos", randn(10, hidden)), ("gamma", rng.uniform(0.5, 1.5, hidden)
                                                                       .astype(np.float32)), ("beta", randn(hidden))]
    inputs = {"i32_ids": [b, s]}
    feed = {"i32_ids": rng.integers(0, 30, (b, s)).astype(np.int32)}
    names = ["i32_ids", "", "word", "pos", "", "gamma", "beta"]
    if segments:
        inits.append(("seg", randn(2, hidden)))
        inputs["i32_seg"] = [b, s]
        feed["i32_seg"] = rng.integers(0, 2, (b, s)).astype(np.int32)
        names[1], names[4] = "i32_seg", "seg"
    if mask:
        keep = np.ones((b, s), np.int32)
        keep[1, 4:] = 0
        inputs["i32_mask"] = [b, s]
        feed["i32_mask"] = keep
    names.append("i32_mask" if mask else "")
    if position_ids:
        shape = (b, s) if position_ids == "batch" else (1, s)
        inputs["i32_positions"] = list(shape)
        feed["i32_positions"] = rng.integers(0, 10, shape).astype(np.int32)
        names.append("i32_positions")
    while names[-1] == "":
        names.pop()
    m = contrib_model("EmbedLayerNormalization", inputs, inits, names=names, n_out=3, epsilon=1e-5)
    m.graph.output[1].type.tensor_type.elem_type = TensorProto.INT32
    reference = ort_run(m, feed)
    sym, arg, aux = import_onnx(m)
    got = run(sym, arg, aux, {k: v.astype(np.float32) for k, v in feed.items()})
    result = compare([reference[0], reference[2]], [got[0], got[2]], ["y", "sum"])
    assert result.max_rel <= RTOL, result
    np.testing.assert_array_equal(reference[1], got[1])
    assert ops(sym)["LayerNorm"] == 1


def test_unsupported_contrib_op_names_domain_and_node():
    m = contrib_model("SkipSimplifiedLayerNormalization", {"x": [2, 5, 16], "skip": [2, 5, 16]},
                      [("gamma", np.ones(16, np.float32))])
    with pytest.raises(GraphError) as e:
        import_onnx(m)
    msg = one_line(e)
    assert "SkipSimplifiedLayerNormalization" in msg and "com.microsoft" in msg and "/the/" in msg


def tiny_bert_with_embeddings(path):
    """tests/data/torch_tiny_bert.onnx behind BERT's embeddings (word + token type + position, sliced
    from a position-id buffer by the sequence length, LayerNormalization), as HF exports write them."""
    m = onnx.load(os.path.join(DATA, "torch_tiny_bert.onnx"))
    g, r, hidden = m.graph, np.random.default_rng(7), 32
    inits = [("word_emb", r.normal(0, 1, (50, hidden))), ("pos_emb", r.normal(0, 1, (16, hidden))),
             ("type_emb", r.normal(0, 1, (2, hidden))), ("emb_ln_g", r.uniform(0.5, 1.5, hidden)),
             ("emb_ln_b", r.normal(0, 0.1, hidden))]
    inits = [numpy_helper.from_array(v.astype(np.float32), n) for n, v in inits]
    inits += [numpy_helper.from_array(v, n) for n, v in (
        ("position_ids_buf", np.arange(16, dtype=np.int64).reshape(1, 16)), ("e_zero", np.array([0], np.int64)),
        ("e_one", np.array([1], np.int64)), ("e_one_s", np.array(1, np.int64)))]
    mk = helper.make_node
    nodes = [mk("Shape", ["input_ids"], ["ids_shape"]), mk("Gather", ["ids_shape", "e_one_s"], ["seq_len"], axis=0),
             mk("Unsqueeze", ["seq_len", "e_zero"], ["seq_len1"]),
             mk("Slice", ["position_ids_buf", "e_zero", "seq_len1", "e_one"], ["position_ids"]),
             mk("Gather", ["word_emb", "input_ids"], ["w_e"]), mk("Gather", ["pos_emb", "position_ids"], ["p_e"]),
             mk("Gather", ["type_emb", "token_type_ids"], ["t_e"]), mk("Add", ["w_e", "t_e"], ["wt"]),
             mk("Add", ["wt", "p_e"], ["wtp"]),
             mk("LayerNormalization", ["wtp", "emb_ln_g", "emb_ln_b"], ["hidden_states"], axis=-1, epsilon=1e-12)]
    others = [i for i in g.input if i.name != "hidden_states"]
    del g.input[:]
    g.input.extend([helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"])
                    for n in ("input_ids", "token_type_ids")] + others)
    body = nodes + list(g.node)
    del g.node[:]
    g.node.extend(body)
    g.initializer.extend(inits)
    onnx.checker.check_model(m)
    onnx.save(m, path)


def test_ort_optimized_bert_with_embeddings(tmp_path):
    """EmbedLayerNormalization (its mask_index feeding Attention) from ORT's optimizer, imported and fused."""
    src = str(tmp_path / "emb.onnx")
    tiny_bert_with_embeddings(src)
    optimized = ort_optimized(src, str(tmp_path / "opt.onnx"), "default")
    found = {n.op_type for n in optimized.graph.node if n.domain == MS}
    assert found == {"EmbedLayerNormalization", "Attention", "SkipLayerNormalization", "BiasGelu"}, found
    for batch, seq, valid in ((2, 8, 5), (3, 6, 2)):
        keep = np.ones((batch, seq), np.int64)
        keep[1, valid:] = 0
        feed = {"input_ids": rng.integers(0, 50, (batch, seq)), "token_type_ids": rng.integers(0, 2, (batch, seq)),
                "attention_mask": keep}
        mx_feed = {k: v.astype(np.float32) for k, v in feed.items()}
        reference = ort_run(src, feed)
        if batch == 2:
            shapes = {k: v.shape for k, v in feed.items()}
            sym, arg, aux = import_onnx(str(tmp_path / "opt.onnx"), input_shapes=shapes)
            fused = fusion.fuse(sym, arg, aux, input_shapes=shapes)
            counts = ops(fused)
            assert counts["fused_add_layer_norm"] == 3 and counts["fused_dense"] == 6 \
                and counts["fused_attention"] == 1, fused.report.to_text(explain=True)
        for s, a, x in ((sym, arg, aux), (fused.symbol, fused.arg_params, fused.aux_params)):
            result = compare(reference, run(s, a, x, mx_feed), ["y"])
            assert result.max_rel <= RTOL, result


@pytest.mark.parametrize("sq, sk", [(5, 7), (7, 5)])
def test_causal_cross_attention_is_refused(sq, sk):
    inputs = {"q": [2, sq, 8], "k": [2, sk, 8], "v": [2, sk, 8]}
    m = contrib_model("MultiHeadAttention", inputs, names=["q", "k", "v"], num_heads=2, unidirectional=1)
    with pytest.raises(GraphError) as e:
        import_onnx(m)
    msg = one_line(e)
    assert "/the/MultiHeadAttention" in msg and "unidirectional" in msg


@pytest.mark.parametrize("op", ["Attention", "MultiHeadAttention"])
@pytest.mark.parametrize("kind", ["raw_all_masked", "length_zero", "raw3d_row_masked", "raw_other_values"])
@pytest.mark.parametrize("fill", [None, -1e9, -3.0])
def test_attention_masked_rows_and_fill_values(op, kind, fill):
    """Rows with every key masked, a mask_filter_value that does not drown the scores, mask values
    other than 0/1 (ORT keeps a key where the raw mask is > 0)."""
    b, s = 2, 5
    if kind == "raw_all_masked":
        mask = np.ones((b, s), np.int32)
        mask[1] = 0
    elif kind == "length_zero":
        mask = np.array([5, 0], np.int32)
    elif kind == "raw3d_row_masked":
        mask = np.ones((b, s, s), np.int32)
        mask[1, 2] = 0
    else:
        mask = np.array([[2, 1, -1, 0, 3], [1, -2, 5, 1, 0]], np.int32)
    attrs = {"num_heads": 2} if fill is None else {"num_heads": 2, "mask_filter_value": fill}
    if op == "Attention":
        m = contrib_model(op, {"x": [b, s, 12], "i32_mask": list(mask.shape)},
                          [("w", randn(12, 24)), ("bias", randn(24))], names=["x", "w", "bias", "i32_mask"], **attrs)
        feed = {"x": randn(b, s, 12), "i32_mask": mask}
    else:
        inputs = {"q": [b, s, 8], "k": [b, s, 8], "v": [b, s, 8], "i32_mask": list(mask.shape)}
        m = contrib_model(op, inputs, names=["q", "k", "v", "", "i32_mask"], **attrs)
        feed = {**{n: randn(b, s, 8) for n in "qkv"}, "i32_mask": mask}
    check_contrib(m, feed)


def test_constants_are_not_confused_by_name():
    """x - c read as x + (-c) must not hand -c to a later reader of c; Max(x, c1, c2) must not read c1
    twice (constants are cached by their ONNX name)."""
    c, c1, c2 = randn(2, 4), randn(2, 4), randn(2, 4)
    nodes = [helper.make_node("Sub", ["x", "c"], ["d"]), helper.make_node("Mul", ["d", "c"], ["e"]),
             helper.make_node("Max", ["e", "c1", "c2"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(v, n) for n, v in (("c", c), ("c1", c1), ("c2", c2))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    check_vs_ort(m, {"x": randn(2, 4)})


def test_ort_optimized_mxnet_export(tmp_path, monkeypatch):
    """ORT's optimizer on MXNet's export: it only finds the GELU (com.microsoft Gelu) among MXNet's
    Flatten/Gemm/Reshape; the result still imports into the whole fused layer."""
    shapes = {"data": (2, 8, 32), "mask": (8, 1, 8)}
    sym = mx_bert_block()
    src = str(tmp_path / "bert.onnx")
    mx_export(sym, mx_params(sym, shapes), shapes, src, 13, monkeypatch)
    optimized = ort_optimized(src, str(tmp_path / "opt.onnx"), "default")
    assert {n.op_type for n in optimized.graph.node if n.domain == MS} == {"Gelu"}
    feed = {"data": randn(2, 8, 32), "mask": np.where(rng.random((8, 1, 8)) > 0.3, 0, -10000).astype(np.float32)}
    reference = ort_run(src, feed)
    sym, arg, aux = import_onnx(str(tmp_path / "opt.onnx"), input_shapes=shapes)
    fused = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    for s, a, x in ((sym, arg, aux), (fused.symbol, fused.arg_params, fused.aux_params)):
        result = compare(reference, run(s, a, x, feed), ["y"])
        assert result.max_rel <= RTOL, result
    assert ops(fused) == {"fused_dense": 4, "fused_attention": 1, "fused_add_layer_norm": 2}, \
        fused.report.to_text(explain=True)


@pytest.mark.parametrize("op", ["Attention", "MultiHeadAttention"])
def test_causal_attention_runs_at_other_lengths(op):
    """unidirectional=1, imported at S=5, runs at S=7 (the band is built from positions, not a constant)."""
    def model_and_feed(s):
        if op == "Attention":
            m = contrib_model(op, {"x": ["B", "S", 12]}, [("w", w), ("bias", bias)], names=["x", "w", "bias"],
                              num_heads=2, unidirectional=1)
            return m, {"x": randn(2, s, 12)}
        m = contrib_model(op, {n: ["B", "S", 8] for n in "qkv"}, names=list("qkv"), num_heads=2, unidirectional=1)
        return m, {n: randn(2, s, 8) for n in "qkv"}

    w, bias = randn(12, 24), randn(24)
    m, feed = model_and_feed(5)
    shapes = {k: v.shape for k, v in feed.items()}
    sym, arg, aux = import_onnx(m, input_shapes=shapes)
    fused = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    assert ops(fused).get("fused_attention", 0) == 1, fused.report.to_text(explain=True)
    for s in (5, 7):
        _, feed = model_and_feed(s)
        for graph in ((sym, arg, aux), (fused.symbol, fused.arg_params, fused.aux_params)):
            result = compare(ort_run(m, feed), run(*graph, feed), ["y"])
            assert result.max_rel <= RTOL, result
