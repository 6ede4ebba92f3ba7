"""``fused_attention`` → stock MXNet ops (see ``patterns/unfuse.py``), for every attribute combination.

    head split (Reshape/transpose/slice_axis, by layout)
    s = linalg_gemm2 | batch_dot(q, k, transpose_b=True) · scale
    causal band (key j visible to query i iff j ≤ i + Sk − Sq), built from positions so that it
    holds at every sequence length:  vis = (Sk−1−j) ≥ (Sq−1−i), from reverse(arange_like(q|k, axis=-2))
        causal_mode add      s = s + where(vis, 0, mask_value)
        causal_mode fill     s = where(vis, s, mask_value)
        causal_mode exclude  lengths = number of visible keys per row (softmax(use_length=True)
                             drops the others, and gives 0 to a row with none)
    mask additive            s = broadcast_add(s, mask)
    mask boolean             s = where(mask ≠ 0, s, mask_value)     (mask broadcast like the kernel's)
    valid_length             softmax(s, lengths, use_length=True)  (lengths shaped like s without its last axis,
                             read per head or per batch element as the kernel reads them at each shape)
      with length_fill       m = key < lengths (and in the causal band);  softmax(where(m, s, mask_value)) * m
    mask boolean, length_fill  softmax(where(mask ≠ 0, s, mask_value)) * mask   (no causal band)
    o = softmax(s) · v, then the head merge  (softmax(temperature=1) for nan_probs="row": MXNet's own
                             kernel, which puts NaN at every probability of a row whose softmax is NaN)

A mask is aligned with the scores from the last axis, as the kernel aligns it: for the
head-aware layouts a rank-4 mask goes with (B, H, Sq, Sk) scores (a (B, H, S, D) split),
lower ranks with (B·H, Sq, Sk).
"""
from __future__ import annotations

from typing import Optional

from fusion.ir.errors import FusionError
from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.engine.rewrite import Builder

from ._unfuse_base import UnfuseRule
from ._unfuse_ops import is_bf16_value


