"""A fused float16 BERT-base encoder layer through MXNet's lib_api entry points on a GPU, against
PyTorch's eager layer and a PyTorch layer using SDPA, on the same weights.

    python3 benchmarks/bench_bert_layer_gpu.py [--batch 16] [--seq 512] [--json FILE]

The fused layer is the seven ops the fusion pass emits for a BERT-base layer, each run through the
op library's "gpu" registration the way MXNet runs it (tests/kernels/libapi_harness.py; no MXNet
needed):  fused_dense (QKV projection, 768 -> 3*768) -> fused_attention (layout packed_qkv, 12
heads) -> fused_dense (output projection) -> fused_add_layer_norm (+ the layer's input) ->
fused_dense (768 -> 3072, GELU) -> fused_dense (3072 -> 768) -> fused_add_layer_norm (+ the first
norm's output).  Every tensor float16 (LayerNorm's gamma and beta too), as PyTorch's float16 layer.
Each op's arguments are built once (OpLibrary.prepare), as an executor keeps them.

Correctness: each layer's output against a float32 evaluation of the same layer on the same
float16 weights and input; the fused layer must be within float16 tolerance of it (max |diff| <=
0.05 on these unit-variance outputs) and no farther than 2x PyTorch's eager float16 layer is.
Times: medians of CUDA events, the three layers alternating.  Exit status 1 when the check fails.
"""
import argparse
import json
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_REPO, "tests", "kernels"))
sys.path.insert(0, os.path.join(_REPO, "cuda_kernels"))

H, D, HIDDEN, FFN = 12, 64, 768, 3072


def weights(torch, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, device="cuda", generator=g) * scale).half()
    return {
        "wqkv": r(3 * HIDDEN, HIDDEN, scale=HIDDEN ** -0.5), "bqkv": r(3 * HIDDEN, scale=0.02),
        "wo": r(HIDDEN, HIDDEN, scale=HIDDEN ** -0.5), "bo": r(HIDDEN, scale=0.02),
        "g1": (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=g)).half(), "b1": r(HIDDEN, scale=0.1),
        "w1": r(FFN, HIDDEN, scale=HIDDEN ** -0.5), "bf1": r(FFN, scale=0.02),
        "w2": r(HIDDEN, FFN, scale=FFN ** -0.5), "bf2": r(HIDDEN, scale=0.02),
        "g2": (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=g)).half(), "b2": r(HIDDEN, scale=0.1),
    }


def torch_layer(torch, W, x, sdpa, dtype=None):
    """PyTorch's layer: eager attention (matmul, softmax, matmul) or SDPA."""
    F = torch.nn.functional
    if dtype is not None:
        W = {k: v.to(dtype) for k, v in W.items()}
        x = x.to(dtype)
    B, S, _ = x.shape
    qkv = F.linear(x, W["wqkv"], W["bqkv"])
    q, k, v = (t.view(B, S, H, D).transpose(1, 2) for t in qkv.split(HIDDEN, dim=-1))
    if sdpa:
        ctx = F.scaled_dot_product_attention(q, k, v)
    else:
        ctx = torch.softmax(q @ k.transpose(-1, -2) * D ** -0.5, dim=-1) @ v
    ctx = ctx.transpose(1, 2).reshape(B, S, HIDDEN)
    h1 = F.layer_norm(F.linear(ctx, W["wo"], W["bo"]) + x, (HIDDEN,), W["g1"], W["b1"], 1e-5)
    f = F.linear(F.gelu(F.linear(h1, W["w1"], W["bf1"])), W["w2"], W["bf2"])
    return F.layer_norm(f + h1, (HIDDEN,), W["g2"], W["b2"], 1e-5)


