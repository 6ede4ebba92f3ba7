"""The base of the un-fusing rules (see ``patterns/unfuse.py``)."""
from __future__ import annotations

from typing import List

from fusion.ir.errors import FusionError
from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.ir.pattern import Pattern, Var, op
from fusion.engine.rule import Rule


class UnfuseRule(Rule):
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

    def two_layer_inputs(self, m: Match):
        """(x, w1, b1, w2, b2, rest) of an op with two layers whose biases may be absent (no_bias1,
        no_bias2: None), fused_se and fused_split_attention; ``rest``: the inputs after them."""
        f = m.node("f")
        ins = self.inputs(m)
        x, w1 = ins.pop(0), ins.pop(0)
        b1 = None if f.param("no_bias1", False) else ins.pop(0)
        w2 = ins.pop(0)
        b2 = None if f.param("no_bias2", False) else ins.pop(0)
        if "num_hidden" not in f.attrs or "num_channels" not in f.attrs:
            raise FusionError("%s '%s' lacks num_hidden/num_channels: its layers cannot be rebuilt" % (f.op, f.name))
        return x, w1, b1, w2, b2, ins
