"""fused_elemwise's generated GPU kernels, checked without a GPU (elemwise_codegen.cc).

1. Every op of the expression language, forward and backward, in float32 / float16 / bfloat16
   storage, broadcast patterns and vector widths, generates CUDA C that NVRTC compiles to PTX for
   sm_80 and sm_90 (NVRTC needs no GPU).
2. The same generated text compiled as host C++ (g++; the elementary functions there are the CPU
   op's own portable ones, act.h) against the CPU op on each of its paths -- the AVX-512 loops and
   the portable ones, forced with MXFUSION_DISABLE_AVX512 in a subprocess (the AVX-512 path skips
   on CPUs without it) -- per op, forward and backward, on random values and NaN, +-inf, +-0,
   subnormals and overflowing ones: the NaN / inf pattern exactly; forward: exact ops bitwise,
   the others each within the bound derived from its elementary functions' measured errors on
   its own path (elemwise_bounds.py: interval arithmetic over the program, so a program that
   cancels, gelu for x << 0, gets the bound its arithmetic has, where an ulp count of the result
   holds on one instruction set and not on another); backward: rtol 2e-4 (the CPU op's loops
   contract a product and a sum into one FMA, and tanh's 1 - y^2 magnifies a 1-ulp difference of
   y; 8e-5 measured).  The error table itself is checked over a sweep of the float range on both
   paths.  At rank 2 the program takes oneDNN's forms of act_relu / leaky / gelu (MXNet's CPU),
   at rank 6 MXNet's own (its GPU).
3. The collapsed broadcast patterns a kernel is specialised for.
On the GPU these kernels are not yet run here: tests/kernels/test_cuda_kernels.py does that on a
GPU machine (make gpu-check).
"""
import ctypes
import json
import os
import re
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

from kernel_fixtures import fused_ops, run_python  # noqa: F401  (builds + loads the library)

_HERE = os.path.dirname(os.path.abspath(__file__))
_KERNELS = os.path.join(_HERE, "..", "..", "cuda_kernels")
sys.path.insert(0, _KERNELS)
import cuda_iface as ci  # noqa: E402
import elemwise_bounds as eb  # noqa: E402

F32, F16, BF16 = 0, 1, 2
UNARY = ["neg", "abs", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "erf", "square", "log1p",
         "expm1", "act_relu", "softrelu", "softsign", "gelu", "log_sigmoid", "mish"]
BINARY = ["add", "sub", "mul", "div", "pow", "max", "min", "lt", "le", "gt", "ge", "eq", "ne", "leaky"]
TERNARY = ["where", "clip", "hard_sigmoid"]
EXACT = {"neg", "abs", "relu", "act_relu", "square", "add", "sub", "mul", "div", "max", "min", "lt", "le", "gt",
         "ge", "eq", "ne", "leaky", "where", "clip", "hard_sigmoid", "sqrt"}

PROGRAMS = ([("%s(x0)" % u, 1) for u in UNARY] + [("%s(x0, x1)" % b, 2) for b in BINARY] +
            [("where(x0, x1, x2)", 3), ("clip(x0, x1, x2)", 3), ("clip(x0, -1.0, 2.0)", 1),
             ("hard_sigmoid(x0, 0.2, 0.5)", 1), ("hard_sigmoid(x0, x1, x2)", 3), ("leaky(x0, 0.0)", 1),
             ("leaky(x0, -0.5)", 1), ("div(x0, 4.0)", 1), ("div(3.0, x0)", 1), ("mul(x0, x0)", 1),
             ("sub(2.5, x0)", 1), ("pow(x0, 2.0)", 1), ("max(div(x0, 0.0), div(x0, 0.0))", 1),
             ("mul(sigmoid(add(mul(x0, 1.5), 0.5)), tanh(sub(x0, 0.25)))", 1),
             ("add(mul(x0, x1), sub(x0, x2))", 3), ("where(gt(x0, x1), gelu(x2), mish(x0))", 3),
             ("mul(x0, sigmoid(add(x1, 3.0)))", 2), ("relu(add(x0, x1))", 2), ("exp(x1)", 3)])


