"""BERT-base encoder in bfloat16: fused bf16 vs MXNet's own AMP bf16, and both in float32.

    python benchmarks/bench_precision.py [--layers 12] [--seqs 128] [--repeats 7] [--blocks 3]

The encoder of ``bench_bert.py`` (``builtin`` variant: LayerNorm and LeakyReLU(gelu) ops,
random weights, batch 1) is timed in one process, round-robin:

* ``mx fp32``: MXNet's default bind (oneDNN subgraph backend on) of the float32 model;
* ``mx amp bf16``: ``mx.contrib.amp.convert_model(sym, args, aux, target_dtype="bfloat16",
  cast_optional_params=True)``, default bind;
* ``fused fp32``: ``fusion.fuse(sym, args, aux)``;
* ``fused bf16``: ``fusion.fuse(sym, args, aux, precision="bf16")`` (``force=True`` on a CPU
  without native bfloat16, where the figures then say so);
* ``amp+fused`` (``--amp-then-fuse``): the AMP model passed through ``fusion.fuse`` (its float32
  parts fuse, its bfloat16 parts stay MXNet's).

Printed per system: the median of ``blocks × repeats`` timed runs, the p10–p90 spread, the
speed-up over MXNet fp32 and over AMP bf16, the same for the best run (on a shared machine the
best run is the one least disturbed by others), and the max relative error of its output
against MXNet fp32 (``max|Δ| / max|ref|``) on the same input.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fusion import _env  # noqa: E402

_env.configure_threads()

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402

import fusion  # noqa: E402
from fusion.bench import executor, time_samples  # noqa: E402
from fusion.precision import BF16, native_bf16_reason, to_bf16  # noqa: E402
from fusion.verify import run as run_model  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_bert import encoder, random_weights  # noqa: E402


def amp_bf16(sym, arg):
    from mxnet.contrib import amp
    # on copies: convert_model replaces entries of the dict it is given with their bf16 casts
    return amp.convert_model(sym, {k: v.copy() for k, v in arg.items()}, {}, target_dtype="bfloat16",
                             cast_optional_params=True)


def run(seq, args):
    hidden, heads, ffn = 768, 12, 3072
    sym = encoder(args.layers, hidden, heads, ffn, written=False)
    arg = {k: mx.nd.array(v) for k, v in random_weights(sym, seq, hidden).items()}
    x = np.random.default_rng(1).standard_normal((1, seq, hidden)).astype(np.float32)
    inputs = {"data": x}
    models, fuse_s = {}, {}
    models["mx fp32"] = (sym, arg, {})
    models["mx amp bf16"] = amp_bf16(sym, arg)
    for name, precision in (("fused fp32", "float32"), ("fused bf16", "bf16")):
        t0 = time.perf_counter()
        r = fusion.fuse(sym, arg, {}, input_shapes={"data": x.shape}, precision=precision, force=True)
        fuse_s[name] = time.perf_counter() - t0
        models[name] = (r.symbol, r.arg_params, r.aux_params)
    if args.amp_then_fuse:
        r = fusion.fuse(*models["mx amp bf16"], input_shapes={"data": x.shape})
        models["amp+fused"] = (r.symbol, r.arg_params, r.aux_params)
    ref = run_model(sym, arg, {}, inputs, subgraph=True)[0]
    errs = {}
    for name, (s, a, x_aux) in models.items():
        out = run_model(s, a, x_aux, inputs, subgraph=True)[0].astype(np.float32)
        errs[name] = float(np.abs(out - ref).max() / np.abs(ref).max())
    systems = {name: executor(s, a, x_aux, inputs) for name, (s, a, x_aux) in models.items()}
    samples = {k: [] for k in systems}
    for _ in range(args.blocks):
        for k, v in time_samples(systems, repeats=args.repeats, warmup=1).items():
            samples[k] += v
    return samples, errs, fuse_s


def gemms(args):
    """fused_dense alone, float32 vs bfloat16 weight, on BERT-base's layer shapes (M = seq rows)."""
    rng = np.random.default_rng(0)
    print("\nfused_dense alone (bias, no activation), executor, medians of %d×%d interleaved runs"
          % (args.blocks, args.repeats))
    print("%-18s %10s %10s %10s %10s %8s | %10s %10s %8s" % ("M x K -> N", "fp32 ms", "bf16 ms", "fp32 GF/s",
                                                         "bf16 GF/s", "speedup", "best fp32", "best bf16", "speedup"))
    for m in (int(s) for s in args.seqs.split(",")):
        for k, n in ((768, 768), (768, 3072), (3072, 768)):
            x = mx.nd.array(rng.standard_normal((m, k)).astype(np.float32))
            w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
            b = mx.nd.array(rng.standard_normal(n).astype(np.float32))
            runs = {}
            for name, wv, dt in (("fp32", mx.nd.array(w), np.float32), ("bf16", mx.nd.array(to_bf16(w), dtype=BF16), BF16)):
                s = mx.sym.fused_dense(mx.sym.var("x"), mx.sym.var("w", dtype=dt), mx.sym.var("b"), num_hidden=n)
                runs[name] = executor(s, {"w": wv, "b": b}, {}, {"x": x})
            samples = {k2: [] for k2 in runs}
            for _ in range(args.blocks):
                for k2, v in time_samples(runs, repeats=args.repeats * 5, warmup=2).items():
                    samples[k2] += v
            med = {k2: statistics.median(v) for k2, v in samples.items()}
            best = {k2: min(v) for k2, v in samples.items()}
            flop = 2.0 * m * k * n
            print("%-18s %10.3f %10.3f %10.0f %10.0f %7.2fx | %10.0f %10.0f %7.2fx" % (
                "%d x %d -> %d" % (m, k, n), 1e3 * med["fp32"], 1e3 * med["bf16"], flop / med["fp32"] / 1e9,
                flop / med["bf16"] / 1e9, med["fp32"] / med["bf16"], flop / best["fp32"] / 1e9,
                flop / best["bf16"] / 1e9, best["fp32"] / best["bf16"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12, help="encoder layers (0: only --gemm)")
    ap.add_argument("--seqs", default="128")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per block and system")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--gemm", action="store_true", help="also time fused_dense alone on BERT's layer shapes")
    ap.add_argument("--amp-then-fuse", action="store_true", help="also time the AMP model after fusion.fuse")
    args = ap.parse_args()
    why = native_bf16_reason()
    print("mxnet %s, OMP_NUM_THREADS=%s, %d layers, batch 1, hidden 768, 12 heads; bf16 %s"
          % (mx.__version__, os.environ.get("OMP_NUM_THREADS"), args.layers,
             "native" if why is None else "EMULATED (%s)" % why))
    for seq in (int(s) for s in args.seqs.split(",")) if args.layers > 0 else ():
        samples, errs, fuse_s = run(seq, args)
        med = {k: 1e3 * statistics.median(v) for k, v in samples.items()}
        print("\nseq %d (medians of %d×%d runs, interleaved)" % (seq, args.blocks, args.repeats))
        best = {k: 1e3 * min(v) for k, v in samples.items()}
        print("%-12s %9s %17s %9s %9s | %8s %9s %9s | %9s" % (
            "system", "median ms", "p10-p90 ms", "vs fp32", "vs amp", "best ms", "vs fp32", "vs amp", "rel err"))
        for k, v in samples.items():
            q = np.percentile(np.array(v) * 1e3, [10, 90])
            print("%-12s %9.1f %8.1f-%-8.1f %8.2fx %8.2fx | %8.1f %8.2fx %8.2fx | %9.1e" % (
                k, med[k], q[0], q[1], med["mx fp32"] / med[k], med["mx amp bf16"] / med[k],
                best[k], best["mx fp32"] / best[k], best["mx amp bf16"] / best[k], errs[k]))
        print("fuse time: %s" % ", ".join("%s %.1f s" % kv for kv in fuse_s.items()))
    if args.gemm:
        gemms(args)
    print("vs X: time of X / time of the system (higher is faster); best: fastest single run; "
          "rel err: max|Δ|/max|ref| against mx fp32")


if __name__ == "__main__":
    main()
