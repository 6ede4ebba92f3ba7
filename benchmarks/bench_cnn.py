"""Benchmark BatchNorm folding on model-zoo CNNs, and the cost of ``fuse()`` itself on large graphs.

    python benchmarks/bench_cnn.py [--models resnet18_v1,densenet121] [--repeats 30]
                                   [--sizes 1000,10000,100000] [--skip-models] [--skip-scaling]

Part 1: batch 1 at 224×224 (299×299 for Inception-v3), random weights and
randomized BatchNorm statistics.  The original and the fused model are bound
in the same process and timed round-robin (``fusion.check.bench.time_interleaved``,
medians), each once with MXNet's default bind (oneDNN subgraph backend on) and
once with the subgraph backend off.  Ratios above 1 mean the fused model is
faster:

* ``fused/default``  original (default bind) ÷ fused (default bind)
* ``vs sg-off``      original (subgraph off) ÷ fused (default bind)
* ``both off``       original (subgraph off) ÷ fused (subgraph off)

Part 2: seconds of ``fuse()`` on synthetic chains of Conv→BN→relu and
Conv→BN→add→relu blocks written directly as Symbol JSON, with 1×1 weights and
BN statistics as small NumPy arrays so that every block really folds.  Building
the same graph with ``mx.sym`` is timed for comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from fusion.native.env import configure_threads  # noqa: E402  (must run before mxnet is imported)

configure_threads()

import numpy as np  # noqa: E402

import fusion  # noqa: E402
from fusion.check.bench import fused_vs_original  # noqa: E402
from fusion.testing import zoo_model  # noqa: E402
from fusion.check.verify import random_inputs  # noqa: E402

MODELS = ("resnet18_v1", "resnet50_v1", "mobilenetv2_1.0", "densenet121", "inceptionv3",
          "squeezenet1.0", "vgg11_bn")
SIZES = (1000, 10000, 100000)


# ---------------------------------------------------------------------------- part 1: latency
def bench_model(name: str, repeats: int) -> dict:
    size = 299 if name.startswith("inception") else 224
    shape = (1, 3, size, size)
    sym, arg, aux = zoo_model(name, shape, seed=0)
    result = fusion.fuse(sym, arg, aux)
    check = fusion.verify((sym, arg, aux), result, input_shapes={"data": shape})
    t = fused_vs_original(sym, arg, aux, result, random_inputs(sym, arg, {"data": shape}), repeats)
    t = {"orig": t["original"], "fused": t["fused"], "orig_off": t["original_no_subgraph"],
         "fused_off": t["fused_no_subgraph"]}
    rep = result.report
    return {"model": name, "size": size, "folded": rep.fused_count, "ops": (rep.ops_before, rep.ops_after),
            "max_rel": check.max_rel, "ms": {k: v * 1e3 for k, v in t.items()}}


def print_models(rows) -> None:
    print("%-16s %4s %6s %11s %9s | %9s %9s %9s %9s | %9s %9s %9s"
          % ("model", "in", "folded", "ops", "max rel", "orig ms", "fused ms", "orig-off", "fused-off",
             "fused/def", "vs sg-off", "both off"))
    for r in rows:
        ms = r["ms"]
        print("%-16s %4d %6d %5d->%-5d %9.1e | %9.2f %9.2f %9.2f %9.2f | %8.2fx %8.2fx %8.2fx"
              % (r["model"], r["size"], r["folded"], r["ops"][0], r["ops"][1], r["max_rel"],
                 ms["orig"], ms["fused"], ms["orig_off"], ms["fused_off"],
                 ms["orig"] / ms["fused"], ms["orig_off"] / ms["fused"], ms["orig_off"] / ms["fused_off"]))


# ---------------------------------------------------------------------------- part 2: fuse() scaling
def synthetic_graph(target_nodes: int, channels: int = 4, seed: int = 0):
    """Symbol JSON dict plus arg/aux params (NumPy) of about ``target_nodes`` nodes.

    Blocks alternate ``relu(BN(conv(x)))`` (9 nodes with its variables) and
    ``relu(BN(conv(x)) + x)`` (10 nodes): every block is one Conv-BN fold.
    """
    rng = np.random.default_rng(seed)
    nodes, arg, aux = [{"op": "null", "name": "data", "inputs": []}], {}, {}
    x = 0

    def var(name, value, store):
        nodes.append({"op": "null", "name": name, "inputs": []})
        store[name] = value
        return len(nodes) - 1

    def node(op, name, inputs, attrs=None):
        nd = {"op": op, "name": name, "inputs": [[i, 0, 0] for i in inputs]}
        if attrs:
            nd["attrs"] = attrs
        nodes.append(nd)
        return len(nodes) - 1

    k = 0
    while len(nodes) < target_nodes:
        p = "b%d_" % k
        w = var(p + "conv_weight", (rng.standard_normal((channels, channels, 1, 1)) * 0.5).astype(np.float32), arg)
        b = var(p + "conv_bias", rng.normal(0, 0.1, channels).astype(np.float32), arg)
        c = node("Convolution", p + "conv", [x, w, b], {"kernel": "(1, 1)", "num_filter": str(channels)})
        bn_in = [var(p + "bn_gamma", rng.uniform(0.5, 1.5, channels).astype(np.float32), arg),
                 var(p + "bn_beta", rng.normal(0, 0.1, channels).astype(np.float32), arg),
                 var(p + "bn_moving_mean", rng.normal(0, 0.1, channels).astype(np.float32), aux),
                 var(p + "bn_moving_var", rng.uniform(0.5, 1.5, channels).astype(np.float32), aux)]
        y = node("BatchNorm", p + "bn", [c] + bn_in, {"eps": "1e-05", "fix_gamma": "False"})
        if k % 2:
            y = node("elemwise_add", p + "add", [y, x])
        x = node("Activation", p + "relu", [y], {"act_type": "relu"})
        k += 1
    data = {"nodes": nodes, "arg_nodes": [i for i, n in enumerate(nodes) if n["op"] == "null"],
            "node_row_ptr": list(range(len(nodes) + 1)), "heads": [[x, 0, 0]],
            "attrs": {"mxnet_version": ["int", 10901]}}
    return data, arg, aux, k


def mxsym_build_seconds(blocks: int, channels: int = 4) -> float:
    """Seconds to build the same chain with ``mx.sym`` and serialize it to JSON."""
    import mxnet as mx

    t = time.perf_counter()
    x = mx.sym.Variable("data")
    for k in range(blocks):
        p = "b%d_" % k
        y = mx.sym.BatchNorm(mx.sym.Convolution(x, kernel=(1, 1), num_filter=channels, name=p + "conv"),
                             eps=1e-5, fix_gamma=False, name=p + "bn")
        if k % 2:
            y = mx.sym.elemwise_add(y, x, name=p + "add")
        x = mx.sym.Activation(y, act_type="relu", name=p + "relu")
    x.tojson()
    return time.perf_counter() - t


def bench_scaling(sizes, mxsym_limit: int, verify_limit: int = 20000) -> None:
    print("%9s %7s %7s %15s %10s %7s %9s %10s %9s"
          % ("nodes", "blocks", "folded", "ops", "fuse() s", "passes", "us/node", "mx.sym s", "max rel"))
    for n in sizes:
        data, arg, aux, blocks = synthetic_graph(n)
        t = time.perf_counter()
        result = fusion.fuse(data, arg, aux)
        seconds = time.perf_counter() - t
        rep = result.report
        build = "%.2f" % mxsym_build_seconds(blocks) if len(data["nodes"]) <= mxsym_limit else "-"
        err = "-"
        if len(data["nodes"]) <= verify_limit:   # the chain has no normalization between blocks: check small ones
            import mxnet as mx
            sym = mx.sym.load_json(json.dumps(data))
            err = "%.1e" % fusion.verify((sym, arg, aux), result, input_shapes={"data": (1, 4, 8, 8)}).max_rel
        print("%9d %7d %7d %7d->%-7d %10.2f %7d %9.1f %10s %9s"
              % (len(data["nodes"]), blocks, rep.fused_count, rep.ops_before, rep.ops_after, seconds,
                 rep.passes, seconds / len(data["nodes"]) * 1e6, build, err))
        assert rep.fused_count == blocks, "expected every block to fold"
        sys.stdout.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated model-zoo names")
    ap.add_argument("--repeats", type=int, default=30, help="timed rounds per model (default 30)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="node counts of the synthetic graphs")
    ap.add_argument("--mxsym-limit", type=int, default=200000,
                    help="time building with mx.sym only up to this many nodes (default 200000)")
    ap.add_argument("--skip-models", action="store_true")
    ap.add_argument("--skip-scaling", action="store_true")
    args = ap.parse_args(argv)

    import mxnet as mx
    print("mxnet %s, OMP_NUM_THREADS=%s, MXNET_CPU_PARALLEL_SIZE=%s, %d cores available"
          % (mx.__version__, os.environ.get("OMP_NUM_THREADS"), os.environ.get("MXNET_CPU_PARALLEL_SIZE"),
             len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()))
    if not args.skip_models:
        print("\n== latency, batch 1, median of %d interleaved rounds (ms) ==" % args.repeats)
        rows = []
        for name in [m for m in args.models.split(",") if m]:
            rows.append(bench_model(name, args.repeats))
            print("  done %s" % name, file=sys.stderr)
        print_models(rows)
        print("fused/def = orig/fused (both default bind); vs sg-off = orig(subgraph off)/fused(default); "
              "both off = orig/fused with the subgraph backend off")
    if not args.skip_scaling:
        print("\n== fuse() on synthetic Conv-BN-relu(-add) chains (Symbol JSON dict in, Symbol out) ==")
        bench_scaling([int(s) for s in args.sizes.split(",") if s], args.mxsym_limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
