"""fused_elemwise vs a NumPy evaluation of the same expression (forward) and MXNet
autograd over the equivalent chain of separate ops (backward).

Tolerances (fp32): forward rtol=1e-5, atol=1e-5 (float64 reference); backward
rtol=1e-4, atol=1e-5.
"""
import math
import os
import re
import tempfile

import mxnet as mx
import numpy as np
import pytest
from mxnet.base import MXNetError
from kernel_fixtures import fused_ops, run_python  # noqa: F401  (fused_ops builds + loads the library)

FWD = dict(rtol=1e-5, atol=1e-5)
BWD = dict(rtol=1e-4, atol=1e-5)
_erf = np.vectorize(math.erf)

NP = {
    "neg": np.negative, "abs": np.abs, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
    "rsqrt": lambda a: 1 / np.sqrt(a), "tanh": np.tanh, "sigmoid": lambda a: 1 / (1 + np.exp(-a)),
    "relu": lambda a: np.maximum(a, 0), "erf": _erf, "square": np.square,
    "softrelu": lambda a: np.where(a > 20, a, np.log1p(np.exp(np.minimum(a, 20)))),
    "softsign": lambda a: a / (1 + np.abs(a)), "log_sigmoid": lambda a: -np.log1p(np.exp(-a)),
    "mish": lambda a: a * np.tanh(np.log1p(np.exp(a))), "log1p": np.log1p, "expm1": np.expm1,
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "pow": np.power,
    "max": np.maximum, "min": np.minimum,
    "lt": lambda a, b: (a < b) * 1.0, "le": lambda a, b: (a <= b) * 1.0,
    "gt": lambda a, b: (a > b) * 1.0, "ge": lambda a, b: (a >= b) * 1.0,
    "eq": lambda a, b: (a == b) * 1.0, "ne": lambda a, b: (a != b) * 1.0,
    "where": lambda c, a, b: np.where(c != 0, a, b),
    "clip": lambda a, lo, hi: np.minimum(np.maximum(a, lo), hi),
}


def _bc(f):
    def g(*xs):
        xs = list(xs)
        shape = np.broadcast_shapes(*[x.shape for x in xs if isinstance(x, mx.nd.NDArray)])
        xs = [mx.nd.broadcast_to(x.reshape((1,) * (len(shape) - x.ndim) + x.shape), shape)
              if isinstance(x, mx.nd.NDArray) and x.shape != shape else x for x in xs]
        return f(*xs)
    return g


MX = {
    "neg": lambda a: -a, "abs": mx.nd.abs, "exp": mx.nd.exp, "log": mx.nd.log, "sqrt": mx.nd.sqrt,
    "rsqrt": mx.nd.rsqrt, "tanh": mx.nd.tanh, "sigmoid": mx.nd.sigmoid, "relu": mx.nd.relu,
    "erf": mx.nd.erf, "square": mx.nd.square,
    "softrelu": lambda a: mx.nd.Activation(a, act_type="softrelu"),
    "softsign": lambda a: mx.nd.Activation(a, act_type="softsign"),
    "log_sigmoid": lambda a: mx.nd.log(mx.nd.sigmoid(a)),  # no such act_type in MXNet 1.9.1
    "mish": lambda a: a * mx.nd.tanh(mx.nd.Activation(a, act_type="softrelu")),
    "log1p": mx.nd.log1p, "expm1": mx.nd.expm1,
    "add": _bc(lambda a, b: a + b), "sub": _bc(lambda a, b: a - b), "mul": _bc(lambda a, b: a * b),
    "div": _bc(lambda a, b: a / b), "pow": _bc(lambda a, b: a ** b),
    "max": _bc(lambda a, b: mx.nd.maximum(a, b)), "min": _bc(lambda a, b: mx.nd.minimum(a, b)),
    "gt": _bc(lambda a, b: a > b), "lt": _bc(lambda a, b: a < b),
    "where": _bc(lambda c, a, b: mx.nd.where(c, a, b)),
    "clip": lambda a, lo, hi: mx.nd.clip(a, lo, hi),
}


