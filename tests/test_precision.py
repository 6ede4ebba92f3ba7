"""Reduced precision (fusion/precision/policy.py): fuse(..., precision="bf16"), mxfuse --precision, hybridize.

Tolerances: against the float32 original, ``max|Δ|/max|orig|`` ≤ 2e-2 (the policy's bf16
tolerance; bf16 rounds each operand by up to 2⁻⁹); against a NumPy reference that rounds
the matrix product's operands to bfloat16 as the kernel does, 1e-5 (only the summation
order differs).
"""
import json
import math
import os
import sys

import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.precision import policy as P
from fusion.ir.errors import FusionError

from conftest import ops, random_params, run_mxfuse

S = mx.sym
BF16_TOL = P.TOLERANCE[P.BFLOAT16]

needs_bf16 = pytest.mark.skipif(P.native_bf16_reason() is not None,
                                reason="CPU without native bfloat16 (fuse refuses precision='bf16' there)")


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return []


# MXNet 1.9.1's oneDNN 2.x has bfloat16 convolutions only with AVX-512: an AMP bfloat16 CNN does not
# run on an AVX2-only CPU ("could not create a primitive descriptor iterator"), with or without fusion
needs_mxnet_bf16_conv = pytest.mark.skipif("avx512f" not in _cpu_flags(),
                                           reason="CPU without AVX-512: MXNet's oneDNN has no bfloat16 convolution")


def bf16_round(a):
    return P.from_bf16(P.to_bf16(a))


def _dense_model(act=None, flatten=False, n=24):
    y = S.FullyConnected(S.var("x"), num_hidden=n, flatten=flatten, name="fc")
    if act == "relu":
        y = S.Activation(y, act_type="relu")
    elif act == "gelu":
        y = S.LeakyReLU(y, act_type="gelu")
    elif act == "tanh_gelu":
        y = (y * 0.5) * (1 + S.tanh((y + 0.044715 * y ** 3) * math.sqrt(2 / math.pi)))
    return y


def _run(sym, arg, aux, feed):
    exe = sym.bind(mx.cpu(), {**arg, **{k: mx.nd.array(v) for k, v in feed.items()}}, aux_states=aux,
                   grad_req="null")
    outs = [o.asnumpy() for o in exe.forward(is_train=False)]
    return outs, exe


# -- conversions ---------------------------------------------------------------------------

def test_to_bf16_rounds_to_nearest_even_and_keeps_specials():
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -2.5, np.inf, -np.inf, np.nan, 3.4e38, 1e-40], np.float32)
    y = P.from_bf16(P.to_bf16(x))
    assert y[0] == 1.0 and y[1] == 1.0                   # tie: to even
    assert y[2] == np.float32(1 + 4 * 2 ** -8)          # tie: up to even
    assert y[3] == -2.5 and np.isposinf(y[4]) and np.isneginf(y[5]) and np.isnan(y[6])
    assert np.isfinite(y[7]) or y[7] == np.inf          # rounds within range or to inf, never NaN
    assert P.to_bf16(x).dtype == P.BF16 and P.dtype_name(P.to_bf16(x).dtype) == "bfloat16"
    # MXNet's own cast agrees
    z = mx.nd.amp_cast(mx.nd.array(x[:6]), dtype=P.BF16).asnumpy()
    assert (z.view(np.uint16) == P.to_bf16(x[:6]).view(np.uint16)).all()


# -- fused_dense in bf16 --------------------------------------------------------------------

@needs_bf16
@pytest.mark.parametrize("act,flatten", [(None, False), ("relu", False), ("gelu", False),
                                         ("tanh_gelu", False), ("relu", True)])
def test_dense_bf16_matches_fp32_and_the_bf16_reference(act, flatten):
    sym = _dense_model(act, flatten)
    shapes = {"x": (10, 5, 16)}     # ≥ 8 GEMM rows either way
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16")
    assert ops(res) == {"fused_dense": 1}, res.report.to_text(explain=True)
    assert res.arg_params["fc_weight_bf16"].dtype == P.BF16 and "fc_weight" not in res.arg_params
    v = fusion.verify((sym, arg, aux), res, input_shapes=shapes)
    assert v.max_rel <= BF16_TOL, v
    assert v.max_rel > 1e-6          # it did run in bf16
    # the kernel's arithmetic: bf16(x) · bf16(W)ᵀ in float32, then bias and activation in float32
    x = np.random.default_rng(3).standard_normal(shapes["x"]).astype(np.float32)
    w, b = arg["fc_weight"].asnumpy(), arg["fc_bias"].asnumpy()
    ref_sym = _dense_model(act, flatten)
    want, _ = _run(ref_sym, {"fc_weight": mx.nd.array(bf16_round(w)), "fc_bias": mx.nd.array(b)}, {},
                   {"x": bf16_round(x)})
    got, exe = _run(res.symbol, res.arg_params, res.aux_params, {"x": x})
    assert np.abs(got[0] - want[0]).max() <= 1e-5 * np.abs(want[0]).max()
    again = exe.forward(is_train=False)[0].asnumpy()       # second call: the weight prepacked
    assert np.abs(again - want[0]).max() <= 1e-5 * np.abs(want[0]).max()


@needs_bf16
def test_small_transformer_block_bf16():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from bench_bert import encoder
    sym = encoder(layers=2, hidden=32, heads=4, ffn=64, written=False)
    shapes = {"data": (2, 16, 32)}
    arg, aux = random_params(sym, shapes)
    arg = {k: mx.nd.array(v.asnumpy() * (0.2 if k.endswith("weight") else 1)) for k, v in arg.items()}
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16")
    counts = ops(res)
    # per layer: one QKV product (qkv_projection), the output projection, the FFN's two
    assert counts.get("fused_attention") == 2 and counts.get("fused_dense") == 8, res.report.to_text()
    dense = [n for n in res.graph.op_nodes() if n.op == "fused_dense"]
    assert all(n.inputs[1].node.name.endswith("_bf16") for n in dense)
    # bfloat16 between ops: FFN1 -> FFN2, the QKV product -> the attention -> the output projection
    assert sorted(n.attrs.raw("num_hidden") for n in dense if n.attrs.raw("out_dtype") == "bfloat16") == \
        ["64", "64", "96", "96"]
    attn = [n for n in res.graph.op_nodes() if n.op == "fused_attention"]
    assert all(n.attrs.get("precision") == "bfloat16" and n.attrs.get("layout") == "packed_qkv" for n in attn)
    assert all(n.attrs.get("out_dtype") == "bfloat16" for n in attn)
    v = fusion.verify((sym, arg, aux), res, input_shapes=shapes)
    assert v.max_rel <= BF16_TOL, v
    fp32 = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    assert not any("precision" in n.attrs for n in fp32.graph.op_nodes())
    assert fusion.verify((sym, arg, aux), fp32, input_shapes=shapes).max_rel <= 1e-4
    assert "precision bf16: 8 weight(s) cast" in res.report.to_text()


