"""Helpers for tests, examples and benchmarks: model-zoo networks with random weights.

BatchNorm statistics are randomized (MXNet initializes mean 0 / variance 1,
which would make folding trivially exact), so a fold that mixes up the
channel axis, eps or fix_gamma shows up as a numerical mismatch.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np


def randomize_batchnorm(arg: Dict, aux: Dict, seed: int = 0) -> None:
    """Give every BatchNorm gamma/beta/moving stats non-trivial values (in place, on these dicts)."""
    import mxnet as mx

    rng = np.random.default_rng(seed)
    for store in (arg, aux):
        for name in sorted(store):
            shape = store[name].shape
            if name.endswith("_gamma"):
                store[name] = mx.nd.array(rng.uniform(0.5, 1.5, shape))
            elif name.endswith("_beta"):
                store[name] = mx.nd.array(rng.normal(0.0, 0.2, shape))
            elif name.endswith("_running_mean") or name.endswith("_moving_mean"):
                store[name] = mx.nd.array(rng.normal(0.0, 0.2, shape))
            elif name.endswith("_running_var") or name.endswith("_moving_var"):
                store[name] = mx.nd.array(rng.uniform(0.5, 2.0, shape))


def zoo_model(name: str, input_shape: Tuple[int, ...] = (1, 3, 224, 224), seed: int = 0, **kwargs):
    """(symbol, arg_params, aux_params) of ``mxnet.gluon.model_zoo.vision`` network ``name``."""
    import mxnet as mx
    from mxnet.gluon.model_zoo import vision

    mx.random.seed(seed)
    net = vision.get_model(name, **kwargs)
    net.initialize(mx.init.Xavier(magnitude=2.0))
    net.hybridize()
    net(mx.nd.zeros(input_shape))
    sym = net._cached_graph[1]
    params = {p.var().name: p.data() for p in net.collect_params().values()}
    aux_names = set(sym.list_auxiliary_states())
    arg = {k: v for k, v in params.items() if k not in aux_names}
    aux = {k: v for k, v in params.items() if k in aux_names}
    randomize_batchnorm(arg, aux, seed)
    return sym, arg, aux


def gluonnlp_bert(seq: int = 16, batch: int = 1, layers: int = 2, units: int = 64, heads: int = 4,
                  vocab_size: int = 100, seed: int = 0):
    """(symbol, arg_params, aux_params, input_shapes) of a small GluonNLP 0.10 BERT (random weights,
    a made-up vocabulary: nothing is downloaded), built like ``bert_12_768_12`` and exported the way
    ``HybridBlock.export`` writes it: inputs ``data0`` (token ids), ``data1`` (segment ids),
    ``data2`` (valid lengths).  Needs ``gluonnlp``.

    Weights are N(0, 0.02) as GluonNLP initializes them, but biases, LayerNorm β and γ are
    randomized too (GluonNLP starts them at 0 and 1, which makes the model nearly invariant to
    a LayerNorm's scale, so a rewrite that changed one would go unseen)."""
    import collections

    import gluonnlp as nlp
    import mxnet as mx

    vocab = nlp.vocab.BERTVocab(collections.Counter("w%d" % i for i in range(vocab_size)))
    mx.random.seed(seed)
    with mx.name.NameManager():     # the same names on every call (bertencoder0_..., not bertencoder3_...)
        model, _ = nlp.model.get_model("bert_12_768_12", dataset_name=None, vocab=vocab, pretrained=False,
                                       use_pooler=True, use_decoder=False, use_classifier=False,
                                       hparam_allow_override=True, num_layers=layers, units=units,
                                       hidden_size=2 * units, num_heads=heads, embed_size=units,
                                       max_length=max(64, seq))
    model.initialize(mx.init.Normal(0.02))
    model.hybridize()
    model(mx.nd.zeros((batch, seq)), mx.nd.zeros((batch, seq)), mx.nd.array([seq] * batch))
    sym = model._cached_graph[1]
    params = {p.name: p.data() for p in model.collect_params().values()}
    rng = np.random.default_rng(seed)
    for name in sorted(params):
        shape = params[name].shape
        if name.endswith(("_bias", "_beta")):
            params[name] = mx.nd.array(rng.normal(0.0, 0.1, shape))
        elif name.endswith("_gamma"):
            params[name] = mx.nd.array(rng.uniform(0.5, 1.5, shape))
    aux_names = set(sym.list_auxiliary_states())
    arg = {k: v for k, v in params.items() if k not in aux_names}
    aux = {k: v for k, v in params.items() if k in aux_names}
    shapes = {"data0": (batch, seq), "data1": (batch, seq), "data2": (batch,)}
    return sym, arg, aux, shapes
