"""``fused_attention`` → batch_dot / softmax / batch_dot with the head split and merge (see ``patterns/unfuse.py``)."""
from __future__ import annotations

from fusion.errors import FusionError
from fusion.graph import Entry
from fusion.matcher import Match
from fusion.rewrite import Builder

from ._unfuse_base import _Unfuse


class UnfuseAttention(_Unfuse):
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

    def rewrite(self, m: Match, b: Builder) -> Entry:
        f = m.node("f")
        ins = self.inputs(m)
        layout = f.param("layout", "plain")
        heads = int(f.param("heads", 1))
        mask_kind = f.param("mask_kind", "none")
        if f.param("causal", False):
            raise FusionError("causal fused_attention has no stock form here")
        data = {"plain": 3, "bshd": 3, "packed_qkv": 1, "interleaved": 1, "interleaved_encdec": 2}[layout]
        mask = ins[data] if mask_kind != "none" else None
        rank = 3
        if layout in ("bshd", "packed_qkv") and mask_kind in ("additive", "boolean"):
            # the kernel reads a rank-4 mask per (B, H, Sq, Sk) and a lower-rank one per (B·H, Sq, Sk)
            shape = m.ctx.shape(mask)
            if shape is None:
                raise FusionError("the rank of mask '%s' of %s is unknown: pass input shapes to unfuse"
                                  % (mask.node.name, f.name))
            rank = 4 if len(shape) == 4 else 3
        if layout == "plain":
            q, k, v = ins[:3]
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
        s = b.op("batch_dot", [q, k], attrs={"transpose_b": True})
        s = b.op("_mul_scalar", [s], attrs={"scalar": float(f.attrs["scale"])})
        softmax_in, extra = [s], {"axis": -1}
        if mask_kind == "additive":
            softmax_in = [b.op("broadcast_add", [s, mask])]
        elif mask_kind == "boolean":
            fill = b.op("_mul_scalar", [b.op("ones_like", [s])], attrs={"scalar": float(f.param("mask_value", -1e18))})
            softmax_in = [b.op("where", [b.op("broadcast_like", [mask, s]), s, fill])]
        elif mask_kind == "valid_length":
            softmax_in, extra = [s, mask], {"axis": -1, "use_length": True}
        p = b.op("softmax", softmax_in, attrs=extra)
        o = b.op("batch_dot", [p, v], name=f.name if layout == "plain" else None)
        if layout in ("plain",):
            return o
        if layout in ("bshd", "packed_qkv"):
            return self._merge(b, o, heads, f.name, rank)
        t = b.op("Reshape", [o], attrs={"shape": (-4, -1, heads, 0, 0)})               # (B, H, S, D)
        t = b.op("transpose", [t], attrs={"axes": (2, 0, 1, 3)})                         # (S, B, H, D)
        return b.op("Reshape", [t], attrs={"shape": (0, 0, -3)}, name=f.name)
