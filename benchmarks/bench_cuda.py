"""GPU benchmark of the CUDA kernels (C interface) against PyTorch, side by side in one run.

    python3 benchmarks/bench_cuda.py [--quick]

Needs an NVIDIA GPU, PyTorch with CUDA, nvcc and cuBLASLt (the nvidia-cublas wheel); imports
no MXNet (the library is built from cuda_kernels/ alone, see cuda_kernels/cuda_iface.py).
Medians of CUDA-event timings, the fused op and its baselines alternating each repetition:

* fused_attention (fp16, bf16) vs torch scaled_dot_product_attention, S = 1024..4096,
  batch 4 (2 with --quick), 16 heads, D = 64 and 128, causal and not; target: within 1.5x;
* fused_attention backward (fp16, from the saved lse) vs SDPA's backward (no target);
* fused_dense + GELU (fp16) vs torch.addmm then gelu; target: within 1.1x;
* fused_add_layer_norm (fp16) vs (a + b) then torch layer_norm; target: at least as fast;
* fused_elemwise 6-op chain (fp32, fp16) over 256 MiB of output vs a device-to-device copy
  of the same bytes (read + write); target: >= 80 % of the copy's bandwidth.

"ratio" is baseline time / fused time (> 1: the fused op is faster); "ok" says whether the
target is met.  --quick fits in about 3 minutes on an H200 (build excluded).
A machine without a GPU or PyTorch prints why and exits 0 (so scripts can call it anywhere).
"""
import argparse
import ctypes
import os
import statistics
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_REPO, "cuda_kernels"))

import cuda_iface as ci  # noqa: E402

ROWS = []


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


def check(lib, rc, what):
    if rc != 0:
        raise RuntimeError("%s failed: %s" % (what, ci.error(lib, rc)))


def row(op, case, fused_ms, base_ms, base_name, target, extra=""):
    ratio = base_ms / fused_ms
    ok = ratio >= 1 / target if target else None
    ROWS.append((op, case, fused_ms, base_ms, base_name, ratio, ok, extra))
    print("| %s | %s | %.3f | %.3f (%s) | %.2f | %s | %s |" % (
        op, case, fused_ms, base_ms, base_name, ratio, "-" if ok is None else ("yes" if ok else "NO"), extra),
        flush=True)


# ---------------------------------------------------------------------------- attention
# Shapes (B, H, Sq, Sk, D, causal): the BERT ones, then long sequences.  Targets: fp16 / bf16 forward
# >= 0.9x SDPA's speed, backward >= 0.8x SDPA's backward; fp32 >= 1.0x the unfused cuBLAS path
# (matmul -> softmax -> matmul, TF32 off), forward and backward.
ATTN_BERT = [(32, 12, 128, 128, 64, False), (8, 16, 512, 512, 64, False)]
ATTN_LONG = [(2, 16, S, S, D, c) for D in (64, 128) for c in (False, True) for S in (1024, 2048, 4096)]
ATTN_FP32_LONG = [(4, 16, 2048, 2048, 128, False), (2, 16, 1024, 1024, 64, True)]
ATTN_TARGET = {("float16", "forward"): 0.9, ("bfloat16", "forward"): 0.9, ("float16", "backward"): 0.8,
               ("bfloat16", "backward"): 0.8, ("float32", "forward"): 1.0, ("float32", "backward"): 1.0}
ATTN_ROWS = []   # one per measured case, for the compact table and the cost table
COST = []        # cost-table entries (schema in benchmarks/README / the cost-table loader)


