"""fused_dense's activation epilogues and fused_add_layer_norm against MXNet's own ops
on NaN, ±inf, ±0, subnormals and huge values: forward and backward, at ranks where
MXNet runs the activation through oneDNN (2) and through its own kernels (6), on the
AVX-512 path and the portable loops (``MXFUSION_DISABLE_AVX512=1``, a subprocess).

fused_dense: x (M, 1) holds the special values and W (N, 1) a few scales, so that the
GEMM is one product per output and z = x·w + b is bitwise MXNet's FullyConnected
(checked with act='none'); the activation then sees every special value.

Tolerances: exact activations (relu, act_relu, leaky, none) bitwise; transcendental ones
NaN/±inf exactly where MXNet has them, finite values within 4 ulps of MXNet's own kernel
(gelu forms also 4e-7·|z| absolute: 1 + erf/tanh cancels; where MXNet runs the activation
through oneDNN, its values are compared with MXNet's own kernel, as oneDNN's
approximations differ from it by up to 1e-4 relative).  Gradients and LayerNorm outputs
(sums): NaN/±inf exactly, finite within 1e-5 of the sum of the magnitudes of the terms.
"""
import os
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest
from kernel_fixtures import fused_ops  # noqa: F401  (the fixture builds + loads the library)

ULPS = 4
SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, 1.2e-38, 3e38, -3e38,
                    1e-30, -1e-30, 0.5, -0.5, 1.0, -1.0, 2.0, -2.5, 5.5, -5.5, 15.0, -15.0,
                    20.5, -20.5, 88.5, -88.5, 100.0, -100.0, 0.3, -7.25], np.float32)
# no product underflows: the sign of an underflowed product is the GEMM's business (MXNet's
# FullyConnected and oneDNN's matmul differ there), not the epilogue's
W_COL = np.array([1.0, -1.0, 0.5, 2.0, -3.0, 1e30, 0.0, -0.0], np.float32)
ACTS = ["none", "relu", "act_relu", "sigmoid", "tanh", "softrelu", "leaky", "gelu_erf", "gelu_tanh"]
EXACT = {"none", "relu", "act_relu", "leaky"}
RANKS = (2, 6)


def mx_act(z, act, slope):
    if act == "relu":
        return mx.nd.relu(z)
    if act == "act_relu":
        return mx.nd.Activation(z, act_type="relu")
    if act in ("sigmoid", "tanh", "softrelu"):
        return mx.nd.Activation(z, act_type=act)
    if act == "leaky":
        return mx.nd.LeakyReLU(z, act_type="leaky", slope=slope)
    if act == "gelu_erf":
        return mx.nd.LeakyReLU(z, act_type="gelu")
    if act == "gelu_tanh":  # the written-out ops (as patterns/unfuse.py emits them)
        c = ((z * z) * z) * 0.044715
        return (z * 0.5) * (mx.nd.tanh((z + c) * 0.7978845608028654) + 1)
    return z


def dense_inputs(rank, bias):
    x = SPECIAL.reshape((-1,) + (1,) * (rank - 1))         # (M, 1, ..., 1): K = 1
    w = W_COL.reshape(-1, 1)
    b = (np.arange(len(W_COL)) % 3 - 1).astype(np.float32) * 0.25 if bias else None
    return x, w, b


def run_dense(act, slope, rank, bias, fused, head):
    """Output and (dx, dw, db) of fused_dense or of MXNet's FullyConnected + activation."""
    x, w, b = dense_inputs(rank, bias)
    arrs = [mx.nd.array(v) for v in (x, w) + ((b,) if bias else ())]
    for a in arrs:
        a.attach_grad()
    flatten = rank == 2
    with mx.autograd.record():
        if fused:
            y = mx.nd.fused_dense(*arrs, num_hidden=len(W_COL), act=act, slope=slope, flatten=flatten,
                                  no_bias=not bias)
        else:
            z = mx.nd.FullyConnected(*arrs, num_hidden=len(W_COL), flatten=flatten, no_bias=not bias)
            y = mx_act(z, act, slope)
    y.backward(mx.nd.array(head(y.shape)))
    return y.asnumpy(), [a.grad.asnumpy() for a in arrs]


def _head(shape):
    return np.random.RandomState(5).uniform(-2, 2, shape).astype(np.float32)


