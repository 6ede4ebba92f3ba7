"""Graphs this project writes run right under MXNet 1.9.1's default bind (its oneDNN subgraph backend),
which hands a layer output that is also a graph output the value of what it fuses after the layer
(fusion/engine/workarounds.py): fused and unfused graphs give the op-by-op values (backend off); an input
model MXNet itself would miscompute is named in the report and on mxfuse's stderr."""
import json

import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.doors import cli
from fusion.native.env import subgraph_backend
from fusion.ir.graph import Graph
from fusion.engine.workarounds import CONV_CHAIN_NEXT, backend_hazards, guard_layer_outputs, strip_guards

from conftest import random_params

S = mx.sym
IMG = {"data": (2, 3, 5, 5), "r": (2, 4, 5, 5)}


def run(sym, arg, aux, inputs, default_bind):
    """Outputs of ``sym`` bound for inference: MXNet's default bind, or op by op (backend off)."""
    with subgraph_backend(default_bind):
        args = {k: mx.nd.array(v) for k, v in {**arg, **inputs}.items() if k in sym.list_arguments()}
        exe = sym.bind(mx.cpu(), args, aux_states={k: mx.nd.array(v) for k, v in aux.items()}, grad_req="null")
        return [o.asnumpy() for o in exe.forward(is_train=False)]


def _inputs(sym, shapes, seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(v).astype(np.float32) * 2 for k, v in shapes.items() if k in sym.list_arguments()}


def _check_default_bind(sym, arg, aux, inputs, ref):
    got = run(sym, arg, aux, inputs, default_bind=True)
    assert len(got) == len(ref)
    for o, r in zip(got, ref):
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5)


def _conv():
    return S.Convolution(S.var("data"), kernel=(1, 1), num_filter=4, name="conv")


def _bn(t):
    return S.BatchNorm(t, fix_gamma=False, name="bn")


def _relu(t):
    return S.Activation(t, act_type="relu")


def _exposed(member, after):
    """Group([after(member), member]): the chain member is a graph output and read by what follows."""
    return S.Group([after(member), member])


HAZARDS = {      # a member of the chain MXNet's convolution pass fuses is also an output
    "conv_bn_head_relu": lambda: _exposed(_bn(_conv()), _relu),
    "conv_add_head_relu": lambda: _exposed(_conv() + S.var("r"), _relu),
    "conv_bn_add_head_relu": lambda: _exposed(_bn(_conv()) + S.var("r"), _relu),
    "conv_head_add": lambda: _exposed(_conv(), lambda t: t + S.var("r")),
}


def _model(name):
    y = HAZARDS[name]()
    shapes = {k: v for k, v in IMG.items() if k in y.list_arguments()}
    arg, aux = random_params(y, shapes)
    return y, shapes, arg, aux


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("name", sorted(HAZARDS))
def test_fused_graph_runs_right_under_the_default_bind(name, mode):
    y, shapes, arg, aux = _model(name)
    inputs = _inputs(y, shapes)
    ref = run(y, arg, aux, inputs, default_bind=False)
    original = run(y, arg, aux, inputs, default_bind=True)
    assert any(not np.allclose(o, r, atol=1e-3) for o, r in zip(original, ref))     # MXNet's own bug, as given
    res = fusion.fuse(y, arg, aux, input_shapes=shapes, mode=mode)
    _check_default_bind(res.symbol, res.arg_params, res.aux_params, inputs, ref)
    assert res.report.extra["mxnet_miscomputes_original"] == backend_hazards(Graph.from_symbol(y))
    assert any(n.startswith("warning: MXNet 1.9.1's default bind") for n in res.report.notes)
    unfused = fusion.unfuse(res.symbol, input_shapes=shapes, arg_params=res.arg_params, aux_params=res.aux_params)
    _check_default_bind(unfused, res.arg_params, res.aux_params, inputs, ref)


