"""Every op the elementwise rule takes, against MXNet's own op, on NaN, ±inf, ±0,
subnormals and huge/small magnitudes: forward and backward, at rank 2 (where MXNet
runs Activation and LeakyReLU through oneDNN) and rank 6 (its own kernels), on the
AVX-512 path and on the portable loops (``MXFUSION_DISABLE_AVX512=1``, in a subprocess).

Each case is ``op(_copy(x), …)``: the elementwise rule fuses it into a one-op
``fused_elemwise`` program, which is bound and compared with the original graph
(oneDNN subgraph backend off).  All cases of a rank run as one ``Group``.

Tolerances:
* exact ops (arithmetic, comparisons, relu, abs, max/min, clip, where, hard_sigmoid,
  leaky, pow/log/sqrt — glibc's, as MXNet's — …): bitwise, forward and backward
  (NaN compared as NaN, zeros by sign);
* transcendental ops computed by the kernel's own vector math (exp, sigmoid, tanh, erf,
  gelu): NaN and ±inf exactly where MXNet has them; finite values within ``ULPS`` ulps
  of MXNet's own kernels (for gelu, whose 1 + erf cancels, also within 4e-7·|x|
  absolute; the backward of these within ``ULPS`` ulps + 2⁻²⁰·|dy|, the rounding of
  y amplified by 1 − y);  where MXNet runs the op through oneDNN (rank ≤ 5) values are
  compared with MXNet's own kernel (oneDNN's approximations differ from it by up to
  1e-4 relative for gelu and flush sigmoid below 1.2e-38), NaN/±inf positions and the
  sign of exact zeros with the oneDNN result;
* BatchNorm as scale-shift: NaN/±inf exactly, finite within 1e-6 of |x·s| + |t|;
* gradients summed over broadcast axes: NaN/±inf exactly, finite within 1e-5 of the
  sum of |terms|.
"""
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.native.env import subgraph_backend

ULPS = 4
F32_MIN = np.float32(1.1754944e-38)
SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, F32_MIN, -F32_MIN,
                    3e38, -3e38, 1e-30, -1e-30, 1e30, -1e30, 0.1, -0.1, 0.5, -0.5, 1.0, -1.0,
                    2.0, -2.0, 3.0, -3.0, 5.5, -5.5, 15.0, -15.0, 20.5, -20.5, 87.5, -87.5,
                    88.5, -88.5, 89.0, -89.0, 100.0, -100.0, 0.6, -0.6, 7.25, -9.5, 1e-7],
                   np.float32)
PAIR = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, F32_MIN, 3e38, -3e38,
                 1e-30, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 3.0, 7.5, -100.0, 100.0], np.float32)
SCALARS = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 3.0, 0.1, -2.5, float("nan"), float("inf"),
           float("-inf"), 1e-30, 1e30, 1e-40]
RANKS = (2, 6)

S = mx.sym


def _unary_x(seed=0):
    rng = np.random.RandomState(seed)
    return np.concatenate([SPECIAL, rng.uniform(-10, 10, 64).astype(np.float32),
                           rng.standard_normal(32).astype(np.float32) * 1e-3])


def _pairs():
    a = np.repeat(PAIR, len(PAIR))
    b = np.tile(PAIR, len(PAIR))
    rng = np.random.RandomState(1)
    ra, rb = rng.uniform(-5, 5, (2, 64)).astype(np.float32)
    return np.concatenate([a, ra]), np.concatenate([b, rb])


@dataclass
class Case:
    name: str
    build: Callable            # (dict of input symbols) -> output symbol
    inputs: Dict[str, np.ndarray]
    fwd: str = "exact"         # exact | approx | bn
    bwd: Optional[str] = "exact"   # exact | approx | sum | None (forward only)
    dnnl: bool = False         # an op MXNet runs through oneDNN at rank <= 5 (approx values)
    one_d: tuple = ()          # inputs that stay 1-D at every rank (a row condition)
    params: Dict[str, np.ndarray] = field(default_factory=dict)
    scale: Optional[Callable] = None   # extra absolute tolerance from the inputs (approx)
    op: str = ""               # bwd="sum": the op, run by MXNet on the broadcast operand tiled