def _attention_reference(q, k, v, scale, mask=None, causal=False, rounded=False):
    """softmax(scale·q·kᵀ + mask)·v in float64; rounded: q, k, v and the unnormalized
    probabilities rounded to bfloat16 first, as the bf16 kernel's products read them."""
    r = bf16_round if rounded else (lambda a: a)
    s = np.einsum("...id,...jd->...ij", r(q).astype(np.float64), r(k)) * scale
    if mask is not None:
        s = s + mask
    if causal:
        sq, sk = s.shape[-2:]
        s = np.where(np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq, s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    if rounded:
        e = r(e.astype(np.float32)).astype(np.float64)
    return np.einsum("...ij,...jd->...id", e, r(v)) / e.sum(-1, keepdims=True)


@needs_bf16
@pytest.mark.parametrize("shape,masked,causal", [((2, 3, 37, 33), False, False), ((1, 4, 128, 64), True, False),
                                                 ((2, 2, 300, 16), False, True), ((1, 1, 5, 7), True, True)])
def test_attention_bf16_products_forward_and_backward(shape, masked, causal):
    """precision='bfloat16': q·kᵀ and p·v from bfloat16 operands, float32 softmax statistics; the
    backward computes in float32 (from the forward's output, so within the bf16 tolerance)."""
    rng = np.random.default_rng(1)
    B, H, S_, D = shape
    q, k, v = (rng.standard_normal((B * H, S_, D)).astype(np.float32) for _ in range(3))
    mask = (rng.standard_normal((S_, S_)) * 2).astype(np.float32) if masked else None
    scale = 1 / math.sqrt(D)
    feed = {"q": q, "k": k, "v": v, **({"mask": mask} if masked else {})}
    kw = dict(scale=scale, causal=causal, mask_kind="additive" if masked else "none")
    outs, grads = {}, {}
    for prec in ("float32", "bfloat16"):
        sym = S.fused_attention(S.var("q"), S.var("k"), S.var("v"), *([S.var("mask")] if masked else []),
                                precision=prec, **kw)
        args = {n: mx.nd.array(a) for n, a in feed.items()}
        exe = sym.bind(mx.cpu(), args, args_grad={n: mx.nd.zeros(a.shape) for n, a in feed.items()})
        outs[prec] = exe.forward(is_train=True)[0].asnumpy()
        dy = np.random.default_rng(2).standard_normal(outs[prec].shape).astype(np.float32)
        exe.backward(mx.nd.array(dy))
        grads[prec] = {n: g.asnumpy() for n, g in exe.grad_dict.items()}
    ref = _attention_reference(q, k, v, scale, mask, causal)
    scale_ref = np.abs(ref).max()
    assert np.abs(outs["float32"] - ref).max() <= 1e-5 * scale_ref
    assert np.abs(outs["bfloat16"] - ref).max() <= BF16_TOL * scale_ref
    assert np.abs(outs["bfloat16"] - ref).max() > 1e-5 * scale_ref       # the products did run in bf16
    near = _attention_reference(q, k, v, scale, mask, causal, rounded=True)
    assert np.abs(outs["bfloat16"] - near).max() <= 2e-3 * scale_ref    # and as the bf16 reference says
    for n in feed:          # backward: float32 products, reading the forward's (bf16-product) output
        g32, g16 = grads["float32"][n], grads["bfloat16"][n]
        assert np.abs(g16 - g32).max() <= BF16_TOL * max(np.abs(g32).max(), 1e-6), n


@pytest.mark.parametrize("b_dtype,output_sum,b_shape", [("bfloat16", False, (3, 5, 40)),
                                                       ("float32", True, (3, 5, 40)),
                                                       ("bfloat16", True, (5, 40))])
def test_add_layer_norm_reads_and_writes_bf16(b_dtype, output_sum, b_shape):
    """bfloat16 a (and b): float32 statistics inside, y (and s) in bfloat16 rounded to nearest even."""
    rng = np.random.default_rng(3)
    a = P.to_bf16(rng.standard_normal((3, 5, 40)).astype(np.float32) * 3 + 1)
    b32 = rng.standard_normal(b_shape).astype(np.float32)
    b = P.to_bf16(b32) if b_dtype == "bfloat16" else b32
    g = rng.uniform(0.5, 1.5, 40).astype(np.float32)
    beta = rng.standard_normal(40).astype(np.float32)
    sym = S.fused_add_layer_norm(S.var("a", dtype=P.BF16), S.var("b", dtype=P.BF16 if b_dtype == "bfloat16" else None),
                                 S.var("g"), S.var("beta"), eps=1e-5, output_sum=output_sum)
    args = {"a": mx.nd.array(a, dtype=P.BF16), "b": mx.nd.array(b, dtype=b.dtype), "g": mx.nd.array(g),
            "beta": mx.nd.array(beta)}
    exe = sym.bind(mx.cpu(), args, grad_req="null")
    outs = exe.forward(is_train=False)
    assert all(P.is_bf16(o.dtype) for o in outs)
    s_ = P.from_bf16(a).astype(np.float64) + (P.from_bf16(b) if b_dtype == "bfloat16" else b32)
    mean, var = s_.mean(-1, keepdims=True), s_.var(-1, keepdims=True)
    want = [(s_ - mean) / np.sqrt(var + 1e-5) * g + beta] + ([s_] if output_sum else [])
    for got, ref in zip(outs, want):
        got = P.from_bf16(got.asnumpy())
        assert np.all(np.abs(got - ref) <= 2 ** -8 * np.abs(ref) + 1e-6)   # one bfloat16 rounding
        assert (P.to_bf16(ref.astype(np.float32)).view(np.uint16) != got.view(np.uint32) >> 16).mean() < 0.02
    exe = sym.bind(mx.cpu(), args, args_grad={"g": mx.nd.zeros(40)}, grad_req={"a": "null", "b": "null",
                                                                              "g": "write", "beta": "null"})
    exe.forward(is_train=True)
    with pytest.raises(mx.base.MXNetError, match="bfloat16 inputs have no backward"):
        exe.backward([mx.nd.ones(o.shape, dtype=P.BF16) for o in exe.outputs])
        mx.nd.waitall()
    with pytest.raises(mx.base.MXNetError, match=r"gamma/beta\) must be float32 or float16, got int32"):
        mx.nd.fused_add_layer_norm(mx.nd.ones((2, 4)), mx.nd.ones((2, 4)), mx.nd.ones(4, dtype="int32"),
                                   mx.nd.ones(4)).asnumpy()


@pytest.mark.parametrize("dtypes,shapes", [(("bfloat16", "bfloat16"), ((4, 3000), (4, 3000))),
                                           (("bfloat16", "float32"), ((4, 3000), (4, 3000))),
                                           (("bfloat16", "bfloat16"), ((4, 3000), (3000,))),
                                           (("float32", "bfloat16"), ((2, 5, 7), (5, 1)))])
def test_elemwise_reads_and_writes_bf16(dtypes, shapes):
    """bfloat16 inputs widened, the program in float32, output bfloat16 when every input is (else float32)."""
    rng = np.random.default_rng(4)
    x32 = [rng.standard_normal(sh).astype(np.float32) for sh in shapes]
    xs = [P.to_bf16(x) if dt == "bfloat16" else x for x, dt in zip(x32, dtypes)]
    expr = "add(mul(tanh(x0), x1), 0.5)"
    sym = S.fused_elemwise(*[S.var("x%d" % i, dtype=P.BF16 if dt == "bfloat16" else None)
                             for i, dt in enumerate(dtypes)], expr=expr, num_args=2)
    args = {"x%d" % i: mx.nd.array(x, dtype=x.dtype) for i, x in enumerate(xs)}
    exe = sym.bind(mx.cpu(), args, grad_req="null")
    out = exe.forward(is_train=False)[0]
    wide = [P.from_bf16(x) if dt == "bfloat16" else x for x, dt in zip(xs, dtypes)]
    want = np.tanh(wide[0].astype(np.float64)) * wide[1] + 0.5
    if all(dt == "bfloat16" for dt in dtypes):
        assert P.is_bf16(out.dtype)
        got = P.from_bf16(out.asnumpy())
        assert np.all(np.abs(got - want) <= 2 ** -8 * np.abs(want) + 1e-6)     # one bfloat16 rounding
    else:
        assert out.dtype == np.float32
        assert np.abs(out.asnumpy() - want).max() <= 1e-5 * np.abs(want).max()
    exe = sym.bind(mx.cpu(), args, args_grad={k: mx.nd.zeros(v.shape, dtype=v.dtype) for k, v in args.items()})
    exe.forward(is_train=True)
    with pytest.raises(mx.base.MXNetError, match="bfloat16 values have no backward"):
        exe.backward([mx.nd.ones(exe.outputs[0].shape, dtype=exe.outputs[0].dtype)])
        mx.nd.waitall()


def test_attention_precision_attribute_checked():
    x = mx.nd.ones((1, 4, 8))
    with pytest.raises(mx.base.MXNetError, match="precision"):
        mx.nd.fused_attention(x, x, x, scale=1.0, precision="float16").asnumpy()


@needs_bf16
@pytest.mark.parametrize("act", ["none", "gelu_erf"])
def test_fused_dense_bf16_head_split_output(act):
    """out_layout='heads_bhsd': the (M, N) product is written as (B, H, S, D)."""
    rng = np.random.default_rng(0)
    B, Sq, K, H, D = 2, 9, 16, 3, 8
    x = rng.standard_normal((B, Sq, K)).astype(np.float32)
    w = rng.standard_normal((H * D, K)).astype(np.float32) * 0.3
    b = rng.standard_normal(H * D).astype(np.float32)
    sym = S.fused_dense(S.var("x"), S.var("w", dtype=P.BF16), S.var("b"), num_hidden=H * D, flatten=False,
                        act=act, out_layout="heads_bhsd", heads=H)
    exe = sym.bind(mx.cpu(), {"x": mx.nd.array(x), "w": mx.nd.array(P.to_bf16(w), dtype=P.BF16),
                              "b": mx.nd.array(b)}, grad_req="null")
    z = bf16_round(x) @ bf16_round(w).T + b
    if act == "gelu_erf":
        z = 0.5 * z * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
    want = z.reshape(B, Sq, H, D).transpose(0, 2, 1, 3)
    for _ in range(3):      # first call (weight read in place), then prepacked
        got = exe.forward(is_train=False)[0].asnumpy()
        assert got.shape == (B, H, Sq, D)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@needs_bf16
def test_small_bert_bf16_self_check_uses_bf16_tolerance():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from bench_bert import encoder, random_weights
    sym = encoder(layers=2, hidden=64, heads=4, ffn=128, written=True)
    arg = {k: mx.nd.array(v) for k, v in random_weights(sym, 16, 64).items()}
    res = fusion.fuse(sym, arg, {}, input_shapes={"data": (1, 16, 64)}, precision="bf16")
    stats = res.report.self_check
    assert stats.checked > 0 and stats.refused == 0, res.report.to_text()
    assert 1e-4 < stats.worst_rel <= BF16_TOL       # accepted under the bf16 tolerance, not fp32's
    v = fusion.verify((sym, arg, {}), res, input_shapes={"data": (1, 16, 64)})
    assert v.max_rel <= BF16_TOL, v
    assert json.loads(res.report.to_json())["precision"] == "bfloat16"


@needs_bf16
def test_caller_arrays_untouched_and_new_names():
    sym = _dense_model("relu")
    shapes = {"x": (2, 8, 16)}
    arg, aux = random_params(sym, shapes)
    before = {k: (v.dtype, v.asnumpy().copy()) for k, v in arg.items()}
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16")
    for k, (dt, val) in before.items():
        assert arg[k].dtype == dt and (arg[k].asnumpy() == val).all()
    assert set(res.arg_params) == {"fc_weight_bf16", "fc_bias"}
    assert res.arg_params["fc_bias"].dtype == np.float32      # epilogue stays float32
    # inputs and outputs keep their dtype
    # (the weight declares its dtype in the graph; MXNet's Python API cannot pass bfloat16)
    assert res.symbol.infer_type(x="float32", fc_bias="float32")[1] == [np.float32]


@needs_bf16
def test_fuse_again_and_save_load_roundtrip(tmp_path):
    sym = _dense_model("relu")
    shapes = {"x": (2, 8, 16)}
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16")
    again = fusion.fuse(res.symbol, res.arg_params, res.aux_params, input_shapes=shapes, precision="bf16")
    assert ops(again) == {"fused_dense": 1} and again.arg_params["fc_weight_bf16"].dtype == P.BF16
    mx.model.save_checkpoint(str(tmp_path / "m"), 0, res.symbol, res.arg_params, res.aux_params)
    s2, a2, x2 = fusion.load_model(str(tmp_path / "m"))
    assert a2["fc_weight_bf16"].dtype == P.BF16
    x = np.random.default_rng(0).standard_normal(shapes["x"]).astype(np.float32)
    assert np.array_equal(_run(s2, a2, x2, {"x": x})[0][0], _run(res.symbol, res.arg_params, {}, {"x": x})[0][0])


def test_fused_dense_bf16_refuses_other_dtypes_and_backward():
    x = mx.nd.array(np.ones((4, 8), np.float32))
    w = mx.nd.array(np.ones((3, 8), np.float32))
    b = mx.nd.zeros((3,))
    with pytest.raises(mx.base.MXNetError, match=r"input 0 \(data\) must be float32"):
        mx.nd.fused_dense(mx.nd.amp_cast(x, dtype=P.BF16), w, b, num_hidden=3).asnumpy()
    with pytest.raises(mx.base.MXNetError, match=r"weight\) must be float32, float16 or bfloat16, got int32"):
        mx.nd.fused_dense(x, w.astype("int32"), b, num_hidden=3).asnumpy()
    wb = mx.nd.amp_cast(w, dtype=P.BF16)
    sym = S.fused_dense(S.var("x"), S.var("w", dtype=P.BF16), S.var("b"), num_hidden=3)
    exe = sym.bind(mx.cpu(), {"x": x, "w": wb, "b": b}, args_grad={"x": mx.nd.zeros((4, 8))},
                   grad_req={"x": "write", "w": "null", "b": "null"})
    exe.forward(is_train=True)
    with pytest.raises(mx.base.MXNetError, match="bfloat16 weight has no backward"):
        exe.backward([mx.nd.ones((4, 3))])
        mx.nd.waitall()


# -- refusals ---------------------------------------------------------------------------------

def test_unknown_precision_refused_with_reason():
    sym = _dense_model("relu")
    with pytest.raises(FusionError, match="precision must be float32 or bf16.*not 'fp16'"):
        fusion.fuse(sym, precision="fp16")


def test_bf16_refused_in_training():
    with pytest.raises(FusionError, match="precision='bf16' is for inference"):
        fusion.fuse(_dense_model("relu"), mode="training", precision="bf16", force=True)


def test_cpu_without_bf16_refused_unless_forced(monkeypatch):
    monkeypatch.setattr(P, "cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    sym = _dense_model("relu")
    shapes = {"x": (2, 8, 16)}
    arg, aux = random_params(sym, shapes)
    with pytest.raises(FusionError, match="no native bfloat16.*avx512_bf16.*force=True"):
        fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16")
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16", force=True)
    assert res.arg_params["fc_weight_bf16"].dtype == P.BF16
    assert fusion.verify((sym, arg, aux), res, input_shapes=shapes).max_rel <= BF16_TOL
    # float32 needs nothing of the CPU
    assert ops(fusion.fuse(sym, arg, aux, input_shapes=shapes)) == {"fused_dense": 1}


def test_onednn_isa_cap_hides_bf16(monkeypatch):
    monkeypatch.setattr(P, "cpu_flags", lambda: {"avx512_bf16"})
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    assert "ONEDNN_MAX_CPU_ISA=AVX512_CORE" in P.native_bf16_reason()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert P.native_bf16_reason() is None


@needs_bf16
def test_weight_not_a_known_parameter_stays_float32():
    sym = _dense_model("relu")
    shapes = {"x": (2, 8, 16)}
    arg, aux = random_params(sym, shapes)
    arg.pop("fc_weight")        # an input, not a parameter: the policy has nothing to cast once
    res = fusion.fuse(sym, arg, aux, input_shapes=dict(shapes, fc_weight=(24, 16)), precision="bf16")
    text = res.report.to_text()
    if ops(res).get("fused_dense"):
        assert "stay float32" in text and "'fc_weight' is not a known parameter" in text, text
        assert all(n.inputs[1].node.name == "fc_weight" for n in res.graph.op_nodes() if n.op == "fused_dense")


# -- surfaces ----------------------------------------------------------------------------------

@needs_bf16
def test_mxfuse_precision_bf16_verify_and_report(tmp_path, capsys):
    sym = _dense_model("gelu")
    arg, aux = random_params(sym, {"x": (2, 8, 16)})
    sym.save(str(tmp_path / "m-symbol.json"))
    mx.nd.save(str(tmp_path / "m-0000.params"), {"arg:" + k: v for k, v in arg.items()})
    code, out, err = run_mxfuse(capsys, tmp_path / "m-symbol.json", "--params", tmp_path / "m-0000.params",
                                "-o", tmp_path / "out", "--shape", "x=2,8,16", "--precision", "bf16", "--verify",
                                "--report", tmp_path / "r.json")
    assert code == 0, err
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["precision"] == "bfloat16" and rep["verify"]["rtol"] == BF16_TOL and rep["verify"]["ok"]
    _, a2, _ = mx.model.load_checkpoint(str(tmp_path / "out"), 0)
    assert a2["fc_weight_bf16"].dtype == P.BF16
    # --rtol overrides the bf16 default
    code, out, err = run_mxfuse(capsys, tmp_path / "m-symbol.json", "--params", tmp_path / "m-0000.params",
                                "-o", tmp_path / "out2", "--shape", "x=2,8,16", "--precision", "bf16", "--verify",
                                "--rtol", "1e-7")
    assert code == 1 and "max rel error" in err and not (tmp_path / "out2-symbol.json").exists()


def test_mxfuse_precision_refusals(tmp_path, capsys, monkeypatch):
    sym = _dense_model("relu")
    arg, aux = random_params(sym, {"x": (2, 8, 16)})
    sym.save(str(tmp_path / "m-symbol.json"))
    mx.nd.save(str(tmp_path / "m-0000.params"), {"arg:" + k: v for k, v in arg.items()})
    base = [tmp_path / "m-symbol.json", "--params", tmp_path / "m-0000.params", "-o", tmp_path / "o",
            "--shape", "x=2,8,16"]
    code, out, err = run_mxfuse(capsys, *base, "--precision", "fp16")
    assert code == 2 and err.count("\n") == 1 and "precision must be float32 or bf16" in err
    monkeypatch.setattr(P, "cpu_flags", lambda: {"avx2"})
    code, out, err = run_mxfuse(capsys, *base, "--precision", "bf16")
    assert code == 2 and "no native bfloat16" in err and "--force-precision" in err
    assert not (tmp_path / "o-symbol.json").exists()
    code, out, err = run_mxfuse(capsys, *base, "--precision", "bf16", "--force-precision", "--verify")
    assert code == 0, err
    code, out, err = run_mxfuse(capsys, *base, "--precision", "bf16", "--force-precision", "--unfuse")
    assert code == 2 and "takes no --unfuse" in err


@needs_bf16
def test_gluon_hybridize_precision_bf16():
    from mxnet.gluon import nn
    net = nn.HybridSequential()
    net.add(nn.Dense(32, activation="relu", flatten=False), nn.Dense(8, flatten=False))
    net.initialize(mx.init.Normal(0.1))
    x = mx.nd.random.normal(shape=(2, 8, 16))
    ref = net(x).asnumpy()
    net.hybridize(backend="fusion", precision="bf16")
    y = net(x).asnumpy()
    assert net.fusion_report.precision == "bfloat16"
    assert np.abs(y - ref).max() / np.abs(ref).max() <= BF16_TOL
    assert all(np.dtype(p.dtype) == np.float32 for p in net.collect_params().values())   # the block's own


@needs_bf16
@pytest.mark.usefixtures("no_regions")
def test_gluon_hybridize_precision_bf16_says_the_convolutions_stay_float32():
    """The Gluon backend cannot run MXNet's AMP conversion (new bfloat16 parameters for the block's
    own): the convolutions stay float32 there, and the report says so and where bfloat16 runs them."""
    from mxnet.gluon import nn
    net = nn.HybridSequential()
    net.add(nn.Conv2D(8, 3, padding=1), nn.BatchNorm(), nn.Activation("relu"), nn.GlobalAvgPool2D(), nn.Dense(10))
    net.initialize(mx.init.Xavier())
    x = mx.nd.random.normal(shape=(2, 3, 12, 12))
    ref = net(x).asnumpy()
    net.hybridize(backend="fusion", precision="bf16")
    y = net(x).asnumpy()
    assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max()
    text = net.fusion_report.to_text()
    assert "the 1 convolution(s) stay float32: the Gluon backend does not convert them" in text
    assert "mxfuse --precision bf16 on the exported model" in text


# -- MXNet's AMP ---------------------------------------------------------------------------------

def _amp(sym, arg):
    from mxnet.contrib import amp
    # on copies: convert_model replaces entries of the dict it is given with their bf16 casts
    return amp.convert_model(sym, {k: v.copy() for k, v in arg.items()}, {}, target_dtype="bfloat16",
                             cast_optional_params=True)


@needs_bf16
def test_amp_then_fuse_reads_the_casts_as_precision_bf16():
    """AMP's casts removed, its bfloat16 parameters widened exactly: the fused ops compute as
    precision='bf16' with the same weight bits; a classifier head left to MXNet runs float32."""
    # (a FullyConnected reading the model's input directly would make AMP expect a bfloat16 input)
    h = S.Activation(S.FullyConnected(S.tanh(S.var("x")), num_hidden=24, flatten=False, name="fc"), act_type="relu")
    sym = S.FullyConnected(h, num_hidden=3, name="head")
    shapes = {"x": (2, 8, 16)}
    arg, aux = random_params(sym, shapes)
    asym, aarg, aaux = _amp(sym, arg)
    res = fusion.fuse(asym, aarg, aaux, input_shapes=shapes)
    assert ops(res) == {"tanh": 1, "fused_dense": 1, "FullyConnected": 1}, res.report.to_text()
    assert res.report.precision == P.BFLOAT16
    assert (res.arg_params["fc_weight_bf16"].asnumpy().view(np.uint16)
            == aarg["fc_weight"].asnumpy().view(np.uint16)).all()            # AMP's bits, cast back
    assert res.arg_params["head_weight"].dtype == np.float32
    text = res.report.to_text()
    assert "converted by MXNet's AMP" in text and "now run in float32: head" in text, text
    for ref in ((asym, aarg, aaux), (sym, arg, aux)):
        v = fusion.verify(ref, res, input_shapes=shapes)
        assert v.max_rel <= BF16_TOL, v
    feed = {"x": np.ones(shapes["x"], np.float32)}
    assert _run(res.symbol, res.arg_params, res.aux_params, feed)[0][0].dtype == _run(asym, aarg, aaux, feed)[0][0].dtype


@needs_bf16
def test_amp_then_fuse_transformer_block():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from bench_bert import encoder, random_weights
    sym = encoder(layers=2, hidden=64, heads=4, ffn=128, written=False)
    shapes = {"data": (1, 16, 64)}
    arg = {k: mx.nd.array(v) for k, v in random_weights(sym, 16, 64).items()}
    asym, aarg, aaux = _amp(sym, arg)
    assert any(op.startswith("amp_") for op in ops(asym))
    res = fusion.fuse(asym, aarg, aaux, input_shapes=shapes)
    assert ops(res) == {"fused_dense": 8, "fused_add_layer_norm": 4, "fused_attention": 2}, res.report.to_text()
    assert all(n.attrs.get("precision") == "bfloat16" for n in res.graph.op_nodes() if n.op == "fused_attention")
    assert res.report.self_check.refused == 0
    amp_err = fusion.verify((sym, arg, {}), (asym, aarg, aaux), input_shapes=shapes).max_rel
    ours = fusion.verify((sym, arg, {}), res, input_shapes=shapes).max_rel
    assert ours <= max(amp_err, 1e-3), (ours, amp_err)      # no worse than AMP's own error
    assert fusion.verify((asym, aarg, aaux), res, input_shapes=shapes).max_rel <= BF16_TOL
    # the same as fusing the float32 model with precision="bf16", but for AMP's biases (rounded to bfloat16)
    direct = fusion.fuse(sym, arg, {}, input_shapes=shapes, precision="bf16")
    assert ops(direct) == ops(res)
    assert fusion.verify((direct.symbol, direct.arg_params, direct.aux_params), res, input_shapes=shapes).max_rel <= 1e-3
    arg_b = {k: mx.nd.array(bf16_round(v.asnumpy())) if k.endswith("bias") else v for k, v in arg.items()}
    direct = fusion.fuse(sym, arg_b, {}, input_shapes=shapes, precision="bf16")
    assert fusion.verify((direct.symbol, direct.arg_params, direct.aux_params), res, input_shapes=shapes).max_rel <= 1e-5


@needs_bf16
def test_mxfuse_on_an_amp_model_verifies_at_the_bf16_tolerance(tmp_path, capsys):
    sym = S.Activation(S.FullyConnected(S.tanh(S.var("x")), num_hidden=24, flatten=False, name="fc"), act_type="relu")
    arg, aux = random_params(sym, {"x": (2, 8, 16)})
    asym, aarg, _ = _amp(sym, arg)
    (tmp_path / "m-symbol.json").write_text(asym.tojson(remove_amp_cast=False))
    mx.nd.save(str(tmp_path / "m-0000.params"), {"arg:" + k: v for k, v in aarg.items()})
    code, out, err = run_mxfuse(capsys, tmp_path / "m-symbol.json", "--params", tmp_path / "m-0000.params",
                                "-o", tmp_path / "out", "--shape", "x=2,8,16", "--verify", "--report", tmp_path / "r.json")
    assert code == 0, err
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["precision"] == "bfloat16" and rep["verify"]["rtol"] == BF16_TOL and rep["verify"]["ok"]
    s2, a2, _ = mx.model.load_checkpoint(str(tmp_path / "out"), 0)
    assert a2["fc_weight_bf16"].dtype == P.BF16 and not {"amp_cast", "amp_multicast"} & set(ops(s2))
    assert s2.list_outputs() == asym.list_outputs()          # AMP's output name, kept


@needs_bf16
def test_amp_multicast_read_through():
    """amp_multicast's outputs read as its inputs (a graph written the way AMP writes a widest-type cast)."""
    x = S.tanh(S.var("x"))
    fc = S.FullyConnected(S.amp_cast(x, dtype=P.BF16), S.var("w", dtype=P.BF16), S.var("b", dtype=P.BF16),
                          num_hidden=16, flatten=False, name="fc")
    m = S.amp_multicast(fc, S.sigmoid(x), num_outputs=2)
    sym = S.LayerNorm(S.elemwise_add(m[0], m[1]), S.var("g"), S.var("beta"), name="ln")
    rng = np.random.default_rng(0)
    arg = {"w": mx.nd.array(P.to_bf16(rng.standard_normal((16, 16)).astype(np.float32) * 0.3), dtype=P.BF16),
           "b": mx.nd.array(P.to_bf16(rng.standard_normal(16).astype(np.float32)), dtype=P.BF16),
           "g": mx.nd.array(rng.uniform(0.5, 1.5, 16)), "beta": mx.nd.array(rng.standard_normal(16))}
    shapes = {"x": (2, 8, 16)}
    res = fusion.fuse(sym, arg, {}, input_shapes=shapes)
    assert ops(res) == {"tanh": 1, "sigmoid": 1, "fused_dense": 1, "fused_add_layer_norm": 1}, res.report.to_text()
    assert fusion.verify((sym, arg, {}), res, input_shapes=shapes).max_rel <= BF16_TOL


@needs_mxnet_bf16_conv
def test_amp_cnn_keeps_its_bf16_convolutions():
    """A convolution AMP runs in bfloat16 has no fused bfloat16 form: the AMP graph is not read as
    precision='bf16' (its convolutions would turn float32); the self-check draws bfloat16 values."""
    x = S.Convolution(S.var("data"), num_filter=8, kernel=(3, 3), pad=(1, 1), name="c1")
    x = S.Activation(S.BatchNorm(x, name="bn1"), act_type="relu")
    x = S.Convolution(x, num_filter=8, kernel=(3, 3), pad=(1, 1), name="c2")
    sym = S.Activation(S.BatchNorm(x, name="bn2") + S.var("data"), act_type="relu")
    shapes = {"data": (1, 8, 6, 6)}
    arg, aux = random_params(sym, shapes)
    from mxnet.contrib import amp
    asym, aarg, aaux = amp.convert_model(sym, {k: v.copy() for k, v in arg.items()},
                                         {k: v.copy() for k, v in aux.items()}, target_dtype="bfloat16",
                                         cast_optional_params=True)
    res = fusion.fuse(asym, aarg, aaux, input_shapes=shapes)
    assert res.report.precision == P.FLOAT32
    assert "converted by MXNet's AMP" in res.report.to_text()
    assert all(P.is_bf16(res.arg_params[n].dtype) for n in ("c1_weight", "c2_weight") if n in res.arg_params)
    v = fusion.verify((asym, aarg, aaux), res, input_shapes=shapes)
    assert v.max_rel <= 1e-4, v
    # BatchNorm folding refuses a bfloat16 convolution up front (not left to the self-check)
    folding = [r for name, r in res.report.rules.items() if name.startswith("conv_bn")]
    reasons = [why for r in folding for why in r.rejected.values()]
    assert not any(r.fused for r in folding)
    assert any("is not float32: BatchNorm folding writes float32 weights" in why for why in reasons), reasons
    assert not any("self-check" in why for why in reasons), reasons


@needs_mxnet_bf16_conv
def test_amp_converted_block_in_the_backend_stays_amp():
    """The Gluon backend hands on only new params, so it does not widen AMP's: the AMP graph's
    float32 parts fuse and its bfloat16 parts stay MXNet's, as the report says."""
    from fusion.api import _fuse
    sym = S.Activation(S.FullyConnected(S.tanh(S.var("x")), num_hidden=24, flatten=False, name="fc"), act_type="relu")
    shapes = {"x": (2, 8, 16)}
    arg, aux = random_params(sym, shapes)
    asym, aarg, aaux = _amp(sym, arg)
    res = _fuse(asym, aarg, aaux, None, "inference", shapes, None, True, copy_params=False)
    text = res.report.to_text()
    assert "converted by MXNet's AMP" in text and "stay MXNet's own ops" in text, text
    v = fusion.verify((asym, aarg, aaux), res, input_shapes=shapes)
    assert v.max_rel <= 1e-4, v


def test_amp_after_fuse_refused_with_reason():
    from mxnet.contrib import amp
    sym = _dense_model("relu")
    shapes = {"x": (2, 8, 16)}
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    with pytest.raises(FusionError, match="AMP cannot convert a fused graph.*fused_dense.*AMP first"):
        amp.convert_model(res.symbol, dict(res.arg_params), {}, target_dtype="bfloat16", cast_optional_params=True)
    with pytest.raises(FusionError, match="AMP cannot convert a fused graph"):
        mx.contrib.amp.convert_symbol(res.symbol, target_dtype="bfloat16")
    amp.convert_symbol(sym, target_dtype="bfloat16")      # unfused graphs convert as before


@needs_bf16
def test_unfuse_bf16_model_gives_stock_ops_with_the_bf16_weights():
    sym = _dense_model("gelu")
    shapes = {"x": (2, 8, 16)}
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16")
    plain = fusion.unfuse(res.symbol, shapes, res.arg_params, res.aux_params)
    assert not any(op.startswith("fused_") for op in ops(plain)) and ops(plain).get("amp_cast") == 1
    v = fusion.verify((sym, arg, aux), (plain, res.arg_params, res.aux_params), input_shapes=shapes)
    assert v.max_rel <= BF16_TOL, v


@needs_bf16
def test_shared_weight_cast_once():
    """Layers sharing a weight (ALBERT) share its bfloat16 copy too."""
    w, b = S.var("w"), S.var("b")
    h = S.Activation(S.FullyConnected(S.var("x"), w, b, num_hidden=16, flatten=False, name="fc1"), act_type="relu")
    y = S.FullyConnected(h, w, b, num_hidden=16, flatten=False, name="fc2")
    shapes = {"x": (2, 8, 16)}
    arg, aux = random_params(y, shapes)
    res = fusion.fuse(y, arg, aux, input_shapes=shapes, precision="bf16")
    assert ops(res) == {"fused_dense": 2}, res.report.to_text()
    assert sorted(res.arg_params) == ["b", "w_bf16"]
    assert fusion.verify((y, arg, aux), res, input_shapes=shapes).max_rel <= BF16_TOL


# -- bfloat16 values between fused ops ------------------------------------------------------------

def _dense_chain(act1, readers=("fc2",)):
    """fc1 [→ act1] → each of ``readers``: "fc2" (a dense), "add" (x + fc1's value), "out" (a graph output)."""
    h = S.FullyConnected(S.var("x"), num_hidden=48, flatten=False, name="fc1")
    if act1 == "relu":
        h = S.Activation(h, act_type="relu", name="a1")
    elif act1 == "gelu":
        h = S.LeakyReLU(h, act_type="gelu", name="a1")
    outs = []
    if "fc2" in readers:
        outs.append(S.FullyConnected(h, num_hidden=16, flatten=False, name="fc2"))
    if "add" in readers:
        outs.append(S.broadcast_add(S.sum(h, axis=-1, keepdims=True), S.var("x")))
    if "out" in readers:
        outs.append(h)
    return outs[0] if len(outs) == 1 else S.Group(outs)


def _without_between(res):
    """The fused graph with float32 values between its ops: no out_dtype, and the readers of a
    bf16_copy output read the float32 output it copies."""
    from fusion.ir.graph import Entry
    g = res.graph
    for nd in g.op_nodes():
        if "out_dtype" in nd.attrs:
            del nd.attrs["out_dtype"]
        for k, e in enumerate(nd.inputs):
            if P.is_bf16_copy(e):
                nd.inputs[k] = Entry(e.node, 0, e.version)
    for nd in g.op_nodes():
        if nd.op in P.BF16_COPIES and nd.param("bf16_copy", False):
            del nd.attrs["bf16_copy"]
            nd.num_outputs -= 1
    return g.to_symbol()


def _dense_numpy(x, w, b, act=None):
    """float32 NumPy: bf16(x)·bf16(w)ᵀ + b, then the activation."""
    y = bf16_round(x) @ bf16_round(w).T + b
    if act == "relu":
        y = np.maximum(y, 0)
    elif act == "gelu":
        y = 0.5 * y * (1 + np.vectorize(math.erf)(y / math.sqrt(2)))
    return y.astype(np.float32)


@needs_bf16
@pytest.mark.parametrize("act1", [None, "relu", "gelu"])
def test_dense_to_dense_value_held_in_bf16_is_exact(act1):
    """fc1's only reader rounds it to bfloat16: fc1 writes it rounded (out_dtype='bfloat16'), fc2 reads
    it as it is — the same bits as the float32 hand-over, on the first call and the prepacked ones."""
    sym = _dense_chain(act1)
    shapes = {"x": (3, 40, 16)}
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16")
    dense = {n.name: n for n in res.graph.op_nodes() if n.op == "fused_dense"}
    assert len(dense) == 2, res.report.to_text()
    writers = [n for n in dense.values() if n.attrs.raw("out_dtype") == "bfloat16"]
    assert len(writers) == 1 and writers[0].inputs[0].node.name == "x"
    assert "1 fused op output(s) held in bfloat16 between ops" in res.report.to_text()
    x = np.random.default_rng(5).standard_normal(shapes["x"]).astype(np.float32)
    got, exe = _run(res.symbol, res.arg_params, res.aux_params, {"x": x})
    plain, exe2 = _run(_without_between(res), res.arg_params, res.aux_params, {"x": x})
    assert got[0].dtype == np.float32 and np.array_equal(got[0], plain[0])
    for _ in range(2):      # second and third calls: weights prepacked, bfloat16 written by oneDNN
        assert np.array_equal(exe.forward(is_train=False)[0].asnumpy(), exe2.forward(is_train=False)[0].asnumpy())
    # NumPy float32 reference of the kernels' arithmetic, and the float32 original
    p = {k: v.asnumpy() for k, v in arg.items()}
    h = bf16_round(_dense_numpy(x, p["fc1_weight"], p["fc1_bias"], act1))
    want = _dense_numpy(h, p["fc2_weight"], p["fc2_bias"])
    assert np.abs(got[0] - want).max() <= 1e-5 * np.abs(want).max()
    v = fusion.verify((sym, arg, aux), res, input_shapes=shapes)
    assert v.max_rel <= BF16_TOL, v


@needs_bf16
@pytest.mark.parametrize("readers", [("fc2", "add"), ("fc2", "out")])
def test_value_with_a_float32_reader_stays_float32(readers):
    """A reader that does not round to bfloat16 (an add, a graph output) keeps the value float32."""
    sym = _dense_chain("relu", readers)
    shapes = {"x": (2, 8, 16)}
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16")
    assert ops(res).get("fused_dense", 0) >= 1, res.report.to_text()
    assert not any(n.attrs.raw("out_dtype") for n in res.graph.op_nodes())
    assert "held in bfloat16 between ops" not in res.report.to_text()
    assert fusion.verify((sym, arg, aux), res, input_shapes=shapes).max_rel <= BF16_TOL


@needs_bf16
def test_float32_precision_never_holds_bf16():
    sym = _dense_chain("relu")
    shapes = {"x": (2, 8, 16)}
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    assert ops(res) == {"fused_dense": 2} and not any(n.attrs.raw("out_dtype") for n in res.graph.op_nodes())


def test_fused_dense_out_dtype_checked():
    x = mx.nd.array(np.ones((4, 8), np.float32))
    w, b = mx.nd.array(np.ones((3, 8), np.float32)), mx.nd.zeros((3,))
    with pytest.raises(mx.base.MXNetError, match="out_dtype='bfloat16' needs a bfloat16 weight"):
        mx.nd.fused_dense(x, w, b, num_hidden=3, out_dtype="bfloat16").asnumpy()
    with pytest.raises(mx.base.MXNetError, match="out_dtype"):
        mx.nd.fused_dense(x, w, b, num_hidden=3, out_dtype="float16").asnumpy()
    wb = mx.nd.amp_cast(w, dtype=P.BF16)
    with pytest.raises(mx.base.MXNetError, match="out_dtype='bfloat16' needs out_layout='plain'"):
        mx.nd.fused_dense(mx.nd.ones((1, 4, 8)), wb, b, num_hidden=3, flatten=False, out_layout="heads_bhsd",
                          heads=3, out_dtype="bfloat16").asnumpy()


@needs_bf16
@pytest.mark.parametrize("act", ["none", "relu"])
def test_fused_dense_reads_and_writes_bf16_alone(act):
    """The op by itself: bfloat16 data and output against the NumPy float32 reference (mx.nd: W read in place;
    an executor's later calls: W prepacked), the same as float32 data rounded by the op."""
    rng = np.random.default_rng(2)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((24, 32), (20, 32), (20,)))
    want = _dense_numpy(x, w, b, None if act == "none" else act)
    xb, wb = mx.nd.array(P.to_bf16(x), dtype=P.BF16), mx.nd.array(P.to_bf16(w), dtype=P.BF16)
    y = mx.nd.fused_dense(xb, wb, mx.nd.array(b), num_hidden=20, act=act, out_dtype="bfloat16")
    assert y.dtype == P.BF16
    assert np.array_equal(P.to_bf16(want).view(np.uint16), y.asnumpy().view(np.uint16)) or \
        np.abs(P.from_bf16(y.asnumpy()) - want).max() <= 2 ** -8 * np.abs(want).max()
    y32 = mx.nd.fused_dense(mx.nd.array(x), wb, mx.nd.array(b), num_hidden=20, act=act).asnumpy()
    assert np.array_equal(P.to_bf16(y32).view(np.uint16), y.asnumpy().view(np.uint16))
    sym = S.fused_dense(S.var("x", dtype=P.BF16), S.var("w", dtype=P.BF16), S.var("b"), num_hidden=20, act=act,
                        out_dtype="bfloat16")
    exe = sym.bind(mx.cpu(), {"x": xb, "w": wb, "b": mx.nd.array(b)}, grad_req="null")
    for _ in range(3):
        assert np.array_equal(exe.forward(is_train=False)[0].asnumpy().view(np.uint16), y.asnumpy().view(np.uint16))


@needs_bf16
@pytest.mark.parametrize("a_dtype,output_sum", [("float32", False), ("float32", True), ("bfloat16", False)])
def test_add_layer_norm_bf16_copy(a_dtype, output_sum):
    """bf16_copy=True: one more output, last, holding y rounded to bfloat16 (nearest even) — the bits a
    reader rounding y computes; y (and s) as without it.  Inference only."""
    rng = np.random.default_rng(8)
    a32 = rng.standard_normal((3, 7, 48)).astype(np.float32) * 3 + 1
    a = P.to_bf16(a32) if a_dtype == "bfloat16" else a32
    b = rng.standard_normal((3, 7, 48)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, 48).astype(np.float32)
    beta = rng.standard_normal(48).astype(np.float32)
    args = {"a": mx.nd.array(a, dtype=a.dtype), "b": mx.nd.array(b), "g": mx.nd.array(g), "beta": mx.nd.array(beta)}

    def run(**kw):
        sym = S.fused_add_layer_norm(S.var("a", dtype=a.dtype), S.var("b"), S.var("g"), S.var("beta"), eps=1e-5,
                                     output_sum=output_sum, **kw)
        return sym, [o.asnumpy() for o in sym.bind(mx.cpu(), args, grad_req="null").forward(is_train=False)]
    _, plain = run()
    sym, outs = run(bf16_copy=True)
    assert len(outs) == len(plain) + 1
    for got, want in zip(outs, plain):
        assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))
    y = plain[0]
    want_copy = y.view(np.uint16) if P.is_bf16(y.dtype) else P.to_bf16(y).view(np.uint16)
    assert P.is_bf16(outs[-1].dtype) and np.array_equal(outs[-1].view(np.uint16), want_copy)
    if a_dtype == "float32":
        exe = sym.bind(mx.cpu(), args, args_grad={"g": mx.nd.zeros(48)},
                       grad_req={"a": "null", "b": "null", "g": "write", "beta": "null"})
        exe.forward(is_train=True)
        with pytest.raises(mx.base.MXNetError, match="bf16_copy has no backward"):
            exe.backward([mx.nd.ones(o.shape, dtype=o.dtype) for o in exe.outputs])
            mx.nd.waitall()


