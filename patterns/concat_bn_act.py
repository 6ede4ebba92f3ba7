r"""DenseNet's pre-activation: Concat → BatchNorm [→ relu] in one pass that never writes the concatenation.

Matched (anchor at the bottom)::

    p0 … pk-1
       Concat(dim=1)                    (rebuilt for any other reader)
       BatchNorm(γ, β, μ, σ², axis=1)   inference, parameters known
       [Activation(relu) | relu]

Rewrite: ``y = fused_concat_scale_act(p0, …, pk-1, s, t, act=…)``, reading the pieces
where they are, with BatchNorm as the exact per-channel scale and shift (computed in
float64, stored as float32 of shape (C, 1, …, 1))::

    s = γ / √(σ² + ε)   (γ := 1 when fix_gamma),   t = β − μ · s
    y = act(concat(p) · s + t)

And, so that a DenseNet's concatenations are not written at all, a Concat(dim=1) whose
first input is another Concat(dim=1) (DenseNet's ``concat(x, layer(x))``), to any depth,
reads the innermost pieces instead (``concat(concat(a, b), c) = concat(a, b, c)``, exact;
each inner one is rebuilt from its pieces for its other readers, all in one rewrite):
each layer's BatchNorm then reads the block's input and every earlier layer's output
directly, and once nothing else reads a concatenation, it is fused away with its BatchNorm.  A concatenation also read elsewhere
is rebuilt for those readers (written once, as before; the pass over it is still saved).

Refused: BatchNorm over another axis than the concatenation's channel axis (1), a
Concat along another axis, values other than float32, unknown parameters or shapes,
and ``mode='training'`` (BatchNorm's moving statistics).
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.ir.pattern import Const, Pattern, Var, op
from fusion.engine.reasons import NeedsShapes
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from ._dtypes import float32_reason
from .elementwise import batchnorm_scale_shift
from .region import taken_by_region

MAX_PIECES = 128
MAX_DEPTH = 64          # nested Concats opened by one rewrite (DenseNet-201's longest block: 48)


def _concat(name: str, prefix: str) -> Pattern:
    return op.Concat(Var(prefix + "0"), *(Var("%s%d" % (prefix, i), optional=True) for i in range(1, MAX_PIECES)),
                     name=name)


def _pieces(m: Match, prefix: str = "p") -> List[Entry]:
    return [m["%s%d" % (prefix, i)] for i in range(MAX_PIECES) if m.has("%s%d" % (prefix, i))]


def _dim(node) -> int:
    return int(node.param("dim", 1))


def _joins(e: Entry, dim: int) -> bool:
    return e.node.op == "Concat" and _dim(e.node) == dim


class ConcatBNAct(Rule):
    name = "concat_bn_act"
    family = "concat_bn_act"
    key = "bn"
    benefit = 35            # before the elementwise regions take BatchNorm → relu
    inference_only = True
    training_reason = ("BatchNorm as a scale and shift uses the moving statistics, which training updates; "
                       "refused in mode='training'")
    description = "Concat → BatchNorm [→ relu] → fused_concat_scale_act (the concatenation is not written)"

    def pattern(self) -> Pattern:
        bn = op.BatchNorm(_concat("cat", "p"), Const("gamma"), Const("beta"), Const("mean"), Const("var"),
                          name="bn")
        return op.Activation(bn, act_type="relu", name="act") | op.relu(bn, name="act") | bn

    def outside_use_ok(self, m: Match, entry: Entry, user) -> bool:
        return entry == Entry(m.node("cat"))    # the concatenation, rebuilt for readers outside

    def check(self, m: Match) -> Optional[str]:
        taken = taken_by_region(m)
        if taken:
            return taken
        cat, bn = m.node("cat"), m.node("bn")
        reason = float32_reason(_pieces(m) + [m[k] for k in ("gamma", "beta", "mean", "var")], m.ctx)
        if reason:
            return reason
        shape = m.ctx.partial_shape(Entry(cat))     # its rank is all it needs (known without input shapes)
        if shape is None:
            return NeedsShapes("the shape of Concat '%s' is unknown" % cat.name)
        if _dim(cat) % len(shape) != 1:
            return "Concat '%s' joins axis %d, not the channel axis 1" % (cat.name, _dim(cat))
        if bn.param("axis") % len(shape) != 1:
            return "BatchNorm '%s' normalizes axis %d, not the channel axis 1" % (bn.name, bn.param("axis"))
        first = _pieces(m)[0]
        if _joins(first, _dim(cat)):      # concat_flatten opens it first: then the copy it makes goes too
            return "Concat '%s' reads Concat '%s' along the same axis (not flattened yet)" % (
                cat.name, first.node.name)
        if bn.param("output_mean_var"):
            return "BatchNorm '%s' also returns its mean and variance" % bn.name
        if batchnorm_scale_shift(bn, m.ctx) is None:
            return ("BatchNorm '%s' is not a known scale and shift (its parameters are not all given, or a "
                    "variance + eps is not positive)" % bn.name)
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        bn = m.node("bn")
        scale, shift, axis, rank = batchnorm_scale_shift(bn, m.ctx)
        shape = [-1] + [1] * (rank - 2)
        s = b.param(bn.name + "_scale", scale.reshape(shape).astype(np.float32))
        t = b.param(bn.name + "_shift", shift.reshape(shape).astype(np.float32))
        act = "none"
        if m.has("act"):
            act = "act_relu" if m.node("act").op == "Activation" else "relu"
        pieces = _pieces(m)
        y = b.op("fused_concat_scale_act", pieces + [s, t], attrs={"num_args": len(pieces), "act": act},
                 name=m.anchor.name)
        cat = m.node("cat")
        graph = m.ctx.graph
        if Entry(cat) in graph.heads or any(u is not bn for u, _ in graph.consumers().get(cat, ())):
            # read elsewhere too: it is still written once, and the pass over it is saved
            return {m.anchor_entry: y, Entry(cat): b.op("Concat", pieces, attrs=cat.attrs, name=cat.name, after=cat)}
        return y


def _axis1(v) -> bool:
    return v is None or int(v) == 1


def _nested(depth: int) -> Pattern:
    """Concat(dim=1) whose first input is, up to ``MAX_DEPTH`` levels deep, another Concat(dim=1):
    level d binds ``cat<d>`` and its other inputs ``q<d>_<i>`` (its first one too at the innermost)."""
    first = Var("q%d_0" % depth)
    if depth + 1 < MAX_DEPTH:
        first = _nested(depth + 1) | first
    rest = (Var("q%d_%d" % (depth, i), optional=True) for i in range(1, MAX_PIECES))
    return op.Concat(first, *rest, name="cat%d" % depth, dim=_axis1)


class ConcatFlatten(Rule):
    name = "concat_flatten"
    family = "concat_bn_act"
    key = "cat0"
    benefit = 36
    description = ("Concat(dim=1) whose first input is a Concat(dim=1), to any depth → one Concat of all the "
                   "pieces (each inner one rebuilt from its pieces for its other readers)")

    def pattern(self) -> Pattern:
        return _nested(0)

    def outside_use_ok(self, m: Match, entry: Entry, user) -> bool:
        return entry.node.op == "Concat"     # an inner concatenation: rebuilt as it was, from its pieces

    @staticmethod
    def _levels(m: Match) -> List[List[Entry]]:
        """Per level, outermost first: the pieces it adds (its first input too at the innermost)."""
        out = []
        d = 0
        while m.has("cat%d" % d):
            out.append([m["q%d_%d" % (d, i)] for i in range(MAX_PIECES) if m.has("q%d_%d" % (d, i))])
            d += 1
        return out

    def check(self, m: Match) -> Optional[str]:
        taken = taken_by_region(m)
        if taken:
            return taken
        levels = self._levels(m)
        if len(levels) < 2:
            return "the first input is not a Concat along the same axis"
        if sum(len(lv) for lv in levels) > MAX_PIECES:
            return "more than %d pieces" % MAX_PIECES
        return None

    def rewrite(self, m: Match, b: Builder):
        levels = self._levels(m)
        graph = m.ctx.graph
        heads = set(graph.heads)
        users = graph.consumers()
        out = {}
        leaves: List[Entry] = []
        for d in range(len(levels) - 1, -1, -1):          # innermost first
            leaves = leaves + levels[d]
            node = m.node("cat%d" % d)
            outer = m.node("cat%d" % (d - 1)) if d else None
            if d == 0 or Entry(node) in heads or any(u is not outer for u, _ in users.get(node, ())):
                attrs = node.attrs.copy()
                attrs["num_args"] = len(leaves)
                out[Entry(node)] = b.op("Concat", list(leaves), attrs=attrs, name=node.name,
                                        after=None if d == 0 else node)
        return out


RULES: List[Rule] = [ConcatFlatten(), ConcatBNAct()]
