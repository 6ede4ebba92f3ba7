"""CUDA C interface (libmxfusion_cuda.so) vs the NumPy references of the CPU tests.

Runs only with an NVIDIA GPU and PyTorch with CUDA (tensors are allocated with torch and
handed to the launchers as device pointers through ctypes); otherwise skipped.
Imports no MXNet, so on a GPU machine without MXNet it runs as

    python3 -m pytest --noconftest -q tests/kernels/test_cuda_kernels.py

(the library is built from cuda_kernels/ with nvcc on first use).
Tolerances (fp32): rtol=1e-4, atol=1e-4 (GPU transcendental functions differ by ulps).
"""
import ctypes
import os
import sys

import numpy as np
import pytest

from references import np_act, ref_attention

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "cuda_kernels"))
import cuda_iface  # noqa: E402
from cuda_iface import ACTS, AttnArgs, ptr  # noqa: E402

pytestmark = pytest.mark.gpu
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU available")
    nat = cuda_iface.native()
    if nat.nvcc_path() is None and not os.path.exists(nat.library_path(cuda=True)):
        pytest.skip("CUDA library not built (no nvcc)")
    return cuda_iface.load(), torch


def dev(torch, a):
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


@pytest.mark.parametrize("N,Sq,Sk,D", [(1, 1, 1, 8), (2, 17, 70, 40), (3, 65, 129, 128), (1, 5, 33, 96)])
@pytest.mark.parametrize("mode", ["none", "additive", "boolean", "valid_length", "causal"])
def test_attention_plain(cuda, N, Sq, Sk, D, mode):
    lib, torch = cuda
    rs = np.random.RandomState(0)
    q, k, v = (rs.uniform(-1, 1, s).astype(np.float32) for s in ((N, Sq, D), (N, Sk, D), (N, Sk, D)))
    tq, tk, tv = dev(torch, q), dev(torch, k), dev(torch, v)
    to = torch.empty((N, Sq, D), device="cuda")
    a = AttnArgs(B=N, H=1, Sq=Sq, Sk=Sk, D=D, Dv=D, q=ptr(tq), k=ptr(tk), v=ptr(tv), o=ptr(to),
                 q_bs=Sq * D, q_rs=D, k_bs=Sk * D, k_rs=D, v_bs=Sk * D, v_rs=D, o_bs=Sq * D,
                 o_rs=D, scale=0.3, mask_value=-1e18)
    mask, kind, keep = None, "none", []
    if mode in ("additive", "boolean"):
        bm = (rs.rand(N, 1, Sk) > 0.3).astype(np.float32)
        mask = bm if mode == "boolean" else np.where(bm > 0, 0, -1e9).astype(np.float32)
        tm = dev(torch, mask)
        keep.append(tm)
        a.mask_kind, a.mask, a.m_sb, a.m_sq, a.m_sk = (2 if mode == "boolean" else 1), ptr(tm), Sk, 0, 1
        kind = mode
    elif mode == "valid_length":
        mask = rs.randint(0, Sk + 1, N).astype(np.int32)
        tl = dev(torch, mask)
        keep.append(tl)
        a.mask_kind, a.lengths, a.len_sn, a.len_sq = 3, ptr(tl), 1, 0
        kind = mode
    a.causal = int(mode == "causal")
    assert lib.mxf_attention_forward(ctypes.byref(a), None) == 0
    torch.cuda.synchronize()
    want = ref_attention(q, k, v, 0.3, mask, kind, causal=mode == "causal")
    np.testing.assert_allclose(to.cpu().numpy(), want, **TOL)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("M,N,K,heads", [(1, 1, 1, 0), (37, 70, 50, 0), (130, 96, 768, 0), (2 * 9, 24, 33, 3)])
def test_dense(cuda, act, M, N, K, heads):
    lib, torch = cuda
    rs = np.random.RandomState(1)
    x, w, b = (rs.uniform(-1, 1, s).astype(np.float32) for s in ((M, K), (N, K), (N,)))
    ty = torch.empty((M * N,), device="cuda")
    tx, tw, tb = dev(torch, x), dev(torch, w), dev(torch, b)
    S = M // 2 if heads else 0
    rc = cuda_iface.dense(lib, tx, tw, tb, ty, M, N, K, act, heads=heads, S=S)
    assert rc == 0
    torch.cuda.synchronize()
    want = np_act(x.astype(np.float64) @ w.T + b, act)
    if heads:
        want = want.reshape(2, S, heads, N // heads).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(ty.cpu().numpy().reshape(want.shape), want, **TOL)


@pytest.mark.parametrize("R,C,b_rows", [(1, 1, 1), (6, 768, 6), (12, 33, 3)])
def test_add_layer_norm(cuda, R, C, b_rows):
    lib, torch = cuda
    rs = np.random.RandomState(2)
    a, b, g, be = (rs.uniform(-1, 1, s).astype(np.float32) for s in ((R, C), (b_rows, C), (C,), (C,)))
    ty, ts = torch.empty((R, C), device="cuda"), torch.empty((R, C), device="cuda")
    args = [dev(torch, x) for x in (a, b, g, be)]
    rc = cuda_iface.add_layer_norm(lib, *args, ty, ts, R, C, b_rows)
    assert rc == 0
    torch.cuda.synchronize()
    s = a.astype(np.float64) + np.tile(b, (R // b_rows, 1))
    mu, var = s.mean(-1, keepdims=True), s.var(-1, keepdims=True)
    np.testing.assert_allclose(ty.cpu().numpy(), (s - mu) / np.sqrt(var + 1e-5) * g + be, **TOL)
    np.testing.assert_allclose(ts.cpu().numpy(), s, **TOL)


@pytest.mark.parametrize("expr,shapes,fn", [
    ("mul(x0, sigmoid(add(x1, 3.0)))", [(7, 300), (300,)], lambda a, b: a / (1 + np.exp(-(b + 3)))),
    ("where(gt(x0, 0), exp(x1), neg(x0))", [(2, 3, 4), (3, 1)], lambda a, b: np.where(a > 0, np.exp(b), -a)),
    ("clip(tanh(x0), -0.5, 0.25)", [(5000,)], lambda a: np.clip(np.tanh(a), -0.5, 0.25)),
])
def test_elemwise(cuda, expr, shapes, fn):
    lib, torch = cuda
    rs = np.random.RandomState(3)
    xs = [rs.uniform(-2, 2, s).astype(np.float32) for s in shapes]
    ts = [dev(torch, x) for x in xs]
    out_shape = np.broadcast_shapes(*shapes)
    to = torch.empty(out_shape, device="cuda")
    rc, err = cuda_iface.elemwise(lib, expr, ts, to)
    assert rc == 0, err
    torch.cuda.synchronize()
    np.testing.assert_allclose(to.cpu().numpy(), fn(*[x.astype(np.float64) for x in xs]), **TOL)


def test_elemwise_bad_program_reports(cuda):
    lib, _ = cuda
    err = ctypes.create_string_buffer(512)
    rc = lib.mxf_elemwise_forward(b"foo(x0)", 1, None, None, None, None, err, 512, None)
    assert rc == -1 and b"unknown function 'foo'" in err.value
