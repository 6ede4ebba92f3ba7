"""The attention rules compute what the unfused graph computes, at every shape it accepts.

Each test fuses at one set of input shapes and compares the fused symbol with the original
(bound with the subgraph backend off) there and at other batch sizes / sequence lengths,
forward and, in training mode, the gradients of every input and parameter.  Tolerances:
outputs 1e-5 and gradients 1e-4 of their scale (fp32), NaN where the original has NaN.
Refusals assert the reason the report gives.
"""
import mxnet as mx
import numpy as np
import pytest

import fusion

from conftest import ops
from test_attention import equivalent

S = mx.sym
I = mx.sym._internal


def rejections(res, rule="attention"):
    return list(res.report.rules[rule].rejected.values())


def qkv(shape_q, shape_k=None, dv=None):
    shape_k = shape_k or shape_q
    shape_v = shape_k[:-1] + (dv or shape_k[-1],)
    return {"q": shape_q, "k": shape_k, "v": shape_v}


def attention(scores_fn=lambda s: s, softmax=lambda s: S.softmax(s, axis=-1), product=S.batch_dot, kt=False):
    q, k, v = S.var("q"), S.var("k"), S.var("v")
    s = product(q, k, transpose_b=True) if not kt else product(q, S.var("kt"))
    return product(softmax(scores_fn(s)), v)


# ---------------------------------------------------------------- linalg_gemm2's axis

def test_gemm2_sequence_first_axis_is_refused():
    """linalg_gemm2(axis=0) multiplies (S, D) matrices batched over axis 1: not the kernel's layout."""
    q, k, v = S.var("q"), S.var("k"), S.var("v")
    y = S.linalg_gemm2(S.softmax(S.linalg_gemm2(q, k, transpose_b=True, axis=0), axis=-1), v, axis=0)
    res = fusion.fuse(y, rules=["attention_fusion"], input_shapes=qkv((5, 3, 8)))
    assert ops(res).get("fused_attention") is None
    assert "along axis 0 of rank-3 operands" in rejections(res)[0]
    res = fusion.fuse(y, rules=["attention_fusion"])          # rank unknown: refused too
    assert "unknown rank" in rejections(res)[0]


def test_gemm2_axis_naming_the_rows_fuses():
    q, k, v = S.var("q"), S.var("k"), S.var("v")
    y = S.linalg_gemm2(S.softmax(S.linalg_gemm2(q, k, transpose_b=True, axis=1, alpha=0.3), axis=2), v, axis=1)
    equivalent(y, qkv((4, 5, 8), (4, 7, 8)), others=[qkv((3, 9, 8), (3, 2, 8))])


# ---------------------------------------------------------------- ranks other than 3

def test_softmax_axis_must_be_the_last_of_the_scores_rank():
    """axis=2 is the key axis of rank-3 scores but the query axis of rank-4 ones."""
    shapes = qkv((2, 3, 5, 4))
    y = attention(softmax=lambda s: S.softmax(s, axis=2))
    res = fusion.fuse(y, rules=["attention_fusion"], input_shapes=shapes)
    assert ops(res).get("fused_attention") is None
    assert "axis 2 of rank-4 scores, not the key axis" in rejections(res)[0]
    res = fusion.fuse(y, rules=["attention_fusion"])
    assert "rank unknown" in rejections(res)[0]
    equivalent(attention(softmax=lambda s: S.softmax(s, axis=3)), shapes, others=[qkv((3, 2, 6, 4))],
               mode="training")


@pytest.mark.parametrize("product", [S.batch_dot, S.linalg_gemm2])
def test_rank4_with_lengths_k_transposed_and_scale(product):
    B, H, Sq, Sk, D = 2, 3, 5, 7, 4
    L = S.var("len", dtype="int32")
    y = attention(lambda s: s * 0.5, lambda s: S.softmax(s, L, axis=-1, use_length=True), product, kt=True)

    def shapes(b, h, sq, sk):
        return {"q": (b, h, sq, D), "kt": (b, h, D, sk), "v": (b, h, sk, D), "len": (b, h, sq)}

    make = (lambda n, sh, rng: rng.integers(0, 8, sh).astype(np.int32) if n == "len" else None)   # <= Sk
    res = equivalent(y, shapes(B, H, Sq, Sk), make=make, others=[shapes(3, 2, 4, 9)], mode="training")
    assert ops(res) == {"SwapAxis": 1, "fused_attention": 1}


