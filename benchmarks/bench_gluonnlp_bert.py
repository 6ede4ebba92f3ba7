"""GluonNLP's own BERT-base (model zoo, random weights): fused vs MXNet default bind / subgraph backend off.

    pip install gluonnlp==0.10.0        # not a dependency of mxnet-fusion; this benchmark only
    python benchmarks/bench_gluonnlp_bert.py [--seqs 128,512] [--repeats 10]

The model is built with ``pretrained=False`` and a made-up vocabulary (nothing is downloaded),
hybridized, and its graph fused with its parameters.  GluonNLP writes attention with MXNet's
interleaved contrib ops and valid lengths, and assembles the QKV weight on every call.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fusion.native import env as _env  # noqa: E402

_env.configure_threads()


import fusion  # noqa: E402
from fusion.check.bench import fused_vs_original  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="128,512")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    try:
        import gluonnlp  # noqa: F401
    except ImportError:
        print("gluonnlp is not installed: pip install gluonnlp==0.10.0")
        return
    from bench_precision import gluonnlp_model      # the same model (random weights, 30k vocabulary)
    print("%-6s | %9s %9s %9s | %8s %8s | %8s  %s" % ("seq", "fused", "mx-def", "mx-off", "vs def", "vs off",
                                                     "rel err", "ops before -> after"))
    for seq in (int(s) for s in args.seqs.split(",")):
        sym, arg, aux, feed = gluonnlp_model(seq, argparse.Namespace(layers=12))
        res = fusion.fuse(sym, arg, aux, input_shapes={k: v.shape for k, v in feed.items()})
        v = fusion.verify((sym, arg, aux), res, inputs=feed)
        t = fused_vs_original(sym, arg, aux, res, feed, args.repeats)
        print("%-6d | %9.1f %9.1f %9.1f | %7.2fx %7.2fx | %8.1e  %d -> %d" % (
            seq, 1e3 * t["fused"], 1e3 * t["original"], 1e3 * t["original_no_subgraph"],
            t["original"] / t["fused"], t["original_no_subgraph"] / t["fused"], v.max_rel,
            res.report.ops_before, res.report.ops_after), flush=True)


if __name__ == "__main__":
    main()
