"""The ONNX graph view and chain patterns (fusion/onnx/graph.py), and the chain passes of
fusion/onnx/passes.py on tiny graphs built inline: each rewrite run in ONNX Runtime against the graph
before it, and left alone when a value it would remove has a second reader or an operand is not
constant."""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from fusion.onnx import passes as onnx_passes  # noqa: E402
from fusion.onnx.graph import Const, GraphView, Init, Input, Op, Var, match, matches  # noqa: E402

RTOL = 1e-6


def model_of(nodes, inputs, outputs, inits=(), opset=17):
    """A model of ``nodes``; inputs/outputs are (name, shape) of float32 values (None: shape unknown)."""
    def vi(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
    g = helper.make_graph(nodes, "g", [vi(*i) for i in inputs], [vi(*o) for o in outputs],
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in dict(inits).items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 8
    return m


def run(model, feed):
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    s = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return s.run(None, feed)


def ops(model):
    return [n.op_type for n in model.graph.node]


def same_outputs(before, after, feed):
    for a, b in zip(run(before, feed), run(after, feed)):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=0)


I64 = np.int64


def slice_squeeze_model(second_reader=False, starts_input=False):
    """Squeeze(Slice(x, [1], [2], [1]), [1]) of x (2, 3, 4) [, the Slice also read by a Neg]."""
    nodes = [helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["s"]),
             helper.make_node("Squeeze", ["s", "axes"], ["y"])]
    outputs = [("y", [2, 4])]
    if second_reader:
        nodes.append(helper.make_node("Neg", ["s"], ["z"]))
        outputs.append(("z", [2, 1, 4]))
    inits = {"ends": np.array([2], I64), "axes": np.array([1], I64)}
    if not starts_input:
        inits["starts"] = np.array([1], I64)
    return model_of(nodes, [("x", [2, 3, 4])], outputs, inits)


# ---------------------------------------------------------------------------------------------
# the view
# ---------------------------------------------------------------------------------------------

def test_view_edges_constants_and_names():
    nodes = [helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array([2.0], np.float32))),
             helper.make_node("Mul", ["x", "k"], ["a"]),
             helper.make_node("Add", ["a", "a"], ["b"]),
             helper.make_node("Add", ["b", "w"], ["y"])]
    m = model_of(nodes, [("x", [2, 3])], [("y", [2, 3]), ("b", [2, 3])], {"w": np.ones((2, 3), np.float32)})
    v = GraphView.of(m)
    assert v.producer("a").op_type == "Mul" and v.producer("x") is None
    assert v.producer("a", "Mul") is not None and v.producer("a", "Add") is None
    assert v.uses("a") == 2 and [n.op_type for n in v.readers("a")] == ["Add", "Add"]   # once per input slot
    assert not v.single_reader("a")
    assert v.uses("b") == 1 and v.is_output("b") and not v.single_reader("b")        # a graph output stays
    assert v.const("k").tolist() == [2.0] and v.init("k") is None                     # a Constant node's value
    assert v.init("w").shape == (2, 3) and v.const("x") is None
    assert v.fresh("a") == "a_1" and v.fresh("new") == "new"
    name = v.add_init(np.arange(3, dtype=I64), v.fresh("w"))
    assert name == "w_1" and v.ints(name) == [0, 1, 2] and name in {t.name for t in m.graph.initializer}
    assert v.static_shapes()["a"] == [2, 3] and v.inferred_ranks()["b"] == 2


def test_view_of_a_node_list_and_shapes_unknown(monkeypatch):
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Identity", ["r"], ["y"])]
    inits = {}
    v = GraphView(nodes, inits, {"y"})
    assert v.producer("r") is nodes[0] and v.single_reader("r")
    v.add_init(np.zeros(2, np.float32), "z")
    assert "z" in inits                        # the caller's dict holds the new initializer
    m = model_of(nodes, [("x", [2, 3])], [("y", None)])

    def fails(model):
        raise onnx.shape_inference.InferenceError("no shapes")
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", fails)
    assert GraphView.of(m).static_shapes() is None    # shape inference fails: no facts
    assert GraphView.of(m).inferred_ranks() == {}


def test_view_drops_dead_nodes_and_unread_initializers():
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Add", ["x", "w"], ["dead"])]
    m = model_of(nodes, [("x", [2])], [("y", [2])], {"w": np.ones(2, np.float32), "u": np.ones(2, np.float32)})
    v = GraphView.of(m)
    v.drop_dead()
    assert ops(m) == ["Relu"] and list(m.graph.initializer) == [] and v.producer("dead") is None