@pytest.mark.parametrize("mshape", [(3, 5, 7), (2, 1, 5, 7), (1, 3, 1, 7), (7,), (5, 7), (2, 3, 5, 7)])
def test_rank4_masks_keep_their_broadcasting(mshape):
    """A rank-3 mask of (B, H, Sq, Sk) scores is per head (H, Sq, Sk); learned, it gets its gradient."""
    y = attention(lambda s: S.broadcast_add(s * 0.5, S.var("bias")))
    bias = np.random.default_rng(0).standard_normal(mshape).astype(np.float32)
    other = qkv((3, 3, 5, 4), (3, 3, 7, 4)) if mshape[0] != 2 or len(mshape) < 4 else qkv((2, 3, 5, 4), (2, 3, 7, 4))
    equivalent(y, qkv((2, 3, 5, 4), (2, 3, 7, 4)), params={"bias": bias}, mode="training", others=[other])


@pytest.mark.parametrize("shape", [(2, 2, 3, 5, 4), (5, 4)])
def test_rank5_batch_dot_and_rank2_gemm2(shape):
    product = S.batch_dot if len(shape) > 2 else S.linalg_gemm2
    y = attention(lambda s: S.broadcast_add(s, S.var("m")), product=product)
    make = lambda n, sh, rng: np.where(rng.random(sh) > 0.3, 0, -1e9).astype(np.float32) if n == "m" else None
    kshape = shape[:-2] + (6, 4)
    shapes = dict(qkv(shape, kshape), m=shape[-2:-1] + (6,))
    other = dict(qkv(shape[:-2] + (3, 4), shape[:-2] + (8, 4)), m=(3, 8))
    equivalent(y, shapes, make=make, mode="training", others=[other])


def test_mask_of_unknown_shape_is_refused():
    y = attention(lambda s: S.broadcast_add(s, S.var("m")))
    res = fusion.fuse(y, rules=["attention_fusion"])
    assert "shapes of mask 'm' and of the scores are unknown" in rejections(res)[0]


def test_mask_that_grows_the_scores_is_refused():
    q, k, v, m = (S.var(n) for n in "qkvm")
    y = S.batch_dot(S.softmax(S.broadcast_add(S.batch_dot(q, k, transpose_b=True), m), axis=-1), v)
    shapes = {"q": (2, 5, 4), "k": (2, 7, 4), "v": (1, 2, 7, 4), "m": (1, 1, 1, 7)}
    res = fusion.fuse(y, rules=["attention_fusion"], input_shapes=shapes)
    assert "broadcasts the scores (2, 5, 7) to (1, 2, 5, 7)" in rejections(res)[0]


# ---------------------------------------------------------------- causal masks

def _band_mask(q, k, offset=None, scores=None):
    """1 where key j is visible to query i: j <= i + (Sk - Sq), from positions; with ``offset``, a
    hard-coded j <= i + offset instead (causal only where Sk - Sq equals it)."""
    qpos = S.reshape(S.contrib.arange_like(q if scores is None else scores, axis=-2), shape=(-1, 1))
    kpos = S.reshape(S.contrib.arange_like(k if scores is None else scores, axis=-2 if scores is None else -1),
                     shape=(1, -1))
    if offset is not None:
        return S.broadcast_lesser_equal(kpos, I._plus_scalar(qpos, scalar=float(offset)))
    # reversed positions align the band bottom-right at every (Sq, Sk)
    rq = S.reshape(S.reverse(S.contrib.arange_like(q, axis=-2), axis=0), shape=(-1, 1))
    rk = S.reshape(S.reverse(S.contrib.arange_like(k, axis=-2), axis=0), shape=(1, -1))
    return S.broadcast_greater_equal(rk, rq)


def _causal_attention(style, c, offset=None):
    q, k, v = S.var("q"), S.var("k"), S.var("v")
    s = S.batch_dot(q, k, transpose_b=True) * 0.5
    band = _band_mask(q, k, offset)
    if style == "add":
        s = S.broadcast_add(s, I._mul_scalar(I._rminus_scalar(band, scalar=1.0), scalar=c))
    else:
        s = S.where(S.broadcast_like(S.expand_dims(band, axis=0), s, lhs_axes=(0,), rhs_axes=(0,)), s,
                    S.ones_like(s) * c)
    return S.batch_dot(S.softmax(s, axis=-1), v)