@needs_bf16
def test_no_bf16_copy_where_no_reader_rounds():
    """A LayerNorm gets no bf16_copy where no reader rounds its output: under float32, or where the
    product after it keeps a float32 weight (one that is not a known parameter, with that reason)."""
    sym, arg, aux, shapes = _bert()
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    assert not any(n.param("bf16_copy", False) for n in res.graph.op_nodes() if n.op == "fused_add_layer_norm")
    x = S.var("x")
    y = S.LayerNorm(S.broadcast_add(x, S.var("r")), S.var("g"), S.var("b"), axis=-1, name="ln")
    out = S.FullyConnected(y, S.var("w_in"), S.var("fc_bias"), num_hidden=16, flatten=False, name="fc") + y
    shapes = {"x": (2, 8, 16), "r": (2, 8, 16), "w_in": (16, 16)}
    arg = {"g": mx.nd.ones(16), "b": mx.nd.zeros(16), "fc_bias": mx.nd.zeros(16)}
    res = fusion.fuse(out, arg, {}, input_shapes=shapes, precision="bf16")
    lns = [n for n in res.graph.op_nodes() if n.op == "fused_add_layer_norm"]
    assert lns and not any(n.param("bf16_copy", False) for n in lns)
    text = res.report.to_text()
    assert "also written rounded to bfloat16" not in text
    assert "its weight 'w_in' is not a known parameter" in text


