"""Regions (patterns/region.py → fused_region, patterns/unfuse_region.py → stock ops again).

The op itself (cuda_kernels/fused_region/) is written on another branch.  Until it is in the op
library, regions are made here with the rule told the op exists (``regions_on``), at the level of
the graph (``fuse_graph``: the rules run without the self-check, which would have to bind the op),
and checked through ``unfuse``: the un-fused program must compute what the original computes.  The
tests that run the op itself (``needs_op``) are skipped until then, with the reason.
"""
import json

import mxnet as mx
import numpy as np
import pytest

import fusion
import patterns.region as region
from fusion.api import resolve_rules
from fusion.engine import cost
from fusion.engine.report import FusionReport
from fusion.engine.rewrite import Context, implemented, run_rules
from fusion.ir.graph import Graph
from fusion.precision import policy
from patterns.unfuse import RULES as UNFUSE_RULES

from conftest import ops, random_params

HAS_OP = implemented("fused_region", "cpu")
needs_op = pytest.mark.skipif(not HAS_OP, reason="fused_region is not in this op library yet (its op, "
                                                 "cuda_kernels/fused_region/fused_region.cc, is written on another "
                                                 "branch): these tests run the op once it is merged")
S = mx.sym
X = {"data": (2, 8, 9, 9)}


@pytest.fixture(autouse=True)
def regions_on(monkeypatch):
    """The rule makes regions as if the op library had fused_region (the graph-level tests never bind it)."""
    if not HAS_OP:
        monkeypatch.setattr(region, "op_available", lambda: True)


# ---------------------------------------------------------------- helpers

class Fused:
    def __init__(self, graph, ctx, report):
        self.graph, self.ctx, self.report = graph, ctx, report

    def programs(self):
        return [json.loads(n.attrs.raw("program")) for n in self.graph.op_nodes() if n.op == "fused_region"]

    def program(self):
        progs = self.programs()
        assert len(progs) == 1, (self.graph.count_ops(), self.report.to_text(explain=True))
        return progs[0]

    def regions(self):
        return [n for n in self.graph.op_nodes() if n.op == "fused_region"]

    def near_misses(self, rule="region"):
        r = self.report.rules.get(rule)
        return list(r.near_misses.values()) if r else []

    def text(self):
        return self.report.to_text(explain=True)


def fuse_graph(sym, arg=None, aux=None, shapes=X, rules=None, mode="inference", device="cpu", precision="float32",
               input_dtypes=None, checker=None):
    """The rules run on ``sym``'s graph as fuse() runs them, without the self-check (which binds the op)."""
    graph = sym if isinstance(sym, Graph) else Graph.from_symbol(sym)
    graph.canonicalize_ops()
    ctx = Context(graph, arg or {}, aux or {}, mode, shapes, input_dtypes, precision, device)
    report = FusionReport(mode=mode)
    run_rules(graph, resolve_rules(rules), ctx, report, checker)
    return Fused(graph, ctx, report)


def all_params(f):
    c = f.ctx
    return {k: (v.asnumpy() if hasattr(v, "asnumpy") else np.asarray(v))
            for store in (c.arg_params, c.aux_params, c.new_args, c.new_aux) for k, v in store.items()}


def unfused(f):
    """The fused graph un-fused (graph level): a symbol of stock ops."""
    g = f.graph.copy()
    params = all_params(f)
    run_rules(g, UNFUSE_RULES, Context(g, params, {}, "inference"), FusionReport(), None)
    assert not any(o.startswith("fused_region") for o in g.count_ops()), g.count_ops()
    return g.to_symbol()


def assert_round_trip(sym, arg, aux, f, shapes=X, rtol=1e-5):
    """unfuse(fuse(sym)) computes what ``sym`` computes, at ``shapes`` and at another batch and plane."""
    plain = unfused(f)
    for s in (shapes, {k: (v[0] + 1,) + tuple(v[1:2]) + tuple(d + 2 for d in v[2:]) for k, v in shapes.items()}):
        v = fusion.verify(sym, (plain, all_params(f), {}), (arg, aux), s)
        assert v.max_rel <= rtol, (s, v, f.text())
    return plain


def fuse_round_trip(sym, shapes=X, rules=None, **kw):
    arg, aux = random_params(sym, shapes)
    f = fuse_graph(sym, arg, aux, shapes, rules=rules, **kw)
    assert_round_trip(sym, arg, aux, f, shapes)
    return f


def conv(x, name, f=8, k=3, s=1, p=1, g=1, d=1, bias=True):
    return S.Convolution(x, kernel=(k, k), stride=(s, s), pad=(p, p), dilate=(d, d), num_filter=f, num_group=g,
                         no_bias=not bias, name=name)


def bn(x, name, fix_gamma=False):
    return S.BatchNorm(x, fix_gamma=fix_gamma, name=name)


def relu(x, name=None):
    return S.Activation(x, act_type="relu", name=name)


def hswish(x):
    return x * (S.clip(x + 3.0, 0, 6) / 6.0)


# ---------------------------------------------------------------- the ops of a region

@pytest.mark.parametrize("kw", [dict(), dict(s=2), dict(p=0), dict(k=1, p=0), dict(d=2, p=2), dict(g=2),
                                dict(g=8), dict(bias=False), dict(k=5, p=2, s=2)],
                         ids=lambda kw: ",".join("%s=%s" % i for i in kw.items()) or "plain")
