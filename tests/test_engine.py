"""Pattern DSL, matcher and rewriter, exercised with small rules written here."""
import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion import Rule
from fusion.ir.errors import FusionError
from fusion.ir.graph import Entry, Graph
from fusion.ir.pattern import AnyOf, Const, OneOf, Var, op, scalar

from conftest import ops

SHAPE = {"x": (2, 3)}


class MulChain(Rule):
    """_mul_scalar(_mul_scalar(x, a), b) -> _mul_scalar(x, a·b); a/b may also be _div_scalar."""
    name = "mul_chain"
    benefit = 2

    def pattern(self):
        inner = scalar("mul", Var("x"), name="a") | scalar("div", Var("x"), name="a")
        return scalar("mul", inner, name="b")

    def rewrite(self, m, b):
        a = m.node("a")
        factor = a.attrs["scalar"] if a.op == "_mul_scalar" else 1.0 / a.attrs["scalar"]
        return b.op("_mul_scalar", [m["x"]], attrs={"scalar": float(factor * m.node("b").attrs["scalar"])})


class SigmoidGate(Rule):
    """x * sigmoid(x) (either order, any mul spelling) -> a Swish written as one LeakyReLU-free op pair."""
    name = "sigmoid_gate"
    benefit = 3
    family = "gate"

    def pattern(self):
        return op.mul(Var("x"), op.sigmoid(Var("x"), name="sig"), name="mul")

    def rewrite(self, m, b):
        s = b.op("Activation", [m["x"]], attrs={"act_type": "sigmoid"}, name=m.node("sig").name)
        return b.op("elemwise_mul", [s, m["x"]], name=m.node("mul").name)


class ReluOfAdd(Rule):
    """relu(add(x, y)) -> relu(add(x, y)), also replacing the add (exported)."""
    name = "relu_add"
    benefit = 1
    exports = ("add",)

    def pattern(self):
        return op.relu(op.add(Var("x"), Var("y"), name="add"), name="relu")

    def rewrite(self, m, b):
        s = b.op("elemwise_add", [m["x"], m["y"]])
        r = b.op("Activation", [s], attrs={"act_type": "relu"})
        return {Entry(m.node("add")): s, m.anchor_entry: r}


class MulOfAdd(Rule):
    name = "mul_add"
    benefit = 1
    exports = ("add",)

    def pattern(self):
        return op.elemwise_mul(op.add(Var("x"), Var("y"), name="add"), Var("z"), name="mul")

    def rewrite(self, m, b):
        s = b.op("elemwise_add", [m["x"], m["y"]])
        return {Entry(m.node("add")): s, m.anchor_entry: b.op("broadcast_mul", [s, m["z"]])}


def run(sym, rules, shapes=SHAPE, **kw):
    res = fusion.fuse(sym, rules=rules, **kw)
    v = fusion.verify(sym, res, ({}, {}), shapes)
    assert v.max_rel <= 1e-6, v
    return res


def test_scalar_forms_and_alternatives_fold_to_fixpoint():
    x = mx.sym.var("x")
    y = ((x * 2.0) / 4.0) * 3.0 * 5.0
    res = run(y, [MulChain()])
    assert ops(res) == {"_mul_scalar": 1}
    assert res.report.rules["mul_chain"].fused
    # idempotent
    again = fusion.fuse(res.symbol, rules=[MulChain()])
    assert again.symbol.tojson() == res.symbol.tojson() and again.report.fused_count == 0


@pytest.mark.parametrize("build", [
    lambda x: x * mx.sym.sigmoid(x),
    lambda x: mx.sym.sigmoid(x) * x,
    lambda x: mx.sym.broadcast_mul(mx.sym.sigmoid(x), x),
    lambda x: mx.sym.elemwise_mul(x, mx.sym.sigmoid(x)),
])
def test_commutative_matching_and_repeated_variables(build):
    res = run(build(mx.sym.var("x")), [SigmoidGate()])
    assert len(res.report.rules["sigmoid_gate"].fused) == 1


def test_repeated_variable_must_bind_the_same_value():
    x, z = mx.sym.var("x"), mx.sym.var("z")
    res = run(x * mx.sym.sigmoid(z), [SigmoidGate()], shapes={"x": (2, 3), "z": (2, 3)})
    assert res.report.fused_count == 0
    assert "must be the same value" in res.report.rules["sigmoid_gate"].near_misses[res.graph.nodes[-1].name]


def test_interior_output_used_outside_is_rejected_with_reason():
    x = mx.sym.var("x")
    inner = x * 2.0
    y = mx.sym.Group([inner * 3.0, mx.sym.exp(inner)])
    res = run(y, [MulChain()])
    assert res.report.fused_count == 0
    (reason,) = res.report.rules["mul_chain"].rejected.values()
    assert "is also used by exp" in reason