@pytest.mark.parametrize("style,c", [("add", -1e9), ("add", -1e4), ("fill", -1e18), ("fill", -1e4)])
@pytest.mark.parametrize("sq,sk", [(6, 6), (6, 4), (4, 9)])
def test_causal_masks_fuse_exactly_at_every_length(style, c, sq, sk):
    """Bottom-right causal masks become causal=True with the mask's own form (add / fill), rows
    that see no key (Sq > Sk) included, forward and backward, at other lengths too."""
    y = _causal_attention(style, c)
    res = equivalent(y, qkv((2, sq, 8), (2, sk, 8)), mode="training",
                     others=[qkv((3, sq + 3, 8), (3, sk, 8)), qkv((1, 2, 8), (1, sk + 5, 8))])
    node = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert node.param("causal", False) is True and node.attrs["causal_mode"] == style
    assert float(node.attrs["mask_value"]) == c and node.attrs["mask_kind"] == "none"


def test_fixed_offset_mask_is_kept_as_a_mask():
    """j <= i - 2 is the causal band only while Sk - Sq = -2: the probe shapes tell, and the mask
    stays an input the kernel reads (rows that see no key match the unfused graph)."""
    y = _causal_attention("add", -1e9, offset=-2)
    res = equivalent(y, qkv((2, 6, 4), (2, 4, 4)), rules=["attention_fusion", "elementwise"],
                     others=[qkv((2, 7, 4), (2, 4, 4)), qkv((3, 5, 4), (3, 5, 4))])
    node = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert not node.param("causal", False) and node.attrs["mask_kind"] == "additive"


def test_sliding_window_is_kept_as_a_mask():
    """A window i - 2 <= j <= i looks causal at length 3; the probe at length 4 shows it is not."""
    q, k, v = S.var("q"), S.var("k"), S.var("v")
    s = S.batch_dot(q, k, transpose_b=True)
    qpos = S.reshape(S.contrib.arange_like(q, axis=-2), shape=(-1, 1))
    kpos = S.reshape(S.contrib.arange_like(k, axis=-2), shape=(1, -1))
    keep = S.broadcast_mul(S.broadcast_lesser_equal(kpos, qpos),
                           S.broadcast_greater_equal(kpos, I._plus_scalar(qpos, scalar=-2.0)))
    y = S.batch_dot(S.softmax(S.broadcast_add(s, (1 - keep) * -1e9)), v)
    res = equivalent(y, qkv((2, 3, 8)), rules=["attention_fusion", "elementwise"], others=[qkv((2, 7, 8))])
    node = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert not node.param("causal", False) and node.attrs["mask_kind"] == "additive"


def test_sliding_window_wider_than_every_probe_is_kept_as_a_mask():
    """A window i - 10 <= j <= i is causal at every length up to 11 (the user's 8, the probes' 5):
    the mask computed at a longer length shows it is not."""
    q, k, v = S.var("q"), S.var("k"), S.var("v")
    s = S.batch_dot(q, k, transpose_b=True)
    qpos = S.reshape(S.contrib.arange_like(q, axis=-2), shape=(-1, 1))
    kpos = S.reshape(S.contrib.arange_like(k, axis=-2), shape=(1, -1))
    keep = S.broadcast_mul(S.broadcast_lesser_equal(kpos, qpos),
                           S.broadcast_greater_equal(kpos, I._plus_scalar(qpos, scalar=-10.0)))
    y = S.batch_dot(S.softmax(S.broadcast_add(s, (1 - keep) * -1e9)), v)
    res = equivalent(y, qkv((2, 8, 4)), rules=["attention_fusion", "elementwise"], others=[qkv((2, 30, 4))])
    node = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert not node.param("causal", False) and node.attrs["mask_kind"] == "additive"


def test_causal_needs_more_than_one_length():
    """A graph that takes one input shape only (a fixed Reshape) gives one (Sq, Sk): the mask stays."""
    x = S.var("x")
    q, k, v = (S.reshape(S.slice_axis(x, axis=1, begin=i * 20, end=(i + 1) * 20), shape=(2, 5, 4))
               for i in range(3))
    s = S.batch_dot(q, k, transpose_b=True)
    band = _band_mask(q, k)
    y = S.batch_dot(S.softmax(S.broadcast_add(s, (1 - band) * -1e9)), v)
    res = equivalent(y, {"x": (2, 60)}, rules=["attention_fusion"])
    node = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert not node.param("causal", False) and node.attrs["mask_kind"] == "additive"


def test_causal_positions_from_the_scores_in_training():
    """Positions of the scores' own axes (arange_like(s, axis=-2/-1)), i >= j: the top-left band,
    causal only while Sq = Sk; q and k are separate inputs, so the mask stays (exact at (3, 9))."""
    q, k, v = S.var("q"), S.var("k"), S.var("v")
    s = S.batch_dot(q, k, transpose_b=True)
    qpos = S.reshape(S.contrib.arange_like(s, axis=-2), shape=(-1, 1))
    kpos = S.reshape(S.contrib.arange_like(s, axis=-1), shape=(1, -1))
    y = S.batch_dot(S.softmax(S.broadcast_add(s, (1 - S.broadcast_greater_equal(qpos, kpos)) * -1e9)), v)
    res = equivalent(y, qkv((2, 5, 4)), rules=["scores_shape", "attention_fusion"], mode="training",
                     others=[qkv((3, 9, 4)), qkv((3, 4, 4), (3, 9, 4))])
    node = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert not node.param("causal", False) and node.attrs["mask_kind"] == "additive"


