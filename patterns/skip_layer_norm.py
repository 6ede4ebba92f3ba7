r"""Residual add followed by LayerNorm → ``fused_add_layer_norm``.

Matched::

    s = a + b                       elemwise_add | broadcast_add (b broadcast over a's leading axes)
    y = LayerNorm(s, γ, β, axis=-1, eps=ε)

Rewrite: ``y = fused_add_layer_norm(a, b, γ, β, eps=ε)`` — one pass over the rows
instead of writing ``s`` and reading it back.  When ``s`` is also used elsewhere
(pre-LN transformers carry it as the residual stream), the op also returns it
(``output_sum=True``) and those uses read the second output.

The op broadcasts ``a`` and ``b`` as ``broadcast_add`` does (NumPy rules, either operand, any
axis), so the rewrite holds at every shape the graph takes, probed or not.  The rule fuses the
residual form, decided at every probe shape: one operand equal to the other or broadcast over
its leading axes (the form the GPU kernels and ORT's SkipLayerNormalization take), that one
second.

Refused: LayerNorm over an axis other than the last; a broadcast add whose shapes are unknown
or that broadcasts otherwise at some probe shape (e.g. over a middle axis).
"""
from __future__ import annotations

from typing import List, Optional

from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.ir.pattern import Pattern, Var, op
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from ._dtypes import float32_reason


def _broadcasts_over_leading(big, small) -> bool:
    small = tuple(small)
    while small and small[0] == 1:
        small = small[1:]
    return len(small) <= len(big) and tuple(big[len(big) - len(small):]) == small


class SkipLayerNorm(Rule):
    name = "skip_layer_norm"
    family = "skip_layer_norm"
    key = "ln"
    benefit = 70
    exports = ("add",)
    description = "residual add → LayerNorm → fused_add_layer_norm (optionally also returning the sum)"

    def pattern(self) -> Pattern:
        return op.LayerNorm(op.add(Var("a"), Var("b"), name="add"), Var("gamma"), Var("beta"), name="ln")

    def _operands(self, m: Match):
        """(a, b) in the order the op takes them, or a reason — decided at every probe shape, so
        that an add whose operands have equal shapes at batch 1 but not at batch 2 (a position
        embedding of shape (1, S, C)) gets the broadcast operand second at every batch size.
        The op broadcasts both ways at any shape, so a shape no probe reached is still right;
        the rule keeps to the residual form (the one the GPU kernels and ORT's
        SkipLayerNormalization take) and leaves other broadcasts to MXNet."""
        add = m.node("add")
        a, b = m["a"], m["b"]
        if add.op == "elemwise_add" or a == b:
            return a, b
        sa, sb = m.ctx.shapes(a), m.ctx.shapes(b)
        if not sa or len(sa) != len(sb):
            return "the shapes of the broadcast add are unknown (pass input shapes)"
        if all(_broadcasts_over_leading(x, y) for x, y in zip(sa, sb)):
            return a, b
        if all(_broadcasts_over_leading(y, x) for x, y in zip(sa, sb)):
            return b, a
        return "add of shapes %s and %s broadcasts other than over the leading axes of one operand" % (
            " / ".join(map(str, sa)), " / ".join(map(str, sb)))

    def check(self, m: Match) -> Optional[str]:
        reason = float32_reason([m["a"], m["b"], m["gamma"], m["beta"]], m.ctx)
        if reason:
            return reason
        ln = m.node("ln")
        axis = ln.param("axis")
        if axis != -1:
            shape = m.ctx.shape(Entry(ln))
            if shape is None or axis != len(shape) - 1:
                return "LayerNorm axis=%d is not known to be the last axis" % axis
        if ln.param("output_mean_var"):
            return "LayerNorm also returns its mean and variance"
        ops = self._operands(m)
        return ops if isinstance(ops, str) else None

    def rewrite(self, m: Match, b: Builder):
        a, bb = self._operands(m)
        ln = m.node("ln")
        users_outside = m.ctx.graph.consumers().get(m.node("add"), ())
        need_sum = any(u is not ln for u, _ in users_outside) or any(e.node is m.node("add") for e in m.ctx.graph.heads)
        attrs = {"eps": float(ln.param("eps")), "output_sum": need_sum}
        out = b.op("fused_add_layer_norm", [a, bb, m["gamma"], m["beta"]], attrs=attrs, name=ln.name,
                   num_outputs=2 if need_sum else 1)
        if not need_sum:
            return out
        return {m.anchor_entry: out[0], Entry(m.node("add")): out[1]}


RULES: List[Rule] = [SkipLayerNorm()]
