"""fused_attention vs a NumPy reference and MXNet's unfused graph.

Tolerances (fp32): forward rtol=1e-5, atol=2e-5 vs NumPy (float64 reference);
backward rtol=1e-4, atol=1e-4 vs MXNet autograd on batch_dot/softmax/batch_dot.
"""
import mxnet as mx
import numpy as np
import pytest
from mxnet.base import MXNetError
from kernel_fixtures import fused_ops, grads, run_python  # noqa: F401  (fused_ops builds + loads the library)
from references import ref_attention

FWD = dict(rtol=1e-5, atol=2e-5)
BWD = dict(rtol=1e-4, atol=1e-4)


def rnd(*shape, seed=0):
    return np.random.RandomState(seed + sum(shape)).uniform(-1, 1, shape).astype(np.float32)


def fused(*args, **attrs):
    return mx.nd.fused_attention(*[mx.nd.array(a, dtype=a.dtype) for a in args], **attrs).asnumpy()


@pytest.mark.parametrize("N,Sq,Sk,D,Dv", [(1, 1, 1, 8, 8), (2, 5, 7, 40, 40), (3, 65, 300, 80, 80),
                                         (1, 130, 257, 96, 32), (2, 64, 64, 128, 128)])
def test_plain_forward(N, Sq, Sk, D, Dv):
    q, k, v = rnd(N, Sq, D), rnd(N, Sk, D, seed=1), rnd(N, Sk, Dv, seed=2)
    scale = 1.0 / np.sqrt(D)
    np.testing.assert_allclose(fused(q, k, v, scale=scale), ref_attention(q, k, v, scale), **FWD)


def test_exact_call_form():
    q = mx.nd.array(rnd(2, 4, 8))
    out = mx.nd.fused_attention(q, q, q, scale=0.125)
    assert out.shape == (2, 4, 8)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_shape", [(2, 33, 300), (2, 1, 300), (1, 33, 300), (300,)])
def test_additive_and_boolean_masks(mask_shape, causal):
    N, Sq, Sk, D = 2, 33, 300, 16
    q, k, v = rnd(N, Sq, D), rnd(N, Sk, D, seed=1), rnd(N, Sk, D, seed=2)
    rs = np.random.RandomState(3)
    boolm = (rs.rand(*mask_shape) > 0.3).astype(np.float32)
    addm = np.where(boolm > 0, 0.0, -1e9).astype(np.float32)
    for kind, m in (("additive", addm), ("boolean", boolm)):
        got = fused(q, k, v, m, scale=0.25, mask_kind=kind, causal=causal)
        np.testing.assert_allclose(got, ref_attention(q, k, v, 0.25, m, kind, causal), **FWD)


def _unfused_mx(q, k, v, scale, mask=None, kind="none"):
    s = mx.nd.batch_dot(q, k, transpose_b=True) * scale
    if kind == "additive":
        s = mx.nd.broadcast_add(s, mask)
    elif kind == "boolean":
        s = mx.nd.where(mx.nd.broadcast_like(mask, s) != 0, s, mx.nd.ones_like(s) * -1e18)
    if kind == "valid_length":  # MXNet takes integer lengths, one per softmax row: (N, Sq)
        mask = mask.astype("int32")
        if mask.ndim == 1:
            mask = mx.nd.broadcast_to(mask.reshape((-1, 1)), shape=s.shape[:2])
        p = mx.nd.softmax(s, mask, axis=-1, use_length=True)
    else:
        p = mx.nd.softmax(s, axis=-1)
    return mx.nd.batch_dot(p, v)


@pytest.mark.parametrize("kind,value", [("additive", -1e9), ("additive", -np.inf),
                                        ("boolean", 0.0), ("valid_length", 0)])
def test_fully_masked_rows_match_mxnet(kind, value):
    N, S, D = 2, 6, 8
    q, k, v = rnd(N, S, D), rnd(N, S, D, seed=1), rnd(N, S, D, seed=2)
    if kind == "valid_length":
        m = np.array([0, 4], np.float32)
    else:
        m = np.zeros((N, S, S), np.float32) if kind == "additive" else np.ones((N, S, S), np.float32)
        m[0, 2, :] = value  # one fully masked row
        m[1, :, 3] = value
    want = _unfused_mx(*(mx.nd.array(x) for x in (q, k, v)), 0.5, mx.nd.array(m), kind).asnumpy()
    got = fused(q, k, v, m, scale=0.5, mask_kind=kind)
    np.testing.assert_allclose(got, want, equal_nan=True, **FWD)


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_valid_length(dtype):
    N, Sq, Sk, D = 3, 20, 300, 24
    q, k, v = rnd(N, Sq, D), rnd(N, Sk, D, seed=1), rnd(N, Sk, D, seed=2)
    L = np.array([0, 5, 300], dtype)
    got = fused(q, k, v, L, scale=0.3, mask_kind="valid_length")
    np.testing.assert_allclose(got, ref_attention(q, k, v, 0.3, L, "valid_length"), **FWD)
    want = _unfused_mx(*(mx.nd.array(x) for x in (q, k, v)), 0.3, mx.nd.array(L, dtype=dtype),
                       "valid_length").asnumpy()
    np.testing.assert_allclose(got, want, **FWD)
    # per-row lengths (N, Sq), exactly as softmax(use_length=True) takes them
    L2 = np.random.RandomState(0).randint(0, Sk + 1, (N, Sq)).astype(dtype)
    got = fused(q, k, v, L2, scale=0.3, mask_kind="valid_length")
    want = _unfused_mx(*(mx.nd.array(x) for x in (q, k, v)), 0.3, mx.nd.array(L2, dtype=dtype),
                       "valid_length").asnumpy()
    np.testing.assert_allclose(got, want, **FWD)