@pytest.mark.parametrize("sq,sk", [(5, 5), (4, 7)])
def test_top_left_band_stays_a_mask_where_lengths_can_differ(sq, sk):
    """j <= i (the band aligned to the top-left corner) is the causal band only while Sq = Sk.
    Queries and keys from different inputs may have other lengths: the mask stays a mask, exact
    at (3, 8) too, even when the user's shapes have equal lengths."""
    q, k, v = S.var("q"), S.var("k"), S.var("v")
    s = S.batch_dot(q, k, transpose_b=True)
    keep = _band_mask(q, k, offset=0)
    y = S.batch_dot(S.softmax(S.broadcast_add(s, (1 - keep) * -1e9)), v)
    res = equivalent(y, qkv((2, sq, 4), (2, sk, 4)), rules=["attention_fusion"], mode="training",
                     others=[qkv((2, 3, 4), (2, 8, 4)), qkv((1, 6, 4), (1, 6, 4))])
    node = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert not node.param("causal", False) and node.attrs["mask_kind"] == "additive"


def test_top_left_band_is_causal_when_queries_and_keys_share_their_length():
    """Self-attention on one input: Sq = Sk at every shape, where j <= i is the causal band."""
    x = S.var("x")
    q, k, v = (S.FullyConnected(x, num_hidden=4, flatten=False, no_bias=True, name=n) for n in "qkv")
    s = S.batch_dot(q, k, transpose_b=True)
    keep = _band_mask(q, k, offset=0)
    y = S.batch_dot(S.softmax(S.broadcast_add(s, (1 - keep) * -1e9)), v)
    rng = np.random.default_rng(3)
    params = {n + "_weight": rng.standard_normal((4, 4)) for n in "qkv"}
    res = equivalent(y, {"x": (2, 5, 4)}, params=params, rules=["attention_fusion"], others=[{"x": (3, 9, 4)}])
    node = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert node.param("causal", False) is True


def test_learned_causal_looking_bias_stays_a_trained_input():
    """In training a parameter is data: a bias that happens to be causal now stays an input."""
    bias = np.triu(np.full((5, 5), -1e9, np.float32), 1)[None]
    y = attention(lambda s: S.broadcast_add(s, S.var("bias")))
    res = equivalent(y, qkv((2, 5, 4)), params={"bias": bias}, mode="training")
    node = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert node.attrs["mask_kind"] == "additive" and "bias" in res.symbol.list_arguments()


# ---------------------------------------------------------------- training: masks and rows that see nothing

def _mask_input(kind):
    def make(n, sh, rng):
        if n == "m":
            if kind == "where":
                m = (rng.random(sh) > 0.4).astype(np.float32)
                m[0, 1, :] = 0
                return m
            m = np.where(rng.random(sh) > 0.4, 0, -1e9 if kind == "add" else -np.inf).astype(np.float32)
            m[0, 1, :] = -1e9                       # a row that sees no key
            return m
        if n == "len":
            L = rng.integers(0, sh[-1] + 1, sh).astype(np.int32) if len(sh) > 1 else None
            L[0, :2] = 0
            return L
        return None
    return make


@pytest.mark.parametrize("kind", ["add", "add_inf", "where", "length"])
def test_gradients_of_rows_that_see_no_key(kind):
    if kind == "length":
        L = S.var("len", dtype="int32")
        y = attention(lambda s: s * 0.5, lambda s: S.softmax(s, L, axis=-1, use_length=True))
        shapes, other = dict(qkv((2, 5, 4), (2, 6, 4)), len=(2, 5)), dict(qkv((3, 4, 4), (3, 8, 4)), len=(3, 4))
    elif kind == "where":
        y = attention(lambda s: S.where(S.var("m"), s, S.ones_like(s) * -1e9))
        shapes, other = dict(qkv((2, 5, 4), (2, 6, 4)), m=(2, 5, 6)), dict(qkv((3, 4, 4), (3, 8, 4)), m=(3, 4, 8))
    else:
        y = attention(lambda s: S.broadcast_add(s, S.var("m")))
        shapes, other = dict(qkv((2, 5, 4), (2, 6, 4)), m=(2, 5, 6)), dict(qkv((3, 4, 4), (3, 8, 4)), m=(3, 4, 8))
    equivalent(y, shapes, make=_mask_input(kind.split("_")[-1] if kind == "add_inf" else kind),
               mode="training", others=[other])


