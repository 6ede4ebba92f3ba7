"""CUDA C interface (the standalone build of cuda_kernels/*.cu, see cuda_kernels/cuda_iface.py)
against float64 references: PyTorch autograd for the gradients, the NumPy references of the CPU
tests for the forward semantics.  Every op in fp32, fp16 and bf16, forward and backward
(fused_elemwise: forward only, its backward runs on the CPU).

Runs only with an NVIDIA GPU, PyTorch with CUDA, nvcc and cuBLASLt (the nvidia-cublas wheel);
otherwise skipped with the reason.  Imports no MXNet, so on a GPU machine without MXNet it runs as

    python3 -m pytest --noconftest -q tests/kernels/test_cuda_kernels.py

(the library is built with nvcc on first use, into build/mxfusion_cuda_iface/).
Tolerances: max |got - want| <= tol * (1 + max |want|), tol 1e-4 (fp32), 5e-3 (fp16), 4e-2 (bf16);
the references take the inputs as rounded to the dtype.
"""
import ctypes
import os
import sys

import numpy as np
import pytest

from references import np_act, ref_attention

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "cuda_kernels"))
import cuda_iface as ci  # noqa: E402

pytestmark = pytest.mark.gpu
DTYPES = ["float32", "float16", "bfloat16"]
TOL = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 4e-2}


@pytest.fixture(scope="module")
def cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU available")
    if ci.nvcc_path() is None and not os.path.exists(ci.library_path()):
        pytest.skip("CUDA library not built (no nvcc)")
    if ci.cublas_dirs() is None and not os.path.exists(ci.library_path()):
        pytest.skip("cuBLASLt not found (pip install nvidia-cublas)")
    lib = ci.load()
    return lib, torch, ci.Workspace(torch)


def tdt(torch, name):
    return getattr(torch, name)


