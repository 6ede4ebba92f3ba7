"""ctypes mirror of the CUDA C interface (``*/<op>.h``) of ``libmxfusion_cuda.so``.

Used by the GPU tests (``tests/kernels/test_cuda_kernels.py``) and the GPU benchmark
(``benchmarks/bench_cuda.py``).  Imports neither MXNet nor the ``fusion`` package, so both
run on a GPU machine that has PyTorch and nvcc but no MXNet (MXNet 1.9.1 has no wheel for
newer Pythons): the library is built from ``cuda_kernels/`` alone.
"""
import ctypes
import importlib.util
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)

# fused_dense's act codes (fused_dense.h), in order
ACTS = ["none", "relu", "sigmoid", "tanh", "softrelu", "leaky", "gelu_erf", "gelu_tanh", "act_relu"]
# mxf_attention_args.mask_kind
MASK_KINDS = {"none": 0, "additive": 1, "boolean": 2, "valid_length": 3}


class AttnArgs(ctypes.Structure):
    """struct mxf_attention_args (fused_attention.h)."""
    _fields_ = ([(n, ctypes.c_int64) for n in ("B", "H", "Sq", "Sk", "D", "Dv")] +
                [(n, ctypes.c_void_p) for n in ("q", "k", "v", "o")] +
                [(n, ctypes.c_int64) for n in ("q_bs", "q_hs", "q_rs", "k_bs", "k_hs", "k_rs",
                                               "v_bs", "v_hs", "v_rs", "o_bs", "o_hs", "o_rs")] +
                [("mask_kind", ctypes.c_int32), ("mask", ctypes.c_void_p)] +
                [(n, ctypes.c_int64) for n in ("m_sb", "m_sh", "m_sq", "m_sk")] +
                [("lengths", ctypes.c_void_p), ("len_sn", ctypes.c_int64), ("len_sq", ctypes.c_int64),
                 ("scale", ctypes.c_float), ("mask_value", ctypes.c_float), ("causal", ctypes.c_int32)])


def native():
    """fusion/_native.py loaded on its own (``import fusion`` needs MXNet)."""
    spec = importlib.util.spec_from_file_location("mxfusion_native_standalone",
                                                  os.path.join(_REPO, "fusion", "_native.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load(build=True):
    """Build (when missing or stale, and nvcc is there) and load the CUDA library."""
    nat = native()
    if build and nat.nvcc_path():
        nat.build(cuda=True, cpu=False)
    return nat.load_cuda()


def ptr(t):
    """Device pointer of a torch tensor (None stays NULL)."""
    return ctypes.c_void_p(t.data_ptr()) if t is not None else None


def attention_args(B, H, Sq, Sk, D, Dv, q, k, v, o, scale, causal=False):
    """Arguments for contiguous plain-layout (B*H, S, D) tensors, no mask."""
    return AttnArgs(B=B, H=H, Sq=Sq, Sk=Sk, D=D, Dv=Dv, q=ptr(q), k=ptr(k), v=ptr(v), o=ptr(o),
                    q_bs=H * Sq * D, q_hs=Sq * D, q_rs=D, k_bs=H * Sk * D, k_hs=Sk * D, k_rs=D,
                    v_bs=H * Sk * Dv, v_hs=Sk * Dv, v_rs=Dv, o_bs=H * Sq * Dv, o_hs=Sq * Dv,
                    o_rs=Dv, scale=scale, mask_value=-1e18, causal=int(causal))


def dense(lib, x, w, b, y, M, N, K, act="none", slope=0.25, heads=0, S=0, stream=None):
    return lib.mxf_dense_forward(ptr(x), ptr(w), ptr(b), ptr(y), ctypes.c_int64(M),
                                 ctypes.c_int64(N), ctypes.c_int64(K), ACTS.index(act),
                                 ctypes.c_float(slope), ctypes.c_int64(heads), ctypes.c_int64(S),
                                 stream)


def add_layer_norm(lib, a, b, gamma, beta, y, s, R, C, b_rows, eps=1e-5, stream=None):
    return lib.mxf_add_layer_norm_forward(ptr(a), ptr(b), ptr(gamma), ptr(beta), ptr(y), ptr(s),
                                          ctypes.c_int64(R), ctypes.c_int64(C),
                                          ctypes.c_int64(b_rows), ctypes.c_float(eps), stream)


def elemwise(lib, expr, inputs, out, stream=None):
    """inputs: torch tensors (broadcasting as NumPy); returns (rc, error text)."""
    n = len(inputs)
    ptrs = (ctypes.c_void_p * n)(*[t.data_ptr() for t in inputs])
    shp = [(ctypes.c_int64 * max(1, t.dim()))(*t.shape) for t in inputs]
    shp_arr = (ctypes.POINTER(ctypes.c_int64) * n)(
        *[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64)) for s in shp])
    nd = (ctypes.c_int * n)(*[t.dim() for t in inputs])
    err = ctypes.create_string_buffer(512)
    rc = lib.mxf_elemwise_forward(expr.encode(), n, ptrs, shp_arr, nd, ptr(out), err, 512, stream)
    return rc, err.value.decode()
