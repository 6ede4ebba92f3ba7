"""Graph IR: lossless Symbol JSON round trips, typed attributes, structural validation."""
import json

import mxnet as mx
import pytest

import fusion
from fusion.ir.attrs import Attrs, format_value, parse_value
from fusion.ir.errors import GraphError
from fusion.ir.graph import Graph


def _roundtrip(sym):
    return Graph.from_symbol(sym).to_symbol().tojson()


@pytest.mark.parametrize("text,value", [
    ("True", True), ("false", False), ("None", None), ("4", 4), ("-1", -1), ("1e-05", 1e-5),
    ("0.001", 0.001), ("(3, 3)", (3, 3)), ("[1, 2]", (1, 2)), ("(1,)", (1,)), ("()", ()),
    ("relu", "relu"), ("(None, 2)", (None, 2)), ("-inf", float("-inf")),
])
def test_parse_value(text, value):
    assert parse_value(text) == value


@pytest.mark.parametrize("value,text", [
    (True, "True"), (False, "False"), (None, "None"), (4, "4"), (1e-5, "1e-05"), (0.125, "0.125"),
    ((3, 3), "(3, 3)"), ((1,), "(1,)"), ("relu", "relu"), (2.0, "2"),
])
def test_format_value_is_mxnet_spelling(value, text):
    assert format_value(value) == text


def test_attrs_keep_untouched_strings_and_format_new_ones():
    a = Attrs({"kernel": "(3,3)", "eps": "1e-05"})
    assert a["kernel"] == (3, 3) and a["eps"] == 1e-5
    a["no_bias"] = False
    assert a.to_json() == {"kernel": "(3,3)", "eps": "1e-05", "no_bias": "False"}


def test_roundtrip_identical_for_multi_output_and_multi_head():
    x = mx.sym.var("data")
    c = mx.sym.Convolution(x, num_filter=4, kernel=(3, 3), no_bias=True, name="c")
    bn = mx.sym.BatchNorm(c, name="bn", output_mean_var=True)
    s = mx.sym.split(bn[0], num_outputs=2, axis=1, name="split")
    sym = mx.sym.Group([s[0] + 1, s[1], bn[1], mx.sym.softmax(x, axis=1)])
    assert _roundtrip(sym) == sym.tojson()
    d = Graph.from_symbol(sym).to_json()
    assert d["node_row_ptr"] == json.loads(sym.tojson())["node_row_ptr"]


def test_roundtrip_zoo_model_with_nothing_to_fuse_is_identical():
    from mxnet.gluon.model_zoo import vision
    net = vision.get_model("squeezenet1.0")
    net.hybridize()
    net.initialize()
    net(mx.nd.zeros((1, 3, 224, 224)))
    sym = net._cached_graph[1]
    assert _roundtrip(sym) == sym.tojson()
    # squeezenet has no BatchNorm and its conv activations stay with oneDNN: in training mode
    # (Dropout kept) nothing applies and fuse() gives the graph back exactly as it was
    assert fusion.fuse(sym, mode="training").symbol.tojson() == sym.tojson()
    # at inference only its Dropout goes
    res = fusion.fuse(sym)
    assert {n: len(r.fused) for n, r in res.report.rules.items() if r.fused} == {"dropout": 1}


def test_extra_node_keys_survive(tmp_path):
    d = json.loads(mx.sym.Activation(mx.sym.var("x"), act_type="relu", name="r").tojson())
    d["nodes"][1]["control_deps"] = []
    assert Graph.from_json(d).to_json()["nodes"][1]["control_deps"] == []


def test_legacy_attr_key_is_read():
    d = json.loads(mx.sym.Activation(mx.sym.var("x"), act_type="relu", name="r").tojson())
    d["nodes"][1]["attr"] = d["nodes"][1].pop("attrs")
    g = Graph.from_json(d)
    assert g.nodes[1].attrs["act_type"] == "relu"


def test_nodes_out_of_order_are_sorted():
    d = json.loads((mx.sym.var("x") * 2).tojson())
    nodes = d["nodes"]
    d["nodes"] = [nodes[1], nodes[0]]
    d["nodes"][0]["inputs"] = [[1, 0, 0]]
    d["heads"] = [[0, 0, 0]]
    g = Graph.from_json(d)
    assert [n.op for n in g.nodes] == ["null", "_mul_scalar"]
    assert g.to_symbol().list_arguments() == ["x"]


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d["nodes"][1].__setitem__("inputs", [[99, 0, 0]]), "points to node 99, past the node list"),
    (lambda d: d["nodes"][1].__setitem__("inputs", [["a", 0]]), "is malformed"),
    (lambda d: d.pop("nodes"), "not an MXNet Symbol JSON"),
    (lambda d: d.__setitem__("heads", []), "no heads"),
    (lambda d: d["nodes"][0].__setitem__("inputs", [[1, 0, 0]]), "cycle"),
    (lambda d: d["nodes"][1].pop("op"), "needs string 'op'"),
])
def test_malformed_graphs_raise_one_line_errors(mutate, message):
    d = json.loads(mx.sym.Activation(mx.sym.var("x"), act_type="relu", name="r").tojson())
    mutate(d)
    with pytest.raises(GraphError, match=message) as e:
        Graph.from_json(d)
    assert "\n" not in str(e.value)


def test_not_json():
    with pytest.raises(GraphError, match="not valid JSON"):
        Graph.from_json('{"nodes": [')
    with pytest.raises(GraphError, match="empty"):
        Graph.from_json("   ")


def test_unknown_op_detected():
    d = json.loads(mx.sym.Activation(mx.sym.var("x"), act_type="relu", name="r").tojson())
    d["nodes"][1]["op"] = "NoSuchOp"
    assert Graph.from_json(d).unknown_ops() == ["NoSuchOp"]
