r"""Softmax written out → ``softmax``.

Matched::

    e = exp(x − max(x, axis=a, keepdims=True))   or   exp(x)
    y = e / sum(e, axis=a, keepdims=True)         broadcast_div | elemwise_div

Rewrite: ``y = softmax(x, axis=a)``.  With the max subtracted this is the same
arithmetic; without it, the written form overflows to inf/NaN for inputs above
~88 while ``softmax`` (which subtracts the max internally) stays finite — the
only inputs on which the two differ.
"""
from __future__ import annotations

from typing import List, Optional

from fusion.graph import Entry
from fusion.matcher import Match
from fusion.pattern import Pattern, Var, op
from fusion.rewrite import Builder
from fusion.rule import Rule

from .layer_norm import _axis


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
        names = ("sum", "max") if m.has("max") else ("sum",)
        axes = [_axis(m.node(n)) for n in names]
        if None in axes:
            return "the reductions must be over one axis"
        if len(set(axes)) != 1:
            return "max and sum reduce different axes %s" % axes
        for n in names:
            if not m.node(n).param("keepdims", False):
                return "%s '%s' does not keep dims" % (m.node(n).op, m.node(n).name)
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        return b.op("softmax", [m["x"]], attrs={"axis": _axis(m.node("sum"))}, name=m.anchor.name)


RULES: List[Rule] = [DecomposedSoftmax()]