@needs_bf16
def test_bf16_copy_of_a_layer_norm_unfuses_and_verifies():
    """fuse(precision='bf16') gives the LayerNorms read by a projection and by the residual stream a
    bf16_copy; unfuse writes it as LayerNorm -> amp_cast, and the stock graph verifies."""
    sym, arg, aux, shapes = _bert()
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16")
    assert any(n.op == "fused_add_layer_norm" and n.param("bf16_copy", False) for n in res.graph.op_nodes())
    plain = fusion.unfuse(res.symbol, shapes, res.arg_params, res.aux_params)
    assert not any(op.startswith("fused_") for op in ops(plain))
    v = fusion.verify((sym, arg, aux), (plain, res.arg_params, res.aux_params), input_shapes=shapes)
    assert v.max_rel <= BF16_TOL, v
    again = fusion.fuse(res.symbol, res.arg_params, res.aux_params, input_shapes=shapes, precision="bf16")
    assert again.symbol.tojson() == res.symbol.tojson()


@needs_bf16
def test_unfuse_keeps_the_bf16_hand_over():
    sym = _dense_chain("gelu")
    shapes = {"x": (2, 8, 16)}
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16")
    plain = fusion.unfuse(res.symbol, shapes, res.arg_params, res.aux_params)
    assert not any(op.startswith("fused_") for op in ops(plain))
    v = fusion.verify((sym, arg, aux), (plain, res.arg_params, res.aux_params), input_shapes=shapes)
    assert v.max_rel <= BF16_TOL, v


