"""fused_attention's backend choice (cuda_kernels/fused_attention/attention_dispatch.cu), without a GPU.

The CUDA library answers `mxf_attention_backend()` -- which backend a call runs and why the faster
ones were not taken -- before touching a device: cuDNN only where it computes the op's exact
semantics, the cuBLASLt products for fp32, the own kernels otherwise.  Each refusal reason is
asserted here; the choice on a machine with a GPU, and the numbers, are tested in
test_cuda_kernels.py.  The library must also load, and answer, where cuDNN cannot be loaded.

Skipped where nvcc is absent and the library is not built.  (Nothing here runs a kernel.)
"""
import ctypes
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "cuda_kernels"))
import cuda_iface as ci  # noqa: E402


@pytest.fixture(scope="module")
def lib():
    if ci.nvcc_path() is None and not os.path.exists(ci.library_path()):
        pytest.skip("nvcc not found and the CUDA library is not built")
    if ci.cublas_dirs() is None and not os.path.exists(ci.library_path()):
        pytest.skip("cuBLASLt not found (pip install nvidia-cublas): the CUDA library is not built")
    return ci.load()


def args(dtype=ci.F16, B=2, H=4, Sq=128, Sk=128, D=64, Dv=None, layout="bhsd", **kw):
    """Arguments on made-up, 256-byte aligned addresses (the check never reads them)."""
    Dv = Dv or D
    a = ci.AttnArgs(dtype=dtype, B=B, H=H, Sq=Sq, Sk=Sk, D=D, Dv=Dv, q=1 << 20, k=2 << 20, v=3 << 20, o=4 << 20,
                    scale=0.125, mask_value=-1e18)
    if layout == "bhsd":
        def st(S, C):
            return H * S * C, S * C, C
    else:  # bshd
        def st(S, C):
            return S * H * C, C, H * C
    a.q_bs, a.q_hs, a.q_rs = st(Sq, D)
    a.k_bs, a.k_hs, a.k_rs = st(Sk, D)
    a.v_bs, a.v_hs, a.v_rs = st(Sk, Dv)
    a.o_bs, a.o_hs, a.o_rs = st(Sq, Dv)
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def additive(**kw):  # a (B, 1, 1, Sk) key-padding mask
    kw.setdefault("Sk", 128)
    return dict(mask_kind=1, mask=5 << 20, m_sb=kw["Sk"], m_sh=0, m_sq=0, m_sk=1, **kw)


def lengths(hint, **kw):
    return dict(mask_kind=3, lengths=6 << 20, len_sn=kw.get("Sq", 128), len_sq=1, lengths_hint=hint, **kw)


# (arguments, backward, the reason cuDNN is refused)
REFUSED = [
    (dict(mask_kind=2, mask=5 << 20, m_sb=128, m_sk=1), False, "boolean mask"),
    (dict(causal=2, mask_value=-1e4), False, "causal_mode add / fill"),
    (dict(causal=3, mask_value=-1e4), False, "causal_mode add / fill"),
    (dict(causal=1, Sq=200, Sk=128), False, "Sq > Sk"),
    (dict(D=60), False, "multiples of 8"),
    (dict(D=40, Dv=36), False, "multiples of 8"),
    (lengths(0), False, "per head or per query row"),
    (lengths(ci.LEN_PER_BATCH), False, "may be 0"),
    (lengths(3, causal=1, Sq=64, Sk=128), False, "aligns the diagonal to each length"),
    (additive(causal=1, Sq=64, Sk=128), False, "bottom-right causal mask takes no bias"),
    (dict(mask_kind=1, mask=5 << 20, m_sb=128, m_sq=0, m_sk=2, Sk=64), False, "not contiguous along the keys"),
    (additive(Sk=100), False, "multiples of 8 elements"),
    (dict(q=(1 << 20) + 2), False, "16-byte aligned"),
    (dict(q_rs=68), False, "multiple of 8 elements"),
    (dict(), True, "log-sum-exp"),
    (dict(Sq=1, Sk=1, lse=7 << 20), True, "Sq = Sk = 1"),
]


