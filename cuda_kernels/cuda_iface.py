"""ctypes mirror of the CUDA C interface (``*/<op>.h``, ``common/mxf_cuda_types.h``) of the
CUDA kernels, and a standalone build of them.

Used by the GPU tests (``tests/kernels/test_cuda_kernels.py``), the compile check
(``tests/kernels/test_cuda_build.py``) and the GPU benchmark (``benchmarks/bench_cuda.py``).
Imports neither MXNet nor the ``fusion`` package, so all of them run on a GPU machine that has
PyTorch and nvcc but no MXNet: ``build()`` compiles ``cuda_kernels/*/*.cu`` (plus the
expression parser) with nvcc for sm_80 and sm_90, the CUDA runtime linked statically and
cuBLASLt dynamically, from the ``nvidia-cublas`` wheel's headers and library (CUDA 13:
``nvidia/cu13``; ``nvidia/cublas`` for CUDA 12 wheels) or the CUDA toolkit's; fused_attention's cuDNN path from the
cuDNN frontend's headers (``nvidia-cudnn-frontend`` wheel, or the copy ``make gpu-bundle`` leaves in
``build/cudnn_bundle``) and cuDNN's (``nvidia-cudnn-cu13``), libcudnn opened at run time (see
``cudnn_dirs()``).
"""
import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
BUILD_DIR = os.path.join(_REPO, "build", "mxfusion_cuda_iface")
# what `make gpu-bundle` copies for a GPU machine whose Python has cuDNN but not the frontend's headers
CUDNN_BUNDLE = os.path.join(_REPO, "build", "cudnn_bundle")
LIB_NAME = "libmxfusion_cuda.so"
ARCHS = ("80", "90")
NVCCFLAGS = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-cudart", "static"]

# common/mxf_cuda_types.h
F32, F16, BF16 = 0, 1, 2
REQ_NULL, REQ_WRITE, REQ_INPLACE, REQ_ADD = 0, 1, 2, 3
ERR_BAD_ARGS, ERR_WORKSPACE, ERR_UNSUPPORTED = -1, -2, -3
# fused_dense's act codes (fused_dense.h), in order
ACTS = ["none", "relu", "sigmoid", "tanh", "softrelu", "leaky", "gelu_erf", "gelu_tanh", "act_relu"]
# mxf_attention_args.mask_kind / .causal
MASK_KINDS = {"none": 0, "additive": 1, "boolean": 2, "valid_length": 3}
CAUSAL = {"none": 0, "exclude": 1, "add": 2, "fill": 3}
# mxf_attention_args.backend, .lengths_hint
BACKENDS = {"auto": 0, "own": 1, "cudnn": 2, "gemm": 3}
BACKEND_NAMES = {v: k for k, v in BACKENDS.items()}
LEN_PER_BATCH, LEN_NONZERO = 1, 2
ERR_CUDNN = -2000

_c_i64, _c_vp, _c_sz = ctypes.c_int64, ctypes.c_void_p, ctypes.c_size_t


class AttnArgs(ctypes.Structure):
    """struct mxf_attention_args (fused_attention.h)."""
    _fields_ = ([("dtype", ctypes.c_int32)] +
                [(n, _c_i64) for n in ("B", "H", "Sq", "Sk", "D", "Dv")] +
                [(n, _c_vp) for n in ("q", "k", "v", "o")] +
                [(n, _c_i64) for n in ("q_bs", "q_hs", "q_rs", "k_bs", "k_hs", "k_rs",
                                       "v_bs", "v_hs", "v_rs", "o_bs", "o_hs", "o_rs")] +
                [("mask_kind", ctypes.c_int32), ("mask", _c_vp)] +
                [(n, _c_i64) for n in ("m_sb", "m_sh", "m_sq", "m_sk")] +
                [("lengths", _c_vp), ("len_sn", _c_i64), ("len_sq", _c_i64),
                 ("scale", ctypes.c_float), ("mask_value", ctypes.c_float), ("causal", ctypes.c_int32),
                 ("lse", _c_vp), ("backend", ctypes.c_int32), ("allow_tf32", ctypes.c_int32),
                 ("lengths_hint", ctypes.c_int32)])


class AttnGrads(ctypes.Structure):
    """struct mxf_attention_grads (fused_attention.h)."""
    _fields_ = ([(n, _c_vp) for n in ("dout", "dq", "dk", "dv", "dmask")] +
                [("dmask_numel", _c_i64)] +
                [(n, ctypes.c_int32) for n in ("req_dq", "req_dk", "req_dv", "req_dmask")])