def exact(expr):
    names = set(re.findall(r"[a-z_0-9]+(?=\()", expr))
    return names <= EXACT


@pytest.fixture(scope="module")
def lib(fused_ops):
    nvrtc = ci.nvrtc_library()
    if nvrtc:
        os.environ.setdefault("MXFUSION_NVRTC_LIB", nvrtc)
    return ctypes.CDLL(fused_ops.library_path())


def generate(lib, expr, n, shapes, backward=False, in_dtypes=None, out_dtype=F32, grad_dtypes=None, vec=1,
             dnnl=True):
    arrs = [(ctypes.c_int64 * max(1, len(s)))(*s) for s in shapes]
    sp = (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(a, ctypes.POINTER(ctypes.c_int64)) for a in arrs])
    nd = (ctypes.c_int * n)(*[len(s) for s in shapes])
    dts = (ctypes.c_int * n)(*(in_dtypes or [F32] * n))
    gds = (ctypes.c_int * n)(*(grad_dtypes or in_dtypes or [F32] * n))
    buf = ctypes.create_string_buffer(1 << 20)
    err = ctypes.create_string_buffer(1024)
    fn = lib.mxf_elemwise_codegen
    fn.restype = ctypes.c_int
    r = fn(expr.encode(), n, int(backward), dts, out_dtype, gds, sp, nd, vec, int(dnnl), buf, len(buf), err, 1024)
    if r < 0:
        raise ValueError(err.value.decode())
    return buf.value.decode()


def nvrtc_compile(lib, src, arch):
    fn = lib.mxf_nvrtc_compile
    fn.restype = ctypes.c_longlong
    log = ctypes.create_string_buffer(1 << 16)
    r = fn(src.encode(), arch, 1, None, 0, log, len(log))
    return r, log.value.decode()


@pytest.fixture(scope="module")
def nvrtc(lib):
    lib.mxf_nvrtc_describe.restype = ctypes.c_char_p
    desc = lib.mxf_nvrtc_describe().decode()
    if not re.match(r"NVRTC \d+\.\d+ ", desc):
        pytest.skip("NVRTC not found here (pip install nvidia-cuda-nvrtc): %s" % desc.splitlines()[0])
    return desc


def _sum_of(calls):
    expr = calls[0]
    for c in calls[1:]:
        expr = "add(%s, %s)" % (expr, c)
    return expr


# every op in three programs; then the variants a kernel is specialised for
ALL_OPS = [
    (_sum_of(["%s(mul(x0, 0.5))" % u for u in UNARY]), 1),
    (_sum_of(["%s(x0, x1)" % b for b in BINARY] + ["leaky(x0, 0.0)", "div(x0, 4.0)"]), 2),
    (_sum_of(["%s(x0, x1, x2)" % t for t in TERNARY] + ["clip(x0, -1.0, 2.0)"]), 3),
]
VARIANTS = [  # shapes, in dtypes, out dtype, vec
    ([(64, 32), (64, 32), (64, 32)], [F32] * 3, F32, 4),
    ([(8, 64), (64,), (8, 1)], [F16, F16, F32], F16, 8),
    ([(2, 16, 4, 4), (16, 1, 1), (1,)], [BF16, BF16, BF16], BF16, 8),
    ([(3, 5, 7), (3, 1, 7), (1, 5, 1)], [F16, BF16, F32], F32, 1),
    ([(1 << 16,), (1,), (1 << 16,)], [F32, F16, F16], F16, 2),
]


@pytest.mark.parametrize("arch", [80, 90])
def test_every_op_compiles_with_nvrtc(lib, nvrtc, arch):
    failures = []
    for expr, n in ALL_OPS:
        for backward in (False, True):
            shapes = [(4, 16)] * n
            src = generate(lib, expr, n, shapes, backward=backward, vec=4, dnnl=False)
            r, log = nvrtc_compile(lib, src, arch)
            if r < 0 or "warning" in log:
                failures.append((expr[:60], backward, log[:2000]))
    assert not failures, failures


