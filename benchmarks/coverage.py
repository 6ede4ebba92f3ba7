"""What fuses, model by model: op counts before and after ``fuse()``, fused ops, and fuse() seconds.

    python benchmarks/coverage.py [--models a,b] [--no-self-check]

Models: model-zoo CNNs (batch 1, 224×224) and BERT-style encoders written four ways
(built-in LayerNorm/GELU, written out, packed QKV, GluonNLP's interleaved ops), a GPT
block with a causal mask, and GluonNLP's own ``bert_12_768_12`` when gluonnlp is
installed — all with random weights, fused with their input shapes given (so the
self-check runs, unless ``--no-self-check``), and verified against the original.
"""
import argparse
import collections
import os
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)
sys.path.insert(0, os.path.join(_REPO, "tests"))

from fusion.native.env import configure_threads  # noqa: E402

configure_threads()

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402

import fusion  # noqa: E402
from fusion.testing import zoo_model  # noqa: E402

ZOO = ("resnet18_v1", "resnet50_v1", "mobilenetv2_1.0", "densenet121", "squeezenet1.0", "vgg11_bn")


def transformer(style):
    import test_transformer_models as T
    x = mx.sym.var("data")
    if style == "interleaved":
        for i in range(2):
            x = T.interleaved_layer(x, i)
        lengths = np.repeat(np.array([T.L, 7], np.int32), T.HEADS)[:, None].repeat(T.L, axis=1)
        inputs = {"data": np.random.default_rng(2).standard_normal((T.L, T.B, T.UNITS)).astype(np.float32),
                  "length": lengths}
    elif style == "gpt":
        for i in range(2):
            x = T.gpt_block(x, i, "additive")
        inputs = {"data": np.random.default_rng(3).standard_normal((T.B, T.L, T.UNITS)).astype(np.float32)}
    else:
        for i in range(2):
            x = T.bert_layer(x, i, style)
        mask = np.zeros((T.B * T.HEADS, 1, T.L), np.float32)
        inputs = {"data": np.random.default_rng(1).standard_normal((T.B, T.L, T.UNITS)).astype(np.float32),
                  "mask": mask}
    arg = T.params_for(x, {k: v.shape for k, v in inputs.items()})
    return x, arg, {}, inputs


def gluonnlp_bert():
    import gluonnlp as nlp
    vocab = nlp.vocab.BERTVocab(collections.Counter("w%d" % i for i in range(30000)))
    mx.random.seed(0)
    model, _ = nlp.model.get_model("bert_12_768_12", dataset_name=None, vocab=vocab, pretrained=False,
                                   use_pooler=True, use_decoder=False, use_classifier=False)
    model.initialize(mx.init.Normal(0.02))
    model.hybridize()
    rng = np.random.default_rng(0)
    inputs = {"data0": rng.integers(0, 30000, (1, 128)).astype(np.float32),
              "data1": np.zeros((1, 128), np.float32), "data2": np.array([96], np.float32)}
    model(*[mx.nd.array(inputs[k]) for k in ("data0", "data1", "data2")])
    sym = model._cached_graph[1]
    params = {p.name: p.data() for p in model.collect_params().values()}
    aux_names = set(sym.list_auxiliary_states())
    return (sym, {k: v for k, v in params.items() if k not in aux_names},
            {k: v for k, v in params.items() if k in aux_names}, inputs)


def models():
    out = {("zoo:" + n): (lambda n=n: zoo_model(n) + ({"data": np.random.default_rng(0).standard_normal(
        (1, 3, 224, 224)).astype(np.float32)},)) for n in ZOO}
    for style in ("builtin", "written", "packed", "interleaved", "gpt"):
        out["bert2:" + style] = lambda style=style: transformer(style)
    try:
        import gluonnlp  # noqa: F401
        out["gluonnlp:bert_12_768_12"] = gluonnlp_bert
    except ImportError:
        pass
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", help="comma-separated names (default: all)")
    ap.add_argument("--no-self-check", action="store_true")
    args = ap.parse_args()
    table = models()
    names = args.models.split(",") if args.models else list(table)
    print("%-26s %13s %8s %8s  %s" % ("model", "ops", "fuse s", "rel err", "fused ops"))
    for name in names:
        sym, arg, aux, inputs = table[name]()
        kw = {} if args.no_self_check is False else {"self_check": False}
        t = time.perf_counter()
        try:
            res = fusion.fuse(sym, arg, aux, input_shapes={k: v.shape for k, v in inputs.items()}, **kw)
        except TypeError:        # a tree without the self_check option
            res = fusion.fuse(sym, arg, aux, input_shapes={k: v.shape for k, v in inputs.items()})
        seconds = time.perf_counter() - t
        v = fusion.verify((sym, arg, aux), res, inputs=inputs)
        counts = res.graph.count_ops()
        fused = ", ".join("%s×%d" % (k, c) for k, c in sorted(counts.items()) if k.startswith("fused_"))
        folded = sum(len(r.fused) for n, r in res.report.rules.items() if n.startswith("conv_bn") or n == "dense_bn")
        if folded:
            fused += (", " if fused else "") + "BN folded×%d" % folded
        print("%-26s %5d -> %-5d %8.2f %8.1e  %s" % (name, res.report.ops_before, res.report.ops_after, seconds,
                                                   v.max_rel, fused), flush=True)


if __name__ == "__main__":
    main()