def test_interior_output_that_is_a_head_is_rejected():
    x = mx.sym.var("x")
    inner = x * 2.0
    res = run(mx.sym.Group([inner * 3.0, inner]), [MulChain()])
    assert res.report.fused_count == 0
    assert "is a graph output" in list(res.report.rules["mul_chain"].rejected.values())[0]


def test_exported_interior_overlap_is_rejected():
    x, y = mx.sym.var("x"), mx.sym.var("y")
    s = x + y
    out = mx.sym.Group([mx.sym.relu(s), mx.sym.relu(s)])
    # one pass: the second relu's candidate shares the exported add with the first -> overlap
    from fusion.engine.report import FusionReport
    from fusion.engine.rewrite import Context, _Pass
    g = Graph.from_symbol(out)
    report = FusionReport()
    assert _Pass(g, Context(g, {}, {}, "inference"), report).run_rule(ReluOfAdd()) == 1
    assert any("overlaps the relu_add match" in r for r in report.rules["relu_add"].rejected.values())
    # to the fixpoint: the deferred candidate is fused in the next pass, and the report says so
    res = run(out, [ReluOfAdd()], shapes={"x": (2, 3), "y": (2, 3)})
    assert len(res.report.rules["relu_add"].fused) == 2 and not res.report.rules["relu_add"].rejected


def test_rewrite_that_would_create_a_cycle_is_rejected():
    x, y = mx.sym.var("x"), mx.sym.var("y")
    s = x + y
    out = mx.sym.elemwise_mul(s, mx.sym.exp(s))      # z = exp(add) feeds the mul: fusing {add, mul} would need its own output
    res = run(out, [MulOfAdd()], shapes={"x": (2, 3), "y": (2, 3)})
    assert res.report.fused_count == 0
    assert "cycle" in list(res.report.rules["mul_add"].rejected.values())[0]


def test_benefit_orders_rules_not_list_position():
    x = mx.sym.var("x")
    y = (x * 2.0) * mx.sym.sigmoid(x * 2.0)

    class Greedy(MulChain):
        name = "greedy"
        benefit = 1

    res = fusion.fuse(y, rules=[Greedy(), SigmoidGate()])
    assert list(res.report.rules) == ["sigmoid_gate", "greedy"]


def test_training_mode_refuses_inference_only_rules():
    class InferenceOnly(MulChain):
        name = "inference_only_chain"
        inference_only = True

    res = fusion.fuse(mx.sym.var("x") * 2.0 * 3.0, rules=[InferenceOnly()], mode="training")
    assert res.report.fused_count == 0
    assert "mode='training'" in list(res.report.rules["inference_only_chain"].rejected.values())[0]
    with pytest.raises(ValueError, match="mode"):
        fusion.fuse(mx.sym.var("x"), mode="train")


def test_check_reason_and_failed_rewrite_leave_graph_untouched():
    class Refuses(MulChain):
        name = "refuses"

        def check(self, m):
            return "scalar %g is not allowed" % m.node("b").attrs["scalar"]

    class Raises(MulChain):
        name = "raises"

        def rewrite(self, m, b):
            raise FusionError("cannot build it")

    y = mx.sym.var("x") * 2.0 * 3.0
    for rule, text in ((Refuses(), "scalar 3 is not allowed"), (Raises(), "rewrite failed: cannot build it")):
        res = fusion.fuse(y, rules=[rule])
        assert res.symbol.tojson() == y.tojson()
        assert list(res.report.rules[rule.name].rejected.values()) == [text]


def test_const_only_matches_parameters_and_values_reach_rules():
    seen = {}

    class ScaleWeight(Rule):
        name = "scale_weight"

        def pattern(self):
            return scalar("mul", op.FullyConnected(Var("x"), Const("w"), Const("b", optional=True),
                                                   name="fc", no_bias=OneOf(True, False)), name="s")

        def check(self, m):
            if m.value("w") is None:
                return "needs the weight's value"

        def rewrite(self, m, b):
            seen["w"] = m.value("w")
            s = m.node("s").attrs["scalar"]
            w = b.param(m.node("fc").name + "_scaled_weight", m.value("w") * s)
            bias = b.param(m.node("fc").name + "_scaled_bias", m.value("b") * s)
            return b.op("FullyConnected", [m["x"], w, bias], attrs=m.node("fc").attrs, name=m.node("fc").name)

    x = mx.sym.var("x")
    y = mx.sym.FullyConnected(x, num_hidden=4, name="fc") * 3.0
    w = mx.nd.array(np.arange(12, dtype=np.float32).reshape(4, 3))
    arg = {"fc_weight": w, "fc_bias": mx.nd.ones(4)}
    before = w.asnumpy().copy()
    res = fusion.fuse(y, arg, {}, rules=[ScaleWeight()])
    assert sorted(res.arg_params) == ["fc_scaled_bias", "fc_scaled_weight"]
    np.testing.assert_array_equal(w.asnumpy(), before)           # caller's array untouched
    assert not seen["w"].flags.writeable                           # rules get read-only views
    v = fusion.verify(y, res, (arg, {}), {"x": (2, 3)})
    assert v.max_rel < 1e-6
    # without params the check explains; a computed weight is not a Const
    assert "needs the weight's value" in list(fusion.fuse(y, rules=[ScaleWeight()]).report.rules["scale_weight"].rejected.values())[0]
    y2 = mx.sym.FullyConnected(x, weight=mx.sym.exp(mx.sym.var("w")), num_hidden=4, no_bias=True, name="fc") * 3.0
    r2 = fusion.fuse(y2, rules=[ScaleWeight()])
    assert "must be a parameter" in r2.report.rules["scale_weight"].near_misses["_mulscalar0" if False else r2.graph.nodes[-1].name]


