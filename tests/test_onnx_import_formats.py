"""ONNX import of the files people have: single ops at every legal attribute (against ONNX Runtime),
files written by MXNet's own exporter (mx.onnx.export_model), files optimized by ONNX Runtime's
transformers optimizer (com.microsoft contrib ops), and the opset range.  Tolerance as everywhere:
max|err| / max|ref| <= 1e-4 (RTOL)."""
import numpy as np
import pytest

from conftest import RTOL, ops

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import fusion  # noqa: E402
from fusion.errors import GraphError  # noqa: E402
from fusion.onnx_io import import_onnx  # noqa: E402
from fusion.verify import compare, run  # noqa: E402


def ort_run(model_or_path, feed):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    src = model_or_path if isinstance(model_or_path, str) else model_or_path.SerializeToString()
    sess = ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: feed[i.name] for i in sess.get_inputs()})


def one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg and msg
    return msg


def single_op_model(op_type, inputs, inits=(), opset=13, out_rank=None, domain="", n_out=1, **attrs):
    """One node reading graph inputs ``inputs`` ({name: shape}) and initializers ``inits`` ({name: array})."""
    init_names = [n for n, _ in inits]
    names = list(inputs) + init_names if not attrs.pop("order", None) else attrs.pop("names")
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