# ---- head-aware layouts ---------------------------------------------------------------
def split_heads(x, H):  # (B,S,H*D) -> (B*H,S,D)
    B, S, W = x.shape
    return x.reshape(B, S, H, W // H).transpose(0, 2, 1, 3).reshape(B * H, S, W // H)


def merge_heads(x, B):  # (B*H,S,D) -> (B,S,H*D)
    BH, S, D = x.shape
    return x.reshape(B, BH // B, S, D).transpose(0, 2, 1, 3).reshape(B, S, -1)


def test_bshd_and_packed():
    B, S, H, D = 2, 70, 3, 40
    q, k, v = rnd(B, S, H * D), rnd(B, S, H * D, seed=1), rnd(B, S, H * D, seed=2)
    want = merge_heads(ref_attention(split_heads(q, H), split_heads(k, H), split_heads(v, H), 0.2), B)
    np.testing.assert_allclose(fused(q, k, v, scale=0.2, layout="bshd", heads=H), want, **FWD)
    qkv = np.concatenate([q, k, v], axis=-1)
    np.testing.assert_allclose(fused(qkv, scale=0.2, layout="packed_qkv", heads=H), want, **FWD)
    # per-batch mask (B,1,1,S) broadcast over heads, and per-batch valid lengths
    m = (np.arange(S)[None, :] < np.array([[30], [70]])).astype(np.float32)
    m4 = m.reshape(B, 1, 1, S)
    got = fused(qkv, m4, scale=0.2, layout="packed_qkv", heads=H, mask_kind="boolean")
    want = merge_heads(ref_attention(split_heads(q, H), split_heads(k, H), split_heads(v, H), 0.2,
                                     np.repeat(m, H, 0)[:, None, :], "boolean"), B)
    np.testing.assert_allclose(got, want, **FWD)
    L = np.array([30, 70], np.float32)
    got = fused(qkv, L, scale=0.2, layout="packed_qkv", heads=H, mask_kind="valid_length")
    np.testing.assert_allclose(got, want, **FWD)


def test_interleaved_matches_mxnet_contrib():
    S, B, H, D = 37, 2, 4, 16
    qkv = rnd(S, B, H * 3 * D)
    x = mx.nd.array(qkv)
    att = mx.nd.softmax(mx.nd.contrib.interleaved_matmul_selfatt_qk(x, heads=H), axis=-1)
    want = mx.nd.contrib.interleaved_matmul_selfatt_valatt(x, att, heads=H).asnumpy()
    got = fused(qkv, scale=1.0 / np.sqrt(D), layout="interleaved", heads=H)
    np.testing.assert_allclose(got, want, **FWD)


def test_interleaved_encdec_matches_mxnet_contrib():
    Sq, Sk, B, H, D = 9, 21, 3, 2, 8
    q, kv = rnd(Sq, B, H * D), rnd(Sk, B, H * 2 * D, seed=1)
    xq, xkv = mx.nd.array(q), mx.nd.array(kv)
    att = mx.nd.softmax(mx.nd.contrib.interleaved_matmul_encdec_qk(xq, xkv, heads=H), axis=-1)
    want = mx.nd.contrib.interleaved_matmul_encdec_valatt(xkv, att, heads=H).asnumpy()
    got = fused(q, kv, scale=1.0 / np.sqrt(D), layout="interleaved_encdec", heads=H)
    np.testing.assert_allclose(got, want, **FWD)


# ---- backward --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["none", "additive", "boolean", "valid_length"])
@pytest.mark.parametrize("N,Sq,Sk,D", [(2, 7, 300, 16), (1, 70, 65, 40)])
def test_backward_vs_mxnet_autograd(kind, N, Sq, Sk, D):
    q, k, v = rnd(N, Sq, D), rnd(N, Sk, D, seed=1), rnd(N, Sk, D, seed=2)
    dy = rnd(N, Sq, D, seed=3)
    rs = np.random.RandomState(4)
    m = {"none": None,
         "additive": np.where(rs.rand(N, 1, Sk) > 0.3, 0, -1e4).astype(np.float32),
         "boolean": (rs.rand(N, Sq, Sk) > 0.3).astype(np.float32),
         "valid_length": np.array([Sk // 2 + 1] + [Sk] * (N - 1), np.float32)}[kind]
    mm = None if m is None else mx.nd.array(m)
    want = grads(lambda a, b, c: _unfused_mx(a, b, c, 0.3, mm, kind), [q, k, v], dy)
    extra = {} if m is None else {"mask_kind": kind}
    got = grads(lambda a, b, c: mx.nd.fused_attention(a, b, c, *([] if m is None else [mm]),
                                                       scale=0.3, **extra), [q, k, v], dy)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **BWD)


def test_backward_packed_and_causal():
    B, S, H, D = 2, 20, 2, 8
    qkv, dy = rnd(B, S, 3 * H * D), rnd(B, S, H * D, seed=5)

    def unfused(x):
        q, k, v = (mx.nd.slice_axis(x, axis=-1, begin=i * H * D, end=(i + 1) * H * D)
                   for i in range(3))
        sp = lambda t: t.reshape((B, S, H, D)).transpose((0, 2, 1, 3)).reshape((B * H, S, D))
        s = mx.nd.batch_dot(sp(q), sp(k), transpose_b=True) * 0.3
        tri = mx.nd.array(np.tril(np.ones((S, S))))
        s = mx.nd.where(mx.nd.broadcast_like(tri.reshape((1, S, S)), s) != 0, s,
                        mx.nd.ones_like(s) * -1e18)
        o = mx.nd.batch_dot(mx.nd.softmax(s, axis=-1), sp(v))
        return o.reshape((B, H, S, D)).transpose((0, 2, 1, 3)).reshape((B, S, H * D))

    want = grads(unfused, [qkv], dy)[0]
    got = grads(lambda x: mx.nd.fused_attention(x, scale=0.3, layout="packed_qkv", heads=H,
                                                 causal=True), [qkv], dy)[0]
    np.testing.assert_allclose(got, want, **BWD)


def test_backward_interleaved():
    S, B, H, D = 11, 2, 2, 8
    qkv, dy = rnd(S, B, H * 3 * D), rnd(S, B, H * D, seed=6)

    def unfused(x):
        att = mx.nd.softmax(mx.nd.contrib.interleaved_matmul_selfatt_qk(x, heads=H), axis=-1)
        return mx.nd.contrib.interleaved_matmul_selfatt_valatt(x, att, heads=H)

    want = grads(unfused, [qkv], dy)[0]
    got = grads(lambda x: mx.nd.fused_attention(x, scale=1 / np.sqrt(D), layout="interleaved",
                                                 heads=H), [qkv], dy)[0]
    np.testing.assert_allclose(got, want, **BWD)


def test_symbol_json_roundtrip():
    q, k, v = (mx.sym.var(n) for n in "qkv")
    s = mx.sym.fused_attention(q, k, v, scale=0.5, causal=True)
    s2 = mx.sym.load_json(s.tojson())
    a = {n: mx.nd.array(rnd(2, 9, 8, seed=i)) for i, n in enumerate("qkv")}
    out = s2.bind(mx.cpu(), a).forward()[0].asnumpy()
    want = ref_attention(*(a[n].asnumpy() for n in "qkv"), 0.5, causal=True)
    np.testing.assert_allclose(out, want, **FWD)


@pytest.mark.parametrize("attrs,msg", [
    (dict(scale=0.1, layout="bhsd"), "layout"),
    (dict(scale=0.1, mask_kind="soft"), "mask_kind"),
    (dict(layout="plain"), "scale"),
    (dict(scale=0.1, causal="maybe"), "causal"),
    (dict(scale=0.1, layout="bshd"), "heads"),
    (dict(scale=0.1, nan_probs="all"), "nan_probs"),
])
def test_invalid_attributes(attrs, msg):
    q = mx.nd.array(rnd(2, 4, 8))
    with pytest.raises(MXNetError, match=msg):
        mx.nd.fused_attention(q, q, q, **attrs).wait_to_read()


def test_bad_shapes_are_reported():
    q, k = mx.nd.array(rnd(2, 4, 8)), mx.nd.array(rnd(2, 5, 6))
    with pytest.raises(MXNetError, match="q \\(\.\.,Sq,D\\)"):
        mx.nd.fused_attention(q, k, k, scale=0.1).wait_to_read()
    with pytest.raises(MXNetError, match="does not broadcast"):
        mx.nd.fused_attention(q, q, q, mx.nd.ones((3, 4, 4)), scale=0.1,
                              mask_kind="additive").wait_to_read()
    # a condition larger than the scores (what MXNet's where cannot read) never reaches the kernel
    with pytest.raises(MXNetError, match="does not broadcast"):
        mx.nd.fused_attention(q, q, q, mx.nd.ones((3, 4, 4)), scale=0.1,
                              mask_kind="boolean").wait_to_read()
    x = mx.nd.array(rnd(4, 2, 3 * 2 * 3))
    with pytest.raises(MXNetError, match="valid_length must have"):
        mx.nd.fused_attention(x, mx.nd.ones((3,)), scale=0.1, layout="interleaved", heads=2,
                              mask_kind="valid_length").wait_to_read()


@pytest.mark.parametrize("Sq,Sk", [(40, 300), (300, 40), (1, 1)])
def test_causal_with_valid_length(Sq, Sk):
    """Bottom-right aligned causal band combined with per-row lengths; rows that see no
    key (Sq > Sk, or length 0) give 0."""
    N, D = 2, 16
    q, k, v = rnd(N, Sq, D), rnd(N, Sk, D, seed=1), rnd(N, Sk, D, seed=2)
    L = np.random.RandomState(1).randint(0, Sk + 1, (N, Sq)).astype(np.int32)
    got = fused(q, k, v, L, scale=0.3, mask_kind="valid_length", causal=True)
    np.testing.assert_allclose(got, ref_attention(q, k, v, 0.3, L, "valid_length", causal=True),
                               **FWD)


def test_backward_encdec_and_bshd():
    Sq, Sk, B, H, D = 7, 12, 2, 2, 8
    q, kv, dy = rnd(Sq, B, H * D), rnd(Sk, B, H * 2 * D, seed=1), rnd(Sq, B, H * D, seed=2)

    def unfused(q, kv):
        att = mx.nd.softmax(mx.nd.contrib.interleaved_matmul_encdec_qk(q, kv, heads=H), axis=-1)
        return mx.nd.contrib.interleaved_matmul_encdec_valatt(kv, att, heads=H)

    want = grads(unfused, [q, kv], dy)
    got = grads(lambda q, kv: mx.nd.fused_attention(q, kv, scale=1 / np.sqrt(D), heads=H,
                                                     layout="interleaved_encdec"), [q, kv], dy)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **BWD)

    S = 9
    x = [rnd(B, S, H * D, seed=i) for i in range(3)]
    dy = rnd(B, S, H * D, seed=5)

    def unfused_bshd(q, k, v):
        sp = lambda t: t.reshape((B, S, H, D)).transpose((0, 2, 1, 3)).reshape((B * H, S, D))
        o = _unfused_mx(sp(q), sp(k), sp(v), 0.4)
        return o.reshape((B, H, S, D)).transpose((0, 2, 1, 3)).reshape((B, S, H * D))

    want = grads(unfused_bshd, x, dy)
    got = grads(lambda q, k, v: mx.nd.fused_attention(q, k, v, scale=0.4, layout="bshd", heads=H),
                 x, dy)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **BWD)


def test_portable_path_without_avx512():
    """MXFUSION_DISABLE_AVX512=1 takes the dnnl_sgemm tile products and portable softmax
    loops (what CPUs without AVX-512 run): same results as the reference."""
    code = (
        "import numpy as np, mxnet as mx, fusion\n"
        "from references import ref_attention\n"
        "rs = np.random.RandomState(0)\n"
        "for N, Sq, Sk, D, Dv, causal in [(2, 5, 7, 40, 40, False), (1, 130, 257, 96, 32, True)]:\n"
        "    q, k, v = (rs.uniform(-1, 1, s).astype(np.float32) for s in\n"
        "               [(N, Sq, D), (N, Sk, D), (N, Sk, Dv)])\n"
        "    got = mx.nd.fused_attention(mx.nd.array(q), mx.nd.array(k), mx.nd.array(v),\n"
        "                                scale=0.2, causal=causal).asnumpy()\n"
        "    np.testing.assert_allclose(got, ref_attention(q, k, v, 0.2, causal=causal),\n"
        "                               rtol=1e-5, atol=1e-5)\n"
        "print('ok')\n")
    assert "ok" in run_python(code, MXFUSION_DISABLE_AVX512="1")


# ---- every rank of the plain layout, masks aligned from the last axis -----------------------
def _mx_unfused(q, k, v, scale, mask=None, kind="none", causal=None, mask_value=-1e18):
    """The unfused MXNet graph at any rank: batch_dot / softmax / batch_dot, the mask added with
    broadcast_add (aligned from the last axis), causal=(mode, c) as an explicit band."""
    s = mx.nd.batch_dot(q, k, transpose_b=True) * scale
    if causal is not None:
        mode, c = causal
        Sq, Sk = s.shape[-2:]
        band = mx.nd.array(np.arange(Sk)[None, :] <= np.arange(Sq)[:, None] + (Sk - Sq))
        if mode == "add":
            s = mx.nd.broadcast_add(s, mx.nd.where(band, mx.nd.zeros_like(band), mx.nd.ones_like(band) * c))
        else:
            s = mx.nd.where(mx.nd.broadcast_add(mx.nd.zeros_like(s), band), s, mx.nd.ones_like(s) * c)
    if kind == "additive":
        s = mx.nd.broadcast_add(s, mask)
    elif kind == "boolean":
        s = mx.nd.where(mx.nd.broadcast_add(mx.nd.zeros_like(s), mask), s, mx.nd.ones_like(s) * mask_value)
    if kind == "valid_length":
        p = mx.nd.softmax(s, mask.astype("int32"), axis=-1, use_length=True)
    else:
        p = mx.nd.softmax(s, axis=-1)
    return mx.nd.batch_dot(p, v)


def _same(got, want, rtol=1e-5):
    """Equal NaN / inf positions, finite values within rtol of the output's scale."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    if fin.any():
        scale = max(np.abs(want[fin]).max(), 1e-6)
        assert np.abs(got[fin] - want[fin]).max() <= rtol * scale, np.abs(got[fin] - want[fin]).max() / scale


@pytest.mark.parametrize("shape", [(5, 8), (2, 3, 5, 8), (2, 2, 3, 5, 8)])
def test_plain_any_rank(shape):
    q = rnd(*shape)
    kshape = shape[:-2] + (7, shape[-1])
    k, v = rnd(*kshape, seed=1), rnd(*kshape, seed=2)
    got = fused(q, k, v, scale=0.3)
    n = int(np.prod(shape[:-2]))
    want = ref_attention(q.reshape(n, 5, 8), k.reshape(n, 7, 8), v.reshape(n, 7, 8), 0.3)
    assert got.shape == shape
    np.testing.assert_allclose(got.reshape(n, 5, 8), want, **FWD)


@pytest.mark.parametrize("mshape", [(3, 5, 7), (2, 1, 5, 7), (1, 3, 1, 7), (7,), (5, 1), (2, 3, 5, 7)])
def test_rank4_masks_broadcast_like_broadcast_add(mshape):
    """On (B, H, Sq, Sk) scores a rank-3 mask is (H, Sq, Sk), as MXNet's broadcasting reads it."""
    B, H, Sq, Sk, D = 2, 3, 5, 7, 8
    q, k, v = rnd(B, H, Sq, D), rnd(B, H, Sk, D, seed=1), rnd(B, H, Sk, D, seed=2)
    m = np.random.RandomState(3).randn(*mshape).astype(np.float32) * 3
    dy = rnd(B, H, Sq, D, seed=4)
    args = [q, k, v, m]
    want = grads(lambda a, b, c, d: _mx_unfused(a, b, c, 0.4, d, "additive"), args, dy)
    got = grads(lambda a, b, c, d: mx.nd.fused_attention(a, b, c, d, scale=0.4, mask_kind="additive"), args, dy)
    _same(fused(q, k, v, m, scale=0.4, mask_kind="additive"),
          _mx_unfused(*(mx.nd.array(x) for x in args[:3]), 0.4, mx.nd.array(m), "additive").asnumpy())
    for g, w in zip(got, want):              # dq, dk, dv and d(mask), reduced to the mask's shape
        np.testing.assert_allclose(g, w, **BWD)


def test_rank4_valid_length_per_head_and_row():
    B, H, Sq, Sk, D = 2, 3, 5, 7, 8
    q, k, v = rnd(B, H, Sq, D), rnd(B, H, Sk, D, seed=1), rnd(B, H, Sk, D, seed=2)
    L = np.random.RandomState(0).randint(0, Sk + 1, (B, H, Sq)).astype(np.int32)
    want = _mx_unfused(*(mx.nd.array(x) for x in (q, k, v)), 0.3, mx.nd.array(L, dtype="int32"), "valid_length")
    _same(fused(q, k, v, L, scale=0.3, mask_kind="valid_length"), want.asnumpy())


# ---- causal modes: the unfused graph's additive and where() masks, exactly ------------------
@pytest.mark.parametrize("mode", ["add", "fill"])
@pytest.mark.parametrize("c", [-1e9, -1e4, -np.inf, 2.0])
@pytest.mark.parametrize("Sq,Sk,amp", [(40, 300, 1.0), (300, 40, 1.0), (70, 70, 1.0), (33, 33, 400.0)])
def test_causal_modes_match_the_unfused_masks(mode, c, Sq, Sk, amp):
    """Rows with no key in their band (Sq > Sk) and scores spread wider than |c| (amp) included:
    the keys after the band are skipped only where that changes nothing."""
    N, D = 2, 16
    q, k, v = rnd(N, Sq, D) * amp, rnd(N, Sk, D, seed=1) * amp, rnd(N, Sk, D, seed=2)
    got = fused(q, k, v, scale=0.25, causal=True, causal_mode=mode, mask_value=c)
    # a row that sees no key under an additive -1e4 is softmax(s - 1e4): float32 rounds s - 1e4
    # to 1e-3, so float32 graphs agree to ~1e-3 of p there, not to 1e-5
    tol = 5e-4 if (mode, c) == ("add", -1e4) and Sq > Sk else 1e-5
    np.testing.assert_allclose(got, ref_attention(q, k, v, 0.25, causal=True, causal_mode=mode, mask_value=c),
                               rtol=tol, atol=2 * tol)
    want = _mx_unfused(*(mx.nd.array(x) for x in (q, k, v)), 0.25, causal=(mode, c)).asnumpy()
    _same(got, want, rtol=tol)


@pytest.mark.parametrize("mode,c", [("add", -1e9), ("fill", -1e18), ("add", -1e4), ("fill", -np.inf)])
@pytest.mark.parametrize("Sq,Sk", [(20, 20), (30, 12), (9, 70)])
def test_causal_modes_backward(mode, c, Sq, Sk):
    N, D = 2, 8
    q, k, v = rnd(N, Sq, D) * 3, rnd(N, Sk, D, seed=1) * 3, rnd(N, Sk, D, seed=2)
    dy = rnd(N, Sq, D, seed=3)
    want = grads(lambda a, b, d: _mx_unfused(a, b, d, 0.5, causal=(mode, c)), [q, k, v], dy)
    got = grads(lambda a, b, d: mx.nd.fused_attention(a, b, d, scale=0.5, causal=True, causal_mode=mode,
                                                       mask_value=c), [q, k, v], dy)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **BWD)


def test_causal_mode_attributes_are_checked():
    q = mx.nd.array(rnd(2, 4, 8))
    with pytest.raises(MXNetError, match="only used with causal=True"):
        mx.nd.fused_attention(q, q, q, scale=0.1, causal_mode="add", mask_value=-1e9).wait_to_read()
    with pytest.raises(MXNetError, match="needs mask_value"):
        mx.nd.fused_attention(q, q, q, scale=0.1, causal=True, causal_mode="fill").wait_to_read()
    with pytest.raises(MXNetError, match="takes no mask input"):
        mx.nd.fused_attention(q, q, q, mx.nd.ones((4, 4)), scale=0.1, causal=True, causal_mode="add",
                              mask_value=-1e9, mask_kind="additive").wait_to_read()


# ---- non-finite values: as the unfused graph --------------------------------------------------
_NAN_CASES = {
    "q NaN": lambda q, k, v, m: q.__setitem__((0, 1, 2), np.nan),
    "k NaN (visible)": lambda q, k, v, m: k.__setitem__((0, 1, 0), np.nan),
    "k NaN (late key)": lambda q, k, v, m: k.__setitem__((0, 5, 0), np.nan),
    "v NaN (late key)": lambda q, k, v, m: v.__setitem__((0, 5, 1), np.nan),
    "v inf (late key)": lambda q, k, v, m: v.__setitem__((0, 5, 1), np.inf),
    "q inf": lambda q, k, v, m: q.__setitem__((1, 2, 0), np.inf),
    "mask NaN": lambda q, k, v, m: m.__setitem__((0, 2, 3), np.nan),
    "mask row -inf": lambda q, k, v, m: m.__setitem__((0, 2), -np.inf),
    "mask +inf": lambda q, k, v, m: m.__setitem__((1, 3, 1), np.inf),
}


@pytest.mark.parametrize("case", sorted(_NAN_CASES))
@pytest.mark.parametrize("kind", ["none", "additive", "boolean", "valid_length", "causal_add", "causal_fill",
                                  "causal_exclude"])
def test_non_finite_values_follow_mxnet(kind, case):
    N, S, D = 2, 6, 4
    q, k, v = rnd(N, S, D), rnd(N, S, D, seed=1), rnd(N, S, D, seed=2)
    m = np.zeros((N, S, S), np.float32) if kind == "additive" else np.ones((N, S, S), np.float32)
    if "mask" in case and kind not in ("additive", "boolean"):
        pytest.skip("no mask input")
    _NAN_CASES[case](q, k, v, m)
    L = np.array([[6, 3, 0, 2, 5, 1], [4, 6, 6, 0, 1, 2]], np.int32)
    nd = [mx.nd.array(x) for x in (q, k, v)]
    if kind.startswith("causal"):
        mode = kind.split("_")[1]
        if mode == "exclude":   # the unfused form of the excluded band: softmax lengths
            band = np.minimum(np.arange(S) + 1, S).astype(np.int32)[None].repeat(N, 0)
            want = _mx_unfused(*nd, 0.5, mx.nd.array(band, dtype="int32"), "valid_length")
            got = fused(q, k, v, scale=0.5, causal=True)
        else:
            want = _mx_unfused(*nd, 0.5, causal=(mode, -1e9))
            got = fused(q, k, v, scale=0.5, causal=True, causal_mode=mode, mask_value=-1e9)
    elif kind == "valid_length":
        want = _mx_unfused(*nd, 0.5, mx.nd.array(L, dtype="int32"), kind)
        got = fused(q, k, v, L, scale=0.5, mask_kind=kind)
    elif kind == "none":
        want, got = _mx_unfused(*nd, 0.5), fused(q, k, v, scale=0.5)
    else:
        want = _mx_unfused(*nd, 0.5, mx.nd.array(m), kind)
        got = fused(q, k, v, m, scale=0.5, mask_kind=kind)
    _same(got, want.asnumpy())


# ---- backward: fully masked rows, mask gradients -----------------------------------------------
@pytest.mark.parametrize("kind", ["additive_1e9", "additive_1e4_shifted", "boolean", "valid_length",
                                  "causal_exclude"])
def test_fully_masked_rows_backward(kind):
    """Gradients of rows that see no key, as MXNet's unfused graph gives them (a row of -1e9 is
    the uniform average, so its P is 1/Sk, not 1; a length-0 row has none)."""
    N, Sq, Sk, D = 2, 9, 6, 4
    q, k, v = rnd(N, Sq, D), rnd(N, Sk, D, seed=1), rnd(N, Sk, D, seed=2)
    dy = rnd(N, Sq, D, seed=3)
    if kind.startswith("additive"):
        m = np.zeros((N, Sq, Sk), np.float32)
        m[0, 1, :] = -1e9 if kind == "additive_1e9" else -1e4
        m[1, :, 2:] = -1e9
        m[1, 4, :] = -1e9
        mm = mx.nd.array(m)
        want = grads(lambda a, b, c: _mx_unfused(a, b, c, 0.5, mm, "additive"), [q, k, v], dy)
        got = grads(lambda a, b, c: mx.nd.fused_attention(a, b, c, mm, scale=0.5, mask_kind="additive"),
                    [q, k, v], dy)
    elif kind == "boolean":
        m = (np.random.RandomState(0).rand(N, Sq, Sk) > 0.4).astype(np.float32)
        m[0, 3, :] = 0
        mm = mx.nd.array(m)
        want = grads(lambda a, b, c: _mx_unfused(a, b, c, 0.5, mm, "boolean", mask_value=-1e9), [q, k, v], dy)
        got = grads(lambda a, b, c: mx.nd.fused_attention(a, b, c, mm, scale=0.5, mask_kind="boolean",
                                                           mask_value=-1e9), [q, k, v], dy)
    else:
        if kind == "valid_length":
            L = np.random.RandomState(1).randint(0, Sk + 1, (N, Sq)).astype(np.int32)
            L[0, :3] = 0
            attrs = dict(mask_kind="valid_length")
            extra = [mx.nd.array(L, dtype="int32")]
        else:                                         # Sq > Sk: the first rows see no key
            L = np.clip(np.arange(Sq) + 1 + Sk - Sq, 0, Sk).astype(np.int32)[None].repeat(N, 0)
            attrs, extra = dict(causal=True), []
        mL = mx.nd.array(L, dtype="int32")
        want = grads(lambda a, b, c: _mx_unfused(a, b, c, 0.5, mL, "valid_length"), [q, k, v], dy)
        got = grads(lambda a, b, c: mx.nd.fused_attention(a, b, c, *extra, scale=0.5, **attrs), [q, k, v], dy)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **BWD)