def _attn_unfused(torch, q, k, v, scale, causal):
    """The unfused graph's path: matmul -> (mask) -> softmax -> matmul, in q's dtype."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        Sq, Sk = s.shape[-2], s.shape[-1]
        band = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril(Sk - Sq)
        s = s.masked_fill(~band, float("-inf"))
    return torch.matmul(torch.softmax(s, -1), v)


def _attn_case(lib, torch, ws, dtype, shape, reps, backends, bwd):
    """Times one shape: ours per backend, SDPA (fp16 / bf16), the unfused path; forward and backward."""
    F = torch.nn.functional
    B, H, Sq, Sk, D, causal = shape
    dt = getattr(torch, dtype)
    q = torch.randn(B, H, Sq, D, device="cuda", dtype=dt)
    k, v = (torch.randn(B, H, Sk, D, device="cuda", dtype=dt) for _ in range(2))
    o, dout = torch.empty_like(q), torch.randn_like(q)
    lse = torch.empty(B * H * Sq, device="cuda")
    scale = D ** -0.5
    name = "B%d H%d S%d%s D%d%s" % (B, H, Sq, "" if Sq == Sk else "/%d" % Sk, D, " causal" if causal else "")
    r = reps if Sq * Sk <= 2048 * 2048 else max(3, reps // 2)
    cases = {}
    for be in backends:
        args = ci.attention_args(q, k, v, o, scale, causal="exclude" if causal else "none", lse=lse)
        args.backend = ci.BACKENDS[be]
        chosen, why = ci.attention_backend(lib, args)
        if chosen != be:
            print("  %s %s %s: backend %s not available (%s)" % (dtype, name, be, be, why), flush=True)
            continue
        cases[be] = args
    sdpa = (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)) \
        if dtype != "float32" else None
    unf = lambda: _attn_unfused(torch, q, k, v, scale, causal)  # noqa: E731
    fns = [(lambda a=a: check(lib, ci.attention(lib, ws, a), "attention")) for a in cases.values()]
    refs = ([sdpa] if sdpa else []) + [unf]
    t = timed(torch, fns + refs, r, warmup=2)
    sdpa_ms = t[len(fns)] if sdpa else None
    unf_ms = t[-1]
    want = (sdpa or unf)().float()
    for (be, a), ms in zip(cases.items(), t):
        check(lib, ci.attention(lib, ws, a), "attention")
        diff = (o.float() - want).abs().max().item()
        _attn_row(dtype, "forward", name, shape, be, ms, sdpa_ms, unf_ms, diff)
    if not bwd:
        return
    # backward: ours from the saved lse; SDPA's and the unfused path's autograd backward on kept graphs
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    outs = []
    if sdpa:
        outs.append(F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, scale=scale))
    outs.append(_attn_unfused(torch, qr, kr, vr, scale, causal))
    refs = [(lambda out=out: torch.autograd.grad(out, (qr, kr, vr), dout, retain_graph=True)) for out in outs]
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    g = ci.AttnGrads(dout=dout.data_ptr(), dq=dq.data_ptr(), dk=dk.data_ptr(), dv=dv.data_ptr(),
                     req_dq=ci.REQ_WRITE, req_dk=ci.REQ_WRITE, req_dv=ci.REQ_WRITE)
    bfns, bnames = [], []
    for be, a in cases.items():
        check(lib, ci.attention(lib, ws, a), "attention")  # lse of this backend's forward
        chosen, why = ci.attention_backend(lib, a, backward=True)
        if chosen != be:  # e.g. the fp32 products have no backward: the call runs what AUTO picks
            b = ci.AttnArgs()
            ctypes.memmove(ctypes.byref(b), ctypes.byref(a), ctypes.sizeof(a))
            b.backend = ci.BACKENDS["auto"]
            chosen, _ = ci.attention_backend(lib, b, backward=True)
            print("  %s %s %s backward: runs %s (%s)" % (dtype, name, be, chosen, why), flush=True)
            if chosen in bnames:
                continue
            a, be = b, chosen
        bfns.append(lambda a=a: check(lib, ci.attention_backward(lib, ws, a, g), "attention backward"))
        bnames.append(be)
    t = timed(torch, bfns + refs, max(3, r // 2), warmup=1)
    sdpa_ms = t[len(bfns)] if sdpa else None
    unf_ms = t[-1]
    want = refs[0]()
    for be, f, ms in zip(bnames, bfns, t):
        f()
        diff = max((x.float() - y.float()).abs().max().item() for x, y in zip((dq, dk, dv), want))
        _attn_row(dtype, "backward", name, shape, be, ms, sdpa_ms, unf_ms, diff)


def _attn_row(dtype, pas, name, shape, backend, ms, sdpa_ms, unf_ms, diff):
    base = unf_ms if dtype == "float32" else sdpa_ms
    target = ATTN_TARGET[(dtype, pas)]
    ratio = base / ms
    ATTN_ROWS.append((dtype, pas, name, backend, ms, sdpa_ms, unf_ms, ratio, target, ratio >= target, diff))
    print("| %s | %s | %s | %s | %.3f | %s | %.3f | %.2f (%s >= %.1f) | %s | %.1e |" % (
        dtype, pas, name, backend, ms, "-" if sdpa_ms is None else "%.3f" % sdpa_ms, unf_ms, ratio,
        "unfused/fused" if dtype == "float32" else "sdpa/fused", target, "yes" if ratio >= target else "NO", diff),
        flush=True)
    B, H, Sq, Sk, D, causal = shape
    COST.append({"op": "fused_attention", "dtype": dtype, "pass": pas,
                 "case": {"B": B, "H": H, "Sq": Sq, "Sk": Sk, "D": D, "causal": causal, "mask": "none",
                          "backend": {"gemm": "gemm_softmax"}.get(backend, backend)},
                 "fused_ms": round(ms, 4), "unfused_ms": round(unf_ms, 4), "reference": "unfused cuBLAS path",
                 "sdpa_ms": None if sdpa_ms is None else round(sdpa_ms, 4)})


def bench_attention_all(lib, torch, ws, reps, quick):
    """fused_attention per backend vs SDPA vs the unfused path, fp32 / fp16 / bf16, forward and
    backward; prints its rows, then a compact table against the targets."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print("\n| dtype | pass | case | backend | fused ms | sdpa ms | unfused ms | ratio (target) | ok | max diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    longs = [sh for sh in ATTN_LONG if not quick or sh[2] != 2048]  # --quick: S = 1024 and 4096
    for dtype in ("float16", "bfloat16"):
        for shape in ATTN_BERT + longs:
            bwd = True
            _attn_case(lib, torch, ws, dtype, shape, reps, ("cudnn", "own"), bwd)
    for shape in ATTN_BERT + ATTN_FP32_LONG:
        _attn_case(lib, torch, ws, "float32", shape, reps, ("gemm", "own") if shape[2] <= 512 else ("gemm",), True)
    print("\nattention targets (best backend per case):")
    best = {}
    for r in ATTN_ROWS:
        key = r[:3]
        if key not in best or r[7] > best[key][7]:
            best[key] = r
    held = sum(1 for r in best.values() if r[9])
    for r in best.values():
        if not r[9]:
            print("  target missed: %s %s %s: best %s %.2f < %.1f" % (r[0], r[1], r[2], r[3], r[7], r[8]))
    print("  %d of %d cases meet their target" % (held, len(best)))


