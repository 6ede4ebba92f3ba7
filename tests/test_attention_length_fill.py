"""GluonNLP's masked softmax, softmax(where(m, s, c)) * m with m = (key < valid_length), → fused_attention
valid_length with length_fill (patterns/attention.py, cuda_kernels/fused_attention/README.md)."""
import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.ir.graph import Graph

from conftest import ops
from test_attention import _run, assert_same, equivalent

S = mx.sym
B, SEQ, E, H = 2, 6, 16, 2


# ---------------------------------------------------------------- graphs in GluonNLP's spelling (and variants)

def key_mask(x, vl, form="gluonnlp", heads=H):
    """The (B·H, S, S) mask GluonNLP's TransformerEncoder + MultiHeadAttentionCell build from valid_length."""
    steps = S.contrib.arange_like(x, axis=1)
    if form == "int":
        k = S.broadcast_lesser(S.Cast(steps, dtype="int32").reshape((1, -1)), vl.reshape((-1, 1)))
        k = S.Cast(k, dtype="float32")
    elif form == "greater":
        k = S.broadcast_greater(vl.reshape((-1, 1)), steps.reshape((1, -1)))
    elif form == "query":        # the lengths along the queries: not a key mask
        k = S.broadcast_lesser(steps.reshape((1, -1)), vl.reshape((-1, 1)))
        ones = S.ones_like(steps)
        m = S.broadcast_mul(S.expand_dims(k, axis=2), S.broadcast_mul(ones, ones.reshape((-1, 1))))
        return S.broadcast_axis(S.expand_dims(m, axis=1), axis=1, size=heads).reshape((-1, 0, 0), reverse=True)
    elif form == "start1":       # positions 1 … S: keys < length - 1
        k = S.broadcast_lesser(S.contrib.arange_like(x, axis=1, start=1).reshape((1, -1)), vl.reshape((-1, 1)))
    else:
        k = S.broadcast_lesser(steps.reshape((1, -1)), vl.reshape((-1, 1)))
    if form == "broadcast_like":
        m = S.broadcast_like(S.expand_dims(k, axis=1), S.batch_dot(x, x, transpose_b=True), lhs_axes=(1,), rhs_axes=(1,))
    else:
        ones = S.ones_like(steps)
        m = S.broadcast_mul(S.expand_dims(k, axis=1), S.broadcast_mul(ones, ones.reshape((-1, 1))))
    if form == "twice":
        m = m * 2
    elif form == "times_twos":     # a product with a tensor of shapes only, of twos
        m = S.broadcast_mul(m, 2 * S.ones_like(m))
    return S.broadcast_axis(S.expand_dims(m, axis=1), axis=1, size=heads).reshape((-1, 0, 0), reverse=True)


def encoder_attention(form="gluonnlp", mul="elemwise", order="pm", dropout=False, fill=-1e18, other_mask=False):
    """One GluonNLP MultiHeadAttentionCell(DotProductAttentionCell) on x (B, S, E) with its mask."""
    x, vl = S.var("x"), S.var("vl", dtype="int32" if form == "int" else None)
    mask = key_mask(x, vl, form)

    def proj(name):
        y = S.FullyConnected(x, num_hidden=E, no_bias=True, flatten=False, name=name)
        y = S.transpose(y.reshape((0, 0, H, -1)), axes=(0, 2, 1, 3))
        return y.reshape((-1, 0, 0), reverse=True)

    q, k, v = S.contrib.div_sqrt_dim(proj("q")), proj("k"), proj("v")
    s = S.batch_dot(q, k, transpose_b=True)
    s = S.where(mask, s, fill * S.ones_like(s))
    p = S.softmax(s, axis=-1)
    m2 = key_mask(x, S.var("vl2"), "gluonnlp") if other_mask else mask
    f = S.elemwise_mul if mul == "elemwise" else S.broadcast_mul
    p = f(p, m2) if order == "pm" else f(m2, p)
    if dropout:
        p = S.Dropout(p, p=0.1)
    o = S.batch_dot(p, v)
    o = S.transpose(o.reshape((-1, H, 0, 0), reverse=True), axes=(0, 2, 1, 3)).reshape((0, 0, -1))
    return S.FullyConnected(o, num_hidden=E, no_bias=True, flatten=False, name="proj")


