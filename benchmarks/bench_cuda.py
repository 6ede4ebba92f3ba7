"""GPU benchmark of the CUDA kernels (C interface) against PyTorch, fp32, in one run.

    python3 benchmarks/bench_cuda.py [--quick]

Needs an NVIDIA GPU, PyTorch with CUDA and nvcc; imports no MXNet (the library is built
from cuda_kernels/ alone, see cuda_kernels/cuda_iface.py).  Prints, with medians of
CUDA-event timings (fused and baselines alternate each repetition):

* fused_attention vs torch scaled_dot_product_attention and the unfused
  matmul -> scale -> softmax -> matmul sequence (12 heads, D=64), with max |diff|;
* fused_dense (+GELU) vs torch.addmm (+gelu), TFLOP/s (TF32 off);
* fused_elemwise 6-op chain over 64 MiB vs PyTorch's separate ops, and as a fraction
  of a device-to-device copy's bandwidth;
* fused_add_layer_norm vs (a + b) then torch layer_norm.

A GPU machine without these prints why and exits 0 (so scripts can call it anywhere).
"""
import argparse
import os
import statistics
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_REPO, "cuda_kernels"))

import cuda_iface  # noqa: E402


def timed(torch, fns, reps, warmup=3):
    """Median milliseconds of each callable, alternating them, timed with CUDA events."""
    for _ in range(warmup):
        for f in fns:
            f()
    torch.cuda.synchronize()
    ts = [[] for _ in fns]
    for _ in range(reps):
        for i, f in enumerate(fns):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            f()
            b.record()
            b.synchronize()
            ts[i].append(a.elapsed_time(b))
    return [statistics.median(t) for t in ts]


def check(rc, what):
    if rc != 0:
        raise RuntimeError("%s failed with status %s" % (what, rc))


def bench_attention(lib, torch, seqs, reps):
    import ctypes
    F = torch.nn.functional
    H, D = 12, 64
    print("\n## fused_attention vs PyTorch, batch 1, %d heads, D=%d, fp32" % (H, D))
    print("| S | fused ms | SDPA ms | unfused ms | vs SDPA | vs unfused | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    for S in seqs:
        q, k, v = (torch.randn(H, S, D, device="cuda") for _ in range(3))
        o = torch.empty_like(q)
        scale = D ** -0.5
        args = cuda_iface.attention_args(1, H, S, S, D, D, q, k, v, o, scale)
        fused = lambda: check(lib.mxf_attention_forward(ctypes.byref(args), None), "attention")
        sdpa = lambda: F.scaled_dot_product_attention(q[None], k[None], v[None])
        unfused = lambda: torch.softmax((q @ k.transpose(1, 2)) * scale, -1) @ v
        t = timed(torch, [fused, sdpa, unfused], reps if S <= 2048 else max(3, reps // 4))
        fused()
        diff = (o - sdpa()[0]).abs().max().item()
        print("| %d | %.3f | %.3f | %.3f | %.2fx | %.2fx | %.1e |" % (
            S, t[0], t[1], t[2], t[1] / t[0], t[2] / t[0], diff))


def bench_dense(lib, torch, reps):
    F = torch.nn.functional
    torch.backends.cuda.matmul.allow_tf32 = False
    print("\n## fused_dense vs torch.addmm (+gelu), fp32 (TF32 off)")
    print("| M | K -> N | act | fused TFLOP/s | torch TFLOP/s | ratio |")
    print("|---|---|---|---|---|---|")
    for M in (128, 512):
        for K, N in [(768, 2304), (768, 768), (768, 3072), (3072, 768)]:
            x, w, b = torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda"), torch.randn(N, device="cuda")
            y = torch.empty(M, N, device="cuda")
            for act in ("none", "gelu_erf"):
                fused = lambda: check(cuda_iface.dense(lib, x, w, b, y, M, N, K, act), "dense")
                if act == "none":
                    ref = lambda: torch.addmm(b, x, w.t())
                else:
                    ref = lambda: F.gelu(torch.addmm(b, x, w.t()))
                t = timed(torch, [fused, ref], reps)
                fl = 2 * M * N * K / 1e9
                print("| %d | %d -> %d | %s | %.1f | %.1f | %.2fx |" % (
                    M, K, N, act, fl / t[0], fl / t[1], t[1] / t[0]))


def bench_elemwise(lib, torch, reps):
    n = 16 * 2 ** 20
    expr = "mul(sigmoid(add(mul(x0, 1.5), 0.5)), tanh(sub(x0, 0.25)))"
    x = torch.randn(n, device="cuda")
    out, dst = torch.empty_like(x), torch.empty_like(x)
    fused = lambda: check(cuda_iface.elemwise(lib, expr, [x], out)[0], "elemwise")
    sep = lambda: torch.sigmoid(x * 1.5 + 0.5) * torch.tanh(x - 0.25)
    copy = lambda: dst.copy_(x)
    t = timed(torch, [fused, sep, copy], reps)
    gbs = lambda ms: 2 * n * 4 / ms / 1e6
    print("\n## fused_elemwise: 6-op chain over 64 MiB: %s" % expr)
    print("| variant | ms | GB/s (read+write) | vs copy |")
    print("|---|---|---|---|")
    for name, ms in [("fused_elemwise", t[0]), ("PyTorch separate ops", t[1]), ("copy", t[2])]:
        print("| %s | %.3f | %.0f | %.0f%% |" % (name, ms, gbs(ms), 100 * t[2] / ms))
    fused()
    print("max abs diff vs PyTorch: %.1e" % (out - sep()).abs().max().item())


def bench_layer_norm(lib, torch, reps):
    F = torch.nn.functional
    print("\n## fused_add_layer_norm vs (a + b) -> layer_norm")
    print("| rows x C | fused ms | torch ms | ratio |")
    print("|---|---|---|---|")
    for R, C in [(512, 768), (4096, 1024)]:
        a, b = torch.randn(R, C, device="cuda"), torch.randn(R, C, device="cuda")
        g, be = torch.randn(C, device="cuda"), torch.randn(C, device="cuda")
        y, s = torch.empty_like(a), torch.empty_like(a)
        fused = lambda: check(cuda_iface.add_layer_norm(lib, a, b, g, be, y, s, R, C, R), "layer norm")
        ref = lambda: F.layer_norm(a + b, (C,), g, be, 1e-5)
        t = timed(torch, [fused, ref], reps)
        print("| %d x %d | %.4f | %.4f | %.2fx |" % (R, C, t[0], t[1], t[1] / t[0]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, S <= 1024")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed: nothing to compare against")
        return
    if not torch.cuda.is_available():
        print("no CUDA GPU available")
        return
    lib = cuda_iface.load()
    print("device: %s, torch %s" % (torch.cuda.get_device_name(), torch.__version__))
    reps = 10 if a.quick else 30
    bench_attention(lib, torch, [128, 512, 1024] if a.quick else [128, 512, 1024, 2048, 4096], reps)
    bench_dense(lib, torch, reps)
    bench_elemwise(lib, torch, reps)
    bench_layer_norm(lib, torch, reps)


if __name__ == "__main__":
    main()
