r"""Attention blocks → one ``fused_attention`` (blockwise, online softmax; the S×S scores never exist).

Three rules, applied in this order in every pass:

``attention`` — the scores / softmax / value product on (N, S, D) tensors::

    q' = q | q·c | q/c                                _mul_scalar | _div_scalar on q
    s  = batch_dot(q', k, transpose_b=True)           | linalg_gemm2(q', k, transpose_b=True, alpha=a)
       | batch_dot(q', kᵀ)                            (k given transposed: a SwapAxis is emitted)
    s  = s | s·c | s/c                                scalar ops or broadcast_mul/div by a 1-element Const
    s  = s | s + mask                                 additive mask (any broadcastable tensor)
       | where(m, s, c·ones_like(s) | zeros_like(s)+c)   boolean mask, fill value c
                                                      (m may be broadcast_like(m', s): the kernel broadcasts m')
    p  = softmax(s, axis=-1) | softmax(s, len, axis=-1, use_length=True)
    p  = p | Dropout(p)                               identity at inference
    o  = batch_dot(p, v) | linalg_gemm2(p, v)

    → o = fused_attention(q, k, v[, mask], layout="plain", scale=c_q·c_s·a, mask_kind=…)

``attention_heads`` — the head split/merge around a plain ``fused_attention``::

    q = L_q(Xq), k = L_k(Xk), v = L_v(Xv), y = L_o(fused_attention(q, k, v, …))

where each ``L`` is a chain of layout ops (Reshape with MXNet's codes 0/-1/-2/-3/-4,
transpose, SwapAxis, expand_dims, squeeze, slice_axis, split).  What a chain does is
checked by running it — with MXNet's own ops — on an index tensor: ``L_q`` must map
(B, S, H·D) to the heads (B·H, S, D) with head ``h`` of batch ``b`` at ``n = b·H + h``,
``L_o`` must be the inverse merge.  Then the chains disappear::

    → y = fused_attention(Xq, Xk, Xv[, mask], layout="bshd", heads=H, …)
    → y = fused_attention(X, [mask], layout="packed_qkv", heads=H, …)   when Xq = Xk = Xv = X (B, S, 3·H·D)
                                                                        sliced into q | k | v

``attention_interleaved`` — GluonNLP's fused projections::

    s = _contrib_interleaved_matmul_selfatt_qk(qkv, heads=H)   (scaled by 1/√D inside)
    … scale / mask / softmax / Dropout as above …
    o = _contrib_interleaved_matmul_selfatt_valatt(qkv, p, heads=H)
    → o = fused_attention(qkv[, mask], layout="interleaved", heads=H, scale=c/√D)
    (and the encoder-decoder pair ``_contrib_interleaved_matmul_encdec_qk/valatt`` → layout="interleaved_encdec")

The math is unchanged: softmax(c·q·kᵀ + mask)·v, with the mask and fully-masked rows
handled like the unfused graph (see cuda_kernels/fused_attention/README.md).
``Dropout`` is dropped at inference; in training the rule is refused when a Dropout
with p > 0 is present (the fused op has no dropout).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from fusion.graph import Entry, Node
from fusion.matcher import Match
from fusion.pattern import Chain, Const, OneOf, Pattern, Var, op, scalar
from fusion.rewrite import Builder
from fusion.rule import Rule

from ._dtypes import float32_reason

LAYOUT_OPS = ("Reshape", "transpose", "SwapAxis", "expand_dims", "squeeze", "slice_axis",
              "split", "SliceChannel", "_split_v2", "_npx_reshape", "_np_transpose")
FUSED = "fused_attention"


# ---------------------------------------------------------------- the scores → softmax → value pattern

def _scaled(x: Pattern, name: str) -> Pattern:
    """x, or x times/divided by a constant (scalar op or a 1-element parameter)."""
    return (scalar("mul", x, name=name) | scalar("div", x, name=name)
            | op.broadcast_mul(x, Const(name + "_c"), name=name) | op.broadcast_div(x, Const(name + "_c"), name=name)
            | x)


def _masked(s: Pattern) -> Pattern:
    fill = (scalar("mul", op.ones_like(s, name="fill_base"), name="fill")
            | scalar("add", op.zeros_like(s, name="fill_base"), name="fill"))
    # broadcast_like(m, s) only borrows the scores' shape; the kernel broadcasts the mask itself
    mask = op.broadcast_like(Var("mask"), s, name="mask_like") | Var("mask")
    return op.add(s, mask, name="mask_op") | op.where(mask, s, fill, name="mask_op") | s


def _probabilities(scores: Pattern) -> Pattern:
    p = op.softmax(_masked(_scaled(scores, "s_scale")), Var("length", optional=True), name="softmax")
    return p.optional(lambda x: op.Dropout(x, name="dropout"))


def core_pattern() -> Pattern:
    q = _scaled(Var("q"), "q_scale")
    qk = (op.batch_dot(q, Var("k"), name="qk", transpose_a=OneOf(False, None))
          | op.gemm2(q, Var("k"), name="qk", transpose_a=OneOf(False, None)))
    p = _probabilities(qk)
    return (op.batch_dot(p, Var("v"), name="pv", transpose_a=OneOf(False, None), transpose_b=OneOf(False, None))
            | op.gemm2(p, Var("v"), name="pv", transpose_a=OneOf(False, None), transpose_b=OneOf(False, None)))


def _scale_factor(m: Match, name: str) -> Tuple[Optional[float], Optional[str]]:
    """(factor, reason): the constant a scale step multiplies by (1.0 when absent)."""
    if not m.has(name):
        return 1.0, None
    node = m.node(name)
    if "scalar" in node.attrs and node.op.startswith("_"):
        c = float(node.attrs["scalar"])
    else:
        v = m.value(name + "_c")
        if v is None:
            return None, "scale '%s' is not a constant with a known value" % m.node(name + "_c").name
        if v.size != 1:
            return None, "scale '%s' has %d values, not one" % (m.node(name + "_c").name, v.size)
        c = float(v.ravel()[0])
    if "div" in node.op.lower():
        if c == 0:
            return None, "division of the scores by 0"
        c = 1.0 / c
    return c, None


def _common_checks(m: Match) -> Optional[str]:
    reason = float32_reason([m[n] for n in ("q", "k", "v", "qkv", "kv") if m.has(n)], m.ctx)
    if reason:
        return reason
    sm = m.node("softmax")
    axis = sm.param("axis")
    if axis not in (-1, 2):
        return "softmax over axis %r, not the key axis (-1)" % axis
    if sm.param("temperature", None) not in (None, 1, 1.0):
        return "softmax temperature %r is not supported" % sm.param("temperature", None)
    if m.has("length") != bool(sm.param("use_length")):
        return "softmax length input and use_length disagree"
    if m.has("dropout") and m.ctx.mode == "training":
        p = float(m.node("dropout").param("p"))
        if p > 0:
            return "Dropout(p=%g) on the attention probabilities runs in training; fused_attention has no dropout" % p
    if m.has("mask_like"):
        bl = m.node("mask_like")
        if bl.param("lhs_axes", None) != bl.param("rhs_axes", None):
            return "broadcast_like of the mask maps axes %s to %s, not position by position" % (
                bl.param("lhs_axes", None), bl.param("rhs_axes", None))
    if m.has("mask_op") and m.node("mask_op").op == "where":
        fill = m.node("fill")
        if float(fill.attrs["scalar"]) >= -1e4 and fill.op in ("_mul_scalar", "_plus_scalar"):
            return "where() fill value %g is not a large negative number" % float(fill.attrs["scalar"])
    return None


# inputs read only for their shape: (op, input slot)
_SHAPE_ONLY = {("_contrib_arange_like", 0), ("ones_like", 0), ("zeros_like", 0), ("shape_array", 0),
               ("size_array", 0), ("broadcast_like", 1), ("reshape_like", 1), ("slice_like", 1)}


def _reads_data(entry: Entry, ctx) -> bool:
    """Whether the value of ``entry`` depends on the values (not only the shapes) of data inputs."""
    seen, stack = set(), [entry.node]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.op == "null":
            if ctx.value(Entry(node)) is None:
                return True
            continue
        if node.op.startswith("_random") or node.op.startswith("_sample") or node.op == "Dropout":
            return True
        stack.extend(e.node for slot, e in enumerate(node.inputs) if (node.op, slot) not in _SHAPE_ONLY)
    return False


def _is_causal(m: Match) -> bool:
    """Whether the mask is exactly the causal one (key j visible to query i iff j ≤ i + Sk − Sq).

    The mask must not read data values (only shapes, through ``arange_like`` and the like:
    checked on the graph), and is computed for the known input shapes.  The kernel then skips the masked key tiles
    instead of reading a mask; an additive mask must be 0 where visible and ≤ −1e4 elsewhere
    (exp underflows to exactly 0 there, as the kernel's exclusion does).
    """
    ctx = m.ctx
    if not m.has("mask_op") or m.has("length"):
        return False
    key = ("causal", m["mask"], m.node("mask_op").op)
    if key in ctx.memo:
        return ctx.memo[key]
    ctx.memo[key] = False
    qs, ks = ctx.shape(m["q"]), ctx.shape(m["k"])
    if not qs or not ks or _reads_data(m["mask"], ctx):
        return False
    sq = qs[-2]
    sk = ks[-2] if m.node("qk").param("transpose_b", False) else ks[-1]
    a, b = ctx.evaluate(m["mask"], seed=1), ctx.evaluate(m["mask"], seed=2)
    if a is None or b is None or a.shape != b.shape or not np.array_equal(a, b) or a.ndim < 2:
        return False
    try:
        full = np.broadcast_to(a, a.shape[:-2] + (sq, sk))
    except ValueError:
        return False
    visible = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
    if m.node("mask_op").op == "where":
        ok = np.all((full != 0) == visible)
    else:
        ok = np.all(full[..., visible] == 0) and np.all(full[..., ~visible] <= -1e4)
    ctx.memo[key] = bool(ok)
    return ctx.memo[key]


def _mask_attrs(m: Match) -> Tuple[List[Entry], Dict[str, object]]:
    if m.has("length"):
        return [m["length"]], {"mask_kind": "valid_length"}
    if not m.has("mask_op"):
        return [], {"mask_kind": "none"}
    if _is_causal(m):
        return [], {"mask_kind": "none", "causal": True}
    if m.node("mask_op").op == "where":
        return [m["mask"]], {"mask_kind": "boolean", "mask_value": float(m.node("fill").attrs["scalar"])}
    return [m["mask"]], {"mask_kind": "additive"}


class Attention(Rule):
    name = "attention"
    family = "attention"
    key = "softmax"
    benefit = 100
    description = "batch_dot(q,kᵀ) → scale → mask → softmax → batch_dot(·,v) → fused_attention"

    def pattern(self) -> Pattern:
        return core_pattern()

    def check(self, m: Match) -> Optional[str]:
        qk, pv = m.node("qk"), m.node("pv")
        if qk.op.endswith("linalg_gemm2") and pv.op.endswith("linalg_gemm2"):
            pass
        scale = 1.0
        for name in ("q_scale", "s_scale"):
            c, reason = _scale_factor(m, name)
            if reason:
                return reason
            scale *= c
        if pv.op.endswith("linalg_gemm2") and float(pv.param("alpha", 1.0)) != 1.0:
            return "value product linalg_gemm2 with alpha=%g" % float(pv.param("alpha", 1.0))
        if m.has("mask_op") and m.has("length"):
            return "both a mask and softmax lengths: not supported together"
        return _common_checks(m)

    def rewrite(self, m: Match, b: Builder) -> Entry:
        qk = m.node("qk")
        scale = float(qk.param("alpha", 1.0)) if qk.op.endswith("linalg_gemm2") else 1.0
        for name in ("q_scale", "s_scale"):
            scale *= _scale_factor(m, name)[0]
        k = m["k"]
        if not qk.param("transpose_b", False):      # k was given as kᵀ (N, D, Sk)
            k = b.op("SwapAxis", [k], attrs={"dim1": 1, "dim2": 2}, name=m.anchor.name + "_kt")
        extra, attrs = _mask_attrs(m)
        attrs.update(layout="plain", scale=scale)
        return b.op(FUSED, [m["q"], k, m["v"]] + extra, attrs=attrs, name=m.anchor.name)


# ---------------------------------------------------------------- interleaved (GluonNLP) projections

def _interleaved_pattern(kind: str) -> Pattern:
    if kind == "selfatt":
        qk = op._contrib_interleaved_matmul_selfatt_qk(Var("qkv"), name="qk")
        return op._contrib_interleaved_matmul_selfatt_valatt(Var("qkv"), _probabilities(qk), name="pv")
    qk = op._contrib_interleaved_matmul_encdec_qk(Var("q"), Var("kv"), name="qk")
    return op._contrib_interleaved_matmul_encdec_valatt(Var("kv"), _probabilities(qk), name="pv")


def _last_dim(m: Match, entry: Entry) -> Optional[int]:
    """Size of the last axis of ``entry``: from shape inference, or from a FullyConnected producing it."""
    shape = m.ctx.shape(entry)
    if shape:
        return shape[-1]
    node = entry.node
    if node.op in ("FullyConnected", "fused_dense") and "num_hidden" in node.attrs and not node.param("flatten", True):
        return int(node.attrs["num_hidden"])
    return None


class InterleavedAttention(Rule):
    family = "attention"
    key = "softmax"
    benefit = 100

    def __init__(self, kind: str):
        self.kind = kind
        self.name = "attention_interleaved" if kind == "selfatt" else "attention_interleaved_encdec"
        self.description = "_contrib_interleaved_matmul_%s_qk/valatt with softmax → fused_attention" % kind

    def pattern(self) -> Pattern:
        return _interleaved_pattern(self.kind)

    def _head_dim(self, m: Match) -> Tuple[Optional[int], Optional[str]]:
        heads = int(m.node("qk").param("heads"))
        if int(m.node("pv").param("heads")) != heads:
            return None, "qk and valatt use different head counts"
        src, parts = (m["qkv"], 3) if self.kind == "selfatt" else (m["q"], 1)
        width = _last_dim(m, src)
        if width is None:
            return None, ("the head size is unknown (the projection width of '%s' is not known: "
                          "pass input shapes)" % src.node.name)
        if width % (parts * heads):
            return None, "width %d is not divisible by %d×heads" % (width, parts)
        return width // (parts * heads), None

    def check(self, m: Match) -> Optional[str]:
        _, reason = self._head_dim(m)
        if reason:
            return reason
        c, reason = _scale_factor(m, "s_scale")
        if reason:
            return reason
        if m.has("mask_op") and m.has("length"):
            return "both a mask and softmax lengths: not supported together"
        return _common_checks(m)

    def rewrite(self, m: Match, b: Builder) -> Entry:
        d, _ = self._head_dim(m)
        scale = _scale_factor(m, "s_scale")[0] / math.sqrt(d)
        extra, attrs = _mask_attrs(m)
        heads = int(m.node("qk").param("heads"))
        if self.kind == "selfatt":
            inputs, layout = [m["qkv"]], "interleaved"
        else:
            inputs, layout = [m["q"], m["kv"]], "interleaved_encdec"
        attrs.update(layout=layout, heads=heads, scale=scale)
        return b.op(FUSED, inputs + extra, attrs=attrs, name=m.anchor.name)


# ---------------------------------------------------------------- head split / merge folded into the op

def heads_pattern() -> Pattern:
    fa = op(FUSED)(Chain(LAYOUT_OPS, Var("xq"), "q_chain"), Chain(LAYOUT_OPS, Var("xk"), "k_chain"),
                   Chain(LAYOUT_OPS, Var("xv"), "v_chain"), Var("mask", optional=True), name="attn", layout="plain")
    return Chain(LAYOUT_OPS, fa, "o_chain")


def run_chain(chain: Sequence[Entry], x: np.ndarray) -> Optional[np.ndarray]:
    """Apply a chain of layout ops (outermost first) to ``x`` with MXNet's own ops; None if MXNet refuses."""
    import mxnet as mx

    y = mx.nd.array(x, dtype="float64")
    try:
        for e in reversed(chain):
            fn = getattr(mx.nd, e.node.op, None) or getattr(mx.nd._internal, e.node.op)
            out = fn(y, **e.node.attrs.to_json())
            y = out[e.index] if isinstance(out, (list, tuple)) else out
        return y.asnumpy()
    except Exception:          # MXNet rejects the shapes: this chain is not a head layout for them
        return None


def split_heads(x: np.ndarray, heads: int, rank: int) -> np.ndarray:
    """(B, S, H·D) → (B·H, S, D) (rank 3) or (B, H, S, D) (rank 4), head h of batch b at n = b·H + h."""
    b, s, e = x.shape
    y = x.reshape(b, s, heads, e // heads).transpose(0, 2, 1, 3)
    return y.reshape(b * heads, s, e // heads) if rank == 3 else y


class AttentionHeads(Rule):
    name = "attention_heads"
    family = "attention_heads"
    key = "attn"
    benefit = 90
    description = "head split/merge (Reshape/transpose/SwapAxis/slice) around fused_attention → its head-aware layout"
    SUBSTITUTE = {"B": 2, "Sq": 5, "Sk": 7}      # distinct primes: a size-generic chain is told apart

    def pattern(self) -> Pattern:
        return heads_pattern()

    def check(self, m: Match) -> Optional[str]:
        plan = self._plan(m)
        return plan if isinstance(plan, str) else None

    @staticmethod
    def _positions_only(m: Match, entry: Entry, user: Node) -> Optional[str]:
        """'q'/'k' when ``user`` takes sequence positions (arange_like over axis -2) off that head split."""
        if user.op != "_contrib_arange_like" or user.param("axis", None) != -2:
            return None
        for n in ("q", "k"):
            chain = m[n + "_chain"]
            if chain and chain[0] == entry:
                return n
        return None

    def outside_use_ok(self, m: Match, entry: Entry, user: Node) -> bool:
        # (B·H, S, D) and (B, S, H·D) have the sequence on axis -2 alike: positions read off a
        # head split (see scores_shape) can be read off the projection it came from
        return self._positions_only(m, entry, user) is not None

    def rewrite(self, m: Match, b: Builder):
        layout, heads, inputs = self._plan(m)
        attn = m.node("attn")
        attrs = attn.attrs.copy()
        attrs["layout"] = layout
        attrs["heads"] = heads
        mask = [m["mask"]] if m.has("mask") else []
        out = b.op(FUSED, inputs + mask, attrs=attrs, name=m.anchor.name)
        mapping = {m.anchor_entry: out}
        for n, x in (("q", "xq"), ("k", "xk")):
            if m[n + "_chain"]:
                mapping.setdefault(m[n + "_chain"][0], m[x])
        return mapping

    def _plan(self, m: Match):
        """(layout, heads, inputs) when the chains are a head split/merge, else the reason they are not."""
        if not m["o_chain"] or not m["q_chain"]:
            return "no head split/merge around the attention"
        widths = {n: _last_dim(m, m[x]) for n, x in (("q", "xq"), ("k", "xk"), ("v", "xv"))}
        if None in widths.values():
            unknown = [n for n, w in widths.items() if w is None]
            return "the width of the %s projection is unknown (pass input shapes)" % "/".join(unknown)
        packed = m["xq"] == m["xk"] == m["xv"]
        sub = self.SUBSTITUTE
        sizes = [(sub["B"], sub["Sq"], sub["Sq"] if packed else sub["Sk"])]
        shape_q = m.ctx.shape(m["xq"])
        shape_k = m.ctx.shape(m["xk"])
        if shape_q and shape_k and len(shape_q) == 3:
            sizes.append((shape_q[0], shape_q[1], shape_k[1]))     # the real sizes, for chains that hard-code them
        reason = "the chains are not a head split/merge"
        for b_, sq, sk in sizes:
            plan = self._plan_for(m, widths, packed, b_, sq, sk)
            if not isinstance(plan, str):
                return plan
            reason = plan
        return reason

    def _plan_for(self, m: Match, widths, packed: bool, b_: int, sq: int, sk: int):
        seqs = {"q": sq, "k": sk, "v": sk}
        rng = {n: np.arange(b_ * seqs[n] * widths[n], dtype=np.float64).reshape(b_, seqs[n], widths[n])
               for n in "qkv"}
        if packed:
            rng = {n: rng["q"] for n in "qkv"}
        outs = {}
        for n in "qkv":
            y = run_chain(m[n + "_chain"], rng[n])
            if y is None or y.ndim not in (3, 4):
                return "%s's layout chain does not give (B·H, S, D) or (B, H, S, D) tensors" % n
            outs[n] = y
        rank = outs["q"].ndim
        heads = outs["q"].shape[0] // b_ if rank == 3 else outs["q"].shape[1]
        if heads < 1 or any(o.ndim != rank for o in outs.values()):
            return "q, k and v chains disagree on the layout"
        if packed:
            e = widths["q"] // 3
            if widths["q"] % 3:
                return "packed projection width %d is not divisible by 3" % widths["q"]
            want = {n: split_heads(rng["q"][:, :, i * e:(i + 1) * e], heads, rank) for i, n in enumerate("qkv")}
        else:
            want = {n: split_heads(rng[n], heads, rank) if widths[n] % heads == 0 else None for n in "qkv"}
        for n in "qkv":
            if want[n] is None or outs[n].shape != want[n].shape or not np.array_equal(outs[n], want[n]):
                return "%s's layout chain is not the head split of %d heads (head h of batch b at b·H+h)" % (n, heads)
        dv = outs["v"].shape[-1]
        o_in = np.arange(b_ * heads * sq * dv, dtype=np.float64)
        o_in = o_in.reshape((b_ * heads, sq, dv) if rank == 3 else (b_, heads, sq, dv))
        y = run_chain(m["o_chain"], o_in)
        merged = o_in.reshape(b_, heads, sq, dv).transpose(0, 2, 1, 3).reshape(b_, sq, heads * dv)
        if y is None or y.shape != merged.shape or not np.array_equal(y, merged):
            return "the output chain is not the merge of %d heads back to (B, S, H·D)" % heads
        if m.has("mask") and rank == 4:
            pass   # a (B,H,Sq,Sk)-broadcastable mask keeps its meaning with the head-aware layouts
        if packed:
            return "packed_qkv", heads, [m["xq"]]
        return "bshd", heads, [m["xq"], m["xk"], m["xv"]]


# ---------------------------------------------------------------- shape-only uses of the scores

class ScoresShape(Rule):
    """``arange_like(scores, axis=-1 | -2)`` → ``arange_like(k | q, axis=-2)``: the same positions.

    A causal mask is often built from positions taken off the scores themselves
    (``arange_like(s, axis=-1)`` compared with ``arange_like(s, axis=-2)``).  Those uses
    keep the scores alive outside an attention match; taken from q (query positions,
    ``Sq = q.shape[-2]``) and k (key positions, ``Sk = k.shape[-2]`` as ``s = q·kᵀ``)
    instead, they leave the attention free to fuse, its mask computed beside it.
    """
    name = "scores_shape"
    family = "attention"
    benefit = 150
    description = "positions taken off the attention scores → taken off q / k"

    def pattern(self) -> Pattern:
        # the scores are context: read, not replaced (they feed the attention as before)
        qk = op.batch_dot(Var("q"), Var("k"), name="qk", transpose_a=OneOf(False, None), transpose_b=True).kept()
        scaled = (scalar("mul", qk, name="s_scale").kept() | scalar("div", qk, name="s_scale").kept() | qk)
        return op._contrib_arange_like(scaled, name="arange")

    def _axis(self, m: Match) -> Optional[int]:
        axis = m.node("arange").param("axis", None)
        if axis in (-1, -2):
            return axis
        shape = m.ctx.shape(m["q"])
        if isinstance(axis, int) and shape is not None and axis - len(shape) in (-1, -2):
            return axis - len(shape)
        return None

    def check(self, m: Match) -> Optional[str]:
        if self._axis(m) is None:
            return "arange_like over axis %r of the scores: not a query/key position axis" % (
                m.node("arange").param("axis", None),)
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        node = m.node("arange")
        attrs = node.attrs.copy()
        attrs["axis"] = -2
        source = m["k"] if self._axis(m) == -1 else m["q"]
        return b.op(node.op, [source], attrs=attrs, name=node.name)


RULES: List[Rule] = [ScoresShape(), Attention(), InterleavedAttention("selfatt"), InterleavedAttention("encdec"),
                     AttentionHeads()]