def evaluate(expr, xs, table):
    """Tiny test-side evaluator of the expression language (independent of the C++)."""
    toks = re.findall(r"x\d+\b|[A-Za-z_][A-Za-z0-9_]*|-?\d+\.?\d*(?:e-?\d+)?|[(),]", expr)
    pos = [0]

    def parse():
        t = toks[pos[0]]
        pos[0] += 1
        if re.fullmatch(r"x\d+", t):
            return xs[int(t[1:])]
        if re.fullmatch(r"-?\d.*", t):
            return float(t)
        assert toks[pos[0]] == "("
        pos[0] += 1
        args = []
        while True:
            args.append(parse())
            sep = toks[pos[0]]
            pos[0] += 1
            if sep == ")":
                break
        return table[t](*args)
    return parse()


def rnd(*shape, seed=0, lo=-2.0, hi=2.0):
    return np.random.RandomState(seed + len(shape)).uniform(lo, hi, shape).astype(np.float32)


EXPRS = [
    ("mul(x0, sigmoid(add(x1, 3.0)))", [(7, 300), (7, 300)]),
    ("add(mul(x0, 0.5), x1)", [(4, 1, 5), (3, 1)]),
    ("where(gt(x0, 0), exp(x1), neg(x2))", [(2, 3, 4), (3, 4), (1,)]),
    ("clip(tanh(x0), -0.5, 0.25)", [(5000,)]),
    ("div(sub(x0, x1), sqrt(add(square(x1), 1e-3)))", [(64, 65), (64, 1)]),
    ("max(min(x0, x1), relu(erf(x0)))", [(3, 1, 9), (1, 4, 1)]),
    ("rsqrt(add(abs(x0), 1))", [(1,)]),
    ("pow(add(abs(x0), 0.5), x1)", [(10, 11), (11,)]),
    ("log(add(exp(x0), 1))", [(2049,)]),
    ("x0", [(3, 4)]),
    ("add(softrelu(x0), mul(softsign(x1), log_sigmoid(x0)))", [(5, 7), (7,)]),
    ("sub(mish(x0), expm1(mul(log1p(abs(x0)), 0.5)))", [(300,)]),
    # scalar arithmetic the CPU forward plan folds into the op that reads it
    ("mul(sigmoid(add(mul(x0, 1.5), 0.5)), tanh(sub(x0, 0.25)))", [(1000,)]),
    ("exp(neg(div(sub(0.5, mul(x0, 3)), 4)))", [(17, 33)]),
    ("relu(add(mul(add(x0, 1), 2), -1))", [(257,)]),
    ("mul(add(mul(x0, 0.5), 0.25), 2)", [(31,)]),  # the result itself is the folded chain
    ("tanh(div(x0, 3))", [(100,)]),  # not a power of two: stays a division
    ("add(mul(x0, x0), mul(x0, 2))", [(65,)]),  # x0 read by several ops
    ("sigmoid(add(x0, x1))", [(6, 40), (40,)]),
]


@pytest.mark.parametrize("expr,shapes", EXPRS)
def test_forward(expr, shapes):
    xs = [rnd(*s, seed=i) for i, s in enumerate(shapes)]
    got = mx.nd.fused_elemwise(*[mx.nd.array(x) for x in xs], expr=expr).asnumpy()
    want = evaluate(expr, [x.astype(np.float64) for x in xs], NP)
    assert got.shape == np.broadcast_shapes(*shapes)
    np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), **FWD)


def test_comparisons():
    a = np.array([1, 2, 3, 4], np.float32)
    b = np.array([2, 2, 2, 2], np.float32)
    for op, want in [("lt", a < b), ("le", a <= b), ("gt", a > b), ("ge", a >= b), ("eq", a == b),
                     ("ne", a != b)]:
        got = mx.nd.fused_elemwise(mx.nd.array(a), mx.nd.array(b), expr="%s(x0, x1)" % op)
        np.testing.assert_array_equal(got.asnumpy(), want.astype(np.float32))


@pytest.mark.parametrize("expr,shapes", EXPRS)
def test_backward_vs_mxnet(expr, shapes):
    xs = [rnd(*s, seed=i) for i, s in enumerate(shapes)]
    out_shape = np.broadcast_shapes(*shapes)
    dy = rnd(*out_shape, seed=9)
    res = []
    for fused in (True, False):
        arrs = [mx.nd.array(x) for x in xs]
        for a in arrs:
            a.attach_grad()
        with mx.autograd.record():
            y = (mx.nd.fused_elemwise(*arrs, expr=expr) if fused else evaluate(expr, arrs, MX))
            if y.shape != out_shape:
                y = mx.nd.broadcast_to(y, out_shape)
        y.backward(mx.nd.array(dy))
        res.append([a.grad.asnumpy() for a in arrs])
    for g, w in zip(*res):
        np.testing.assert_allclose(g, w, **BWD)