def rand(torch, shape, dtype, lo=-1.0, hi=1.0, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.rand(shape, generator=g, dtype=torch.float64) * (hi - lo) + lo
    return x.to(tdt(torch, dtype)).cuda()


def f64(t):
    return t.detach().double().cpu().numpy()


def close(got, want, dtype, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    nw = np.isnan(want)
    assert (np.isnan(got) == nw).all(), "%s: NaN pattern differs" % what
    iw = np.isinf(want)
    assert (got[iw] == want[iw]).all(), "%s: infinities differ" % what
    fin = ~nw & ~iw
    if fin.any():
        err = np.abs(got[fin] - want[fin]).max()
        scale = 1 + np.abs(want[fin]).max()
        assert err <= TOL[dtype] * scale, "%s: max abs error %g > %g" % (what, err, TOL[dtype] * scale)


def ok(lib, rc):
    assert rc == 0, ci.error(lib, rc)


def test_library_reports_itself(cuda):
    lib, _, _ = cuda
    assert lib.mxf_cublaslt_version() > 0
    assert [lib.mxf_dtype_size(c) for c in (0, 1, 2, 7)] == [4, 2, 2, 0]
    assert b"workspace" in lib.mxf_cuda_error_string(ci.ERR_WORKSPACE)


# ----------------------------------------------------------------------------- attention

MODES = ["none", "additive", "boolean", "valid_length", "causal", "causal_add", "causal_fill",
         "causal_add_far"]
SHAPES = [(1, 1, 1, 1, 8), (2, 3, 17, 70, 40), (1, 2, 65, 129, 128), (1, 1, 5, 33, 96),
          (1, 2, 70, 64, 256), (2, 1, 130, 90, 64)]


def attn_case(torch, dtype, B, H, Sq, Sk, D, mode, layout, seed=0):
    """Inputs, args and the NumPy reference of one forward case."""
    rs = np.random.RandomState(seed)
    if layout == "bhsd":
        q, k, v = (rand(torch, s, dtype, seed=seed + i) for i, s in
                   enumerate(((B, H, Sq, D), (B, H, Sk, D), (B, H, Sk, D))))
    else:  # bshd views of one packed buffer: strides of the op's interleaved layouts
        buf = rand(torch, (B, max(Sq, Sk), 3, H, D), dtype, seed=seed)
        q, k, v = buf[:, :Sq, 0], buf[:, :Sk, 1], buf[:, :Sk, 2]
    o = torch.empty((B, H, Sq, D) if layout == "bhsd" else (B, Sq, H, D), dtype=q.dtype, device="cuda")
    lse = torch.empty((B * H * Sq,), dtype=torch.float32, device="cuda")
    causal = {"causal": "exclude", "causal_add": "add", "causal_fill": "fill", "causal_add_far": "add"}.get(mode, "none")
    mv = -1e18 if mode in ("none", "boolean", "causal", "causal_add_far") else -3.0
    a = ci.attention_args(q, k, v, o, 0.3, layout=layout, causal=causal, mask_value=mv, lse=lse)
    keep, mask, kind = [], None, "none"
    if mode in ("additive", "boolean"):
        bm = (rs.rand(B, 1, Sk) > 0.3).astype(np.float32)
        mask = bm if mode == "boolean" else np.where(bm > 0, rs.uniform(-1, 1, bm.shape), -1e9).astype(np.float32)
        tm = torch.from_numpy(mask).to(q.dtype).cuda()
        keep.append(tm)
        a.mask_kind, a.mask, a.m_sb, a.m_sh, a.m_sq, a.m_sk = ci.MASK_KINDS[mode], tm.data_ptr(), Sk, 0, 0, 1
        mask = f64(tm)
        kind = mode
    elif mode == "valid_length":
        lens = rs.randint(0, Sk + 1, B * H).astype(np.int32)
        tl = torch.from_numpy(lens).cuda()
        keep.append(tl)
        a.mask_kind, a.lengths, a.len_sn, a.len_sq = 3, tl.data_ptr(), 1, 0
        mask, kind = lens, mode

    def nsd(t, S, Dx):  # (B*H, S, D) float64
        x = f64(t)
        x = x if layout == "bhsd" else x.transpose(0, 2, 1, 3)
        return x.reshape(B * H, S, Dx)

    rmask = mask
    if kind in ("additive", "boolean"):
        rmask = np.repeat(mask, H, axis=0)
    want = ref_attention(nsd(q, Sq, D), nsd(k, Sk, D), nsd(v, Sk, D), 0.3, rmask, kind,
                         causal=causal != "none", mask_value=mv,
                         causal_mode=causal if causal != "none" else "exclude")
    return dict(q=q, k=k, v=v, o=o, lse=lse, args=a, keep=keep, want=want, mask=mask, kind=kind,
                causal=causal, mv=mv, nsd=nsd)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,Sq,Sk,D", SHAPES)
@pytest.mark.parametrize("mode", MODES)
def test_attention_forward(cuda, dtype, B, H, Sq, Sk, D, mode):
    lib, torch, ws = cuda
    c = attn_case(torch, dtype, B, H, Sq, Sk, D, mode, "bhsd")
    ok(lib, ci.attention(lib, ws, c["args"]))
    torch.cuda.synchronize()
    close(c["nsd"](c["o"], Sq, D), c["want"], dtype, "out")
    if mode in ("none", "causal"):  # the log-sum-exp of each row's (visible) scores
        s = np.einsum("nqd,nkd->nqk", c["nsd"](c["q"], Sq, D), c["nsd"](c["k"], Sk, D)) * 0.3
        if mode == "causal":
            band = np.arange(Sk)[None, :] <= np.arange(Sq)[:, None] + (Sk - Sq)
            s = np.where(band[None], s, -np.inf)
        with np.errstate(divide="ignore"):
            m = s.max(-1, keepdims=True)
            want = np.where(np.isfinite(m[..., 0]), (m + np.log(np.exp(s - np.where(np.isfinite(m), m, 0)).sum(-1,
                            keepdims=True)))[..., 0], np.inf)
        close(f64(c["lse"]).reshape(want.shape), want, dtype, "lse")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_attention_forward_strided_layout(cuda, dtype, mode):
    lib, torch, ws = cuda
    c = attn_case(torch, dtype, 2, 3, 40, 40, 64, mode, "bshd")
    ok(lib, ci.attention(lib, ws, c["args"]))
    torch.cuda.synchronize()
    close(c["nsd"](c["o"], 40, 64), c["want"], dtype, "out")


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_nonfinite_rows(cuda, dtype):
    """A NaN / +inf score or an all -inf row gives NaN; valid length 0 gives 0; a row that skips
    a key whose v is inf gives NaN in that column (the CPU op's semantics)."""
    lib, torch, ws = cuda
    B, H, S, D = 1, 1, 6, 16
    q, k, v = (rand(torch, (B, H, S, D), dtype, seed=i) for i in range(3))
    q[0, 0, 1, 0] = float("nan")
    mask = torch.zeros((B, 1, 1, S), dtype=q.dtype, device="cuda")
    o = torch.empty_like(q)
    a = ci.attention_args(q, k, v, o, 0.5)
    a.mask_kind, a.mask, a.m_sb, a.m_sk = 1, mask.data_ptr(), S, 1
    ok(lib, ci.attention(lib, ws, a))
    torch.cuda.synchronize()
    got = f64(o)[0, 0]
    assert np.isnan(got[1]).all() and np.isfinite(np.delete(got, 1, 0)).all()
    mask.fill_(float("-inf"))
    ok(lib, ci.attention(lib, ws, a))
    torch.cuda.synchronize()
    assert np.isnan(f64(o)).all()
    # valid lengths 0 and 3 with v[5] = inf: row with length 0 -> 0 unless a skipped v is inf
    v2 = v.clone()
    v2[0, 0, 5, 2] = float("inf")
    lens = torch.tensor([3], dtype=torch.int32, device="cuda")
    a = ci.attention_args(q, k, v2, o, 0.5)
    a.mask_kind, a.lengths, a.len_sn = 3, lens.data_ptr(), 1
    ok(lib, ci.attention(lib, ws, a))
    torch.cuda.synchronize()
    got = f64(o)[0, 0]
    rows = [0, 2, 3, 4, 5]
    assert np.isnan(got[rows, 2]).all() and np.isfinite(got[rows][:, [0, 1, 3]]).all()


def torch_attention(torch, q, k, v, scale, mask=None, kind="none", causal="none", mv=-1e18):
    """Float64 autograd reference on (N, S, D) tensors (rows with no visible key give 0)."""
    s = q @ k.transpose(-1, -2) * scale
    N, Sq, Sk = s.shape
    keep = torch.ones_like(s, dtype=torch.bool)
    if kind == "additive":
        s = s + mask
    elif kind == "boolean":
        s = torch.where(mask != 0, s, torch.full_like(s, mv))
    elif kind == "valid_length":
        keep = keep & (torch.arange(Sk, device=s.device)[None, None, :] < mask[:, None, None])
    if causal != "none":
        band = torch.arange(Sk, device=s.device)[None, :] <= torch.arange(Sq, device=s.device)[:, None] + (Sk - Sq)
        band = band[None].expand_as(s)
        if causal == "add":
            s = torch.where(band, s, s + mv)
        elif causal == "fill":
            s = torch.where(band, s, torch.full_like(s, mv))
        else:
            keep = keep & band
    s = s.masked_fill(~keep, float("-inf"))
    any_ = keep.any(-1, keepdim=True)
    s = torch.where(any_, s, torch.zeros_like(s))
    p = torch.softmax(s, -1) * any_
    return p @ v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,Sq,Sk,D", [(1, 1, 1, 1, 8), (2, 3, 17, 70, 40), (1, 2, 65, 129, 128),
                                         (1, 1, 33, 20, 256)])