@pytest.mark.parametrize("mshape", [(2, 9, 13), (1, 9, 13), (1, 1, 13), (9, 13), (13,), (2, 1, 1), (2, 9, 1)])
def test_additive_mask_gradient_is_reduced_to_its_shape(mshape):
    N, Sq, Sk, D = 2, 9, 13, 8
    q, k, v = rnd(N, Sq, D), rnd(N, Sk, D, seed=1), rnd(N, Sk, D, seed=2)
    m = np.random.RandomState(5).randn(*mshape).astype(np.float32)
    dy = rnd(N, Sq, D, seed=3)
    want = grads(lambda a, b, c, d: _mx_unfused(a, b, c, 0.3, d, "additive"), [q, k, v, m], dy)
    got = grads(lambda a, b, c, d: mx.nd.fused_attention(a, b, c, d, scale=0.3, mask_kind="additive"),
                [q, k, v, m], dy)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **BWD)


@pytest.mark.parametrize("mshape", [(6, 1, 20), (2, 3, 20, 20), (2, 1, 1, 20), (1, 3, 20, 20), (20, 20)])
def test_mask_gradient_head_layouts(mshape):
    """bshd / packed_qkv: a rank-4 mask per (B, H, Sq, Sk), lower ranks per (B·H, Sq, Sk)."""
    B, S, H, D = 2, 20, 3, 8
    x, dy = rnd(B, S, 3 * H * D), rnd(B, S, H * D, seed=5)
    m = np.random.RandomState(2).randn(*mshape).astype(np.float32)
    rank = 4 if len(mshape) == 4 else 3

    def unfused(x, m):
        q, k, v = (mx.nd.slice_axis(x, axis=-1, begin=i * H * D, end=(i + 1) * H * D) for i in range(3))
        sp = lambda t: t.reshape((B, S, H, D)).transpose((0, 2, 1, 3))
        q, k, v = ((sp(t) if rank == 4 else sp(t).reshape((B * H, S, D))) for t in (q, k, v))
        o = _mx_unfused(q, k, v, 0.3, m, "additive")
        return o.reshape((B, H, S, D)).transpose((0, 2, 1, 3)).reshape((B, S, H * D))

    want = grads(unfused, [x, m], dy)
    got = grads(lambda x, m: mx.nd.fused_attention(x, m, scale=0.3, layout="packed_qkv", heads=H,
                                                   mask_kind="additive"), [x, m], dy)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **BWD)