def params_of(sym, shapes, seed=0):
    rng = np.random.default_rng(seed)
    arg_shapes, _, _ = sym.infer_shape(**shapes)
    return {n: rng.standard_normal(s).astype(np.float32) * 0.5
            for n, s in zip(sym.list_arguments(), arg_shapes) if n not in shapes}


def lengths(dtype="float32"):
    def make(name, shape, rng):
        if name in ("vl", "vl2"):
            sk = SEQ if shape[0] == B else 9
            vals = np.concatenate([[0, sk], rng.integers(0, sk + 1, shape[0])])[:shape[0]]
            if dtype == "float32" and shape[0] > 2:
                vals = vals + 0.5 * (np.arange(shape[0]) % 2)    # fractional: keys j < 2.5 are 0, 1, 2
            return vals.astype(dtype)
        return None
    return make


SHAPES = {"x": (B, SEQ, E), "vl": (B,)}
OTHERS = [{"x": (3, 9, E), "vl": (3,)}]


# ---------------------------------------------------------------- fused and equal

@pytest.mark.parametrize("form", ["gluonnlp", "greater", "broadcast_like", "int"])
@pytest.mark.parametrize("mul,order", [("elemwise", "pm"), ("elemwise", "mp"), ("broadcast", "pm")])
def test_gluonnlp_masked_softmax_fuses(form, mul, order):
    sym = encoder_attention(form, mul, order)
    res = equivalent(sym, SHAPES, params_of(sym, SHAPES), rules=None, others=OTHERS,
                     make=lengths("int32" if form == "int" else "float32"))
    f = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert f.param("mask_kind") == "valid_length" and f.param("length_fill") is True, f.attrs
    assert float(f.param("mask_value")) == -1e18
    assert f.param("layout") == "packed_qkv" or f.param("layout") == "bshd", f.attrs
    assert "where" not in ops(res) and "softmax" not in ops(res), ops(res)


def test_dropout_after_the_product_and_another_fill():
    sym = encoder_attention(dropout=True, fill=-1e4)
    res = equivalent(sym, SHAPES, params_of(sym, SHAPES), rules=None, others=OTHERS, make=lengths())
    f = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert float(f.param("mask_value")) == -1e4


def test_length_zero_rows_give_zero_as_gluonnlp():
    sym = encoder_attention()
    shapes = {"x": (3, SEQ, E), "vl": (3,)}
    prm = params_of(sym, shapes)
    res = fusion.fuse(sym, {n: mx.nd.array(v) for n, v in prm.items()}, {}, input_shapes=shapes)
    assert ops(res).get("fused_attention") == 1
    rng = np.random.default_rng(3)
    vals = dict(prm, x=rng.standard_normal(shapes["x"]).astype(np.float32), vl=np.array([0, 3, 0], np.float32))
    want, _ = _run(sym, vals, False, 0)
    got, _ = _run(res.symbol, dict(vals, **{n: v.asnumpy() for n, v in res.arg_params.items()}), False, 0)
    assert_same(got[0], want[0], 1e-5)
    assert np.abs(want[0][0]).max() == 0 and np.abs(got[0][0]).max() == 0


# ---------------------------------------------------------------- GluonNLP's decoder: query lengths times the causal band