def test_unfuse_guards_a_layer_output_its_stock_form_exposes():
    """A fused_dense that is an output and read by a GELU: un-fused it is a FullyConnected read by
    LeakyReLU(gelu), which MXNet's FullyConnected pass fuses, handing the output the GELU's value."""
    x = S.var("data")
    fc = S.FullyConnected(x, num_hidden=6, flatten=False, name="fc")
    y = S.Group([(fc * 0.5) * (S.erf(fc / 1.4142135623730951) + 1.0), fc])
    shapes = {"data": (2, 6, 5)}          # rows enough for a bare FullyConnected to become fused_dense
    arg, aux = random_params(y, shapes)
    inputs = _inputs(y, shapes, seed=1)
    ref = run(y, arg, aux, inputs, default_bind=False)
    res = fusion.fuse(y, arg, aux, input_shapes=shapes, rules=["dense_act", "gelu"])
    assert "fused_dense" in res.graph.count_ops() and "Reshape" not in res.graph.count_ops()
    plain = fusion.unfuse(res.symbol, input_shapes=shapes, arg_params=res.arg_params, aux_params=res.aux_params)
    ops = [n["op"] for n in json.loads(plain.tojson())["nodes"]]
    assert "FullyConnected" in ops and "Reshape" in ops
    _check_default_bind(plain, res.arg_params, res.aux_params, inputs, ref)


def test_a_layer_output_handed_out_through_copy_is_a_hazard_and_guarded():
    """``_copy`` (what keeps an output's name) hands the layer's output out as a graph output does:
    MXNet's convolution pass fuses the sigmoid and gives _copy its value too."""
    conv = _conv()
    y = S.Group([S.Activation(conv, act_type="sigmoid"), S._internal._copy(conv)])
    shapes = {"data": IMG["data"]}
    arg, aux = random_params(y, shapes)
    inputs = _inputs(y, shapes, seed=2)
    ref = run(y, arg, aux, inputs, default_bind=False)
    assert len(backend_hazards(Graph.from_symbol(y))) == 1
    g = Graph.from_symbol(y)
    assert guard_layer_outputs(g) == ["conv"]
    _check_default_bind(g.to_symbol(), arg, aux, inputs, ref)


def test_unfuse_of_a_region_giving_back_a_layer_output_is_guarded():
    """A region that gives back a convolution's output (a graph output, kept as _copy) read inside by
    a sigmoid: un-fused, the stock Convolution is read by both, and MXNet would hand out the sigmoid."""
    from fusion.engine.rewrite import implemented
    if not implemented("fused_region", "cpu"):
        pytest.skip("this op library has no CPU fused_region")
    x = S.var("data")
    gate = S.Convolution(S.Activation(S.Convolution(S.contrib.AdaptiveAvgPooling2D(x, output_size=1), kernel=(1, 1),
                                                    num_filter=2, name="fc0"), act_type="relu"),
                         kernel=(1, 1), num_filter=3, name="fc1")
    y = S.Group([S.broadcast_mul(x, S.sigmoid(gate)), gate])
    shapes = {"data": IMG["data"]}
    arg, aux = random_params(y, shapes)
    inputs = _inputs(y, shapes, seed=3)
    ref = run(y, arg, aux, inputs, default_bind=False)
    res = fusion.fuse(y, arg, aux, input_shapes=shapes)
    assert "fused_region" in res.graph.count_ops(), res.report.to_text(explain=True)
    _check_default_bind(res.symbol, res.arg_params, res.aux_params, inputs, ref)
    plain = fusion.unfuse(res.symbol, input_shapes=shapes, arg_params=res.arg_params, aux_params=res.aux_params)
    assert "Reshape" in [n["op"] for n in json.loads(plain.tojson())["nodes"]]
    _check_default_bind(plain, res.arg_params, res.aux_params, inputs, ref)


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_batchnorm_statistics_of_a_convolution_are_guarded(mode):
    """Convolution → BatchNorm(output_mean_var=True) with its variance read: MXNet's convolution pass
    folds the BatchNorm and hands out the convolution's (N, C, H, W) output as the (C,) variance."""
    bn = S.BatchNorm(_conv(), fix_gamma=False, output_mean_var=True, name="bn")
    y = S.Group([bn[0], S.relu(bn[2])])
    shapes = {"data": IMG["data"]}
    arg, aux = random_params(y, shapes)
    inputs = _inputs(y, shapes, seed=4)
    ref = run(y, arg, aux, inputs, default_bind=False)
    original = run(y, arg, aux, inputs, default_bind=True)
    assert [o.shape for o in original] != [r.shape for r in ref]        # MXNet's own bug, as given
    assert backend_hazards(Graph.from_symbol(y)) == ["conv -> bn"]
    assert backend_hazards(Graph.from_symbol(S.Group([bn[0]]))) == []  # the statistics unread: right
    res = fusion.fuse(y, arg, aux, input_shapes=shapes, mode=mode)
    _check_default_bind(res.symbol, res.arg_params, res.aux_params, inputs, ref)
    plain = fusion.unfuse(res.symbol, input_shapes=shapes, arg_params=res.arg_params, aux_params=res.aux_params)
    _check_default_bind(plain, res.arg_params, res.aux_params, inputs, ref)


