"""MXNet's bfloat16 meeting NumPy: MXNet's type inference (and AMP, and this package) name it
'bfloat16', which ``np.dtype`` does not know (TypeError), and its arrays have a structured NumPy
dtype no arithmetic takes.  Every place that can meet one goes through ``precision.policy``
(``np_dtype``, ``dtype_name``, ``as_float32``, ``astype``).

The regression: ``fuse(densenet121, precision="bf16")`` crashed with "TypeError: data type 'bfloat16'
not understood" — AMP runs a DenseNet transition's BN-ReLU in bfloat16, and the self-check of
``pool_before_pointwise_conv`` (avg-pool before the transition's 1×1 convolution) compared the
bfloat16 activation's dtype with ``np.dtype('bfloat16')``.
"""
from __future__ import annotations

import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.check import verify as V
from fusion.engine.inputs import draw
from fusion.ir.errors import FusionError
from fusion.precision import policy as P

from conftest import ops, random_params

S = mx.sym
BF16_TOL = P.TOLERANCE[P.BFLOAT16]
needs_bf16 = pytest.mark.skipif(P.native_bf16_reason() is not None,
                                reason="this CPU has no native bfloat16: %s" % P.native_bf16_reason())
# MXNet 1.9.1's oneDNN has bfloat16 convolutions only with AVX-512 (AMP's graph of a CNN does not run
# without): the forced path (no native bfloat16) still needs it
needs_mxnet_bf16_conv = pytest.mark.skipif("avx512f" not in P.cpu_flags(),
                                           reason="CPU without AVX-512: MXNet's oneDNN has no bfloat16 convolution")
SHAPES = {"data": (1, 3, 8, 8)}