# -- convolutions under precision="bf16": MXNet's AMP converts them first --------------------------

def _small_cnn():
    x = S.Convolution(S.var("data"), num_filter=8, kernel=(3, 3), pad=(1, 1), name="c1")
    x = S.Activation(S.BatchNorm(x, name="bn1"), act_type="relu")
    x = S.Convolution(x, num_filter=8, kernel=(3, 3), pad=(1, 1), name="c2")
    x = S.Activation(S.BatchNorm(x, name="bn2") + S.var("data"), act_type="relu")
    return S.FullyConnected(S.flatten(x), num_hidden=10, name="fc")


@needs_bf16
@pytest.mark.usefixtures("no_regions")      # where regions are made they take the convolutions instead (test_region.py)
def test_bf16_on_a_cnn_runs_its_convolutions_in_bf16_through_amp():
    sym = _small_cnn()
    shapes = {"data": (1, 8, 6, 6)}
    arg, aux = random_params(sym, shapes)
    before = {k: v.asnumpy().copy() for k, v in arg.items()}
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16")
    assert res.report.precision == P.BFLOAT16
    assert "MXNet's AMP converted the graph first (its 2 convolution(s)" in res.report.to_text()
    assert all(P.is_bf16(res.arg_params[n].dtype) for n in ("c1_weight", "c2_weight"))
    assert all(np.array_equal(arg[k].asnumpy(), v) for k, v in before.items())      # the caller's arrays
    _, out_types, _ = res.symbol.infer_type(data=np.float32)
    assert out_types == [np.float32]                                                   # model output dtype kept
    # the same model as amp.convert_model then fuse(), on the same input
    from mxnet.contrib import amp
    asym, aarg, aaux = amp.convert_model(sym, {k: v.copy() for k, v in arg.items()},
                                         {k: v.copy() for k, v in aux.items()}, target_dtype="bfloat16",
                                         cast_optional_params=True)
    x = np.random.default_rng(0).standard_normal(shapes["data"]).astype(np.float32)
    from fusion.check.verify import run as run_model     # (AMP's graph names its input twice: bound by position)
    got = run_model(res.symbol, res.arg_params, res.aux_params, {"data": x})[0]
    want = run_model(asym, aarg, aaux, {"data": x})[0].astype(np.float32)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    v = fusion.verify((sym, arg, aux), res, input_shapes=shapes)
    assert v.max_rel <= BF16_TOL, v


