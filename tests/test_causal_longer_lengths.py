"""A mask is read as causal only when it is causal at every probe AND at longer sequence lengths
the graph takes; where the longer lengths cannot be computed, the mask stays a mask.

The graph: a packed (B, S, 3·H·D) input split into heads by Reshape/transpose (its head count
and head size fixed by no parameter), with the additive mask ``1 - (i + 1 >= j)`` (0 on the band
j <= i + 1, 1 after it).  At the user's sequence length 1 and the probes' 2 that mask looks
exactly causal with 0 after the band; at 3 it is not.  Growing every size no parameter fixes
(the head count and head size too) gives shapes the graph cannot take; growing the scores'
lengths alone shows the mask is not causal."""
from __future__ import annotations

import mxnet as mx
import numpy as np

import fusion

S, I = mx.sym, mx.sym._internal


def _graph():
    qkv = S.var("qkv")                        # (B, S, 3 * 2 heads * 4)
    split = S.SliceChannel(qkv, axis=-1, num_outputs=3, name="split")
    q = S.Reshape(S.transpose(S.Reshape(split[0], shape=(0, 0, -1, 4)), axes=(0, 2, 1, 3)), shape=(-3, 0, 0))
    k = S.Reshape(S.transpose(S.Reshape(split[1], shape=(0, 0, -1, 4)), axes=(0, 2, 1, 3)), shape=(-3, 0, 0))
    v = S.Reshape(S.transpose(S.Reshape(split[2], shape=(0, 0, -1, 4)), axes=(0, 2, 1, 3)), shape=(-3, 0, 0))
    scores = S.batch_dot(q, k, transpose_b=True, name="scores")
    rows = I._plus_scalar(S.Reshape(S.contrib.arange_like(q, axis=1), shape=(-1, 1)), scalar=1.0)
    cols = S.Reshape(S.contrib.arange_like(k, axis=1), shape=(1, -1))
    mask = I._rminus_scalar(S.broadcast_greater_equal(rows, cols), scalar=1.0)
    p = S.softmax(S.broadcast_add(scores, mask), name="softmax")
    out = S.batch_dot(p, v, name="context")
    return S.Reshape(S.transpose(S.Reshape(out, shape=(-4, -1, 2, 0, 0)), axes=(0, 2, 1, 3)), shape=(0, 0, -3))


def _run(sym, arg, x):
    exe = sym.bind(mx.cpu(), {"qkv": mx.nd.array(x), **arg}, grad_req="null")
    return exe.forward(is_train=False)[0].asnumpy()


def test_mask_causal_only_at_short_lengths_stays_a_mask():
    sym = _graph()
    res = fusion.fuse(sym, {}, {}, input_shapes={"qkv": (2, 1, 24)})
    rng = np.random.default_rng(0)
    for shape in ((2, 1, 24), (1, 3, 24), (3, 7, 24)):
        x = rng.standard_normal(shape).astype(np.float32)
        want, got = _run(sym, {}, x), _run(res.symbol, res.arg_params, x)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), shape
    import json
    attrs = [n.get("attrs", {}) for n in json.loads(res.symbol.tojson())["nodes"] if n["op"] == "fused_attention"]
    assert attrs and all(a.get("causal") != "True" for a in attrs), attrs


def test_a_true_causal_mask_there_is_still_causal():
    """The same graph with ``1 - (i >= j)`` (1 added after the band j <= i): causal at every length,
    read as causal (the grown lengths show it)."""
    sym = _graph()
    js = sym.tojson().replace('"scalar": "1.0"', '"scalar": "0.0"', 1)
    sym = mx.sym.load_json(js)
    res = fusion.fuse(sym, {}, {}, input_shapes={"qkv": (2, 5, 24)})
    rng = np.random.default_rng(1)
    for shape in ((2, 5, 24), (1, 3, 24), (3, 9, 24)):
        x = rng.standard_normal(shape).astype(np.float32)
        want, got = _run(sym, {}, x), _run(res.symbol, res.arg_params, x)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), shape
    import json
    attrs = [n.get("attrs", {}) for n in json.loads(res.symbol.tojson())["nodes"] if n["op"] == "fused_attention"]
    assert [(a.get("causal"), a.get("mask_value")) for a in attrs] == [("True", "1")], attrs
