"""Benchmark the fused CPU ops against MXNet's unfused ops, measured in the same run.

    OMP_NUM_THREADS=2 python benchmarks/bench_kernels.py [--quick]

Prints one table per op.  All timings are medians over interleaved repetitions
(fused and baseline alternate, so machine noise hits both).  Memory for attention is
the bytes of intermediate tensors each side needs, computed from the shapes: MXNet
materializes the scores and the softmax output (2 x N x S x S floats); the fused
kernel only holds per-thread tiles (see cuda_kernels/fused_attention/attention_cpu.cc).
"""
import argparse
import importlib.util
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("MXNET_CPU_PARALLEL_SIZE", "2000000000")

import numpy as np  # noqa: E402

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)


def _native():
    try:
        from fusion.native import library as _native
        return _native
    except Exception:
        spec = importlib.util.spec_from_file_location("fusion_native_bench",
                                                      os.path.join(_REPO, "fusion", "native", "library.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


MINS = {}  # best times of the last call, for the "best" columns


def timeit_interleaved(fns, reps, warmup=3):
    """Median seconds of each callable, alternating them each repetition.

    The minimum of each is kept in MINS (list, same order): on a shared machine the
    best time is the least disturbed one, the median the typical one.
    """
    for _ in range(warmup):
        for f in fns:
            f()
    ts = [[] for _ in fns]
    for _ in range(reps):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            f()
            ts[i].append(time.perf_counter() - t)
    MINS["last"] = [float(np.min(t)) for t in ts]
    return [float(np.median(t)) for t in ts]


def bind(sym, args):
    import mxnet as mx
    return sym.bind(mx.cpu(), args, grad_req="null")


def run_exec(ex):
    return lambda: ex.forward()[0].wait_to_read()


def fma_peak_gflops(threads):
    """This machine's peak fp32 FMA rate, from benchmarks/fma_peak.cc built here with
    -march=native (None when no compiler is at hand)."""
    import ctypes
    import shutil
    import subprocess
    import tempfile
    if not shutil.which("g++"):
        return None
    d = tempfile.mkdtemp(prefix="mxf_peak_")
    so = os.path.join(d, "fma_peak.so")
    try:
        subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
                        os.path.join(os.path.dirname(os.path.abspath(__file__)), "fma_peak.cc"),
                        "-o", so], check=True, capture_output=True)
        lib = ctypes.CDLL(so)
        lib.fma_peak_gflops.restype = ctypes.c_double
        lib.fma_peak_gflops.argtypes = [ctypes.c_int, ctypes.c_long]
        return lib.fma_peak_gflops(threads, 20_000_000)
    except (OSError, subprocess.CalledProcessError):
        return None
    finally:
        shutil.rmtree(d, ignore_errors=True)