@pytest.mark.parametrize("kw,backward,reason", REFUSED)
@pytest.mark.parametrize("dtype", [ci.F16, ci.BF16])
def test_cudnn_refusals_name_the_reason(lib, kw, backward, reason, dtype):
    kw = dict(kw)
    name, why = ci.attention_backend(lib, args(dtype=dtype, **kw), backward)
    assert name == "own", (name, why)
    assert why.startswith("cudnn: ") and reason in why, why


def test_expressible_call_falls_back_only_for_the_machine(lib):
    """A call cuDNN can express: here (no GPU, or cuDNN missing) the reason is about the machine."""
    for kw in (dict(), additive(), lengths(3), dict(causal=1), dict(causal=1, Sq=64, Sk=128), dict(Sq=1, Sk=4096),
               dict(D=128, layout="bshd"), dict(D=256)):
        name, why = ci.attention_backend(lib, args(**kw))
        if name == "cudnn":
            assert why == ""
            continue
        assert name == "own" and why.startswith("cudnn: "), why
        assert any(s in why for s in ("device", "libcudnn", "frontend", "CUDA runtime", "cannot build")), why


def test_fp32_takes_the_products(lib):
    for kw in (dict(mask_kind=2, mask=5 << 20, m_sb=128, m_sk=1), dict(causal=3, mask_value=-1e4),
               dict(layout="bshd", D=40, Sq=7, Sk=9), lengths(0)):
        assert ci.attention_backend(lib, args(dtype=ci.F32, **kw)) == ("gemm", "")
        assert ci.attention_backend(lib, args(dtype=ci.F32, lse=7 << 20, **kw), backward=True) == ("gemm", "")


def test_forced_backends(lib):
    assert ci.attention_backend(lib, args(backend=ci.BACKENDS["own"])) == ("own", "")
    name, why = ci.attention_backend(lib, args(backend=ci.BACKENDS["gemm"]))
    assert name == "error %d" % ci.ERR_UNSUPPORTED and "gemm: fp32 only" in why
    name, why = ci.attention_backend(lib, args(dtype=ci.F32, backend=ci.BACKENDS["cudnn"]))
    assert name == "error %d" % ci.ERR_UNSUPPORTED and "cudnn: fp16 / bf16 only" in why
    name, _ = ci.attention_backend(lib, args(backend=9))
    assert name == "error %d" % ci.ERR_BAD_ARGS
    name, _ = ci.attention_backend(lib, args(D=300))
    assert name == "error %d" % ci.ERR_BAD_ARGS


def _run(code, **env):
    e = dict(os.environ, **env)
    r = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=e, cwd=os.path.dirname(ci.__file__), timeout=120)
    assert r.returncode == 0, r.stdout
    return r.stdout


def test_library_loads_and_answers_without_cudnn(lib):
    """libcudnn is not a link dependency: with it unloadable, the library loads, says why, and
    the call goes to the own kernels."""
    needed = subprocess.run(["readelf", "-d", ci.library_path()], stdout=subprocess.PIPE, text=True).stdout
    assert "libcudnn" not in needed, needed
    code = ("import sys; sys.path.insert(0, '.'); import cuda_iface as ci, test_attention_backends as t\n"
            "lib = ci.load(do_build=False)\n"
            "print('VERSION', lib.mxf_cudnn_version())\n"
            "print('CHOICE', *ci.attention_backend(lib, t.args()))\n")
    out = _run(code, MXFUSION_CUDNN_LIB="/nonexistent/libcudnn.so.9",
               PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))
    assert "VERSION 0" in out, out
    line = [ln for ln in out.splitlines() if ln.startswith("CHOICE")][0]
    assert line.startswith("CHOICE own cudnn: ") and ("libcudnn.so.9 could not be loaded" in line or
                                                      "frontend" in line), line


def test_environment_override(lib):
    code = ("import sys; sys.path.insert(0, '.'); import cuda_iface as ci, test_attention_backends as t\n"
            "lib = ci.load(do_build=False)\n"
            "print('CHOICE', *ci.attention_backend(lib, t.args(dtype=ci.F32)))\n")
    out = _run(code, MXFUSION_ATTN_BACKEND="own", PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))
    assert "CHOICE own" in out, out