@pytest.mark.parametrize("mode", ["none", "additive", "boolean", "valid_length", "causal", "causal_add",
                                  "causal_fill"])
def test_attention_backward(cuda, dtype, B, H, Sq, Sk, D, mode):
    lib, torch, ws = cuda
    c = attn_case(torch, dtype, B, H, Sq, Sk, D, mode, "bhsd", seed=3)
    a = c["args"]
    ok(lib, ci.attention(lib, ws, a))
    dout = rand(torch, c["o"].shape, dtype, seed=9)
    dq, dk, dv = (torch.full_like(t, 7.0) for t in (c["q"], c["k"], c["v"]))
    g = ci.AttnGrads(dout=dout.data_ptr(), dq=dq.data_ptr(), dk=dk.data_ptr(), dv=dv.data_ptr(),
                     req_dq=ci.REQ_WRITE, req_dk=ci.REQ_WRITE, req_dv=ci.REQ_ADD)
    dmask = None
    if c["kind"] == "additive":
        dmask = torch.zeros((B, 1, Sk), dtype=c["q"].dtype, device="cuda")
        g.dmask, g.dmask_numel, g.req_dmask = dmask.data_ptr(), B * Sk, ci.REQ_WRITE
    ok(lib, ci.attention_backward(lib, ws, a, g))
    torch.cuda.synchronize()
    # reference
    nsd = c["nsd"]
    Q, K, V = (torch.tensor(nsd(t, S, D), requires_grad=True) for t, S in ((c["q"], Sq), (c["k"], Sk), (c["v"], Sk)))
    m = None
    if c["kind"] in ("additive", "boolean"):
        m = torch.tensor(np.repeat(c["mask"], H, axis=0), requires_grad=c["kind"] == "additive")
    elif c["kind"] == "valid_length":
        m = torch.tensor(c["mask"].astype(np.int64))
    out = torch_attention(torch, Q, K, V, 0.3, m, c["kind"], c["causal"], c["mv"])
    out.backward(torch.tensor(nsd(dout, Sq, D)))
    close(nsd(dq, Sq, D), Q.grad.numpy(), dtype, "dq")
    close(nsd(dk, Sk, D), K.grad.numpy(), dtype, "dk")
    close(nsd(dv, Sk, D) - 7.0, V.grad.numpy(), dtype, "dv (added)")
    if dmask is not None:
        close(f64(dmask), m.grad.numpy().reshape(B, H, 1, Sk).sum(1), dtype, "dmask")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128, 200])
def test_attention_backward_full_mask_strided_layout(cuda, dtype, D):
    """(B, S, H, D) views of a packed buffer, an additive mask of the scores' full shape (its
    gradient without broadcasting), gradients added to what is there."""
    lib, torch, ws = cuda
    B, H, Sq, Sk = 2, 3, 37, 45
    buf = rand(torch, (B, Sk, 3, H, D), dtype, seed=4)
    q, k, v = buf[:, :Sq, 0], buf[:, :, 1], buf[:, :, 2]
    o = torch.empty((B, Sq, H, D), dtype=q.dtype, device="cuda")
    lse = torch.empty((B * H * Sq,), dtype=torch.float32, device="cuda")
    mask = rand(torch, (B, H, Sq, Sk), dtype, -2, 2, seed=5)
    a = ci.attention_args(q, k, v, o, 0.2, layout="bshd", lse=lse)
    a.mask_kind, a.mask = 1, mask.data_ptr()
    a.m_sb, a.m_sh, a.m_sq, a.m_sk = H * Sq * Sk, Sq * Sk, Sk, 1
    ok(lib, ci.attention(lib, ws, a))
    dout = rand(torch, o.shape, dtype, seed=6)
    gbuf = torch.ones_like(buf)
    dq, dk, dv = gbuf[:, :Sq, 0], gbuf[:, :, 1], gbuf[:, :, 2]
    dmask = torch.ones_like(mask)
    g = ci.AttnGrads(dout=dout.data_ptr(), dq=dq.data_ptr(), dk=dk.data_ptr(), dv=dv.data_ptr(),
                     dmask=dmask.data_ptr(), dmask_numel=mask.numel(),
                     req_dq=ci.REQ_ADD, req_dk=ci.REQ_ADD, req_dv=ci.REQ_ADD, req_dmask=ci.REQ_ADD)
    ok(lib, ci.attention_backward(lib, ws, a, g))
    torch.cuda.synchronize()

    def nsd(t, S):
        return f64(t).transpose(0, 2, 1, 3).reshape(B * H, S, D)

    Q, K, V = (torch.tensor(nsd(t, S), requires_grad=True) for t, S in ((q, Sq), (k, Sk), (v, Sk)))
    M = torch.tensor(f64(mask).reshape(B * H, Sq, Sk), requires_grad=True)
    out = torch_attention(torch, Q, K, V, 0.2, M, "additive")
    close(nsd(o, Sq), out.detach().numpy(), dtype, "out")
    out.backward(torch.tensor(nsd(dout, Sq)))
    close(nsd(dq, Sq) - 1.0, Q.grad.numpy(), dtype, "dq")
    close(nsd(dk, Sk) - 1.0, K.grad.numpy(), dtype, "dk")
    close(nsd(dv, Sk) - 1.0, V.grad.numpy(), dtype, "dv")
    close(f64(dmask).reshape(B * H, Sq, Sk) - 1.0, M.grad.numpy(), dtype, "dmask")


