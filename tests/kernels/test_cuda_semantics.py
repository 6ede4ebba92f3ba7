"""The CUDA fused_elemwise kernel on NaN, ±inf, ±0, subnormals and huge values against
MXNet's own semantics (NumPy references in references.py; the GPU has no oneDNN, so
act_relu keeps NaN as relu does).  The same references are checked against the CPU op
at rank 6 (where MXNet uses its own kernels too), so they are known right where no GPU
is at hand.

Runs the CUDA part only with an NVIDIA GPU and PyTorch with CUDA; imports no MXNet there
(``python3 -m pytest --noconftest -q tests/kernels/test_cuda_semantics.py``).
Tolerances: exact functions bitwise (NaN as NaN, zeros by sign); the others NaN and ±inf
exactly, finite values within 4 ulps of the float64 reference (gelu also 4e-7·|x|).
"""
import os
import sys

import numpy as np
import pytest

from references import ELEMWISE_APPROX, ELEMWISE_EXACT

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "cuda_kernels"))

SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, 1.2e-38, 3e38, -3e38, 1e-30,
                    0.5, -0.5, 1.0, -1.0, 2.0, -2.5, 5.5, 15.0, -15.0, 20.5, -20.5, 88.5, -88.5,
                    100.0, -100.0, 0.3, -7.25], np.float32)
ARITY = {"where": 3, "clip": 3, "hard_sigmoid": 3, "leaky": 2}
BINARY = {"add", "sub", "mul", "div", "pow", "max", "min", "lt", "le", "gt", "ge", "eq", "ne"}
FUNCS = sorted(set(ELEMWISE_EXACT) | set(ELEMWISE_APPROX))


def operands(fn):
    """The inputs of `fn`: every pair of special values for binary functions, constants
    as the rules write them for the rest."""
    if fn in BINARY:
        return [np.repeat(SPECIAL, len(SPECIAL)), np.tile(SPECIAL, len(SPECIAL))], "%s(x0, x1)" % fn
    if fn == "leaky":
        return [SPECIAL, np.array([0.1], np.float32)], "leaky(x0, x1)"
    if fn == "where":
        return [np.resize(SPECIAL[::-1], SPECIAL.size), SPECIAL, -SPECIAL], "where(x0, x1, x2)"
    if fn == "clip":
        return [SPECIAL, np.array([-1.0], np.float32), np.array([6.0], np.float32)], "clip(x0, x1, x2)"
    if fn == "hard_sigmoid":
        return [SPECIAL, np.array([0.2], np.float32), np.array([0.5], np.float32)], "hard_sigmoid(x0, x1, x2)"
    return [SPECIAL], "%s(x0)" % fn


def _ordered(a):
    i = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def check(fn, got, args):
    exact = fn in ELEMWISE_EXACT
    want = (ELEMWISE_EXACT if exact else ELEMWISE_APPROX)[fn](*args).ravel()
    got = np.asarray(got, np.float32).ravel()
    ng, nw = np.isnan(got), np.isnan(want)
    bad = ng != nw
    both = ~ng & ~nw
    if exact:
        bad |= both & (got.view(np.uint32) != want.view(np.uint32))
    else:
        inf = np.isinf(got) | np.isinf(want)
        bad |= both & inf & (got != want)
        atol = 4e-7 * np.abs(np.broadcast_to(args[0], got.shape)) if fn == "gelu" else 0.0
        close = (np.abs(_ordered(got) - _ordered(want)) <= 4) | (np.abs(got.astype(np.float64) - want) <= atol)
        bad |= both & ~inf & ~close
    idx = np.flatnonzero(bad)
    assert not idx.size, "%s: %d mismatches, e.g. %s" % (
        fn, idx.size, [(tuple(float(np.broadcast_to(a, got.shape)[i]) for a in args), float(got[i]), float(want[i]))
                       for i in idx[:4]])


@pytest.mark.parametrize("fn", FUNCS)
def test_references_match_the_cpu_op_at_rank_6(fn):
    mx = pytest.importorskip("mxnet")
    from kernel_fixtures import native_module
    native = native_module()
    native.build(cuda=False)
    native.load()
    args, expr = operands(fn)
    r6 = [a.reshape(a.shape + (1,) * (6 - a.ndim)) for a in args]
    got = mx.nd.fused_elemwise(*[mx.nd.array(a) for a in r6], expr=expr).asnumpy()
    check(fn, got, args)


@pytest.fixture(scope="module")
def cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU available")
    import cuda_iface
    if cuda_iface.nvcc_path() is None and not os.path.exists(cuda_iface.library_path()):
        pytest.skip("CUDA library not built (no nvcc)")
    return cuda_iface, cuda_iface.load(), torch


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["generated", "interpreter"])
@pytest.mark.parametrize("fn", FUNCS)
def test_cuda_kernel_matches_mxnet_semantics(cuda, fn, kernel):
    """Both GPU forms: the kernel NVRTC compiles for the expression, and the interpreter (its fallback)."""
    cuda_iface, lib, torch = cuda
    args, expr = operands(fn)
    ins = [torch.from_numpy(np.ascontiguousarray(a)).cuda() for a in args]
    out = torch.empty(np.broadcast_shapes(*[a.shape for a in args]), device="cuda")
    before = lib.mxf_elemwise_set_jit(1 if kernel == "generated" else 0)
    try:
        rc, err = cuda_iface.elemwise(lib, expr, ins, out)
    finally:
        lib.mxf_elemwise_set_jit(before)
    assert rc == 0, err
    torch.cuda.synchronize()
    check(fn, out.cpu().numpy(), args)