def _bn_relu_conv(x, name, num_filter, k):
    x = S.Activation(S.BatchNorm(x, fix_gamma=False, name=name + "_bn"), act_type="relu", name=name + "_relu")
    return S.Convolution(x, num_filter=num_filter, kernel=(k, k), pad=(k // 2, k // 2), no_bias=True,
                         name=name + "_conv")


def densenet_like(growth=4, layers=2):
    """GluonCV's DenseNet in small: stem, dense blocks of BN-ReLU-1×1 conv-BN-ReLU-3×3 conv concatenated
    to their input, a transition (BN-ReLU-1×1 conv-avg pool) between them, BN-ReLU-global pool-dense."""
    x = S.Convolution(S.var("data"), num_filter=8, kernel=(3, 3), pad=(1, 1), no_bias=True, name="stem")
    for b in range(2):
        for i in range(layers):
            y = _bn_relu_conv(x, "b%dl%d_a" % (b, i), 2 * growth, 1)
            y = _bn_relu_conv(y, "b%dl%d_b" % (b, i), growth, 3)
            x = S.Concat(x, y, dim=1, name="b%dl%d_cat" % (b, i))
        if b == 0:
            x = _bn_relu_conv(x, "t%d" % b, 8, 1)
            x = S.Pooling(x, kernel=(2, 2), stride=(2, 2), pool_type="avg", name="t%d_pool" % b)
    x = S.Activation(S.BatchNorm(x, fix_gamma=False, name="final_bn"), act_type="relu", name="final_relu")
    x = S.Pooling(x, global_pool=True, kernel=(1, 1), pool_type="avg", name="gap")
    return S.FullyConnected(S.flatten(x), num_hidden=10, name="fc")


#: the two bfloat16 paths for a CNN: the default rules (its convolutions in bfloat16 inside a
#: fused_region, MXNet's AMP not run) and the rules without the region rule (MXNet's AMP converts the
#: graph first; the rewrite that met bfloat16 in the regression runs on AMP's graph)
PATHS = {"region": None, "amp": ["default", "-region"]}


def _check_bf16_densenet(res, sym, arg, aux, path):
    text = res.report.to_text()
    assert res.report.precision == P.BFLOAT16, text
    if path == "amp":
        assert "MXNet's AMP converted the graph first" in text, text
        assert res.report.rules["pool_before_pointwise_conv"].fused, text     # the rewrite that met bfloat16
        assert "amp_cast" in ops(res) and any(P.is_bf16(v.dtype) for v in res.arg_params.values())
    else:
        assert "was not run" in text and res.report.rules["region"].fused, text
        assert "amp_cast" not in ops(res) and ops(res).get("fused_region"), text
        assert not any(P.is_bf16(v.dtype) for v in res.arg_params.values())
    _, out_types, _ = res.symbol.infer_type(data=np.float32)
    assert out_types == [np.float32]
    v = fusion.verify((sym, arg, aux), res, input_shapes=SHAPES)
    assert v.max_rel <= BF16_TOL, v


@needs_bf16
@needs_mxnet_bf16_conv
@pytest.mark.parametrize("path", sorted(PATHS))
def test_densenet_like_fuses_in_bf16(path):
    sym = densenet_like()
    arg, aux = random_params(sym, SHAPES)
    res = fusion.fuse(sym, arg, aux, input_shapes=SHAPES, precision="bf16", rules=PATHS[path])
    _check_bf16_densenet(res, sym, arg, aux, path)


@needs_mxnet_bf16_conv
@pytest.mark.parametrize("path", sorted(PATHS))
def test_densenet_like_bf16_forced_on_a_cpu_without_bf16(monkeypatch, path):
    monkeypatch.setattr(P, "cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    sym = densenet_like()
    arg, aux = random_params(sym, SHAPES)
    with pytest.raises(FusionError, match="no native bfloat16"):
        fusion.fuse(sym, arg, aux, input_shapes=SHAPES, precision="bf16", rules=PATHS[path])
    res = fusion.fuse(sym, arg, aux, input_shapes=SHAPES, precision="bf16", force=True, rules=PATHS[path])
    _check_bf16_densenet(res, sym, arg, aux, path)


@needs_mxnet_bf16_conv
def test_densenet_like_amp_graph_fuses_and_verifies():
    """The user's own AMP bfloat16 graph (its values bfloat16 between the convolutions), fused as it
    is and with precision='bf16'; its input dtype given in each spelling."""
    from mxnet.contrib import amp

    sym = densenet_like()
    arg, aux = random_params(sym, SHAPES)
    asym, aarg, aaux = amp.convert_model(sym, {k: v.copy() for k, v in arg.items()},
                                         {k: v.copy() for k, v in aux.items()}, target_dtype="bfloat16",
                                         cast_optional_params=True)
    for kwargs in ({}, {"precision": "bf16", "force": True}, {"input_dtypes": {"data": np.float32}},
                   {"input_dtypes": {"data": np.dtype("float32")}}, {"input_dtypes": {"data": "float32"}}):
        res = fusion.fuse(asym, aarg, aaux, input_shapes=SHAPES, **kwargs)
        v = fusion.verify((asym, aarg, aaux), res, input_shapes=SHAPES)
        assert v.max_rel <= BF16_TOL, (kwargs, v)


def test_input_dtypes_in_any_spelling_and_refused_when_no_dtype():
    """input_dtypes as NumPy types, dtypes or names (the self-check drew from str(np.float32) before)."""
    sym = S.Activation(S.FullyConnected(S.var("x"), num_hidden=24, flatten=False, name="fc"), act_type="relu")
    shapes = {"x": (2, 8, 16)}
    arg, aux = random_params(sym, shapes)
    for dt in (np.float32, np.dtype("float32"), "float32"):
        res = fusion.fuse(sym, arg, aux, input_shapes=shapes, input_dtypes={"x": dt})
        assert ops(res) == {"fused_dense": 1}, (dt, res.report.to_text())
    with pytest.raises(FusionError, match=r"input_dtypes\['x'\] = 'no_such_type' is not a dtype"):
        fusion.fuse(sym, arg, aux, input_shapes=shapes, input_dtypes={"x": "no_such_type"})


@pytest.mark.parametrize("dtype", ["bfloat16", P.BF16])
@pytest.mark.parametrize("domain", [None, ("bool",), ("int", 0, 3)])
def test_draw_bf16_in_each_domain(dtype, domain):
    v = draw(np.random.default_rng(0), (64,), dtype, domain)
    assert v.dtype == P.BF16
    f = P.from_bf16(v)
    assert np.isfinite(f).all()
    if domain == ("bool",):
        assert set(np.unique(f)) <= {0.0, 1.0}
    elif domain is not None:
        assert set(np.unique(f)) <= {0.0, 1.0, 2.0, 3.0}
    else:       # the same values as float32 draws, rounded
        want = draw(np.random.default_rng(0), (64,), "float32", None)
        assert np.array_equal(f, P.from_bf16(P.to_bf16(want)))


def test_dtype_helpers_take_every_spelling():
    for spelled in ("bfloat16", P.BF16):
        assert P.np_dtype(spelled) == P.BF16 and P.dtype_name(spelled) == "bfloat16"
    assert P.np_dtype(np.float32) == np.float32 and P.np_dtype("int32") == np.int32
    x = np.array([1.0, -2.5, 3.140625], np.float32)
    b = P.astype(x, "bfloat16")
    assert b.dtype == P.BF16 and P.astype(b, P.BF16) is b
    assert np.array_equal(P.astype(b, "float64"), x.astype(np.float64))
    assert np.array_equal(P.as_float32(b), x) and P.as_float32(x) is x


def test_verify_compares_bf16_outputs_as_their_values():
    """Comparing the bit patterns as numbers (what casting the structured dtype gave) is not an error."""
    a = P.to_bf16(np.array([1.0, 2.0, -4.0], np.float32))
    b = P.to_bf16(np.array([1.0, 2.0, -4.0625], np.float32))
    r = V.compare([a], [b], ["out"])
    assert r.max_abs == pytest.approx(0.0625) and r.max_rel == pytest.approx(0.0625 / 4)
