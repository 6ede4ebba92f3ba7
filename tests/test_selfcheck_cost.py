"""The self-check at small probe sizes, on the graph's own values and on its own: what it still catches.

A rewrite that names no size is checked at a smaller copy of the input shapes (fusion/engine/facts.py
``small_probes``); one that names a size the small shapes could stand below (a gather of the
first 128 rows) is checked at the user's.  The inputs of a candidate are the values the graph
computes there, except where they could not tell a wrong rewrite (constant, not finite): drawn.
A rewrite is first checked on its own, on drawn inputs (at smaller shapes of its own where it
names no size); one that fails there is checked on the graph's values, which decide.
"""
import mxnet as mx
import numpy as np

import fusion
from fusion.ir.pattern import Var, op
from fusion.engine.rule import Rule

from test_selfcheck import ReluToSigmoid  # wrong: relu -> sigmoid

S = mx.sym


class MaxOfFirstRows(Rule):
    """Wrong above 128 rows: max(x, axis=2) → max(take(x, 0..127, axis=2, mode=clip), axis=2).

    Exact while the axis has at most 128 rows (clip repeats the last row, which leaves a maximum
    as it is); above, the rows past 127 are never read.  The rule reads no shape: only the size it
    bakes (a parameter of 128 indices) says it is not the same rewrite at every size."""
    name = "max_of_first_rows"
    benefit = 1

    def pattern(self):
        return op.max(Var("x"), name="m", axis=lambda a: tuple(a) == (2,) if isinstance(a, tuple) else a == 2)

    def check(self, m):
        return "rewritten already" if m["x"].node.op == "take" else None

    def rewrite(self, m, b):
        rows = b.param("first_rows", np.arange(128, dtype=np.float32))
        t = b.op("take", [m["x"], rows], attrs={"axis": 2, "mode": "clip"})
        return b.op("max", [t], attrs=m.node("m").attrs, name=m.anchor.name)


class ScaleByOnePercent(Rule):
    """Wrong wherever x is not 0: relu(x) → relu(x) · 1.01."""
    name = "scale_by_one_percent"
    benefit = 1

    def pattern(self):
        return op.relu(Var("x"), name="r")

    def rewrite(self, m, b):
        return b.op("_mul_scalar", [b.op("relu", [m["x"]])], attrs={"scalar": 1.01}, name=m.anchor.name)


def conv_net(head):
    x = S.var("data")
    y = S.Convolution(x, num_filter=4, kernel=(3, 3), pad=(1, 1), name="c")
    return head(y)


def params(sym, shape):
    rng = np.random.default_rng(0)
    arg_shapes, _, _ = sym.infer_shape(data=shape)
    return {n: mx.nd.array(rng.standard_normal(s)) for n, s in zip(sym.list_arguments(), arg_shapes) if n != "data"}


def test_an_error_only_above_the_small_sizes_is_caught_at_the_users():
    shape = (1, 3, 400, 6)                          # 400 rows: the small probes have 64 and 80
    sym = conv_net(lambda y: S.max(y, axis=2))
    arg = params(sym, shape)
    res = fusion.fuse(sym, arg, {}, rules=[MaxOfFirstRows()], input_shapes={"data": shape})
    assert res.report.fused_count == 0
    reason = " | ".join(res.report.rules["max_of_first_rows"].rejected.values())
    assert reason.startswith("self-check: output differs by"), reason       # at the user's 400 rows
    assert res.report.self_check.size_free == 0
    from fusion.engine.facts import small_probes
    from fusion.ir.graph import Graph
    found, smallest = small_probes(Graph.from_symbol(sym), {k: v.shape for k, v in arg.items()}, {"data": shape})
    assert smallest == 64 and all(p["data"][2] <= 128 for p, _ in found), found    # none would show it
    # the same rewrite at those sizes is right: it is exact up to 128 rows
    res = fusion.fuse(sym, arg, {}, rules=[MaxOfFirstRows()], input_shapes={"data": (1, 3, 64, 6)})
    assert res.report.fused_count == 1, res.report.to_text()


