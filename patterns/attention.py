r"""Attention blocks → one ``fused_attention`` (blockwise, online softmax; the S×S scores never exist).

Three rules, applied in this order in every pass:

``attention`` — the scores / softmax / value product on (..., S, D) tensors::

    q' = q | q·c | q/c                                _mul_scalar | _div_scalar, or broadcast_mul/div
                                                      by a 1-element parameter, on q
       | q/√D                                         _contrib_div_sqrt_dim, D q's last axis: a projection's
                                                      width through layout ops that keep it at every size
                                                      (on the scores it divides by √Sk: refused)
    s  = batch_dot(q', k, transpose_b=True)           | linalg_gemm2(q', k, transpose_b=True, alpha=a)
       | batch_dot(q', kᵀ)                            (k given transposed: a SwapAxis of its last two axes)
    s  = s | s·c | s/c                                the same scale forms on the scores
    s  = s | s + mask                                 additive mask (any tensor broadcast to s)
       | where(m, s, c·ones_like(s) | zeros_like(s)+c)   boolean mask, fill value c
                                                      (m may be broadcast_like(m', s): the kernel broadcasts m')
    p  = softmax(s, axis=-1) | softmax(s, len, axis=-1, use_length=True)
    p  = p | p · m                                    GluonNLP's masked softmax: m the where() condition
    p  = p | Dropout(p)                               identity at inference
    o  = batch_dot(p, v) | linalg_gemm2(p, v)

    → o = fused_attention(q, k, v[, mask], layout="plain", scale=c_q·c_s·a, mask_kind=…)

Any rank MXNet's products take (batch_dot: ≥ 3, linalg_gemm2: ≥ 2): the leading axes are
batch axes, the mask is broadcast like ``broadcast_add`` broadcasts it (aligned from the last
axis), lengths have the scores' shape without the key axis.  What is decided from shapes is
decided at every probe shape (``Context.shapes``) and refused when unknown:

* the softmax runs over the scores' last axis (``axis=-1``, or ``rank−1``);
* linalg_gemm2's matrix rows are on axis −2 (``axis=-2``, or ``rank−2``);
* a mask never broadcasts the scores to a larger shape; MXNet's ``where`` does not broadcast:
  its condition has the scores' shape, or their leading dims followed by ones (read as a
  broadcast over the other axes; a 1-D one selects whole rows along axis 0), and is given the
  op as (N, …, 1, …, 1) — any other shape MXNet 1.9.1 reads misaligned (or cannot read), and
  is refused;
* a mask that is exactly causal at every probe (built from positions only, 0 / nonzero on
  the band ``j ≤ i + Sk − Sq``, one constant c elsewhere) becomes ``causal=True`` with
  ``causal_mode="add"`` (additive: c added to the scores after the band) or ``"fill"``
  (``where``: the scores after the band replaced by c), ``mask_value=c``: the same numbers,
  fully masked rows included, while the kernel skips the keys after the band when their
  probabilities are provably 0.

GluonNLP's masked softmax ``softmax(where(m, s, c)) * m`` (its DotProductAttentionCell) fuses where
``m`` is proved a length mask (``key_length_mask``): carried (layout and broadcast ops, Cast,
products with values read from shapes only) from ``broadcast_lesser(positions, lengths)`` (or
``broadcast_greater`` swapped) with the positions 0 … S−1 read from shapes, and, computed by MXNet at
every probe with the comparison replaced by codes, equal to its key mask ``m[n, i, j] = K[n // H, j]``
(the encoder's valid_length mask) or to its query mask times the causal band ``K[n // H, i]·[j ≤ i + Sk − Sq]``
(the decoder's self-attention, the band checked at longer lengths too).  It becomes ``mask_kind=
"valid_length"`` with ``length_fill`` (the hidden keys keep c in the softmax's sum, 0 in the product:
a length-0 row gives 0 as GluonNLP's does) — lengths ``sum(K)`` per batch element, repeated over the
heads, or ``K·1e9`` per row with ``causal``; inference on the CPU only (the op has no backward and no
GPU kernel for it).  Any other mask ``m`` (one given as an input: GluonNLP's memory mask, whose
values cannot be proved a length mask) fuses as ``mask_kind="boolean"`` with ``length_fill``: the
kernel replaces the scores where ``m`` is 0 by c, and multiplies each probability by ``m``'s value
after the softmax — the same form for every value of ``m`` — where ``m`` (the where() condition and the
factor alike) is float32 in the scores' own shape at every probe.

Parameters are never baked in training mode: a 1-element scale parameter is kept as an
input, applied to q (``broadcast_mul``/``broadcast_div``, so its gradient is computed); at
inference its value is folded into ``scale`` when known.  A learned additive mask stays
the mask input (the op returns its gradient); a causal mask must not read parameters there.

``attention_heads`` — the head split/merge around a plain ``fused_attention``::

    q = L_q(Xq), k = L_k(Xk), v = L_v(Xv), y = L_o(fused_attention(q, k, v, …))

where each ``L`` is a chain of layout ops (Reshape with MXNet's codes 0/-1/-2/-3/-4,
transpose, SwapAxis, expand_dims, squeeze, slice_axis, split).  What a chain does is
checked by running it — with MXNet's own ops — on an index tensor: ``L_q`` must map
(B, S, H·D) to the heads (B·H, S, D) or (B, H, S, D) with head ``h`` of batch ``b`` at
``n = b·H + h``, ``L_o`` must be the inverse merge — at sizes of its own (B, Sq, Sk = 2, 5, 7), or
else (chains that hard-code a size, a Reshape naming the sequence length) at the graph's sizes and at
the next batch size, where a chain either cannot run (it names the batch) or must be the split/merge
too: a Reshape splitting B·H as (H, B), the merge at batch 1 only, is refused.  Then the chains
disappear::

    → y = fused_attention(Xq, Xk, Xv[, mask], layout="bshd", heads=H, …)
    → y = fused_attention(X, [mask], layout="packed_qkv", heads=H, …)   when Xq = Xk = Xv = X (B, S, 3·H·D)
                                                                        sliced into q | k | v
    (a mask of rank < 4 next to a (B, H, S, D) split is given the op as rank 4, so that it
    keeps broadcasting over (B, H, Sq, Sk) from the last axis)

``attention_interleaved`` — GluonNLP's fused projections::

    s = _contrib_interleaved_matmul_selfatt_qk(qkv, heads=H)   (scaled by 1/√D inside)
    … scale / mask / softmax / Dropout as above …
    o = _contrib_interleaved_matmul_selfatt_valatt(qkv, p, heads=H)
    → o = fused_attention(qkv[, mask], layout="interleaved", heads=H, scale=c/√D)
    (and the encoder-decoder pair ``_contrib_interleaved_matmul_encdec_qk/valatt`` → layout="interleaved_encdec")

The math is unchanged: softmax(c·q·kᵀ + mask)·v, with the mask, fully masked rows and
non-finite values handled like the unfused graph, forward and backward (see
cuda_kernels/fused_attention/README.md).  A softmax given a ``temperature`` (1) runs MXNet's
own kernel, not oneDNN's, which differ in where a NaN row's probabilities are NaN (what dV
reads): the op is told ``nan_probs="row"``.  ``Dropout`` is dropped at inference; it is refused
when it samples there (``mode="always"``), and in training when p > 0 (the fused op has no
dropout).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from fusion.ir.graph import Entry, Node
from fusion.ir.matcher import Match
from fusion.ir.pattern import Chain, Const, OneOf, Pattern, Var, op, scalar
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from ._dtypes import float32_reason

# with MXNet's other spellings of the same ops (reshape, swapaxes): a graph's JSON carries
# whichever its frontend wrote, and fused graphs are written back with the registered names
LAYOUT_OPS = ("Reshape", "reshape", "transpose", "SwapAxis", "swapaxes", "expand_dims", "squeeze", "slice_axis",
              "split", "SliceChannel", "_split_v2", "_npx_reshape", "_np_transpose")
FUSED = "fused_attention"
LENGTH_DTYPES = ("int32", "int64", "uint8", "float32", "float64")   # what the kernel reads as lengths


# ---------------------------------------------------------------- the scores → softmax → value pattern

def _scaled(x: Pattern, name: str) -> Pattern:
    """x, or x times/divided by a constant (scalar op or a 1-element parameter), or divided by the
    square root of its last axis (``_contrib_div_sqrt_dim``: GluonNLP's DotProductAttentionCell)."""
    return (scalar("mul", x, name=name) | scalar("div", x, name=name)
            | op.broadcast_mul(x, Const(name + "_c"), name=name) | op.broadcast_div(x, Const(name + "_c"), name=name)
            | op._contrib_div_sqrt_dim(x, name=name) | x)


def _masked(s: Pattern) -> Pattern:
    fill = (scalar("mul", op.ones_like(s, name="fill_base"), name="fill")
            | scalar("add", op.zeros_like(s, name="fill_base"), name="fill"))
    # broadcast_like(m, s) only borrows the scores' shape; the kernel broadcasts the mask itself
    mask = op.broadcast_like(Var("mask"), s, name="mask_like") | Var("mask")
    return op.add(s, mask, name="mask_op") | op.where(mask, s, fill, name="mask_op") | s


def _probabilities(scores: Pattern) -> Pattern:
    p = op.softmax(_masked(_scaled(scores, "s_scale")), Var("length", optional=True), name="softmax")
    # GluonNLP's masked softmax: softmax(where(m, s, c)) * m (the multiply either way round)
    p = p.optional(lambda x: op.elemwise_mul(x, Var("pmask"), name="prob_mask")
                   | op.broadcast_mul(x, Var("pmask"), name="prob_mask"))
    return p.optional(lambda x: op.Dropout(x, name="dropout"))


def core_pattern() -> Pattern:
    q = _scaled(Var("q"), "q_scale")
    qk = (op.batch_dot(q, Var("k"), name="qk", transpose_a=OneOf(False, None))
          | op.gemm2(q, Var("k"), name="qk", transpose_a=OneOf(False, None)))
    p = _probabilities(qk)
    return (op.batch_dot(p, Var("v"), name="pv", transpose_a=OneOf(False, None), transpose_b=OneOf(False, None))
            | op.gemm2(p, Var("v"), name="pv", transpose_a=OneOf(False, None), transpose_b=OneOf(False, None)))


# ---------------------------------------------------------------- facts

def _shapes(m: Match, entry: Entry) -> Tuple[tuple, ...]:
    """The shape of ``entry`` at every probe where it is known (the user's first)."""
    return tuple(m.ctx.shapes(entry))


def _rank(m: Match, entry: Entry) -> Optional[int]:
    shapes = _shapes(m, entry)
    return len(shapes[0]) if shapes else None


def _scores(m: Match) -> Entry:
    """The scores the mask / softmax step reads (after the scale)."""
    return Entry(m.node("s_scale") if m.has("s_scale") else m.node("qk"))


def _mask_source(m: Match) -> Entry:
    """The mask as the kernel is given it: broadcast_like(m, s) reads m itself."""
    return m["mask"]


class Scale:
    """One scale step: a constant folded into ``scale``, or a parameter kept as an input."""

    def __init__(self, factor: float = 1.0, param: Optional[Entry] = None, divide: bool = False):
        self.factor, self.param, self.divide = factor, param, divide


def _scale_step(m: Match, name: str) -> Tuple[Optional[Scale], Optional[str]]:
    """(step, reason): what a scale step multiplies the scores by (``Scale()`` when absent)."""
    if not m.has(name):
        return Scale(), None
    node = m.node(name)
    if node.op == "_contrib_div_sqrt_dim":
        # x / sqrt(x.shape[-1]), a size MXNet reads at run time: one scale only where it is fixed
        if name == "s_scale":
            return None, ("'%s' divides the scores by the square root of the key length, which changes "
                          "with the input: not one scale" % node.name)
        dims = sorted({s[-1] for s in _shapes(m, node.inputs[0]) if s})
        if not dims:
            return None, "the last axis of '%s' (divided by its square root) has an unknown size (pass input " \
                         "shapes)" % node.name
        if len(dims) > 1:
            return None, ("'%s' divides by the square root of a size that changes with the input shapes (%s): "
                          "not one scale" % (node.name, ", ".join(map(str, dims))))
        reason = _fixed_last_dim(node.inputs[0], dims[0], m)
        if reason:
            return None, reason
        return Scale(1.0 / math.sqrt(dims[0])), None
    divide = "div" in node.op.lower()
    if "scalar" in node.attrs and node.op.startswith("_"):
        c = float(node.attrs["scalar"])
        if divide:
            if c == 0:
                return None, "division of the scores by 0"
            c = 1.0 / c
        return Scale(c), None
    const = m[name + "_c"]
    value = m.value(name + "_c")
    shapes = _shapes(m, const)
    size = value.size if value is not None else (int(np.prod(shapes[0])) if shapes else None)
    if size is None:
        return None, "scale '%s' has an unknown size (pass its value or input shapes)" % const.node.name
    if size != 1:
        return None, "scale '%s' has %d values, not one" % (const.node.name, size)
    if value is not None and m.ctx.mode != "training":
        c = float(value.ravel()[0])
        if divide:
            if c == 0:
                return None, "division of the scores by 0"
            c = 1.0 / c
        return Scale(c), None
    # a trained (or unknown) parameter stays an input: its gradient is computed through q
    ndim = value.ndim if value is not None else len(shapes[0])
    q_rank = _rank(m, m["q"]) if m.has("q") else None
    if ndim > 2 and (q_rank is None or ndim > q_rank):
        return None, ("scale parameter '%s' of rank %d may broadcast the scores to a higher rank "
                      "(pass input shapes)" % (const.node.name, ndim))
    return Scale(param=const, divide=divide), None


def _fixed_last_dim(entry: Entry, size: int, m: Match) -> Optional[str]:
    """Why the last axis of ``entry`` (``size`` at the probes) may have another size at run time
    (None: it is fixed).  Fixed: ``entry`` is a projection's output (FullyConnected / fused_dense:
    its last axis is ``num_hidden``) through layout ops that give ``size`` whatever the other
    sizes are -- run with MXNet's ops on the projection's shape with other leading sizes.  The
    probes alone can miss a size that is equal to another by coincidence (a sequence length
    equal to the number of heads)."""
    chain = []
    e = entry
    while e.node.op in LAYOUT_OPS and len(e.node.inputs) == 1 and len(chain) < 16:
        chain.append(e)
        e = e.node.inputs[0]
    src = e.node
    shape = m.ctx.shape(e)
    if src.op not in ("FullyConnected", "fused_dense") or not shape:
        return ("'%s' divides by the square root of its last axis, which is not a projection's width "
                "(FullyConnected num_hidden) through layout ops: its size may change at run time" % m.node("q_scale").name)
    seen = set()
    for lead in ((2, 3), (5, 7), (3, 11), (7, 2), (1, 13)):
        lead = (lead + (1,) * len(shape))[:len(shape) - 1]
        out = chain_shape(chain, lead + (shape[-1],))
        if out is not None:
            seen.add(out[-1] if out else None)
    if seen != {size}:
        return ("'%s' divides by the square root of a size its layout ops do not keep at %d for other batch "
                "and sequence sizes (%s): not one scale" % (m.node("q_scale").name, size,
                                                           ", ".join(map(str, sorted(seen, key=str))) or "none run"))
    return None


def _axis_reason(m: Match) -> Optional[str]:
    """Why the softmax or a linalg_gemm2 is not over the axes the kernel uses (None: it is)."""
    sm = m.node("softmax")
    axis = sm.param("axis", -1)
    rank = _rank(m, sm.inputs[0])
    if axis != -1:
        if rank is None:
            return ("softmax over axis %r with the scores' rank unknown (pass input shapes): "
                    "only the last axis is the key axis" % (axis,))
        if axis not in (rank - 1,):
            return "softmax over axis %r of rank-%d scores, not the key axis (the last)" % (axis, rank)
    for name in ("qk", "pv"):
        node = m.node(name)
        if not node.op.endswith("linalg_gemm2"):
            continue
        gaxis = node.param("axis", -2)
        if gaxis == -2:
            continue
        grank = _rank(m, node.inputs[0])
        if grank is None:
            return ("linalg_gemm2 '%s' with axis=%r and an unknown rank (pass input shapes)"
                    % (node.name, gaxis))
        if gaxis not in (grank - 2,):
            return ("linalg_gemm2 '%s' takes its matrix rows along axis %r of rank-%d operands, not "
                    "the second-to-last (a sequence-first layout)" % (node.name, gaxis, grank))
    return None


def _mask_reason(m: Match) -> Optional[str]:
    """Why the mask cannot be handed to the kernel as it is broadcast in the graph (None: it can)."""
    if not m.has("mask_op"):
        return None
    mask, scores, out = _mask_source(m), _scores(m), Entry(m.node("mask_op"))
    ms, ss, os_ = _shapes(m, mask), _shapes(m, scores), _shapes(m, out)
    if not ms or not ss or not os_:
        return ("the shapes of mask '%s' and of the scores are unknown (pass input shapes): how the "
                "mask broadcasts decides what the fused op reads" % mask.node.name)
    is_where = m.node("mask_op").op == "where"
    for mshape, sshape, oshape in zip(ms, ss, os_):
        if oshape != sshape:
            return "mask '%s' %s broadcasts the scores %s to %s" % (mask.node.name, mshape, sshape, oshape)
        if len(mshape) > len(sshape):
            return "mask '%s' %s has a higher rank than the scores %s" % (mask.node.name, mshape, sshape)
        if is_where and not m.has("mask_like") and tuple(mshape) != tuple(sshape):
            reason = _where_condition_reason(mask.node.name, tuple(mshape), tuple(sshape))
            if reason:
                return reason
            continue
        for d, t in zip(reversed(mshape), reversed(sshape)):
            if d not in (1, t):
                return "mask '%s' %s does not broadcast to the scores %s" % (mask.node.name, mshape, sshape)
    if not is_where:
        dtype = m.ctx.dtype(mask)
        if dtype not in ("float32", None):
            return "additive mask '%s' is %s, not float32" % (mask.node.name, dtype)
    return None


def _where_condition_reason(name: str, cshape: tuple, sshape: tuple) -> Optional[str]:
    """Why MXNet's ``where`` does not read condition ``cshape`` as a broadcast over scores ``sshape``.

    MXNet 1.9.1's ``where`` does not broadcast: a 1-D condition selects rows along axis 0 (its
    size checked), any other shape passes its shape inference unchecked and is read as
    ``cond[i // (size(s) / size(cond))]`` — a broadcast over the trailing axes exactly when the
    condition's shape is the scores' leading dims followed by ones (the kernel is given it so).
    A larger condition, or one whose size does not divide the scores', it cannot read: it
    divides by zero (the process dies of SIGFPE) or reads past the condition."""
    if len(cshape) == 1 and len(sshape) > 1:
        if cshape[0] != sshape[0]:
            return "where() condition '%s' %s does not select rows of the scores %s" % (name, cshape, sshape)
        return None
    lead = cshape
    while lead and lead[-1] == 1:
        lead = lead[:-1]
    if len(lead) <= len(sshape) and lead == sshape[:len(lead)]:
        return None
    csize, ssize = int(np.prod(cshape)), int(np.prod(sshape))
    if csize > ssize or ssize % csize:
        how = "which MXNet's where cannot read (%d elements for %d)" % (csize, ssize)
    else:
        how = "read by MXNet's where as cond[i // %d], not broadcast" % (ssize // csize)
    return ("where() condition '%s' %s of the scores %s: %s (a condition of another shape than the "
            "scores must be their leading dims followed by ones)" % (name, cshape, sshape, how))


def _common_checks(m: Match) -> Optional[str]:
    reason = float32_reason([m[n] for n in ("q", "k", "v", "qkv", "kv") if m.has(n)], m.ctx)
    if reason:
        return reason
    sm = m.node("softmax")
    reason = _axis_reason(m)
    if reason:
        return reason
    if sm.param("temperature", None) not in (None, 1, 1.0):
        return "softmax temperature %r is not supported" % sm.param("temperature", None)
    if m.has("length") != bool(sm.param("use_length")):
        return "softmax length input and use_length disagree"
    if m.has("length"):
        dtype = m.ctx.dtype(m["length"])
        if dtype is not None and dtype not in LENGTH_DTYPES:
            return "softmax lengths '%s' are %s; the kernel reads %s" % (
                m["length"].node.name, dtype, "/".join(LENGTH_DTYPES))
    if m.has("mask_op") and m.has("length"):
        return "both a mask and softmax lengths: not supported together"
    if m.has("prob_mask"):
        reason = _probs_mask_reason(m)
        if reason:
            return reason
    if m.has("dropout"):
        dropout = m.node("dropout")
        p = float(dropout.param("p", 0.5))
        if dropout.param("mode", "training") == "always" and p > 0:
            return ("Dropout(p=%g, mode='always') on the attention probabilities samples at inference "
                    "too; fused_attention has no dropout" % p)
        if m.ctx.mode == "training" and p > 0:
            return "Dropout(p=%g) on the attention probabilities runs in training; fused_attention has no dropout" % p
    if m.has("mask_like"):
        bl = m.node("mask_like")
        if bl.param("lhs_axes", None) != bl.param("rhs_axes", None):
            return "broadcast_like of the mask maps axes %s to %s, not position by position" % (
                bl.param("lhs_axes", None), bl.param("rhs_axes", None))
    return _mask_reason(m)


# inputs read only for their shape: (op, input slot)
_SHAPE_ONLY = {("_contrib_arange_like", 0), ("ones_like", 0), ("zeros_like", 0), ("shape_array", 0),
               ("size_array", 0), ("broadcast_like", 1), ("reshape_like", 1), ("slice_like", 1)}


def _reads_data(entry: Entry, ctx) -> bool:
    """Whether the value of ``entry`` depends on the values (not only the shapes) of data inputs.

    In training mode parameters count as data: they change while training."""
    seen, stack = set(), [entry.node]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.op == "null":
            if ctx.mode == "training" or ctx.value(Entry(node)) is None:
                return True
            continue
        if node.op.startswith("_random") or node.op.startswith("_sample") or node.op == "Dropout":
            return True
        stack.extend(e.node for slot, e in enumerate(node.inputs) if (node.op, slot) not in _SHAPE_ONLY)
    return False


def _longer_shapes(ctx, lengths: set) -> List[Dict[str, tuple]]:
    """The user's input shapes with sizes grown (S -> 2S+3), in two ways: every size but the batch
    that no parameter has, and only the sizes in ``lengths`` (the scores' query and key lengths:
    a graph whose inputs also carry head counts or head sizes that no parameter fixes takes only
    this one).  Empty when no size can grow."""
    base = dict(ctx.input_shapes or {})
    fixed = {d for nd in ctx.graph.variables() for d in (ctx._param_shape(nd.name) or ())}
    out = []
    for grow in ({d for s in base.values() for d in s[1:] if d > 1 and d not in fixed},
                 {d for d in lengths if d > 1}):
        if grow:
            longer = {n: (s[:1] + tuple(2 * d + 3 if d in grow else d for d in s[1:])) for n, s in base.items()}
            if longer not in out:
                out.append(longer)
    return out


def _causal_value(a: np.ndarray, sq: int, sk: int, where: bool) -> Tuple[bool, Optional[float]]:
    """(causal, c): whether mask ``a`` is causal on (Sq, Sk) scores — 0 (additive) / nonzero (where)
    on the band j ≤ i + Sk − Sq of every slice, one constant c after it (additive; None when
    nothing is after the band here, or for ``where``, whose fill gives c)."""
    if a.ndim < 2:
        return False, None
    try:
        slices = np.broadcast_to(a, a.shape[:-2] + (sq, sk)).reshape(-1, sq, sk)
    except ValueError:
        return False, None
    visible = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
    if where:
        return bool(np.all((slices != 0) == visible)), None
    if not np.all(slices[:, visible] == 0):
        return False, None
    if visible.all():
        return True, None
    masked = np.unique(slices[:, ~visible])
    if masked.size != 1 or np.isnan(masked[0]):
        return False, None
    return True, float(masked[0])


def _causal_at(m: Match, shapes: Dict[str, tuple], sshape: tuple, where: bool, values: set) -> bool:
    """Whether the mask, computed by MXNet at input ``shapes`` (scores of ``sshape``) with two
    seeds, is the same both times and causal; the value after the band is added to ``values``."""
    runs = [m.ctx.evaluate(m["mask"], seed, shapes) for seed in (1, 2)]
    if any(r is None for r in runs) or runs[0].shape != runs[1].shape or not np.array_equal(runs[0], runs[1]):
        return False
    causal, c = _causal_value(runs[0], sshape[-2], sshape[-1], where)
    if causal and c is not None:
        values.add(c)
    return causal


def causal_form(m: Match) -> Optional[Tuple[str, float]]:
    """("add" | "fill", c) when the mask is exactly causal at every probe shape, else None.

    The mask must not read data values (only shapes, through ``arange_like`` and the like:
    checked on the graph; in training not parameters either), and is computed with MXNet at
    each probe (the user's input shapes and the alternates of ``Context.probes``, which must
    include at least two (Sq, Sk); where the graph takes a query length other than the key
    length, the probe of sizes set apart has one) and at longer lengths: a mask causal at one
    sequence length only (a fixed offset, a sliding window wider than the probes' lengths, a
    band aligned to the top-left corner) stays a mask, which is exact.
    """
    ctx = m.ctx
    if not m.has("mask_op") or m.has("length"):
        return None
    where = m.node("mask_op").op == "where"
    key = ("causal", m["mask"], m.node("mask_op").name, ctx.mode)
    if key in ctx.memo:
        return ctx.memo[key]
    ctx.memo[key] = None
    probes = list(getattr(ctx, "probes", None) or [ctx.input_shapes])
    scores = _shapes(m, _scores(m))
    if len(scores) != len(probes) or _reads_data(m["mask"], ctx):
        return None
    if len({tuple(sh[-2:]) for sh in scores}) < 2:
        return None                 # one (Sq, Sk) only: a fixed offset or window could not be told apart
    values: set = set()
    if not all(_causal_at(m, shapes, sshape, where, values) for shapes, sshape in zip(probes, scores)):
        return None
    # A window wider than every probe length looks causal there.  The mask alone (positions
    # only: cheap) is also computed at longer lengths the graph takes; where it cannot be (no
    # size grows, or the graph takes none of the grown shapes), the mask stays a mask.
    for longer in _longer_shapes(ctx, {d for sh in scores for d in sh[-2:]}):
        runs = [ctx.evaluate(m["mask"], seed, longer) for seed in (1, 2)]
        if all(r is not None for r in runs):
            a = runs[0]
            if a.shape != runs[1].shape or not np.array_equal(a, runs[1]) or a.ndim < 2 or min(a.shape[-2:]) < 2:
                return None
            causal, c = _causal_value(a, a.shape[-2], a.shape[-1], where)
            if not causal:
                return None
            if c is not None:
                values.add(c)
            break
    else:
        return None
    if where:
        form = ("fill", float(m.node("fill").attrs["scalar"]))
    elif len(values) == 1:
        form = ("add", values.pop())
    else:
        return None                 # masked values differ between shapes, or none was seen
    ctx.memo[key] = form
    return form


def _mask_inputs(m: Match, b: Builder) -> Tuple[List[Entry], Dict[str, object]]:
    """The mask input(s) and mask attributes of the fused op."""
    inputs, attrs = _mask_inputs_of(m, b)
    if m.node("softmax").param("temperature", None) is not None and not m.has("length"):
        # MXNet runs a softmax given a temperature (1 here) with its own kernel, not oneDNN's: a
        # row whose softmax is NaN has every probability NaN (what dV reads), as with lengths
        attrs["nan_probs"] = "row"
    return inputs, attrs


def _mask_inputs_of(m: Match, b: Builder) -> Tuple[List[Entry], Dict[str, object]]:
    if m.has("prob_mask"):
        found, _ = key_length_mask(m)
        if found is None:       # any mask: where(m, s, c) on the scores, the probabilities times m
            return [_condition(m)], {"mask_kind": "boolean", "length_fill": True,
                                     "mask_value": float(m.node("fill").attrs["scalar"])}
        cmp, heads, form = found
        attrs = {"mask_kind": "valid_length", "length_fill": True, "mask_value": float(m.node("fill").attrs["scalar"])}
        if form == "key":       # K's rows are prefixes of the keys: their sums are the lengths
            lengths = b.op("sum", [b.op("Cast", [Entry(cmp)], attrs={"dtype": "float32"})], attrs={"axis": 1})
        else:                   # query i of batch element b sees its band where K[b, i], no key elsewhere
            lengths = b.op("_mul_scalar", [b.op("Cast", [Entry(cmp)], attrs={"dtype": "float32"})],
                           attrs={"scalar": 1e9})
            attrs["causal"] = True
        if heads > 1:       # row n of the scores reads the lengths of batch element n // H
            lengths = b.op("repeat", [lengths], attrs={"repeats": heads, "axis": 0})
        return [lengths], attrs
    if m.has("length"):
        return [m["length"]], {"mask_kind": "valid_length"}
    if not m.has("mask_op"):
        return [], {"mask_kind": "none"}
    form = causal_form(m)
    if form is not None:
        return [], {"mask_kind": "none", "causal": True, "causal_mode": form[0], "mask_value": form[1]}
    mask = _mask_source(m)
    mshape = _shapes(m, mask)[0]
    sshape = _shapes(m, _scores(m))[0]
    if m.node("mask_op").op == "where":
        if len(mshape) < len(sshape) and not m.has("mask_like"):
            # where() reads a condition of the scores' leading dims (a 1-D one selects whole rows
            # along axis 0) as a broadcast over the other axes: (N, …) → (N, …, 1, …, 1)
            for _ in range(len(sshape) - len(mshape)):
                mask = b.op("expand_dims", [mask], attrs={"axis": -1})
        if m.ctx.dtype(m["mask"]) not in ("float32", None):
            # the kernel reads a float32 condition: nonzero stays nonzero
            mask = b.op("Cast", [b.op("_not_equal_scalar", [mask], attrs={"scalar": 0.0})],
                        attrs={"dtype": "float32"})
        return [mask], {"mask_kind": "boolean", "mask_value": float(m.node("fill").attrs["scalar"])}
    return [mask], {"mask_kind": "additive"}


# ---------------------------------------------------------------- GluonNLP's masked softmax: softmax(where(m, s, c)) * m

# ops that carry a mask's values to other positions (or dtypes) without computing new ones
_CARRY = frozenset(set(LAYOUT_OPS) - {"split", "SliceChannel", "_split_v2"}) | {
    "broadcast_axis", "broadcast_axes", "broadcast_to", "broadcast_like", "Cast", "amp_cast", "_copy", "identity"}
# key positions < lengths: the input slot of the positions
_LESS = {"broadcast_lesser": 0, "broadcast_greater": 1}


def _condition(m: Match) -> Entry:
    """The where() condition as the graph gives it (with its broadcast_like)."""
    return Entry(m.node("mask_like")) if m.has("mask_like") else m["mask"]


def _length_comparison(m: Match) -> Tuple[Optional[Node], Optional[str]]:
    """The comparison ``positions < lengths`` the where() condition is carried from (through
    layout / broadcast ops, Cast, and products with values that read no data), or the reason."""
    ctx = m.ctx
    e = _condition(m)
    for _ in range(64):
        node = e.node
        if node.op in _LESS:
            return node, None
        if node.op in _CARRY:
            data = [x for slot, x in enumerate(node.inputs) if (node.op, slot) not in _SHAPE_ONLY]
            if len(data) != 1:
                break
            e = data[0]
            continue
        if node.op in ("broadcast_mul", "elemwise_mul") and len(node.inputs) == 2:
            reading = [x for x in node.inputs if _reads_data(x, ctx)]
            if len(reading) != 1:
                return None, ("mask '%s' is a product of two values that read the data ('%s'): not a "
                              "comparison of key positions with lengths carried to the scores"
                              % (_condition(m).node.name, node.name))
            e = reading[0]
            continue
        break
    if e.node.is_variable:
        return None, ("mask '%s' is carried from input '%s', not from a comparison of key positions with "
                      "lengths: its values are not known to be a length mask" % (_condition(m).node.name, e.node.name))
    return None, ("mask '%s' is computed by %s '%s', not carried (layout / broadcast ops, Cast, products "
                  "with ones) from a comparison of key positions with lengths (broadcast_lesser(positions, "
                  "lengths) or broadcast_greater(lengths, positions))" % (_condition(m).node.name, e.node.op,
                                                                         e.node.name))


def key_length_mask(m: Match):
    """((K, H, form), None) when the where() condition is ``mask[n, i, j] = K[n // H, j]`` at every probe
    shape, with ``K = (j < L_b)`` a (B, Sk) comparison of the key positions 0 … Sk−1 with lengths
    (B, 1): each row of K keeps a prefix of the keys, its sum is its length.  Else the reason.

    Proved from the graph: K is ``broadcast_lesser(P, L)`` / ``broadcast_greater(L, P)`` with P
    read from shapes only and equal to 0 … Sk−1 along the keys (computed at each probe), and
    the path from K to the condition carries values only (layout and broadcast ops, Cast,
    products with values that read no data); what that path does is computed by MXNet at each
    probe with K replaced by codes (its key index + 1, its batch index + 1, zeros, ones): the
    condition must give K's entry (n // H, j) at every (n, i, j).

    Or (form "query", GluonNLP's TransformerDecoder): K = (i < L_b) over the queries and the
    condition ``K[n // H, i] · band(i, j)`` with band the causal band j ≤ i + Sk − Sq (a factor read
    from shapes only) — at every probe (two (Sq, Sk) at least) and at longer lengths, where the
    condition computed with K all ones must be the band: the op's causal band with lengths Sk
    (K = 1) or 0 per row."""
    ctx = m.ctx
    key = ("key_length_mask", _condition(m), m.node("mask_op").name)
    if key in ctx.memo:
        return ctx.memo[key]
    cmp, reason = _length_comparison(m)
    result = (None, reason)
    if cmp is not None:
        result = _prove_key_lengths(m, cmp)
    ctx.memo[key] = result
    return result


def _prove_key_lengths(m: Match, cmp: Node):
    """((K, H, form), None): the condition is K's key mask (form "key"), or K's query mask times the
    causal band (form "query": GluonNLP's decoder), else the reason."""
    slot = _LESS[cmp.op]
    pos, lengths = cmp.inputs[slot], cmp.inputs[1 - slot]
    if _reads_data(pos, m.ctx):
        return None, ("'%s' compares '%s' with '%s', and neither is positions read from shapes only"
                      % (cmp.name, pos.node.name, lengths.node.name))
    found, reason = _prove_lengths(m, cmp, "key")
    if found is not None:
        return found, None
    found, reason2 = _prove_lengths(m, cmp, "query")
    if found is not None:
        return found, None
    return None, reason + "; nor the query mask times the causal band (%s)" % reason2


def _band(sq: int, sk: int) -> np.ndarray:
    """The causal band of (Sq, Sk) scores as the kernel takes it: key j visible to query i iff j ≤ i + Sk − Sq."""
    return (np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)).astype(np.float64)


def _prove_lengths(m: Match, cmp: Node, form: str):
    ctx = m.ctx
    slot = _LESS[cmp.op]
    pos, lengths = cmp.inputs[slot], cmp.inputs[1 - slot]
    what = "key" if form == "key" else "query"
    probes = list(getattr(ctx, "probes", None) or [ctx.input_shapes])
    cond = _condition(m)
    ks, ls, ms, ss = (_shapes(m, x) for x in (Entry(cmp), lengths, cond, _scores(m)))
    if not probes or not all(len(x) == len(probes) for x in (ks, ls, ms, ss)):
        return None, ("the shapes of length mask '%s' are unknown (pass input shapes)" % cmp.name)
    if form == "query" and len({tuple(sh[-2:]) for sh in ss}) < 2:
        return None, "one (Sq, Sk) at the probes: a causal band cannot be told from a fixed one"
    heads = set()
    for shapes, kshape, lshape, mshape, sshape in zip(probes, ks, ls, ms, ss):
        if len(kshape) != 2 or len(lshape) != 2 or lshape != (kshape[0], 1):
            return None, ("'%s' compares positions with lengths %s into %s: not lengths (B, 1) against "
                          "the %ss, a (B, S) mask" % (cmp.name, lshape, kshape, what))
        if tuple(mshape) != tuple(sshape) or len(sshape) < 3:
            return None, ("mask '%s' %s does not have the scores' shape %s" % (cond.node.name, mshape, sshape))
        b_, sn = kshape
        sq, sk = sshape[-2:]
        if sn != (sk if form == "key" else sq):
            return None, ("'%s' compares %d positions, the scores have %d %ss" % (
                cmp.name, sn, sk if form == "key" else sq, what))
        n = int(np.prod(sshape[:-2]))
        if b_ < 1 or n % b_:
            return None, ("the scores' %d heads are not a multiple of the %d rows of '%s'" % (n, b_, cmp.name))
        heads.add(n // b_)
        p = ctx.evaluate(pos, 0, shapes)
        if p is None or p.size != sn or p.shape not in ((sn,), (1, sn)) or not np.array_equal(
                p.reshape(-1), np.arange(sn)):
            return None, ("'%s' does not read the %s positions 0 … %d: %s" % (
                pos.node.name, what, sn - 1, "not computable" if p is None else "%s of shape %s" % (
                    np.array2string(p.reshape(-1)[:6], separator=", ")[:-1] + (", …]" if p.size > 6 else "]"),
                    p.shape)))
        dtype = ctx.dtype(Entry(cmp)) or "float32"
        jj, bb = np.meshgrid(np.arange(sn), np.arange(b_))
        rows = np.arange(n) // (n // b_)
        for name, code in (("%s index" % what, jj + 1), ("batch index", bb + 1), ("zeros", 0 * jj),
                           ("ones", 0 * jj + 1)):
            code = code.astype(dtype)
            got = ctx.evaluate(cond, 0, shapes, replacing=(cmp, code))
            c = code[rows].astype(np.float64)
            want = np.broadcast_to(c[:, None, :], (n, sq, sk)) if form == "key" else \
                c[:, :, None] * _band(sq, sk)[None]
            if got is None or got.shape != tuple(sshape) or not np.array_equal(
                    got.reshape(n, sq, sk).astype(np.float64), want):
                return None, ("mask '%s' is not the %s mask of '%s' (row n // %d)%s (checked with %s in its "
                              "place at %s)" % (cond.node.name, what, cmp.name, n // b_,
                                                " at every query" if form == "key" else " times the causal band",
                                                name, tuple(sshape)))
    if len(heads) != 1:
        return None, ("mask '%s' repeats the rows of '%s' %s times at the probe shapes: not one head "
                      "count" % (cond.node.name, cmp.name, " / ".join(map(str, sorted(heads)))))
    if form == "query":
        # the band is computed from shapes: a band causal at the probes' lengths only (a window wider
        # than them, a fixed offset) is told at longer lengths
        ok = False
        for longer in _longer_shapes(ctx, {d for sh in ss for d in sh[-2:]}):
            p = ctx.evaluate(pos, 0, longer)
            lv = ctx.evaluate(lengths, 0, longer)
            if p is None or lv is None:
                continue
            got = ctx.evaluate(cond, 0, longer, replacing=(cmp, np.ones((lv.shape[0], p.size),
                                                                        dtype=ctx.dtype(Entry(cmp)) or "float32")))
            if got is None or got.ndim < 2:
                continue
            sq, sk = got.shape[-2:]
            if not np.array_equal(got.reshape(-1, sq, sk).astype(np.float64),
                                  np.broadcast_to(_band(sq, sk), got.reshape(-1, sq, sk).shape)):
                return None, ("mask '%s' is not the causal band at the longer lengths (%d, %d)"
                              % (cond.node.name, sq, sk))
            ok = True
            break
        if not ok:
            return None, "mask '%s' could not be computed at longer lengths: its band is not known to be causal" \
                % cond.node.name
    return (cmp, heads.pop(), form), None


def _probs_mask_reason(m: Match) -> Optional[str]:
    """Why softmax(where(m, s, c)) * m is not the op's ``length_fill`` (None: it is)."""
    mul = m.node("prob_mask")
    if m.ctx.mode == "training":
        return ("the probabilities multiplied by mask '%s' ('%s'): fused_attention's length_fill has no "
                "backward (inference only)" % (m["pmask"].node.name, mul.name))
    if m.ctx.device != "cpu":
        return "fused_attention's length_fill (the probabilities multiplied by the mask) has no %s kernel" % m.ctx.device
    if not m.has("mask_op") or m.node("mask_op").op != "where":
        return ("the probabilities are multiplied by '%s' ('%s') without a where() mask on the scores"
                % (m["pmask"].node.name, mul.name))
    if m["pmask"] != _condition(m):
        return ("the probabilities are multiplied by '%s', not by the where() condition '%s'"
                % (m["pmask"].node.name, _condition(m).node.name))
    if tuple(_shapes(m, Entry(mul))) != tuple(_shapes(m, Entry(m.node("softmax")))):
        return "the product '%s' broadcasts the probabilities to another shape" % mul.name
    c = float(m.node("fill").attrs["scalar"])
    if not math.isfinite(c):
        return "where() fill value %r: length_fill takes a finite score for the keys past the length" % c
    _, reason = key_length_mask(m)
    if reason is None:
        return None
    # not a length mask: the general form, the kernel reading m itself where it is the scores' shape
    return _any_probs_mask_reason(m, reason)


def _any_probs_mask_reason(m: Match, length_reason: str) -> Optional[str]:
    """Why softmax(where(m, s, c)) * m with ``m`` not a length mask is not ``mask_kind="boolean"``
    with ``length_fill`` (None: it is)."""
    cond = _condition(m)
    dtype = m.ctx.dtype(cond)
    if dtype != "float32":
        return ("mask '%s' is %s, not float32 (the probabilities are multiplied by its values; it is not "
                "a length mask either: %s)" % (cond.node.name, dtype or "of unknown dtype", length_reason))
    cs, ss = _shapes(m, cond), _shapes(m, _scores(m))
    if not cs or len(cs) != len(ss):
        return "the shape of mask '%s' is unknown (pass input shapes)" % cond.node.name
    for cshape, sshape in zip(cs, ss):
        if tuple(cshape) != tuple(sshape):
            return ("mask '%s' %s is not the scores' shape %s (where() and the product would broadcast it "
                    "differently; it is not a length mask either: %s)" % (cond.node.name, tuple(cshape),
                                                                           tuple(sshape), length_reason))
    return None


class Attention(Rule):
    name = "attention"
    family = "attention"
    key = "softmax"
    benefit = 100
    description = "batch_dot(q,kᵀ) → scale → mask → softmax → batch_dot(·,v) → fused_attention"

    def pattern(self) -> Pattern:
        return core_pattern()

    def check(self, m: Match) -> Optional[str]:
        pv = m.node("pv")
        for name in ("q_scale", "s_scale"):
            _, reason = _scale_step(m, name)
            if reason:
                return reason
        if pv.op.endswith("linalg_gemm2") and float(pv.param("alpha", 1.0)) != 1.0:
            return "value product linalg_gemm2 with alpha=%g" % float(pv.param("alpha", 1.0))
        return _common_checks(m)

    def rewrite(self, m: Match, b: Builder) -> Entry:
        qk = m.node("qk")
        scale = float(qk.param("alpha", 1.0)) if qk.op.endswith("linalg_gemm2") else 1.0
        q = m["q"]
        for name in ("q_scale", "s_scale"):
            step = _scale_step(m, name)[0]
            scale *= step.factor
            if step.param is not None:   # (q·t)·kᵀ = (q·kᵀ)·t, and t keeps its gradient
                q = b.op("broadcast_div" if step.divide else "broadcast_mul", [q, step.param])
        k = m["k"]
        if not qk.param("transpose_b", False):      # k was given as kᵀ (..., D, Sk)
            k = b.op("SwapAxis", [k], attrs={"dim1": -1, "dim2": -2}, name=m.anchor.name + "_kt")
        extra, attrs = _mask_inputs(m, b)
        attrs.update(layout="plain", scale=scale)
        return b.op(FUSED, [q, k, m["v"]] + extra, attrs=attrs, name=m.anchor.name)


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
        widths = {sh[-1] for sh in m.ctx.shapes(src) if sh}
        if len(widths) > 1:
            return None, ("the head size changes with the width of '%s' (%s at the probe shapes): MXNet's "
                          "op scales by 1/√(head size) at run time, the fused op by a constant"
                          % (src.node.name, " / ".join(str(w) for w in sorted(widths))))
        return width // (parts * heads), None

    def check(self, m: Match) -> Optional[str]:
        _, reason = self._head_dim(m)
        if reason:
            return reason
        step, reason = _scale_step(m, "s_scale")
        if reason:
            return reason
        if step.param is not None:
            return ("scale parameter '%s' would be folded into the op (q, k and v are packed "
                    "together here): %s" % (step.param.node.name, "it is trained in mode='training'"
                                            if m.ctx.mode == "training" else "its value is unknown"))
        return _common_checks(m)

    def rewrite(self, m: Match, b: Builder) -> Entry:
        d, _ = self._head_dim(m)
        scale = _scale_step(m, "s_scale")[0].factor / math.sqrt(d)
        extra, attrs = _mask_inputs(m, b)
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


_SAME_SIZE = frozenset({"Reshape", "reshape", "_npx_reshape", "transpose", "_np_transpose", "SwapAxis",
                        "swapaxes", "expand_dims", "squeeze"})


def run_chain(chain: Sequence[Entry], x: np.ndarray) -> Optional[np.ndarray]:
    """Apply a chain of layout ops (outermost first) to ``x`` with MXNet's own ops; None if MXNet refuses.

    MXNet runs them asynchronously: an op that fails while running (a Reshape that MXNet 1.9.1
    infers to a shape of another size, even 0, then cannot copy into) raises at the next wait on
    its output — here, not at a later, unrelated call of the caller's (a zero-size result is
    read without waiting)."""
    import mxnet as mx

    y = mx.nd.array(x, dtype="float64")
    try:
        for e in reversed(chain):
            fn = getattr(mx.nd, e.node.op, None) or getattr(mx.nd._internal, e.node.op)
            out = fn(y, **e.node.attrs.to_json())
            out = out[e.index] if isinstance(out, (list, tuple)) else out
            out.wait_to_read()
            if e.node.op in _SAME_SIZE and out.size != y.size:
                return None
            y = out
        return y.asnumpy()
    except Exception:          # MXNet rejects the shapes: this chain is not a head layout for them
        return None


def chain_shape(chain: Sequence[Entry], shape: Tuple[int, ...]) -> Optional[Tuple[int, ...]]:
    """The shape ``run_chain`` would give an input of ``shape``, from MXNet's shape inference op by
    op (nothing allocated); None where MXNet cannot run the chain there (it refuses an op, or a
    reshape infers a shape of another size, which it then cannot copy into)."""
    import mxnet as mx

    for e in reversed(chain):
        fn = getattr(mx.sym, e.node.op, None) or getattr(mx.sym._internal, e.node.op)
        y = fn(mx.sym.var("x"), **e.node.attrs.to_json())
        if len(y.list_outputs()) > 1:
            y = y[e.index]
        try:
            _, out, _ = y.infer_shape(x=tuple(shape))
        except Exception:  # noqa: BLE001 -- MXNet refuses the op at this shape
            return None
        if not out or out[0] is None:
            return None
        out = tuple(out[0])
        if e.node.op in _SAME_SIZE and int(np.prod(out)) != int(np.prod(shape)):
            return None
        shape = out
    return tuple(shape)


def split_heads(x: np.ndarray, heads: int, rank: int) -> np.ndarray:
    """(B, S, H·D) → (B·H, S, D) (rank 3) or (B, H, S, D) (rank 4), head h of batch b at n = b·H + h."""
    b, s, e = x.shape
    y = x.reshape(b, s, heads, e // heads).transpose(0, 2, 1, 3)
    return y.reshape(b * heads, s, e // heads) if rank == 3 else y


class _CannotRun(str):
    """A reason of ``AttentionHeads._plan_for``: MXNet cannot run a chain at these sizes (a chain
    that hard-codes a size), which says nothing about the sizes the graph runs at."""


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
        layout, heads, inputs, rank = self._plan(m)
        attn = m.node("attn")
        attrs = attn.attrs.copy()
        attrs["layout"] = layout
        attrs["heads"] = heads
        mask = [m["mask"]] if m.has("mask") else []
        if mask and rank == 4 and attn.param("mask_kind", "none") in ("additive", "boolean"):
            # the head-aware layouts align a mask of rank < 4 with (B·H, Sq, Sk); the scores were
            # (B, H, Sq, Sk): leading axes of size 1 keep the mask broadcasting as it did
            for _ in range(4 - len(_shapes(m, m["mask"])[0])):
                mask = [b.op("expand_dims", mask, attrs={"axis": 0})]
        out = b.op(FUSED, inputs + mask, attrs=attrs, name=m.anchor.name)
        mapping = {m.anchor_entry: out}
        for n, x in (("q", "xq"), ("k", "xk")):
            if m[n + "_chain"]:
                mapping.setdefault(m[n + "_chain"][0], m[x])
        return mapping

    def _plan(self, m: Match):
        """(layout, heads, inputs, rank of the split) when the chains are a head split/merge, else
        the reason they are not."""
        if not m["o_chain"] or not m["q_chain"]:
            return "no head split/merge around the attention"
        widths = {n: _last_dim(m, m[x]) for n, x in (("q", "xq"), ("k", "xk"), ("v", "xv"))}
        if None in widths.values():
            unknown = [n for n, w in widths.items() if w is None]
            return "the width of the %s projection is unknown (pass input shapes)" % "/".join(unknown)
        packed = m["xq"] == m["xk"] == m["xv"]
        sub = self.SUBSTITUTE
        plan = self._plan_for(m, widths, packed, sub["B"], sub["Sq"], sub["Sq"] if packed else sub["Sk"])
        shape_q = m.ctx.shape(m["xq"])
        shape_k = m.ctx.shape(m["xk"])
        if not isinstance(plan, str) or not (shape_q and shape_k and len(shape_q) == 3):
            return plan
        # the real sizes, for chains that hard-code them (a Reshape naming the sequence length) ...
        b_, sq, sk = shape_q[0], shape_q[1], shape_k[1]
        plan = self._plan_for(m, widths, packed, b_, sq, sk)
        if isinstance(plan, str):
            return str(plan)
        # ... and at another batch size: a chain that runs there and gives something else (a Reshape
        # splitting B·H as (H, B), the merge at batch 1 only) is refused; one MXNet cannot run there
        # names the batch size itself (the graph runs at that size only)
        other = self._plan_for(m, widths, packed, b_ + 1, sq, sk)
        if isinstance(other, str) and not isinstance(other, _CannotRun):
            return "the chains are the head split/merge at batch %d only (at batch %d: %s)" % (b_, b_ + 1, other)
        return plan

    def _plan_for(self, m: Match, widths, packed: bool, b_: int, sq: int, sk: int):
        seqs = {"q": sq, "k": sk, "v": sk}
        rng = {n: np.arange(b_ * seqs[n] * widths[n], dtype=np.float64).reshape(b_, seqs[n], widths[n])
               for n in "qkv"}
        if packed:
            rng = {n: rng["q"] for n in "qkv"}
        outs = {}
        for n in "qkv":
            y = run_chain(m[n + "_chain"], rng[n])
            if y is None:
                return _CannotRun("MXNet cannot run %s's layout chain at (B, S) = (%d, %d)" % (n, b_, seqs[n]))
            if y.ndim not in (3, 4):
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
        if y is None:
            return _CannotRun("MXNet cannot run the output chain at (B, S) = (%d, %d)" % (b_, sq))
        merged = o_in.reshape(b_, heads, sq, dv).transpose(0, 2, 1, 3).reshape(b_, sq, heads * dv)
        if y.shape != merged.shape or not np.array_equal(y, merged):
            return "the output chain is not the merge of %d heads back to (B, S, H·D)" % heads
        if (m.has("mask") and rank == 4 and m.node("attn").param("mask_kind", "none") in ("additive", "boolean")
                and not _shapes(m, m["mask"])):
            return "the rank of mask '%s' is unknown (pass input shapes)" % m["mask"].node.name
        if packed:
            return "packed_qkv", heads, [m["xq"]], rank
        return "bshd", heads, [m["xq"], m["xk"], m["xv"]], rank


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