def test_condition_and_length_inputs_get_zero_gradient():
    """As where() gives its condition and softmax(use_length=True) its lengths."""
    N, S, D = 2, 7, 8
    q, k, v = rnd(N, S, D), rnd(N, S, D, seed=1), rnd(N, S, D, seed=2)
    cond = (np.random.RandomState(0).rand(N, S, S) > 0.3).astype(np.float32)
    L = np.array([3, 7], np.float32)
    for m, kind in ((cond, "boolean"), (L, "valid_length")):
        g = grads(lambda a, b, c, d: mx.nd.fused_attention(a, b, c, d, scale=0.3, mask_kind=kind),
                  [q, k, v, m], rnd(N, S, D, seed=3))
        assert not g[3].any()


@pytest.mark.parametrize("avx512", ["0", "1"])
def test_edge_semantics_across_small_tiles(avx512):
    """Tiles of 8 rows × 32 keys (MXFUSION_ATTN_BQ/BK), both tile-product paths: a NaN score in a
    tile that is otherwise -inf still makes the row NaN when later tiles are finite; causal add
    rows that must compute the keys after their band; the non-finite v rule across tiles."""
    code = (
        "import numpy as np, mxnet as mx, fusion\n"
        "from references import ref_attention\n"
        "rs = np.random.RandomState(0)\n"
        "q, k, v = (rs.uniform(-1, 1, (2, 20, 8)).astype(np.float32) for _ in range(3))\n"
        "k = rs.uniform(-1, 1, (2, 70, 8)).astype(np.float32); v = rs.uniform(-1, 1, (2, 70, 8)).astype(np.float32)\n"
        "m = np.zeros((2, 20, 70), np.float32); m[0, 3, :32] = -np.inf; m[0, 3, 5] = np.nan\n"
        "nd = lambda *a: [mx.nd.array(x) for x in a]\n"
        "got = mx.nd.fused_attention(*nd(q, k, v, m), scale=0.5, mask_kind='additive').asnumpy()\n"
        "assert np.isnan(got[0, 3]).all() and np.isfinite(np.delete(got[0], 3, 0)).all()\n"
        "for c, amp in ((-1e4, 300.0), (-1e9, 1.0)):\n"
        "    got = mx.nd.fused_attention(*nd(q * amp, k * amp, v), scale=0.5, causal=True, causal_mode='add',\n"
        "                                mask_value=c).asnumpy()\n"
        "    want = ref_attention(q * amp, k * amp, v, 0.5, causal=True, causal_mode='add', mask_value=c)\n"
        "    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)\n"
        "v2 = v.copy(); v2[1, 69, 2] = np.inf\n"
        "L = np.array([70, 40], np.int32)\n"
        "got = mx.nd.fused_attention(*nd(q, k, v2), mx.nd.array(L, dtype='int32'), scale=0.5,\n"
        "                            mask_kind='valid_length').asnumpy()\n"
        "assert np.isnan(got[1, :, 2]).all() and np.isfinite(np.delete(got[1], 2, 1)).all()\n"
        "assert np.isfinite(got[0]).all()\n"
        "print('ok')\n")
    env = dict(MXFUSION_ATTN_BQ="8", MXFUSION_ATTN_BK="32")
    if avx512 == "0":
        env["MXFUSION_DISABLE_AVX512"] = "1"
    assert "ok" in run_python(code, **env)