# ---------------------------------------------------------------------------- build

def nvcc_path():
    return shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and
                                    "/usr/local/cuda/bin/nvcc") or None


def cublas_dirs():
    """(include folder, library folder, library file name) of cuBLASLt, or None.

    The nvidia-cublas wheel (``pip install nvidia-cublas``; PyTorch's CUDA wheels depend on it)
    first, then the CUDA toolkit next to nvcc."""
    for base in sys.path:
        for sub in ("nvidia/cu13", "nvidia/cublas"):
            inc, lib = os.path.join(base, sub, "include"), os.path.join(base, sub, "lib")
            if os.path.exists(os.path.join(inc, "cublasLt.h")):
                libs = sorted(glob.glob(os.path.join(lib, "libcublasLt.so*")))
                if libs:
                    return inc, lib, os.path.basename(libs[0])
    nvcc = nvcc_path()
    if nvcc:
        root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        for inc, lib in ((os.path.join(root, "include"), os.path.join(root, "lib64")),
                         (os.path.join(root, "targets", "x86_64-linux", "include"),
                          os.path.join(root, "targets", "x86_64-linux", "lib"))):
            libs = sorted(glob.glob(os.path.join(lib, "libcublasLt.so*")))
            if os.path.exists(os.path.join(inc, "cublasLt.h")) and libs:
                return inc, lib, os.path.basename(libs[0])
    return None


def cublas_flags():
    """(compile flags, link flags) for cuBLASLt: the include folder; the library by its file
    name (the wheel ships only the soname, libcublasLt.so.13) with an rpath to its folder."""
    found = cublas_dirs()
    if not found:
        return [], []
    inc, lib, name = found
    return ["-I" + inc], ["-L" + lib, "-l:" + name, "-Xlinker", "-rpath=" + lib]


def _find(rel, extra=()):
    """The first folder of sys.path (then `extra`) holding `rel`."""
    for base in list(sys.path) + list(extra):
        if base and os.path.exists(os.path.join(base, rel)):
            return base
    return None


def cudnn_dirs():
    """{"frontend": include folder of cudnn_frontend.h, "include": cudnn.h's folder, "lib": libcudnn.so.9's
    folder or "", "cudart": libcudart.so.13's folder or ""}, or None when the headers are missing.

    The frontend's headers: MXFUSION_CUDNN_FRONTEND_INCLUDE, the nvidia-cudnn-frontend wheel
    (site-packages/include), or build/cudnn_bundle/frontend (``make gpu-bundle``).  cuDNN's headers
    and library: the nvidia-cudnn wheel (nvidia/cudnn, e.g. PyTorch's), else the bundled headers.
    The library is not linked: the build records its folder, where libmxfusion_cuda.so opens it at
    the first cuDNN call (MXFUSION_CUDNN_LIB overrides)."""
    fe = os.environ.get("MXFUSION_CUDNN_FRONTEND_INCLUDE")
    if not (fe and os.path.exists(os.path.join(fe, "cudnn_frontend.h"))):
        base = _find(os.path.join("include", "cudnn_frontend.h"), [os.path.join(CUDNN_BUNDLE, "frontend")])
        fe = os.path.join(base, "include") if base else None
    base = _find(os.path.join("nvidia", "cudnn", "include", "cudnn.h"))
    if base:
        inc = os.path.join(base, "nvidia", "cudnn", "include")
    elif os.path.exists(os.path.join(CUDNN_BUNDLE, "cudnn", "include", "cudnn.h")):
        inc = os.path.join(CUDNN_BUNDLE, "cudnn", "include")
    else:
        inc = None
    if not fe or not inc:
        return None
    libbase = _find(os.path.join("nvidia", "cudnn", "lib", "libcudnn.so.9"))
    rt = _find(os.path.join("nvidia", "cu13", "lib", "libcudart.so.13"))
    cudart = os.path.join(rt, "nvidia", "cu13", "lib") if rt else ""
    nvcc = nvcc_path()
    if not cudart and nvcc:
        root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        for d in (os.path.join(root, "lib64"), os.path.join(root, "targets", "x86_64-linux", "lib"),
                  "/usr/local/cuda/lib64"):
            if os.path.exists(os.path.join(d, "libcudart.so.13")):
                cudart = d
                break
    return {"frontend": fe, "include": inc, "lib": os.path.join(libbase, "nvidia", "cudnn", "lib") if libbase else "",
            "cudart": cudart}