def decoder_attention(band="lesser_equal", order="lengths_first"):
    """TransformerDecoder's self-attention mask: (i < valid_length_b) · (j ≤ i), repeated over the heads."""
    x, vl = S.var("x"), S.var("vl")
    steps = S.contrib.arange_like(x, axis=1)
    cmp = getattr(S, "broadcast_" + band)
    causal = cmp(steps.reshape((1, -1)), steps.reshape((-1, 1)))
    rows = S.expand_dims(S.broadcast_lesser(steps.reshape((1, -1)), vl.reshape((-1, 1))), -1)
    mask = S.broadcast_mul(rows, S.expand_dims(causal, 0)) if order == "lengths_first" else \
        S.broadcast_mul(S.expand_dims(causal, 0), rows)
    mask = S.broadcast_axis(S.expand_dims(mask, axis=1), axis=1, size=H).reshape((-1, 0, 0), reverse=True)

    def proj(name):
        y = S.FullyConnected(x, num_hidden=E, no_bias=True, flatten=False, name=name)
        return S.transpose(y.reshape((0, 0, H, -1)), axes=(0, 2, 1, 3)).reshape((-1, 0, 0), reverse=True)

    s = S.batch_dot(S.contrib.div_sqrt_dim(proj("q")), proj("k"), transpose_b=True)
    p = S.softmax(S.where(mask, s, -1e18 * S.ones_like(s)), axis=-1) * mask
    o = S.batch_dot(p, proj("v"))
    return S.transpose(o.reshape((-1, H, 0, 0), reverse=True), axes=(0, 2, 1, 3)).reshape((0, 0, -1))


@pytest.mark.parametrize("order", ["lengths_first", "band_first"])
def test_gluonnlp_decoder_self_attention_fuses_causal(order):
    sym = decoder_attention(order=order)
    res = equivalent(sym, SHAPES, params_of(sym, SHAPES), rules=None, others=OTHERS, make=lengths())
    f = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert f.param("causal") is True and f.param("length_fill") is True, f.attrs


def test_decoder_band_of_another_diagonal_fuses_as_any_mask():
    """j < i (the diagonal masked too): not the op's causal band — the mask itself, mask_kind boolean."""
    sym = decoder_attention(band="lesser")
    res = equivalent(sym, SHAPES, params_of(sym, SHAPES), rules=None, others=OTHERS, make=lengths())
    f = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert f.param("mask_kind") == "boolean" and not f.param("causal", False), f.attrs


def test_unfuse_gives_the_decoder_mask_back():
    sym = decoder_attention()
    prm = params_of(sym, SHAPES)
    res = fusion.fuse(sym, {n: mx.nd.array(v) for n, v in prm.items()}, {}, input_shapes=SHAPES)
    assert ops(res).get("fused_attention") == 1
    plain = fusion.unfuse(res.symbol, input_shapes=SHAPES, arg_params=res.arg_params, aux_params={})
    assert not any(op.startswith("fused_") for op in Graph.from_symbol(plain).count_ops())
    rng = np.random.default_rng(2)
    fused_params = {n: v.asnumpy() for n, v in res.arg_params.items()}
    for shp in [SHAPES] + OTHERS:
        vals = dict(fused_params, x=rng.standard_normal(shp["x"]).astype(np.float32),
                    vl=np.concatenate([[0], rng.integers(0, shp["x"][1] + 1, shp["vl"][0] - 1)]).astype(np.float32))
        want, _ = _run(sym, dict(prm, **vals), False, 0)
        got, _ = _run(plain, {n: vals[n] for n in plain.list_arguments()}, False, 0)
        assert_same(got[0], want[0], 1e-5, str(shp))


# ---------------------------------------------------------------- refused, with the reason

def _attention_reasons(res):
    return list(res.report.rules["attention"].rejected.values())


@pytest.mark.parametrize("form", ["query", "twice", "times_twos", "start1"])
def test_near_misses_of_the_length_mask_fuse_as_any_mask(form):
    """Not a key-length mask (query lengths, 2·m, positions from 1): the general form, mask_kind boolean
    with length_fill — where(m, s, c), then the probabilities times m's values (twice: 2·p)."""
    sym = encoder_attention(form)
    res = equivalent(sym, SHAPES, params_of(sym, SHAPES), rules=None, others=OTHERS, make=lengths())
    f = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert f.param("mask_kind") == "boolean" and f.param("length_fill") is True, f.attrs
    assert "softmax" not in ops(res), ops(res)


def test_probabilities_times_another_mask_are_refused():
    sym = encoder_attention(other_mask=True)
    shapes = dict(SHAPES, vl2=(B,))
    prm = params_of(sym, shapes)
    res = fusion.fuse(sym, {n: mx.nd.array(v) for n, v in prm.items()}, {}, input_shapes=shapes)
    assert "fused_attention" not in ops(res)
    assert any("not by the where() condition" in r for r in _attention_reasons(res)), _attention_reasons(res)