@needs_bf16
def test_bf16_amp_conversion_only_for_graphs_with_convolutions():
    """No convolution: the policy's own fused bf16 ops, no AMP casts; fused already: not converted again."""
    sym = _dense_model("relu")
    shapes = {"x": (2, 8, 16)}
    arg, aux = random_params(sym, shapes)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16")
    assert "amp_cast" not in ops(res) and "MXNet's AMP converted" not in res.report.to_text()
    cnn = _small_cnn()
    shapes = {"data": (1, 8, 6, 6)}
    arg, aux = random_params(cnn, shapes)
    once = fusion.fuse(cnn, arg, aux, input_shapes=shapes, precision="bf16")
    again = fusion.fuse(once.symbol, once.arg_params, once.aux_params, input_shapes=shapes, precision="bf16")
    assert "MXNet's AMP converted" not in again.report.to_text()
    assert fusion.verify((cnn, arg, aux), again, input_shapes=shapes).max_rel <= BF16_TOL


# -- fused_attention reading and writing bfloat16 -------------------------------------------------

def _qkv_input(layout, B, S_, H, D, seed=3):
    x = np.random.default_rng(seed).standard_normal((B, S_, 3 * H * D) if layout == "packed_qkv"
                                                     else (S_, B, 3 * H * D)).astype(np.float32)
    return x