# ----------------------------------------------------------------------------- attention backends
# Each backend forced (args.backend) against the float64 reference: cuDNN (fp16 / bf16) and the
# cuBLASLt products (fp32) where the capability check takes the call, the own kernels always.  A
# forced backend that cannot take a call is skipped with the check's reason (printed by -rs).

BACKENDS = {"float32": ["gemm", "own"], "float16": ["cudnn", "own"], "bfloat16": ["cudnn", "own"]}
BE_CASES = [  # B, H, Sq, Sk, D, mode
    (2, 3, 64, 64, 64, "none"), (2, 4, 128, 256, 128, "causal"), (1, 2, 96, 96, 64, "causal"),
    (2, 2, 1, 4096, 64, "none"), (2, 3, 70, 136, 40, "additive"), (3, 2, 64, 128, 64, "additive_full"),
    (3, 2, 80, 80, 64, "valid_length"), (2, 2, 64, 64, 64, "causal_valid_length"), (1, 2, 64, 64, 256, "none"),
    (2, 2, 64, 64, 64, "large")]


def be_case(torch, dtype, B, H, Sq, Sk, D, mode, layout="bhsd", seed=1):
    """Inputs, args and the float64 reference of a case every backend may take."""
    rs = np.random.RandomState(seed)
    hi = 12.0 if mode == "large" else 1.0  # "large": scores with a spread of hundreds
    if layout == "bhsd":
        q, k, v = (rand(torch, s, dtype, -hi, hi, seed=seed + i) for i, s in
                   enumerate(((B, H, Sq, D), (B, H, Sk, D), (B, H, Sk, D))))
        o = torch.empty((B, H, Sq, D), dtype=q.dtype, device="cuda")
    else:  # bshd views of one packed (B, S, 3, H, D) buffer
        buf = rand(torch, (B, max(Sq, Sk), 3, H, D), dtype, -hi, hi, seed=seed)
        q, k, v = buf[:, :Sq, 0], buf[:, :Sk, 1], buf[:, :Sk, 2]
        o = torch.empty((B, Sq, H, D), dtype=q.dtype, device="cuda")
    lse = torch.empty((B * H * Sq,), dtype=torch.float32, device="cuda")
    causal = "exclude" if mode.startswith("causal") else "none"
    a = ci.attention_args(q, k, v, o, D ** -0.5, layout=layout, causal=causal, lse=lse)
    keep, mask, kind, rmask = [], None, "none", None
    if mode in ("additive", "additive_full"):
        shape = (B, 1, 1, Sk) if mode == "additive" else (B, H, Sq, Sk)
        m = np.where(rs.rand(*shape) > 0.3, rs.uniform(-2, 2, shape), -1e4).astype(np.float32)
        m[..., 0] = 0.5  # no fully masked row (those are tested below)
        tm = torch.from_numpy(m).to(q.dtype).cuda()
        keep.append(tm)
        a.mask_kind, a.mask = 1, tm.data_ptr()
        a.m_sb, a.m_sh, a.m_sq, a.m_sk = (Sk, 0, 0, 1) if mode == "additive" else (H * Sq * Sk, Sq * Sk, Sk, 1)
        kind, rmask = "additive", np.broadcast_to(f64(tm), (B, H, Sq, Sk)).reshape(B * H, Sq, Sk)
    elif mode.endswith("valid_length"):
        per_b = rs.randint(1, Sk + 1, B).astype(np.int32)
        lens = np.repeat(per_b, H * Sq)  # the (b*H + h, row) table, one length per batch element
        tl = torch.from_numpy(lens).cuda()
        keep.append(tl)
        a.mask_kind, a.lengths, a.len_sn, a.len_sq = 3, tl.data_ptr(), Sq, 1
        a.lengths_hint = ci.LEN_PER_BATCH | ci.LEN_NONZERO
        kind, rmask = "valid_length", np.repeat(per_b, H)

    def nsd(t, S, Dx):
        x = f64(t)
        x = x if layout == "bhsd" else x.transpose(0, 2, 1, 3)
        return x.reshape(B * H, S, Dx)

    want = ref_attention(nsd(q, Sq, D), nsd(k, Sk, D), nsd(v, Sk, D), D ** -0.5, rmask, kind,
                         causal=causal != "none")
    return dict(q=q, k=k, v=v, o=o, lse=lse, args=a, keep=keep, want=want, nsd=nsd, kind=kind, rmask=rmask,
                causal=causal)


def force(lib, a, backend, backward=False):
    a.backend = ci.BACKENDS[backend]
    name, why = ci.attention_backend(lib, a, backward)
    if name != backend:
        pytest.skip("backend %s does not take this call: %s" % (backend, why))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("B,H,Sq,Sk,D,mode", BE_CASES)
def test_attention_backend_forward(cuda, dtype, which, B, H, Sq, Sk, D, mode):
    lib, torch, ws = cuda
    backend = BACKENDS[dtype][which]
    c = be_case(torch, dtype, B, H, Sq, Sk, D, mode)
    force(lib, c["args"], backend)
    ok(lib, ci.attention(lib, ws, c["args"]))
    torch.cuda.synchronize()
    close(c["nsd"](c["o"], Sq, D), c["want"], dtype, "%s out" % backend)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("mode", ["none", "causal", "additive", "valid_length"])
def test_attention_backend_strided(cuda, dtype, which, mode):
    """bshd views of one packed buffer (the op's packed / interleaved layouts)."""
    lib, torch, ws = cuda
    backend = BACKENDS[dtype][which]
    c = be_case(torch, dtype, 2, 3, 64, 64, 64, mode, layout="bshd")
    force(lib, c["args"], backend)
    ok(lib, ci.attention(lib, ws, c["args"]))
    torch.cuda.synchronize()
    close(c["nsd"](c["o"], 64, 64), c["want"], dtype, "%s out" % backend)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("B,H,Sq,Sk,D,mode", [(2, 4, 128, 256, 128, "causal"), (2, 2, 1, 4096, 64, "none"),
                                              (2, 2, 64, 64, 64, "large"), (3, 2, 80, 80, 64, "valid_length")])