def test_training_and_gpu_are_refused():
    sym = encoder_attention()
    prm = params_of(sym, SHAPES)
    res = fusion.fuse(sym, {n: mx.nd.array(v) for n, v in prm.items()}, {}, input_shapes=SHAPES, mode="training")
    assert "fused_attention" not in ops(res)
    assert any("no backward" in r for r in _attention_reasons(res)), _attention_reasons(res)


def _data_mask_attention(cond_shape=None, mul=S.elemwise_mul):
    q, k, v, a, bb = (S.var(n) for n in "qkvab")
    m = S.broadcast_lesser(a, bb) if cond_shape is None else S.var("m")
    s = S.batch_dot(q, k, transpose_b=True)
    p = mul(S.softmax(S.where(m, s, -1e18 * S.ones_like(s)), axis=-1), m)
    return S.batch_dot(p, v)


def test_mask_compared_from_data_fuses_as_any_mask():
    """where(m, s, c) * m with m compared from two data values: not a length mask, the general form."""
    sym = _data_mask_attention()
    shapes = {"q": (4, 5, 8), "k": (4, 6, 8), "v": (4, 6, 8), "a": (4, 5, 6), "b": (4, 5, 6)}
    res = equivalent(sym, shapes, {}, rules=None,
                     others=[{"q": (2, 3, 8), "k": (2, 9, 8), "v": (2, 9, 8), "a": (2, 3, 9), "b": (2, 3, 9)}])
    f = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert f.param("mask_kind") == "boolean" and f.param("length_fill") is True, f.attrs


def test_mask_where_reads_rows_and_the_product_columns_is_refused():
    """A 1-D condition: MXNet's where() selects whole rows with it, broadcast_mul multiplies the keys'
    columns by it (Sk = N here) — not one mask of the scores' shape."""
    sym = _data_mask_attention(cond_shape=(4,), mul=S.broadcast_mul)
    shapes = {"q": (4, 5, 8), "k": (4, 4, 8), "v": (4, 4, 8), "m": (4,)}
    res = fusion.fuse(sym, {}, {}, input_shapes=shapes)
    assert "fused_attention" not in ops(res)
    assert any("is not the scores' shape" in r for r in _attention_reasons(res)), _attention_reasons(res)


# ---------------------------------------------------------------- the op's edges, against the unfused graph

def reference(q, k, v, lengths, scale, c):
    n, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    m = (np.arange(sk)[None, None, :] < lengths[:, None, None]).astype(np.float32) * np.ones((n, sq, sk), np.float32)
    qs, ks, vs, ms = (S.var(t) for t in ("q", "k", "v", "m"))
    s = S.batch_dot(qs, ks, transpose_b=True) * scale
    p = S.softmax(S.where(ms, s, c * S.ones_like(s)), axis=-1) * ms
    out, _ = _run(S.batch_dot(p, vs), {"q": q, "k": k, "v": v, "m": m}, False, 0)
    return out[0]


def fused_op(q, k, v, lengths, scale, c):
    qs, ks, vs, ls = (S.var(t) for t in ("q", "k", "v", "l"))
    y = S.fused_attention(qs, ks, vs, ls, mask_kind="valid_length", length_fill=True, mask_value=c, scale=scale)
    out, _ = _run(y, {"q": q, "k": k, "v": v, "l": lengths}, False, 0)
    return out[0]


@pytest.mark.parametrize("case", ["plain", "huge_negative_scores", "all_minus_inf", "nan_and_inf",
                                  "non_finite_v_past_length", "long"])