def test_convolutions(kw):
    y = conv(relu(conv(S.var("data"), "c1")), "c2", **kw)
    f = fuse_round_trip(y)
    p = f.program()
    assert [o["op"] for o in p["ops"]] == ["conv", "conv"]
    c = p["ops"][1]
    assert (c["kernel"], c["stride"], c["pad"], c["dilate"], c["groups"], c["filters"]) == (
        [kw.get("k", 3)] * 2, [kw.get("s", 1)] * 2, [kw.get("p", 1)] * 2, [kw.get("d", 1)] * 2, kw.get("g", 1), 8)
    assert (c["bias"] is None) == (kw.get("bias") is False)
    assert p["ops"][0]["post"] == [{"eltwise": "relu"}]
    assert p["params"][c["weight"]] == [8, 8 // kw.get("g", 1), kw.get("k", 3), kw.get("k", 3)]
    assert f.regions()[0].attrs["num_data"] == 1 and len(f.regions()[0].inputs) == 1 + len(p["params"])


def deconv(x, name, f=8, k=4, s=2, p=1, adj=0, d=1, bias=True, **kw):
    return S.Deconvolution(x, kernel=(k, k), stride=(s, s), pad=(p, p), adj=(adj, adj), dilate=(d, d), num_filter=f,
                           no_bias=not bias, name=name, **kw)


def _pose_head(bias=False):
    """GluonCV's simple-pose head over a convolution: (deconv 4x4/2 → BatchNorm → relu) x 2, a 1x1 convolution."""
    x = relu(conv(S.var("data"), "c0", 16))
    for k in range(2):
        x = relu(bn(deconv(x, "up%d" % k, bias=bias), "up%d_bn" % k))
    return conv(x, "heat", 5, k=1, p=0)


@pytest.mark.parametrize("kw", [dict(), dict(bias=False), dict(k=3, p=1, adj=1), dict(k=2, p=0), dict(k=3, s=1, p=1),
                                dict(k=3, d=2, p=2)],
                         ids=lambda kw: ",".join("%s=%s" % i for i in kw.items()) or "plain")
def test_deconvolutions(kw):
    """MXNet's Deconvolution as the program's deconv: its weight (C, O, KH, KW) and its attributes as they are."""
    y = conv(relu(deconv(relu(conv(S.var("data"), "c1")), "up", **kw)), "c2")
    f = fuse_round_trip(y)
    p = f.program()
    assert [o["op"] for o in p["ops"]] == ["conv", "deconv", "conv"]
    d = p["ops"][1]
    k = kw.get("k", 4)
    assert (d["kernel"], d["stride"], d["pad"], d["adj"], d["dilate"], d["filters"]) == (
        [k] * 2, [kw.get("s", 2)] * 2, [kw.get("p", 1)] * 2, [kw.get("adj", 0)] * 2, [kw.get("d", 1)] * 2, 8)
    assert (d["bias"] is None) == (kw.get("bias") is False) and "groups" not in d
    assert p["params"][d["weight"]] == [8, 8, k, k]
    assert d["post"] == [{"eltwise": "relu"}]


def test_pose_head_is_one_region_and_deconv_rules_stand_aside():
    y = _pose_head()
    f = fuse_round_trip(y)
    assert f.graph.count_ops() == {"fused_region": 1}, f.text()
    assert [o["op"] for o in f.program()["ops"]] == ["conv", "deconv", "batchnorm", "deconv", "batchnorm", "conv"]
    g = fuse_graph(y, *random_params(y, X), rules=["default", "-region"])
    assert "fused_region" not in g.graph.count_ops() and g.graph.count_ops().get("Deconvolution", 0) + \
        g.graph.count_ops().get("fused_deconv", 0) == 2, g.graph.count_ops()


@pytest.mark.parametrize("kw,why", [
    (dict(num_group=2), "grouped (num_group=2): a region's deconv has one group"),
    (dict(target_shape=(18, 18)), "target_shape (MXNet then computes its padding)"),
    (dict(k=3, p=0, adj=1), "adj (1, 1) larger than pad (0, 0)"),
])
def test_deconvolution_the_contract_lacks_ends_the_region(kw, why):
    y = conv(relu(conv(relu(deconv(relu(conv(S.var("data"), "c1")), "up", **kw)), "c2")), "c3")
    f = fuse_graph(y, *random_params(y, X, inputs=["data"]), shapes=X, rules=["region"])
    reasons = [c["reason"] for x in f.report.rules["region"].fused for c in x["details"]["cuts"]["inputs"]] + \
        f.near_misses()
    assert any(why in r for r in reasons), f.text()
    assert all(o["op"] != "deconv" for p in f.programs() for o in p["ops"])


POOLS = {
    "max3s2": (lambda x: S.Pooling(x, kernel=(3, 3), stride=(2, 2), pad=(1, 1), pool_type="max"),
               {"mode": "max", "kernel": [3, 3], "stride": [2, 2], "pad": [1, 1], "convention": "valid", "global": False}),
    "avg2full": (lambda x: S.Pooling(x, kernel=(2, 2), stride=(2, 2), pool_type="avg", pooling_convention="full"),
                 {"mode": "avg", "convention": "full", "count_include_pad": True}),
    "avg_exclude_pad": (lambda x: S.Pooling(x, kernel=(3, 3), pad=(1, 1), pool_type="avg", count_include_pad=False),
                        {"mode": "avg", "count_include_pad": False, "stride": [1, 1]}),
    "global_max": (lambda x: S.Pooling(x, kernel=(1, 1), global_pool=True, pool_type="max"),
                   {"mode": "max", "global": True}),
    "global_avg": (lambda x: S.Pooling(x, kernel=(1, 1), global_pool=True, pool_type="avg"),
                   {"mode": "avg", "global": True}),
    "mean": (lambda x: S.mean(x, axis=(2, 3), keepdims=True), {"mode": "avg", "global": True}),
    "adaptive": (lambda x: S.contrib.AdaptiveAvgPooling2D(x, output_size=1), {"mode": "avg", "global": True}),
}


@pytest.mark.parametrize("name", sorted(POOLS))
def test_poolings(name):
    make, want = POOLS[name]
    y = conv(make(relu(conv(S.var("data"), "c1"))), "c2")
    f = fuse_round_trip(y)
    pool = f.program()["ops"][1]
    assert pool["op"] == "pool" and {k: pool[k] for k in want} == want, pool


def test_concat_of_branches_with_a_pooling_branch():
    """Inception's block: four branches of the block input, concatenated along the channels."""
    x = relu(conv(S.var("data"), "stem"))
    b1 = relu(conv(x, "b1", 4, k=1, p=0))
    b2 = relu(conv(relu(conv(x, "b2a", 4, k=1, p=0)), "b2b", 6, k=5, p=2))
    b3 = relu(conv(relu(conv(x, "b3a", 4, k=1, p=0)), "b3b", 6))
    b4 = relu(conv(S.Pooling(x, kernel=(3, 3), pad=(1, 1), pool_type="avg"), "b4", 2, k=1, p=0))
    y = S.Concat(b1, b2, b3, b4, dim=1, name="cat")
    f = fuse_round_trip(y)
    p = f.program()
    cat = p["ops"][-1]
    assert cat["op"] == "concat" and len(cat["in"]) == 4
    assert sum(o["op"] == "conv" for o in p["ops"]) == 7 and p["outputs"] == [1 + len(p["ops"]) - 1]


@pytest.mark.parametrize("fix_gamma", [False, True])
def test_batchnorm_with_its_moving_statistics(fix_gamma):
    """A BatchNorm nothing folds (after a relu): a batchnorm op reading γ, β and the moving statistics."""
    y = conv(bn(relu(conv(S.var("data"), "c1")), "bn", fix_gamma=fix_gamma), "c2")
    arg, aux = random_params(y, X)
    f = fuse_graph(y, arg, aux)
    norm = f.program()["ops"][1]
    assert norm["op"] == "batchnorm" and norm["fix_gamma"] is fix_gamma and norm["eps"] == pytest.approx(1e-3)
    names = [e.node.name for e in f.regions()[0].inputs]
    assert {"bn_moving_mean", "bn_moving_var", "bn_gamma", "bn_beta"} <= set(names)
    plain = assert_round_trip(y, arg, aux, f)
    assert sorted(plain.list_auxiliary_states()) == ["bn_moving_mean", "bn_moving_var"]


def _act(kind):
    return lambda y: S.Activation(y, act_type=kind)


def _elemwise(expr):
    return lambda y: S.fused_elemwise(y, expr=expr, num_args=1)


def f32(v):
    return float(np.float32(v))


F6 = f32(1 / 6)
#: activation written some way -> the step it is
ACTIVATIONS = {
    "Activation(relu)": (_act("relu"), {"eltwise": "relu"}),
    "relu": (S.relu, {"eltwise": "relu"}),
    "Activation(sigmoid)": (_act("sigmoid"), {"eltwise": "sigmoid"}),
    "sigmoid": (S.sigmoid, {"eltwise": "sigmoid"}),
    "Activation(tanh)": (_act("tanh"), {"eltwise": "tanh"}),
    "tanh": (S.tanh, {"eltwise": "tanh"}),
    "softrelu": (_act("softrelu"), {"eltwise": "softrelu"}),
    "leaky": (lambda y: S.LeakyReLU(y, act_type="leaky", slope=0.1), {"eltwise": "leaky", "slope": f32(0.1)}),
    "elu": (lambda y: S.LeakyReLU(y, act_type="elu", slope=0.3), {"eltwise": "elu", "alpha": f32(0.3)}),
    "gelu": (lambda y: S.LeakyReLU(y, act_type="gelu"), {"eltwise": "gelu"}),
    "relu6": (lambda y: S.clip(y, 0, 6), {"eltwise": "clip", "lo": 0.0, "hi": 6.0}),
    "swish": (lambda y: y * S.sigmoid(y), {"eltwise": "swish"}),
    "gluon_swish": (lambda y: y * S.sigmoid(1.0 * y), {"eltwise": "swish"}),      # Gluon's Swish(beta=1.0)
    "hard_swish": (hswish, {"eltwise": "hard_swish"}),
    "hard_swish_product_first": (lambda y: y * S.clip(y + 3.0, 0, 6) / 6.0, {"eltwise": "hard_swish"}),
    "hard_sigmoid_clip": (lambda y: S.clip(y + 3.0, 0, 6) / 6.0,
                          {"eltwise": "hard_sigmoid", "alpha": F6, "beta": 0.5}),
    "hard_sigmoid": (lambda y: S.hard_sigmoid(y, alpha=0.25, beta=0.4),
                     {"eltwise": "hard_sigmoid", "alpha": 0.25, "beta": f32(0.4)}),
    "plus": (lambda y: y + 2.0, {"eltwise": "linear", "scale": 1.0, "shift": 2.0}),
    "minus": (lambda y: y - 2.0, {"eltwise": "linear", "scale": 1.0, "shift": -2.0}),
    "rminus": (lambda y: 2.0 - y, {"eltwise": "linear", "scale": -1.0, "shift": 2.0}),
    "times": (lambda y: y * 3.0, {"eltwise": "linear", "scale": 3.0, "shift": 0.0}),
    "divide": (lambda y: y / 4.0, {"eltwise": "linear", "scale": 0.25, "shift": 0.0}),
    "elemwise:hard_swish": (_elemwise("mul(x0, div(clip(add(x0, 3.0), 0.0, 6.0), 6.0))"),
                            {"eltwise": "hard_swish"}),
    "elemwise:hard_sigmoid": (_elemwise("div(clip(add(x0, 3.0), 0.0, 6.0), 6.0)"),
                              {"eltwise": "hard_sigmoid", "alpha": F6, "beta": 0.5}),
    "elemwise:swish": (_elemwise("mul(x0, sigmoid(x0))"), {"eltwise": "swish"}),
    "elemwise:act_relu": (_elemwise("act_relu(x0)"), {"eltwise": "relu"}),
    "elemwise:leaky": (_elemwise("leaky(x0, 0.2)"), {"eltwise": "leaky", "slope": f32(0.2)}),
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activations_every_way_they_are_written(name):
    """conv → activation → conv: the activation is one step of the first convolution."""
    make, step = ACTIVATIONS[name]
    y = conv(make(conv(S.var("data"), "c1")), "c2")
    f = fuse_round_trip(y, rules=["region"])
    first = f.program()["ops"][0]
    assert first["op"] == "conv" and first.get("post") == [step], first


def test_activation_of_a_data_input_is_an_act_op():
    y = conv(relu(conv(S.relu(S.var("data")), "c1")), "c2")
    f = fuse_round_trip(y)
    p = f.program()
    assert p["ops"][0] == {"op": "act", "in": 0, "post": [{"eltwise": "relu"}]}


def test_a_value_read_twice_inside_keeps_its_own_op_for_the_step():
    """relu(c1) feeds c2 and the add: relu is a step of c1 (c1's value is read by relu alone); the add of
    relu's value to c2's is c2's step (relu's value is made before c2)."""
    r = relu(conv(S.var("data"), "c1"))
    y = relu(conv(r, "c2") + r)
    f = fuse_round_trip(y)
    p = f.program()
    assert [o.get("post") for o in p["ops"]] == [[{"eltwise": "relu"}], [{"add": 1}, {"eltwise": "relu"}]]


def test_residual_add_folds_into_the_later_branch():
    """ResNet's downsampling block: the shortcut convolution comes after the main branch's last one, so the
    add is a step of the shortcut's convolution, reading the main branch's value."""
    x = S.var("data")
    main = conv(relu(conv(relu(conv(x, "a", 4, k=1, p=0)), "b", 4)), "c", 16, k=1, p=0)
    short = conv(x, "down", 16, k=1, p=0)
    y = relu(main + short)
    f = fuse_round_trip(y)
    p = f.program()
    assert p["ops"][-1]["post"] == [{"add": 1 + 2}, {"eltwise": "relu"}], p["ops"]


def test_add_op_where_neither_side_can_take_it():
    x = S.var("data")
    a, b = conv(x, "a"), conv(x, "b")
    y = S.Concat(a + b, conv(a, "c"), conv(b, "d"), dim=1)
    f = fuse_round_trip(y)
    assert any(o["op"] == "add" for o in f.program()["ops"])


def test_squeeze_excitation_is_a_mul_op_with_a_channel_gate():
    x = relu(conv(S.var("data"), "c0", 16))
    g = S.Pooling(x, kernel=(1, 1), global_pool=True, pool_type="avg")
    g = S.sigmoid(conv(relu(conv(g, "fc1", 4, k=1, p=0)), "fc2", 16, k=1, p=0))
    for y in (S.broadcast_mul(x, g), S.broadcast_mul(g, x)):
        f = fuse_round_trip(conv(y, "c3"))
        mul = [o for o in f.program()["ops"] if o["op"] == "mul"]
        assert len(mul) == 1
        p = f.program()
        assert p["ops"][mul[0]["in"][1] - 1]["op"] == "conv"        # (N, C, 1, 1): the gate, second


def _se_gate_broadcast(form):
    """An SE block whose gate is broadcast_like'd to the map before the product (GluonCV's pose networks)."""
    x = relu(conv(S.var("data"), "c0", 16))
    g = S.Pooling(x, kernel=(1, 1), global_pool=True, pool_type="avg")
    g = S.sigmoid(conv(relu(conv(g, "fc1", 4, k=1, p=0)), "fc2", 16, k=1, p=0))
    like = S.broadcast_like(g, x, lhs_axes=(2, 3), rhs_axes=(2, 3)) if form == "axes" else S.broadcast_like(g, x)
    y = {"elemwise": lambda: S.elemwise_mul(x, like), "operator": lambda: x * like, "swapped": lambda: like * x,
         "axes": lambda: S.broadcast_mul(like, x)}[form]()
    return conv(y, "c3")


@pytest.mark.parametrize("form", ["elemwise", "operator", "swapped", "axes"])
def test_squeeze_excitation_gate_broadcast_like_the_map_is_a_mul_by_the_gate(form):
    f = fuse_round_trip(_se_gate_broadcast(form))
    assert f.graph.count_ops() == {"fused_region": 1}, f.text()
    p = f.program()
    mul = [o for o in p["ops"] if o["op"] == "mul"]
    assert len(mul) == 1, p["ops"]
    assert p["ops"][mul[0]["in"][1] - 1]["op"] == "conv"        # (N, C, 1, 1): the gate itself, second
    assert any(r.startswith("taken by a region") for r in f.near_misses("se")), f.text()


def _gate_on_h(x):
    """The channels' gate put on the H axis, (N, 1, C, 1): broadcast_like fills the map where H = C, but
    not one value per channel."""
    g = S.FullyConnected(S.Pooling(x, kernel=(1, 1), global_pool=True, pool_type="avg"), num_hidden=16, name="fc")
    return S.broadcast_like(S.reshape(S.sigmoid(g), shape=(0, 1, -1, 1)), x)


@pytest.mark.parametrize("make,why", [
    (lambda x: x * _gate_on_h(x), "broadcasts 'reshape"),
    (lambda x: x + S.broadcast_like(S.sigmoid(conv(S.Pooling(x, kernel=(1, 1), global_pool=True, pool_type="avg"),
                                                   "fc", 16, k=1, p=0)), x),
     "read by elemwise_add '_plus"),
])
def test_broadcast_like_that_is_not_a_gate_of_a_product_cuts_the_region(make, why):
    x = relu(conv(S.var("data"), "c0", 16))
    y = conv(relu(conv(make(x), "c3")), "c4")
    shapes = {"data": (2, 8, 16, 16)}          # H = C: the only plane where the gate on H fills the map
    arg, aux = random_params(y, shapes)
    f = fuse_graph(y, arg, aux, shapes, rules=["region"])
    assert f.regions(), f.text()
    assert fusion.verify(y, (unfused(f), all_params(f), {}), (arg, aux), shapes).max_rel <= 1e-5
    cuts = [c["reason"] for r in f.report.rules["region"].fused for c in r["details"]["cuts"]["inputs"]]
    assert any(why in c for c in cuts), (cuts, f.text())


def test_product_of_equal_shapes_is_a_step():
    x = S.var("data")
    y = conv(conv(x, "a") * relu(conv(x, "b")), "c")
    f = fuse_round_trip(y)
    assert {"mul": 1} in f.program()["ops"][1]["post"] or {"mul": 2} in f.program()["ops"][0].get("post", [])


# ---------------------------------------------------------------- blocks of real networks

def test_resnet_bottleneck_v1b():
    x = S.var("data")
    y = relu(bn(conv(x, "c1", 4, k=1, p=0, bias=False), "bn1"))
    y = relu(bn(conv(y, "c2", 4, s=2, bias=False), "bn2"))
    y = bn(conv(y, "c3", 16, k=1, p=0, bias=False), "bn3")
    y = relu(y + bn(conv(x, "down", 16, k=1, s=2, p=0, bias=False), "bnd"))
    f = fuse_round_trip(y)
    p = f.program()
    assert [o["op"] for o in p["ops"]] == ["conv"] * 4 and f.graph.count_ops() == {"fused_region": 1}


def test_preactivation_v2_block_batchnorm_after_an_add():
    x = S.var("data")
    h = relu(bn(x, "bn0"))
    y = conv(relu(bn(conv(h, "c1", bias=False), "bn1")), "c2", bias=False)
    y = y + x
    y = relu(bn(y, "bn_next"))                       # the next block's pre-activation reads the sum
    y = conv(y, "c3", bias=False) + y
    f = fuse_round_trip(y)
    kinds = [o["op"] for o in f.program()["ops"]]
    assert kinds.count("batchnorm") == 2 and kinds.count("conv") == 3, kinds


def _res_unit(cin, e, cout, k=3, act="hard_swish", se=False, s=1):
    from fusion.testing.gluoncv import _blocks, export
    with mx.name.NameManager():
        return export(_blocks()["ResUnit"](cin, e, cout, k, act, se, s, prefix="u_"), (1, cin, 9, 9))


@pytest.mark.parametrize("case", [(8, 24, 8, 3, "hard_swish", True, 1), (8, 24, 16, 5, "hard_swish", False, 2),
                                  (8, 16, 12, 5, "relu", True, 2), (8, 8, 8, 3, "relu", False, 1)])
def test_mobilenetv3_units(case):
    sym, arg, aux = _res_unit(*case)
    shapes = {"data": (1, case[0], 9, 9)}
    f = fuse_graph(sym, arg, aux, shapes)
    assert_round_trip(sym, arg, aux, f, shapes)
    assert f.graph.count_ops() == {"fused_region": 1}, f.text()
    steps = [s.get("eltwise") for o in f.program()["ops"] for s in o.get("post", ())]
    acts = (2 if case[1] != case[0] else 1) + (case[4] == "relu" and case[5])     # expand, depthwise, SE's hidden
    assert steps.count(case[4]) == acts, steps
    if case[5]:
        assert "hard_sigmoid" in steps and any(o["op"] == "mul" for o in f.program()["ops"])


def test_mobilenetv3_unit_with_its_activations_in_fused_elemwise():
    """The same unit after the elementwise rule made its hard-swishes and gate fused_elemwise programs."""
    sym, arg, aux = _res_unit(8, 24, 8, 3, "hard_swish", True, 1)
    shapes = {"data": (1, 8, 9, 9)}
    first = fuse_graph(sym, arg, aux, shapes, rules=["bn_folding", "elementwise"])
    assert first.graph.count_ops().get("fused_elemwise", 0) >= 2, first.graph.count_ops()
    params = all_params(first)
    again = fuse_graph(first.graph.to_symbol(), params, {}, shapes)
    assert again.graph.count_ops() == {"fused_region": 1}, again.text()
    stock = fuse_graph(sym, arg, aux, shapes)
    assert again.program()["ops"] == stock.program()["ops"]
    assert_round_trip(sym, arg, aux, Fused(again.graph, Context(again.graph, params, {}, "inference"), again.report),
                      shapes)


def _dense_layer(x, name, growth=4, bottleneck=8):
    y = conv(relu(bn(x, name + "_bn1")), name + "_c1", bottleneck, k=1, p=0, bias=False)
    y = conv(relu(bn(y, name + "_bn2")), name + "_c2", growth, bias=False)
    return S.Concat(x, y, dim=1, name=name + "_cat")


def test_densenet_block_and_transition():
    x = conv(S.var("data"), "stem", 8)
    for k in range(3):
        x = _dense_layer(x, "l%d" % k)
    t = conv(relu(bn(x, "t_bn")), "t_conv", 10, k=1, p=0, bias=False)
    y = S.Pooling(t, kernel=(2, 2), stride=(2, 2), pool_type="avg")
    f = fuse_round_trip(y)
    kinds = [o["op"] for o in f.program()["ops"]]
    assert kinds.count("concat") == 3 and kinds.count("batchnorm") == 4 and kinds.count("conv") == 8, kinds
    assert f.graph.count_ops() == {"fused_region": 1}, f.text()     # dense_block (after region) found nothing left


def test_se_resnext_block():
    from fusion.testing.gluoncv import _blocks, export
    with mx.name.NameManager():
        sym, arg, aux = export(_blocks()["ResNeXtBlock"](32, 4, 4, 1, downsample=True, use_se=True), (1, 16, 8, 8))
    shapes = {"data": (1, 16, 8, 8)}
    f = fuse_graph(sym, arg, aux, shapes)
    assert_round_trip(sym, arg, aux, f, shapes)
    assert f.graph.count_ops() == {"fused_region": 1}, f.text()
    p = f.program()
    assert any(o["op"] == "conv" and o["groups"] == 4 for o in p["ops"]) and any(o["op"] == "mul" for o in p["ops"])
    assert any("taken by a region" in r for name in ("se_add", "se") for r in f.near_misses(name)), f.text()


def _network(name, source, shape):
    """A network as GluonCV's model zoo gives it (needs ``gluoncv``) or as this package's copies write
    it without GluonCV (``fusion.testing.gluoncv``; ResNet-50 v2 from MXNet's own model zoo)."""
    if source == "gluoncv":
        pytest.importorskip("gluoncv")
        from fusion.testing.gcv_zoo import gcv_zoo_model
        return gcv_zoo_model(name, shape, 0, bn_by_nodes=True)
    if name == "resnet50_v2":
        from fusion.testing import zoo_model
        return zoo_model(name, shape)
    from fusion.testing.gluoncv import gluoncv_model
    return gluoncv_model(name, shape)


@pytest.mark.parametrize("source", ["copy", "gluoncv"])
@pytest.mark.parametrize("name,side", [("mobilenetv3_large", 64), ("resnet50_v2", 64), ("se_resnext50_32x4d", 64)])
def test_gluoncv_networks_become_one_region(name, side, source):
    shapes = {"data": (1, 3, side, side)}
    sym, arg, aux = _network(name, source, shapes["data"])
    f = fuse_graph(sym, arg, aux, shapes)
    assert f.graph.count_ops().get("fused_region") == 1, f.graph.count_ops()
    plain = unfused(f)
    v = fusion.verify(sym, (plain, all_params(f), {}), (arg, aux), shapes)
    assert v.max_rel <= 1e-5, v


# ---------------------------------------------------------------- refusals and cuts

def _two_convs(x=None):
    return conv(relu(conv(S.var("data") if x is None else x, "c1")), "c2")


def test_training_refuses_regions():
    y = _two_convs()
    arg, aux = random_params(y, X)
    f = fuse_graph(y, arg, aux, mode="training")
    assert not f.regions()
    assert any("inference-only" in r and "mode='training'" in r for r in f.near_misses()), f.text()


def test_gpu_refuses_regions():
    y = _two_convs()
    arg, aux = random_params(y, X)
    f = fuse_graph(y, arg, aux, device="gpu", rules=["region"])
    assert not f.regions()
    assert any("CPU op" in r and "device='gpu'" in r for r in f.near_misses()), f.text()


def test_op_library_without_fused_region_makes_none_and_says_nothing(monkeypatch):
    monkeypatch.setattr(region, "op_available", lambda: False)
    y = _two_convs()
    arg, aux = random_params(y, X)
    f = fuse_graph(y, arg, aux)
    assert not f.regions() and not f.near_misses()


def test_unsupported_op_cuts_the_region_and_the_report_says_why():
    y = conv(relu(conv(S.exp(_two_convs()), "c3")), "c4")
    f = fuse_round_trip(y, rules=["region"])
    assert len(f.regions()) == 2
    details = [r["details"] for r in f.report.rules["region"].fused]
    cuts = [c["reason"] for d in details for c in d["cuts"]["inputs"]] + \
        [c["reason"] for d in details for c in d["cuts"]["outputs"]]
    assert any("not a region op" in c for c in cuts), cuts
    text = f.report.to_text()
    assert "region 'c4'" in text and "exp" in text


def test_value_read_outside_is_given_back():
    r = relu(conv(S.var("data"), "c1"), name="r1")
    y = S.Group([conv(relu(conv(r, "c2")), "c3"), S.exp(r)])
    f = fuse_round_trip(y, rules=["region"])
    (n,) = f.regions()
    assert n.num_outputs == 2 and len(f.program()["outputs"]) == 2
    (d,) = [x["details"] for x in f.report.rules["region"].fused]
    assert d["outputs"] == 2 and "gives back 'r1', read by exp 'exp" in " ".join(d["lines"]), d
    assert d["cuts"]["inputs"] == [{"value": "'data'", "reason": "a graph input"}], d


def test_value_read_outside_that_leads_back_into_the_region_cuts_it():
    r = relu(conv(S.var("data"), "c1"), name="r1")
    y = conv(relu(conv(r, "c2")) + S.exp(r), "c3")
    f = fuse_round_trip(y, rules=["region"])
    (d,) = [x["details"] for x in f.report.rules["region"].fused]
    assert any("also read by exp" in c["reason"] and "leads back into it" in c["reason"]
               for c in d["cuts"]["inputs"]), d
    assert all(n.num_outputs == 1 for n in f.regions())


def test_graph_output_inside_is_given_back():
    r = relu(conv(S.var("data"), "c1"), name="r1")
    y = S.Group([relu(conv(relu(conv(r, "c2")), "c3"), name="out"), r])
    f = fuse_round_trip(y, rules=["region"])
    assert [n.name for n in f.regions()] == ["out"], f.text()
    assert [(e.node.name, e.index) for e in f.graph.heads] == [("out", 0), ("out", 1)]
    (d,) = [x["details"] for x in f.report.rules["region"].fused]
    assert "gives back 'r1', read by a graph output" in d["lines"], d


def test_value_of_another_dtype_is_not_taken():
    x = relu(conv(S.var("data"), "c1"))
    y = conv(relu(conv(S.Cast(x, dtype="float64"), "c2")), "c3")
    arg, aux = random_params(y, X)
    for k in ("c2_weight", "c2_bias", "c3_weight", "c3_bias"):
        arg[k] = arg[k].astype("float64")
    f = fuse_graph(y, arg, aux, rules=["region"])
    assert not f.regions()
    assert any("float64" in r for r in f.near_misses()), f.text()


def test_unknown_shapes_are_refused_for_want_of_them():
    y = _two_convs()
    f = fuse_graph(y, *random_params(y, X), shapes=None, rules=["region"])
    assert not f.regions()
    assert any("unknown" in r and "pass input shapes" in r for r in f.near_misses()), f.text()


def test_3d_convolution_is_not_taken():
    x = S.var("data")
    y = S.Convolution(S.Convolution(x, kernel=(1, 3, 3), pad=(0, 1, 1), num_filter=4, name="c1"),
                      kernel=(1, 3, 3), pad=(0, 1, 1), num_filter=4, name="c2")
    shapes = {"data": (1, 2, 3, 6, 6)}
    f = fuse_graph(y, *random_params(y, shapes), shapes=shapes, rules=["region"])
    assert not f.regions()
    assert any("3-D" in r for r in f.near_misses()), f.text()


def test_nhwc_convolution_is_not_taken():
    x = S.var("data")
    y = S.Convolution(S.Convolution(x, kernel=(3, 3), pad=(1, 1), num_filter=4, layout="NHWC", name="c1"),
                      kernel=(3, 3), pad=(1, 1), num_filter=4, layout="NHWC", name="c2")
    shapes = {"data": (1, 6, 6, 3)}
    f = fuse_graph(y, *random_params(y, shapes), shapes=shapes, rules=["region"])
    assert not f.regions()
    assert any("layout NHWC" in r for r in f.near_misses()), f.text()


@pytest.mark.parametrize("make,why", [
    (lambda y: S.Activation(y, act_type="softsign"), "softsign"),
    (lambda y: S.LeakyReLU(y, act_type="selu"), "selu"),
    (lambda y: S.broadcast_mul(y, S.var("scale", shape=(1, 8, 1, 1))), "multiplies equal shapes or by (N, C, 1, 1)"),
    (lambda y: S.fused_elemwise(y, expr="exp(x0)", num_args=1), "exp(…) is not an op or step of a region"),
    (lambda y: 1.0 / y, "not a region op"),
])
def test_what_the_contract_lacks_ends_the_region(make, why):
    y = conv(relu(conv(make(relu(conv(S.var("data"), "c1"))), "c2")), "c3")
    shapes = dict(X)
    f = fuse_graph(y, *random_params(y, shapes, inputs=["data"]), shapes=shapes, rules=["region"])
    (d,) = [x["details"] for x in f.report.rules["region"].fused]
    assert any(why in c["reason"] for c in d["cuts"]["inputs"]), d["cuts"]


def test_too_small_a_region_is_left_to_mxnet():
    """A convolution and its relu alone: MXNet's oneDNN backend fuses them at bind already."""
    y = relu(conv(S.var("data"), "c1"))
    f = fuse_graph(y, *random_params(y, X), rules=["region"])
    assert not f.regions()
    assert any("too small" in r for r in f.near_misses()), f.text()


def test_measured_costs_decide_over_the_rule(tmp_path, monkeypatch):
    name, flags = cost.cpu_identity()
    table = {"device": name, "kind": "cpu", "cpu_flags": list(flags), "date": "2024-01-01", "command": "test",
             "entries": [{"op": "fused_region", "dtype": "float32", "pass": "forward", "reference": "MXNet",
                          "case": {"convs": 2, "other_ops": 1, "mmacs": 0.1}, "fused_ms": 2.0, "unfused_ms": 1.0}]}
    (tmp_path / "t.json").write_text(json.dumps(table))
    monkeypatch.setenv("MXFUSION_COST_TABLES", str(tmp_path))
    cost._tables.cache_clear()
    try:
        y = _two_convs()
        f = fuse_graph(y, *random_params(y, X), rules=["region"])
        assert not f.regions()
        assert any("slower or no faster" in r for r in f.near_misses()), f.text()
    finally:
        cost._tables.cache_clear()


def test_region_fallback_rule():
    assert cost.region_fallback({"convs": 2, "other_ops": 0}).fuse
    assert cost.region_fallback({"convs": 1, "other_ops": 2}).fuse
    assert not cost.region_fallback({"convs": 1, "other_ops": 1}).fuse
    assert cost.decide("fused_region", "float32", "forward", {"convs": 1, "other_ops": 1, "mmacs": 1.0},
                       table={"device": "x", "kind": "cpu", "cpu_flags": [], "date": "", "command": "",
                              "entries": []}).fuse is False


# ---------------------------------------------------------------- the CNN block rules stand aside

def _se_block():
    x = relu(conv(S.var("data"), "c0", 16))
    g = S.Pooling(x, kernel=(1, 1), global_pool=True, pool_type="avg")
    g = S.sigmoid(conv(relu(conv(g, "fc1", 4, k=1, p=0)), "fc2", 16, k=1, p=0))
    return conv(S.broadcast_mul(x, g), "c3")


def test_squeeze_excitation_stands_aside_for_a_region_and_fuses_without_one():
    y = _se_block()
    arg, aux = random_params(y, X)
    f = fuse_graph(y, arg, aux)
    assert f.graph.count_ops() == {"fused_region": 1}
    assert any(r.startswith("taken by a region") for r in f.near_misses("se")), f.text()
    g = fuse_graph(y, arg, aux, rules=["default", "-region"])
    assert g.graph.count_ops().get("fused_se") == 1, g.graph.count_ops()


def test_block_rules_take_what_a_refused_region_leaves():
    """A grouped convolution with its relu is too small a region: grouped_conv fuses it in the next pass."""
    y = relu(conv(S.var("data"), "g", 32, g=4))
    shapes = {"data": (1, 16, 8, 8)}
    f = fuse_graph(y, *random_params(y, shapes), shapes=shapes, rules=["region", "grouped_convolution"])
    assert f.graph.count_ops() == {"fused_grouped_conv": 1}, f.text()


class _RefuseAll:
    """A self-check that refuses every rewrite of rule ``name``."""

    def __init__(self, name):
        self.name = name

    def run(self, rule, candidates):
        return ["self-check: refused for the test" if rule.name == self.name else None for _ in candidates]

    def committed(self, replaced):
        pass


def test_a_region_the_self_check_refuses_leaves_its_ops_to_the_block_rules():
    y = _se_block()
    f = fuse_graph(y, *random_params(y, X), checker=_RefuseAll("region"))
    assert not f.regions() and f.graph.count_ops().get("fused_se") == 1, f.text()
    assert "refused for the test" in " ".join(f.report.rules["region"].rejected.values())


def test_rules_can_be_left_out_by_name():
    names = [r.name for r in resolve_rules(["default", "-region"])]
    assert "region" not in names and "elementwise" in names
    assert [r.name for r in resolve_rules("-region")] == names
    assert "conv_bn" not in [r.name for r in resolve_rules(["-bn_folding"])]
    with pytest.raises(fusion.FusionError):
        resolve_rules(["-no_such_rule"])


# ---------------------------------------------------------------- the graph around regions

def test_fusing_again_changes_nothing():
    y = conv(relu(conv(S.exp(_se_block()), "c4")), "c5")
    arg, aux = random_params(y, X)
    f = fuse_graph(y, arg, aux)
    before = f.graph.to_json()
    again = fuse_graph(Graph.from_json(json.dumps(before)), all_params(f), {})
    assert again.graph.to_json()["nodes"] == before["nodes"]


def test_program_survives_the_symbol_json():
    y = _se_block()
    arg, aux = random_params(y, X)
    f = fuse_graph(y, arg, aux)
    text = json.dumps(f.graph.to_json())
    g = Graph.from_json(text)
    assert [json.loads(n.attrs.raw("program")) for n in g.op_nodes()] == f.programs()
    assert_round_trip(y, arg, aux, Fused(g, f.ctx, f.report))


def test_bf16_regions_compute_in_bfloat16():
    y = _two_convs()
    arg, aux = random_params(y, X)
    f = fuse_graph(y, arg, aux, precision="bfloat16")
    (node,) = f.regions()
    assert node.attrs["precision"] == "bfloat16"
    assert not any(n.attrs.get("__dtype__") for n in f.graph.variables())      # weights stay float32 parameters
    assert policy.computes_reduced(f.graph)


def test_amp_leaves_the_convolutions_to_regions_where_the_op_is():
    emitted = [op for r in resolve_rules(None) for op in r.emits]
    assert policy.convolutions_fused(emitted, {"fused_region": {"forward": {"cpu"}}}) == "fused_region"
    assert policy.convolutions_fused(emitted, {}) is None
    assert policy.convolutions_fused([op for r in resolve_rules("-region") for op in r.emits],
                                     {"fused_region": {"forward": {"cpu"}}}) is None


def test_report_lists_each_region_and_its_cuts():
    y = S.Flatten(S.Pooling(_se_block(), kernel=(1, 1), global_pool=True, pool_type="avg"), name="flat")
    f = fuse_graph(y, *random_params(y, X))
    short = f.report.to_text()
    line = next(ln for ln in short.splitlines() if ln.startswith("  region '"))
    assert "4 convolution(s)" in line and "'data' (a graph input)" in line and "Flatten 'flat'" in line, line
    assert short.splitlines()[0].startswith("mxnet-fusion report")
    full = f.report.to_text(explain=True).splitlines()
    at = full.index(line)
    assert full[at + 1] == "    reads 'data': a graph input" and "read by Flatten 'flat'" in full[at + 2], full
    rec = f.report.to_dict()["rules"]
    assert [r for r in rec if r["rule"] == "region"][0]["matches"][0]["details"]["convolutions"] == 4


def test_unfuse_refuses_a_program_it_cannot_read():
    y = _two_convs()
    f = fuse_graph(y, *random_params(y, X))
    (node,) = f.regions()
    node.attrs["program"] = json.dumps(dict(f.program(), ops=[{"op": "warp", "in": 0}]))
    g = f.graph.copy()
    rep = FusionReport()
    run_rules(g, UNFUSE_RULES, Context(g, all_params(f), {}, "inference"), rep, None)
    assert "unknown op 'warp'" in " ".join(rep.rules["unfuse_region"].rejected.values())


# ---------------------------------------------------------------- with the op (after the merge)

@needs_op
@pytest.mark.parametrize("block", ["se", "bottleneck", "dense", "pose_head", "pose_head_bias"])
def test_fused_region_runs_like_the_stock_ops(block):
    y = {"se": _se_block, "bottleneck": lambda: conv(relu(conv(relu(conv(S.var("data"), "a", k=1, p=0)), "b")),
                                                     "c", k=1, p=0) + S.var("data"),
         "dense": lambda: _dense_layer(_dense_layer(conv(S.var("data"), "s"), "l0"), "l1"),
         "pose_head": _pose_head, "pose_head_bias": lambda: _pose_head(bias=True)}[block]()
    assert_runs_like_the_stock_ops(y, regions=1)


def assert_runs_like_the_stock_ops(y, regions: int):
    """fuse(y) makes ``regions`` fused_region ops and computes what ``y`` computes at two shapes, its
    unfuse too, and fusing it again changes nothing."""
    arg, aux = random_params(y, X)
    res = fusion.fuse(y, arg, aux, input_shapes=X)
    assert ops(res).get("fused_region") == regions, res.report.to_text(explain=True)
    for shapes in (X, {"data": (3, 8, 12, 10)}):
        v = fusion.verify(y, res, (arg, aux), shapes)
        assert v.max_rel <= 1e-4, v
    plain = fusion.unfuse(res.symbol)
    v = fusion.verify(y, (plain, res.arg_params, res.aux_params), (arg, aux), X)
    assert v.max_rel <= 1e-4, v
    again = fusion.fuse(res.symbol, res.arg_params, res.aux_params, input_shapes=X)
    assert again.symbol.tojson() == res.symbol.tojson()
    return res


@needs_op
@pytest.mark.parametrize("form", ["operator", "axes"])
def test_fused_region_runs_like_the_stock_ops_with_the_gate_broadcast_like_the_map(form):
    y = _se_gate_broadcast(form)
    arg, aux = random_params(y, X)
    res = fusion.fuse(y, arg, aux, input_shapes=X)
    assert ops(res) == {"fused_region": 1}, res.report.to_text(explain=True)
    for shapes in (X, {"data": (3, 8, 12, 10)}):
        v = fusion.verify(y, res, (arg, aux), shapes)
        assert v.max_rel <= 1e-4, v
    again = fusion.fuse(res.symbol, res.arg_params, res.aux_params, input_shapes=X)
    assert again.symbol.tojson() == res.symbol.tojson()


@needs_op
def test_fused_symbol_saves_loads_and_binds(tmp_path):
    y = _se_block()
    arg, aux = random_params(y, X)
    res = fusion.fuse(y, arg, aux, input_shapes=X)
    res.symbol.save(str(tmp_path / "m-symbol.json"))
    sym = mx.sym.load(str(tmp_path / "m-symbol.json"))
    mod = mx.mod.Module(sym, data_names=["data"], label_names=None)
    mod.bind(data_shapes=[("data", X["data"])], for_training=False)
    mod.set_params(res.arg_params, res.aux_params)
    x = mx.nd.random.normal(shape=X["data"])
    mod.forward(mx.io.DataBatch([x]), is_train=False)
    v = fusion.verify(y, (sym, res.arg_params, res.aux_params), (arg, aux), X)
    assert v.max_rel <= 1e-4 and mod.get_outputs()[0].shape == (2, 8, 9, 9)


@needs_op
def test_onnx_export_goes_through_unfuse(tmp_path):
    pytest.importorskip("onnxruntime")
    from fusion.onnx.export import export_onnx
    y = _se_block()
    arg, aux = random_params(y, X)
    res = fusion.fuse(y, arg, aux, input_shapes=X)
    assert ops(res).get("fused_region") == 1
    result = export_onnx(res.symbol, res.arg_params, res.aux_params, X, str(tmp_path / "m.onnx"))
    assert result is None or result.ok(1e-4)


@needs_op
def test_bf16_fuse_runs_regions_in_bfloat16_without_amp():
    if policy.native_bf16_reason():
        pytest.skip(policy.native_bf16_reason())
    y = _se_block()
    arg, aux = random_params(y, X)
    res = fusion.fuse(y, arg, aux, input_shapes=X, precision="bf16")
    assert ops(res).get("fused_region") == 1 and "amp_cast" not in ops(res), ops(res)
    assert any("inside fused_region" in n for n in res.report.notes), res.report.notes
    v = fusion.verify(y, res, (arg, aux), X)
    assert v.max_rel <= policy.tolerance(policy.BFLOAT16), v


@needs_op
def test_gluon_backend_fuses_regions_for_inference_and_trains_without_them():
    from mxnet import autograd
    from mxnet.gluon import nn
    net = nn.HybridSequential()
    net.add(nn.Conv2D(8, 3, padding=1), nn.BatchNorm(), nn.Activation("relu"), nn.Conv2D(8, 3, padding=1),
            nn.Activation("relu"), nn.GlobalAvgPool2D(), nn.Dense(10))
    net.initialize(mx.init.Xavier())
    x = mx.nd.random.normal(shape=(2, 3, 12, 12))
    ref = net(x).asnumpy()
    net.hybridize(backend="fusion")
    assert np.abs(net(x).asnumpy() - ref).max() <= 1e-4 * np.abs(ref).max()
    assert net.fusion_report.rules["region"].fused, net.fusion_report.to_text(explain=True)
    with autograd.record():
        loss = net(x).sum()
    loss.backward()
    assert net.fusion_report.mode == "training" and not net.fusion_report.rules["region"].fused


def test_bf16_leaves_amp_out_where_regions_take_the_convolutions(monkeypatch):
    """With fused_region in the op library (faked here) MXNet's AMP does not convert the graph first; a
    convolution no region takes (alone with its relu: too small) stays float32 and the report says so."""
    from fusion.native import library
    caps = dict(library.capabilities())
    caps["fused_region"] = {"forward": frozenset({"cpu"}), "backward": frozenset()}
    monkeypatch.setattr(library, "_capabilities", caps)
    y = relu(conv(S.var("data"), "c1"))
    arg, aux = random_params(y, X)
    res = fusion.fuse(y, arg, aux, input_shapes=X, precision="bf16", force=True)
    assert "amp_cast" not in ops(res) and ops(res).get("Convolution") == 1, ops(res)
    assert any("1 convolution(s) outside stay float32: c1" in n for n in res.report.notes), res.report.notes
    monkeypatch.setattr(library, "_capabilities", {k: v for k, v in caps.items() if k != "fused_region"})
    res = fusion.fuse(y, arg, aux, input_shapes=X, precision="bf16", force=True)
    assert not any("fused_region" in n for n in res.report.notes), res.report.notes


def test_a_gate_of_its_own_input_with_another_constant_is_one_region():
    """x · (clip(x + 2, 0, 6) / 6) after a graph input (not GluonCV's hard-swish: its steps stay apart
    in the op): the op computed it in place over x and was 0.70 off; the self-check refused it."""
    x = S.var("data")
    y = x * (S.clip(x + 2.0, 0, 6) / 6.0)
    y = conv(relu(conv(y, "c1")), "c2")
    f = fuse_round_trip(y)
    assert f.graph.count_ops() == {"fused_region": 1}, f.text()


@needs_op
def test_a_wrong_dilation_is_refused_where_the_region_is_checked_at_smaller_shapes(monkeypatch):
    """The region checked on its own at shapes smaller than the user's: after a stride of 4, its dilated
    convolution's map at the smallest of them (8×8 in, 1×1 after a stride of 8) reads the centre tap alone,
    where a program with the dilation wrong computes the same (it was fused so).  The shapes checked are the smallest where every tap
    is read, and the self-check refuses the wrong program; the right one is fused."""
    y = conv(relu(conv(relu(conv(S.var("data"), "c1", k=8, s=8, p=0)), "c2", d=2, p=2)), "c3")
    shapes = {"data": (1, 8, 64, 64)}
    arg, aux = random_params(y, shapes)
    res = fusion.fuse(y, arg, aux, input_shapes=shapes, rules=["region"])
    assert ops(res) == {"fused_region": 1}, res.report.to_text()
    assert res.report.self_check.alone_smaller == 1, res.report.self_check

    add = region.ProgramBuilder.add

    def undilated(self, d):
        if d.get("op") == "conv" and d.get("dilate") == [2, 2]:
            d = dict(d, dilate=[1, 1], pad=[1, 1])      # the same shapes, the other taps elsewhere
        return add(self, d)

    monkeypatch.setattr(region.ProgramBuilder, "add", undilated)
    res = fusion.fuse(y, arg, aux, input_shapes=shapes, rules=["region"])
    assert "fused_region" not in ops(res), res.report.to_text()
    assert "self-check" in " ".join(res.report.rules["region"].rejected.values())