def test_attention_error_within_twice_sdpa(cuda, dtype, B, H, Sq, Sk, D, mode):
    """Against float64, the chosen backend's error is within 2x PyTorch SDPA's own (same dtype)."""
    lib, torch, ws = cuda
    c = be_case(torch, dtype, B, H, Sq, Sk, D, mode)
    ok(lib, ci.attention(lib, ws, c["args"]))
    F = torch.nn.functional
    am = None
    if c["kind"] == "valid_length":
        L = torch.tensor(c["rmask"].reshape(B, H)[:, 0], device="cuda")
        am = (torch.arange(Sk, device="cuda")[None, :] < L[:, None])[:, None, None, :]
    ref = F.scaled_dot_product_attention(c["q"], c["k"], c["v"], attn_mask=am, is_causal=c["causal"] != "none"
                                         and Sq == Sk, scale=D ** -0.5) if not (c["causal"] != "none" and Sq != Sk) \
        else None
    torch.cuda.synchronize()
    err = np.abs(c["nsd"](c["o"], Sq, D) - c["want"]).max()
    if ref is None:  # SDPA's is_causal is top-left: compare with the tolerance instead
        assert err <= TOL[dtype] * (1 + np.abs(c["want"]).max())
        return
    err_sdpa = np.abs(c["nsd"](ref, Sq, D) - c["want"]).max()
    assert err <= 2 * err_sdpa + 1e-6, (err, err_sdpa)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("B,H,Sq,Sk,D,mode", [(2, 3, 64, 64, 64, "none"), (2, 2, 128, 256, 128, "causal"),
                                              (2, 2, 64, 128, 64, "additive"), (3, 2, 80, 80, 64, "valid_length"),
                                              (1, 2, 64, 64, 256, "none")])
def test_attention_backend_backward(cuda, dtype, which, B, H, Sq, Sk, D, mode):
    lib, torch, ws = cuda
    backend = BACKENDS[dtype][which]
    c = be_case(torch, dtype, B, H, Sq, Sk, D, mode, seed=5)
    a = c["args"]
    a.backend = 0
    ok(lib, ci.attention(lib, ws, a))  # the lse any forward gives
    dout = rand(torch, c["o"].shape, dtype, seed=9)
    dq, dk, dv = (torch.empty_like(t) for t in (c["q"], c["k"], c["v"]))
    g = ci.AttnGrads(dout=dout.data_ptr(), dq=dq.data_ptr(), dk=dk.data_ptr(), dv=dv.data_ptr(),
                     req_dq=ci.REQ_WRITE, req_dk=ci.REQ_WRITE, req_dv=ci.REQ_WRITE)
    dmask = None
    if c["kind"] == "additive":
        dmask = torch.zeros((B, 1, 1, Sk), dtype=c["q"].dtype, device="cuda")
        g.dmask, g.dmask_numel, g.req_dmask = dmask.data_ptr(), B * Sk, ci.REQ_WRITE
    force(lib, a, backend, backward=True)
    rc = ci.attention_backward(lib, ws, a, g)
    if rc == ci.ERR_UNSUPPORTED:  # the gradients asked for (e.g. cuDNN's dBias of this mask shape)
        pytest.skip("backend %s refused the backward with these gradients" % backend)
    ok(lib, rc)
    torch.cuda.synchronize()
    nsd = c["nsd"]
    Q, K, V = (torch.tensor(nsd(t, S, D), requires_grad=True) for t, S in ((c["q"], Sq), (c["k"], Sk), (c["v"], Sk)))
    m = None
    if c["kind"] == "additive":
        m = torch.tensor(c["rmask"].copy(), requires_grad=True)
    elif c["kind"] == "valid_length":
        m = torch.tensor(c["rmask"].astype(np.int64))
    out = torch_attention(torch, Q, K, V, D ** -0.5, m, c["kind"], c["causal"])
    out.backward(torch.tensor(nsd(dout, Sq, D)))
    close(nsd(dq, Sq, D), Q.grad.numpy(), dtype, "%s dq" % backend)
    close(nsd(dk, Sk, D), K.grad.numpy(), dtype, "%s dk" % backend)
    close(nsd(dv, Sk, D), V.grad.numpy(), dtype, "%s dv" % backend)
    if dmask is not None:
        close(f64(dmask).reshape(B, Sk), m.grad.numpy().reshape(B, H * Sq, Sk).sum(1), dtype, "%s dmask" % backend)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_attention_cudnn_nonfinite_semantics(cuda, dtype):
    """The cuDNN path keeps the op's edge semantics: a NaN score row and an all -inf (masked) row are
    NaN; under a causal band a column whose v is inf at a key some rows skip is NaN in those rows;
    a backward with a NaN input gives what the own kernels give (its guard hands it to them)."""
    lib, torch, ws = cuda
    B, H, S, D = 1, 2, 64, 64
    q, k, v = (rand(torch, (B, H, S, D), dtype, seed=i) for i in range(3))
    q[0, 0, 3, 0] = float("nan")
    mask = torch.zeros((B, 1, 1, S), dtype=q.dtype, device="cuda")
    o = torch.empty_like(q)
    lse = torch.empty(B * H * S, device="cuda")
    a = ci.attention_args(q, k, v, o, 0.125, lse=lse)
    a.mask_kind, a.mask, a.m_sb, a.m_sk = 1, mask.data_ptr(), S, 1
    force(lib, a, "cudnn")
    ok(lib, ci.attention(lib, ws, a))
    torch.cuda.synchronize()
    got = f64(o)
    assert np.isnan(got[0, 0, 3]).all() and np.isfinite(np.delete(got[0, 0], 3, 0)).all()
    assert np.isfinite(got[0, 1]).all() and np.isnan(f64(lse).reshape(H, S)[0, 3])
    mask.fill_(float("-inf"))
    ok(lib, ci.attention(lib, ws, a))
    torch.cuda.synchronize()
    assert np.isnan(f64(o)).all()
    # causal: v[.., 40, 5] = inf; rows i < 40 skip key 40 -> NaN in column 5, rows >= 40 see it
    q2 = rand(torch, (B, H, S, D), dtype, seed=7)
    v2 = v.clone()
    v2[0, 1, 40, 5] = float("inf")
    a = ci.attention_args(q2, k, v2, o, 0.125, causal="exclude", lse=lse)
    force(lib, a, "cudnn")
    ok(lib, ci.attention(lib, ws, a))
    torch.cuda.synchronize()
    got = f64(o)[0, 1]
    assert np.isnan(got[:40, 5]).all() and np.isfinite(np.delete(got[:40], 5, 1)).all()
    assert not np.isfinite(got[40:, 5]).any()
    assert np.isfinite(f64(o)[0, 0]).all()
    # backward with a NaN in q: cuDNN's result is replaced by the own kernels'
    outs = {}
    for be in ("own", "cudnn"):
        a = ci.attention_args(q, k, v, o, 0.125, lse=lse)
        ok(lib, ci.attention(lib, ws, a))
        dout = rand(torch, q.shape, dtype, seed=11)
        grads = [torch.empty_like(q) for _ in range(3)]
        g = ci.AttnGrads(dout=dout.data_ptr(), dq=grads[0].data_ptr(), dk=grads[1].data_ptr(),
                         dv=grads[2].data_ptr(), req_dq=ci.REQ_WRITE, req_dk=ci.REQ_WRITE, req_dv=ci.REQ_WRITE)
        force(lib, a, be, backward=True)
        ok(lib, ci.attention_backward(lib, ws, a, g))
        torch.cuda.synchronize()
        outs[be] = [f64(t) for t in grads]
    for x, y in zip(outs["own"], outs["cudnn"]):
        assert (np.isnan(x) == np.isnan(y)).all()
        fin = np.isfinite(x)
        assert (np.isfinite(y) == fin).all()
        assert np.allclose(x[fin], y[fin], rtol=1e-2, atol=1e-3)  # float32 atomics, rounded to the dtype


