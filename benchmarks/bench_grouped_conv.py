"""Grouped 3×3 convolutions of ResNeXt's shapes: fused_grouped_conv (oneDNN 3.x) vs MXNet's own, in a block.

    python benchmarks/bench_grouped_conv.py [--repeats 50] [--rounds 3]

Each case is ResNeXt's bottleneck body at one stage (batch 1): 1×1 conv → BN → relu →
3×3 conv with 32 groups → BN → relu → 1×1 conv, so the grouped convolution reads and writes
its neighbours' layouts as it does in the network.  ``original`` is MXNet's default bind
(its oneDNN backend fuses conv+BN+relu itself); ``fused`` is ``fusion.fuse`` with the opt-in
``grouped_convolution`` rules and the default ones (BatchNorm folded; the grouped convolution →
fused_grouped_conv).  Medians of
interleaved calls with their p10–p90 spread, and the ratio original ÷ fused per round.
"""
from __future__ import annotations

import argparse
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from fusion.native.env import configure_threads  # noqa: E402  (must run before mxnet is imported)

configure_threads()

import numpy as np  # noqa: E402

import fusion  # noqa: E402
from fusion.check.bench import executor, time_samples  # noqa: E402
from fusion.check.verify import random_inputs  # noqa: E402

# (channels, plane size, channels per group): ResNeXt-50 32x4d's stages
CASES = ((128, 56, 4), (256, 28, 8), (512, 14, 16))


def block(C: int, groups: int):
    import mxnet as mx
    x = mx.sym.var("data")
    y = mx.sym.Convolution(x, kernel=(1, 1), num_filter=C, no_bias=True, name="c1")
    y = mx.sym.Activation(mx.sym.BatchNorm(y, fix_gamma=False, name="bn1"), act_type="relu")
    y = mx.sym.Convolution(y, kernel=(3, 3), pad=(1, 1), num_filter=C, num_group=groups, no_bias=True, name="g")
    y = mx.sym.Activation(mx.sym.BatchNorm(y, fix_gamma=False, name="bn2"), act_type="relu")
    return mx.sym.Convolution(y, kernel=(1, 1), num_filter=2 * C, no_bias=True, name="c3")


def params(sym, shape, seed=0):
    import mxnet as mx
    rng = np.random.default_rng(seed)
    arg_shapes, _, aux_shapes = sym.infer_shape(data=shape)
    arg = {n: mx.nd.array(rng.normal(0, 0.1, s)) for n, s in zip(sym.list_arguments(), arg_shapes) if n != "data"}
    aux = {n: mx.nd.array(rng.uniform(0.5, 1.5, s) if n.endswith("var") else rng.normal(0, 0.1, s))
           for n, s in zip(sym.list_auxiliary_states(), aux_shapes)}
    return arg, aux


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    print("OMP_NUM_THREADS=%s; medians of interleaved calls [p10-p90], ms" % os.environ.get("OMP_NUM_THREADS"))
    for C, hw, per_group in CASES:
        shape = (1, C, hw, hw)
        sym = block(C, C // per_group)
        arg, aux = params(sym, shape)
        res = fusion.fuse(sym, arg, aux, rules=["grouped_convolution", "default"], input_shapes={"data": shape})
        check = fusion.verify((sym, arg, aux), res, input_shapes={"data": shape})
        fused_ops = sorted(n for n, c in res.graph.count_ops().items() if c)
        inputs = random_inputs(sym, arg, {"data": shape})
        systems = {"original": executor(sym, arg, aux, inputs),
                   "fused": executor(res.symbol, res.arg_params, res.aux_params, inputs)}
        print("\nC=%d %dx%d, %d groups of %d: max rel err %.1e; fused ops %s" % (
            C, hw, hw, C // per_group, per_group, check.max_rel, ", ".join(fused_ops)))
        for r in range(args.rounds):
            s = {k: np.asarray(v) * 1e3 for k, v in time_samples(systems, repeats=args.repeats).items()}
            med = {k: float(np.median(v)) for k, v in s.items()}
            print("  round %d: original %.3f [%.3f-%.3f]  fused %.3f [%.3f-%.3f]  ratio %.2fx" % (
                r + 1, med["original"], np.percentile(s["original"], 10), np.percentile(s["original"], 90),
                med["fused"], np.percentile(s["fused"], 10), np.percentile(s["fused"], 90),
                med["original"] / med["fused"]))
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
