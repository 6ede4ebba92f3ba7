"""Parameters in and out of fuse(): checked like the CLI checks them, returned as the caller's kind and
context, never sharing memory with the caller's arrays; models that need no input shapes fuse without them."""
import os

import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.doors import cli
from fusion.ir.errors import ParamsError

from conftest import random_params

S = mx.sym


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def save(folder, name, sym, arg, aux):
    sym.save(str(folder / (name + "-symbol.json")))
    mx.nd.save(str(folder / (name + "-0000.params")), {**{"arg:" + k: v for k, v in arg.items()},
                                                        **{"aux:" + k: v for k, v in aux.items()}})
    return folder / (name + "-symbol.json"), folder / (name + "-0000.params")


# ---------------------------------------------------------------- no --shape: nothing blamed on the params

def causal_lm():
    """Token embedding, a causal mask from arange_like of the input, softmax, a projection."""
    tok = S.var("data")
    h = S.Embedding(tok, input_dim=20, output_dim=8, name="emb")                     # (B, L, 8)
    s = S.batch_dot(h, h, transpose_b=True)                                          # (B, L, L)
    steps = S.contrib.arange_like(tok, axis=1)
    causal = S.broadcast_lesser_equal(S.reshape(steps, shape=(1, -1)), S.reshape(steps, shape=(-1, 1)))
    s = S.broadcast_add(s, S.expand_dims((1 - causal) * -1e9, axis=0))
    o = S.batch_dot(S.softmax(s, axis=-1), h)
    return S.FullyConnected(o, num_hidden=20, flatten=False, name="head")


def test_causal_lm_without_shape(tmp_path, capsys):
    # was: exit 2 "parameter shapes do not fit the graph: ... arange_like0 ... cannot handle param.axis 1"
    sym = causal_lm()
    arg, aux = random_params(sym, {"data": (2, 6)})
    sp, pp = save(tmp_path, "lm", sym, arg, aux)
    code, out, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "out")
    assert code == 0, err
    s1, a1, x1 = mx.model.load_checkpoint(str(tmp_path / "out"), 0)
    v = fusion.verify((sym, arg, aux), (s1, a1, x1), input_shapes={"data": (2, 6)})
    assert v.ok(), v


def test_bert_without_shape(tmp_path, capsys):
    pytest.importorskip("gluonnlp")
    from fusion.testing import gluonnlp_bert

    sym, arg, aux, shapes = gluonnlp_bert(seq=16)
    sp, pp = save(tmp_path, "bert", sym, arg, aux)
    code, out, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "out")
    assert code == 0, err
    assert "attention" in out
    s1, a1, x1 = mx.model.load_checkpoint(str(tmp_path / "out"), 0)
    v = fusion.verify((sym, arg, aux), (s1, a1, x1), input_shapes={"data0": (2, 24), "data1": (2, 24), "data2": (2,)})
    assert v.ok(), v


def test_wrong_params_still_blamed_without_shape(tmp_path, capsys):
    sym = causal_lm()
    arg, aux = random_params(sym, {"data": (2, 6)})
    sp, pp = save(tmp_path, "lm", sym, dict(arg, emb_weight=mx.nd.ones((21, 8))), aux)
    code, _, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "out")
    assert code == 2
    assert "'emb_weight' has shape (21, 8) but Embedding 'emb' (input_dim=20, output_dim=8) needs (20, 8)" in err
    assert len(err.strip().splitlines()) == 1 and not os.path.exists(str(tmp_path / "out") + "-symbol.json")


# ---------------------------------------------------------------- dtypes

MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "models",
                     "mobilenetv2_0.25")
FIRST = "mobilenetv20_features_conv0_weight"


@pytest.fixture(scope="module")
def mobilenet():
    return mx.model.load_checkpoint(MODEL, 0)