# ---- backward: non-finite values as the unfused graph ------------------------------------------
_NAN_GRAD_CASES = dict(_NAN_CASES, **{
    "k -inf (late key)": lambda q, k, v, m, dy: k.__setitem__((1, 5, 2), -np.inf),
    "v NaN (visible)": lambda q, k, v, m, dy: v.__setitem__((1, 0, 3), np.nan),
    "dy NaN": lambda q, k, v, m, dy: dy.__setitem__((1, 3, 2), np.nan),
    "dy inf": lambda q, k, v, m, dy: dy.__setitem__((0, 0, 1), np.inf),
})


def _grads_same(got, want, rtol=1e-4):
    for g, w in zip(got, want):
        _same(g, w, rtol)


@pytest.mark.parametrize("case", sorted(_NAN_GRAD_CASES))
@pytest.mark.parametrize("kind", ["none", "additive", "boolean", "valid_length", "causal_add", "causal_fill",
                                  "causal_exclude"])
def test_non_finite_values_backward_follow_mxnet(kind, case):
    """Gradients with a NaN / ±inf in q, k, v, the mask or dO, as MXNet's unfused graph gives them:
    rows whose softmax is NaN (oneDNN's probabilities, MXNet's own with lengths), keys after a
    row's length (0 among them, a row with no key) or causal band still multiplied by the
    products (0·inf), the softmax's row sum over the keys the row sees."""
    N, Sq, Sk, D = 2, 6, 7, 4
    q, k, v = rnd(N, Sq, D), rnd(N, Sk, D, seed=1), rnd(N, Sk, D, seed=2)
    dy = rnd(N, Sq, D, seed=3)
    m = np.zeros((N, Sq, Sk), np.float32) if kind == "additive" else np.ones((N, Sq, Sk), np.float32)
    if "mask" in case and kind not in ("additive", "boolean"):
        pytest.skip("no mask input")
    f = _NAN_GRAD_CASES[case]
    f(q, k, v, m, dy) if f.__code__.co_argcount == 5 else f(q, k, v, m)
    if kind == "boolean":
        m[0, 4, :] = 0
        m[1, :, 3] = 0
    L = np.array([[6, 3, 0, 2, 7, 1], [4, 7, 7, 0, 1, 2]], np.int32)
    mm = mx.nd.array(m)
    if kind.startswith("causal"):
        mode = kind.split("_")[1]
        if mode == "exclude":   # the unfused form of the excluded band: softmax lengths
            band = np.clip(np.arange(Sq) + 1 + Sk - Sq, 0, Sk).astype(np.int32)[None].repeat(N, 0)
            mb = mx.nd.array(band, dtype="int32")
            un = lambda a, b, c: _mx_unfused(a, b, c, 0.5, mb, "valid_length")
            fu = lambda a, b, c: mx.nd.fused_attention(a, b, c, scale=0.5, causal=True)
        else:
            un = lambda a, b, c: _mx_unfused(a, b, c, 0.5, causal=(mode, -1e9))
            fu = lambda a, b, c: mx.nd.fused_attention(a, b, c, scale=0.5, causal=True, causal_mode=mode,
                                                        mask_value=-1e9)
    elif kind == "valid_length":
        mL = mx.nd.array(L, dtype="int32")
        un = lambda a, b, c: _mx_unfused(a, b, c, 0.5, mL, kind)
        fu = lambda a, b, c: mx.nd.fused_attention(a, b, c, mL, scale=0.5, mask_kind=kind)
    elif kind == "none":
        un = lambda a, b, c: _mx_unfused(a, b, c, 0.5)
        fu = lambda a, b, c: mx.nd.fused_attention(a, b, c, scale=0.5)
    else:
        un = lambda a, b, c: _mx_unfused(a, b, c, 0.5, mm, kind, mask_value=-1e9)
        fu = lambda a, b, c: mx.nd.fused_attention(a, b, c, mm, scale=0.5, mask_kind=kind, mask_value=-1e9)
    _grads_same(grads(fu, [q, k, v], dy), grads(un, [q, k, v], dy))


