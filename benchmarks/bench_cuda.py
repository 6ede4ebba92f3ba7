"""GPU benchmark of the CUDA kernels (C interface) against PyTorch, side by side in one run.

    python3 benchmarks/bench_cuda.py [--quick] [--json FILE] [--costs FILE] [--sections a,b]

Needs an NVIDIA GPU, PyTorch with CUDA, nvcc and cuBLASLt (the nvidia-cublas wheel); imports
no MXNet (the library is built from cuda_kernels/ alone, see cuda_kernels/cuda_iface.py).
Medians of CUDA-event timings, the fused op and its baselines alternating each repetition.
Sections (each returns its rows; --sections picks some):

* attention: fused_attention (fp16, bf16) vs torch scaled_dot_product_attention, S = 1024..4096,
  batch 4 (2 with --quick), 16 heads, D = 64 and 128, causal and not; target: within 1.5x;
  its backward (fp16, from the saved lse) vs SDPA's backward (no target);
* dense: fused_dense + GELU (fp16) vs torch.addmm then gelu; target: within 1.1x;
* layer_norm: fused_add_layer_norm (fp16) vs (a + b) then torch layer_norm; target: at least as fast;
* elemwise: fused_elemwise's generated (NVRTC) kernels, and the interpreter, vs PyTorch's separate
  eager ops and a device-to-device copy: the 6-op chain over 256 MiB (fp32, fp16; target >= 80 %
  of the copy's bandwidth), x0 * sigmoid(x1 + 3) and relu(x0 + x1) at 64 Mi elements (fp16, fp32),
  broadcast operands, and the backward passes vs PyTorch autograd; target >= 1.0x PyTorch.

"ratio" is baseline time / fused time (> 1: the fused op is faster); "ok" says whether the
target is met.  --json writes every row, --costs the cost-table entries (fused vs unfused time
per op, dtype, pass and case; the schema of the fusion pass's GPU cost table).  --quick fits in
about 3 minutes on an H200 (build excluded).
A machine without a GPU or PyTorch prints why and exits 0 (so scripts can call it anywhere).
"""
import argparse
import datetime
import json
import os
import statistics
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_REPO, "cuda_kernels"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cuda_iface as ci  # noqa: E402
from bench_cuda_elemwise import bench_elemwise  # noqa: E402  (the elementwise section)

ROWS = []    # every row printed: (op, case, fused ms, baseline ms, baseline, ratio, ok, notes)
COSTS = []   # cost-table entries (see cost())


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


def cost(op, dtype, pass_, case, fused_ms, unfused_ms, reference):
    """One entry of the GPU cost table: the fused op's time and that of the ops it replaces."""
    COSTS.append({"op": op, "dtype": dtype, "pass": pass_, "case": case, "fused_ms": round(fused_ms, 5),
                  "unfused_ms": round(unfused_ms, 5), "reference": reference})


def row(op, case, fused_ms, base_ms, base_name, target, extra=""):
    ratio = base_ms / fused_ms
    ok = ratio >= 1 / target if target else None
    ROWS.append((op, case, fused_ms, base_ms, base_name, ratio, ok, extra))
    print("| %s | %s | %.3f | %.3f (%s) | %.2f | %s | %s |" % (
        op, case, fused_ms, base_ms, base_name, ratio, "-" if ok is None else ("yes" if ok else "NO"), extra),
        flush=True)