# ---------------------------------------------------------------------------------------------
# chain patterns
# ---------------------------------------------------------------------------------------------

def test_chain_pattern_binds_nodes_values_and_constants():
    m = slice_squeeze_model()
    v = GraphView.of(m)
    got = match(v, onnx_passes.SLICE_SQUEEZE, m.graph.node[1])
    assert got is not None
    assert got["x"] == "x" and got["slice"].op_type == "Slice" and got["squeeze"] is m.graph.node[1]
    assert got["starts"].tolist() == [1] and got.name("starts") == "starts" and got["steps"] is None
    assert [n.op_type for n, _ in matches(v, onnx_passes.SLICE_SQUEEZE)] == ["Squeeze"]


def test_chain_pattern_refuses_an_interior_value_with_a_second_reader():
    m = slice_squeeze_model(second_reader=True)
    v = GraphView.of(m)
    assert match(v, onnx_passes.SLICE_SQUEEZE, m.graph.node[1]) is None
    shared = Op("Squeeze", Op("Slice", Var("x"), one_reader=False), Init("axes"))
    assert match(v, shared, m.graph.node[1]) is not None      # unless the pattern allows it


def test_chain_pattern_refuses_an_operand_that_is_not_constant():
    m = slice_squeeze_model(starts_input=True)
    m.graph.input.append(helper.make_tensor_value_info("starts", TensorProto.INT64, [1]))
    assert match(GraphView.of(m), onnx_passes.SLICE_SQUEEZE, m.graph.node[1]) is None
    # a Constant node is a constant, but not an initializer
    m = slice_squeeze_model(starts_input=True)
    m.graph.node.insert(0, helper.make_node("Constant", [], ["starts"],
                                            value=numpy_helper.from_array(np.array([1], I64))))
    v = GraphView.of(m)
    assert match(v, onnx_passes.SLICE_SQUEEZE, m.graph.node[2]) is None
    any_const = Op("Squeeze", Op("Slice", Var("x"), Const("starts")), Const("axes"))
    assert match(v, any_const, m.graph.node[2])["starts"].tolist() == [1]


def test_chain_pattern_predicates_commutative_optional_and_repeated_names():
    nodes = [helper.make_node("Unsqueeze", ["x", "ax"], ["u"]),
             helper.make_node("Mul", ["c", "u"], ["y"]),
             helper.make_node("Mul", ["x", "x"], ["sq"]),
             helper.make_node("Mul", ["x", "c"], ["xc"])]
    m = model_of(nodes, [("x", [2])], [("y", [1, 2]), ("sq", [2]), ("xc", [2])],
                 {"ax": np.array([0], I64), "c": np.array(3.0, np.float32)})
    v = GraphView.of(m)
    scaled = Op("Mul", Op("Unsqueeze", Input("x"), optional=True), Const("c", lambda a: a.size == 1),
                commutative=True)
    assert match(v, scaled, nodes[1])["x"] == "x"          # the constant first: the other order
    assert match(v, scaled, nodes[3])["x"] == "x"          # no Unsqueeze: the optional step skipped
    assert match(v, Op("Mul", Var("x"), Const("c", lambda a: a.size == 2), commutative=True), nodes[3]) is None
    square = Op("Mul", Var("a"), Var("a"))
    assert match(v, square, nodes[2]) is not None and match(v, square, nodes[3]) is None
    assert match(v, Op("Mul", Input("a"), Var("b"), arity=(3,)), nodes[3]) is None
    assert match(v, Op("Mul", Input("a"), Var("b"), domain="com.microsoft"), nodes[3]) is None
    assert match(v, Op(("Add", "Mul"), Input("a"), Var("b")), nodes[3]) is not None
    assert match(v, Op("Mul", Input("a"), Var("b"), where=lambda n: n.output[0] == "sq"), nodes[3]) is None


# ---------------------------------------------------------------------------------------------
# the chain passes, in ONNX Runtime
# ---------------------------------------------------------------------------------------------