def test_op_edges_as_the_unfused_graph(case):
    rng = np.random.default_rng(1)
    n, sq, sk, d = 5, 4, 300 if case == "long" else 7, 8
    q, k, v = (rng.standard_normal((n, s_, d)).astype(np.float32) for s_ in (sq, sk, sk))
    lengths = np.array([0, 3, sk, 1, 5], np.float32)
    scale, c = 0.4, -1e18
    if case == "huge_negative_scores":     # every visible score far below c: the filled keys win the softmax
        q[1] = 1e10
        k[1] = -1e10
        c = -1e4
    elif case == "all_minus_inf":
        q[3] = np.inf
        k[3, :, 0] = -1
        k[3, :, 1:] = 0
        q[3, :, 1:] = 0
    elif case == "nan_and_inf":
        q[1, 0, 0] = np.nan
        k[2, 3, 1] = np.inf
    elif case == "non_finite_v_past_length":
        v[1, 5, 2] = np.inf
        v[4, 6, 3] = np.nan
        v[0, 2, 0] = -np.inf
    assert_same(fused_op(q, k, v, lengths, scale, c), reference(q, k, v, lengths, scale, c), 1e-5, case)


def reference_any_mask(q, k, v, m, scale, c):
    qs, ks, vs, ms = (S.var(t) for t in ("q", "k", "v", "m"))
    s = S.batch_dot(qs, ks, transpose_b=True) * scale
    p = S.softmax(S.where(ms, s, c * S.ones_like(s)), axis=-1) * ms
    out, _ = _run(S.batch_dot(p, vs), {"q": q, "k": k, "v": v, "m": m}, False, 0)
    return out[0]


def fused_any_mask(q, k, v, m, scale, c):
    qs, ks, vs, ms = (S.var(t) for t in ("q", "k", "v", "m"))
    y = S.fused_attention(qs, ks, vs, ms, mask_kind="boolean", length_fill=True, mask_value=c, scale=scale)
    out, _ = _run(y, {"q": q, "k": k, "v": v, "m": m}, False, 0)
    return out[0]


@pytest.mark.parametrize("case", ["zeros_ones", "any_values", "fully_masked_rows", "huge_negative_scores",
                                  "non_finite_v_where_masked", "nan_mask", "long"])
def test_any_mask_op_edges_as_the_unfused_graph(case):
    """mask_kind boolean with length_fill: softmax(where(m, s, c)) * m for any m."""
    rng = np.random.default_rng(4)
    n, sq, sk, d = 5, 4, 300 if case == "long" else 7, 8
    q, k, v = (rng.standard_normal((n, s_, d)).astype(np.float32) for s_ in (sq, sk, sk))
    m = (rng.random((n, sq, sk)) < 0.6).astype(np.float32)
    scale, c = 0.4, -1e18
    if case == "any_values":
        m = m * rng.choice([1.0, 2.0, -0.5, 0.25], (n, sq, sk)).astype(np.float32)
    elif case == "fully_masked_rows":
        m[1] = 0
        m[3, 2] = 0
    elif case == "huge_negative_scores":
        q[1] = 1e10
        k[1] = -1e10
        c = -1e4
    elif case == "non_finite_v_where_masked":
        m[:, :, 2] = 0
        v[1, 2, 1] = np.inf
        v[4, 2, 3] = np.nan
    elif case == "nan_mask":
        m[2, 1, 3] = np.nan
    assert_same(fused_any_mask(q, k, v, m, scale, c), reference_any_mask(q, k, v, m, scale, c), 1e-5, case)


def test_op_refuses_what_it_cannot_compute():
    q, lens = mx.nd.ones((2, 3, 4)), mx.nd.array([1, 2])
    for attrs, message in [(dict(mask_kind="additive", mask_value=-1e9), "only used with mask_kind='valid_length'"),
                           (dict(mask_kind="boolean", mask_value=-1e9, causal=True), "takes no causal band"),
                           (dict(mask_kind="valid_length"), "needs a finite mask_value"),
                           (dict(mask_kind="valid_length", mask_value=float("-inf")), "needs a finite mask_value")]:
        with pytest.raises(mx.base.MXNetError, match=message):
            mx.nd.fused_attention(q, q, q, lens, length_fill=True, scale=1.0, **attrs).wait_to_read()
    qs, ks, vs, ls = (S.var(t) for t in ("q", "k", "v", "l"))
    shapes = {"q": (2, 3, 4), "k": (2, 3, 4), "v": (2, 3, 4), "l": (2,)}
    y = S.fused_attention(qs, ks, vs, ls, mask_kind="valid_length", length_fill=True, mask_value=-1e18, scale=1.0)
    args = {n: mx.nd.ones(s) for n, s in shapes.items()}
    exe = y.bind(mx.cpu(), args, args_grad={n: mx.nd.zeros(s) for n, s in shapes.items()})
    exe.forward(is_train=True)
    with pytest.raises(mx.base.MXNetError, match="no backward"):
        exe.backward([mx.nd.ones((2, 3, 4))])
        mx.nd.waitall()


