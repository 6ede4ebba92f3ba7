"""Helpers for tests, examples and benchmarks: model-zoo networks with random weights.

BatchNorm statistics are randomized (MXNet initializes mean 0 / variance 1,
which would make folding trivially exact), so a fold that mixes up the
channel axis, eps or fix_gamma shows up as a numerical mismatch.

Here: model-zoo networks (``zoo_model``), Gluon blocks exported (``gluon_export``), a small GluonNLP
BERT (``gluonnlp_bert``), a BERT written as ONNX (``onnx_bert``); in ``gluoncv``, GluonCV's CNN blocks.

May import: any layer of mxnet-fusion but ``fusion.doors`` (ARCHITECTURE.md); the models here
need none today, only MXNet, GluonNLP and onnx, imported when a model is asked for.
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


def randomize_batchnorm_of(sym, arg: Dict, aux: Dict, seed: int = 0) -> None:
    """Every BatchNorm's gamma, beta, mean and (positive) variance of ``sym`` drawn at random (in
    place), found by the BatchNorm nodes' inputs rather than by parameter names (GluonCV's SSD heads
    name some statistics like weights)."""
    import json

    import mxnet as mx

    rng = np.random.default_rng(seed)
    nodes = json.loads(sym.tojson())["nodes"]
    ranges = ((0.5, 1.5), None, None, (0.5, 2.0))      # gamma, beta, mean, var
    for n in nodes:
        if n["op"] != "BatchNorm":
            continue
        for k, (src, _, _) in enumerate(n["inputs"][1:5]):
            name = nodes[src]["name"]
            store = arg if name in arg else aux if name in aux else None
            if store is not None:
                lo_hi = ranges[k]
                shape = store[name].shape
                store[name] = mx.nd.array(rng.uniform(*lo_hi, shape) if lo_hi else rng.normal(0.0, 0.2, shape))


def zoo_model(name: str, input_shape: Tuple[int, ...] = (1, 3, 224, 224), seed: int = 0, **kwargs):
    """(symbol, arg_params, aux_params) of ``mxnet.gluon.model_zoo.vision`` network ``name``."""
    import mxnet as mx
    from mxnet.gluon.model_zoo import vision

    mx.random.seed(seed)
    return gluon_export(vision.get_model(name, **kwargs), input_shape, seed)


def gluon_export(net, input_shape: Tuple[int, ...], seed: int = 0, init=None, bn_by_nodes: bool = False,
                 call_with=None):
    """(symbol, arg_params, aux_params) of a Gluon block (the global MXNet seed set by the caller):
    Xavier weights (or ``init``), randomized BatchNorm statistics (found by name, or with
    ``bn_by_nodes`` by the BatchNorm nodes' inputs: ``randomize_batchnorm_of``).  ``call_with``: the
    arguments to call the block with (several inputs, e.g. a language model's tokens and its begin
    state: the symbol names them data0, data1, … in the order Gluon flattens them), in place of one
    array of zeros of ``input_shape``."""
    import mxnet as mx

    net.initialize(init if init is not None else mx.init.Xavier(magnitude=2.0))
    net.hybridize()
    args = list(call_with) if call_with is not None else [mx.nd.zeros(input_shape)]
    try:
        net(*args)
    except ValueError as e:
        if "Deferred initialization failed" not in str(e):
            raise
        # a parameter no op reads (monodepth2's encoder keeps its ResNet's classifier) never gets a shape,
        # and the hybridized call infers every parameter's: run once imperatively (the parameters read get
        # theirs), give the others a placeholder shape, then hybridize again (gluon_export drops them)
        net.hybridize(active=False)
        net(*args)
        for p in net.collect_params().values():
            if p._deferred_init:
                p.shape = tuple(d if d else 1 for d in p.shape)
                p._finish_deferred_init()
        net.hybridize()
        net(*args)
    sym = net._cached_graph[1]
    # a parameter the graph does not read (monodepth2's encoder keeps its ResNet's unused classifier)
    # was never given a shape: left out
    used = set(sym.list_arguments()) | set(sym.list_auxiliary_states())
    params = {p.var().name: p.data() for p in net.collect_params().values() if p.var().name in used}
    aux_names = set(sym.list_auxiliary_states())
    arg = {k: v for k, v in params.items() if k not in aux_names}
    aux = {k: v for k, v in params.items() if k in aux_names}
    if bn_by_nodes:
        randomize_batchnorm_of(sym, arg, aux, seed)
    else:
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


def onnx_bert(layers: int = 2, hidden: int = 64, heads: int = 4, ffn: int = 128, vocab_size: int = 100,
              max_positions: int = 512, opset: int = 17, seed: int = 0):
    """A BERT encoder (embeddings, ``layers`` layers, pooler) as an ``onnx.ModelProto``, written with
    ``onnx.helper`` the way torch's exporter writes BERT (random weights; torch not needed): int64
    inputs ``input_ids``, ``token_type_ids``, ``attention_mask`` (B, S) with symbolic batch and
    sequence, positions sliced from a buffer by ``Shape``, the extended mask ``(1 - mask)·-10000``,
    head splits by ``Shape``/``Gather``/``Concat``-built ``Reshape`` targets, erf GELU, outputs
    ``last_hidden_state`` and ``pooler_output``.  ``bert_12_768_12`` sizes: layers=12, hidden=768,
    heads=12, ffn=3072, vocab_size=30522."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    count = [0]

    def init(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(name, shape, std=0.02):
        return init(name, rng.normal(0, std, shape).astype(np.float32))

    def op(op_type, inputs, **attrs):
        count[0] += 1
        out = "/%s_%d_out" % (op_type, count[0])
        nodes.append(helper.make_node(op_type, inputs, [out], name="/%s_%d" % (op_type, count[0]), **attrs))
        return out

    def const(value, dtype=np.int64):
        count[0] += 1
        return init("const_%d" % count[0], np.asarray(value, dtype))

    d = hidden // heads
    ids, types, mask = "input_ids", "token_type_ids", "attention_mask"
    seq_len = op("Unsqueeze", [op("Gather", [op("Shape", [ids]), const(1)], axis=0), const([0])])
    positions = op("Slice", [init("position_ids", np.arange(max_positions, dtype=np.int64)[None]),
                             const([0]), seq_len, const([1])])

    def layer_norm(x, tag):
        return op("LayerNormalization", [x, init(tag + ".weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32)),
                                          weight(tag + ".bias", (hidden,), 0.1)], axis=-1, epsilon=1e-12)

    emb = op("Add", [op("Gather", [weight("word_embeddings", (vocab_size, hidden)), ids]),
                     op("Gather", [weight("token_type_embeddings", (2, hidden)), types])])
    emb = op("Add", [emb, op("Gather", [weight("position_embeddings", (max_positions, hidden)), positions])])
    x = layer_norm(emb, "embeddings.LayerNorm")
    ext = op("Cast", [op("Unsqueeze", [op("Unsqueeze", [mask, const([1])]), const([2])])], to=TensorProto.FLOAT)
    ext = op("Mul", [op("Sub", [const(1.0, np.float32), ext]), const(-10000.0, np.float32)])

    def dense(y, tag, n_in, n_out):
        w = weight(tag + ".weight_T", (n_in, n_out))
        return op("Add", [weight(tag + ".bias", (n_out,), 0.1), op("MatMul", [y, w])])

    def dim(t, i):
        return op("Unsqueeze", [op("Gather", [op("Shape", [t]), const(i)], axis=0), const([0])])

    def split_heads(y, perm):
        shape = op("Concat", [dim(y, 0), dim(y, 1), const([heads]), const([d])], axis=0)
        return op("Transpose", [op("Reshape", [y, shape])], perm=perm)

    for i in range(layers):
        p = "encoder.layer.%d." % i
        q = split_heads(dense(x, p + "attention.self.query", hidden, hidden), [0, 2, 1, 3])
        k = split_heads(dense(x, p + "attention.self.key", hidden, hidden), [0, 2, 3, 1])
        v = split_heads(dense(x, p + "attention.self.value", hidden, hidden), [0, 2, 1, 3])
        scores = op("Div", [op("MatMul", [q, k]), const(np.sqrt(d), np.float32)])
        probs = op("Softmax", [op("Add", [scores, ext])], axis=-1)
        ctx = op("Transpose", [op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
        ctx = op("Reshape", [ctx, op("Concat", [dim(ctx, 0), dim(ctx, 1), const([hidden])], axis=0)])
        h1 = layer_norm(op("Add", [dense(ctx, p + "attention.output.dense", hidden, hidden), x]),
                        p + "attention.output.LayerNorm")
        inter = dense(h1, p + "intermediate.dense", hidden, ffn)
        erf = op("Erf", [op("Div", [inter, const(np.sqrt(2.0), np.float32)])])
        gelu = op("Mul", [op("Mul", [inter, op("Add", [erf, const(1.0, np.float32)])]), const(0.5, np.float32)])
        x = layer_norm(op("Add", [dense(gelu, p + "output.dense", ffn, hidden), h1]), p + "output.LayerNorm")
    first = op("Gather", [x, const(0)], axis=1)
    pooled = op("Tanh", [op("Gemm", [first, weight("pooler.dense.weight", (hidden, hidden)),
                                      weight("pooler.dense.bias", (hidden,), 0.1)], transB=1)])
    nodes.append(helper.make_node("Identity", [x], ["last_hidden_state"]))
    nodes.append(helper.make_node("Identity", [pooled], ["pooler_output"]))
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "sequence"]) for n in (ids, types, mask)]
    outputs = [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", hidden]),
               helper.make_tensor_value_info("pooler_output", TensorProto.FLOAT, ["batch", hidden])]
    model = helper.make_model(helper.make_graph(nodes, "bert", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", opset)], producer_name="mxnet-fusion tests")
    model.ir_version = 8
    return model
