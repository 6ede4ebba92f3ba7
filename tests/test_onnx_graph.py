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
from fusion.onnx.graph import Const, GraphView, Init, Input, Op, Sum, Var, match, match_sum, matches  # noqa: E402

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


def test_repeated_pattern_matches_any_number_of_ops_none_included():
    pat = Op("Neg", Op("Identity", Op("Abs", Var("x"), name="abs"), repeat=True), name="neg")
    for k in range(3):
        nodes = [helper.make_node("Abs", ["x"], ["v0"])]
        nodes += [helper.make_node("Identity", ["v%d" % i], ["v%d" % (i + 1)]) for i in range(k)]
        nodes.append(helper.make_node("Neg", ["v%d" % k], ["y"]))
        view = GraphView.of(model_of(nodes, [("x", [2])], [("y", [2])]))
        m = match(view, pat, view.nodes[-1])
        assert m is not None and m["x"] == "x" and m["abs"].op_type == "Abs"
    nodes = [helper.make_node("Identity", ["x"], ["i"]), helper.make_node("Neg", ["i"], ["y"])]
    view = GraphView.of(model_of(nodes, [("x", [2])], [("y", [2])]))
    assert match(view, pat, view.nodes[-1]) is None          # no Abs under the Identities
    with pytest.raises(ValueError):
        Op("Identity", Var("x"), Var("y"), repeat=True)


def _int_input_model(to_inner, to_outer, identities, second_reader=False, in_type=TensorProto.INT64):
    """Cast(Cast(ids, to_inner) [-> Identity...], to_outer), ids an integer graph input (2, 3)."""
    nodes = [helper.make_node("Cast", ["ids"], ["f"], to=to_inner)]
    prev = "f"
    for i in range(identities):
        nodes.append(helper.make_node("Identity", [prev], ["i%d" % i]))
        prev = "i%d" % i
    nodes.append(helper.make_node("Cast", [prev], ["y"], to=to_outer))
    outputs = [helper.make_tensor_value_info("y", to_outer, [2, 3])]
    if second_reader:
        nodes.append(helper.make_node("Neg", ["f"], ["z"]))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", in_type, [2, 3])], outputs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("identities", [0, 1, 3])
@pytest.mark.parametrize("outer", [TensorProto.INT64, TensorProto.INT32])
def test_cast_round_trip_of_an_integer_input(identities, outer):
    m = _int_input_model(TensorProto.FLOAT, outer, identities, second_reader=identities == 1)

    def peephole(nodes, inits, outputs):
        return onnx_passes.peephole(nodes, inits, {"ids": TensorProto.INT64}, frozenset(outputs))
    after = _list_pass(m, peephole)
    last = [n for n in after.graph.node if n.output[0] == "y"][0]
    assert list(last.input) == ["ids"] and last.op_type == ("Identity" if outer == TensorProto.INT64 else "Cast")
    feed = {"ids": np.array([[0, 5, 7], [30521, 2, 1]], np.int64)}
    for a, b in zip(run(m, feed), run(after, feed)):
        np.testing.assert_array_equal(a, b)


def test_cast_round_trip_left_alone_when_not_integer_to_integer():
    def peephole(nodes, inits, outputs):
        return onnx_passes.peephole(nodes, inits, {"ids": TensorProto.INT64}, frozenset(outputs))
    for m in (_int_input_model(TensorProto.FLOAT, TensorProto.FLOAT, 1),          # ends in float
              _int_input_model(TensorProto.FLOAT, TensorProto.INT64, 0, in_type=TensorProto.FLOAT)):
        types = {"ids": m.graph.input[0].type.tensor_type.elem_type}
        after = _list_pass(m, lambda nodes, inits, outputs: onnx_passes.peephole(nodes, inits, types,
                                                                                   frozenset(outputs)))
        assert ops(after) == ops(m)
        last = [n for n in after.graph.node if n.output[0] == "y"][0]
        assert list(last.input) != ["ids"]


def _skip_ln_model(bias_shape=(4,), add_read_twice=False, bias_first=False):
    """SkipLayerNormalization(Add(MatMul(x, W), b), skip, gamma, beta) of x (2, 3, 4)."""
    rng = np.random.default_rng(0)
    add_in = ["b", "mm"] if bias_first else ["mm", "b"]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"]), helper.make_node("Add", add_in, ["a"]),
             helper.make_node("SkipLayerNormalization", ["a", "skip", "gamma", "beta"], ["y"], domain="com.microsoft",
                              epsilon=1e-5)]
    outputs = [("y", [2, 3, 4])]
    if add_read_twice:
        nodes.append(helper.make_node("Neg", ["a"], ["z"]))
        outputs.append(("z", [2, 3, 4]))
    inits = {"W": rng.standard_normal((4, 4)).astype(np.float32), "b": rng.standard_normal(bias_shape).astype(np.float32),
             "gamma": rng.standard_normal(4).astype(np.float32), "beta": rng.standard_normal(4).astype(np.float32)}
    return model_of(nodes, [("x", [2, 3, 4]), ("skip", [2, 3, 4])], outputs, inits)


