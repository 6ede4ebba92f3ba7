"""deconv_act (opt-in, family ``deconvolution``): Deconvolution [→ relu] → fused_deconv (oneDNN 3.x),
made only where the CPU's cost table says it pays; the op against MXNet's Deconvolution."""
import json

import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.engine import cost

from conftest import fuse_and_check, ops, random_params

S = mx.sym


@pytest.fixture
def no_cost(monkeypatch):
    monkeypatch.setenv("MXFUSION_NO_COST", "1")


@pytest.fixture
def no_table(tmp_path, monkeypatch):
    monkeypatch.delenv("MXFUSION_NO_COST", raising=False)
    monkeypatch.setenv("MXFUSION_COST_TABLES", "")
    monkeypatch.setattr(cost, "TABLES_DIR", str(tmp_path))
    cost._tables.cache_clear()
    yield
    cost._tables.cache_clear()


def head(act=True, no_bias=False, **kw):
    """conv → Deconvolution → BatchNorm [→ relu] (a pose head's layer; the BatchNorm is folded first)."""
    attrs = dict(kernel=(4, 4), stride=(2, 2), pad=(1, 1))
    attrs.update(kw)
    x = S.Convolution(S.var("data"), num_filter=6, kernel=(3, 3), pad=(1, 1), name="c")
    y = S.Deconvolution(x, num_filter=5, no_bias=no_bias, name="deconv", **attrs)
    y = S.BatchNorm(y, fix_gamma=False, name="bn")
    return S.Activation(y, act_type="relu", name="act") if act else y


SHAPES = {"data": (1, 3, 5, 4)}
RULES = ["bn_folding", "deconvolution"]


@pytest.mark.parametrize("act", [True, False])
@pytest.mark.parametrize("attrs", [{}, {"adj": (1, 1), "pad": (1, 1)}, {"kernel": (3, 2), "stride": (1, 2), "pad": (1, 0)},
                                   {"dilate": (2, 2), "kernel": (3, 3), "stride": (2, 2), "pad": (2, 2)}])
def test_deconvolution_fuses_and_matches(no_cost, act, attrs):
    res = fuse_and_check(head(act=act, **attrs), SHAPES, rules=RULES, rtol=1e-5)
    counts = ops(res)
    assert counts.get("fused_deconv") == 1 and "Deconvolution" not in counts and "BatchNorm" not in counts
    assert "Activation" not in counts          # the relu is the op's post-op
    # the fused model at another batch size and plane
    other = {"data": (3, 3, 7, 6)}
    arg, aux = random_params(head(act=act, **attrs), SHAPES)
    fused = fusion.fuse(head(act=act, **attrs), arg, aux, rules=RULES, input_shapes=SHAPES)
    v = fusion.verify((head(act=act, **attrs), arg, aux), fused, input_shapes=other)
    assert v.max_rel <= 1e-5, v


def test_direct_loop_matches(no_cost, monkeypatch):
    monkeypatch.setenv("MXFUSION_NO_DNNL_CONV", "1")
    res = fuse_and_check(head(adj=(1, 0), pad=(1, 1)), SHAPES, rules=RULES, rtol=1e-5)
    assert ops(res).get("fused_deconv") == 1


def test_unfuse_gives_stock_ops(no_cost):
    sym = head()
    arg, aux = random_params(sym, SHAPES)
    res = fusion.fuse(sym, arg, aux, rules=RULES, input_shapes=SHAPES)
    plain = fusion.unfuse(res.symbol)
    counts = ops(plain)
    assert "fused_deconv" not in counts and counts["Deconvolution"] == 1 and counts["Activation"] == 1
    v = fusion.verify((sym, arg, aux), (plain, res.arg_params, res.aux_params), input_shapes=SHAPES)
    assert v.max_rel <= 1e-5, v


def test_not_in_the_default_rules():
    sym = head()
    arg, aux = random_params(sym, SHAPES)
    assert "fused_deconv" not in ops(fusion.fuse(sym, arg, aux, input_shapes=SHAPES))


