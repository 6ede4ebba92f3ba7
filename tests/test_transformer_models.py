"""Whole transformer models, written in several styles: everything fuses, outputs unchanged."""
import math

import mxnet as mx
import numpy as np
import pytest

import fusion

from conftest import ops

S = mx.sym
B, L, UNITS, HEADS, FFN = 2, 12, 32, 4, 64
D = UNITS // HEADS


def fc(x, n, name):
    return S.FullyConnected(x, num_hidden=n, flatten=False, name=name)


def layer_norm(x, name, written):
    g, b = S.var(name + "_gamma"), S.var(name + "_beta")
    if not written:
        return S.LayerNorm(x, g, b, eps=1e-5, name=name)
    mean = S.mean(x, axis=-1, keepdims=True)
    d = S.broadcast_sub(x, mean)
    var = S.mean(d * d, axis=-1, keepdims=True)
    return S.broadcast_add(S.broadcast_mul(S.broadcast_mul(d, S.rsqrt(var + 1e-5)), g), b)


def gelu(x, written):
    return (x * 0.5) * (S.erf(x / math.sqrt(2)) + 1) if written else S.LeakyReLU(x, act_type="gelu")


def split(t):
    return S.reshape(S.transpose(S.reshape(t, shape=(0, 0, HEADS, -1)), axes=(0, 2, 1, 3)), shape=(-3, 0, 0))


def merge(o):
    return S.reshape(S.transpose(S.reshape(o, shape=(-4, -1, HEADS, 0, 0)), axes=(0, 2, 1, 3)), shape=(0, 0, -3))


def bert_layer(x, i, style):
    p = "l%d_" % i
    written = style == "written"
    if style == "packed":
        parts = S.split(fc(x, 3 * UNITS, p + "qkv"), num_outputs=3, axis=-1)
        q, k, v = (split(parts[j]) for j in range(3))
    else:
        q, k, v = (split(fc(x, UNITS, p + n)) for n in ("q", "k", "v"))
    s = S.broadcast_add(S.batch_dot(q, k, transpose_b=True) / math.sqrt(D), S.var("mask"))
    ctx = merge(S.batch_dot(S.Dropout(S.softmax(s, axis=-1), p=0.1), v))
    h = layer_norm(fc(ctx, UNITS, p + "o") + x, p + "ln1", written)
    f = fc(gelu(fc(h, FFN, p + "ffn1"), written), UNITS, p + "ffn2")
    return layer_norm(f + h, p + "ln2", written)


def interleaved_layer(x, i, dropout=None):
    """GluonNLP style: (L, B, C) layout, interleaved QKV projection, valid lengths; ``dropout``:
    "identity" as GluonNLP writes dropout=0 (Gluon's Dropout(0.0) is an identity ``_copy``),
    "dropout" a Dropout (removed at inference)."""
    p = "l%d_" % i
    qkv = fc(x, 3 * UNITS, p + "qkv")
    s = S.contrib.interleaved_matmul_selfatt_qk(qkv, heads=HEADS)
    att = S.softmax(s, S.var("length"), axis=-1, use_length=True)
    if dropout == "identity":
        att = S.identity(att)
    elif dropout == "dropout":
        att = S.Dropout(att, p=0.1)
    ctx = S.contrib.interleaved_matmul_selfatt_valatt(qkv, att, heads=HEADS)
    h = layer_norm(fc(ctx, UNITS, p + "o") + x, p + "ln1", False)
    return layer_norm(fc(gelu(fc(h, FFN, p + "ffn1"), False), UNITS, p + "ffn2") + h, p + "ln2", False)


def params_for(sym, shapes, seed=0):
    rng = np.random.default_rng(seed)
    known = {n: (UNITS,) for n in sym.list_arguments() if n.endswith("_gamma") or n.endswith("_beta")}
    arg_shapes, _, _ = sym.infer_shape(**shapes, **known)
    arg = {}
    for n, shp in zip(sym.list_arguments(), arg_shapes):
        if n in shapes:
            continue
        arg[n] = mx.nd.array(1 + 0.1 * rng.standard_normal(shp) if n.endswith("gamma") else 0.2 * rng.standard_normal(shp))
    return arg


def run_both(sym, arg, inputs):
    res = fusion.fuse(sym, arg, {}, input_shapes={k: v.shape for k, v in inputs.items()})
    v = fusion.verify(sym, res, (arg, {}), inputs=inputs)
    return res, v


