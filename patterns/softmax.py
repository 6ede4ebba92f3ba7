r"""Softmax written out → ``softmax``.

Matched::

    e = exp(x − max(x, axis=a, keepdims=True))   or   exp(x)
    y = e / sum(e, axis=a, keepdims=True)         broadcast_div | elemwise_div

Rewrite: ``y = softmax(x, axis=a) + (m − m)``, ``m = max(x, axis=a, keepdims=True)``.
On finite rows ``m − m`` is 0 and this is the same arithmetic.  The written form gives a
whole row of NaN where the row holds a NaN or +inf (``x − max`` is NaN there) or is all
−inf; MXNet's ``softmax`` does not (``[NaN, 0, 1] → [NaN, 0, 0]``), while ``m − m`` is NaN
exactly on those rows (``max`` propagates NaN), so the sum is the written form's value
everywhere.  Without
it the written form is another function on inputs a model does meet: it overflows
to inf/NaN for inputs above ~88 and gives 0/0 = NaN where every input of a row is
below ~−87 (a fully masked row), where ``softmax`` stays finite — so that form is
refused.
"""
from __future__ import annotations

from typing import List, Optional

from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.ir.pattern import Pattern, Var, op
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from .layer_norm import reduced_axis


def softmax_pattern() -> Pattern:
    x = Var("x")
    shifted = op.sub(x, op.max(x, name="max"), name="shift")
    e = op.exp(shifted | x, name="exp")
    return op.div(e, op.sum(e, name="sum"), name="div")


class DecomposedSoftmax(Rule):
    name = "softmax"
    family = "softmax"
    benefit = 45
    description = "exp(x − max) / sum(exp(x − max)) written out → softmax"

    def pattern(self) -> Pattern:
        return softmax_pattern()

    def check(self, m: Match) -> Optional[str]:
        if not m.has("max"):
            return ("exp(x)/sum(exp(x)) without the max subtracted overflows (x > 88) and gives 0/0 where "
                    "a whole row is below −87, where softmax stays finite: not the same function")
        names = ("sum", "max")
        axes = [reduced_axis(m.node(n)) for n in names]
        if None in axes:
            return "the reductions must be over one axis"
        if len(set(axes)) != 1:
            return "max and sum reduce different axes %s" % axes
        for n in names:
            if not m.node(n).param("keepdims", False):
                return "%s '%s' does not keep dims" % (m.node(n).op, m.node(n).name)
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        axis = reduced_axis(m.node("sum"))
        y = b.op("softmax", [m["x"]], attrs={"axis": axis})
        top = b.op("max", [m["x"]], attrs={"axis": axis, "keepdims": True})
        row_nan = b.op("elemwise_sub", [top, top])           # NaN on rows the written form makes NaN
        return b.op("broadcast_add", [y, row_nan], name=m.anchor.name)


RULES: List[Rule] = [DecomposedSoftmax()]
