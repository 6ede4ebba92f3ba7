"""precision='bf16' on graphs with convolutions when the rules of the run cannot give them to a
``fused_region`` (``rules=[..., "-region"]``): MXNet's AMP converts them first, and where AMP
cannot convert a graph, or MXNet cannot run the graph AMP gives, the convolutions stay float32
with the reason in the report (the rest of the graph is fused as under precision='bf16').

With the default rules the convolutions a region takes run in bfloat16 inside it and AMP is not
run (``test_default_rules_leave_amp_out``; tests/test_region.py has the region's own)."""
from __future__ import annotations

import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.precision import policy as P

from conftest import ops, random_params

S = mx.sym
BF16_TOL = P.TOLERANCE[P.BFLOAT16]
needs_bf16 = pytest.mark.skipif(P.native_bf16_reason() is not None,
                                reason="this CPU has no native bfloat16: %s" % P.native_bf16_reason())


def _runs_within_bf16(sym, arg, aux, res, shapes):
    """The fused graph runs at ``shapes`` and at twice the batch, within the bf16 tolerance."""
    for scale in (1, 2):
        s = {k: (v[0] * scale,) + tuple(v[1:]) for k, v in shapes.items()}
        v = fusion.verify((sym, arg, aux), res, input_shapes=s)
        assert v.max_rel <= BF16_TOL, (s, v)


#: the rule library without the region rule: the path on which MXNet's AMP converts the convolutions
NO_REGION = ["default", "-region"]


def _conv(x, name, num_filter=4):
    return S.Convolution(x, num_filter=num_filter, kernel=(3, 3), pad=(1, 1), name=name)


@needs_bf16
def test_amp_cannot_convert_the_graph_convolutions_stay_float32():
    """AMP's own type inference fails on a Concat of a bfloat16 convolution and a float32 input."""
    sym = S.Concat(S.var("a"), _conv(S.var("b"), "c0"), dim=1, name="cat")
    shapes = {"a": (1, 2, 5, 5), "b": (1, 3, 5, 5)}
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16", rules=NO_REGION)
    text = res.report.to_text()
    assert "the 1 convolution(s) stay float32: MXNet's AMP cannot convert the graph" in text, text
    assert "Non-uniform data type in Concat" in text
    assert not any(P.is_bf16(v.dtype) for v in res.arg_params.values())
    _runs_within_bf16(sym, arg, aux, res, shapes)


@needs_bf16
def test_amp_graph_without_a_bf16_kernel_keeps_the_convolutions_float32():
    """AMP's lists put Activation in bfloat16, and MXNet has no bfloat16 softsign: the graph AMP
    gives does not run, so it is not taken."""
    sym = S.Activation(_conv(S.var("data"), "c0"), act_type="softsign", name="act")
    shapes = {"data": (1, 3, 6, 6)}
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16", rules=NO_REGION)
    text = res.report.to_text()
    assert "stay float32: MXNet cannot run AMP's graph of it: MXNetError: Unknown type enum" in text, text
    assert "amp_cast" not in ops(res)
    _runs_within_bf16(sym, arg, aux, res, shapes)
    # a relu there has a bfloat16 kernel: AMP's graph is taken
    sym = S.Activation(_conv(S.var("data"), "c0"), act_type="relu", name="act")
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16", rules=NO_REGION)
    assert "MXNet's AMP converted the graph first" in res.report.to_text()
    _runs_within_bf16(sym, arg, aux, res, shapes)


@needs_bf16
def test_without_input_shapes_amp_graph_is_not_taken_untried():
    sym = S.Activation(_conv(S.var("data"), "c0"), act_type="relu", name="act")
    shapes = {"data": (1, 3, 6, 6)}
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, precision="bf16", rules=NO_REGION)
    text = res.report.to_text()
    assert "the shape of input(s) data is not given" in text and "pass input_shapes" in text, text
    assert not any(P.is_bf16(v.dtype) for v in res.arg_params.values())
    _runs_within_bf16(sym, arg, aux, res, shapes)


@needs_bf16
def test_outputs_amp_leaves_in_bf16_are_cast_back_even_where_type_inference_cannot_tell():
    """A graph output computed from a weight AMP cast to bfloat16 (a sum of a convolution's
    weight) next to a split-attention tail whose types MXNet cannot infer from the parameters
    alone: the dtypes of a run decide which outputs are cast back to float32."""
    w0 = S.var("fc0_weight")
    fc0 = S.Convolution(S.var("pooled"), w0, S.var("fc0_bias"), kernel=(1, 1), num_filter=4, name="fc0")
    fc1 = S.Convolution(fc0, S.var("fc1_weight"), S.var("fc1_bias"), kernel=(1, 1), num_filter=8, name="fc1")
    att = S.Reshape(S.SwapAxis(S.Reshape(fc1, shape=(0, 1, 2, -1)), dim1=1, dim2=2), shape=(0, 2, -1, 1, 1))
    sym = S.Group([S.sum(w0, name="wsum"), S.sum(S.broadcast_mul(att, S.var("splits")), axis=1, name="s1")])
    shapes = {"pooled": (1, 4, 1, 1), "splits": (1, 2, 4, 1, 1)}
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16", rules=NO_REGION)
    assert "MXNet's AMP converted the graph first" in res.report.to_text()
    from fusion.check.verify import run as run_model
    outs = run_model(res.symbol, res.arg_params, res.aux_params,
                     {k: np.ones(v, np.float32) for k, v in shapes.items()})
    assert [o.dtype for o in outs] == [np.float32, np.float32]
    _runs_within_bf16(sym, arg, aux, res, shapes)


@needs_bf16
def test_default_rules_leave_amp_out():
    """With the region rule in the run MXNet's AMP is not run (its bfloat16 convolutions between
    MXNet's ops are slower than float32): a convolution the region rule takes runs in bfloat16 inside
    the fused_region, one it does not take stays float32 and the report names it."""
    sym = S.Concat(S.var("a"), _conv(S.var("b"), "c0"), dim=1, name="cat")
    shapes = {"a": (1, 2, 5, 5), "b": (1, 3, 5, 5)}
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16")
    text = res.report.to_text()
    assert "MXNet's AMP" in text and "was not run" in text, text
    assert "1 convolution(s) outside stay float32: c0" in text, text
    assert "amp_cast" not in ops(res)
    assert not any(P.is_bf16(v.dtype) for v in res.arg_params.values())
    _runs_within_bf16(sym, arg, aux, res, shapes)


def test_a_float32_model_using_amp_multicast_itself_stays_float32():
    """GluonCV's SSD box decoder calls ``amp_multicast(..., cast_narrow=True)`` in a float32 model: no
    bfloat16 anywhere, so it is no AMP graph.  It was read as one, and fuse() (precision float32 asked)
    gave its regions precision='bfloat16': SSD-512 MobileNet's scores 1e-3 off, not reported."""
    x = S.var("data")
    y = S.relu(_conv(S.relu(_conv(x, "c0", 8)), "c1", 8))
    a, b = S.amp_multicast(y, S.var("anchors"), num_outputs=2, cast_narrow=True)
    sym = S.Group([S.broadcast_add(a, b, name="decoded")])
    shapes = {"data": (1, 3, 8, 8), "anchors": (1, 8, 8, 8)}
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    text = res.report.to_text()
    assert res.report.precision == "float32", text
    assert "converted by MXNet's AMP" not in text, text
    assert "bfloat16" not in res.symbol.tojson()
    v = fusion.verify((sym, arg, aux), res, input_shapes=shapes)
    assert v.max_rel <= 1e-5, v
