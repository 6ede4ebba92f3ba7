"""Attention rules (patterns/attention.py): every written form fuses into one fused_attention, numbers unchanged."""
import math

import mxnet as mx
import numpy as np
import pytest

import fusion

from conftest import fuse_and_check, ops, random_params

S = mx.sym
N, SQ, SK, D = 6, 5, 7, 8
RULES = ["attention_fusion"]


def qkv_vars():
    return S.var("q"), S.var("k"), S.var("v")


SHAPES = {"q": (N, SQ, D), "k": (N, SK, D), "v": (N, SK, D)}


def assert_same(got, want, rtol, what=""):
    """NaN / inf where the original has them; finite values within ``rtol`` of the output's scale."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=what)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want), err_msg=what)
    fin = np.isfinite(want)
    if fin.any():
        scale = max(float(np.abs(want[fin]).max()), 1e-6)
        err = float(np.abs(got[fin] - want[fin]).max()) / scale
        assert err <= rtol, "%s: error %.3g of the scale %.3g" % (what, err, scale)


def _run(sym, values, train, head_seed):
    """Outputs (and, when ``train``, gradients of every float32 argument) of ``sym`` bound with the
    subgraph backend off."""
    from fusion.native.env import subgraph_backend

    args = {n: mx.nd.array(values[n], dtype=values[n].dtype) for n in sym.list_arguments()}
    grads = {n: mx.nd.zeros(a.shape) for n, a in args.items() if a.dtype == np.float32} if train else None
    with subgraph_backend(False):
        exe = sym.bind(mx.cpu(), args, args_grad=grads, grad_req="write" if train else "null")
    outs = [o.asnumpy() for o in exe.forward(is_train=train)]
    if not train:
        return outs, {}
    rng = np.random.default_rng(head_seed)
    exe.backward([mx.nd.array(rng.standard_normal(o.shape)) for o in outs])
    return outs, {n: g.asnumpy() for n, g in grads.items()}


def equivalent(sym, shapes, params=None, mode="inference", rules=RULES, others=(), make=None, fused=1,
               rtol=1e-5, grad_rtol=1e-4, seed=0):
    """Fuse ``sym`` at the input ``shapes``; then, at those shapes and at each shape dict of ``others``
    (the fused symbol bound at other batch sizes / sequence lengths), compare it with the unfused
    graph: outputs within ``rtol`` of their scale, NaN where the original has NaN, and in training
    mode the gradient of every float32 argument (inputs and parameters) within ``grad_rtol`` of its
    scale.  ``make(name, shape, rng)`` gives special inputs (masks, lengths; None: normal values).
    ``fused``: how many fused_attention ops the result must hold.  Returns the FusionResult."""
    params = {n: np.asarray(v, np.float32) for n, v in (params or {}).items()}
    rng = np.random.default_rng(seed)

    def inputs(shp):
        vals = {}
        for n, sh in shp.items():
            v = make(n, sh, rng) if make else None
            vals[n] = rng.standard_normal(sh).astype(np.float32) if v is None else v
        return vals

    first = inputs(shapes)
    res = fusion.fuse(sym, {n: mx.nd.array(v) for n, v in params.items()}, {}, input_shapes=shapes,
                      input_dtypes={n: str(v.dtype) for n, v in first.items()}, rules=rules, mode=mode)
    assert ops(res).get("fused_attention", 0) == fused, (ops(res), res.report.to_text(explain=True))
    train = mode == "training"
    for k, shp in enumerate([shapes] + list(others)):
        vals = dict(params, **(first if k == 0 else inputs(shp)))
        new = {n: v.asnumpy() for n, v in res.arg_params.items() if n not in params}
        want, wgrad = _run(sym, vals, train, k)
        got, ggrad = _run(res.symbol, dict(vals, **new), train, k)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, rtol, "output %d at %s" % (i, shp))
        for n, w in wgrad.items():
            assert_same(ggrad[n], w, grad_rtol, "gradient of %s at %s" % (n, shp))
    return res


def check_fused(y, shapes, rules=RULES, arg=None, aux=None, rtol=1e-5, expect=None, **kw):
    if arg is None:
        arg, aux = random_params(y, shapes)
    res = fuse_and_check(y, shapes, arg, aux, rtol=rtol, rules=rules, **kw)
    counts = ops(res)
    assert counts.get("fused_attention") == 1, res.report.to_text(explain=True)
    if expect is not None:
        assert counts == expect, counts
    return res


@pytest.mark.parametrize("scale", [
    lambda s: s / math.sqrt(D),
    lambda s: s * 0.3,
    lambda s: S.broadcast_div(s, S.var("temp")),
    lambda s: s,
])
def test_scores_scales(scale):
    q, k, v = qkv_vars()
    y = S.batch_dot(S.softmax(scale(S.batch_dot(q, k, transpose_b=True)), axis=-1), v)
    arg = {"temp": mx.nd.array([2.5])}
    check_fused(y, SHAPES, arg=arg, aux={}, expect={"fused_attention": 1})


def test_scale_on_q_and_gemm2_alpha():
    q, k, v = qkv_vars()
    s = S.linalg_gemm2(q * 0.5, k, transpose_b=True, alpha=0.25)
    y = S.linalg_gemm2(S.softmax(s, axis=-1), v)
    res = check_fused(y, SHAPES, expect={"fused_attention": 1})
    assert float(res.graph.op_nodes()[0].attrs["scale"]) == 0.125


def test_k_given_transposed_gets_a_swap():
    q, k, v = qkv_vars()
    kt = S.var("kt")
    y = S.batch_dot(S.softmax(S.batch_dot(q, kt) * 0.2, axis=-1), v)
    check_fused(y, {"q": (N, SQ, D), "kt": (N, D, SK), "v": (N, SK, D)}, expect={"SwapAxis": 1, "fused_attention": 1})


@pytest.mark.parametrize("mask_shape", [(N, SQ, SK), (N, 1, SK), (1, 1, SK)])
def test_additive_mask(mask_shape):
    q, k, v = qkv_vars()
    s = S.broadcast_add(S.batch_dot(q, k, transpose_b=True) * 0.3, S.var("mask"))
    y = S.batch_dot(S.Dropout(S.softmax(s, axis=-1), p=0.1), v)
    check_fused(y, dict(SHAPES, mask=mask_shape), expect={"fused_attention": 1})


def _attention_with(s_fn, extra_shapes, inputs):
    q, k, v = qkv_vars()
    y = S.batch_dot(s_fn(S.batch_dot(q, k, transpose_b=True) * 0.3), v)
    return y, dict(SHAPES, **extra_shapes)


def test_fully_masked_rows_match_unfused():
    q, k, v = qkv_vars()
    mask = np.zeros((N, SQ, SK), np.float32)
    mask[0, 1, :] = -1e9          # one fully masked row
    mask[1, :, 3:] = -1e9
    s = S.broadcast_add(S.batch_dot(q, k, transpose_b=True) * 0.3, S.var("mask"))
    y = S.batch_dot(S.softmax(s, axis=-1), v)
    res = fusion.fuse(y, rules=RULES, input_shapes=dict(SHAPES, mask=mask.shape))
    rng = np.random.default_rng(1)
    inputs = {n: rng.standard_normal(shp).astype(np.float32) for n, shp in SHAPES.items()}
    inputs["mask"] = mask
    v_ = fusion.verify(y, res, ({}, {}), inputs=inputs)
    assert v_.max_rel <= 1e-5 and ops(res) == {"fused_attention": 1}


def test_boolean_mask_with_where():
    q, k, v = qkv_vars()
    s = S.batch_dot(q, k, transpose_b=True) / math.sqrt(D)
    s = S.where(S.var("m"), s, S.ones_like(s) * -1e18)
    y = S.batch_dot(S.softmax(s, axis=-1), v)
    rng = np.random.default_rng(2)
    inputs = {n: rng.standard_normal(shp).astype(np.float32) for n, shp in SHAPES.items()}
    m = (rng.uniform(size=(N, SQ, SK)) > 0.3).astype(np.float32)
    m[2, 0, :] = 0                 # fully masked row: uniform average of v, as unfused
    inputs["m"] = m
    res = fusion.fuse(y, rules=RULES, input_shapes={n: a.shape for n, a in inputs.items()})
    assert ops(res) == {"fused_attention": 1}
    assert fusion.verify(y, res, ({}, {}), inputs=inputs).max_rel <= 1e-5


def test_valid_length_softmax():
    q, k, v = qkv_vars()
    s = S.batch_dot(q, k, transpose_b=True) * 0.3
    y = S.batch_dot(S.softmax(s, S.var("len"), axis=-1, use_length=True), v)
    rng = np.random.default_rng(3)
    inputs = {n: rng.standard_normal(shp).astype(np.float32) for n, shp in SHAPES.items()}
    lengths = rng.integers(0, SK + 1, size=(N, SQ)).astype(np.int32)
    lengths[0, 0] = 0
    res = fusion.fuse(y, rules=RULES)
    assert ops(res) == {"fused_attention": 1}
    import mxnet as mx_
    exe_inputs = dict(inputs, len=lengths)
    ref = S.Group([y]).bind(mx_.cpu(), {k_: mx_.nd.array(v_, dtype=v_.dtype) for k_, v_ in exe_inputs.items()}).forward()[0]
    out = res.symbol.bind(mx_.cpu(), {k_: mx_.nd.array(v_, dtype=v_.dtype) for k_, v_ in exe_inputs.items()}).forward()[0]
    np.testing.assert_allclose(out.asnumpy(), ref.asnumpy(), rtol=1e-5, atol=1e-6)


def test_training_mode_with_dropout_refused_without_dropout_allowed():
    q, k, v = qkv_vars()
    s = S.batch_dot(q, k, transpose_b=True) * 0.3
    y = S.batch_dot(S.Dropout(S.softmax(s, axis=-1), p=0.1), v)
    res = fusion.fuse(y, rules=RULES, mode="training")
    assert res.report.fused_count == 0
    assert "Dropout(p=0.1)" in list(res.report.rules["attention"].rejected.values())[0]
    y2 = S.batch_dot(S.softmax(s, axis=-1), v)
    assert fusion.fuse(y2, rules=RULES, mode="training").report.fused_count == 1


def test_backward_matches_unfused():
    q, k, v = qkv_vars()
    y = S.batch_dot(S.softmax(S.batch_dot(q, k, transpose_b=True) * 0.3, axis=-1), v)
    res = fusion.fuse(y, rules=RULES, mode="training")
    rng = np.random.default_rng(4)
    vals = {n: mx.nd.array(rng.standard_normal(shp)) for n, shp in SHAPES.items()}
    grads = []
    for sym in (y, res.symbol):
        g = {n: mx.nd.zeros(shp) for n, shp in SHAPES.items()}
        exe = sym.bind(mx.cpu(), dict(vals), args_grad=g)
        exe.forward(is_train=True)
        exe.backward(mx.nd.ones((N, SQ, D)))
        grads.append({n: a.asnumpy() for n, a in g.items()})
    for n in SHAPES:
        np.testing.assert_allclose(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- refusals

def test_scores_used_elsewhere_not_fused():
    q, k, v = qkv_vars()
    s = S.batch_dot(q, k, transpose_b=True) * 0.3
    y = S.Group([S.batch_dot(S.softmax(s, axis=-1), v), s])
    res = fusion.fuse(y, rules=RULES)
    assert res.report.fused_count == 0
    assert "graph output" in list(res.report.rules["attention"].rejected.values())[0]


def test_non_constant_scale_not_fused():
    q, k, v = qkv_vars()
    s = S.broadcast_mul(S.batch_dot(q, k, transpose_b=True), S.exp(S.var("t")))
    y = S.batch_dot(S.softmax(s, axis=-1), v)
    res = fusion.fuse(y, rules=RULES)
    assert res.report.fused_count == 0
    assert "must be a parameter" in res.report.rules["attention"].near_misses[res.graph.nodes[-1].name]


def test_softmax_over_wrong_axis_not_fused():
    q, k, v = qkv_vars()
    y = S.batch_dot(S.softmax(S.batch_dot(q, k, transpose_b=True), axis=1), S.var("v2"))
    res = fusion.fuse(y, rules=RULES)
    assert res.report.fused_count == 0
    assert "axis 1" in list(res.report.rules["attention"].rejected.values())[0]


# ---------------------------------------------------------------- multi-head layouts

B, L, LK, H, HD = 2, 5, 7, 3, 4
E = H * HD
HEAD_RULES = ["attention_fusion", "attention_heads"]


def split_std(t):
    return S.reshape(S.transpose(S.reshape(t, shape=(0, 0, H, -1)), axes=(0, 2, 1, 3)), shape=(-3, 0, 0))


def split_codes(t):
    t = S.reshape(t, shape=(0, 0, -4, H, -1))
    return S.reshape(S.swapaxes(t, dim1=1, dim2=2), shape=(-1, 0, 0), reverse=True)


def merge_std(o):
    return S.reshape(S.transpose(S.reshape(o, shape=(-4, -1, H, 0, 0)), axes=(0, 2, 1, 3)), shape=(0, 0, -3))


def merge_codes(o):
    return S.reshape(S.swapaxes(S.reshape(o, shape=(-1, H, 0, 0), reverse=True), dim1=1, dim2=2), shape=(0, 0, -1))


def mha(split, merge, cross=False, mask=False):
    x = S.var("x")
    mem = S.var("mem") if cross else x
    fc = lambda t, n: S.FullyConnected(t, num_hidden=E, flatten=False, name=n)
    q, k, v = split(fc(x, "q")), split(fc(mem, "k")), split(fc(mem, "v"))
    s = S.batch_dot(q, k, transpose_b=True) / math.sqrt(HD)
    if mask:
        s = S.broadcast_add(s, S.var("mask"))
    return fc(merge(S.batch_dot(S.softmax(s, axis=-1), v)), "o")


@pytest.mark.parametrize("split,merge", [(split_std, merge_std), (split_codes, merge_codes), (split_std, merge_codes)])
def test_head_split_and_merge_disappear(split, merge):
    y = mha(split, merge)
    res = check_fused(y, {"x": (B, L, 10)}, rules=HEAD_RULES)
    counts = ops(res)
    assert counts == {"FullyConnected": 4, "fused_attention": 1}, counts
    attn = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert attn.attrs["layout"] == "bshd" and attn.attrs["heads"] == H


def test_cross_attention_with_mask():
    y = mha(split_std, merge_std, cross=True, mask=True)
    res = check_fused(y, {"x": (B, L, 10), "mem": (B, LK, 9), "mask": (B * H, 1, LK)}, rules=HEAD_RULES)
    assert ops(res) == {"FullyConnected": 4, "fused_attention": 1}


def test_packed_qkv_projection():
    x = S.var("x")
    qkv = S.FullyConnected(x, num_hidden=3 * E, flatten=False, name="qkv")
    parts = S.split(qkv, num_outputs=3, axis=-1)
    q, k, v = (split_std(parts[i]) for i in range(3))
    y = merge_std(S.batch_dot(S.softmax(S.batch_dot(q, k, transpose_b=True) * 0.5, axis=-1), v))
    res = check_fused(y, {"x": (B, L, 10)}, rules=HEAD_RULES)
    assert ops(res) == {"FullyConnected": 1, "fused_attention": 1}
    attn = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert attn.attrs["layout"] == "packed_qkv"


def test_reshape_that_changes_head_order_is_not_folded():
    def bad_split(t):            # (B, S, D, H): heads taken from the wrong factor of the width
        return S.reshape(S.transpose(S.reshape(t, shape=(0, 0, -1, H)), axes=(0, 3, 1, 2)), shape=(-3, 0, 0))
    y = mha(bad_split, merge_std)
    res = fuse_and_check(y, {"x": (B, L, 10)}, rules=HEAD_RULES, rtol=1e-5)
    assert ops(res)["fused_attention"] == 1 and ops(res).get("transpose")   # core fused, layout kept
    reasons = list(res.report.rules["attention_heads"].rejected.values())
    assert reasons and "not the head split" in reasons[0]


def test_merge_that_hard_codes_the_heads_as_the_batch_factor_is_refused():
    """(-4, H, -1) splits B·H as (H, B), not (B, H): the same as the merge at batch 1 only.  The rule
    runs the chain at other sizes too, and refuses it there, where it gives something else."""
    def head_first_merge(o):
        return S.reshape(S.transpose(S.reshape(o, shape=(-4, H, -1, 0, 0)), axes=(1, 2, 0, 3)), shape=(0, 0, -3))
    y = mha(split_std, head_first_merge)
    res = fuse_and_check(y, {"x": (1, L, 10)}, rules=HEAD_RULES, rtol=1e-5)
    reasons = list(res.report.rules["attention_heads"].rejected.values())
    assert reasons and "the head split/merge at batch 1 only (at batch 2: the output chain is not the merge of %d heads" % H in reasons[0]
    arg = {k: v for k, v in res.arg_params.items()}
    x2 = np.random.default_rng(3).standard_normal((B, L, 10)).astype(np.float32)
    assert fusion.verify(y, res, (arg, res.aux_params), inputs={"x": x2}).max_rel <= 1e-5   # batch 2 as well


def test_split_that_hard_codes_the_sequence_length_is_planned_at_the_real_sizes():
    """A chain MXNet can run only at the graph's own sequence length (a Reshape naming it) is checked
    at the real sizes instead."""
    seq = 6

    def split_fixed(t):
        return S.reshape(S.transpose(S.reshape(t, shape=(0, seq, H, -1)), axes=(0, 2, 1, 3)), shape=(-3, 0, 0))
    y = mha(split_fixed, merge_std)
    res = check_fused(y, {"x": (B, seq, 10)}, rules=HEAD_RULES)
    assert ops(res) == {"FullyConnected": 4, "fused_attention": 1}, res.report.to_text()


def test_interleaved_selfatt_with_valid_length():
    x = S.var("x")
    qkv = S.FullyConnected(x, num_hidden=3 * E, flatten=False, name="qkv")      # (L, B, 3E)
    s = S.contrib.interleaved_matmul_selfatt_qk(qkv, heads=H)
    p = S.softmax(s, S.var("len"), axis=-1, use_length=True)
    y = S.contrib.interleaved_matmul_selfatt_valatt(qkv, S.Dropout(p, p=0.1), heads=H)
    rng = np.random.default_rng(5)
    arg, aux = random_params(y, {"x": (L, B, 10), "len": (B * H, L)}, inputs={"x", "len"})
    res = fusion.fuse(y, arg, aux, rules=["attention_fusion"])
    assert ops(res) == {"FullyConnected": 1, "fused_attention": 1}, res.report.to_text()
    inputs = {"x": rng.standard_normal((L, B, 10)).astype(np.float32),
              "len": np.repeat(rng.integers(1, L + 1, size=(B * H, 1)), L, axis=1).astype(np.int32)}
    assert fusion.verify(y, res, (arg, aux), inputs=inputs).max_rel <= 1e-5


def test_interleaved_encdec():
    x, mem = S.var("x"), S.var("mem")
    q = S.FullyConnected(x, num_hidden=E, flatten=False, name="q")
    kv = S.FullyConnected(mem, num_hidden=2 * E, flatten=False, name="kv")
    s = S.contrib.interleaved_matmul_encdec_qk(q, kv, heads=H)
    y = S.contrib.interleaved_matmul_encdec_valatt(kv, S.softmax(s, axis=-1), heads=H)
    res = check_fused(y, {"x": (L, B, 10), "mem": (LK, B, 6)}, rules=["attention_fusion"])
    assert ops(res) == {"FullyConnected": 2, "fused_attention": 1}


def test_four_dimensional_gemm2_attention_with_head_mask():
    # (B, H, S, D) operands straight into linalg_gemm2, a (B, 1, 1, Sk) padding mask
    q, k, v = qkv_vars()
    s = S.broadcast_add(S.linalg_gemm2(q, k, transpose_b=True, alpha=0.25), S.var("mask"))
    y = S.linalg_gemm2(S.softmax(s, axis=-1), v)
    shapes = {"q": (2, 3, SQ, D), "k": (2, 3, SK, D), "v": (2, 3, SK, D), "mask": (2, 1, 1, SK)}
    res = check_fused(y, shapes, expect={"fused_attention": 1})
    assert res.graph.op_nodes()[0].attrs["layout"] == "plain"


def test_positions_taken_off_the_scores_move_to_q_and_k():
    q, k, v = qkv_vars()
    s = S.batch_dot(q, k, transpose_b=True) * 0.3
    causal = S.broadcast_lesser_equal(S.reshape(S.contrib.arange_like(s, axis=-1), shape=(1, -1)),
                                      S.reshape(S.contrib.arange_like(s, axis=1), shape=(-1, 1)))
    y = S.batch_dot(S.softmax(S.broadcast_add(s, S.expand_dims((1 - causal) * -1e9, axis=0)), axis=-1), v)
    shapes = {"q": (N, SQ, D), "k": (N, SQ, D), "v": (N, SQ, D)}
    res = check_fused(y, shapes, rules=["scores_shape", "attention_fusion"])
    assert len(res.report.rules["scores_shape"].fused) == 2
    # an arange over the feature axis of the scores is not a position: left alone, with the reason
    y2 = S.Group([y, S.contrib.arange_like(s, axis=0)])
    res2 = fusion.fuse(y2, rules=["scores_shape"], input_shapes=shapes)
    assert any("not a query/key position axis" in r for r in res2.report.rules["scores_shape"].rejected.values())


def test_causal_mask_recognized_only_when_exactly_causal():
    q, k, v = qkv_vars()
    shapes = {"q": (N, SQ, D), "k": (N, SQ, D), "v": (N, SQ, D)}
    s = S.batch_dot(q, k, transpose_b=True) * 0.3
    steps = S.contrib.arange_like(q, axis=1)
    lower = S.broadcast_lesser_equal(S.reshape(steps, shape=(1, -1)), S.reshape(steps, shape=(-1, 1)))
    for allowed, causal in ((lower, True), (1 - lower, False)):      # the second one looks ahead: not causal
        y = S.batch_dot(S.softmax(S.broadcast_add(s, S.expand_dims((1 - allowed) * -1e9, axis=0)), axis=-1), v)
        res = check_fused(y, shapes)
        node = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
        assert node.param("causal", False) is causal
        assert node.attrs["mask_kind"] == ("none" if causal else "additive")
    # a mask that depends on the data is never taken for causal, even if it happens to look so
    m = S.broadcast_mul(S.broadcast_lesser_equal(S.reshape(steps, shape=(1, -1)), S.reshape(steps, shape=(-1, 1))),
                        S.reshape(S.sum(S.var("gate") > 0) > 0, shape=(1, 1)))
    y = S.batch_dot(S.softmax(S.broadcast_add(s, S.expand_dims((1 - m) * -1e9, axis=0)), axis=-1), v)
    res = check_fused(y, dict(shapes, gate=(3,)))
    node = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert node.attrs["mask_kind"] == "additive"


def test_interleaved_head_size_unknown_is_explained():
    qkv = S.var("qkv")                       # not a projection, and no shapes given: the head size is unknown
    s = S.contrib.interleaved_matmul_selfatt_qk(qkv, heads=H)
    y = S.contrib.interleaved_matmul_selfatt_valatt(qkv, S.softmax(s, axis=-1), heads=H)
    res = fusion.fuse(y, rules=["attention_fusion"])
    assert res.report.fused_count == 0
    assert "head size is unknown" in list(res.report.rules["attention_interleaved"].rejected.values())[0]
    # with the shape given it is known here, but the graph takes any width: MXNet's op scales by
    # 1/√(head size) at run time, which a constant cannot follow
    res = fusion.fuse(y, rules=["attention_fusion"], input_shapes={"qkv": (L, B, 3 * E)})
    assert res.report.fused_count == 0
    assert "head size changes with the width" in list(res.report.rules["attention_interleaved"].rejected.values())[0]
    # a projection fixes the width: it fuses
    x = S.var("x")
    qkv = S.FullyConnected(x, num_hidden=3 * E, flatten=False, name="proj")
    s = S.contrib.interleaved_matmul_selfatt_qk(qkv, heads=H)
    y = S.contrib.interleaved_matmul_selfatt_valatt(qkv, S.softmax(s, axis=-1), heads=H)
    res = check_fused(y, {"x": (L, B, E)}, rules=["attention_fusion"])


def test_fuse_of_the_fused_graph_fires_nothing_with_a_hard_coded_block_beside_an_interleaved_one():
    """A packed attention whose head split names the sequence length (the graph takes no other
    length) beside an interleaved one over an input whose width 3E is also the packed projection's
    width.  The graph takes other widths of that input, where MXNet's op scales by another 1/√(head
    size): the interleaved block is refused.  Fusing the packed block removes its Reshape naming
    the length; fusing the fused graph again must still see the other widths and refuse the same."""
    seq = 6

    def split_fixed(t):
        return S.reshape(S.transpose(S.reshape(t, shape=(0, seq, H, -1)), axes=(0, 2, 1, 3)), shape=(-3, 0, 0))
    x = S.var("x")
    parts = S.split(S.FullyConnected(x, num_hidden=3 * E, flatten=False, name="qkv"), num_outputs=3, axis=-1)
    q, k, v = (split_fixed(parts[i]) for i in range(3))
    packed = merge_std(S.batch_dot(S.softmax(S.batch_dot(q, k, transpose_b=True) * 0.5, axis=-1), v))
    packed = S.FullyConnected(packed, num_hidden=E, flatten=False, name="o")
    inter = S.var("inter")                              # (L, B, 3E): any width MXNet's op takes
    s = S.contrib.interleaved_matmul_selfatt_qk(inter, heads=H)
    y = S.Group([packed, S.contrib.interleaved_matmul_selfatt_valatt(inter, S.softmax(s, axis=-1), heads=H)])
    shapes = {"x": (B, seq, 10), "inter": (L, B, 3 * E)}
    arg, aux = random_params(y, shapes)
    res = fusion.fuse(y, arg, aux, input_shapes=shapes, rules=HEAD_RULES)
    assert ops(res).get("fused_attention") == 1, res.report.to_text(explain=True)
    reasons = list(res.report.rules["attention_interleaved"].rejected.values())
    assert reasons and "head size changes with the width of 'inter'" in reasons[0], reasons
    again = fusion.fuse(res.symbol, res.arg_params, res.aux_params, input_shapes=shapes, rules=HEAD_RULES)
    assert again.report.fused_count == 0, again.report.to_text()
    assert again.symbol.tojson() == res.symbol.tojson()
    rng = np.random.default_rng(2)
    inputs = {n: rng.standard_normal(sh).astype(np.float32) for n, sh in shapes.items()}
    assert fusion.verify(y, again, (arg, aux), inputs=inputs).max_rel <= 1e-5