def _list_pass(model, fn):
    """``fn`` (a pass over the node list while the graph is assembled) applied to a copy of ``model``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = {t.name: t for t in g.initializer}
    nodes = fn([n for n in g.node], inits, {o.name for o in g.output})
    del g.node[:]
    g.node.extend(nodes)
    del g.initializer[:]
    g.initializer.extend(inits.values())
    return out


def test_slice_squeeze_as_gather():
    m = slice_squeeze_model()
    after = _list_pass(m, onnx_passes.slice_squeeze)
    onnx_passes.drop_dead(after)
    assert ops(after) == ["Gather"]
    same_outputs(m, after, {"x": np.random.default_rng(0).normal(size=(2, 3, 4)).astype(np.float32)})
    shared = slice_squeeze_model(second_reader=True)
    assert ops(_list_pass(shared, onnx_passes.slice_squeeze)) == ["Slice", "Squeeze", "Neg"]


def _copy(m):
    out = onnx.ModelProto()
    out.CopyFrom(m)
    return out


def test_expand_into_constant():
    def build(shared):
        nodes = [helper.make_node("Mul", ["c", "x"], ["xc"]), helper.make_node("Expand", ["xc", "shape"], ["y"])]
        outputs = [("y", [2, 3, 4])]
        if shared:
            nodes.append(helper.make_node("Neg", ["xc"], ["z"]))
            outputs.append(("z", [3, 1]))
        return model_of(nodes, [("x", [3, 1])], outputs,
                        {"c": np.array(0.5, np.float32), "shape": np.array([2, 3, 4], I64)})
    m = build(False)
    after = onnx_passes.expand_into_constant(_copy(m), {"xc": [3, 1]})
    assert ops(after) == ["Mul"]
    same_outputs(m, after, {"x": np.arange(3, dtype=np.float32).reshape(3, 1)})
    assert ops(onnx_passes.expand_into_constant(build(True), {"xc": [3, 1]})) == ["Mul", "Expand", "Neg"]
    assert ops(onnx_passes.expand_into_constant(build(False), {})) == ["Mul", "Expand"]   # shape unknown


def test_fused_gemm():
    def build(shared, weight_input=False):
        nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"], transB=1),
                 helper.make_node("LeakyRelu", ["g"], ["y"], alpha=0.2)]
        outputs = [("y", [2, 4])]
        if shared:
            nodes.append(helper.make_node("Neg", ["g"], ["z"]))
            outputs.append(("z", [2, 4]))
        inits = {"b": np.arange(4, dtype=np.float32)}
        inputs = [("x", [2, 3])] + ([("w", [4, 3])] if weight_input else [])
        if not weight_input:
            inits["w"] = np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32)
        return model_of(nodes, inputs, outputs, inits)
    m = build(False)
    after = onnx_passes.fused_gemm(_copy(m))
    assert [(n.domain, n.op_type) for n in after.graph.node] == [("com.microsoft", "FusedGemm")]
    same_outputs(m, after, {"x": np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)})
    assert ops(onnx_passes.fused_gemm(build(True))) == ["Gemm", "LeakyRelu", "Neg"]
    assert ops(onnx_passes.fused_gemm(build(False, weight_input=True))) == ["Gemm", "LeakyRelu"]


def test_swap_as_reshape():
    def build(shared):
        nodes = [helper.make_node("Reshape", ["x", "s"], ["r"]), helper.make_node("Transpose", ["r"], ["y"],
                                                                                   perm=[1, 0, 2])]
        outputs = [("y", [2, 1, 4])]
        if shared:
            nodes.append(helper.make_node("Neg", ["r"], ["z"]))
            outputs.append(("z", [1, 2, 4]))
        return model_of(nodes, [("x", [8])], outputs, {"s": np.array([1, 2, 4], I64)})
    m = build(False)
    after = onnx_passes.swap_as_reshape(_copy(m))
    assert ops(after) == ["Reshape"]
    same_outputs(m, after, {"x": np.arange(8, dtype=np.float32)})
    assert ops(onnx_passes.swap_as_reshape(build(True))) == ["Reshape", "Transpose", "Neg"]


def test_unsqueeze_of_unsqueeze_as_one():
    def build(shared):
        nodes = [helper.make_node("Unsqueeze", ["x", "a0"], ["u"]), helper.make_node("Unsqueeze", ["u", "a2"], ["y"])]
        outputs = [("y", [1, 2, 1, 3])] + ([("u", [1, 2, 3])] if shared else [])
        return model_of(nodes, [("x", [2, 3])], outputs, {"a0": np.array([0], I64), "a2": np.array([2], I64)})

    def peephole(nodes, inits, outputs):
        return onnx_passes.peephole(nodes, inits, {}, frozenset(outputs))
    m = build(False)
    after = _list_pass(m, peephole)
    onnx_passes.drop_dead(after)
    assert ops(after) == ["Unsqueeze"]
    same_outputs(m, after, {"x": np.arange(6, dtype=np.float32).reshape(2, 3)})
    assert ops(_list_pass(build(True), peephole)) == ["Unsqueeze", "Unsqueeze"]     # u is a graph output