def write_cost_table(torch, path):
    import datetime
    import json
    import subprocess
    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             stdout=subprocess.PIPE, text=True, timeout=20).stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001 -- the table is still useful without it
        drv = "unknown"
    table = {"device": torch.cuda.get_device_name(), "kind": "gpu", "driver": drv, "cuda": str(torch.version.cuda),
             "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv), "entries": COST}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(table, fh, indent=1)
    print("cost table (%d entries) written to %s" % (len(COST), path))


def bench_dense(lib, torch, ws, shapes, reps):
    F = torch.nn.functional
    for M, K, N in shapes:
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        w = torch.randn(N, K, device="cuda", dtype=torch.float16) * K ** -0.5
        b = torch.randn(N, device="cuda", dtype=torch.float16)
        y = torch.empty(M, N, device="cuda", dtype=torch.float16)
        fused = lambda: check(lib, ci.dense(lib, ws, x, w, b, y, M, N, K, "gelu_erf"), "dense")  # noqa: E731
        ref = lambda: F.gelu(torch.addmm(b, x, w.t()))  # noqa: E731
        t = timed(torch, [fused, ref], reps)
        fused()
        diff = (y.float() - ref().float()).abs().max().item()
        row("dense+gelu", "fp16 %dx%d->%d" % (M, K, N), t[0], t[1], "addmm+gelu", 1.1,
            "%.0f TFLOP/s, max|diff| %.1e" % (2 * M * N * K / t[0] / 1e9, diff))


def bench_layer_norm(lib, torch, shapes, reps):
    F = torch.nn.functional
    for R, C in shapes:
        a, b = (torch.randn(R, C, device="cuda", dtype=torch.float16) for _ in range(2))
        g, be = (torch.randn(C, device="cuda", dtype=torch.float16) for _ in range(2))
        y = torch.empty_like(a)
        fused = lambda: check(lib, ci.add_layer_norm(lib, a, b, g, be, y, None, R, C, R), "layer norm")  # noqa: E731
        ref = lambda: F.layer_norm(a + b, (C,), g, be, 1e-5)  # noqa: E731
        t = timed(torch, [fused, ref], reps)
        fused()
        diff = (y.float() - ref().float()).abs().max().item()
        gbs = 3 * R * C * 2 / t[0] / 1e6
        row("add+layer_norm", "fp16 %dx%d" % (R, C), t[0], t[1], "add+layer_norm", 1.0,
            "%.0f GB/s, max|diff| %.1e" % (gbs, diff))


def bench_elemwise(lib, torch, reps):
    expr = "mul(sigmoid(add(mul(x0, 1.5), 0.5)), tanh(sub(x0, 0.25)))"
    for dtype in (torch.float32, torch.float16):
        n = (256 << 20) // (4 if dtype == torch.float32 else 2)
        x = torch.randn(n, device="cuda", dtype=dtype)
        out, dst = torch.empty_like(x), torch.empty_like(x)
        fused = lambda: check(lib, ci.elemwise(lib, expr, [x], out)[0], "elemwise")  # noqa: E731
        copy = lambda: dst.copy_(x)  # noqa: E731
        sep = lambda: torch.sigmoid(x * 1.5 + 0.5) * torch.tanh(x - 0.25)  # noqa: E731
        t = timed(torch, [fused, copy, sep], reps)
        fused()
        diff = (out.float() - sep().float()).abs().max().item()
        gbs = 2 * n * x.element_size() / t[0] / 1e6
        # target: >= 80 % of the copy's bandwidth, i.e. copy / fused >= 0.8
        row("elemwise", "%s 6 ops, 256 MiB" % str(dtype)[6:], t[0], t[1], "d2d copy", 1.25,
            "%.0f GB/s = %.0f%% of copy; PyTorch ops %.3f ms; max|diff| %.1e" % (gbs, 100 * t[1] / t[0], t[2], diff))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (about 3 minutes)")
    ap.add_argument("--cost-table", help="where the attention cost table (JSON) goes "
                    "(default: $OUT/gpu-check/cost_table_attention.json, else out/gpu-check/)")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed: nothing to compare against")
        return
    if not torch.cuda.is_available():
        print("no CUDA GPU available")
        return
    lib = ci.load()
    ws = ci.Workspace(torch)
    torch.backends.cuda.matmul.allow_tf32 = False
    print("device: %s, torch %s, cuBLASLt %d" % (torch.cuda.get_device_name(), torch.__version__,
                                                  lib.mxf_cublaslt_version()))
    print("| op | case | fused ms | baseline ms | ratio | ok | notes |")
    print("|---|---|---|---|---|---|---|")
    reps = 10 if a.quick else 30
    seqs = [1024, 2048, 4096]
    print("cuDNN (fused attention): %s" % (lib.mxf_cudnn_version() or "not loaded"))
    bench_attention_all(lib, torch, ws, reps, a.quick)
    write_cost_table(torch, a.cost_table or os.path.join(os.environ.get("OUT") or os.path.join(_REPO, "out"),
                                                         "gpu-check", "cost_table_attention.json"))
    dense_shapes = [(8192, 4096, 4096), (4096, 1024, 4096)] if a.quick else \
        [(8192, 4096, 4096), (4096, 1024, 4096), (4096, 4096, 1024), (16384, 8192, 8192)]
    bench_dense(lib, torch, ws, dense_shapes, reps)
    bench_layer_norm(lib, torch, [(16384, 1024), (8192, 4096)] if a.quick else
                     [(4096, 768), (16384, 1024), (8192, 4096), (32768, 8192)], reps)
    bench_elemwise(lib, torch, reps)
    missed = [r for r in ROWS if r[6] is False]
    print("\n%d of %d rows meet their target" % (sum(1 for r in ROWS if r[6]), len(ROWS)))
    for r in missed:
        print("target missed: %s %s (ratio %.2f)" % (r[0], r[1], r[5]))


if __name__ == "__main__":
    main()