def test_an_add_of_a_convolution_with_itself_is_guarded():
    """``elemwise_add(conv, conv)`` (what un-fusing writes for ``broadcast_add(x, x)``): MXNet's pass
    fuses the add as a sum into the convolution and the bind fails (measured); the second operand is
    guarded."""
    for chain in (_conv(), _bn(_conv())):
        y = S.relu(S.elemwise_add(chain, chain))
        shapes = {"data": IMG["data"]}
        arg, aux = random_params(y, shapes)
        inputs = _inputs(y, shapes, seed=5)
        ref = run(y, arg, aux, inputs, default_bind=False)
        with pytest.raises(mx.base.MXNetError):          # "Shape inconsistent" / "Check failed: !is_none()"
            run(y, arg, aux, inputs, default_bind=True)
        g = Graph.from_symbol(y)
        assert len(backend_hazards(g)) == 1
        guard_layer_outputs(g)
        add = next(n for n in g.nodes if n.op == "elemwise_add")
        assert [e.node.op for e in add.inputs] == [("Convolution" if chain.name == "conv" else "BatchNorm"), "Reshape"]
        _check_default_bind(g.to_symbol(), arg, aux, inputs, ref)
    # the form a user writes (broadcast_add, which the pass does not take) round-trips through unfuse
    bn = _bn(_conv())
    y = S.relu(S.broadcast_add(bn, bn))
    arg, aux = random_params(y, {"data": IMG["data"]})
    inputs = _inputs(y, {"data": IMG["data"]}, seed=6)
    ref = run(y, arg, aux, inputs, default_bind=False)
    res = fusion.fuse(y, arg, aux, input_shapes={"data": IMG["data"]})
    plain = fusion.unfuse(res.symbol, input_shapes={"data": IMG["data"]}, arg_params=res.arg_params,
                          aux_params=res.aux_params)
    _check_default_bind(plain, res.arg_params, res.aux_params, inputs, ref)


def test_no_warning_and_no_guard_where_nothing_is_exposed():
    y = _relu(_bn(_conv()))                      # the chain's last value is the only output
    shapes = {"data": IMG["data"]}
    arg, aux = random_params(y, shapes)
    res = fusion.fuse(y, arg, aux, input_shapes=shapes, mode="training")
    assert "mxnet_miscomputes_original" not in res.report.extra
    assert not any("default bind" in n for n in res.report.notes)
    assert "Reshape" not in res.graph.count_ops()
    # read by another op, not handed out: MXNet's pass stops its chain there (measured right)
    bn = _bn(_conv())
    assert backend_hazards(Graph.from_symbol(S.Group([_relu(bn), S.tanh(bn)]))) == []