@pytest.mark.parametrize("style", ["builtin", "written", "packed"])
def test_bert_encoder(style):
    x = S.var("data")
    for i in range(2):
        x = bert_layer(x, i, style)
    rng = np.random.default_rng(1)
    mask = np.zeros((B * HEADS, 1, L), np.float32)
    mask[:HEADS, :, 9:] = -1e4                        # first sequence padded after 9 tokens
    inputs = {"data": rng.standard_normal((B, L, UNITS)).astype(np.float32), "mask": mask}
    res, v = run_both(x, params_for(x, {"data": (B, L, UNITS), "mask": mask.shape}), inputs)
    assert v.max_rel <= 1e-4, v
    counts = ops(res)
    # separate query/key/value projections of one input become one product (qkv_projection)
    assert counts == {"fused_attention": 2, "fused_dense": 8, "fused_add_layer_norm": 4}, \
        (counts, res.report.to_text(explain=True))


@pytest.mark.parametrize("dropout", [None, "identity", "dropout"])
def test_gluonnlp_interleaved_encoder(dropout):
    x = S.var("data")
    for i in range(2):
        x = interleaved_layer(x, i, dropout)
    rng = np.random.default_rng(2)
    lengths = np.repeat(np.array([L, 7], np.int32), HEADS)[:, None].repeat(L, axis=1)
    inputs = {"data": rng.standard_normal((L, B, UNITS)).astype(np.float32), "length": lengths}
    res, v = run_both(x, params_for(x, {"data": (L, B, UNITS), "length": lengths.shape}), inputs)
    assert v.max_rel <= 1e-4, v
    assert ops(res) == {"fused_attention": 2, "fused_dense": 8, "fused_add_layer_norm": 4}, res.report.to_text()


def gpt_block(x, i, mask_style, positions_from_scores=False):
    """Pre-LN causal block; the causal mask is built in the graph from arange_like comparisons."""
    p = "g%d_" % i
    h = layer_norm(x, p + "ln1", False)
    q, k, v = (split(fc(h, UNITS, p + n)) for n in ("q", "k", "v"))
    s = S.batch_dot(q, k, transpose_b=True) * (1.0 / math.sqrt(D))
    if positions_from_scores:                   # positions taken off the scores themselves
        causal = S.broadcast_lesser_equal(S.reshape(S.contrib.arange_like(s, axis=-1), shape=(1, -1)),
                                          S.reshape(S.contrib.arange_like(s, axis=1), shape=(-1, 1)))
    else:
        steps = S.contrib.arange_like(x, axis=1)                                    # (L,)
        causal = S.broadcast_lesser_equal(S.reshape(steps, shape=(1, -1)), S.reshape(steps, shape=(-1, 1)))
    if mask_style == "where":
        m = S.broadcast_like(S.expand_dims(causal, axis=0), s, lhs_axes=(0,), rhs_axes=(0,))
        s = S.where(m, s, S.ones_like(s) * -1e18)
    else:
        s = S.broadcast_add(s, S.expand_dims((1 - causal) * -1e9, axis=0))
    o = fc(merge(S.batch_dot(S.softmax(s, axis=-1), v)), UNITS, p + "o")
    x = o + x
    f = fc(gelu(fc(layer_norm(x, p + "ln2", False), FFN, p + "ffn1"), False), UNITS, p + "ffn2")
    return f + x


@pytest.mark.parametrize("mask_style,from_scores", [("where", False), ("additive", False), ("additive", True)])
def test_gpt_causal_blocks(mask_style, from_scores):
    x = S.var("data")
    for i in range(2):
        x = gpt_block(x, i, mask_style, from_scores)
    rng = np.random.default_rng(3)
    inputs = {"data": rng.standard_normal((B, L, UNITS)).astype(np.float32)}
    res, v = run_both(x, params_for(x, {"data": (B, L, UNITS)}), inputs)
    assert v.max_rel <= 1e-4, v
    counts = ops(res)
    qkv = len(res.report.rules["qkv_projection"].fused)      # each merges three projections into one
    assert counts["fused_attention"] == 2 and counts["fused_dense"] + 2 * qkv == 12, res.report.to_text(explain=True)
    assert counts.get("fused_add_layer_norm", 0) >= 2          # residual add + next block's LayerNorm
    assert "batch_dot" not in counts and "softmax" not in counts
    # the in-graph mask is recognized as causal: the kernel skips masked tiles, the mask computation is gone
    attn = [n for n in res.graph.op_nodes() if n.op == "fused_attention"]
    assert all(n.attrs["causal"] is True and n.attrs["mask_kind"] == "none" for n in attn)
    assert "_contrib_arange_like" not in counts and "transpose" not in counts, counts