def bench_attention(lib, torch, ws, seqs, batch, reps):
    F = torch.nn.functional
    H = 16
    for dtype in (torch.float16, torch.bfloat16):
        for D in (64, 128):
            for causal in (False, True):
                for S in seqs:
                    q, k, v = (torch.randn(batch, H, S, D, device="cuda", dtype=dtype) for _ in range(3))
                    o = torch.empty_like(q)
                    args = ci.attention_args(q, k, v, o, D ** -0.5, causal="exclude" if causal else "none")
                    fused = lambda: check(lib, ci.attention(lib, ws, args), "attention")  # noqa: E731
                    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
                    t = timed(torch, [fused, sdpa], reps if S <= 2048 else max(3, reps // 2))
                    fused()
                    diff = (o.float() - sdpa().float()).abs().max().item()
                    fl = 4 * batch * H * S * S * D / (2 if causal else 1)
                    row("attention", "%s D=%d S=%d%s" % (str(dtype)[6:], D, S, " causal" if causal else ""),
                        t[0], t[1], "sdpa", 1.5, "%.0f TFLOP/s, max|diff| %.1e" % (fl / t[0] / 1e9, diff))


def bench_attention_backward(lib, torch, ws, seqs, batch, reps):
    """Backward only: ours from the saved lse vs SDPA's backward (autograd.grad on a kept graph)."""
    F = torch.nn.functional
    H = 16
    for D in (64, 128):
        for causal in (False, True):
            for S in seqs:
                dt = torch.float16
                q, k, v = (torch.randn(batch, H, S, D, device="cuda", dtype=dt) for _ in range(3))
                o, dout = torch.empty_like(q), torch.randn_like(q)
                lse = torch.empty(batch * H * S, device="cuda")
                args = ci.attention_args(q, k, v, o, D ** -0.5, causal="exclude" if causal else "none", lse=lse)
                check(lib, ci.attention(lib, ws, args), "attention")
                dq, dk, dv = (torch.empty_like(q) for _ in range(3))
                g = ci.AttnGrads(dout=dout.data_ptr(), dq=dq.data_ptr(), dk=dk.data_ptr(), dv=dv.data_ptr(),
                                 req_dq=ci.REQ_WRITE, req_dk=ci.REQ_WRITE, req_dv=ci.REQ_WRITE)
                qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
                out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
                fused = lambda: check(lib, ci.attention_backward(lib, ws, args, g), "attention backward")  # noqa: E731
                ref = lambda: torch.autograd.grad(out, (qr, kr, vr), dout, retain_graph=True)  # noqa: E731
                t = timed(torch, [fused, ref], max(3, reps // 2))
                fused()
                diff = max((a.float() - b.float()).abs().max().item() for a, b in zip((dq, dk, dv), ref()))
                row("attention bwd", "fp16 D=%d S=%d%s" % (D, S, " causal" if causal else ""), t[0], t[1],
                    "sdpa bwd", None, "max|diff| %.1e" % diff)


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
        cost("fused_dense", "float16", "forward", {"M": M, "K": K, "N": N, "act": "gelu_erf"}, t[0], t[1],
             "PyTorch addmm + gelu")


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
        cost("fused_add_layer_norm", "float16", "forward", {"rows": R, "cols": C}, t[0], t[1],
             "PyTorch add + layer_norm")


def device_info(torch, lib):
    import subprocess
    driver = ""
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        pass
    rt = lib.mxf_cuda_runtime_version()   # the kernels' CUDA runtime (static), e.g. 13000 -> "13.0"
    return {"device": torch.cuda.get_device_name(), "kind": "gpu", "driver": driver,
            "cuda": "%d.%d" % (rt // 1000, rt % 1000 // 10), "date": datetime.date.today().isoformat(),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (about 3 minutes)")
    ap.add_argument("--json", help="write every row here (JSON)")
    ap.add_argument("--costs", help="write the cost-table entries here (JSON)")
    ap.add_argument("--sections", default="attention,dense,layer_norm,elemwise",
                    help="comma-separated sections to run (default: all)")
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
    info = device_info(torch, lib)
    print("device: %s, driver %s, torch %s (CUDA %s; the kernels' runtime %s), cuBLASLt %d; fused_elemwise: %s" % (
        info["device"], info["driver"], torch.__version__, torch.version.cuda, info["cuda"], lib.mxf_cublaslt_version(),
        lib.mxf_elemwise_jit_status().decode().splitlines()[0]))
    print("| op | case | fused ms | baseline ms | ratio | ok | notes |")
    print("|---|---|---|---|---|---|---|")
    reps = 10 if a.quick else 30
    seqs = [1024, 2048, 4096]
    dense_shapes = [(8192, 4096, 4096), (4096, 1024, 4096)] if a.quick else \
        [(8192, 4096, 4096), (4096, 1024, 4096), (4096, 4096, 1024), (16384, 8192, 8192)]
    sections = {
        "attention": lambda: (bench_attention(lib, torch, ws, seqs, 2 if a.quick else 4, reps),
                              bench_attention_backward(lib, torch, ws, [2048] if a.quick else seqs,
                                                       2 if a.quick else 4, reps)),
        "dense": lambda: bench_dense(lib, torch, ws, dense_shapes, reps),
        "layer_norm": lambda: bench_layer_norm(lib, torch, [(16384, 1024), (8192, 4096)] if a.quick else
                                               [(4096, 768), (16384, 1024), (8192, 4096), (32768, 8192)], reps),
        "elemwise": lambda: bench_elemwise(lib, torch, ws, reps, row, cost, timed, check),
    }
    per_section = {}
    for name in a.sections.split(","):
        start = len(ROWS)
        try:
            sections[name]()
        except Exception as e:  # a section that fails still leaves the others' rows
            print("section %s failed: %s: %s" % (name, type(e).__name__, e), flush=True)
            per_section[name + " (failed)"] = []
        per_section[name] = ROWS[start:]
    missed = [r for r in ROWS if r[6] is False]
    print("\n%d of %d rows with a target meet it" % (sum(1 for r in ROWS if r[6]), sum(1 for r in ROWS
                                                                                    if r[6] is not None)))
    for r in missed:
        print("target missed: %s %s (ratio %.2f)" % (r[0], r[1], r[5]))
    keys = ("op", "case", "fused_ms", "baseline_ms", "baseline", "ratio", "ok", "notes")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(info, sections={k: [dict(zip(keys, r)) for r in v] for k, v in per_section.items()}),
                      fh, indent=1)
    if a.costs:
        with open(a.costs, "w") as fh:
            json.dump(dict(info, entries=COSTS), fh, indent=1)
    if any(k.endswith("(failed)") for k in per_section):
        sys.exit(1)


if __name__ == "__main__":
    main()