def test_mxfuse_warns_about_an_input_model_mxnet_runs_wrong(tmp_path, capsys):
    y, shapes, arg, aux = _model("conv_bn_head_relu")
    y.save(str(tmp_path / "m-symbol.json"))
    mx.nd.save(str(tmp_path / "m-0000.params"), {**{"arg:" + k: v for k, v in arg.items()},
                                                 **{"aux:" + k: v for k, v in aux.items()}})
    code = cli.main([str(tmp_path / "m-symbol.json"), "--params", str(tmp_path / "m-0000.params"), "-o",
                     str(tmp_path / "out" / "m"), "--shape", "data=2,3,5,5", "--report", str(tmp_path / "r.json")])
    _, err = capsys.readouterr()
    assert code == 0, err
    assert "mxfuse: warning: MXNet's default bind computes the input model wrong" in err and "bn -> " in err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["mxnet_miscomputes_original"] and any("default bind" in n for n in report["notes"])


@pytest.mark.parametrize("member", ["BatchNorm", "elemwise_add"])
def test_chain_list_covers_what_mxnet_fuses_after_a_chain_member(member):
    """Measured against the installed MXNet: a reader of a conv-chain member that is also a graph
    output, which comes out different with the backend on, is in CONV_CHAIN_NEXT."""
    readers = {"relu": _relu, "sigmoid": lambda t: S.Activation(t, act_type="sigmoid"),
               "gelu": lambda t: S.LeakyReLU(t, act_type="gelu"), "clip": lambda t: S.clip(t, 0.0, 6.0),
               "elemwise_add": lambda t: t + S.var("r"), "tanh": S.tanh, "exp": S.exp}
    ops = {"relu": "Activation", "sigmoid": "Activation", "gelu": "LeakyReLU", "clip": "clip",
           "elemwise_add": "elemwise_add", "tanh": "tanh", "exp": "exp"}
    missing = []
    for name, make in readers.items():
        if member == "elemwise_add" and name == "elemwise_add":
            continue
        m = _bn(_conv()) if member == "BatchNorm" else _conv() + S.var("r2")
        y = S.Group([make(m), m])
        shapes = {k: v for k, v in dict(IMG, r2=IMG["r"]).items() if k in y.list_arguments()}
        arg, aux = random_params(y, shapes)
        inputs = _inputs(y, shapes, seed=2)
        ref, got = run(y, arg, aux, inputs, False), run(y, arg, aux, inputs, True)
        wrong = any(not np.allclose(o, r, rtol=1e-5, atol=1e-5) for o, r in zip(got, ref))
        if wrong and ops[name] not in CONV_CHAIN_NEXT[member]:
            missing.append(name)
    assert not missing, missing


# ---------------------------------------------------------------- NaN and inf through a fused activation