def test_attention_fp32_tf32_only_when_asked(cuda):
    """The fp32 products: full fp32 by default (1e-4 of float64); allow_tf32 runs and stays within
    TF32's error."""
    lib, torch, ws = cuda
    c = be_case(torch, "float32", 2, 4, 256, 256, 64, "none")
    force(lib, c["args"], "gemm")
    ok(lib, ci.attention(lib, ws, c["args"]))
    torch.cuda.synchronize()
    close(c["nsd"](c["o"], 256, 64), c["want"], "float32", "fp32 products")
    c["args"].allow_tf32 = 1
    ok(lib, ci.attention(lib, ws, c["args"]))
    torch.cuda.synchronize()
    err = np.abs(c["nsd"](c["o"], 256, 64) - c["want"]).max()
    assert err <= 5e-3 * (1 + np.abs(c["want"]).max()), err


def test_attention_rejects_bad_arguments(cuda):
    lib, torch, ws = cuda
    q = torch.zeros((1, 1, 4, 8), device="cuda")
    a = ci.attention_args(q, q, q, q, 1.0)
    a.dtype = 5
    assert ci.attention(lib, ws, a) == ci.ERR_BAD_ARGS
    a = ci.attention_args(q, q, q, q, 1.0)
    a.D = 300
    assert ci.attention(lib, ws, a) == ci.ERR_BAD_ARGS
    a = ci.attention_args(q, q, q, q, 1.0)
    g = ci.AttnGrads(dout=q.data_ptr(), dq=q.data_ptr(), req_dq=1)
    assert ci.attention_backward(lib, ws, a, g) == ci.ERR_BAD_ARGS  # no lse


# ----------------------------------------------------------------------------- dense

DENSE_SHAPES = [(1, 1, 1, 0, 0), (37, 70, 50, 0, 0), (130, 96, 768, 0, 0), (2 * 9, 24, 33, 3, 9),
                (4 * 16, 64, 64, 4, 16), (2 * 8, 48, 40, 6, 8), (12 * 5, 36, 24, 3, 5)]


def dense_ref(x, w, b, act):
    return np_act(x @ w.T + (b if b is not None else 0), act)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ci.ACTS)