@pytest.mark.parametrize("bshape", [(1, 5, 5), (2, 5, 5), (1, 1, 5), (5,)])
def test_learned_additive_bias_gets_its_gradient(bshape):
    """A relative-position bias parameter: d(bias) = dScores summed over the broadcast axes."""
    bias = np.random.default_rng(1).standard_normal(bshape).astype(np.float32)
    y = attention(lambda s: S.broadcast_add(s, S.var("bias")))
    equivalent(y, qkv((2, 5, 4)), params={"bias": bias}, mode="training",
               others=[qkv((2, 5, 4), (2, 5, 4))] if bshape[0] == 2 else [qkv((4, 5, 7))])


def test_where_condition_gets_no_gradient_like_mxnet():
    y = attention(lambda s: S.where(S.var("m"), s, S.zeros_like(s) + -1e4))
    make = lambda n, sh, rng: (rng.random(sh) > 0.5).astype(np.float32) if n == "m" else None
    equivalent(y, dict(qkv((2, 5, 4)), m=(2, 5, 5)), make=make, mode="training")   # m's gradient: 0 both


# ---------------------------------------------------------------- where() with a 1-D condition

def test_where_with_a_1d_condition_selects_rows():
    """MXNet's where(cond (N,), x, y) takes whole rows of x along axis 0."""
    y = attention(lambda s: S.where(S.var("c"), s, S.ones_like(s) * -1e9))
    make = lambda n, sh, rng: np.array([1, 0, 1][:sh[0]] + [0] * (sh[0] - 3), np.float32) if n == "c" else None
    res = equivalent(y, dict(qkv((3, 5, 4)), c=(3,)), make=make, others=[dict(qkv((4, 2, 4), (4, 6, 4)), c=(4,))],
                     mode="training")
    assert ops(res) == {"expand_dims": 2, "fused_attention": 1}


def test_where_with_an_integer_condition():
    y = attention(lambda s: S.where(S.var("c", dtype="int32"), s, S.ones_like(s) * -1e9))
    make = lambda n, sh, rng: rng.integers(0, 3, sh).astype(np.int32) if n == "c" else None
    equivalent(y, dict(qkv((2, 5, 4)), c=(2, 5, 5)), make=make)


def test_any_where_fill_value_is_exact():
    y = attention(lambda s: S.where(S.var("c"), s, S.ones_like(s) * 0.25))
    make = lambda n, sh, rng: (rng.random(sh) > 0.5).astype(np.float32) if n == "c" else None
    equivalent(y, dict(qkv((2, 5, 4)), c=(2, 5, 5)), make=make, mode="training")


# ---------------------------------------------------------------- Dropout and parameters

@pytest.mark.parametrize("mode", ["inference", "training"])
def test_monte_carlo_dropout_is_refused(mode):
    y = attention(softmax=lambda s: S.Dropout(S.softmax(s, axis=-1), p=0.5, mode="always"))
    res = fusion.fuse(y, rules=["attention_fusion"], input_shapes=qkv((2, 4, 8)), mode=mode)
    assert ops(res).get("fused_attention") is None and ops(res).get("Dropout") == 1
    assert "mode='always'" in rejections(res)[0] and "samples at inference" in rejections(res)[0]


@pytest.mark.parametrize("form", ["mul_scores", "div_scores", "mul_q"])
def test_training_keeps_a_scale_parameter_trainable(form):
    t = S.var("temp")
    if form == "mul_q":
        q, k, v = S.var("q"), S.var("k"), S.var("v")
        y = S.batch_dot(S.softmax(S.batch_dot(S.broadcast_mul(q, t), k, transpose_b=True), axis=-1), v)
    else:
        op = S.broadcast_mul if form == "mul_scores" else S.broadcast_div
        y = attention(lambda s: op(s, t))
    res = equivalent(y, qkv((2, 5, 4)), params={"temp": np.array([0.7], np.float32)}, mode="training",
                     others=[qkv((3, 6, 4))])
    assert "temp" in res.symbol.list_arguments()
    # at inference its value is folded into the op's scale
    res = fusion.fuse(y, {"temp": mx.nd.array([0.7])}, {}, rules=["attention_fusion"], input_shapes=qkv((2, 5, 4)))
    assert ops(res) == {"fused_attention": 1} and "temp" not in res.symbol.list_arguments()