@pytest.mark.parametrize("shape0", [(6,), (1,)])      # x0 read in full, and broadcast
def test_backward_passes_nothing_through_a_comparison(shape0):
    """Below a comparison no gradient flows: the values it reads pass nothing back, not 0 times their
    local derivative (pow of a negative base: log(a) is NaN there), as MXNet's separate ops give 0."""
    expr = "tanh(gt(add(x0, pow(x0, x0)), x1))"
    x0 = np.full(shape0, -0.52, np.float32)
    x1 = np.linspace(-1.5, 1.5, 6).astype(np.float32)
    arrs = [mx.nd.array(x0), mx.nd.array(x1)]
    for a in arrs:
        a.attach_grad()
    with mx.autograd.record():
        y = mx.nd.fused_elemwise(*arrs, expr=expr)
    y.backward(mx.nd.ones(y.shape))
    for a in arrs:
        np.testing.assert_array_equal(a.grad.asnumpy(), np.zeros(a.shape, np.float32))


def test_constant_program():
    y = mx.nd.fused_elemwise(mx.nd.ones((3, 5000)), expr="2.5", num_args=1)
    np.testing.assert_array_equal(y.asnumpy(), np.full((3, 5000), 2.5, np.float32))


def test_num_args_allows_unused_inputs():
    x0, x1 = mx.nd.ones((2, 3)), mx.nd.ones((4, 1, 3))
    y = mx.nd.fused_elemwise(x0, x1, expr="mul(x0, 2)", num_args=2)
    assert y.shape == (4, 2, 3)
    np.testing.assert_array_equal(y.asnumpy(), 2 * np.ones((4, 2, 3)))


@pytest.mark.parametrize("expr,msg", [
    ("", "empty expression"),
    ("foo(x0)", "unknown function 'foo'"),
    ("add(x0)", "'add' takes 2 argument"),
    ("add(x0, x1", "expected ',' or '\\)'"),
    ("mul(x0, x1) x2", "after the expression"),
    ("add(x0, $)", "unexpected character"),
])
def test_invalid_programs(expr, msg):
    with pytest.raises(MXNetError, match=msg):
        mx.nd.fused_elemwise(mx.nd.ones(3), mx.nd.ones(3), expr=expr, num_args=2).wait_to_read()


def test_invalid_program_fails_at_symbol_creation():
    with pytest.raises(MXNetError, match="does not exist"):
        mx.sym.fused_elemwise(mx.sym.var("a"), expr="add(x0, x5)", num_args=1)


def test_non_broadcastable_inputs():
    with pytest.raises(MXNetError, match="do not broadcast"):
        mx.nd.fused_elemwise(mx.nd.ones((2, 3)), mx.nd.ones((4,)), expr="add(x0, x1)").wait_to_read()


def test_symbol_json_roundtrip():
    s = mx.sym.fused_elemwise(mx.sym.var("a"), mx.sym.var("b"), expr="where(gt(x0, x1), x0, 0.5)")
    s2 = mx.sym.load_json(s.tojson())
    a, b = rnd(3, 4), rnd(4, seed=1)
    out = s2.bind(mx.cpu(), {"a": mx.nd.array(a), "b": mx.nd.array(b)}).forward()[0].asnumpy()
    np.testing.assert_allclose(out, np.where(a > b, a, 0.5), **FWD)


# --- the CPU's vector kernels -------------------------------------------------------

_WIDE = np.concatenate([
    np.linspace(-30, 30, 600001, dtype=np.float32),
    np.float32(10.0) ** np.arange(-30, 1.6, 0.01, dtype=np.float32),
    -np.float32(10.0) ** np.arange(-30, 1.6, 0.01, dtype=np.float32),
    np.array([0.0, -0.0, 88.5, 89.5, -87.0, -103.0, -110.0, np.inf, -np.inf, np.nan], np.float32)])