def _ordered(a):
    i = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def check(got, want, exact, ref=None, atol=0.0, what=""):
    """got vs MXNet's want: NaN/±inf positions exactly; values bitwise (exact) or within
    ULPS of ref (MXNet's own kernel) or atol."""
    got, want = np.asarray(got, np.float32).ravel(), np.asarray(want, np.float32).ravel()
    ref = want if ref is None else np.asarray(ref, np.float32).ravel()
    atol = np.broadcast_to(np.asarray(atol, np.float64).ravel() if np.size(atol) == got.size else atol, got.shape)
    ng, nw = np.isnan(got), np.isnan(want)
    bad = ng != nw
    both = ~ng & ~nw
    if exact:
        bad |= both & (got.view(np.uint32) != want.view(np.uint32))
    else:
        inf = np.isinf(got) | np.isinf(want)
        bad |= both & inf & (got != want)
        fin = both & ~inf & np.isfinite(ref)
        with np.errstate(invalid="ignore", over="ignore"):
            close = (np.abs(_ordered(got) - _ordered(ref)) <= ULPS) | (np.abs(got.astype(np.float64) - ref) <= atol)
        bad |= fin & ~close
        zero = both & (got == 0) & (want == 0)
        bad |= zero & (np.signbit(got) != np.signbit(want))
    idx = np.flatnonzero(bad)
    assert not idx.size, "%s: %d mismatches, e.g. %s" % (
        what, idx.size, [(int(i), float(got[i]), float(want[i]), float(ref[i])) for i in idx[:5]])


def dense_results(rank, bias):
    """{(act, slope): (y, grads)} of fused_dense, for the comparisons in the parent."""
    out = {}
    for act in ACTS:
        for slope in ((0.25, 0.0, -2.0) if act == "leaky" else (0.25,)):
            out[(act, slope)] = run_dense(act, slope, rank, bias, True, _head)
    return out


def compare_dense(results, rank, bias):
    x, w, b = dense_inputs(rank, bias)
    z_got = results[("none", 0.25)][0]
    z_want = run_dense("none", 0.25, rank, bias, False, _head)[0]
    check(z_got, z_want, True, what="z = x w + b (K = 1)")
    for (act, slope), (y, grads) in results.items():
        want_y, want_g = run_dense(act, slope, rank, bias, False, _head)
        # MXNet's own kernels (rank 6) for the values of what oneDNN runs at rank <= 5
        ref_y, ref_g = run_dense(act, slope, 6, bias, False, _head) if rank <= 5 else (want_y, want_g)
        ref_y = ref_y.reshape(want_y.shape)
        gelu = act.startswith("gelu")
        zabs = np.abs(z_want.astype(np.float64))
        check(y, want_y, act in EXACT, ref=ref_y, atol=4e-7 * zabs if gelu else 0.0,
              what="forward act=%s slope=%g rank %d" % (act, slope, rank))
        # gradients are sums over the other GEMM dimension: NaN/±inf exactly, values to 1e-5
        dz_scale = np.abs(_head(want_y.shape).astype(np.float64))
        for name, g, wg in zip(("dx", "dw", "db"), grads, want_g):
            if name == "dx":
                tol = 1e-5 * (dz_scale.reshape(len(SPECIAL), -1) @ np.abs(W_COL.astype(np.float64)))
            elif name == "dw":
                tol = 1e-5 * (dz_scale.reshape(len(SPECIAL), -1).T @ np.abs(np.nan_to_num(SPECIAL, posinf=0, neginf=0).astype(np.float64)))
            else:
                tol = 1e-5 * dz_scale.reshape(len(SPECIAL), -1).sum(0)
            check_sum(g, wg, tol.reshape(g.shape), "%s act=%s slope=%g rank %d" % (name, act, slope, rank))


def check_sum(got, want, tol, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    ng, nw = np.isnan(got), np.isnan(want)
    bad = ng != nw
    both = ~ng & ~nw
    inf = np.isinf(got) | np.isinf(want)
    bad |= both & inf & (got != want)
    with np.errstate(invalid="ignore", over="ignore"):
        bad |= both & ~inf & (np.abs(got.astype(np.float64) - want) > tol + 1e-30)
    idx = np.flatnonzero(bad.ravel())
    assert not idx.size, "%s: %d mismatches, e.g. %s" % (
        what, idx.size, [(int(i), float(got.ravel()[i]), float(want.ravel()[i])) for i in idx[:5]])


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("bias", [True, False])
def test_dense_epilogues_match_mxnet(rank, bias):
    compare_dense(dense_results(rank, bias), rank, bias)


def test_dense_nan_row_poisons_like_fullyconnected():
    """A NaN (or inf·0) inside the GEMM sum: the whole output row is NaN, as in MXNet."""
    rng = np.random.RandomState(0)
    x = rng.uniform(-1, 1, (12, 40)).astype(np.float32)
    x[3, 7], x[5, 0], x[8, 39] = np.nan, np.inf, -np.inf
    w = rng.uniform(-1, 1, (16, 40)).astype(np.float32)
    w[2, 0] = 0.0   # inf * 0 in row 5, column 2
    for act in ACTS:
        got = mx.nd.fused_dense(mx.nd.array(x), mx.nd.array(w), no_bias=True, act=act).asnumpy()
        want = mx_act(mx.nd.FullyConnected(mx.nd.array(x), mx.nd.array(w), num_hidden=16, no_bias=True),
                      act, 0.25).asnumpy()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=act)
        np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want), err_msg=act)
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=act)


# ------------------------------------------------------------------ fused_add_layer_norm