def test_specialised_variants_compile_with_nvrtc(lib, nvrtc):
    expr = "where(gt(x0, x1), mul(gelu(x2), x1), sub(x0, sigmoid(x2)))"
    for shapes, dts, odt, vec in VARIANTS:
        for backward in (False, True):
            src = generate(lib, expr, 3, shapes, backward, dts, odt, vec=vec, dnnl=False)
            r, log = nvrtc_compile(lib, src, 90)
            assert r > 0 and "warning" not in log, (shapes, dts, backward, log[:3000])


def test_the_kernel_key_names_the_collapsed_pattern(lib):
    def key(shapes, vec=1):
        src = generate(lib, "add(add(x0, x1), x2)", 3, shapes, vec=vec)
        return re.search(r"^// (fwd;.*)$", src, re.M).group(1)
    # full-size and single-element inputs: one flat dim
    assert ";ndim=1;bcast=0,1,0," in key([(4, 5, 6), (1,), (4, 5, 6)])
    # a bias over the last dim: rows x columns, the bias broadcast along the rows
    assert ";ndim=2;bcast=0,1,0," in key([(4, 5, 6), (6,), (4, 5, 6)])
    # per-channel (C, 1, 1) over (N, C, H, W): N, C, H*W with the channel input broadcast along N and H*W
    assert ";ndim=3;bcast=0,5,0," in key([(2, 3, 4, 4), (3, 1, 1), (2, 3, 4, 4)])
    # neighbours every input broadcasts alike merge (2 x 3 -> 6); size-1 dims carry nothing
    assert ";ndim=2;bcast=1,0,0," in key([(1, 1, 4), (2, 3, 4), (2, 3, 4)])
    assert ";ndim=3;bcast=2,5,3," in key([(1, 4, 1, 6), (4, 1), (6,)])
    with pytest.raises(ValueError, match="vector width 4 does not divide the innermost dim 6"):
        key([(4, 5, 6), (6,), (4, 5, 6)], vec=4)


# ---- the element functions, as host C++, against the CPU op ------------------------------------------

def _host_library(lib, tmpdir, programs, rank):
    shapes = lambda n: [(2, 256) if rank == 2 else (2, 1, 1, 1, 2, 128)] * n  # noqa: E731
    parts = ["#include <cmath>\n#include <cstring>\n#include \"act.h\"\n"]
    for i, (expr, n) in enumerate(programs):
        src = generate(lib, expr, n, shapes(n), backward=True)
        parts.append("namespace p%d {\n%s\n}  // namespace p%d\n" % (i, src, i))
        xs = ", ".join("x[%d][e]" % k for k in range(n))
        gs = ", ".join("&g[%d][e]" % k for k in range(n))
        parts.append('extern "C" void fwd_%d(const float* const* x, float* y, long n) {\n'
                     '  for (long e = 0; e < n; ++e) y[e] = p%d::mxf_ew_forward(%s);\n}\n' % (i, i, xs))
        parts.append('extern "C" void bwd_%d(const float* const* x, const float* dy, float* const* g, long n) {\n'
                     '  for (long e = 0; e < n; ++e) p%d::mxf_ew_gradient(%s, dy[e], %s);\n}\n' % (i, i, xs, gs))
    src_path = os.path.join(tmpdir, "generated_rank%d.cc" % rank)
    with open(src_path, "w") as fh:
        fh.write("".join(parts))
    so = src_path[:-3] + ".so"
    mxinc = os.path.join(os.path.dirname(mx.__file__), "include")
    cmd = ["g++", "-O1", "-std=c++17", "-march=x86-64-v3", "-ffp-contract=off", "-fPIC", "-shared", "-w",
           "-I" + os.path.join(_KERNELS, "common"), "-I" + mxinc, src_path, "-o", so]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return ctypes.CDLL(so)


SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, 88.8, -88.8, 20.5, -20.5, 1e30, -1e30,
                    1.0, -1.0, 0.5], np.float32)


def _inputs(n, size, seed):
    r = np.random.default_rng(seed)
    out = []
    for k in range(n):
        x = (r.standard_normal(size) * 3).astype(np.float32)
        pos = r.permutation(size)[:4 * SPECIAL.size]
        x[pos] = np.tile(SPECIAL, 4)[r.permutation(4 * SPECIAL.size)]
        out.append(x)
    return out