def test_interleaved_scale_parameter_refused_in_training():
    x, params = _projected(24)
    s = S.contrib.interleaved_matmul_selfatt_qk(x, heads=2)
    y = S.contrib.interleaved_matmul_selfatt_valatt(x, S.softmax(S.broadcast_mul(s, S.var("t")), axis=-1), heads=2)
    res = fusion.fuse(y, {"t": mx.nd.array([0.5]), **{k: mx.nd.array(v) for k, v in params.items()}}, {},
                      rules=["attention_fusion"], input_shapes={"x": (5, 2, 24)}, mode="training")
    assert "it is trained in mode='training'" in rejections(res, "attention_interleaved")[0]


# ---------------------------------------------------------------- packed projections in training

H, D = 3, 4


def _projected(width):
    """The packed projections as models have them: a bias of ``width`` (zeros here) fixes the width,
    so the slices of q, k and v cover all of it at every shape the graph takes (a free input
    could be wider, its extra columns read by no slice, and a packed layout would read them)."""
    return S.broadcast_add(S.var("x"), S.var("proj_bias")), {"proj_bias": np.zeros(width, np.float32)}


def _packed(swap=False, mask=None, heads4=False):
    x, _ = _projected(3 * H * D)
    sl = [S.slice_axis(x, axis=-1, begin=i * H * D, end=(i + 1) * H * D) for i in range(3)]
    if swap:
        sl = [sl[1], sl[0], sl[2]]

    def split(t):
        t = S.transpose(S.reshape(t, shape=(0, 0, H, -1)), axes=(0, 2, 1, 3))
        return t if heads4 else S.reshape(t, shape=(-3, 0, 0))

    q, k, v = map(split, sl)
    s = S.batch_dot(q, k, transpose_b=True) * 0.5
    if mask == "bias":
        s = S.broadcast_add(s, S.var("bias"))
    elif mask == "where":
        s = S.where(S.broadcast_like(S.var("m"), s), s, S.ones_like(s) * -1e9)
    o = S.batch_dot(S.softmax(s, axis=-1), v)
    if not heads4:
        o = S.reshape(o, shape=(-4, -1, H, 0, 0))
    return S.reshape(S.transpose(o, axes=(0, 2, 1, 3)), shape=(0, 0, -3))


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("mask,heads4,bshape", [(None, False, None), ("bias", False, (1, 6, 6)),
                                                 ("bias", True, (3, 6, 6)), ("bias", True, (1, 3, 1, 6)),
                                                 ("where", True, (2, 1, 1, 6))])
def test_packed_projection_gradients(swap, mask, heads4, bshape):
    params, make, shapes = dict(_projected(3 * H * D)[1]), None, {"x": (2, 6, 3 * H * D)}
    if mask == "bias":
        params["bias"] = np.random.default_rng(2).standard_normal(bshape).astype(np.float32)
    if mask == "where":
        shapes["m"] = bshape
        make = lambda n, sh, rng: (rng.random(sh) > 0.3).astype(np.float32) if n == "m" else None
    res = equivalent(_packed(swap, mask, heads4), shapes, params=params, make=make, mode="training",
                     rules=["attention_fusion", "attention_heads"])
    layout = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0].attrs["layout"]
    assert layout == ("bshd" if swap else "packed_qkv")


# ---------------------------------------------------------------- non-finite values in training

def _with_non_finite(names, lengths=None):
    """make(): normal values with a NaN and ±inf in each of ``names``; lengths with rows of 0."""
    def make(n, sh, rng):
        if n == lengths:
            L = rng.integers(0, sh[-1] + 1, sh).astype(np.int32)
            L.reshape(-1)[::3] = 0
            return L
        if n in names:
            v = rng.standard_normal(sh).astype(np.float32)
            flat = v.reshape(-1)
            flat[rng.integers(flat.size)] = np.nan
            flat[rng.integers(flat.size)] = np.inf
            flat[rng.integers(flat.size)] = -np.inf
            return v
        return None
    return make


def test_interleaved_lengths_zero_gradients_with_non_finite_values():
    """GluonNLP's interleaved self-attention with softmax lengths, rows of length 0 among them,
    and NaN / ±inf in the projections: gradients NaN exactly where MXNet's are (a key after a
    row's length still multiplies 0 by its k, q, dO; the softmax sums only the keys it sees)."""
    (x, params), L = _projected(24), S.var("len", dtype="int32")
    s = S.contrib.interleaved_matmul_selfatt_qk(x, heads=2)
    y = S.contrib.interleaved_matmul_selfatt_valatt(x, S.softmax(s, L, axis=-1, use_length=True), heads=2)
    for seed in range(3):
        res = equivalent(y, {"x": (5, 2, 24), "len": (4, 5)}, params=params, rules=["attention_fusion"], mode="training",
                         make=_with_non_finite({"x"}, "len"), others=[{"x": (7, 3, 24), "len": (6, 7)}], seed=seed)
    assert ops(res) == {"fused_attention": 1, "broadcast_add": 1}