def cudnn_flags():
    """nvcc flags of the cuDNN path (none without the headers: it then compiles as 'not built')."""
    d = cudnn_dirs()
    if not d:
        return []
    # the frontend's JSON (serialisation) is not used; -O1: its headers take minutes to compile at -O3
    return ["-I" + d["frontend"], "-I" + d["include"], "-DMXF_WITH_CUDNN=1", "-DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING",
            "-DCUDNN_FRONTEND_SKIP_JSON_LIB", "-Xcompiler", "-O1",
            '-DMXF_CUDNN_LIB_DIR="%s"' % d["lib"], '-DMXF_CUDART_LIB_DIR="%s"' % d["cudart"]]


def sources():
    srcs = sorted(glob.glob(os.path.join(_HERE, "*", "*.cu")))
    srcs.append(os.path.join(_HERE, "fused_elemwise", "expr_program.cc"))
    srcs.append(os.path.join(_HERE, "fused_attention", "attention_cudnn_graph.cpp"))  # host C++ (cuDNN frontend)
    deps = sorted(glob.glob(os.path.join(_HERE, "*", "*.h")) + glob.glob(os.path.join(_HERE, "*", "*.cuh")))
    return srcs, deps


def gencode(archs=ARCHS):
    out = []
    for a in archs:
        out += ["-gencode", "arch=compute_%s,code=sm_%s" % (a, a)]
    return out


def compile_commands(objdir, archs=ARCHS, extra=()):
    """nvcc commands for every source: [(source, object, argv)]."""
    cflags, _ = cublas_flags()
    inc = ["-I" + _HERE, "-I" + os.path.join(_HERE, "common")] + cflags
    dnn = cudnn_flags()
    out = []
    for s in sources()[0]:
        o = os.path.join(objdir, os.path.basename(os.path.dirname(s)) + "_" + os.path.basename(s) + ".o")
        own = dnn if os.path.basename(s) == "attention_cudnn_graph.cpp" else []
        out.append((s, o, [nvcc_path()] + NVCCFLAGS + gencode(archs) + inc + own + list(extra) +
                    ["-x", "cu" if s.endswith(".cu") else "c++", "-c", s, "-o", o]))
    return out


def _hash(archs):
    srcs, deps = sources()
    h = hashlib.sha256()
    h.update(" ".join(NVCCFLAGS + gencode(archs) + sum(cublas_flags(), []) + cudnn_flags()).encode())
    for f in srcs + deps:
        h.update(os.path.relpath(f, _HERE).encode())
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


def _run(cmd):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise RuntimeError("nvcc failed:\n%s\n%s" % (" ".join(cmd), r.stdout))
    return r.stdout


def library_path():
    return os.path.join(BUILD_DIR, LIB_NAME)


def build(jobs=None, archs=ARCHS):
    """Compile the CUDA library into build/mxfusion_cuda_iface/ unless it is current.
    Returns its path.  Raises RuntimeError when nvcc or cuBLASLt is missing or nvcc fails."""
    if not nvcc_path():
        raise RuntimeError("nvcc not found")
    if not cublas_dirs():
        raise RuntimeError("cuBLASLt not found: pip install nvidia-cublas")
    lib = library_path()
    digest = _hash(archs)
    stamp = lib + ".sha256"
    if os.path.exists(lib) and os.path.exists(stamp) and open(stamp).read().strip() == digest:
        return lib
    objdir = os.path.join(BUILD_DIR, "obj")
    os.makedirs(objdir, exist_ok=True)
    cmds = compile_commands(objdir, archs)
    jobs = jobs or int(os.environ.get("MXFUSION_BUILD_JOBS", str(min(8, os.cpu_count() or 2))))
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
        list(ex.map(lambda c: _run(c[2]), cmds))
    tmp = "%s.%d.tmp" % (lib, os.getpid())
    _run([nvcc_path()] + NVCCFLAGS + gencode(archs) + ["-shared", "-o", tmp] + [c[1] for c in cmds] +
         cublas_flags()[1])
    os.replace(tmp, lib)
    with open(stamp, "w") as fh:
        fh.write(digest + "\n")
    return lib


_lib = None


def load(do_build=True):
    """Build (when missing or stale) and load the CUDA library; sets the ctypes signatures."""
    global _lib
    if _lib is None:
        path = build() if do_build else library_path()
        lib = ctypes.CDLL(path)
        for name, res, args in _SIGNATURES:
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _lib = lib
    return _lib