def test_a_rewrite_that_names_no_size_is_checked_at_small_shapes_and_still_refused():
    shape = (1, 3, 160, 136)
    sym = conv_net(S.relu)
    res = fusion.fuse(sym, params(sym, shape), {}, rules=[ReluToSigmoid()], input_shapes={"data": shape})
    assert res.report.fused_count == 0
    reason = " | ".join(res.report.rules["relu_to_sigmoid"].rejected.values())
    assert reason.startswith("self-check at input shapes data=1,3,64,64: output differs"), reason
    assert res.report.self_check.refused == 1


def test_right_size_free_rewrites_are_reported_as_checked_at_small_shapes():
    shape = (1, 3, 96, 80)
    x = S.var("data")
    y = S.Activation(S.BatchNorm(S.Convolution(x, num_filter=4, kernel=(3, 3), pad=(1, 1), name="c"),
                                 name="bn"), act_type="relu")
    arg_shapes, _, aux_shapes = y.infer_shape(data=shape)
    rng = np.random.default_rng(0)
    arg = {n: mx.nd.array(rng.standard_normal(s)) for n, s in zip(y.list_arguments(), arg_shapes) if n != "data"}
    aux = {n: mx.nd.array(rng.uniform(0.5, 2, s)) for n, s in zip(y.list_auxiliary_states(), aux_shapes)}
    res = fusion.fuse(y, arg, aux, input_shapes={"data": shape})
    c = res.report.self_check
    assert res.report.fused_count == 1 and c.checked == 1 and c.size_free == 1
    assert {"data": shape} not in c.probes and all(p["data"][3] <= 80 for p in c.probes), c.probes
    # on its own (nothing else of the graph run), at shapes of its own smaller than the graph's
    assert c.alone == 1 and c.alone_smaller == 1, c
    assert "1 of them on their own on drawn inputs (1 at smaller shapes: they name no size)" in res.report.to_text()


def test_a_constant_value_of_the_graph_is_drawn_instead():
    """relu(x) · 1.01 is right where x is 0: the graph computes x = 0 · conv here, a constant, which
    could not tell the wrong rewrite; the check draws that input instead and refuses it."""
    shape = (1, 3, 8, 8)
    sym = conv_net(lambda y: S.relu(y * 0.0))
    res = fusion.fuse(sym, params(sym, shape), {}, rules=[ScaleByOnePercent()], input_shapes={"data": shape})
    assert res.report.fused_count == 0
    assert "self-check: output differs" in " ".join(res.report.rules["scale_by_one_percent"].rejected.values())


# ---------------------------------------------------------------- on its own, at smaller shapes of its own

class Undilate(Rule):
    """Wrong: conv(conv(x, stride 8), 3×3, dilate 2, pad 2) → the second with dilate 1, pad 1: the same
    shapes, the same centre tap; only the other taps differ."""
    name = "undilate"
    benefit = 1

    def pattern(self):
        return op.Convolution(op.Convolution(Var("x"), Var("w1"), Var("b1"), name="c1"), Var("w2"), Var("b2"),
                              name="c2")

    def check(self, m):
        return None if tuple(m.node("c2").attrs["dilate"]) == (2, 2) else "not dilated"

    def rewrite(self, m, b):
        c1 = b.op("Convolution", [m["x"], m["w1"], m["b1"]], attrs=m.node("c1").attrs)
        attrs = dict(m.node("c2").attrs.to_json(), dilate="(1, 1)", pad="(1, 1)")
        return b.op("Convolution", [c1, m["w2"], m["b2"]], attrs=attrs, name=m.anchor.name)