def _cp(v):
    return S.identity(v)


def _op(name):
    return getattr(S, name, None) or getattr(S._internal, name)


def build_cases() -> List[Case]:
    from patterns.elementwise import EXPR
    cases: List[Case] = []
    x = _unary_x()
    a, b = _pairs()
    transcendental = {"exp", "sigmoid", "tanh", "erf"}
    for name in sorted(EXPR):
        if name in ("Activation", "LeakyReLU", "hard_sigmoid", "clip", "where", "Dropout", "_copy",
                    "identity", "fused_elemwise", "reciprocal"):
            continue
        f = _op(name)
        if "scalar" in name.lower():
            for k, s in enumerate(SCALARS):
                cases.append(Case("%s(x, %r)" % (name, s), lambda v, f=f, s=s: f(_cp(v["x"]), scalar=s),
                                  {"x": x}))
            continue
        try:
            arity = len(f(S.var("p"), S.var("q")).list_arguments())
        except Exception:
            arity = 1
        if arity == 2:
            cases.append(Case(name, lambda v, f=f: f(_cp(v["a"]), _cp(v["b"])), {"a": a, "b": b}))
            if name.startswith("broadcast_"):   # a broadcast operand: gradients summed
                cases.append(Case(name + " bcast", lambda v, f=f: f(_cp(v["a"]), _cp(v["b"])),
                                  {"a": a[:462].reshape(22, 21), "b": PAIR.reshape(1, 21)}, bwd="sum",
                                  op=name))
        else:
            kind = "approx" if name in transcendental else "exact"
            cases.append(Case(name, lambda v, f=f: f(_cp(v["x"])), {"x": x}, fwd=kind, bwd=kind))
    cases.append(Case("reciprocal", lambda v: S.reciprocal(_cp(v["x"])), {"x": x}))
    for act in ("relu", "sigmoid", "tanh"):
        kind = "exact" if act == "relu" else "approx"
        cases.append(Case("Activation(%s)" % act, lambda v, act=act: S.Activation(_cp(v["x"]), act_type=act),
                          {"x": x}, fwd=kind, bwd=kind, dnnl=act != "relu"))
    for slope in (0.25, 0.1, 0.0, -2.0, 1.5):
        cases.append(Case("LeakyReLU(leaky, %r)" % slope,
                          lambda v, s=slope: S.LeakyReLU(_cp(v["x"]), act_type="leaky", slope=s), {"x": x}))
    cases.append(Case("LeakyReLU(gelu)", lambda v: S.LeakyReLU(_cp(v["x"]), act_type="gelu"), {"x": x},
                      fwd="approx", bwd="approx", dnnl=True, scale=lambda i: 4e-7 * np.abs(i["x"])))
    for al, be in ((0.2, 0.5), (0.3, 0.55), (-1.0, 0.5), (0.0, 0.25), (1e30, 0.5)):
        cases.append(Case("hard_sigmoid(%r, %r)" % (al, be),
                          lambda v, al=al, be=be: S.hard_sigmoid(_cp(v["x"]), alpha=al, beta=be), {"x": x}))
    for lo, hi in ((-1.0, 1.0), (0.0, 6.0), (1.0, -1.0), (float("-inf"), 0.0), (0.0, float("inf")),
                   (float("nan"), 1.0), (-0.0, 0.0)):
        cases.append(Case("clip(%r, %r)" % (lo, hi), lambda v, lo=lo, hi=hi: S.clip(_cp(v["x"]), lo, hi),
                          {"x": x}))
    c = np.where(np.arange(len(a)) % 3 == 0, a, np.where(np.arange(len(a)) % 3 == 1, 0.0, -0.0)).astype(np.float32)
    cases.append(Case("where", lambda v: S.where(_cp(v["c"]), _cp(v["a"]), _cp(v["b"])),
                      {"c": c, "a": a, "b": b}))
    rows = PAIR.copy()
    cases.append(Case("where rows", lambda v: S.where(v["c"], _cp(v["a"]), _cp(v["b"])),
                      {"c": rows, "a": np.tile(a[:21 * 3].reshape(21, 3), (1, 1)), "b": b[:21 * 3].reshape(21, 3)},
                      one_d=("c",)))
    # scalar chains the forward plan folds: exactly the separately rounded ops
    rng = np.random.RandomState(3)
    xr = np.concatenate([x, rng.uniform(-10, 10, 4000).astype(np.float32)])
    chains = {
        "relu((x*3)+0.1)": lambda t: S.relu(S._internal._plus_scalar(S._internal._mul_scalar(t, scalar=3.0), scalar=0.1)),
        "(x*3)+0.1": lambda t: S._internal._plus_scalar(S._internal._mul_scalar(t, scalar=3.0), scalar=0.1) * 1.0,
        "act_relu(-(x)*1.7-0.3)": lambda t: S.Activation(S._internal._minus_scalar(
            S._internal._mul_scalar(S.negative(t), scalar=1.7), scalar=0.3), act_type="relu"),
        "relu(-((x*1.3)+0.2))": lambda t: S.relu(S.negative(S._internal._plus_scalar(
            S._internal._mul_scalar(t, scalar=1.3), scalar=0.2))),
        "relu(((x+1)*2)-1)": lambda t: S.relu(S._internal._minus_scalar(S._internal._mul_scalar(
            S._internal._plus_scalar(t, scalar=1.0), scalar=2.0), scalar=1.0)),
        "relu((x*1e30)*1e10)": lambda t: S.relu(S._internal._mul_scalar(S._internal._mul_scalar(t, scalar=1e30), scalar=1e10)),
        "relu((x*10)*0.1)": lambda t: S.relu(S._internal._mul_scalar(S._internal._mul_scalar(t, scalar=10.0), scalar=0.1)),
        "relu(-(x*3))": lambda t: S.relu(S.negative(S._internal._mul_scalar(t, scalar=3.0))),
        "relu(x/4 - 2)": lambda t: S.relu(S._internal._minus_scalar(S._internal._div_scalar(t, scalar=4.0), scalar=2.0)),
        "relu(2 - x)": lambda t: S.relu(S._internal._rminus_scalar(t, scalar=2.0)),
        "relu((x+0)*-1)": lambda t: S.relu(S._internal._mul_scalar(S._internal._plus_scalar(t, scalar=0.0), scalar=-1.0)),
    }
    for nm, f in chains.items():
        cases.append(Case(nm, lambda v, f=f: f(v["x"]), {"x": xr}))
    for nm, f in {"sigmoid((x*1.5)+0.5)": lambda t: S.sigmoid(S._internal._plus_scalar(S._internal._mul_scalar(t, scalar=1.5), scalar=0.5)),
                  "exp(-x)": lambda t: S.exp(S.negative(t)),
                  "tanh(x-0.25)": lambda t: S.tanh(S._internal._minus_scalar(t, scalar=0.25)),
                  "erf(x*0.7)": lambda t: S.erf(S._internal._mul_scalar(t, scalar=0.7))}.items():
        cases.append(Case(nm, lambda v, f=f: f(v["x"]), {"x": xr}, fwd="approx", bwd="approx"))
    # BatchNorm (inference) as scale-shift, then an op: forward only
    C = 4
    bn_p = {"gamma": np.array([1.5, 0.0, -2.0, 1e-3], np.float32), "beta": np.array([0.1, -1.0, 0.0, 5.0], np.float32),
            "mean": np.array([0.0, 1.0, -3.0, 1e3], np.float32), "var": np.array([1.0, 2.0, 0.5, 1e-6], np.float32)}
    xb = np.resize(x, (len(x) // C * C,)).reshape(-1, C)
    cases.append(Case("BatchNorm", lambda v: S.relu(S.BatchNorm(v["xb"], v["gamma"], v["beta"], v["mean"], v["var"],
                                                                fix_gamma=False, eps=1e-5)),
                      {"xb": xb}, fwd="bn", bwd=None, params=bn_p))
    cases.append(Case("Dropout", lambda v: S.relu(S.Dropout(_cp(v["x"]), p=0.5)), {"x": x}, bwd=None))
    return cases


def _shaped(case: Case, rank: int) -> Dict[str, np.ndarray]:
    out = {}
    for k, v in case.inputs.items():
        if k in case.one_d or (case.fwd == "bn" and k == "xb"):
            out[k] = v if k in case.one_d else v.reshape(v.shape + (1,) * (rank - v.ndim))
        else:
            out[k] = v.reshape(v.shape + (1,) * (rank - v.ndim))
    return out


def group(cases: List[Case], rank: int):
    """(Group symbol, data inputs, params) with each case's names prefixed c<i>_."""
    outs, data, params = [], {}, {}
    for i, case in enumerate(cases):
        pre = "c%d_" % i
        names = list(case.inputs) + list(case.params)
        v = {n: S.var(pre + n) for n in names}
        outs.append(case.build(v))
        for k, arr in _shaped(case, rank).items():
            data[pre + k] = arr
        for k, arr in case.params.items():
            params[pre + k] = arr
    return S.Group(outs), data, params


def head_grads(shapes, special=False):
    """Head gradients: uniform in [-2, 2], or the special values (NaN, inf, ...) repeated."""
    rng = np.random.RandomState(7)
    out = []
    for shape in shapes:
        g = rng.uniform(-2, 2, shape).astype(np.float32)
        if special:
            g.ravel()[:] = np.resize(SPECIAL, g.size)
        out.append(g)
    return out


def run(sym, data, params, with_grad, special_dy=False):
    """Forward outputs (inference) and, when asked, input gradients (training forward)."""
    aux_names = set(sym.list_auxiliary_states())
    args = {k: mx.nd.array(v) for k, v in {**data, **params}.items() if k not in aux_names}
    aux = {k: mx.nd.array(v) for k, v in params.items() if k in aux_names}
    args = {k: args[k] for k in sym.list_arguments()}
    with subgraph_backend(False):
        exe = sym.bind(mx.cpu(), args, aux_states=aux, grad_req="null")
    fwd = [o.asnumpy() for o in exe.forward(is_train=False)]
    grads = {}
    if with_grad:
        gargs = {k: mx.nd.zeros(v.shape) for k, v in args.items() if k in data}
        with subgraph_backend(False):
            exe = sym.bind(mx.cpu(), args, args_grad=gargs, aux_states=aux,
                           grad_req={k: ("write" if k in data else "null") for k in args})
        exe.forward(is_train=True)
        exe.backward([mx.nd.array(g) for g in head_grads([o.shape for o in fwd], special_dy)])
        grads = {k: v.asnumpy() for k, v in gargs.items()}
    return fwd, grads


def fused(cases, rank):
    sym, data, params = group(cases, rank)
    res = fusion.fuse(sym, {k: mx.nd.array(v) for k, v in params.items()}, {},
                      rules=["elementwise"], input_shapes={k: v.shape for k, v in data.items()})
    fparams = {**{k: v.asnumpy() for k, v in res.arg_params.items()},
               **{k: v.asnumpy() for k, v in res.aux_params.items()}}
    return res, data, fparams


def fused_results(rank, special_dy=False):
    cases = build_cases()
    res, data, fparams = fused(cases, rank)
    fwd, grads = run(res.symbol, data, fparams, True, special_dy)
    return fwd, grads


# ------------------------------------------------------------------ comparison

def _ordered(a):
    i = a.view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def _ulps(a, b):
    return np.abs(_ordered(a) - _ordered(b))


def mismatches(got, want, mode, ref=None, atol=0.0, limit=4):
    """Indices where got differs from want beyond `mode`'s tolerance, with values."""
    got, want = np.asarray(got, np.float32).ravel(), np.asarray(want, np.float32).ravel()
    ref = want if ref is None else np.asarray(ref, np.float32).ravel()
    atol = np.asarray(atol, np.float64)
    atol = atol.ravel() if atol.size == got.size else np.broadcast_to(atol, got.shape)
    nan_g, nan_w = np.isnan(got), np.isnan(want)
    bad = nan_g != nan_w
    both = ~nan_g & ~nan_w
    if mode == "exact":
        bad |= both & (got.view(np.uint32) != want.view(np.uint32))
    else:
        inf_g, inf_w = np.isinf(got), np.isinf(want)
        bad |= both & (inf_g | inf_w) & (got != want)
        fin = both & ~inf_g & ~inf_w
        if mode == "approx":
            zero = fin & (got == 0) & (want == 0)
            bad |= zero & (np.signbit(got) != np.signbit(want))
            refd = np.abs(got.astype(np.float64) - ref)
            ok = (_ulps(got, ref) <= ULPS) | (refd <= atol)
            bad |= fin & ~ok & np.isfinite(ref)
        else:  # a tolerance relative to the scale in atol
            bad |= fin & (np.abs(got.astype(np.float64) - want) > atol)
    idx = np.flatnonzero(bad)
    return [(int(i), float(got[i]), float(want[i]), float(ref[i])) for i in idx[:limit]], int(bad.sum())


def check_case(case: Case, i: int, rank: int, got_fwd, want_fwd, ref_fwd, got_grads, want_grads,
               ref_grads, data, dy=None):
    errors = []
    pre = "c%d_" % i
    inputs = {k[len(pre):]: v for k, v in data.items() if k.startswith(pre)}
    dnnl_here = case.dnnl and rank <= 5
    if case.fwd == "bn":
        p = case.params
        s = p["gamma"] / np.sqrt(p["var"].astype(np.float64) + 1e-5)
        t = p["beta"] - p["mean"] * s
        tol = 1e-6 * (np.abs(inputs["xb"].reshape(-1, 4) * s) + np.abs(t)).reshape(got_fwd.shape)
        bad, n = mismatches(got_fwd, want_fwd, "scaled", atol=tol)
    else:
        atol = case.scale(inputs).reshape(-1) if case.scale else 0.0
        bad, n = mismatches(got_fwd, want_fwd, case.fwd, ref=ref_fwd if dnnl_here else None, atol=atol)
    if n:
        errors.append("forward: %d mismatches, e.g. (index, got, MXNet, MXNet's own kernel) %s" % (n, bad))
    if case.bwd is None:
        return errors
    for k in case.inputs:
        g, w, r = got_grads[pre + k], want_grads[pre + k], ref_grads[pre + k]
        if case.bwd == "sum":
            want_sum, tol = _summed_gradient(case, inputs, dy, k)
            bad, n = mismatches(g, want_sum, "scaled", atol=tol)
        elif case.bwd == "exact" and not dnnl_here:
            bad, n = mismatches(g, w, "exact")
        else:
            d = np.broadcast_to(dy, g.shape) if dy is not None else 0.0
            bad, n = mismatches(g, w, "approx", ref=r if dnnl_here else None,
                                atol=2.0 ** -20 * np.abs(d).astype(np.float64))
        if n:
            errors.append("gradient of %s: %d mismatches, e.g. %s" % (k, n, bad))
    return errors


def _summed_gradient(case, inputs, dy, name):
    """MXNet's per-element gradient of ``case.op`` with its operands tiled to one shape,
    summed (float64) over the broadcast axes of input ``name``; and the tolerance of a float32
    sum of those terms (1e-6 of the sum of their magnitudes)."""
    shape = np.broadcast_shapes(*[v.shape for v in inputs.values()])
    arrs = {k: mx.nd.array(np.broadcast_to(v, shape)) for k, v in inputs.items()}
    for v in arrs.values():
        v.attach_grad()
    with mx.autograd.record():
        y = getattr(mx.nd, case.op)(*arrs.values())
    y.backward(mx.nd.array(np.broadcast_to(dy, shape)))
    terms = arrs[name].grad.asnumpy().astype(np.float64)
    axes = tuple(i for i, (d, s) in enumerate(zip(inputs[name].shape, shape)) if d != s)
    with np.errstate(invalid="ignore"):
        total = terms.sum(axis=axes, keepdims=True)
        mag = np.abs(terms).sum(axis=axes, keepdims=True)
    return total.astype(np.float32), 1e-6 * np.where(np.isfinite(mag), mag, 0.0)


def _reference(rank):
    cases = build_cases()
    sym, data, params = group(cases, rank)
    fwd, grads = run(sym, data, params, True)
    return cases, sym, data, fwd, grads


_CACHE = {}


def reference(rank):
    if rank not in _CACHE:
        _CACHE[rank] = _reference(rank)
    return _CACHE[rank]


def compare_all(rank, got_fwd, got_grads, ref_rank=6, special_dy=False):
    cases, sym, data, want_fwd, want_grads = reference(rank)
    if special_dy:
        want_fwd, want_grads = run(sym, data, group(cases, rank)[2], True, special_dy=True)
    ref_fwd, ref_grads = want_fwd, want_grads
    if rank <= 5:  # MXNet's own kernels (rank 6), for the values of the ops oneDNN runs at this rank
        _, sym6, data6, ref_fwd, ref_grads = reference(ref_rank)
        if special_dy:
            ref_fwd, ref_grads = run(sym6, data6, group(cases, ref_rank)[2], True, special_dy=True)
        ref_grads = {k: v.reshape(want_grads[k].shape) for k, v in ref_grads.items()}
        ref_fwd = [r.reshape(w.shape) for r, w in zip(ref_fwd, want_fwd)]
    dys = head_grads([o.shape for o in want_fwd], special_dy)
    errors = []
    for i, case in enumerate(cases):
        if special_dy and case.bwd not in ("exact",):
            continue
        errs = check_case(case, i, rank, got_fwd[i], want_fwd[i], ref_fwd[i], got_grads, want_grads,
                          ref_grads, data, dy=dys[i])
        errors += ["%s (rank %d): %s" % (case.name, rank, e) for e in errs]
    return errors


@pytest.mark.parametrize("rank", RANKS)
def test_every_op_fuses(rank):
    cases = build_cases()
    res, _, _ = fused(cases, rank)
    counts = res.graph.count_ops()
    assert counts.get("fused_elemwise") == len(cases), (counts, res.report.to_text(explain=True))
    assert set(counts) <= {"fused_elemwise", "Reshape"}, counts


@pytest.mark.parametrize("rank", RANKS)
def test_avx512_path_matches_mxnet(rank):
    fwd, grads = fused_results(rank)
    errors = compare_all(rank, fwd, grads)
    assert not errors, "\n".join(errors[:40])


@pytest.mark.parametrize("rank", RANKS)
def test_backward_with_special_head_gradients(rank):
    """dy itself NaN, ±inf, ±0, subnormal: MXNet's arrangement of each gradient (g * (2x),
    not (2g) * x; 0 written where clip or where cut the gradient, not g * 0)."""
    fwd, grads = fused_results(rank, special_dy=True)
    errors = compare_all(rank, fwd, grads, special_dy=True)
    assert not errors, "\n".join(errors[:40])


def test_portable_path_matches_mxnet(tmp_path):
    """The same comparisons on the portable loops (MXFUSION_DISABLE_AVX512=1): the
    library reads the switch when it loads, hence the fresh process."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    code = ("import sys, numpy as np\n"
            "sys.path[:0] = [%r, %r]\n"
            "import fusion, test_elementwise_semantics as T\n"
            "out = {}\n"
            "for rank in T.RANKS:\n"
            "    for sp in (False, True):\n"
            "        fwd, grads = T.fused_results(rank, special_dy=sp)\n"
            "        for i, o in enumerate(fwd): out['%%d_%%d_f%%d' %% (rank, sp, i)] = o\n"
            "        for k, g in grads.items(): out['%%d_%%d_g%%s' %% (rank, sp, k)] = g\n"
            "np.savez(sys.argv[1], **out)\n" % (root, here))
    path = str(tmp_path / "portable.npz")
    env = dict(os.environ, MXFUSION_DISABLE_AVX512="1", OMP_NUM_THREADS="2")
    r = subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True, text=True,
                       timeout=600, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    errors = []
    with np.load(path) as z:
        for rank in RANKS:
            for sp in (False, True):
                n = len(build_cases())
                fwd = [z["%d_%d_f%d" % (rank, sp, i)] for i in range(n)]
                pre = "%d_%d_g" % (rank, sp)
                grads = {k[len(pre):]: z[k] for k in z.files if k.startswith(pre)}
                errors += compare_all(rank, fwd, grads, special_dy=sp)
    assert not errors, "\n".join(errors[:40])