@pytest.mark.parametrize("Sk", [7, 15, 16, 17, 33, 70])
@pytest.mark.parametrize("where", ["first", "last", "two", "all_neg_inf"])
def test_nan_rows_probabilities_as_onednn_softmax(Sk, where):
    """A key of k holding a NaN makes every row that sees it NaN; dV of those rows reads the
    probabilities MXNet's oneDNN softmax gives (NaN at the key, and at the vector lane its max
    reduction carries the NaN to), and MXNet's own kernel (a temperature: nan_probs="row") gives
    the whole row NaN.  With causal fill, the rows after the key keep finite gradients."""
    N, Sq, D = 2, 40, 4
    q, k, v = rnd(N, Sq, D), rnd(N, Sk, D, seed=1), rnd(N, Sk, D, seed=2)
    dy = rnd(N, Sq, D, seed=3)
    if where == "first":
        k[0, 0, 1] = np.nan
    elif where == "last":
        k[0, Sk - 1, 1] = np.nan
    elif where == "two":
        k[0, Sk // 2, 0] = np.nan
        k[1, Sk - 1, 3] = np.nan
    m = None
    if where == "all_neg_inf":                        # rows of -inf only, one with a NaN
        m = np.zeros((N, Sq, Sk), np.float32)
        m[0, 3, :] = -np.inf
        m[1, 5, :] = -np.inf
        m[1, 5, Sk // 3] = np.nan
    mm = None if m is None else mx.nd.array(m)
    extra = {} if m is None else {"mask_kind": "additive"}
    for temperature in (None, 1.0):
        def unfused(a, b, c):
            s = mx.nd.batch_dot(a, b, transpose_b=True) * 0.5
            s = s if mm is None else mx.nd.broadcast_add(s, mm)
            t = {} if temperature is None else {"temperature": temperature}
            return mx.nd.batch_dot(mx.nd.softmax(s, axis=-1, **t), c)

        probs = {} if temperature is None else {"nan_probs": "row"}
        want = grads(unfused, [q, k, v], dy)
        got = grads(lambda a, b, c: mx.nd.fused_attention(a, b, c, *([] if mm is None else [mm]), scale=0.5,
                                                           **extra, **probs), [q, k, v], dy)
        _grads_same(got, want)
    # causal fill: the NaN key is after the band of the early rows (their scores are replaced)
    want = grads(lambda a, b, c: _mx_unfused(a, b, c, 0.5, causal=("fill", -1e4)), [q, k, v], dy)
    got = grads(lambda a, b, c: mx.nd.fused_attention(a, b, c, scale=0.5, causal=True, causal_mode="fill",
                                                       mask_value=-1e4), [q, k, v], dy)
    _grads_same(got, want)


@pytest.mark.parametrize("env", [{"DNNL_MAX_CPU_ISA": "AVX2"}, {"MXNET_MKLDNN_ENABLED": "0"}])
def test_nan_rows_follow_the_softmax_mxnet_runs(env):
    """oneDNN capped to AVX2 (8-float lanes, the tail run as a padded vector), and MXNet's own
    softmax when its oneDNN kernels are off: the op reads the same switches."""
    code = (
        "import numpy as np, mxnet as mx, fusion\n"
        "from kernel_fixtures import grads\n"
        "rs = np.random.RandomState(0)\n"
        "for Sk in (7, 9, 13, 17, 33):\n"
        "    q, k, v, dy = (rs.uniform(-1, 1, s).astype(np.float32) for s in\n"
        "                   [(2, 20, 4), (2, Sk, 4), (2, Sk, 4), (2, 20, 4)])\n"
        "    k[0, Sk - 1, 1] = np.nan; k[1, Sk // 2, 2] = np.nan; k[1, 1, 0] = np.inf\n"
        "    un = lambda a, b, c: mx.nd.batch_dot(mx.nd.softmax(mx.nd.batch_dot(a, b, transpose_b=True) * 0.5,\n"
        "                                                       axis=-1), c)\n"
        "    fu = lambda a, b, c: mx.nd.fused_attention(a, b, c, scale=0.5)\n"
        "    for g, w in zip(grads(fu, [q, k, v], dy), grads(un, [q, k, v], dy)):\n"
        "        assert np.array_equal(np.isnan(g), np.isnan(w)), Sk\n"
        "        f = np.isfinite(w)\n"
        "        assert not f.any() or np.abs(g[f] - w[f]).max() <= 1e-4 * max(np.abs(w[f]).max(), 1e-6)\n"
        "print('ok')\n")
    assert "ok" in run_python(code, **env)


def _interleaved_unfused(x, L, H, temperature=None):
    s = mx.nd.contrib.interleaved_matmul_selfatt_qk(x, heads=H)
    p = mx.nd.softmax(s, L, axis=-1, use_length=True) if L is not None else mx.nd.softmax(s, axis=-1)
    return mx.nd.contrib.interleaved_matmul_selfatt_valatt(x, p, heads=H)


@pytest.mark.parametrize("layout", ["interleaved", "interleaved_encdec", "packed_qkv", "bshd", "plain4"])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_lengths_zero_backward_every_layout(layout, nonfinite):
    """Rows of length 0 (and others) in every layout, with a NaN / ±inf in the projections or
    not: gradients as MXNet's softmax(use_length=True) graph gives them."""
    S, B, H, D = 6, 2, 2, 3
    rs = np.random.RandomState(7)
    L = rs.randint(0, S + 1, (B * H, S)).astype(np.int32)
    L[0, :2] = 0
    L[3, 4] = 0
    mL = mx.nd.array(L, dtype="int32")
    split = lambda t: t.reshape((B, S, H, D)).transpose((0, 2, 1, 3)).reshape((B * H, S, D))
    merge = lambda o: o.reshape((B, H, S, D)).transpose((0, 2, 1, 3)).reshape((B, S, H * D))
    if layout == "interleaved":
        xs = [rnd(S, B, H * 3 * D)]
        un = lambda x: _interleaved_unfused(x, mL, H)
        fu = lambda x: mx.nd.fused_attention(x, mL, scale=1 / np.sqrt(D), layout=layout, heads=H,
                                             mask_kind="valid_length")
    elif layout == "interleaved_encdec":
        xs = [rnd(S, B, H * D), rnd(S, B, H * 2 * D, seed=1)]

        def un(q, kv):
            s = mx.nd.contrib.interleaved_matmul_encdec_qk(q, kv, heads=H)
            return mx.nd.contrib.interleaved_matmul_encdec_valatt(
                kv, mx.nd.softmax(s, mL, axis=-1, use_length=True), heads=H)

        fu = lambda q, kv: mx.nd.fused_attention(q, kv, mL, scale=1 / np.sqrt(D), layout=layout, heads=H,
                                                 mask_kind="valid_length")
    elif layout == "packed_qkv":
        xs = [rnd(B, S, 3 * H * D)]

        def un(x):
            q, k, v = (split(mx.nd.slice_axis(x, axis=-1, begin=i * H * D, end=(i + 1) * H * D)) for i in range(3))
            return merge(_mx_unfused(q, k, v, 0.4, mL, "valid_length"))

        fu = lambda x: mx.nd.fused_attention(x, mL, scale=0.4, layout=layout, heads=H, mask_kind="valid_length")
    elif layout == "bshd":
        xs = [rnd(B, S, H * D, seed=i) for i in range(3)]
        un = lambda q, k, v: merge(_mx_unfused(split(q), split(k), split(v), 0.4, mL, "valid_length"))
        fu = lambda q, k, v: mx.nd.fused_attention(q, k, v, mL, scale=0.4, layout=layout, heads=H,
                                                   mask_kind="valid_length")
    else:                                             # plain (B, H, S, D) with (B, H, S) lengths
        xs = [rnd(B, H, S, D, seed=i) for i in range(3)]
        m4 = mx.nd.array(L.reshape(B, H, S), dtype="int32")
        un = lambda q, k, v: _mx_unfused(q, k, v, 0.4, m4, "valid_length")
        fu = lambda q, k, v: mx.nd.fused_attention(q, k, v, m4, scale=0.4, mask_kind="valid_length")
    if nonfinite:
        xs[0].reshape(-1)[5] = np.nan
        xs[-1].reshape(-1)[-2] = np.inf
        xs[-1].reshape(-1)[xs[-1].size // 2] = -np.inf
    out_shape = fu(*[mx.nd.array(x) for x in xs]).shape
    dy = rnd(*out_shape, seed=9)
    _grads_same(grads(fu, xs, dy), grads(un, xs, dy))


# ---- a non-finite value where the probability is at the edge of float32 ----------------------
def _tiny_probability_case(gap, late=False):
    """Scores of a row: key 1 at -gap below the max; v of key 1 is +inf, -inf or NaN by column.
    ``late``: the max comes only at key 290, in a later key tile than key 1 (the others at -gap)."""
    N, Sq, Sk, D = 1, 3, 300 if late else 5, 2
    q = np.zeros((N, Sq, D), np.float32)
    q[0, :, 0] = 1.0
    k = np.zeros((N, Sk, D), np.float32)
    if late:
        k[0, :, 0] = -gap
        k[0, 290, 0] = 0.0
    k[0, 1, 0] = -gap                   # scale 1: the score of key 1 is -gap
    v = rnd(N, Sk, 4, seed=3)
    v[0, 1, :3] = [np.inf, -np.inf, np.nan]
    return q, k, v


# gaps around the two flush points: oneDNN's exp gives 0 below about -86.99, MXNet's own softmax
# keeps subnormals down to about -103.3 (then the quotient by the sum rounds to 0); our own exp
# flushes at -86.6, so 86.7 is a probability above 0 that the online softmax drops
_GAPS = [20.0, 86.7, 86.9, 87.1, 87.5, 95.0, 103.0, 104.5, 200.0]


def _check_tiny_probabilities():
    for gap, late in [(g, late) for g in _GAPS for late in (False, True)]:
        q, k, v = _tiny_probability_case(gap, late)
        nd = [mx.nd.array(x) for x in (q, k, v)]
        want = mx.nd.batch_dot(mx.nd.softmax(mx.nd.batch_dot(nd[0], nd[1], transpose_b=True), axis=-1), nd[2])
        _same(mx.nd.fused_attention(*nd, scale=1.0).asnumpy(), want.asnumpy())


@pytest.mark.parametrize("softmax", ["onednn", "mxnet"])
def test_non_finite_value_with_a_tiny_probability(softmax):
    """P · inf is ±inf where the unfused softmax gives a probability above 0 and NaN where it gives
    exactly 0 — at the row's final max, which the online softmax learns only at the end."""
    if softmax == "onednn":
        _check_tiny_probabilities()
    else:       # MXNet's own softmax kernel: the op reads the switch when the library loads
        code = ("import fusion\nfrom test_fused_attention import _check_tiny_probabilities\n"
                "_check_tiny_probabilities()\nprint('ok')\n")
        assert "ok" in run_python(code, MXNET_MKLDNN_ENABLED="0")