@pytest.mark.parametrize("M,N,K,heads,S", DENSE_SHAPES)
def test_dense_forward(cuda, dtype, act, M, N, K, heads, S):
    lib, torch, ws = cuda
    x, w, b = (rand(torch, s, dtype, seed=i) for i, s in enumerate(((M, K), (N, K), (N,))))
    y = torch.empty((M * N,), dtype=x.dtype, device="cuda")
    ok(lib, ci.dense(lib, ws, x, w, b, y, M, N, K, act, heads=heads, S=S))
    torch.cuda.synchronize()
    want = dense_ref(f64(x), f64(w), f64(b), act)
    if heads:
        want = want.reshape(M // S, S, heads, N // heads).transpose(0, 2, 1, 3)
    close(f64(y).reshape(want.shape), want, dtype, "y")


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_no_bias_and_empty_k(cuda, dtype):
    lib, torch, ws = cuda
    x, w = rand(torch, (9, 20), dtype), rand(torch, (12, 20), dtype, seed=1)
    y = torch.empty((9, 12), dtype=x.dtype, device="cuda")
    ok(lib, ci.dense(lib, ws, x, w, None, y, 9, 12, 20, "tanh"))
    torch.cuda.synchronize()
    close(f64(y), np.tanh(f64(x) @ f64(w).T), dtype, "no bias")
    b = rand(torch, (12,), dtype, seed=2)
    e = torch.empty((9, 0), dtype=x.dtype, device="cuda")
    ok(lib, ci.dense(lib, ws, e, e, b, y, 9, 12, 0, "relu"))
    torch.cuda.synchronize()
    close(f64(y), np.broadcast_to(np.maximum(f64(b), 0), (9, 12)), dtype, "K = 0")


def torch_act(torch, z, act, slope=0.25):
    F = torch.nn.functional
    return {"none": lambda: z, "relu": lambda: torch.relu(z), "act_relu": lambda: torch.relu(z),
            "sigmoid": lambda: torch.sigmoid(z), "tanh": lambda: torch.tanh(z),
            "softrelu": lambda: F.softplus(z, threshold=20), "leaky": lambda: F.leaky_relu(z, slope),
            "gelu_erf": lambda: F.gelu(z), "gelu_tanh": lambda: F.gelu(z, approximate="tanh")}[act]()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["none", "relu", "sigmoid", "tanh", "softrelu", "leaky", "gelu_erf", "gelu_tanh"])