def _ulps(a, b):
    ai = a.view(np.int32).astype(np.int64)
    bi = b.view(np.int32).astype(np.int64)
    ai = np.where(ai < 0, -(ai & 0x7fffffff), ai)
    bi = np.where(bi < 0, -(bi & 0x7fffffff), bi)
    return np.abs(ai - bi)


def _compare(got, want, exact_op, what, rtol=None):
    nan_g, nan_w = np.isnan(got), np.isnan(want)
    assert np.array_equal(nan_g, nan_w), "%s: NaN at %s vs %s" % (what, np.flatnonzero(nan_g ^ nan_w)[:8], want[(nan_g ^ nan_w)][:8])
    ok = ~nan_w
    g, w = got[ok], want[ok]
    inf = np.isinf(w) | np.isinf(g)
    assert np.array_equal(g[inf], w[inf]), "%s: inf differs: %s vs %s" % (what, g[inf][:8], w[inf][:8])
    g, w = g[~inf], w[~inf]
    if exact_op:
        bad = g.view(np.uint32) != w.view(np.uint32)
        assert not bad.any(), "%s: not bitwise: %s vs %s" % (what, g[bad][:8], w[bad][:8])
    elif rtol is None:
        u = _ulps(g, w)
        assert u.max(initial=0) <= 32, "%s: %d ulps at %s vs %s" % (what, u.max(), g[u > 32][:4], w[u > 32][:4])
    else:
        np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-6 * max(1.0, float(np.abs(w).max(initial=0))),
                                   err_msg=what)


#: The CPU op run in a fresh process (its path is fixed when the library loads): every program of
#: argv[1] (JSON [[expr, n], ...]) on the inputs of argv[2] (npz: x<i>_<k>, dy<i>) at rank argv[4],
#: forward and backward through MXNet autograd, into argv[3] (npz: y<i>, g<i>_<k>).
_CPU_OP = """
import json
import numpy as np, mxnet as mx, fusion
programs = json.load(open(sys.argv[1]))
rank = int(sys.argv[4])
shape = (2, 256) if rank == 2 else (2, 1, 1, 1, 2, 128)
out = {}
with np.load(sys.argv[2]) as z:
    for i, (expr, n) in enumerate(programs):
        arrs = [mx.nd.array(z["x%d_%d" % (i, k)].reshape(shape)) for k in range(n)]
        for a in arrs:
            a.attach_grad()
        with mx.autograd.record():
            y = mx.nd.fused_elemwise(*arrs, expr=expr, num_args=n)
        y.backward(mx.nd.array(z["dy%d" % i].reshape(shape)))
        out["y%d" % i] = y.asnumpy().ravel()
        for k, a in enumerate(arrs):
            out["g%d_%d" % (i, k)] = a.grad.asnumpy().ravel()
np.savez(sys.argv[3], **out)
"""