_REF = {"exp": np.exp, "sigmoid": lambda a: 1 / (1 + np.exp(-a)), "tanh": np.tanh, "erf": _erf}
_REL = {"exp": 3e-7, "sigmoid": 3e-7, "tanh": 5e-7, "erf": 7e-7}


def _check_unary(name, got):
    with np.errstate(all="ignore"):
        want = _REF[name](_WIDE.astype(np.float64))
    got = got.astype(np.float64)
    # below 2.5e-38 the portable exp flushes to 0 (mxf_common.h): absolute error there
    big = np.isfinite(want) & (np.abs(want) > 2.5e-38) & (np.abs(want) < 3.4e38)
    rel = np.abs(got[big] - want[big]) / np.abs(want[big])
    assert rel.max() < _REL[name], (name, float(rel.max()), _WIDE[big][np.argmax(rel)])
    tiny = np.abs(want) <= 2.5e-38  # underflow end: absolute error
    assert np.all(np.abs(got[tiny] - want[tiny]) <= 2.5e-38)
    huge = np.isfinite(want) & (np.abs(want) >= 3.4e38)  # beyond float: inf
    assert np.all(np.isinf(got[huge]))
    special = ~np.isfinite(want)
    np.testing.assert_array_equal(got[special], want[special])  # inf stays inf, nan nan
    assert np.all(np.abs(got[np.isfinite(got)]) <= (np.inf if name == "exp" else 1.0))


@pytest.mark.parametrize("name", ["exp", "sigmoid", "tanh", "erf"])
def test_transcendentals_accuracy(name):
    """Relative error over the whole float range, including tiny arguments (where tanh
    must stay relatively accurate), the overflow/underflow ends and inf/nan."""
    _check_unary(name, mx.nd.fused_elemwise(mx.nd.array(_WIDE), expr="%s(x0)" % name).asnumpy())


def test_portable_and_avx512_paths_agree():
    """MXFUSION_DISABLE_AVX512=1 forces the portable loops: same accuracy contract, and
    the two paths agree to a few ulp on the folded forward plan too, and on fused_dense's
    activation epilogues."""
    code = (
        "import numpy as np, mxnet as mx, fusion\n"
        "x = mx.nd.array(np.load(sys.argv[1]))\n"
        "out = [mx.nd.fused_elemwise(x, expr=e).asnumpy() for e in sys.argv[3:]]\n"
        "rng = np.random.RandomState(0)\n"
        "a, w, b = [mx.nd.array(rng.uniform(-3, 3, s).astype(np.float32)) for s in "
        "[(37, 40), (29, 40), (29,)]]\n"
        "out += [mx.nd.fused_dense(a, w, b, act=act).asnumpy() for act in "
        "['sigmoid', 'tanh', 'gelu_erf', 'gelu_tanh']]\n"
        "np.savez(sys.argv[2], *out)\n")
    exprs = ["exp(x0)", "sigmoid(x0)", "tanh(x0)", "relu(mul(add(x0, 1), -2))",
             "mul(sigmoid(add(mul(x0, 1.5), 0.5)), tanh(sub(x0, 0.25)))"]
    with tempfile.TemporaryDirectory() as d:
        np.save(os.path.join(d, "x.npy"), _WIDE)
        res = []
        for off in ("1", "0"):
            outp = os.path.join(d, "o%s.npz" % off)
            run_python(code, os.path.join(d, "x.npy"), outp, *exprs, MXFUSION_DISABLE_AVX512=off)
            with np.load(outp) as z:
                res.append([z["arr_%d" % i] for i in range(len(exprs) + 4)])
    for name, got in zip(["exp", "sigmoid", "tanh"], res[0][:3]):
        _check_unary(name, got)  # the portable loops keep the contract
    for e, a, b in zip(exprs, *res):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-37, err_msg=e)
    for act, a, b in zip(["sigmoid", "tanh", "gelu_erf", "gelu_tanh"], res[0][-4:], res[1][-4:]):
        np.testing.assert_allclose(a, b, **FWD, err_msg="fused_dense " + act)