def fused_layer(torch, lib, W, x, stream):
    """The seven fused ops, prepared once; returns (run, output)."""
    B, S, _ = x.shape
    e = lambda *s: torch.empty(*s, device="cuda", dtype=torch.float16)  # noqa: E731
    qkv, ctx, proj, h1, f1, f2, out = e(B, S, 3 * HIDDEN), e(B, S, HIDDEN), e(B, S, HIDDEN), e(B, S, HIDDEN), \
        e(B, S, FFN), e(B, S, HIDDEN), e(B, S, HIDDEN)
    dense = lambda n, act="none": {"num_hidden": n, "flatten": False, "act": act}  # noqa: E731
    steps = [
        lib.prepare("fused_dense", dense(3 * HIDDEN), [x, W["wqkv"], W["bqkv"]], [qkv], "gpu", stream),
        lib.prepare("fused_attention", {"scale": D ** -0.5, "layout": "packed_qkv", "heads": H}, [qkv], [ctx],
                    "gpu", stream),
        lib.prepare("fused_dense", dense(HIDDEN), [ctx, W["wo"], W["bo"]], [proj], "gpu", stream),
        lib.prepare("fused_add_layer_norm", {"eps": 1e-5}, [proj, x, W["g1"], W["b1"]], [h1], "gpu", stream),
        lib.prepare("fused_dense", dense(FFN, "gelu_erf"), [h1, W["w1"], W["bf1"]], [f1], "gpu", stream),
        lib.prepare("fused_dense", dense(HIDDEN), [f1, W["w2"], W["bf2"]], [f2], "gpu", stream),
        lib.prepare("fused_add_layer_norm", {"eps": 1e-5}, [f2, h1, W["g2"], W["b2"]], [out], "gpu", stream),
    ]

    def run():
        for s in steps:
            s()
    return run, out


from bench_cuda import timed  # noqa: E402  (median ms per callable, CUDA events, alternating)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", help="write the rows here (JSON)")
    a = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("no CUDA GPU available")
        return 1
    from kernel_fixtures import native_module
    from libapi_harness import OpLibrary
    native = native_module()
    paths = native.build(cuda=True, gpu=True)
    os.environ.setdefault("MXFUSION_CUDA_LIB", native.library_path(cuda=True))
    lib = OpLibrary(paths[0])
    torch.backends.cuda.matmul.allow_tf32 = False
    stream = torch.cuda.current_stream().cuda_stream
    W = weights(torch)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(a.batch, a.seq, HIDDEN, device="cuda", generator=g).half()
    run, out = fused_layer(torch, lib, W, x, stream)
    eager = lambda: torch_layer(torch, W, x, sdpa=False)  # noqa: E731
    sdpa = lambda: torch_layer(torch, W, x, sdpa=True)  # noqa: E731
    run()
    ref32 = torch_layer(torch, W, x, sdpa=False, dtype=torch.float32)
    err_fused = (out.float() - ref32).abs().max().item()
    err_eager = (eager().float() - ref32).abs().max().item()
    err_sdpa = (sdpa().float() - ref32).abs().max().item()
    t = timed(torch, [run, eager, sdpa], a.reps)
    case = "fp16 B=%d S=%d" % (a.batch, a.seq)
    rows = [
        {"op": "BERT-base layer", "case": case, "fused_ms": t[0], "baseline_ms": t[1], "baseline": "PyTorch eager",
         "ratio": t[1] / t[0], "ok": t[1] / t[0] >= 1.0,
         "notes": "max|diff| vs fp32: fused %.1e, eager %.1e, sdpa %.1e" % (err_fused, err_eager, err_sdpa)},
        {"op": "BERT-base layer", "case": case, "fused_ms": t[0], "baseline_ms": t[2], "baseline": "PyTorch SDPA layer",
         "ratio": t[2] / t[0], "ok": None, "notes": ""},
    ]
    print("device: %s, torch %s" % (torch.cuda.get_device_name(), torch.__version__))
    print("| layer | case | fused ms | baseline ms | ratio | notes |")
    for r in rows:
        print("| %s | %s | %.3f | %.3f (%s) | %.2f | %s |" % (r["op"], r["case"], r["fused_ms"], r["baseline_ms"],
                                                          r["baseline"], r["ratio"], r["notes"]))
    ok = err_fused <= 0.05 and err_fused <= 2 * max(err_eager, 1e-3)
    print("outputs %s: fused max|diff| %.2e vs float32 (tolerance 0.05 and 2x eager's %.2e)" % (
        "match" if ok else "DIFFER", err_fused, err_eager))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"sections": {"bert": rows}, "check": {"ok": ok, "fused": err_fused, "eager": err_eager,
                                                             "sdpa": err_sdpa}}, fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