@pytest.mark.parametrize("bias_first", [False, True])
def test_matmul_bias_folded_into_skip_layer_norm(bias_first):
    m = _skip_ln_model(bias_first=bias_first)

    def peephole(nodes, inits, outputs):
        return onnx_passes.peephole(nodes, inits, {}, frozenset(outputs))
    after = _list_pass(m, peephole)
    onnx_passes.drop_dead(after)
    assert ops(after) == ["MatMul", "SkipLayerNormalization"]
    assert list(after.graph.node[1].input) == ["mm", "skip", "gamma", "beta", "b"]
    rng = np.random.default_rng(1)
    feed = {k: rng.standard_normal((2, 3, 4)).astype(np.float32) for k in ("x", "skip")}
    for a, b in zip(run(m, feed), run(after, feed)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_matmul_bias_left_alone_when_the_add_is_read_twice_or_the_bias_is_not_1d():
    def peephole(nodes, inits, outputs):
        return onnx_passes.peephole(nodes, inits, {}, frozenset(outputs))
    for m in (_skip_ln_model(add_read_twice=True), _skip_ln_model(bias_shape=(1, 4))):
        after = _list_pass(m, peephole)
        assert [list(n.input) for n in after.graph.node] == [list(n.input) for n in m.graph.node]


SUM = Sum(Op("Neg", Var("a"), name="neg"), Init("c"), optional=[Op("Abs", Var("b"), name="abs")])


@pytest.mark.parametrize("shape", ["left", "right", "flat"])
def test_sum_pattern_matches_any_tree_of_adds(shape):
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Abs", ["y"], ["ab"])]
    if shape == "left":         # (n + ab) + c
        nodes += [helper.make_node("Add", ["n", "ab"], ["s1"]), helper.make_node("Add", ["s1", "c"], ["s"])]
    elif shape == "right":      # c + (ab + n)
        nodes += [helper.make_node("Add", ["ab", "n"], ["s1"]), helper.make_node("Add", ["c", "s1"], ["s"])]
    else:                       # n + c, ab elsewhere: the optional term stays empty
        nodes += [helper.make_node("Add", ["n", "c"], ["s"]), helper.make_node("Relu", ["ab"], ["z"])]
    nodes.append(helper.make_node("Relu", ["s"], ["o"]))     # the sum's one reader
    outputs = [("o", [2])] + ([("z", [2])] if shape == "flat" else [])
    view = GraphView.of(model_of(nodes, [("x", [2]), ("y", [2])], outputs, {"c": np.ones(2, np.float32)}))
    m = match_sum(view, SUM, ["s"])
    assert m is not None and m["a"] == "x" and m.name("c") == "c"
    assert ("abs" in m) == (shape != "flat") and len(m.adds) == (1 if shape == "flat" else 2)


def test_sum_pattern_refuses_a_leaf_no_term_takes_or_a_missing_term():
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Add", ["n", "y"], ["s"])]
    view = GraphView.of(model_of(nodes, [("x", [2]), ("y", [2])], [("s", [2])]))
    assert match_sum(view, SUM, ["s"]) is None                 # y is no constant: no term takes it
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Add", ["n", "c"], ["s"]),
             helper.make_node("Add", ["s", "c"], ["t"])]
    view = GraphView.of(model_of(nodes, [("x", [2])], [("t", [2]), ("s", [2])], {"c": np.ones(2, np.float32)}))
    assert match_sum(view, SUM, ["t"]) is None                 # s is read twice: a leaf, and no term takes it


def _embedding_model(segments, order):
    """LayerNormalization(word[ids] (+ seg[types]) + P), ids (2, 5) int64, hidden 8, the Adds in ``order``."""
    rng = np.random.default_rng(0)
    inits = {"word": rng.standard_normal((30, 8)).astype(np.float32), "pos": rng.standard_normal((5, 8)).astype(np.float32),
             "gamma": rng.standard_normal(8).astype(np.float32), "beta": rng.standard_normal(8).astype(np.float32)}
    nodes = [helper.make_node("Gather", ["word", "ids"], ["w"])]
    terms = ["w", "pos"]
    if segments:
        inits["seg"] = rng.standard_normal((2, 8)).astype(np.float32)
        nodes.append(helper.make_node("Gather", ["seg", "types"], ["t"]))
        terms.append("t")
    terms = [terms[i] for i in order[:len(terms)]]
    acc = terms[0]
    for i, t in enumerate(terms[1:]):
        nodes.append(helper.make_node("Add", [t, acc] if i % 2 else [acc, t], ["sum%d" % i]))
        acc = "sum%d" % i
    nodes.append(helper.make_node("LayerNormalization", [acc, "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5))
    ids = [helper.make_tensor_value_info(n, TensorProto.INT64, [2, 5]) for n in (["ids", "types"] if segments else ["ids"])]
    g = helper.make_graph(nodes, "g", ids, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 8])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("segments,order", [(False, (0, 1)), (False, (1, 0)), (True, (0, 1, 2)), (True, (2, 1, 0)),
                                            (True, (1, 2, 0))])
def test_embedding_sum_as_embed_layer_normalization(segments, order):
    m = _embedding_model(segments, order)
    after = onnx.ModelProto()
    after.CopyFrom(m)
    after = onnx_passes.embed_layer_norm(after)
    assert "EmbedLayerNormalization" in ops(after) and "Gather" not in ops(after) and "Add" not in ops(after)
    rng = np.random.default_rng(2)
    feed = {"ids": rng.integers(0, 30, (2, 5)).astype(np.int64)}
    if segments:
        feed["types"] = rng.integers(0, 2, (2, 5)).astype(np.int64)
    np.testing.assert_allclose(run(after, feed)[0], run(m, feed)[0], rtol=1e-5, atol=1e-5)


def test_embedding_sum_left_alone_with_a_second_constant():
    m = _embedding_model(False, (0, 1))
    extra = numpy_helper.from_array(np.ones((5, 8), np.float32), "pos2")
    m.graph.initializer.append(extra)
    ln = m.graph.node[-1]
    m.graph.node.insert(len(m.graph.node) - 1, helper.make_node("Add", [ln.input[0], "pos2"], ["more"]))
    ln.input[0] = "more"
    assert "EmbedLayerNormalization" not in ops(onnx_passes.embed_layer_norm(m))