def test_a_window_checked_at_smaller_shapes_still_reads_every_tap():
    """At its own smallest shapes (8×8 in, 1×1 after the stride) the dilated convolution reads its centre
    tap alone and the wrong dilation would pass: the shapes it is checked at are the smallest where every
    tap is read (as at the user's), and it is refused."""
    shape = (1, 3, 64, 64)
    x = S.var("data")
    y = S.Convolution(x, num_filter=4, kernel=(8, 8), stride=(8, 8), name="c1")
    y = S.Convolution(y, num_filter=4, kernel=(3, 3), pad=(2, 2), dilate=(2, 2), name="c2")
    res = fusion.fuse(y, params(y, shape), {}, rules=[Undilate()], input_shapes={"data": shape})
    assert res.report.fused_count == 0, res.report.to_text()
    assert "self-check" in " ".join(res.report.rules["undilate"].rejected.values())


def test_taps_read():
    from fusion.engine.selfcheck import _taps_read
    from fusion.ir.graph import Entry, Graph

    x = S.var("data")
    y = S.Convolution(x, num_filter=2, kernel=(3, 3), pad=(2, 2), dilate=(2, 2), no_bias=True, name="c")
    g = Graph.from_symbol(y)
    (c,) = [n for n in g.nodes if n.op == "Convolution"]

    def taps(h, w):
        return {t for _, t in _taps_read([c], {c.inputs[0]: (1, 3, h, w), Entry(c, 0): (1, 2, h, w)})}

    assert taps(1, 1) == {(1, 1)}                          # the centre alone
    assert taps(3, 1) == {(j, 1) for j in range(3)}        # pad 2, dilate 2: 3 rows read them all
    assert taps(2, 2) == {(1, 1)}
    assert len(taps(3, 3)) == 9


class ConcatConv(Rule):
    """conv(concat(a, b)) → the same ops again (right), or scaled by 1.01 (``wrong``)."""
    benefit = 1

    def __init__(self, wrong=False):
        self.wrong = wrong
        self.name = "concat_conv_wrong" if wrong else "concat_conv"

    def pattern(self):
        return op.Convolution(op.Concat(Var("a"), Var("b"), name="cat"), Var("w"), Var("bias"), name="c")

    def check(self, m):
        return None if m.anchor.name == "c" else "rewritten already"      # the rebuilt one has another name

    def rewrite(self, m, b):
        cat = b.op("Concat", [m["a"], m["b"]], attrs=m.node("cat").attrs)
        y = b.op("Convolution", [cat, m["w"], m["bias"]], attrs=m.node("c").attrs)
        if self.wrong:
            y = b.op("_mul_scalar", [y], attrs={"scalar": 1.01})
        return b.op("identity", [y], name=m.anchor.name + "_again")


def test_sizes_past_the_channel_axis_shrink_where_the_channels_cannot():
    """concat(a: 24 channels, b: 16) read by a 40-channel convolution (PSPNet's head: 2048 + 4·512 → 4096):
    shrinking every size the parameters do not have breaks the concat's sum, so the sizes past the channel
    axis shrink alone — checked on its own at smaller shapes, and a wrong rewrite still refused there."""
    shapes = {"a": (1, 24, 48, 48), "b": (1, 16, 48, 48)}
    y = S.Convolution(S.Concat(S.var("a"), S.var("b"), dim=1), num_filter=8, kernel=(3, 3), pad=(1, 1), name="c")
    rng = np.random.default_rng(0)
    arg_shapes, _, _ = y.infer_shape(**shapes)
    arg = {n: mx.nd.array(rng.standard_normal(s)) for n, s in zip(y.list_arguments(), arg_shapes) if n not in shapes}
    res = fusion.fuse(y, arg, {}, rules=[ConcatConv()], input_shapes=shapes)
    c = res.report.self_check
    assert res.report.fused_count == 1 and c.alone == 1 and c.alone_smaller == 1, (c, res.report.to_text())
    res = fusion.fuse(y, arg, {}, rules=[ConcatConv(wrong=True)], input_shapes=shapes)
    assert res.report.fused_count == 0
    assert "self-check" in " ".join(res.report.rules["concat_conv_wrong"].rejected.values())
