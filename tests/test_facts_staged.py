"""Shape facts of a graph holding library ops (inferred in stages, stock ops before each library
op): a variable read in one stage and again after a library op (a BatchNorm's moving mean, also
summed by the graph) keeps its shape, so the values after the library op have facts and the
rules after it see them in the same fuse() -- fusing twice gives the graph fusing once gave."""
from __future__ import annotations

import json

import mxnet as mx
import numpy as np
import pytest

import fusion
from conftest import random_params

S = mx.sym


def _layer(x, i):
    y = S.Activation(S.BatchNorm(x, name="bn%d" % i), act_type="relu")
    y = S.Convolution(y, num_filter=16, kernel=(1, 1), no_bias=True, name="c1_%d" % i)
    y = S.Activation(S.BatchNorm(y, name="bn2_%d" % i), act_type="relu")
    y = S.Convolution(y, num_filter=16, kernel=(3, 3), pad=(1, 1), no_bias=True, name="c2_%d" % i)
    return S.Concat(x, y, dim=1, name="cat%d" % i)


def _ops(sym):
    return sorted(n["op"] for n in json.loads(sym.tojson())["nodes"] if n["op"] != "null")


@pytest.mark.usefixtures("no_regions")
def test_fusing_twice_changes_nothing_when_a_variable_is_read_across_a_library_op():
    """Layers 0-1 and 3 become dense blocks; layer 2's 1x1 convolution is a graph output, so its
    BatchNorms stay, the second one reading its moving mean between the two blocks, and the graph
    sums that moving mean after the second block."""
    x = _layer(_layer(S.var("data"), 0), 1)
    x = _layer(x, 2)
    x = _layer(x, 3)
    internals = x.get_internals()
    sym = S.Group([internals["c1_2_output"], x, S.sum(internals["bn2_2_moving_mean"], name="s")])
    shapes = {"data": (1, 16, 5, 6)}
    arg, aux = random_params(sym, shapes)
    once = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    assert _ops(once.symbol).count("fused_dense_block") == 2, _ops(once.symbol)
    twice = fusion.fuse(once.symbol, once.arg_params, once.aux_params, input_shapes=shapes)
    assert _ops(twice.symbol) == _ops(once.symbol), (_ops(once.symbol), _ops(twice.symbol))
    assert fusion.verify((sym, arg, aux), once, input_shapes=shapes).max_rel <= 1e-4


def test_a_reshape_to_one_size_is_read_as_a_shape():
    """``reshape(x, shape=-1)`` (GluonNLP's BERT flattens its valid lengths so) gives its ``shape`` as one
    number: the self-check's small probes crashed on it ('int' object is not iterable) for every
    GluonNLP BERT, RoBERTa, ERNIE and DistilBERT."""
    from fusion.engine.facts import as_sizes, reshape_divides, reshape_output
    from fusion.ir.graph import Graph

    g = Graph.from_symbol(mx.sym.reshape(mx.sym.var("x"), shape=-1))
    nd = [n for n in g.nodes if not n.is_variable][0]
    assert as_sizes(nd.attrs.get("shape")) == (-1,)
    assert reshape_divides(nd)
    assert reshape_output((2, 3, 5), as_sizes(nd.attrs.get("shape"))) == (30,)


def test_a_declared_bfloat16_variable_keeps_the_dtypes_of_the_stage_reading_it():
    """The precision policy's bfloat16 weights are variables declaring ``__dtype__`` (MXNet's Python API
    cannot pass bfloat16 by name): a stage reading one is inferred with it, so the dtypes of the whole
    graph stay known (they were all dropped, and Faster R-CNN's backbone, read by a fused_dense with a
    bfloat16 weight, stayed out of regions under precision="bf16": 3087 ms, slower than float32's 2931)."""
    from fusion.engine.facts import infer_nodes
    from fusion.ir.graph import Entry, Graph
    from fusion.precision.policy import BF16_CODE

    w = S.var("w_bf16")
    y = S.Group([S.elemwise_add(w, w, name="twice"), S.amp_cast(w, dtype="float32", name="up") + S.var("data")])
    g = Graph.from_symbol(y)
    by = {n.name: n for n in g.nodes}
    by["w_bf16"].attrs["__dtype__"] = str(BF16_CODE)
    got = infer_nodes(list(g.nodes), {}, {}, {"w_bf16": (4,), "data": (4,)}, {"data": "float32"})
    assert got is not None
    shapes, types = got
    assert types.get(Entry(by["twice"])) == "bfloat16", types
    assert types[Entry(by["up"])] == "float32" and types[g.heads[1]] == "float32", types
