r"""Three projections of one input feeding an attention → one product (``fused_dense``, N = 3·H·D).

Matched (what ``dense_act`` and ``attention_heads`` make of BERT's separate query/key/value layers)::

    q = fused_dense(x, Wq[, bq]),  k = fused_dense(x, Wk[, bk]),  v = fused_dense(x, Wv[, bv])
    o = fused_attention(q, k, v[, mask], layout="bshd", heads=H)

Rewrite: ``qkv = fused_dense(x, [Wq; Wk; Wv][, [bq; bk; bv]])`` (the weights and biases
concatenated once into new parameters) and ``o = fused_attention(qkv[, mask],
layout="packed_qkv", heads=H)``, which reads q, k and v as the three H·D blocks of each row.
Every output value is the same dot product as before (one GEMM of N = 3·H·D instead of three
of H·D: x is read — and, under ``precision="bf16"``, rounded to bfloat16 — once); only the
GEMM's blocking may change the float32 summation order.

Refused: projections with an activation, ``flatten=True``, a head-split output, or widths that
differ (packed_qkv takes three blocks of H·D); weights or biases that are not known parameters,
or not all float32 or all bfloat16; bfloat16 weights outside ``precision="bf16"``; training (new
parameters).  q, k and v read by anything but the attention are interior values: no match.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.ir.pattern import Const, Pattern, Var, op
from fusion.precision.policy import BFLOAT16, from_bf16, is_bf16
from fusion.engine.report import no_value_reason
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

PROJ = ("q", "k", "v")


def _proj(n: str) -> Pattern:
    return op("fused_dense")(Var("x"), Const("w" + n), Const("b" + n, optional=True), name=n)


class QKVProjection(Rule):
    name = "qkv_projection"
    family = "qkv_projection"
    key = "attn"
    benefit = 10
    inference_only = True
    training_reason = "it concatenates the three weights into a new parameter; in training every parameter " \
                      "must stay the one the optimizer updates"
    description = "three fused_dense of one input → fused_attention(bshd) → one fused_dense (N = 3·H·D) → packed_qkv"

    def pattern(self) -> Pattern:
        return op("fused_attention")(_proj("q"), _proj("k"), _proj("v"), Var("mask", optional=True), name="attn")

    def check(self, m: Match) -> Optional[str]:
        attn = m.node("attn")
        if str(attn.attrs.raw("layout", "plain")) != "bshd":
            return "the attention's layout is %s, not bshd" % attn.attrs.raw("layout", "plain")
        shapes, dtypes, biased = set(), set(), set()
        for n in PROJ:
            d = m.node(n)
            raw = {k: str(d.attrs.raw(k)) for k in ("act", "flatten", "out_layout", "out_dtype", "no_bias")}
            if raw["act"] not in ("none", "None"):
                return "projection '%s' has the activation %s" % (d.name, raw["act"])
            if raw["flatten"] not in ("False", "0", "false"):
                return "projection '%s' flattens its input" % d.name
            if raw["out_layout"] not in ("plain", "None") or raw["out_dtype"] not in ("float32", "None"):
                return "projection '%s' writes another layout or dtype" % d.name
            w = m.value("w" + n)
            if w is None:
                return no_value_reason(m.ctx, m["w" + n].node.name, "weight")
            biased.add(m.has("b" + n))
            if m.has("b" + n):
                b = m.value("b" + n)
                if b is None:
                    return no_value_reason(m.ctx, m["b" + n].node.name, "bias")
                if b.dtype != np.float32:
                    return "bias '%s' is %s, not float32" % (m["b" + n].node.name, b.dtype)
            shapes.add(tuple(w.shape))
            dtypes.add("bfloat16" if is_bf16(w.dtype) else np.dtype(w.dtype).name)
        if len(shapes) != 1:
            return "the projections' weights differ in shape (%s): packed_qkv takes three blocks of H·D" % (
                ", ".join(map(str, sorted(shapes))))
        if len(biased) != 1:
            return "some projections have a bias and others not"
        if len(dtypes) != 1 or not dtypes <= {"float32", "bfloat16"}:
            return "the projections' weights are %s, not all float32 or all bfloat16" % "/".join(sorted(dtypes))
        if dtypes == {"bfloat16"} and m.ctx.precision != BFLOAT16:
            return "the projections' weights are bfloat16 (fuse with precision='bf16' to merge them)"
        width, heads = next(iter(shapes))[0], int(attn.param("heads", 1))
        if heads < 1 or width % heads:
            return "projection width %d is not a multiple of heads=%d" % (width, heads)
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        attn = m.node("attn")
        names = [m["w" + n].node.name for n in PROJ]
        # concatenated in float32 (bfloat16 widens exactly; the precision policy casts the new
        # weight back to the same bits, as it casts every fused_dense weight)
        w = np.concatenate([np.asarray(from_bf16(v) if is_bf16(v.dtype) else v, np.float32)
                            for v in (m.value("w" + n) for n in PROJ)], axis=0)
        base = names[0][:-len("_bf16")] if names[0].endswith("_bf16") else names[0]
        inputs = [m["x"], b.param(base + "_qkv", w)]
        attrs = {"num_hidden": int(w.shape[0]), "flatten": False, "act": "none"}
        if m.has("bq"):
            inputs.append(b.param(m["bq"].node.name + "_qkv",
                                  np.concatenate([np.asarray(m.value("b" + n), np.float32).reshape(-1) for n in PROJ])))
        else:
            attrs["no_bias"] = True
        qkv = b.op("fused_dense", inputs, attrs=attrs, name=m.node("q").name + "_qkv")
        a = attn.attrs.copy()
        a["layout"] = "packed_qkv"
        return b.op("fused_attention", [qkv] + ([m["mask"]] if m.has("mask") else []), attrs=a,
                    name=attn.name)


RULES: List[Rule] = [QKVProjection()]
