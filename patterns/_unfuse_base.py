"""The base of the un-fusing rules (see ``patterns/unfuse.py``)."""
from __future__ import annotations

from typing import List

from fusion.graph import Entry
from fusion.matcher import Match
from fusion.pattern import Pattern, Var, op
from fusion.rule import Rule


class _Unfuse(Rule):
    benefit = 1
    family = "unfuse"

    def __init__(self, op_name: str, arity: int):
        self.op_name = op_name
        self.name = "unfuse_" + op_name[len("fused_"):]
        self.description = "%s → stock MXNet ops" % op_name
        self.arity = arity

    def pattern(self) -> Pattern:
        return op(self.op_name)(*[Var("i%d" % k, optional=k > 0) for k in range(self.arity)], name="f")

    def inputs(self, m: Match) -> List[Entry]:
        return list(m.node("f").inputs)
