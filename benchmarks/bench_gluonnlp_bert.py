"""GluonNLP's own BERT-base (model zoo, random weights): fused vs MXNet default bind / subgraph backend off.

    pip install gluonnlp==0.10.0        # not a dependency of mxnet-fusion; this benchmark only
    python benchmarks/bench_gluonnlp_bert.py [--seqs 128,512] [--repeats 10]

The model is built with ``pretrained=False`` and a made-up vocabulary (nothing is downloaded),
hybridized, and its graph fused with its parameters.  GluonNLP writes attention with MXNet's
interleaved contrib ops and valid lengths, and assembles the QKV weight on every call.
"""
import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fusion import _env  # noqa: E402

_env.configure_threads()

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402

import fusion  # noqa: E402
from fusion.bench import fused_vs_original  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="128,512")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    try:
        import gluonnlp as nlp
    except ImportError:
        print("gluonnlp is not installed: pip install gluonnlp==0.10.0")
        return
    vocab = nlp.vocab.BERTVocab(collections.Counter("w%d" % i for i in range(30000)))
    print("%-6s | %9s %9s %9s | %8s %8s | %8s  %s" % ("seq", "fused", "mx-def", "mx-off", "vs def", "vs off",
                                                     "rel err", "ops before -> after"))
    for seq in (int(s) for s in args.seqs.split(",")):
        mx.random.seed(0)
        model, _ = nlp.model.get_model("bert_12_768_12", dataset_name=None, vocab=vocab, pretrained=False,
                                       use_pooler=True, use_decoder=False, use_classifier=False)
        model.initialize(mx.init.Normal(0.02))
        model.hybridize()
        rng = np.random.default_rng(0)
        feed = {"data0": rng.integers(0, 30000, (1, seq)).astype(np.float32),
                "data1": np.zeros((1, seq), np.float32), "data2": np.array([seq * 3 // 4], np.float32)}
        model(*[mx.nd.array(feed[k]) for k in ("data0", "data1", "data2")])
        sym = model._cached_graph[1]
        params = {p.name: p.data() for p in model.collect_params().values()}
        aux_names = set(sym.list_auxiliary_states())
        arg = {k: v for k, v in params.items() if k not in aux_names}
        aux = {k: v for k, v in params.items() if k in aux_names}
        res = fusion.fuse(sym, arg, aux, input_shapes={k: v.shape for k, v in feed.items()})
        v = fusion.verify((sym, arg, aux), res, inputs=feed)
        t = fused_vs_original(sym, arg, aux, res, feed, args.repeats)
        print("%-6d | %9.1f %9.1f %9.1f | %7.2fx %7.2fx | %8.1e  %d -> %d" % (
            seq, 1e3 * t["fused"], 1e3 * t["original"], 1e3 * t["original_no_subgraph"],
            t["original"] / t["fused"], t["original_no_subgraph"] / t["fused"], v.max_rel,
            res.report.ops_before, res.report.ops_after), flush=True)


if __name__ == "__main__":
    main()