@pytest.mark.parametrize("dtype", ["float16", "float64", "int32", "bool", "int8"])
def test_one_weight_of_another_dtype_is_refused_in_one_line(mobilenet, tmp_path, capsys, dtype):
    # was: a traceback with --verify (int8: "ValueError: int8 is not supported." even without),
    # or exit 0 and a model that fails to bind ("This layer requires uniform type")
    sym, arg, aux = mobilenet
    arg = dict(arg, **{FIRST: arg[FIRST].astype(dtype)})
    with pytest.raises(ParamsError, match="parameter '%s' has dtype %s where the graph computes in float32"
                       % (FIRST, dtype)):
        fusion.fuse(sym, arg, aux)
    sp, pp = save(tmp_path, "m", sym, arg, aux)
    for extra in ([], ["--verify", "--shape", "data=1,3,224,224"]):
        code, _, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "out", *extra)
        assert code == 2 and "'%s' has dtype %s" % (FIRST, dtype) in err, err
        assert len(err.strip().splitlines()) == 1
        assert not os.path.exists(str(tmp_path / "out") + "-symbol.json")


def test_a_float64_model_fuses_and_verifies(mobilenet, tmp_path, capsys):
    sym, arg, aux = mobilenet
    arg = {k: v.astype("float64") for k, v in arg.items()}
    aux = {k: v.astype("float64") for k, v in aux.items()}
    res = fusion.fuse(sym, arg, aux, input_shapes={"data": (1, 3, 32, 32)})
    assert {np.dtype(v.dtype).name for v in res.arg_params.values()} == {"float64"}      # folded ones too
    assert res.report.ops_after < res.report.ops_before
    v = fusion.verify((sym, arg, aux), res, input_shapes={"data": (1, 3, 32, 32)})
    assert v.ok(rtol=1e-12), v
    sp, pp = save(tmp_path, "m", sym, arg, aux)
    code, out, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "out", "--verify",
                             "--shape", "data=1,3,32,32")
    assert code == 0 and ": OK" in out, err


def test_integer_parameter_folded_keeps_its_dtype():
    # an int8 constant computed from an int8 parameter: was "ValueError: int8 is not supported." (from_numpy)
    x, p = S.var("data"), S.var("p")
    for dtype in ("int8", "uint8", "int32"):
        y = S.Cast(S.broadcast_add(S.Cast(x, dtype=dtype), p * 1), dtype="float32")
        arg = {"p": mx.nd.array([1, 0, 1, 1]).astype(dtype)}
        res = fusion.fuse(y, arg, {}, input_shapes={"data": (2, 4)})
        (name, value), = res.arg_params.items()
        assert name.endswith("_const") and isinstance(value, mx.nd.NDArray) and np.dtype(value.dtype).name == dtype
        v = fusion.verify((y, arg, {}), res, input_shapes={"data": (2, 4)})
        assert v.ok(), v


def test_unsupported_dtype_is_refused():
    x = S.var("data")
    y = S.FullyConnected(x, num_hidden=2, name="fc")
    with pytest.raises(ParamsError, match="'fc_weight' has dtype int16"):
        fusion.fuse(y, {"fc_weight": np.ones((2, 3), np.int16), "fc_bias": np.zeros(2, np.float32)})


# ---------------------------------------------------------------- the same checks as mxfuse

def test_nan_weights_refused_like_the_cli(mobilenet):
    sym, arg, aux = mobilenet
    w = arg[FIRST].asnumpy().copy()
    w[0, 0, 0, 0] = np.nan
    with pytest.raises(ParamsError, match="parameter '%s' contains NaN or inf" % FIRST):
        fusion.fuse(sym, dict(arg, **{FIRST: mx.nd.array(w)}), aux)
    var = "mobilenetv20_features_batchnorm0_running_var"
    with pytest.raises(ParamsError, match="negative moving variance in '%s'" % var):
        fusion.fuse(sym, arg, dict(aux, **{var: -aux[var]}))