def ort_dense_runner(x, w, b, threads):
    """ONNX Runtime running MatMul + Add on the same data (None without onnxruntime)."""
    try:
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return None
    M, K = x.shape
    N = w.shape[0]
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "wt"], ["y0"]), helper.make_node("Add", ["y0", "b"], ["y"])],
        "dense", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, N])],
        [numpy_helper.from_array(np.ascontiguousarray(w.T), "wt"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feed = {"x": x}
    return lambda: sess.run(None, feed)


def bench_dense(reps):
    import mxnet as mx
    M = 128
    nt = int(os.environ["OMP_NUM_THREADS"])
    peak = fma_peak_gflops(nt)
    print("\n## fused_dense vs FullyConnected(+Activation), M=%d, fp32, %d threads" % (M, nt))
    if peak:
        print("machine peak (FMA loop, %d threads): %.0f GFLOP/s; \"%%pk\" columns are fractions of it"
              % (nt, peak))
    print("| K -> N | act | fused GFLOP/s | MXNet GFLOP/s | ONNX Runtime GFLOP/s | fused / MXNet | "
          "ratio of best times | fused %pk | MXNet %pk | ORT %pk |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    x, w, b = mx.sym.var("x"), mx.sym.var("w"), mx.sym.var("b")
    for K, N in [(768, 2304), (768, 768), (768, 3072), (3072, 768)]:
        for act in ("none", "gelu_erf"):
            args = {"x": mx.nd.random.normal(shape=(M, K)), "w": mx.nd.random.normal(shape=(N, K)),
                    "b": mx.nd.random.normal(shape=(N,))}
            fc = mx.sym.FullyConnected(x, w, b, num_hidden=N)
            if act == "gelu_erf":
                fc = mx.sym.LeakyReLU(fc, act_type="gelu")
            e1 = bind(mx.sym.fused_dense(x, w, b, act=act), args)
            e2 = bind(fc, args)
            t1, t2 = timeit_interleaved([run_exec(e1), run_exec(e2)], reps)
            g1, g2 = 2 * M * N * K / t1 / 1e9, 2 * M * N * K / t2 / 1e9
            b1, b2 = MINS["last"]
            g3 = None
            if act == "none":  # ONNX Runtime's MatMul+Add, timed apart (its workers spin)
                r = ort_dense_runner(*(args[k].asnumpy() for k in "xwb"), nt)
                if r is not None:
                    g3 = 2 * M * N * K / timeit_interleaved([r], reps)[0] / 1e9
                    time.sleep(0.1)
            pct = lambda g: "%.0f%%" % (100 * g / peak) if (peak and g) else "-"
            print("| %d -> %d | %s | %.1f | %.1f | %s | %.2fx | %.2fx | %s | %s | %s |" % (
                K, N, act, g1, g2, "%.1f" % g3 if g3 else "-", g1 / g2, b2 / b1, pct(g1), pct(g2),
                pct(g3)))


def bench_attention(reps, seqs):
    import mxnet as mx
    H, D, nt = 12, 64, int(os.environ["OMP_NUM_THREADS"])
    print("\n## fused_attention vs batch_dot/softmax/batch_dot, batch 1, %d heads, D=%d" % (H, D))
    print("| S | fused ms | MXNet ms | speedup | speedup of best times | MXNet scratch MiB | "
          "fused scratch MiB |")
    print("|---|---|---|---|---|---|---|")
    q, k, v = mx.sym.var("q"), mx.sym.var("k"), mx.sym.var("v")
    scale = 1.0 / np.sqrt(D)
    for S in seqs:
        args = {n: mx.nd.random.normal(shape=(H, S, D)) for n in "qkv"}
        fused = mx.sym.fused_attention(q, k, v, scale=scale)
        s = mx.sym.batch_dot(q, k, transpose_b=True) * scale
        ref = mx.sym.batch_dot(mx.sym.softmax(s, axis=-1), v)
        e1, e2 = bind(fused, args), bind(ref, args)
        r = max(3, reps // (1 if S <= 512 else 4))
        t1, t2 = timeit_interleaved([run_exec(e1), run_exec(e2)], r, warmup=2)
        mx_bytes = 2 * H * S * S * 4
        bq, bk = 64, 256
        fused_bytes = nt * (bq * bk + bq * D + 4 * bq) * 4
        b1, b2 = MINS["last"]
        print("| %d | %.2f | %.2f | %.2fx | %.2fx | %.1f | %.2f |" % (
            S, t1 * 1e3, t2 * 1e3, t2 / t1, b2 / b1, mx_bytes / 2**20, fused_bytes / 2**20))


def bench_elemwise(reps):
    import mxnet as mx
    n = 16 * 2**20  # 64 MiB of float32
    expr = "mul(sigmoid(add(mul(x0, 1.5), 0.5)), tanh(sub(x0, 0.25)))"  # 6 ops
    x = mx.nd.random.normal(shape=(n,))
    out = mx.nd.empty((n,))
    xs = mx.sym.var("x0")
    e1 = bind(mx.sym.fused_elemwise(xs, expr=expr), {"x0": x})
    sep = lambda: (mx.nd.sigmoid(x * 1.5 + 0.5) * mx.nd.tanh(x - 0.25)).wait_to_read()
    src, dst = x.asnumpy(), np.empty(n, np.float32)
    t_fused, t_sep, t_np, t_mx = timeit_interleaved(
        [run_exec(e1), sep, lambda: np.copyto(dst, src), lambda: x.copyto(out).wait_to_read()],
        reps)
    best = MINS["last"]
    t_copy, b_copy = min(t_np, t_mx), min(best[2], best[3])
    gbs = lambda t: 2 * n * 4 / t / 1e9  # one read + one write of the tensor
    print("\n## fused_elemwise: 6-op chain over a 64 MiB tensor: %s" % expr)
    print("| variant | ms | GB/s (read+write) | vs copy bandwidth | best ms | best vs best copy |")
    print("|---|---|---|---|---|---|")
    for name, t, b in [("fused_elemwise", t_fused, best[0]), ("MXNet separate ops", t_sep, best[1]),
                       ("copy (numpy copyto)", t_np, best[2]),
                       ("copy (MXNet copyto)", t_mx, best[3])]:
        print("| %s | %.2f | %.2f | %.0f%% | %.2f | %.0f%% |" % (
            name, t * 1e3, gbs(t), 100 * t_copy / t, b * 1e3, 100 * b_copy / b))
    print("speedup fused vs separate ops: %.2fx (best times: %.2fx)" % (t_sep / t_fused,
                                                                       best[1] / best[0]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, S <= 1024")
    ap.add_argument("--only", choices=["dense", "attention", "elemwise"])
    a = ap.parse_args()
    nat = _native()
    nat.build()
    nat.load()
    reps = 8 if a.quick else 20
    print("load average before: %.2f %.2f %.2f (2 cores; others' jobs skew timings)"
          % os.getloadavg())
    if a.only in (None, "dense"):
        bench_dense(reps)
    if a.only in (None, "attention"):
        bench_attention(reps, [128, 512, 1024] if a.quick else [128, 512, 1024, 2048])
    if a.only in (None, "elemwise"):
        bench_elemwise(reps)
    print("\nload average after: %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