def gluonnlp_dot_product_layer(x, i):
    """GluonNLP's MultiHeadAttentionCell(DotProductAttentionCell) without a mask, as it exports:
    heads split by Reshape/transpose/Reshape(reverse), q divided by √D (_contrib_div_sqrt_dim),
    Dropout(0.0) as an identity, the probabilities split into (B, H, S, S) and merged back before
    the value product."""
    p = "d%d_" % i
    def split(t):
        return S.reshape(S.transpose(S.reshape(t, shape=(0, 0, HEADS, -1)), axes=(0, 2, 1, 3)),
                         shape=(-1, 0, 0), reverse=True)
    q = S.contrib.div_sqrt_dim(split(S.FullyConnected(x, num_hidden=UNITS, no_bias=True, flatten=False, name=p + "q")))
    k = split(S.FullyConnected(x, num_hidden=UNITS, no_bias=True, flatten=False, name=p + "k"))
    v = split(S.FullyConnected(x, num_hidden=UNITS, no_bias=True, flatten=False, name=p + "v"))
    att = S.identity(S.softmax(S.batch_dot(q, k, transpose_b=True), axis=-1))
    att = S.reshape(S.reshape(att, shape=(-1, HEADS, 0, 0), reverse=True), shape=(-1, 0, 0), reverse=True)
    o = S.reshape(S.batch_dot(att, v), shape=(-1, HEADS, 0, 0), reverse=True)
    o = S.reshape(S.transpose(o, axes=(0, 2, 1, 3)), shape=(0, 0, -1))
    h = layer_norm(S.FullyConnected(o, num_hidden=UNITS, no_bias=True, flatten=False, name=p + "proj") + x,
                   p + "ln1", False)
    return layer_norm(fc(S.Activation(fc(h, FFN, p + "ffn1"), act_type="relu"), UNITS, p + "ffn2") + h, p + "ln2", False)


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_gluonnlp_dot_product_attention_cell(mode):
    x = S.var("data")
    for i in range(2):
        x = gluonnlp_dot_product_layer(x, i)
    rng = np.random.default_rng(3)
    inputs = {"data": rng.standard_normal((B, L, UNITS)).astype(np.float32)}
    arg = params_for(x, {"data": (B, L, UNITS)})
    res = fusion.fuse(x, arg, {}, mode=mode, input_shapes={"data": (B, L, UNITS)})
    assert ops(res).get("fused_attention") == 2, res.report.to_text(explain=True)
    v = fusion.verify(x, res, (arg, {}), inputs=inputs)
    assert v.max_rel <= 1e-4, v


def test_div_sqrt_dim_of_the_scores_is_refused_with_the_reason():
    """On the scores it divides by √Sk, which changes with the sequence length: not one scale."""
    q, k, v = S.var("q"), S.var("k"), S.var("v")
    y = S.batch_dot(S.softmax(S.contrib.div_sqrt_dim(S.batch_dot(q, k, transpose_b=True)), axis=-1), v)
    res = fusion.fuse(y, {}, {}, input_shapes={n: (2, 6, 8) for n in "qkv"})
    assert not ops(res).get("fused_attention")
    reasons = list(res.report.rules["attention"].rejected.values())
    assert any("divides the scores by the square root of the key length" in r for r in reasons), reasons


def test_div_sqrt_dim_of_a_q_that_is_not_a_projection_stays_outside():
    """q given as an input (N, S, D) with S = D by coincidence: the probes cannot grow D alone, so
    they cannot show that it is fixed -- only a projection's width says so.  The division is not
    folded into the op's scale (the reason is recorded); the attention fuses on the divided q, and
    matches at a shape with another D."""
    q, k = S.var("q"), S.var("k")
    y = S.batch_dot(S.softmax(S.batch_dot(S.contrib.div_sqrt_dim(q), k, transpose_b=True), axis=-1), k)
    res = fusion.fuse(y, {}, {}, input_shapes={"q": (6, 3, 3), "k": (6, 3, 3)})
    assert ops(res).get("fused_attention") == 1 and ops(res).get("_contrib_div_sqrt_dim") == 1
    rng = np.random.default_rng(0)
    for shape in ((6, 3, 3), (2, 5, 4)):
        inputs = {n: rng.standard_normal(shape).astype(np.float32) for n in "qk"}
        v = fusion.verify(y, res, ({}, {}), inputs=inputs)
        assert v.max_rel <= 1e-5, v