# ---------------------------------------------------------------- unfuse, ONNX

def test_unfuse_gives_the_masked_softmax_back():
    sym = encoder_attention()
    prm = params_of(sym, SHAPES)
    res = fusion.fuse(sym, {n: mx.nd.array(v) for n, v in prm.items()}, {}, input_shapes=SHAPES)
    assert ops(res).get("fused_attention") == 1
    fused_params = {n: v.asnumpy() for n, v in res.arg_params.items()}
    plain = fusion.unfuse(res.symbol, input_shapes=SHAPES, arg_params=res.arg_params, aux_params={})
    assert not any(op.startswith("fused_") for op in Graph.from_symbol(plain).count_ops())
    rng = np.random.default_rng(5)
    for shp in [SHAPES] + OTHERS:
        vals = dict(fused_params, x=rng.standard_normal(shp["x"]).astype(np.float32),
                    vl=np.concatenate([[0], rng.integers(0, shp["x"][1] + 1, shp["vl"][0] - 1)]).astype(np.float32))
        want, _ = _run(sym, dict(prm, **vals), False, 0)
        got, _ = _run(plain, {n: vals[n] for n in plain.list_arguments()}, False, 0)
        assert_same(got[0], want[0], 1e-5, str(shp))


def test_unfuse_and_onnx_give_any_mask_back(tmp_path):
    sym = _data_mask_attention(cond_shape=(4, 5, 6))
    shapes = {"q": (4, 5, 8), "k": (4, 6, 8), "v": (4, 6, 8), "m": (4, 5, 6)}
    res = fusion.fuse(sym, {}, {}, input_shapes=shapes)
    assert ops(res).get("fused_attention") == 1
    plain = fusion.unfuse(res.symbol, input_shapes=shapes, arg_params={}, aux_params={})
    assert not any(op.startswith("fused_") for op in Graph.from_symbol(plain).count_ops())
    rng = np.random.default_rng(6)
    vals = {n: rng.standard_normal(sh).astype(np.float32) for n, sh in shapes.items()}
    vals["m"] = ((rng.random(shapes["m"]) < 0.5) * rng.choice([1.0, 3.0], shapes["m"])).astype(np.float32)
    vals["m"][1] = 0
    want, _ = _run(sym, vals, False, 0)
    got, _ = _run(plain, vals, False, 0)
    assert_same(got[0], want[0], 1e-5)
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from fusion.onnx.export import export_onnx
    check = export_onnx(res.symbol, res.arg_params, res.aux_params, shapes, str(tmp_path / "any.onnx"))
    assert check.max_rel <= 1e-4, check


def test_onnx_export_of_the_fused_form(tmp_path):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from fusion.onnx.export import export_onnx

    sym = encoder_attention()
    prm = params_of(sym, SHAPES)
    res = fusion.fuse(sym, {n: mx.nd.array(v) for n, v in prm.items()}, {}, input_shapes=SHAPES)
    assert ops(res).get("fused_attention") == 1
    check = export_onnx(res.symbol, res.arg_params, res.aux_params, SHAPES, str(tmp_path / "enc.onnx"))
    assert check.max_rel <= 1e-4, check


# ---------------------------------------------------------------- the real GluonNLP encoder