def cpu_has_avx512() -> bool:
    """What the op's run-time check (cpu_has_avx512, vmath_avx512.cc) asks: AVX-512 F and DQ."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = set(next(line for line in fh if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        return False
    return {"avx512f", "avx512dq"} <= flags


def _path_env(path):
    """The environment that puts the CPU op on ``path``; skips where this CPU cannot run it."""
    if path == "avx512":
        if not cpu_has_avx512():
            pytest.skip("this CPU has no AVX-512 F/DQ: the op's AVX-512 loops cannot run here "
                        "(the portable path is tested on every CPU)")
        return {"MXFUSION_DISABLE_AVX512": "0"}
    return {"MXFUSION_DISABLE_AVX512": "1"}


def _cpu_op(programs, inputs, rank, path, tmpdir):
    env = _path_env(path)
    prog = os.path.join(tmpdir, "programs.json")
    with open(prog, "w") as fh:
        json.dump([[e, n] for e, n in programs], fh)
    inp, outp = os.path.join(tmpdir, "inputs.npz"), os.path.join(tmpdir, "op_%s_%d.npz" % (path, rank))
    np.savez(inp, **inputs)
    run_python(_CPU_OP, prog, inp, outp, rank, **env)
    with np.load(outp) as z:
        return {k: z[k] for k in z.files}


def _same_specials(got, want, what):
    """NaN and inf where the CPU op has them, with the same sign: exactly."""
    nan_g, nan_w = np.isnan(got), np.isnan(want)
    assert np.array_equal(nan_g, nan_w), "%s: NaN at %s vs %s" % (what, np.flatnonzero(nan_g ^ nan_w)[:8], want[(nan_g ^ nan_w)][:8])
    inf = np.isinf(want) | np.isinf(got)
    assert np.array_equal(got[inf], want[inf]), "%s: inf differs: %s vs %s" % (what, got[inf][:8], want[inf][:8])


def _within(got, iv, xs, what):
    bad = eb.outside(got, iv)
    if bad.any():
        k = np.flatnonzero(bad)[:4]
        raise AssertionError("%s: %d value(s) outside the derived bound, e.g. %s" % (
            what, bad.sum(), ["x=%s got %.9g not in [%.9g, %.9g]" % ([float(x[j]) for x in xs], got[j], iv.lo[j],
                                                                      iv.hi[j]) for j in k]))


@pytest.mark.parametrize("path", eb.PATHS)
@pytest.mark.parametrize("rank", [2, 6])
def test_generated_element_functions_match_the_cpu_op(lib, tmp_path, rank, path):
    """The generated element functions (as host C++: the portable path's functions) against the CPU op
    on ``path`` (the AVX-512 loops or the portable ones, forced in a subprocess), per program:
    NaN/inf exactly; exact programs bitwise; the others each within the bound derived from the
    elementary functions' errors on its own path (elemwise_bounds.py) -- not within an ulp count,
    which no two paths can promise where a program cancels (gelu for x << 0); backward within
    rtol 2e-4 (the loops contract a product and a sum into one FMA, and tanh's 1 - y^2 magnifies a
    1-ulp difference of y; 8e-5 measured on both paths)."""
    host = _host_library(lib, str(tmp_path), PROGRAMS, rank)
    size = 512
    P = ctypes.POINTER(ctypes.c_float)
    inputs, xs_of = {}, []
    for i, (expr, n) in enumerate(PROGRAMS):
        xs = _inputs(n, size, seed=i)
        dy = _inputs(1, size, seed=1000 + i)[0]
        dy[np.isnan(dy) | np.isinf(dy)] = 1.0        # head gradients: finite (a NaN one is the CPU's own test)
        xs_of.append((xs, dy))
        inputs.update({"x%d_%d" % (i, k): x for k, x in enumerate(xs)})
        inputs["dy%d" % i] = dy
    op = _cpu_op(PROGRAMS, inputs, rank, path, str(tmp_path))
    checked = 0
    for i, (expr, n) in enumerate(PROGRAMS):
        xs, dy = xs_of[i]
        want_y = op["y%d" % i]
        want_g = [op["g%d_%d" % (i, k)] for k in range(n)]
        xptrs = (P * n)(*[x.ctypes.data_as(P) for x in xs])
        got_y = np.empty(size, np.float32)
        getattr(host, "fwd_%d" % i)(xptrs, got_y.ctypes.data_as(P), ctypes.c_long(size))
        got_g = [np.empty(size, np.float32) for _ in range(n)]
        gptrs = (P * n)(*[g.ctypes.data_as(P) for g in got_g])
        getattr(host, "bwd_%d" % i)(xptrs, dy.ctypes.data_as(P), gptrs, ctypes.c_long(size))
        what = "%s forward (rank %d, CPU op on the %s path)" % (expr, rank, path)
        _same_specials(got_y, want_y, what)
        if exact(expr):
            fin = np.isfinite(want_y)
            bad = got_y[fin].view(np.uint32) != want_y[fin].view(np.uint32)
            assert not bad.any(), "%s: not bitwise: %s vs %s" % (what, got_y[fin][bad][:8], want_y[fin][bad][:8])
        else:
            _within(want_y, eb.bounds(expr, xs, path), xs, what)
            _within(got_y, eb.bounds(expr, xs, "portable"), xs, what.replace("CPU op", "generated code vs"))
            checked += 1
        for k in range(n):
            _compare(got_g[k], want_g[k], False, "%s d/dx%d (rank %d, %s path)" % (expr, k, rank, path), rtol=2e-4)
    assert checked > 10


#: Every elementary function over a sweep of the float range: its bits every 4096th pattern (both signs,
#: subnormals, the overflow ends), densely around 0 and the functions' branch points.
def _sweep():
    bits = np.arange(0, 1 << 32, 4096, dtype=np.uint64).astype(np.uint32)
    wide = bits.view(np.float32)
    r = np.random.default_rng(7)
    near = np.concatenate([r.uniform(-1, 1, 1 << 16), r.uniform(-12, 12, 1 << 16),
                           r.uniform(19.5, 20.5, 4096), r.uniform(-90, 90, 1 << 14)]).astype(np.float32)
    x = np.concatenate([wide, near])
    return x[~np.isnan(x)]


SWEPT = ["exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "tanh", "sigmoid", "erf", "gelu", "softrelu", "log_sigmoid",
         "mish", "softsign"]


@pytest.mark.parametrize("path", eb.PATHS)
def test_elementary_functions_within_their_bounds(lib, tmp_path, path):
    """elemwise_bounds.ELEMENTARY_ULPS holds: each function of the CPU op on ``path``, and the generated
    code's (portable), lies in the interval derived from the table over the whole sweep, pow on pairs."""
    x = _sweep()
    programs = [("%s(x0)" % f, 1) for f in SWEPT] + [("pow(x0, x1)", 2)]
    r = np.random.default_rng(3)
    base = np.abs(x[:: max(1, x.size // 200000)])[:200000]
    expo = r.uniform(-30, 30, base.size).astype(np.float32)
    code = (
        "import numpy as np, mxnet as mx, fusion\n"
        "with np.load(sys.argv[1]) as z:\n"
        "    x, a, b = z['x'], z['a'], z['b']\n"
        "out = {'f%d' % i: mx.nd.fused_elemwise(mx.nd.array(x), expr=e, num_args=1).asnumpy()\n"
        "       for i, e in enumerate(sys.argv[3:])}\n"
        "out['pow'] = mx.nd.fused_elemwise(mx.nd.array(a), mx.nd.array(b), expr='pow(x0, x1)').asnumpy()\n"
        "np.savez(sys.argv[2], **out)\n")
    inp, outp = str(tmp_path / "sweep.npz"), str(tmp_path / "out.npz")
    np.savez(inp, x=x, a=base, b=expo)
    run_python(code, inp, outp, *[e for e, _ in programs[:-1]], **_path_env(path))
    host = _host_library(lib, str(tmp_path), programs, 2)
    P = ctypes.POINTER(ctypes.c_float)
    with np.load(outp) as z:
        for i, f in enumerate(SWEPT):
            iv = eb.bounds("%s(x0)" % f, [x], path)
            assert eb.bounded(iv).mean() > 0.4, f
            _within(z["f%d" % i], iv, [x], "%s (CPU op, %s path)" % (f, path))
            got = np.empty_like(x)
            xp = (P * 1)(x.ctypes.data_as(P))
            getattr(host, "fwd_%d" % i)(xp, got.ctypes.data_as(P), ctypes.c_long(x.size))
            _within(got, eb.bounds("%s(x0)" % f, [x], "portable"), [x], "%s (generated code)" % f)
        _within(z["pow"], eb.bounds("pow(x0, x1)", [base, expo], path), [base, expo], "pow (CPU op, %s path)" % path)


def test_nvrtc_missing_is_reported_with_the_reason(fused_ops):
    code = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
lib.mxf_nvrtc_describe.restype = ctypes.c_char_p
print(lib.mxf_nvrtc_describe().decode())
"""
    out = run_python(code, fused_ops.library_path(), MXFUSION_NVRTC_LIB="/nonexistent/libnvrtc.so.13",
                     LD_LIBRARY_PATH="")
    if re.match(r"NVRTC \d+\.\d+ ", out):
        pytest.skip("an NVRTC is on this machine's loader path")
    assert "NVRTC (libnvrtc.so) not found" in out and "/nonexistent/libnvrtc.so.13" in out