def test_fuse_does_not_mutate_the_callers_symbol():
    y = mx.sym.var("x") * 2.0 * 3.0
    before = y.tojson()
    fusion.fuse(y, rules=[MulChain()])
    assert y.tojson() == before


def test_report_text_and_json():
    res = fusion.fuse(mx.sym.var("x") * 2.0 * 3.0, rules=[MulChain()])
    d = res.report.to_dict()
    assert d["fused"] == 1 and d["ops_before"] == 2 and d["ops_after"] == 1
    assert "mul_chain" in res.report.to_text()
    import json
    assert json.loads(res.report.to_json())["rules"][0]["rule"] == "mul_chain"


def test_unknown_rule_name():
    with pytest.raises(FusionError, match="unknown rule 'nope'"):
        fusion.fuse(mx.sym.var("x"), rules=["nope"])


def test_optional_inputs_must_come_last():
    with pytest.raises(ValueError):
        op.FullyConnected(Var("x"), Const("b", optional=True), Const("w"))


def test_anyof_roots():
    p = op.relu(Var("x")) | op.sigmoid(Var("x"))
    assert p.roots() == {"relu", "sigmoid"}
    assert AnyOf(p, Var("y")).roots() == frozenset()


def test_rule_that_rewrites_its_own_output_forever_is_reported():
    class Forever(ReluOfAdd):
        name = "forever"

        def rewrite(self, m, b):
            s = b.op("elemwise_add", [m["x"], m["y"]])
            return {Entry(m.node("add")): s, m.anchor_entry: b.op("relu", [s])}

    x, y = mx.sym.var("x"), mx.sym.var("y")
    with pytest.raises(FusionError, match="fixpoint"):
        fusion.fuse(mx.sym.relu(x + y), rules=[Forever()])


def test_a_rule_that_raises_costs_only_its_candidates():
    class BuggyCheck(MulChain):
        name = "buggy_check"

        def check(self, m):
            return None if m.node("b").attrs["scalar"] == 3.0 else {}["missing"]

    class BuggyRewrite(MulChain):
        name = "buggy_rewrite"

        def rewrite(self, m, b):
            raise TypeError("oops")

    x, z = mx.sym.var("x"), mx.sym.var("z")
    y = mx.sym.Group([x * 2.0 * 3.0, z * 2.0 * 5.0])
    res = run(y, [BuggyCheck()], shapes={"x": (2, 3), "z": (2, 3)})
    rr = res.report.rules["buggy_check"]
    assert len(rr.fused) == 1
    assert any("internal error in rule buggy_check (KeyError" in r for r in rr.rejected.values())
    res = run(y, [BuggyRewrite()], shapes={"x": (2, 3), "z": (2, 3)})
    assert res.symbol.tojson() == y.tojson()
    assert all("internal error in rule buggy_rewrite (TypeError: oops)" in r
               for r in res.report.rules["buggy_rewrite"].rejected.values())


def test_user_rules_by_module_name(tmp_path, monkeypatch):
    (tmp_path / "my_rules.py").write_text(
        "from fusion import Rule\n"
        "from fusion.ir.pattern import Var, scalar\n"
        "class Double(Rule):\n"
        "    name = 'double_mul'\n"
        "    def pattern(self):\n"
        "        return scalar('mul', scalar('mul', Var('x'), name='a'), name='b')\n"
        "    def rewrite(self, m, b):\n"
        "        return b.op('_mul_scalar', [m['x']], attrs={'scalar': float(m.node('a').attrs['scalar'])"
        " * float(m.node('b').attrs['scalar'])})\n"
        "RULES = [Double]\n")
    monkeypatch.chdir(tmp_path)
    res = fusion.fuse(mx.sym.var("x") * 2.0 * 3.0, rules=["my_rules:RULES"])
    assert len(res.report.rules["double_mul"].fused) == 1
    with pytest.raises(FusionError, match="cannot import rule module 'nope'"):
        fusion.fuse(mx.sym.var("x"), rules=["nope:RULES"])
    with pytest.raises(FusionError, match="has no MISSING"):
        fusion.fuse(mx.sym.var("x"), rules=["my_rules:MISSING"])