LN_ROWS = np.array([
    [1, 2, 3, 4, 5, 6], [np.nan, 1, 2, 3, 4, 5], [np.inf, 1, 2, 3, 4, 5], [-np.inf, 1, 2, 3, 4, 5],
    [np.inf, -np.inf, 2, 3, 4, 5], [3e38, 3e38, 1, 2, 3, 4], [1e20, -1e20, 1, 2, 3, 4],
    [2, 2, 2, 2, 2, 2], [1e-40, -1e-40, 0, 0, 1e-40, 0], [1e19, 1e19, 1e19, 1e19, 1e19, 1.0000001e19],
    [-0.0, -0.0, -0.0, -0.0, -0.0, -0.0], [1e-30, 2e-30, -1e-30, 0, 5e-31, 1e-30]], np.float32)
LN_B = np.array([0.5, -0.0, 0.0, 1.0, -2.0, 0.25], np.float32)
LN_G = np.array([1.0, -1.0, 0.5, 2.0, 0.0, 1.0], np.float32)
LN_BETA = np.array([0.0, 0.5, -1.0, 0.0, 3.0, -0.0], np.float32)


def run_ln(rank, fused, output_sum, eps=1e-5, bcast=True):
    a = LN_ROWS.reshape((LN_ROWS.shape[0],) + (1,) * (rank - 2) + (LN_ROWS.shape[1],))
    b = LN_B if bcast else np.resize(LN_ROWS[::-1], a.shape)
    arrs = [mx.nd.array(v) for v in (a, b, LN_G, LN_BETA)]
    for v in arrs:
        v.attach_grad()
    rng = np.random.RandomState(9)
    heads = [rng.uniform(-2, 2, a.shape).astype(np.float32) for _ in range(2)]
    with mx.autograd.record():
        if fused:
            o = mx.nd.fused_add_layer_norm(*arrs, eps=eps, output_sum=output_sum)
            outs = list(o) if output_sum else [o]
        else:
            s = mx.nd.broadcast_add(arrs[0], arrs[1])
            outs = [mx.nd.LayerNorm(s, arrs[2], arrs[3], eps=eps)] + ([s] if output_sum else [])
    mx.autograd.backward(outs, [mx.nd.array(h) for h in heads[:len(outs)]])
    return [o.asnumpy() for o in outs], [v.grad.asnumpy() for v in arrs]


def compare_ln(results, rank):
    for (output_sum, bcast), (outs, grads) in results.items():
        want_outs, want_grads = run_ln(rank, False, output_sum, bcast=bcast)
        what = "rank %d output_sum=%s b %s" % (rank, output_sum, "broadcast" if bcast else "full")
        # y: a row's scale; the sum s: exact
        scale = np.nanmax(np.abs(np.where(np.isfinite(want_outs[0]), want_outs[0], 0)), axis=-1, keepdims=True)
        check_sum(outs[0], want_outs[0], 1e-5 * np.broadcast_to(scale + 1, outs[0].shape), "y " + what)
        if output_sum:
            check(outs[1], want_outs[1], True, what="sum " + what)
        for name, g, w in zip(("da", "db", "dgamma", "dbeta"), grads, want_grads):
            fin = np.where(np.isfinite(w), np.abs(w), 0)
            tol = 1e-4 * (fin.max() + 1) if name in ("dgamma", "dbeta", "db") else 1e-5 * (
                np.max(fin, axis=-1, keepdims=True) + 1)
            check_sum(g, w, np.broadcast_to(tol, g.shape), name + " " + what)


def ln_results(rank):
    return {(o, bc): run_ln(rank, True, o, bcast=bc) for o in (False, True) for bc in (True, False)}


@pytest.mark.parametrize("rank", RANKS)
def test_add_layer_norm_matches_mxnet(rank):
    compare_ln(ln_results(rank), rank)


def test_portable_path_matches_mxnet(tmp_path):
    """The same comparisons with MXFUSION_DISABLE_AVX512=1 (read when the library loads)."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    code = ("import sys, pickle\n"
            "sys.path[:0] = [%r, %r]\n"
            "import fusion, test_dense_ln_semantics as T\n"
            "out = {('dense', r, b): T.dense_results(r, b) for r in T.RANKS for b in (True, False)}\n"
            "out.update({('ln', r): T.ln_results(r) for r in T.RANKS})\n"
            "pickle.dump(out, open(sys.argv[1], 'wb'))\n" % (root, here))
    path = str(tmp_path / "portable.pkl")
    r = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=600, cwd=root,
                       env=dict(os.environ, MXFUSION_DISABLE_AVX512="1", OMP_NUM_THREADS="2"))
    assert r.returncode == 0, r.stderr[-3000:]
    import pickle
    with open(path, "rb") as f:
        out = pickle.load(f)
    for rank in RANKS:
        for bias in (True, False):
            compare_dense(out[("dense", rank, bias)], rank, bias)
        compare_ln(out[("ln", rank)], rank)