def test_declined_without_a_cost_table(no_table):
    sym = head()
    arg, aux = random_params(sym, SHAPES)
    res = fusion.fuse(sym, arg, aux, rules=RULES, input_shapes=SHAPES)
    assert "fused_deconv" not in ops(res)
    text = res.report.to_text()
    assert "Deconvolution 'deconv' stays MXNet's" in text and "no cost table measured on this CPU" in text, text


def test_follows_a_measured_table(tmp_path, monkeypatch):
    here, flags = cost.cpu_identity()
    case = {"kernel": "4x4/2", "relu": True, "adds_reorders": True, "c_in": 6, "c_out": 5, "out_pixels": 80}
    for fused_ms, expect in ((0.5, True), (2.0, False)):
        table = {"device": here, "kind": "cpu", "cpu_flags": list(flags), "date": "2026-01-01", "command": "test",
                 "entries": [{"op": "fused_deconv", "dtype": "float32", "pass": "forward", "case": case,
                              "fused_ms": fused_ms, "unfused_ms": 1.0, "reference": "MXNet default bind"}]}
        (tmp_path / "t.json").write_text(json.dumps(table))
        monkeypatch.setenv("MXFUSION_COST_TABLES", str(tmp_path))
        monkeypatch.delenv("MXFUSION_NO_COST", raising=False)
        cost._tables.cache_clear()
        sym = head()
        arg, aux = random_params(sym, SHAPES)
        res = fusion.fuse(sym, arg, aux, rules=RULES, input_shapes=SHAPES)
        assert ("fused_deconv" in ops(res)) is expect, res.report.to_text()
    cost._tables.cache_clear()


@pytest.mark.parametrize("kw, says", [
    ({"num_group": 3, "num_filter": 6}, "is grouped"),
    ({"target_shape": (10, 8)}, "sets target_shape"),
    ({"adj": (1, 1), "pad": (0, 0)}, "larger than pad"),
])
def test_refusals_say_why(no_cost, kw, says):
    x = S.var("data")
    attrs = dict(kernel=(4, 4), stride=(2, 2), pad=(1, 1), num_filter=5, no_bias=False, name="deconv")
    attrs.update(kw)
    y = S.Activation(S.Deconvolution(x, **attrs), act_type="relu")
    shapes = {"data": (1, 6, 5, 4)}
    arg, aux = random_params(y, shapes)
    res = fusion.fuse(y, arg, aux, rules=RULES, input_shapes=shapes)
    assert "fused_deconv" not in ops(res)
    assert says in res.report.to_text(explain=True), res.report.to_text(explain=True)


def test_training_and_gpu_refused(no_cost):
    sym = head()
    arg, aux = random_params(sym, SHAPES)
    res = fusion.fuse(sym, arg, aux, rules=["deconvolution"], input_shapes=SHAPES, mode="training")
    assert "fused_deconv" not in ops(res) and "no backward" in res.report.to_text()
    res = fusion.fuse(sym, arg, aux, rules=RULES, input_shapes=SHAPES, device="gpu", self_check=False)
    assert "fused_deconv" not in ops(res)


def test_op_rejects_bad_attributes():
    x, w = mx.nd.ones((1, 2, 3, 3)), mx.nd.ones((2, 4, 3, 3))
    with pytest.raises(mx.base.MXNetError, match="adj between 0 and pad"):
        mx.nd.fused_deconv(x, w, kernel=(3, 3), pad=(0, 0), adj=(1, 1), num_filter=4, no_bias=True).wait_to_read()
    with pytest.raises(mx.base.MXNetError, match="weight must be"):
        mx.nd.fused_deconv(x, w, kernel=(3, 3), num_filter=5, no_bias=True).wait_to_read()
    y = mx.nd.fused_deconv(x, w, kernel=(3, 3), num_filter=4, no_bias=True)
    ref = mx.nd.Deconvolution(x, w, kernel=(3, 3), num_filter=4, no_bias=True)
    assert np.allclose(y.asnumpy(), ref.asnumpy(), rtol=1e-5, atol=1e-5)