_P = ctypes.POINTER
_SIGNATURES = [
    ("mxf_dtype_size", ctypes.c_int, [ctypes.c_int]),
    ("mxf_cuda_error_string", ctypes.c_char_p, [ctypes.c_int]),
    ("mxf_cublaslt_version", _c_sz, []),
    ("mxf_dense_forward_workspace_size", _c_sz, [ctypes.c_int, _c_i64, _c_i64, _c_i64, ctypes.c_int, _c_i64]),
    ("mxf_dense_forward", ctypes.c_int,
     [ctypes.c_int, _c_vp, _c_vp, _c_vp, _c_vp, _c_i64, _c_i64, _c_i64, ctypes.c_int, ctypes.c_float,
      _c_i64, _c_i64, _c_vp, _c_sz, _c_vp]),
    ("mxf_dense_backward_workspace_size", _c_sz, [ctypes.c_int, _c_i64, _c_i64, _c_i64, ctypes.c_int, _c_i64]),
    ("mxf_dense_backward", ctypes.c_int,
     [ctypes.c_int] + [_c_vp] * 8 + [ctypes.c_int] * 3 + [_c_i64] * 3 + [ctypes.c_int, ctypes.c_float] +
     [_c_i64, _c_i64, _c_vp, _c_sz, _c_vp]),
    ("mxf_add_layer_norm_forward", ctypes.c_int,
     [ctypes.c_int] + [_c_vp] * 8 + [_c_i64] * 3 + [ctypes.c_float, _c_vp]),
    ("mxf_add_layer_norm_backward_workspace_size", _c_sz, [ctypes.c_int, _c_i64, _c_i64, _c_i64]),
    ("mxf_add_layer_norm_backward", ctypes.c_int,
     [ctypes.c_int] + [_c_vp] * 11 + [ctypes.c_int] * 4 + [_c_i64] * 3 + [ctypes.c_float, _c_vp, _c_sz, _c_vp]),
    ("mxf_elemwise_forward", ctypes.c_int,
     [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, _P(_c_vp), _P(_P(_c_i64)), _P(ctypes.c_int), _c_vp,
      ctypes.c_char_p, ctypes.c_int, _c_vp]),
    ("mxf_attention_backend", ctypes.c_int, [_P(AttnArgs), ctypes.c_int, ctypes.c_char_p, _c_sz]),
    ("mxf_cudnn_version", _c_sz, []),
    ("mxf_attention_forward_workspace_size", _c_sz, [_P(AttnArgs)]),
    ("mxf_attention_forward", ctypes.c_int, [_P(AttnArgs), _c_vp, _c_sz, _c_vp]),
    ("mxf_attention_backward_workspace_size", _c_sz, [_P(AttnArgs), _P(AttnGrads)]),
    ("mxf_attention_backward", ctypes.c_int, [_P(AttnArgs), _P(AttnGrads), _c_vp, _c_sz, _c_vp]),
]


# ---------------------------------------------------------------------------- torch helpers

def dtype_code(t):
    """The MXF dtype code of a torch tensor."""
    import torch
    return {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}[t.dtype]


def ptr(t):
    """Device pointer of a torch tensor (None stays NULL)."""
    return t.data_ptr() if t is not None else None


def stream_ptr(torch):
    return torch.cuda.current_stream().cuda_stream


class Workspace:
    """Device scratch memory from torch, grown on demand (kernels never allocate)."""

    def __init__(self, torch):
        self.torch, self.buf = torch, None

    def get(self, nbytes):
        if nbytes == 0:
            return None, 0
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = self.torch.empty(nbytes + 256, dtype=self.torch.uint8, device="cuda")
        return self.buf.data_ptr(), self.buf.numel()


def error(lib, rc):
    return "%d (%s)" % (rc, lib.mxf_cuda_error_string(rc).decode())


def dense(lib, ws, x, w, b, y, M, N, K, act="none", slope=0.25, heads=0, S=0, stream=None):
    code = dtype_code(x)
    p, n = ws.get(lib.mxf_dense_forward_workspace_size(code, M, N, K, ACTS.index(act), heads))
    return lib.mxf_dense_forward(code, ptr(x), ptr(w), ptr(b), ptr(y), M, N, K, ACTS.index(act), slope,
                                 heads, S, p, n, stream)


def dense_backward(lib, ws, dy, x, w, b, y, dx, dw, db, M, N, K, act="none", slope=0.25, heads=0, S=0,
                   req=(REQ_WRITE, REQ_WRITE, REQ_WRITE), stream=None):
    code = dtype_code(x)
    p, n = ws.get(lib.mxf_dense_backward_workspace_size(code, M, N, K, ACTS.index(act), heads))
    return lib.mxf_dense_backward(code, ptr(dy), ptr(x), ptr(w), ptr(b), ptr(y), ptr(dx), ptr(dw), ptr(db),
                                  req[0], req[1], req[2] if db is not None else REQ_NULL, M, N, K,
                                  ACTS.index(act), slope, heads, S, p, n, stream)


