"""GluonCV-style CNNs (SE blocks, hard-swish, dense concatenation): fused vs MXNet's default bind.

    python benchmarks/bench_cnn_blocks.py [--models se_resnext50_32x4d,mobilenetv3_large]
                                          [--repeats 30] [--rounds 1]

Batch 1 at 224×224, random weights and randomized BatchNorm statistics.  The networks
are written as GluonCV writes them (``fusion/testing/gluoncv.py``; DenseNet-121 and
ResNet-50 are MXNet's model zoo, which GluonCV's equal).  Original and fused model are
bound in the same process with MXNet's default bind (its oneDNN subgraph backend on,
which fuses conv+BN+ReLU(+add) itself) and timed round-robin; per model the median and
the p10–p90 spread of each, and ``speed-up`` = original median ÷ fused median.  With
``--rounds R`` the whole comparison is repeated R times and every round printed (the
machines are shared: look at the spread across rounds).  Every fused model is verified
against the original first (max relative error, ``fusion.verify``).  ``MODEL+RULES`` fuses
with opt-in rules besides the default ones (``densenet121+dense_concat``).

``--no-input-shapes`` fuses each model twice, with ``input_shapes`` and without (the README's
first example), prints how many rewrites each made and how many more the report says input shapes
would allow, verifies the model fused without shapes at 224×224 batch 1 and at 2×3×160×192
(DenseNet: 2×3×240×232), and
times the original and both fused models round-robin.

``--dense-blocks`` times DenseNet-121's four dense blocks alone instead (MXNet's model zoo
block, C0/H/L = 64/56/6, 128/28/12, 256/14/24, 512/7/16, batch 1): each block as MXNet's
default bind runs it against the block fused (``fused_dense_block``).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from fusion.native.env import configure_threads  # noqa: E402  (must run before mxnet is imported)

configure_threads()

import numpy as np  # noqa: E402

import fusion  # noqa: E402
from fusion.check.bench import executor, time_samples  # noqa: E402
from fusion.testing import zoo_model  # noqa: E402
from fusion.testing.gluoncv import MODELS as GLUONCV  # noqa: E402
from fusion.testing.gluoncv import gluoncv_model  # noqa: E402
from fusion.check.verify import random_inputs  # noqa: E402

MODELS = ("se_resnext50_32x4d", "resnest50", "mobilenetv3_large", "densenet121", "densenet121+dense_concat", "resnet50_v1",
          "se_resnet50_v1")
ZOO = ("densenet121", "resnet50_v1", "resnet18_v1", "mobilenetv2_1.0")
SHAPE = (1, 3, 224, 224)
DENSE_BLOCKS = ((64, 56, 6), (128, 28, 12), (256, 14, 24), (512, 7, 16))
WATCHED = ("fused_dense_block", "fused_inverted_residual", "fused_se", "fused_split_attention", "fused_grouped_conv", "fused_elemwise", "Convolution", "BatchNorm", "Concat", "broadcast_mul",
           "_contrib_AdaptiveAvgPooling2D", "Pooling", "sum", "expand_dims", "softmax")


def load(name: str):
    if name in GLUONCV:
        return gluoncv_model(name, SHAPE)
    return zoo_model(name, SHAPE)


def counts(symbol) -> collections.Counter:
    import json
    return collections.Counter(n["op"] for n in json.loads(symbol.tojson())["nodes"] if n["op"] != "null")


def bench(name: str, repeats: int, rounds: int) -> None:
    model, _, opt_in = name.partition("+")
    sym, arg, aux = load(model)
    rules = [opt_in, "default"] if opt_in else None
    result = fusion.fuse(sym, arg, aux, rules=rules, input_shapes={"data": SHAPE})
    check = fusion.verify((sym, arg, aux), result, input_shapes={"data": SHAPE})
    before, after = counts(sym), counts(result.symbol)
    inputs = random_inputs(sym, arg, {"data": SHAPE})
    systems = {"original": executor(sym, arg, aux, inputs),
               "fused": executor(result.symbol, result.arg_params, result.aux_params, inputs)}
    print("\n%s: verified max rel err %.1e; ops %d -> %d" % (name, check.max_rel, sum(before.values()),
                                                            sum(after.values())))
    print("  op counts (before -> after): " + ", ".join(
        "%s %d->%d" % (op, before.get(op, 0), after.get(op, 0)) for op in WATCHED if before.get(op) or after.get(op)))
    for r in range(rounds):
        s = time_samples(systems, repeats=repeats)
        ms = {k: np.asarray(v) * 1e3 for k, v in s.items()}
        med = {k: float(np.median(v)) for k, v in ms.items()}
        spread = {k: (float(np.percentile(v, 10)), float(np.percentile(v, 90))) for k, v in ms.items()}
        print("  round %d: original %.2f ms [%.2f-%.2f]  fused %.2f ms [%.2f-%.2f]  speed-up %.2fx"
              % (r + 1, med["original"], *spread["original"], med["fused"], *spread["fused"],
                 med["original"] / med["fused"]))
        sys.stdout.flush()


def bench_without_shapes(name: str, repeats: int, rounds: int) -> None:
    """The model fused with and without ``input_shapes``: rewrites made by each, then timed together."""
    model, _, opt_in = name.partition("+")
    sym, arg, aux = load(model)
    rules = [opt_in, "default"] if opt_in else None
    with_shapes = fusion.fuse(sym, arg, aux, rules=rules, input_shapes={"data": SHAPE})
    without = fusion.fuse(sym, arg, aux, rules=rules)
    errors = []
    # right at any size it is bound at, not only the usual one (DenseNet's 7x7 classifier pooling
    # takes 224-255 only: 2x3x240x232 there)
    other = (2, 3, 240, 232) if model.startswith("densenet") else (2, 3, 160, 192)
    for shape in (SHAPE, other):
        errors.append("%.1e at %s" % (fusion.verify((sym, arg, aux), without, input_shapes={"data": shape}).max_rel,
                                      "x".join(map(str, shape))))
    after_with, after_without = counts(with_shapes.symbol), counts(without.symbol)
    print("\n%s: rewrites with input shapes %d, without %d (report: %s more with input shapes); ops %d -> %d "
          "with, %d without; fused without shapes verified: max rel err %s"
          % (name, with_shapes.report.fused_count, without.report.fused_count,
             without.report.extra.get("more_with_input_shapes", 0), sum(counts(sym).values()),
             sum(after_with.values()), sum(after_without.values()), ", ".join(errors)))
    print("  fused ops with shapes: " + ", ".join("%s %d" % (op, after_with[op]) for op in WATCHED[:6] if after_with.get(op)))
    print("  fused ops without:     " + ", ".join("%s %d" % (op, after_without[op]) for op in WATCHED[:6]
                                                  if after_without.get(op)))
    inputs = random_inputs(sym, arg, {"data": SHAPE})
    systems = {"original": executor(sym, arg, aux, inputs),
               "with_shapes": executor(with_shapes.symbol, with_shapes.arg_params, with_shapes.aux_params, inputs),
               "without": executor(without.symbol, without.arg_params, without.aux_params, inputs)}
    for r in range(rounds):
        s = time_samples(systems, repeats=repeats)
        ms = {k: np.asarray(v) * 1e3 for k, v in s.items()}
        med = {k: float(np.median(v)) for k, v in ms.items()}
        print("  round %d: " % (r + 1) + "  ".join(
            "%s %.2f ms [%.2f-%.2f]" % (k, med[k], np.percentile(ms[k], 10), np.percentile(ms[k], 90)) for k in ms)
              + "  speed-up with shapes %.2fx, without %.2fx" % (med["original"] / med["with_shapes"],
                                                                 med["original"] / med["without"]))
        sys.stdout.flush()


def dense_block(c0: int, h: int, layers: int):
    """One dense block of MXNet's model zoo DenseNet (growth 32, bottleneck 128), random weights
    and randomized BatchNorm statistics: (symbol, arg_params, aux_params)."""
    import mxnet as mx
    from mxnet.gluon.model_zoo.vision.densenet import _make_dense_block

    blk = _make_dense_block(layers, 4, 32, 0, 1)
    blk.initialize(mx.init.Xavier())
    blk.hybridize()
    blk(mx.nd.zeros((1, c0, h, h)))
    rng = np.random.RandomState(c0 + h + layers)
    ranges = {"running_var": (0.5, 1.5), "running_mean": (-0.1, 0.1), "gamma": (0.5, 1.5), "beta": (-0.2, 0.2)}
    for k, p in blk.collect_params().items():
        for suffix, (lo, hi) in ranges.items():
            if k.endswith(suffix):
                p.set_data(mx.nd.array(rng.uniform(lo, hi, p.shape)))
    sym = blk(mx.sym.var("data"))
    aux_names = set(sym.list_auxiliary_states())
    params = {k: p.data() for k, p in blk.collect_params().items()}
    return (sym, {k: v for k, v in params.items() if k not in aux_names},
            {k: v for k, v in params.items() if k in aux_names})


def bench_dense_blocks(repeats: int, rounds: int) -> None:
    total = {"original": [], "fused": []}
    for c0, h, layers in DENSE_BLOCKS:
        sym, arg, aux = dense_block(c0, h, layers)
        shape = (1, c0, h, h)
        result = fusion.fuse(sym, arg, aux, input_shapes={"data": shape})
        check = fusion.verify((sym, arg, aux), result, input_shapes={"data": shape})
        inputs = random_inputs(sym, arg, {"data": shape})
        systems = {"original": executor(sym, arg, aux, inputs),
                   "fused": executor(result.symbol, result.arg_params, result.aux_params, inputs)}
        print("\ndense block c0=%d h=%d layers=%d: verified max rel err %.1e; ops %d -> %d"
              % (c0, h, layers, check.max_rel, sum(counts(sym).values()), sum(counts(result.symbol).values())))
        for r in range(rounds):
            s = time_samples(systems, repeats=repeats)
            ms = {k: np.asarray(v) * 1e3 for k, v in s.items()}
            med = {k: float(np.median(v)) for k, v in ms.items()}
            for k in total:
                total[k].append(med[k])
            print("  round %d: original %.2f ms [%.2f-%.2f]  fused %.2f ms [%.2f-%.2f]  speed-up %.2fx"
                  % (r + 1, med["original"], np.percentile(ms["original"], 10), np.percentile(ms["original"], 90),
                     med["fused"], np.percentile(ms["fused"], 10), np.percentile(ms["fused"], 90),
                     med["original"] / med["fused"]))
            sys.stdout.flush()
    print("\nsum of the four blocks' medians (all rounds): original %.2f ms, fused %.2f ms, %.2fx"
          % (sum(total["original"]), sum(total["fused"]), sum(total["original"]) / sum(total["fused"])))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--repeats", type=int, default=30, help="timed calls per system per round (default 30)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds per model (default 1)")
    ap.add_argument("--dense-blocks", action="store_true", help="time DenseNet-121's dense blocks alone")
    ap.add_argument("--no-input-shapes", action="store_true",
                    help="fuse with and without input_shapes: rewrites of each, both timed against the original")
    args = ap.parse_args(argv)
    import mxnet as mx
    print("mxnet %s, OMP_NUM_THREADS=%s, batch 1, 224x224; medians of interleaved calls, [p10-p90]"
          % (mx.__version__, os.environ.get("OMP_NUM_THREADS")))
    if args.dense_blocks:
        bench_dense_blocks(args.repeats, args.rounds)
        return 0
    for name in [m for m in args.models.split(",") if m]:
        if name.partition("+")[0] not in tuple(GLUONCV) + ZOO:
            print("unknown model %r" % name, file=sys.stderr)
            return 2
        (bench_without_shapes if args.no_input_shapes else bench)(name, args.repeats, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