@pytest.mark.parametrize("expr,f,exact_zero_sign", [
    ("mul(x0, 0)", lambda a: a * 0, True),
    ("mul(x0, 1)", lambda a: a * 1, True),
    ("add(x0, 0)", lambda a: a + 0, True),  # -0 + 0 is +0
    ("sub(x0, 0)", lambda a: a - 0, True),  # -0 - 0 is -0
    ("sub(0, x0)", lambda a: 0 - a, True),
    ("neg(x0)", np.negative, True),
    ("tanh(div(x0, 0.5))", lambda a: np.tanh(a / 0.5), True),
    ("exp(mul(x0, inf))", lambda a: np.exp(a * np.inf), True),  # inf constants never fold
    ("mul(mul(x0, 1e30), 1e30)", lambda a: a * np.float32(1e30) * np.float32(1e30), False),
    ("mul(mul(x0, 1e-30), 1e-30)", lambda a: a * np.float32(1e-30) * np.float32(1e-30), False),
    ("mul(neg(mul(x0, 2)), 3)", lambda a: -(a * 2) * 3, False),
])
def test_folded_scalar_ops_keep_special_values(expr, f, exact_zero_sign):
    """Folding x*s+t into the op that reads it keeps inf/nan, and (for a single folded
    op) the sign of zero.  A chain composed into one x*s+t rounds once, so only its
    values are compared; constants whose product would overflow or go subnormal are not
    composed."""
    x = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e38, -1e38, 3.0, 1e-30], np.float32)
    with np.errstate(all="ignore"):
        want = f(x).astype(np.float32)
    got = mx.nd.fused_elemwise(mx.nd.array(x), expr=expr).asnumpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=expr)
    if exact_zero_sign:
        np.testing.assert_array_equal(np.signbit(got[want == 0]), np.signbit(want[want == 0]),
                                      err_msg=expr)


def test_large_output_streams_to_memory():
    """Outputs larger than the last-level cache are written with streaming stores; the
    values, a broadcast input and an unaligned tail included, are unchanged."""
    n = 9 * 2**20 + 13  # > 32 MiB of float32
    x0 = rnd(n, seed=3)
    x1 = rnd(1, seed=4)
    got = mx.nd.fused_elemwise(mx.nd.array(x0), mx.nd.array(x1),
                               expr="mul(sigmoid(add(mul(x0, 1.5), x1)), tanh(x0))").asnumpy()
    want = 1 / (1 + np.exp(-(x0.astype(np.float64) * 1.5 + x1))) * np.tanh(x0.astype(np.float64))
    np.testing.assert_allclose(got, want, **FWD)


def test_many_live_values():
    """The forward plan reuses block buffers once a value's last reader has run; values
    kept alive across many instructions must not be overwritten."""
    expr = ("add(add(mul(exp(x0), x1), mul(tanh(x0), sigmoid(x1))), "
            "add(sub(x0, x1), mul(add(exp(x0), tanh(x1)), sub(sigmoid(x0), x0))))")
    xs = [rnd(3000, seed=5), rnd(3000, seed=6)]
    got = mx.nd.fused_elemwise(*[mx.nd.array(x) for x in xs], expr=expr).asnumpy()
    want = evaluate(expr, [x.astype(np.float64) for x in xs], NP)
    np.testing.assert_allclose(got, want, **FWD)


def test_a_subexpression_written_twice_is_one_value():
    """max(d, d) with d = x / (x < 6): MXNet sums d's two gradients (g, 0) before d's backward,
    (g + 0) / 0 = inf; per copy it would be g / 0 + 0 / 0 = NaN."""
    x = mx.nd.array([[1.0, 7.0, -2.0, 8.0]])
    d = "div(x0, lt(x0, 6.0))"
    sym = mx.sym.fused_elemwise(mx.sym.var("x"), expr="max(%s, %s)" % (d, d), num_args=1)
    gx = mx.nd.zeros(x.shape)
    exe = sym.bind(mx.cpu(), {"x": x}, args_grad={"x": gx})
    exe.forward(is_train=True)
    exe.backward([mx.nd.ones(x.shape)])
    v = mx.sym.var("x")
    dd = mx.sym.broadcast_div(v, v < 6)
    ref = mx.sym.broadcast_maximum(dd, dd)
    gr = mx.nd.zeros(x.shape)
    e2 = ref.bind(mx.cpu(), {"x": x}, args_grad={"x": gr})
    e2.forward(is_train=True)
    e2.backward([mx.nd.ones(x.shape)])
    assert np.array_equal(gx.asnumpy(), gr.asnumpy()), (gx.asnumpy(), gr.asnumpy())
    assert np.isinf(gx.asnumpy()[0, 1])