@pytest.mark.parametrize("temperature", [None, 1.0])
def test_nan_rows_gradients_follow_the_softmax_mxnet_runs(temperature):
    """A NaN in k makes the rows that see it NaN; dV reads their probabilities where MXNet's softmax
    puts them — oneDNN's (its default) or its own kernel (what a temperature selects: the op is
    told nan_probs="row")."""
    t = {} if temperature is None else {"temperature": temperature}
    y = attention(lambda s: s * 0.5, lambda s: S.softmax(s, axis=-1, **t))

    def make(n, sh, rng):
        if n != "k":
            return None
        v = rng.standard_normal(sh).astype(np.float32)
        v[0, -1, 1] = np.nan                    # the last key: oneDNN carries it to another lane
        v[-1, sh[1] // 2, 0] = np.nan
        return v

    res = equivalent(y, qkv((2, 9, 4), (2, 33, 4)), mode="training", make=make,
                     others=[qkv((3, 5, 4), (3, 17, 4))])
    node = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert node.attrs.raw("nan_probs", "auto") == ("auto" if temperature is None else "row")


def test_causal_band_skipped_by_a_nan_row():
    """Causal fill: a row whose band holds a +inf score is NaN while the rows after it (a -inf
    there) are not; under MXNet's own softmax (a temperature) every probability of it is NaN,
    the keys after its band too (which the kernel skips), so their dV is NaN."""
    q, k, v = S.var("q"), S.var("k"), S.var("v")
    s = S.batch_dot(q, k, transpose_b=True) * 0.5
    band = _band_mask(q, k)
    s = S.where(S.broadcast_like(S.expand_dims(band, axis=0), s, lhs_axes=(0,), rhs_axes=(0,)), s,
                S.ones_like(s) * -1e18)
    y = S.batch_dot(S.softmax(s, axis=-1, temperature=1.0), v)

    def make(n, sh, rng):
        val = np.abs(rng.standard_normal(sh)).astype(np.float32) + 0.1
        if n == "q":
            val[:, 3, 0] *= -1                  # row 3: q·k of key 2 is +inf, the later rows' -inf
        if n == "k":
            val[:, 2, 0] = -np.inf
        return val

    res = equivalent(y, qkv((2, 9, 1)), mode="training", make=make, others=[qkv((3, 6, 1))])
    node = [n for n in res.graph.op_nodes() if n.op == "fused_attention"][0]
    assert node.param("causal", False) and node.attrs["causal_mode"] == "fill"
    assert node.attrs.raw("nan_probs", "auto") == "row"


# ---------------------------------------------------------------- where() conditions of other shapes

@pytest.mark.parametrize("cshape", ["rows", "rows1"])
def test_where_condition_of_leading_dims_reads_as_a_broadcast(cshape):
    """MXNet's where reads a condition of the scores' leading dims, (N, Sq) or (N, Sq, 1), as
    cond[i // Sk]: a broadcast over the keys, which the kernel is given as (N, Sq, 1)."""
    y = attention(lambda s: S.where(S.var("c"), s, S.ones_like(s) * -1e9))
    make = lambda n, sh, rng: (rng.random(sh) > 0.3).astype(np.float32) if n == "c" else None

    def shapes(b, sq, sk):
        return dict(qkv((b, sq, 4), (b, sk, 4)), c=(b, sq) if cshape == "rows" else (b, sq, 1))

    res = equivalent(y, shapes(2, 5, 7), make=make, mode="training", others=[shapes(3, 4, 9)])
    assert ops(res).get("fused_attention") == 1


@pytest.mark.parametrize("cshape,why", [((1, 5, 7), "read by MXNet's where as cond[i // 2], not broadcast"),
                                        ((5, 7), "read by MXNet's where as cond[i // 2], not broadcast"),
                                        ((2, 1, 7), "read by MXNet's where as cond[i // 5], not broadcast"),
                                        ((3, 5, 7), "which MXNet's where cannot read (105 elements for 70)"),
                                        ((2, 3), "which MXNet's where cannot read (6 elements for 70)")])
def test_where_condition_read_misaligned_is_refused(cshape, why):
    """Any other condition shape passes MXNet 1.9.1's shape inference unchecked and is read as
    cond[i // (size ratio)] (or not at all): not the broadcast the kernel would apply."""
    y = attention(lambda s: S.where(S.var("c"), s, S.ones_like(s) * -1e9))
    res = fusion.fuse(y, rules=["attention_fusion"], input_shapes=dict(qkv((2, 5, 4), (2, 7, 4)), c=cshape))
    assert ops(res).get("fused_attention") is None
    assert why in rejections(res)[0] and "'c' %s of the scores (2, 5, 7)" % (cshape,) in rejections(res)[0]


# ---------------------------------------------------------------- head chains tried on index tensors

def test_head_chain_that_mxnet_cannot_run_leaves_no_error_behind():
    """attention_heads runs each layout chain with MXNet's ops at substitute sizes; a Reshape MXNet
    infers to an empty shape there ((-1, 3, 0, 0) reversed of 40 elements: v's split, also a graph
    output, leaves a chain of one head) fails while running.  That failure is the chain's (not a
    head merge), not an error raised by a later, unrelated call."""
    x = S.var("x")
    proj = {n: S.reshape(S.FullyConnected(x, S.var(n + "_w"), S.var(n + "_b"), num_hidden=12, flatten=False),
                         shape=(0, 0, -4, 3, -1)) for n in "qkv"}           # (B, S, 3, 4)
    q, k, v = (S.reshape(S.swapaxes(proj[n], dim1=1, dim2=2), shape=(-1, 0, 0), reverse=True) for n in "qkv")
    o = S.batch_dot(S.softmax(S.linalg_gemm2(q, k, transpose_b=True) / 0.5, axis=2), v)
    y = S.reshape(S.swapaxes(S.reshape(o, shape=(-1, 3, 0, 0), reverse=True), dim1=1, dim2=2), shape=(0, 0, -1))
    y = S.Group([proj["v"], y])
    rng = np.random.default_rng(0)
    params = {n + s: rng.standard_normal((12, 6) if s == "_w" else (12,)).astype(np.float32)
              for n in "qkv" for s in ("_w", "_b")}
    res = fusion.fuse(y, {n: mx.nd.array(v) for n, v in params.items()}, {}, input_shapes={"x": (1, 5, 6)},
                      rules=["attention_fusion", "attention_heads"])
    mx.nd.waitall()                             # nothing left failing behind fuse()
    assert ops(res).get("fused_attention") == 1
    equivalent(y, {"x": (1, 5, 6)}, params=params, rules=["attention_fusion", "attention_heads"],
               others=[{"x": (9, 6, 6)}])


@pytest.mark.parametrize("swap", [False, True])
def test_head_chains_in_other_spellings(swap):
    """The head split / merge written with MXNet's other names of the same ops (reshape, swapaxes),
    as a graph's JSON may carry them, fuses like the registered names — and fusing the result
    again changes nothing (it is written back with the registered names)."""
    x, params = _projected(3 * H * D)

    def split(t):
        t = S.reshape(t, shape=(0, 0, H, -1))
        t = S.swapaxes(t, dim1=1, dim2=2) if swap else S.transpose(t, axes=(0, 2, 1, 3))
        return S.reshape(t, shape=(-3, 0, 0))

    q, k, v = (split(S.slice_axis(x, axis=-1, begin=i * H * D, end=(i + 1) * H * D)) for i in range(3))
    o = S.batch_dot(S.softmax(S.batch_dot(q, k, transpose_b=True) * 0.5, axis=-1), v)
    o = S.reshape(o, shape=(-4, -1, H, 0, 0))
    o = S.swapaxes(o, dim1=1, dim2=2) if swap else S.transpose(o, axes=(0, 2, 1, 3))
    y = S.reshape(o, shape=(0, 0, -3))
    text = y.tojson().replace('"op": "Reshape"', '"op": "reshape"').replace('"op": "SwapAxis"', '"op": "swapaxes"')
    assert '"reshape"' in text and (not swap or '"swapaxes"' in text)
    shapes = {"x": (2, 6, 3 * H * D)}
    res = fusion.fuse(text, {k: mx.nd.array(v) for k, v in params.items()}, {}, input_shapes=shapes)
    assert ops(res) == {"fused_attention": 1, "broadcast_add": 1}, ops(res)
    again = fusion.fuse(res.symbol, res.arg_params, res.aux_params, input_shapes=shapes)
    assert again.symbol.tojson() == res.symbol.tojson()
    equivalent(y, shapes, params=params, rules=["attention_fusion", "attention_heads"], others=[{"x": (3, 4, 3 * H * D)}])