@pytest.mark.parametrize("M,N,K,heads", [(37, 70, 50, 0), (130, 96, 256, 0), (2 * 9, 24, 33, 3), (1, 1, 1, 0)])
@pytest.mark.parametrize("bias", [True, False])
def test_dense_backward(cuda, dtype, act, M, N, K, heads, bias):
    lib, torch, ws = cuda
    x, w, b = (rand(torch, s, dtype, seed=i) for i, s in enumerate(((M, K), (N, K), (N,))))
    b = b if bias else None
    S = 9 if heads else 0
    y = torch.empty((M * N,), dtype=x.dtype, device="cuda")
    ok(lib, ci.dense(lib, ws, x, w, b, y, M, N, K, act, heads=heads, S=S))
    dy = rand(torch, (M * N,), dtype, seed=5)
    dx, dw = torch.empty_like(x), torch.full_like(w, 2.0)
    db = torch.empty_like(b) if bias else None
    ok(lib, ci.dense_backward(lib, ws, dy, x, w, b, y, dx, dw, db, M, N, K, act, heads=heads, S=S,
                              req=(ci.REQ_WRITE, ci.REQ_ADD, ci.REQ_WRITE)))
    torch.cuda.synchronize()
    X, W = torch.tensor(f64(x), requires_grad=True), torch.tensor(f64(w), requires_grad=True)
    Bv = torch.tensor(f64(b), requires_grad=True) if bias else None
    Y = torch_act(torch, X @ W.T + (Bv if bias else 0), act)
    dY = torch.tensor(f64(dy))
    if heads:  # dy is in the (B, heads, S, D) layout
        dY = dY.reshape(M // S, heads, S, N // heads).permute(0, 2, 1, 3).reshape(M, N)
    Y.backward(dY.reshape(M, N))
    close(f64(dx), X.grad.numpy(), dtype, "dx")
    close(f64(dw) - 2.0, W.grad.numpy(), dtype, "dw (added)")
    if bias:
        close(f64(db), Bv.grad.numpy(), dtype, "dbias")


def test_dense_rejects_bad_arguments(cuda):
    lib, torch, ws = cuda
    x = torch.zeros((6, 4), device="cuda")
    assert lib.mxf_dense_forward(9, x.data_ptr(), x.data_ptr(), None, x.data_ptr(), 6, 4, 4, 0, 0.0, 0, 0,
                                 None, 0, None) == ci.ERR_BAD_ARGS
    assert lib.mxf_dense_forward(0, x.data_ptr(), x.data_ptr(), None, x.data_ptr(), 6, 4, 4, 0, 0.0, 3, 2,
                                 None, 0, None) == ci.ERR_BAD_ARGS  # N % heads
    assert lib.mxf_dense_forward(0, x.data_ptr(), x.data_ptr(), None, x.data_ptr(), 6, 4, 4, 0, 0.0, 0, 0,
                                 None, 0, None) == ci.ERR_WORKSPACE


# ----------------------------------------------------------------------------- add + layer norm

LN_SHAPES = [(1, 1, 1), (6, 768, 6), (12, 33, 3), (64, 1024, 1), (8, 4096, 8), (300, 80, 300)]


def ln_ref(a, b, g, be, R, b_rows, eps=1e-5):
    s = a + np.tile(b, (R // b_rows, 1))
    mu, var = s.mean(-1, keepdims=True), s.var(-1, keepdims=True)
    return s, (s - mu) / np.sqrt(var + eps) * g + be, mu[:, 0], 1 / np.sqrt(var[:, 0] + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,C,b_rows", LN_SHAPES)
def test_add_layer_norm_forward(cuda, dtype, R, C, b_rows):
    lib, torch, ws = cuda
    a, b, g, be = (rand(torch, s, dtype, seed=i) for i, s in enumerate(((R, C), (b_rows, C), (C,), (C,))))
    y, s = torch.empty((R, C), dtype=a.dtype, device="cuda"), torch.empty((R, C), dtype=a.dtype, device="cuda")
    mean, rstd = (torch.empty((R,), device="cuda") for _ in range(2))
    ok(lib, ci.add_layer_norm(lib, a, b, g, be, y, s, R, C, b_rows, mean=mean, rstd=rstd))
    torch.cuda.synchronize()
    # the sum is rounded to the dtype before the normalization, as the unfused graph has it
    s_want = f64((a.double() + b.double().repeat(R // b_rows, 1)).to(a.dtype))
    _, y_want, mu, rs_ = ln_ref(s_want, np.zeros((b_rows, C)), f64(g), f64(be), R, b_rows)
    close(f64(s), s_want, dtype, "sum")
    close(f64(y), y_want, dtype, "y")
    close(f64(mean), mu, "float32", "mean")
    close(f64(rstd) / 100, rs_ / 100, "float32", "rstd")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,C,b_rows", LN_SHAPES)
@pytest.mark.parametrize("saved_stats", [False, True])
def test_add_layer_norm_backward(cuda, dtype, R, C, b_rows, saved_stats):
    lib, torch, ws = cuda
    a, b, g, be = (rand(torch, s, dtype, seed=i) for i, s in enumerate(((R, C), (b_rows, C), (C,), (C,))))
    y, s = torch.empty((R, C), dtype=a.dtype, device="cuda"), torch.empty((R, C), dtype=a.dtype, device="cuda")
    mean, rstd = (torch.empty((R,), device="cuda") for _ in range(2))
    ok(lib, ci.add_layer_norm(lib, a, b, g, be, y, s, R, C, b_rows, mean=mean, rstd=rstd))
    dy, dsum = rand(torch, (R, C), dtype, seed=7), rand(torch, (R, C), dtype, seed=8)
    da, db, dg, dbe = (torch.full_like(t, 1.0) for t in (a, b, g, be))
    ok(lib, ci.add_layer_norm_backward(lib, ws, dy, dsum, a, b, g, da, db, dg, dbe, R, C, b_rows,
                                       mean=mean if saved_stats else None, rstd=rstd if saved_stats else None,
                                       req=(ci.REQ_WRITE, ci.REQ_WRITE, ci.REQ_ADD, ci.REQ_WRITE)))
    torch.cuda.synchronize()
    A, Bt, G, BE = (torch.tensor(f64(t), requires_grad=True) for t in (a, b, g, be))
    S = A + Bt.repeat(R // b_rows, 1)
    Y = torch.nn.functional.layer_norm(S, (C,), G, BE, 1e-5)
    (Y * torch.tensor(f64(dy))).sum().add_((S * torch.tensor(f64(dsum))).sum()).backward()
    close(f64(da), A.grad.numpy(), dtype, "da")
    close(f64(db), Bt.grad.numpy(), dtype, "db")
    close(f64(dg) - 1.0, G.grad.numpy(), dtype, "dgamma (added)")
    close(f64(dbe), BE.grad.numpy(), dtype, "dbeta")


def test_add_layer_norm_rejects_bad_arguments(cuda):
    lib, torch, ws = cuda
    a = torch.zeros((4, 8), device="cuda")
    assert ci.add_layer_norm(lib, a, a, a, a, a, None, 4, 8, 3) == ci.ERR_BAD_ARGS  # R % b_rows
    assert ci.add_layer_norm(lib, a, a, a, a, a, None, 4, 40000, 4) == ci.ERR_BAD_ARGS  # C too large
    assert lib.mxf_add_layer_norm_backward(0, *([a.data_ptr()] * 5), None, None, *([a.data_ptr()] * 4),
                                           1, 1, 1, 1, 4, 8, 4, 1e-5, None, 0, None) == ci.ERR_WORKSPACE


# ----------------------------------------------------------------------------- elemwise

EW_CASES = [
    ("mul(x0, sigmoid(add(x1, 3.0)))", [(7, 300), (300,)], lambda a, b: a / (1 + np.exp(-(b + 3)))),
    ("mul(x0, sigmoid(add(x1, 3.0)))", [(8, 256), (256,)], lambda a, b: a / (1 + np.exp(-(b + 3)))),
    ("where(gt(x0, 0), exp(x1), neg(x0))", [(2, 3, 4), (3, 1)], lambda a, b: np.where(a > 0, np.exp(b), -a)),
    ("clip(tanh(x0), -0.5, 0.25)", [(5000,)], lambda a: np.clip(np.tanh(a), -0.5, 0.25)),
    ("add(mul(x0, x1), x2)", [(4096,), (4096,), (1,)], lambda a, b, c: a * b + c),
    ("relu(add(x0, x1))", [(3, 64, 32), (3, 64, 32)], lambda a, b: np.maximum(a + b, 0)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("expr,shapes,fn", EW_CASES)
def test_elemwise(cuda, dtype, expr, shapes, fn):
    lib, torch, _ = cuda
    xs = [rand(torch, s, dtype, -2, 2, seed=i) for i, s in enumerate(shapes)]
    out = torch.empty(np.broadcast_shapes(*shapes), dtype=xs[0].dtype, device="cuda")
    rc, err = ci.elemwise(lib, expr, xs, out)
    assert rc == 0, err
    torch.cuda.synchronize()
    close(f64(out), fn(*[f64(x) for x in xs]), dtype, expr)


def test_elemwise_unaligned_input_takes_the_scalar_path(cuda):
    lib, torch, _ = cuda
    x = rand(torch, (1025,), "float16")[1:]  # 2-byte offset: no 16-byte loads
    out = torch.empty((1024,), dtype=torch.float16, device="cuda")
    rc, err = ci.elemwise(lib, "exp(x0)", [x], out)
    assert rc == 0, err
    torch.cuda.synchronize()
    close(f64(out), np.exp(f64(x)), "float16", "exp")


def test_elemwise_bad_program_reports(cuda):
    lib, _, _ = cuda
    err = ctypes.create_string_buffer(512)
    rc = lib.mxf_elemwise_forward(0, b"foo(x0)", 1, None, None, None, None, err, 512, None)
    assert rc == ci.ERR_BAD_ARGS and b"unknown function 'foo'" in err.value
