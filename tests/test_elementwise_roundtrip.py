"""Random elementwise graphs: fused, un-fused, and both run against the original at the
input shapes they were fused at and at another batch size, on inputs with NaN, ±inf
and ±0 among normal values.

Tolerances: NaN and ±inf exactly where the original has them; finite values within
1e-5 of max(|original|, 1) per output (the transcendental functions of the fused op are
within a few ulps of MXNet's, and errors grow through a chain of them).
"""
import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.check.verify import run as run_graph
from fusion.ir.graph import Graph

S = mx.sym
B, C, H = 3, 4, 5
SHAPES = {"full": (B, C, H), "ch": (C, H), "c11": (1, C, 1), "h": (H,), "11h": (1, 1, H), "one": (1,)}
SCALARS = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 3.0, -2.5, float("nan"), float("inf"), float("-inf"), 1e-30]
UNARY = ["negative", "abs", "exp", "log", "sqrt", "rsqrt", "square", "tanh", "sigmoid", "relu", "erf",
         "reciprocal"]
BINARY = ["broadcast_add", "broadcast_sub", "broadcast_mul", "broadcast_div", "broadcast_power",
          "broadcast_maximum", "broadcast_minimum", "broadcast_greater", "broadcast_lesser_equal",
          "broadcast_not_equal"]
SAME = ["elemwise_add", "elemwise_sub", "elemwise_mul", "elemwise_div", "_maximum", "_minimum", "_power",
        "_greater", "_equal"]
SCALAR_OPS = ["_plus_scalar", "_minus_scalar", "_rminus_scalar", "_mul_scalar", "_div_scalar", "_rdiv_scalar",
              "_power_scalar", "_rpower_scalar", "_maximum_scalar", "_minimum_scalar", "_greater_scalar",
              "_lesser_equal_scalar", "_equal_scalar"]


def _f(name):
    return getattr(S, name, None) or getattr(S._internal, name)


def _bcast(*shapes):
    return tuple(np.broadcast_shapes(*shapes))


def random_graph(seed):
    """(symbol, {input: shape key}) of 3-9 elementwise ops over 2-3 inputs."""
    rng = np.random.RandomState(seed)
    keys = ["full"] + list(rng.choice(list(SHAPES), size=rng.randint(1, 3)))
    ins = {"x%d" % i: k for i, k in enumerate(keys)}
    vals = [(S.var(n), SHAPES[k]) for n, k in ins.items()]
    for _ in range(rng.randint(3, 10)):
        kind = rng.choice(["unary", "binary", "same", "scalar", "act", "leaky", "clip", "hsig", "where", "rows"],
                          p=[.18, .18, .08, .2, .08, .06, .06, .04, .06, .06])
        a, sa = vals[-1]     # a chain; binary ops and where take their other operands anywhere
        if kind == "unary":
            v, s = _f(rng.choice(UNARY))(a), sa
        elif kind == "binary":
            b, sb = vals[rng.randint(len(vals))]
            v, s = _f(rng.choice(BINARY))(a, b), _bcast(sa, sb)
        elif kind == "same":
            same = [(b, sb) for b, sb in vals if sb == sa]
            b, sb = same[rng.randint(len(same))]
            v, s = _f(rng.choice(SAME))(a, b), sa
        elif kind == "scalar":
            v, s = _f(rng.choice(SCALAR_OPS))(a, scalar=SCALARS[rng.randint(len(SCALARS))]), sa
        elif kind == "act":
            v, s = S.Activation(a, act_type=rng.choice(["relu", "sigmoid", "tanh"])), sa
        elif kind == "leaky":
            v = (S.LeakyReLU(a, act_type="gelu") if rng.rand() < .4 else
                 S.LeakyReLU(a, act_type="leaky", slope=float(rng.choice([0.25, 0.0, -1.5]))))
            s = sa
        elif kind == "clip":
            lo, hi = sorted(rng.choice([-2.0, -0.5, 0.0, 1.0, 3.0], 2, replace=False))
            v, s = S.clip(a, float(lo), float(hi)), sa
        elif kind == "hsig":
            v, s = S.hard_sigmoid(a, alpha=float(rng.choice([0.2, 0.5])), beta=0.5), sa
        elif kind == "where":
            same = [(b, sb) for b, sb in vals if sb == sa]
            b, _ = same[rng.randint(len(same))]
            c, _ = same[rng.randint(len(same))]
            v, s = S.where(S._internal._greater_scalar(c, scalar=0.0), a, b), sa
        else:   # rows: a 1-D condition of length shape[0] selects rows (MXNet's where)
            if len(sa) < 2:
                continue
            name = "r%d" % len(ins)
            ins[name] = "rows%d" % sa[0]
            b, _ = [(b, sb) for b, sb in vals if sb == sa][0]
            v, s = S.where(S.var(name), a, S.negative(b)), sa
        vals.append((v, s))
    return vals[-1][0], ins


def shapes_for(ins, batch):
    out = {}
    for n, k in ins.items():
        if k.startswith("rows"):
            out[n] = (batch if int(k[4:]) == B else int(k[4:]),)
        else:
            s = SHAPES[k]
            out[n] = (batch,) + s[1:] if len(s) == 3 and s[0] == B else s
    return out


def inputs_for(shapes, seed):
    rng = np.random.RandomState(seed)
    out = {}
    for n, s in shapes.items():
        v = rng.standard_normal(s).astype(np.float32) * 2
        mask = rng.rand(*s)
        v[mask < 0.04] = np.nan
        v[(mask >= 0.04) & (mask < 0.07)] = np.inf
        v[(mask >= 0.07) & (mask < 0.10)] = -np.inf
        v[(mask >= 0.10) & (mask < 0.13)] = 0.0
        v[(mask >= 0.13) & (mask < 0.15)] = -0.0
        out[n] = v
    return out