def test_gluonnlp_transformer_encoder():
    pytest.importorskip("gluonnlp")
    from gluonnlp.model.transformer import get_transformer_encoder_decoder

    enc, _, _ = get_transformer_encoder_decoder(num_layers=2, units=32, hidden_size=64, num_heads=4,
                                                max_src_length=32, max_tgt_length=32, prefix="h36enc_")
    enc.initialize(mx.init.Xavier(), force_reinit=True)
    enc.hybridize()
    x, vl = mx.nd.random.normal(shape=(2, 12, 32)), mx.nd.array([12, 5])
    enc(x, None, vl)
    sym = enc._cached_graph[1]
    params = {p.name: p.data() for p in enc.collect_params().values()}
    names = sym.list_inputs()
    data = [n for n in names if n not in params]
    shapes = {data[0]: (2, 12, 32), data[1]: (2,)}
    res = fusion.fuse(sym, params, {}, input_shapes=shapes)
    assert ops(res).get("fused_attention") == 2, res.report.to_text(explain=True)
    for shp, lens in [(shapes, [12, 0]), ({data[0]: (3, 7, 32), data[1]: (3,)}, [3, 7, 1])]:
        vals = {data[0]: np.random.default_rng(0).standard_normal(shp[data[0]]).astype(np.float32),
                data[1]: np.array(lens, np.float32)}
        want, _ = _run(sym, dict({n: p.asnumpy() for n, p in params.items()}, **vals), False, 0)
        new = {n: v.asnumpy() for n, v in res.arg_params.items()}
        got, _ = _run(res.symbol, dict(new, **vals), False, 0)
        for g, w in zip(got, want):
            assert_same(g, w, 1e-4, str(shp))


def test_gluonnlp_transformer_decoder():
    """Self-attention (query lengths · causal band) fuses as causal with lengths; the memory attention's
    mask is an input of the graph (init_state_from_encoder builds it outside): any mask, boolean."""
    pytest.importorskip("gluonnlp")
    from gluonnlp.model.transformer import get_transformer_encoder_decoder

    _, dec, _ = get_transformer_encoder_decoder(num_layers=2, units=32, hidden_size=64, num_heads=4,
                                                max_src_length=32, max_tgt_length=32, prefix="h36dec_")
    dec.initialize(mx.init.Xavier(), force_reinit=True)
    dec.hybridize()
    mem, evl = mx.nd.random.normal(shape=(2, 7, 32)), mx.nd.array([7, 3])
    dec(mx.nd.random.normal(shape=(2, 6, 32)), dec.init_state_from_encoder(mem, evl), mx.nd.array([6, 2]))
    sym = dec._cached_graph[1]
    params = {p.name: p.data() for p in dec.collect_params().values()}
    data = [n for n in sym.list_inputs() if n not in params]
    shapes = {}
    for n, shp in zip(dec._cached_graph[0], [(2, 6, 32), (2, 7, 32), (2, 7), (2,)]):
        shapes[n.name] = shp
    assert set(shapes) == set(data), (shapes, data)
    res = fusion.fuse(sym, params, {}, input_shapes=shapes)
    fused = [n for n in res.graph.op_nodes() if n.op == "fused_attention"]
    assert len(fused) == 4, res.report.to_text(explain=True)
    assert sum(bool(f.param("causal", False)) and f.param("mask_kind") == "valid_length" for f in fused) == 2, fused
    assert sum(f.param("mask_kind") == "boolean" and bool(f.param("length_fill")) for f in fused) == 2, fused
    assert "softmax" not in ops(res), ops(res)
    names = [n.name for n in dec._cached_graph[0]]
    rng = np.random.default_rng(0)
    for lens, mem_lens in (([6, 2], [7, 3]), ([0, 5], [0, 7])):
        vals = dict(zip(names, [rng.standard_normal((2, 6, 32)).astype(np.float32),
                                rng.standard_normal((2, 7, 32)).astype(np.float32),
                                (np.arange(7)[None] < np.array(mem_lens)[:, None]).astype(np.float32),
                                np.array(lens, np.float32)]))
        want, _ = _run(sym, dict({n: p.asnumpy() for n, p in params.items()}, **vals), False, 0)
        got, _ = _run(res.symbol, dict({n: v.asnumpy() for n, v in res.arg_params.items()}, **vals), False, 0)
        assert_same(got[0], want[0], 1e-4, str(lens))