def _nan_inputs(shape, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 2
    x.flat[0], x.flat[1], x.flat[2] = np.nan, np.inf, -np.inf
    return x


def _dense_head(between):
    """FullyConnected -> ``between`` -> clip(0, 6): MXNet's backend does not fuse the clip into the layer."""
    fc = S.FullyConnected(S.var("data"), num_hidden=8, name="fc")
    return S.clip(between(fc), 0.0, 6.0, name="clip")


def _conv_head(between, act=_relu):
    return act(between(S.Convolution(S.var("data"), kernel=(1, 1), num_filter=4, name="conv")))


NEW_NAN_FUSIONS = {     # a rewrite leaves a layer and an op the backend fuses with other NaN results adjacent
    "dense_bn_clip": (lambda: _dense_head(lambda t: S.BatchNorm(t, axis=1, fix_gamma=False, name="bn")), (2, 6)),
    "dense_dropout_clip": (lambda: _dense_head(lambda t: S.Dropout(t, p=0.5, name="drop")), (2, 6)),
    "conv_dropout_relu": (lambda: _conv_head(lambda t: S.Dropout(t, p=0.5, name="drop")), (2, 3, 5, 5)),
    "conv_dropout_sigmoid": (lambda: _conv_head(lambda t: S.Dropout(t, p=0.5, name="drop"),
                                                lambda t: S.Activation(t, act_type="sigmoid", name="sig")), (2, 3, 5, 5)),
}


def _assert_same_values(got, ref):
    for o, r in zip(got, ref):
        assert np.array_equal(np.isnan(o), np.isnan(r)) and np.array_equal(np.isinf(o), np.isinf(r))
        fin = np.isfinite(r)
        np.testing.assert_allclose(o[fin], r[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(NEW_NAN_FUSIONS))
def test_an_op_a_rewrite_leaves_after_a_layer_keeps_its_nan_and_inf_results(name):
    """A folded BatchNorm or a removed Dropout puts an op right after a layer where MXNet's backend fuses
    it, with other NaN results (fc -> clip(0, 6): 0, where the clip op gives NaN; conv -> relu: NaN,
    where the relu op gives 0): it reads the layer through the identity guard, and the fused model
    under the default bind gives the NaN and inf the original gives there (and unfuse keeps them)."""
    make, shape = NEW_NAN_FUSIONS[name]
    y = make()
    arg, aux = random_params(y, {"data": shape})
    x = {"data": _nan_inputs(shape)}
    ref = run(y, arg, aux, x, default_bind=False)
    res = fusion.fuse(y, arg, aux, input_shapes={"data": shape})
    assert res.graph.count_ops().get("Reshape") == 1, res.graph.count_ops()
    bare = res.graph.copy()
    strip_guards(bare)                      # what the guard keeps away: other NaN positions
    got = run(bare.to_symbol(), res.arg_params, res.aux_params, x, default_bind=True)
    assert any(not np.array_equal(np.isnan(o), np.isnan(r)) for o, r in zip(got, ref))
    assert any("change their NaN and inf results" in n for n in res.report.notes), res.report.notes
    _assert_same_values(run(res.symbol, res.arg_params, res.aux_params, x, default_bind=True), ref)
    plain = fusion.unfuse(res.symbol)
    _assert_same_values(run(plain, res.arg_params, res.aux_params, x, default_bind=True), ref)
    again = fusion.fuse(res.symbol, res.arg_params, res.aux_params, input_shapes={"data": shape})
    assert again.symbol.tojson() == res.symbol.tojson()


@pytest.mark.parametrize("name", ["conv_bn_relu", "conv_relu", "dense_bn_relu", "dense_clip"])
def test_no_guard_where_the_backend_fused_the_op_before_or_keeps_its_results(name):
    """conv -> BatchNorm -> relu: the backend's convolution chain takes the BatchNorm too, so the original
    ran relu fused already; fc -> relu: the same results fused or not; fc -> clip written so: the
    original's own default bind fuses it."""
    make, shape = {
        "conv_bn_relu": (lambda: _conv_head(_bn), (2, 3, 5, 5)),
        "conv_relu": (lambda: _conv_head(lambda t: t), (2, 3, 5, 5)),
        "dense_bn_relu": (lambda: _relu(S.BatchNorm(S.FullyConnected(S.var("data"), num_hidden=8, name="fc"),
                                                    axis=1, fix_gamma=False, name="bn")), (2, 6)),
        "dense_clip": (lambda: _dense_head(lambda t: t), (2, 6)),
    }[name]
    y = make()
    arg, aux = random_params(y, {"data": shape})
    res = fusion.fuse(y, arg, aux, input_shapes={"data": shape})
    assert "Reshape" not in res.graph.count_ops(), res.graph.count_ops()
    assert not any("NaN and inf" in n for n in res.report.notes), res.report.notes