def run(sym, arg, inputs):
    return run_graph(sym, arg, {}, inputs)


def compare(got, want, what):
    for g, w in zip(got, want):
        assert g.shape == w.shape, (what, g.shape, w.shape)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=what + ": NaN positions")
        np.testing.assert_array_equal(np.isposinf(g), np.isposinf(w), err_msg=what + ": +inf positions")
        np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w), err_msg=what + ": -inf positions")
        fin = np.isfinite(w)
        scale = max(float(np.abs(w[fin]).max()) if fin.any() else 0.0, 1.0)
        err = float(np.abs(g[fin].astype(np.float64) - w[fin]).max()) if fin.any() else 0.0
        assert err <= 1e-5 * scale, (what, err, scale)


@pytest.mark.parametrize("seed", range(80))
def test_fuse_unfuse_roundtrip_at_two_batch_sizes(seed):
    sym, ins = random_graph(seed)
    shapes = shapes_for(ins, B)
    res = fusion.fuse(sym, rules=["elementwise"], input_shapes=shapes)
    assert "fused_elemwise" in res.graph.count_ops(), res.report.to_text(explain=True)
    plain = fusion.unfuse(res.symbol, shapes, res.arg_params, res.aux_params)
    assert not any(op.startswith("fused_") for op in Graph.from_symbol(plain).count_ops())
    arg = {k: v.asnumpy() for k, v in res.arg_params.items()}
    for batch in (B, 7):
        inputs = inputs_for(shapes_for(ins, batch), seed * 10 + batch)
        want = run(sym, {}, inputs)
        compare(run(res.symbol, arg, inputs), want, "fused at batch %d" % batch)
        compare(run(plain, arg, inputs), want, "un-fused at batch %d" % batch)


PROGRAMS = [
    # (program, input shapes): forms the rules do not emit, which unfuse still covers
    ("clip(x0, x1, x2)", [(3, 4), (4,), (1, 1)]),               # tensor bounds
    ("clip(x0, -1.0, x1)", [(3, 4), (1, 4)]),
    ("hard_sigmoid(x0, x1, 0.5)", [(3, 4), (4,)]),
    ("leaky(x0, x1)", [(2, 3), (3,)]),
    ("where(x0, 2.5, x1)", [(2, 3), (3,)]),                     # constants and broadcasting in where
    ("where(1.0, x0, nan)", [(4,)]),
    ("max(0.0, x0)", [(5,)]),                                   # constant left: operand order kept
    ("min(-0.0, x0)", [(5,)]),
    ("add(mul(2.0, 3.0), x0)", [(5,)]),                         # a constant subexpression
    ("2.5", [(2, 3)]),                                          # a constant program
    ("mul(x0, 2.0)", [(2, 3), (4, 1, 3)]),                      # an unused input still broadcasts
    ("x0", [(3,)]),
    ("sub(exp(neg(x0)), log_sigmoid(x0))", [(6,)]),
    ("mish(softsign(softrelu(x0)))", [(6,)]),
    ("act_relu(gelu(expm1(log1p(x0))))", [(6,)]),
    ("mul(mul(x0, 0.5), add(tanh(mul(add(x0, mul(mul(mul(x0, x0), x0), 0.044715)), 0.7978845608028654)), 1))",
     [(2, 6)]),                                                 # GELU's tanh form (gelu rule, dense_act)
]


@pytest.mark.parametrize("expr,shapes", PROGRAMS)
def test_unfuse_is_total(expr, shapes):
    names = ["x%d" % i for i in range(len(shapes))]
    sym = S.fused_elemwise(*[S.var(n) for n in names], expr=expr, num_args=len(names))
    plain = fusion.unfuse(sym, dict(zip(names, shapes)))
    assert not any(op.startswith("fused_") for op in Graph.from_symbol(plain).count_ops())
    for lead in (None, 5):     # at the shapes given, and with the leading dim of the first changed
        sh = [((lead,) + s[1:] if lead and len(s) > 1 and k == 0 else s) for k, s in enumerate(shapes)]
        inputs = inputs_for(dict(zip(names, sh)), 1)
        compare(run(plain, {}, inputs), run(sym, {}, inputs), expr)


def test_unfuse_of_a_program_nested_as_deep_as_mxnet_loads():
    """A program nested thousands deep (one written by hand, or by another tool: the rules emit at
    most 256 ops) unfuses like any other — the parser and builder do not recurse."""
    from fusion.ir.graph import MAX_EXPR_DEPTH

    expr = "x0"
    for i in range(MAX_EXPR_DEPTH - 1):
        expr = ("add(%s, x1)" if i % 2 else "mul(%s, 0.999)") % expr
    sym = S.fused_elemwise(S.var("x0"), S.var("x1"), expr=expr, num_args=2)
    plain = fusion.unfuse(sym, {"x0": (2, 3), "x1": (2, 3)})
    assert Graph.from_symbol(plain).count_ops() == {"_mul_scalar": MAX_EXPR_DEPTH // 2,
                                                    "broadcast_add": MAX_EXPR_DEPTH // 2 - 1}
    inputs = inputs_for({"x0": (2, 3), "x1": (2, 3)}, 1)
    compare(run(plain, {}, inputs), run(sym, {}, inputs), "deep")