def add_layer_norm(lib, a, b, gamma, beta, y, s, R, C, b_rows, eps=1e-5, mean=None, rstd=None, stream=None):
    return lib.mxf_add_layer_norm_forward(dtype_code(a), ptr(a), ptr(b), ptr(gamma), ptr(beta), ptr(y),
                                          ptr(s), ptr(mean), ptr(rstd), R, C, b_rows, eps, stream)


def add_layer_norm_backward(lib, ws, dy, dsum, a, b, gamma, da, db, dgamma, dbeta, R, C, b_rows, eps=1e-5,
                            mean=None, rstd=None, req=(REQ_WRITE,) * 4, stream=None):
    code = dtype_code(a)
    p, n = ws.get(lib.mxf_add_layer_norm_backward_workspace_size(code, R, C, b_rows))
    return lib.mxf_add_layer_norm_backward(code, ptr(dy), ptr(dsum), ptr(a), ptr(b), ptr(gamma), ptr(mean),
                                           ptr(rstd), ptr(da), ptr(db), ptr(dgamma), ptr(dbeta), *req,
                                           R, C, b_rows, eps, p, n, stream)


def elemwise(lib, expr, inputs, out, stream=None):
    """inputs: torch tensors of out's dtype (broadcasting as NumPy); returns (rc, error text)."""
    n = len(inputs)
    ptrs = (_c_vp * n)(*[t.data_ptr() for t in inputs])
    shp = [(_c_i64 * max(1, t.dim()))(*t.shape) for t in inputs]
    shp_arr = (_P(_c_i64) * n)(*[ctypes.cast(s, _P(_c_i64)) for s in shp])
    nd = (ctypes.c_int * n)(*[t.dim() for t in inputs])
    err = ctypes.create_string_buffer(512)
    rc = lib.mxf_elemwise_forward(dtype_code(out), expr.encode(), n, ptrs, shp_arr, nd, ptr(out), err, 512,
                                  stream)
    return rc, err.value.decode()


def attention_args(q, k, v, o, scale, layout="bhsd", causal="none", mask_value=-1e18, lse=None):
    """Arguments for (B, H, S, D) ("bhsd") or (B, S, H, D) ("bshd") torch tensors (any strides
    whose last dim is contiguous), no mask."""
    if layout == "bhsd":
        B, H, Sq, D = q.shape
        Sk, Dv = k.shape[2], v.shape[3]
        st = lambda t: (t.stride(0), t.stride(1), t.stride(2))  # noqa: E731
    else:
        B, Sq, H, D = q.shape
        Sk, Dv = k.shape[1], v.shape[3]
        st = lambda t: (t.stride(0), t.stride(2), t.stride(1))  # noqa: E731
    a = AttnArgs(dtype=dtype_code(q), B=B, H=H, Sq=Sq, Sk=Sk, D=D, Dv=Dv, q=ptr(q), k=ptr(k), v=ptr(v),
                 o=ptr(o), scale=scale, mask_value=mask_value, causal=CAUSAL[causal], lse=ptr(lse))
    (a.q_bs, a.q_hs, a.q_rs), (a.k_bs, a.k_hs, a.k_rs) = st(q), st(k)
    (a.v_bs, a.v_hs, a.v_rs), (a.o_bs, a.o_hs, a.o_rs) = st(v), st(o)
    return a


def attention_backend(lib, args, backward=False):
    """(backend name, reason text) the library chooses for these arguments (no GPU needed)."""
    why = ctypes.create_string_buffer(1024)
    rc = lib.mxf_attention_backend(ctypes.byref(args), int(backward), why, 1024)
    return BACKEND_NAMES.get(rc, "error %d" % rc), why.value.decode()


def attention(lib, ws, args, stream=None):
    p, n = ws.get(lib.mxf_attention_forward_workspace_size(ctypes.byref(args)))
    return lib.mxf_attention_forward(ctypes.byref(args), p, n, stream)


def attention_backward(lib, ws, args, grads, stream=None):
    p, n = ws.get(lib.mxf_attention_backward_workspace_size(ctypes.byref(args), ctypes.byref(grads)))
    return lib.mxf_attention_backward(ctypes.byref(args), ctypes.byref(grads), p, n, stream)
