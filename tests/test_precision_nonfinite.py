"""precision='bf16': non-finite values come out where the float32 model gives them.

oneDNN's GELU (the post-op of fused_dense's bfloat16 product) gives NaN for an infinite input
where MXNet's gives +inf for +inf; fused_dense takes the post-op only where no pre-activation
can be infinite (bounds on x, W and the bias) and applies MXNet's GELU itself elsewhere."""
from __future__ import annotations

import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.precision import policy as P

from conftest import ops

S = mx.sym
BF16_TOL = P.TOLERANCE[P.BFLOAT16]
needs_bf16 = pytest.mark.skipif(P.native_bf16_reason() is not None,
                                reason="this CPU has no native bfloat16: %s" % P.native_bf16_reason())


def _ffn(act_type, second: bool):
    x = S.FullyConnected(S.var("x"), num_hidden=32, flatten=False, name="fc1")
    x = S.LeakyReLU(x, act_type=act_type, name="act")
    if second:
        x = S.FullyConnected(x, num_hidden=16, flatten=False, name="fc2")
    return x


def _run(sym, arg, x):
    exe = sym.bind(mx.cpu(), {"x": mx.nd.array(x), **arg}, grad_req="null")
    return exe.forward(is_train=False)[0].asnumpy().astype(np.float64)


@needs_bf16
@pytest.mark.parametrize("act_type", ["gelu"])
@pytest.mark.parametrize("second", [False, True], ids=["gelu_out", "gelu_then_dense"])
@pytest.mark.parametrize("special", ["inf", "-inf", "nan", "huge", "finite"])
def test_gelu_product_keeps_the_float32_models_non_finite_values(act_type, second, special):
    sym = _ffn(act_type, second)
    rng = np.random.default_rng(3)
    shapes = {"x": (2, 5, 24)}
    arg = {"fc1_weight": mx.nd.array(rng.standard_normal((32, 24)) * 0.2),
           "fc1_bias": mx.nd.array(rng.standard_normal(32) * 0.1)}
    if second:
        arg.update(fc2_weight=mx.nd.array(rng.standard_normal((16, 32)) * 0.2),
                   fc2_bias=mx.nd.array(rng.standard_normal(16) * 0.1))
    res = fusion.fuse(sym, arg, {}, input_shapes=shapes, precision="bf16")
    assert ops(res).get("fused_dense") == (2 if second else 1)
    x = rng.standard_normal(shapes["x"]).astype(np.float32)
    value = {"inf": np.inf, "-inf": -np.inf, "nan": np.nan, "huge": 3e37, "finite": 1.5}[special]
    x[0, 1, 3] = value
    x[1, 4, :] = value
    want = _run(sym, arg, x)
    got = _run(res.symbol, res.arg_params, x)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_array_equal(np.sign(got[np.isinf(got)]), np.sign(want[np.isinf(want)]))
    fin = np.isfinite(want)
    rows = np.ones(want.shape[:-1], bool)     # rows the special value does not reach
    rows[0, 1] = rows[1, 4] = False
    scale = np.abs(want[rows]).max()
    assert np.abs(got - want)[rows].max() <= BF16_TOL * scale
    assert fin[rows].all()