def test_gluon_block_with_nan_weights_runs_unfused():
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Conv2D(4, 3), mx.gluon.nn.BatchNorm())
    net.initialize()
    x = mx.nd.ones((1, 3, 6, 6))
    net(x)
    net[0].weight.set_data(mx.nd.full(net[0].weight.shape, np.nan))
    ref = net(x).asnumpy()
    net.hybridize(backend="fusion")
    with pytest.warns(RuntimeWarning, match="contains NaN or inf"):
        out = net(x).asnumpy()
    assert np.array_equal(np.isnan(out), np.isnan(ref))


# ---------------------------------------------------------------- what fuse() returns

def test_rules_as_one_string(mobilenet):
    # was: iterated by character ("unknown rule 'c'")
    sym, arg, aux = mobilenet
    res = fusion.fuse(sym, arg, aux, rules="conv_bn_act", self_check=False)
    from patterns import rules_by_name

    assert set(res.report.rules) == {r.name for r in rules_by_name()["conv_bn_act"]}
    assert sum(len(r.fused) for r in res.report.rules.values()) > 0


def test_numpy_params_give_ndarrays(mobilenet):
    sym, arg, aux = mobilenet
    res = fusion.fuse(sym, {k: v.asnumpy() for k, v in arg.items()}, {k: v.asnumpy() for k, v in aux.items()},
                      self_check=False)
    kinds = {type(v) for v in list(res.arg_params.values()) + list(res.aux_params.values())}
    assert kinds == {mx.nd.NDArray}


def test_result_shares_no_memory_with_the_callers_arrays(mobilenet):
    sym, arg, aux = mobilenet
    arg = {k: v.copy() for k, v in arg.items()}
    res = fusion.fuse(sym, arg, aux, self_check=False)
    kept = [k for k in res.arg_params if k in arg]
    assert kept, "the classifier's weight is kept"
    before = {k: res.arg_params[k].asnumpy().copy() for k in kept}
    for k in kept:
        assert res.arg_params[k] is not arg[k]
        arg[k][:] = 0                    # the caller updates its arrays in place (an optimizer step)
    for k in kept:
        assert np.array_equal(res.arg_params[k].asnumpy(), before[k]), k


@pytest.mark.parametrize("where", [mx.cpu(1), mx.cpu_pinned()])
def test_new_params_on_their_sources_context(mobilenet, where):
    # was: new params on cpu(0) whatever the context of the params they were computed from
    sym, arg, aux = mobilenet
    arg = {k: v.as_in_context(where) for k, v in arg.items()}
    aux = {k: v.as_in_context(where) for k, v in aux.items()}
    res = fusion.fuse(sym, arg, aux, self_check=False)
    params = list(res.arg_params.values()) + list(res.aux_params.values())
    assert {p.context for p in params} == {where}
    x = mx.nd.array(np.random.default_rng(0).standard_normal((1, 3, 32, 32)), ctx=where)
    exe = res.symbol.bind(where, dict(res.arg_params, data=x), aux_states=res.aux_params)
    ref = sym.bind(where, dict(arg, data=x), aux_states=aux).forward()[0].asnumpy()
    out = exe.forward()[0].asnumpy()
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-4


# ---------------------------------------------------------------- Symbol.optimize_for keeps the caller's params

def test_optimize_for_adds_and_keeps(mobilenet):
    # was: 159 of 161 args and all aux deleted; the original symbol could not be bound with the same dicts
    sym, arg, aux = mobilenet
    args, auxs = dict(arg), dict(aux)
    fused = sym.optimize_for("fusion", args, auxs)
    assert all(args[k] is arg[k] for k in arg) and all(auxs[k] is aux[k] for k in aux)
    assert set(args) > set(arg) and set(auxs) == set(aux)
    x = mx.nd.array(np.random.default_rng(0).standard_normal((1, 3, 32, 32)))
    ref = sym.bind(mx.cpu(), dict(args, data=x), aux_states=auxs).forward()[0].asnumpy()
    out = fused.bind(mx.cpu(), {k: v for k, v in dict(args, data=x).items() if k in fused.list_arguments()},
                     aux_states={k: v for k, v in auxs.items() if k in fused.list_auxiliary_states()}
                     ).forward()[0].asnumpy()
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-4
