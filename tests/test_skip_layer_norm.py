"""skip_layer_norm (patterns/skip_layer_norm.py): residual add + LayerNorm → fused_add_layer_norm."""
import mxnet as mx
import pytest

import fusion

from conftest import fuse_and_check, ops, random_params

S = mx.sym


def ln(s, name="ln"):
    return S.LayerNorm(s, S.var(name + "_gamma"), S.var(name + "_beta"), name=name)


@pytest.mark.parametrize("add", [S.elemwise_add, S.broadcast_add, lambda a, b: b + a])
def test_add_layer_norm(add):
    y = ln(add(S.var("a"), S.var("b")))
    res = fuse_and_check(y, {"a": (3, 4, 16), "b": (3, 4, 16)}, rules=["skip_layer_norm"])
    assert ops(res) == {"fused_add_layer_norm": 1}


def test_broadcast_residual_with_shapes():
    y = ln(S.broadcast_add(S.var("b"), S.var("a")))        # b (1, 4, 16) broadcasts over a's batch
    shapes = {"a": (3, 4, 16), "b": (1, 4, 16)}
    arg, aux = random_params(y, shapes)
    res = fusion.fuse(y, arg, aux, rules=["skip_layer_norm"], input_shapes=shapes)
    assert ops(res) == {"fused_add_layer_norm": 1}
    assert fusion.verify(y, res, (arg, aux), shapes).max_rel <= 1e-5
    unknown = fusion.fuse(y, arg, aux, rules=["skip_layer_norm"])
    assert "shapes of the broadcast add are unknown" in list(unknown.report.rules["skip_layer_norm"].rejected.values())[0]


def test_sum_reused_as_residual_comes_out_of_the_op():
    s = S.var("a") + S.var("b")
    h = ln(s)
    y = S.Group([S.FullyConnected(h, num_hidden=16, flatten=False, name="f") + s])     # pre-LN residual stream
    res = fuse_and_check(y, {"a": (2, 3, 16), "b": (2, 3, 16)}, rules=["skip_layer_norm"])
    assert ops(res) == {"fused_add_layer_norm": 1, "FullyConnected": 1, "elemwise_add": 1}
    node = [n for n in res.graph.op_nodes() if n.op == "fused_add_layer_norm"][0]
    assert node.attrs["output_sum"] is True


def test_layer_norm_not_on_last_axis_refused():
    y = S.LayerNorm(S.var("a") + S.var("b"), S.var("g"), S.var("be"), axis=1, name="ln")
    res = fusion.fuse(y, rules=["skip_layer_norm"])
    assert res.report.fused_count == 0
    assert "axis=1" in list(res.report.rules["skip_layer_norm"].rejected.values())[0]