class UnfuseAttention(UnfuseRule):
    def __init__(self):
        super().__init__("fused_attention", 4)

    def _split(self, b: Builder, x: Entry, heads: int, rank: int) -> Entry:
        """(B, S, H·D) → (B·H, S, D), or (B, H, S, D) when the mask is given per (B, H, Sq, Sk)."""
        t = b.op("Reshape", [x], attrs={"shape": (0, 0, heads, -1)})
        t = b.op("transpose", [t], attrs={"axes": (0, 2, 1, 3)})
        return b.op("Reshape", [t], attrs={"shape": (-3, 0, 0)}) if rank == 3 else t

    def _merge(self, b: Builder, o: Entry, heads: int, name: str, rank: int) -> Entry:
        t = b.op("Reshape", [o], attrs={"shape": (-4, -1, heads, 0, 0)}) if rank == 3 else o
        t = b.op("transpose", [t], attrs={"axes": (0, 2, 1, 3)})
        return b.op("Reshape", [t], attrs={"shape": (0, 0, -3)}, name=name)

    def _interleaved(self, b: Builder, x: Entry, heads: int, parts: int, index: int) -> Entry:
        """(S, B, H·parts·D) → part ``index`` as (B·H, S, D), as MXNet's interleaved ops read it."""
        t = b.op("Reshape", [x], attrs={"shape": (0, 0, heads, parts, -1)})
        t = b.op("slice_axis", [t], attrs={"axis": 3, "begin": index, "end": index + 1})
        t = b.op("Reshape", [t], attrs={"shape": (0, 0, 0, -1)})                     # (S, B, H, D)
        t = b.op("transpose", [t], attrs={"axes": (1, 2, 0, 3)})                       # (B, H, S, D)
        return b.op("Reshape", [t], attrs={"shape": (-3, 0, 0)})

    @staticmethod
    def _band(b: Builder, q: Entry, k: Entry) -> Entry:
        """(Sq, Sk) 1/0: key j visible to query i iff Sk−1−j ≥ Sq−1−i (bottom-right aligned)."""
        rq = b.op("reverse", [b.op("_contrib_arange_like", [q], attrs={"axis": -2})], attrs={"axis": 0})
        rk = b.op("reverse", [b.op("_contrib_arange_like", [k], attrs={"axis": -2})], attrs={"axis": 0})
        return b.op("broadcast_greater_equal", [b.op("Reshape", [rk], attrs={"shape": (1, -1)}),
                                                b.op("Reshape", [rq], attrs={"shape": (-1, 1)})])

    @staticmethod
    def _rows_like(b: Builder, s: Entry) -> Entry:
        """Zeros shaped like the scores without their last axis (what softmax lengths are shaped as)."""
        return b.op("sum", [b.op("zeros_like", [s])], attrs={"axis": -1})

    def _lengths(self, m: Match, b: Builder, lengths: Entry, s: Entry, rows_rank: Optional[int],
                 ls: Optional[tuple]) -> Entry:
        """The op's valid lengths as softmax(use_length=True) takes them: int32, shaped like the scores
        ``s`` without their last axis (rank ``rows_rank``), read as the kernel reads them at every shape.

        The kernel takes the scores' own form, or (N,) / (N, Sq) with N = B·H (one per head) or N = B
        (shared by the B's heads), telling them apart by the sizes of each call: a graph fused at
        B = 1, H = 2 with (2, Sq) lengths per head reads them per batch element at B = 2.  Row n of
        the (B·H, Sq) rows takes row ⌊n·N / (B·H)⌋ of the lengths — n itself per head, n // H per
        batch element — computed from the shapes in the graph (arange_like, take), so one stock
        graph reads them as the kernel does at every shape."""
        t = b.op("Cast", [lengths], attrs={"dtype": "int32"})
        if ls is None or rows_rank is None:
            return t                     # what the rules emit (softmax's own lengths); shapes unknown
        if len(ls) == rows_rank and rows_rank != 2:
            # the scores' own form (rank 1: (Sq,) scores of rank 2; rank >= 3: (batch..., Sq)); a
            # rank-1 (1,) (one length for all) broadcasts like it
            return b.op("broadcast_add", [b.op("Cast", [self._rows_like(b, s)], attrs={"dtype": "int32"}), t]) \
                if rows_rank == 1 else t
        if rows_rank == 1:               # (1, Sq): the one head's lengths per row
            return b.op("Reshape", [t], attrs={"shape": (-1,)})
        rows = self._rows_like(b, s)                                     # zeros (batch..., Sq)
        flat = rows if rows_rank == 2 else b.op("Reshape", [rows], attrs={"shape": (-1, 0), "reverse": True})  # (B·H, Sq)
        f64 = lambda e: b.op("Cast", [e], attrs={"dtype": "float64"})     # noqa: E731
        n = f64(b.op("_contrib_arange_like", [flat], attrs={"axis": 0}))  # 0 .. B·H-1
        total = b.op("sum", [b.op("ones_like", [n])])                     # B·H, as a (1,) tensor
        first = t if len(ls) == 1 else b.op("slice_axis", [t], attrs={"axis": 1, "begin": 0, "end": 1})
        count = b.op("sum", [f64(b.op("ones_like", [first]))])            # N
        index = b.op("floor", [b.op("broadcast_div", [b.op("broadcast_mul", [n, count]), total])])
        g = b.op("take", [t, index], attrs={"axis": 0})                   # (B·H,) or (B·H, Sq)
        if len(ls) == 1:
            g = b.op("Reshape", [g], attrs={"shape": (-1, 1)})
        g = b.op("broadcast_add", [b.op("Cast", [flat], attrs={"dtype": "int32"}), g])
        if rows_rank > 2:                                                 # (B·H, Sq) → (batch..., Sq)
            g = b.op("reshape_like", [g, rows])
        return g

    def _split_rank(self, m: Match, f, mask: Optional[Entry], mask_kind: str) -> int:
        """Rank of the head split of bshd / packed_qkv: 4 for a mask given per (B, H, ...)."""
        if mask is None:
            return 3
        shape = m.ctx.shape(mask)
        if shape is None:
            raise FusionError("the rank of mask '%s' of %s is unknown: pass input shapes to unfuse"
                              % (mask.node.name, f.name))
        if mask_kind == "valid_length":
            return 4 if len(shape) == 3 else 3
        return 4 if len(shape) == 4 else 3

    def rewrite(self, m: Match, b: Builder) -> Entry:
        f = m.node("f")
        if str(f.attrs.raw("out_dtype", "float32")) == "bfloat16":
            # written rounded to bfloat16 for readers that round it anyway: so do the stock ops
            y = self._attention(m, b, f, f.name + "_fp32")
            return b.op("amp_cast", [y], attrs={"dtype": "bfloat16"}, name=f.name)
        return self._attention(m, b, f, f.name)

    def _attention(self, m: Match, b: Builder, f, name: str) -> Entry:
        ins = self.inputs(m)
        layout = f.param("layout", "plain")
        heads = int(f.param("heads", 1))
        mask_kind = f.param("mask_kind", "none")
        causal = bool(f.param("causal", False))
        causal_mode = f.param("causal_mode", "exclude")
        mask_value = float(f.param("mask_value", -1e18))
        data = {"plain": 3, "bshd": 3, "packed_qkv": 1, "interleaved": 1, "interleaved_encdec": 2}[layout]
        # data held in bfloat16 (precision.between_ops): widened exactly
        ins = [b.op("amp_cast", [e], attrs={"dtype": "float32"}, name="%s_data%d_fp32" % (f.name, i))
               if i < data and is_bf16_value(m, e) else e for i, e in enumerate(ins)]
        mask = ins[data] if mask_kind != "none" else None
        q_shape = m.ctx.shape(ins[0])
        rank = 3
        if layout in ("bshd", "packed_qkv"):
            rank = self._split_rank(m, f, mask, mask_kind)
        # MXNet's interleaved ops give (B·H, Sq, Sk) scores: a mask given per (B, H, Sq, Sk) is
        # applied to them viewed as (B, H, Sq, Sk)
        per_head4 = False
        if layout.startswith("interleaved") and mask is not None:
            shape = m.ctx.shape(mask)
            if shape is None and mask_kind != "valid_length":
                raise FusionError("the rank of mask '%s' of %s is unknown: pass input shapes to unfuse"
                                  % (mask.node.name, f.name))
            per_head4 = shape is not None and len(shape) == (3 if mask_kind == "valid_length" else 4)
        if layout == "plain":
            q, k, v = ins[:3]
            rank = len(q_shape) if q_shape is not None else 3
        elif layout == "bshd":
            q, k, v = (self._split(b, x, heads, rank) for x in ins[:3])
        elif layout == "packed_qkv":
            parts = b.op("split", [ins[0]], attrs={"num_outputs": 3, "axis": -1}, num_outputs=3)
            q, k, v = (self._split(b, p, heads, rank) for p in parts)
        elif layout == "interleaved":
            q, k, v = (self._interleaved(b, ins[0], heads, 3, i) for i in range(3))
        else:
            q = self._interleaved(b, ins[0], heads, 1, 0)
            k, v = (self._interleaved(b, ins[1], heads, 2, i) for i in range(2))
        # linalg_gemm2 takes every rank >= 2, as the plain layout does; batch_dot needs >= 3
        product = "linalg_gemm2" if layout == "plain" else "batch_dot"
        s = b.op(product, [q, k], attrs={"transpose_b": True})
        s = b.op("_mul_scalar", [s], attrs={"scalar": float(f.attrs["scale"])})
        if per_head4 and mask_kind != "valid_length":
            s = b.op("Reshape", [s], attrs={"shape": (-4, -1, heads, 0, 0)})
        lengths = None
        if causal:
            vis = self._band(b, q, k)
            if causal_mode == "add":
                add = b.op("where", [vis, b.op("zeros_like", [vis]),
                                     b.op("_mul_scalar", [b.op("ones_like", [vis])], attrs={"scalar": mask_value})])
                s = b.op("broadcast_add", [s, add])
            elif causal_mode == "fill":
                cond = b.op("broadcast_add", [b.op("zeros_like", [s]), vis])
                fill = b.op("_mul_scalar", [b.op("ones_like", [s])], attrs={"scalar": mask_value})
                s = b.op("where", [cond, s, fill])
            else:
                band = b.op("sum", [vis], attrs={"axis": -1})
                lengths = b.op("Cast", [b.op("broadcast_add", [self._rows_like(b, s), band])],
                               attrs={"dtype": "int32"})
        if mask_kind == "additive":
            s = b.op("broadcast_add", [s, mask])
        elif mask_kind == "boolean":
            # the condition broadcast to the scores' shape from the last axis, as the kernel reads it
            cond = b.op("broadcast_add", [b.op("zeros_like", [s]), mask])
            fill = b.op("_mul_scalar", [b.op("ones_like", [s])], attrs={"scalar": mask_value})
            s = b.op("where", [cond, s, fill])
            if bool(f.param("length_fill", False)):
                # softmax(where(m, s, c)) * m: every probability times the mask's value
                p = b.op("elemwise_mul", [b.op("softmax", [s], attrs={"axis": -1}), cond])
        elif mask_kind == "valid_length":
            ls = m.ctx.shape(mask)
            if per_head4:   # (B, H, Sq) → (B·H, Sq)
                mask = b.op("Reshape", [mask], attrs={"shape": (-3, 0)})
                ls = (ls[0] * ls[1], ls[2])
            rows_rank = (len(q_shape) - 1 if q_shape is not None else None) if layout == "plain" else \
                (2 if per_head4 else rank - 1)
            given = self._lengths(m, b, mask, s, rows_rank, ls)
            lengths = given if lengths is None else b.op("broadcast_minimum", [given, lengths])
        if mask_kind == "boolean" and bool(f.param("length_fill", False)):
            pass                # p above
        elif lengths is not None and bool(f.param("length_fill", False)):
            # GluonNLP's masked softmax: the keys at or after a row's length get mask_value, then
            # probability 0 (softmax(where(m, s, c)) * m, m = key < length)
            # (the key axis named from the front where the rank is known: fusion/onnx's export of
            # arange_like over axis -1 gives one position)
            s_rank = (len(q_shape) if q_shape is not None else None) if layout == "plain" else rank
            keys = b.op("_contrib_arange_like", [s], attrs={"axis": -1 if s_rank is None else s_rank - 1})
            lf = b.op("expand_dims", [b.op("Cast", [lengths], attrs={"dtype": "float32"})], attrs={"axis": -1})
            cond = b.op("broadcast_lesser", [b.op("broadcast_add", [b.op("zeros_like", [s]), keys]), lf])
            fill = b.op("_mul_scalar", [b.op("ones_like", [s])], attrs={"scalar": mask_value})
            p = b.op("elemwise_mul", [b.op("softmax", [b.op("where", [cond, s, fill])], attrs={"axis": -1}), cond])
        elif lengths is not None:
            p = b.op("softmax", [s, lengths], attrs={"axis": -1, "use_length": True})
        elif f.param("nan_probs", "auto") == "row":
            # a temperature (1) runs MXNet's own softmax kernel, not oneDNN's: a row whose softmax
            # is NaN has every probability NaN, as the op's nan_probs="row" gives it
            p = b.op("softmax", [s], attrs={"axis": -1, "temperature": 1.0})
        else:
            p = b.op("softmax", [s], attrs={"axis": -1})
        if per_head4 and mask_kind != "valid_length":
            p = b.op("Reshape", [p], attrs={"shape": (-3, 0, 0)})
        o = b.op(product, [p, v], name=name if layout == "plain" else None)
        if layout == "plain":
            return o
        if layout in ("bshd", "packed_qkv"):
            return self._merge(b, o, heads, name, rank)
        t = b.op("Reshape", [o], attrs={"shape": (-4, -1, heads, 0, 0)})               # (B, H, S, D)
        t = b.op("transpose", [t], attrs={"axes": (2, 0, 1, 3)})                         # (S, B, H, D)
        return b.op("Reshape", [t], attrs={"shape": (0, 0, -3)}, name=name)