def _attention_nd(x, layout, H, D, lengths=None, **kw):
    args = [x] + ([lengths] if lengths is not None else [])
    return mx.nd.fused_attention(*args, heads=H, layout=layout, scale=1 / math.sqrt(D), precision="bfloat16",
                                 mask_kind="valid_length" if lengths is not None else "none", **kw)


@needs_bf16
@pytest.mark.parametrize("layout,lengths,causal,special", [
    ("packed_qkv", False, False, None), ("interleaved", True, False, None), ("packed_qkv", False, True, None),
    ("packed_qkv", False, False, "inf_v"), ("interleaved", True, False, "nan_q"), ("packed_qkv", False, False, "odd"),
    ("packed_qkv", False, False, "wide"), ("interleaved", True, False, "wide"), ("packed_qkv", False, False, "one")])
def test_attention_reads_and_writes_bf16_exactly(layout, lengths, causal, special):
    """bfloat16 q, k, v (the values its bf16 products round them to) give the same bits as those values
    given in float32 — read as they are (finite values, no causal band) or widened (causal, a non-finite
    value); out_dtype='bfloat16' writes the float32 result rounded to nearest even."""
    # wide: head sizes past one 32-value chunk and a part chunk, keys in 5 panels (the last part full)
    B, S_, H, D = {"odd": (1, 5, 2, 9), "wide": (2, 131, 2, 40), "one": (1, 1, 2, 64)}.get(special, (2, 37, 3, 16))
    x = _qkv_input(layout, B, S_, H, D)
    if special == "inf_v":
        x[0, 3, 2 * H * D + 5] = np.inf
    elif special == "nan_q":
        x[4, 1, 2] = np.nan
    xr = bf16_round(x)
    lens = mx.nd.array(np.array([S_, S_ - 11][:B], np.float32)) if lengths else None
    kw = {"causal": True} if causal else {}
    want = _attention_nd(mx.nd.array(xr), layout, H, D, lens, **kw).asnumpy()       # float32 in, float32 out
    xb = mx.nd.array(P.to_bf16(x), dtype=P.BF16)
    got = _attention_nd(xb, layout, H, D, lens, **kw)
    assert got.dtype == np.float32 and np.array_equal(got.asnumpy(), want, equal_nan=True)
    gotb = _attention_nd(xb, layout, H, D, lens, out_dtype="bfloat16", **kw)
    assert gotb.dtype == P.BF16
    assert np.array_equal(gotb.asnumpy().view(np.uint16), P.to_bf16(want).view(np.uint16))
    out32 = _attention_nd(mx.nd.array(x), layout, H, D, lens, out_dtype="bfloat16", **kw)   # float32 in, bf16 out
    if special in (None, "wide", "one") and not causal:      # the float32 path rounds q, k, v itself: the same bits again
        assert np.array_equal(out32.asnumpy().view(np.uint16), gotb.asnumpy().view(np.uint16))
    if special in (None, "wide", "one") and not lengths:     # and the NumPy reference of the bf16 products
        q, k, v = (xr.reshape(B, S_, 3, H, D)[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        ref = _attention_reference(q, k, v, 1 / math.sqrt(D), causal=causal, rounded=True)
        ref = ref.transpose(0, 2, 1, 3).reshape(B, S_, H * D)
        assert np.abs(want - ref).max() <= 2e-3 * np.abs(ref).max()


@needs_bf16
@pytest.mark.parametrize("B,H", [(1, 2), (2, 3), (1, 12)])
def test_attention_bf16_inputs_with_an_additive_mask_exact(B, H):
    """bfloat16 q, k, v with an additive mask: the same bits as their float32 values, whether the kernel
    runs a task per head (at least two heads per thread) or per query block."""
    S_, D = 70, 32
    x = bf16_round(_qkv_input("packed_qkv", B, S_, H, D, seed=5))
    mask = np.random.default_rng(6).standard_normal((B, 1, 1, S_)).astype(np.float32) * 3
    mask[:, :, :, -5:] = -1e9

    def run(data, **kw):
        return mx.nd.fused_attention(data, mx.nd.array(mask), heads=H, layout="packed_qkv", scale=1 / math.sqrt(D),
                                     precision="bfloat16", mask_kind="additive", **kw)
    want = run(mx.nd.array(x)).asnumpy()
    xb = mx.nd.array(P.to_bf16(x), dtype=P.BF16)
    assert np.array_equal(run(xb).asnumpy(), want)
    assert np.array_equal(run(xb, out_dtype="bfloat16").asnumpy().view(np.uint16), P.to_bf16(want).view(np.uint16))


def test_attention_bf16_io_checked():
    x = mx.nd.ones((1, 4, 24))
    xb = mx.nd.amp_cast(x, dtype=P.BF16)
    with pytest.raises(mx.base.MXNetError, match="out_dtype='bfloat16' needs precision='bfloat16'"):
        mx.nd.fused_attention(x, heads=2, layout="packed_qkv", scale=1.0, out_dtype="bfloat16").asnumpy()
    with pytest.raises(mx.base.MXNetError, match="bfloat16 data inputs need precision='bfloat16'"):
        mx.nd.fused_attention(xb, heads=2, layout="packed_qkv", scale=1.0).asnumpy()
    with pytest.raises(mx.base.MXNetError, match="out_dtype"):
        mx.nd.fused_attention(x, heads=2, layout="packed_qkv", scale=1.0, precision="bfloat16",
                              out_dtype="float64").asnumpy()
    q = mx.nd.ones((1, 4, 8))
    with pytest.raises(mx.base.MXNetError, match="the data inputs must have one dtype"):
        mx.nd.fused_attention(mx.nd.amp_cast(q, dtype=P.BF16), q, q, scale=1.0, precision="bfloat16").asnumpy()
    # no backward in bfloat16
    sym = S.fused_attention(S.var("x", dtype=P.BF16), heads=2, layout="packed_qkv", scale=1.0, precision="bfloat16")
    exe = sym.bind(mx.cpu(), {"x": xb}, args_grad={"x": mx.nd.zeros(xb.shape, dtype=P.BF16)})
    exe.forward(is_train=True)
    with pytest.raises(mx.base.MXNetError, match="bfloat16 inputs or output have no backward"):
        exe.backward([mx.nd.ones(exe.outputs[0].shape)])
        mx.nd.waitall()


def _bert(layers=2, causal=False):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from bench_bert import encoder
    sym = encoder(layers=layers, hidden=32, heads=4, ffn=64, written=False)
    shapes = {"data": (2, 16, 32)}
    arg, aux = random_params(sym, shapes)
    arg = {k: mx.nd.array(v.asnumpy() * (0.2 if k.endswith("weight") else 1)) for k, v in arg.items()}
    return sym, arg, aux, shapes


@needs_bf16
def test_attention_values_held_in_bf16_are_exact():
    """QKV product -> attention -> output projection in bfloat16: the same bits as the float32 hand-overs
    (every reader rounded them to bfloat16 anyway), first and prepacked calls; unfuse keeps them."""
    sym, arg, aux, shapes = _bert()
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16")
    attn = [n for n in res.graph.op_nodes() if n.op == "fused_attention"]
    assert len(attn) == 2 and all(n.attrs.raw("out_dtype") == "bfloat16" for n in attn)
    assert all(n.inputs[0].node.op == "fused_dense" and n.inputs[0].node.attrs.raw("out_dtype") == "bfloat16"
               for n in attn)
    assert "6 fused op output(s) held in bfloat16 between ops" in res.report.to_text()
    # the LayerNorms feeding a projection write a bfloat16 copy for it (the last one is the graph output)
    lns = [n for n in res.graph.op_nodes() if n.op == "fused_add_layer_norm"]
    assert [n.param("bf16_copy", False) for n in lns] == [True, True, True, False]
    assert "3 float32 output(s) also written rounded to bfloat16" in res.report.to_text()
    x = np.random.default_rng(7).standard_normal(shapes["data"]).astype(np.float32)
    got, exe = _run(res.symbol, res.arg_params, res.aux_params, {"data": x})
    plain, exe2 = _run(_without_between(res), res.arg_params, res.aux_params, {"data": x})
    assert np.array_equal(got[0], plain[0])
    for _ in range(2):
        assert np.array_equal(exe.forward(is_train=False)[0].asnumpy(), exe2.forward(is_train=False)[0].asnumpy())
    assert fusion.verify((sym, arg, aux), res, input_shapes=shapes).max_rel <= BF16_TOL
    stock = fusion.unfuse(res.symbol, shapes, res.arg_params, res.aux_params)
    assert not any(op.startswith("fused_") for op in ops(stock))
    v = fusion.verify((sym, arg, aux), (stock, res.arg_params, res.aux_params), input_shapes=shapes)
    assert v.max_rel <= BF16_TOL, v


@needs_bf16
def test_attention_values_stay_float32_where_a_reader_needs_them(monkeypatch):
    """Causal attention (its band bounds read float32 q and k), a CPU without bf16 products (forced), an
    attention output that is also a graph output: those values stay float32."""
    from fusion.ir.graph import Entry
    sym, arg, aux, shapes = _bert(layers=1)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16")
    g = res.graph
    attn = next(n for n in g.op_nodes() if n.op == "fused_attention")
    qkv = attn.inputs[0].node.name

    def again():
        for nd in g.op_nodes():
            if "out_dtype" in nd.attrs:
                del nd.attrs["out_dtype"]
        g.mark_changed()
        return P.between_ops(g, P.BFLOAT16)

    # a graph output: the attention's value is read by the caller too
    g.heads = list(g.heads) + [Entry(attn, 0)]
    changed = again()
    assert attn.name not in changed and qkv in changed
    # causal: the QKV product's value stays float32
    g.heads = g.heads[:1]
    attn.attrs["causal"] = "True"
    changed = again()
    assert qkv not in changed and attn.name in changed
    # no native bf16 products (fuse forced): the attention computes from float32 q, k, v
    attn.attrs["causal"] = "False"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    changed = again()
    assert qkv not in changed and attn.name in changed
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert qkv in again()
