"""``fused_elemwise`` → the stock ops of its program (see ``patterns/unfuse.py``)."""
from __future__ import annotations

import re
from typing import List

from fusion.errors import FusionError
from fusion.graph import Entry
from fusion.matcher import Match
from fusion.pattern import Pattern, Var, op
from fusion.rewrite import Builder

from ._unfuse_base import _Unfuse


_BINARY = {"add": "broadcast_add", "sub": "broadcast_sub", "mul": "broadcast_mul", "div": "broadcast_div",
           "pow": "broadcast_power", "max": "broadcast_maximum", "min": "broadcast_minimum",
           "lt": "broadcast_lesser", "le": "broadcast_lesser_equal", "gt": "broadcast_greater",
           "ge": "broadcast_greater_equal", "eq": "broadcast_equal", "ne": "broadcast_not_equal"}
_SCALAR = {"add": ("_plus_scalar", "_plus_scalar"), "sub": ("_minus_scalar", "_rminus_scalar"),
           "mul": ("_mul_scalar", "_mul_scalar"), "div": ("_div_scalar", "_rdiv_scalar"),
           "pow": ("_power_scalar", "_rpower_scalar"), "max": ("_maximum_scalar", "_maximum_scalar"),
           "min": ("_minimum_scalar", "_minimum_scalar"),
           "lt": ("_lesser_scalar", "_greater_scalar"), "le": ("_lesser_equal_scalar", "_greater_equal_scalar"),
           "gt": ("_greater_scalar", "_lesser_scalar"), "ge": ("_greater_equal_scalar", "_lesser_equal_scalar"),
           "eq": ("_equal_scalar", "_equal_scalar"), "ne": ("_not_equal_scalar", "_not_equal_scalar")}
_UNARY = {"neg": "negative", "abs": "abs", "exp": "exp", "log": "log", "sqrt": "sqrt", "rsqrt": "rsqrt",
          "tanh": "tanh", "sigmoid": "sigmoid", "relu": "relu", "erf": "erf", "square": "square"}
_TOKEN = re.compile(r"\s*(?:(?P<num>[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|inf))"
                    r"|(?P<name>[A-Za-z_][A-Za-z_0-9]*)|(?P<punct>[(),]))")


def _parse(text: str):
    """The program as a tree: ("num", v) | ("in", k) | (fn, [args])."""
    tokens = [(t.lastgroup, t.group(t.lastgroup)) for t in _TOKEN.finditer(text)]
    pos = [0]

    def expr():
        kind, val = tokens[pos[0]]
        pos[0] += 1
        if kind == "num":
            return ("num", float(val))
        if re.fullmatch(r"x\d+", val):
            return ("in", int(val[1:]))
        assert tokens[pos[0]] == ("punct", "("), "expected ( after %s" % val
        pos[0] += 1
        args = [expr()]
        while tokens[pos[0]] == ("punct", ","):
            pos[0] += 1
            args.append(expr())
        assert tokens[pos[0]] == ("punct", ")")
        pos[0] += 1
        return (val, args)

    return expr()


class ElemwiseProgram:
    """Builds stock ops for a fused_elemwise program."""

    def __init__(self, b: Builder, inputs: List[Entry], name: str):
        self.b, self.inputs, self.name = b, inputs, name

    def build(self, text: str) -> Entry:
        out = self._emit(_parse(text))
        if isinstance(out, float):
            raise FusionError("fused_elemwise program %r is a constant" % text)
        return out

    def _op(self, op_name: str, ins, **attrs) -> Entry:
        return self.b.op(op_name, ins, attrs=attrs)

    def _emit(self, t):
        kind = t[0]
        if kind == "num":
            return t[1]
        if kind == "in":
            return self.inputs[t[1]]
        args = [self._emit(a) for a in t[1]]
        if kind in _UNARY:
            return self._op(_UNARY[kind], args)
        if kind in _BINARY:
            a, c = args
            if isinstance(a, float) and isinstance(c, float):
                raise FusionError("constant subexpression %s(%g, %g) in fused_elemwise" % (kind, a, c))
            if isinstance(c, float):
                return self._op(_SCALAR[kind][0], [a], scalar=c)
            if isinstance(a, float):
                return self._op(_SCALAR[kind][1], [c], scalar=a)
            return self._op(_BINARY[kind], [a, c])
        if kind == "clip":
            x, lo, hi = args
            if isinstance(lo, float) and isinstance(hi, float):
                return self._op("clip", [x], a_min=lo, a_max=hi)
            return self._emit(("min", [("max", [t[1][0], t[1][1]]), t[1][2]]))
        if kind == "where":
            c, a, e = (self._op("_mul_scalar", [self._op("ones_like", [self._any(args)])], scalar=v)
                       if isinstance(v, float) else v for v in args)
            # MXNet's where takes equal shapes: broadcast all three to the common shape first
            zero = [self._op("_mul_scalar", [v], scalar=0.0) for v in (c, a, e)]
            like = self._op("broadcast_add", [self._op("broadcast_add", zero[:2]), zero[2]])
            c, a, e = (self._op("broadcast_like", [v, like]) for v in (c, a, e))
            return self._op("where", [c, a, e])
        raise FusionError("fused_elemwise function %r has no stock equivalent" % kind)

    @staticmethod
    def _any(args) -> Entry:
        return next(a for a in args if not isinstance(a, float))


class UnfuseElemwise(_Unfuse):
    def __init__(self):
        super().__init__("fused_elemwise", 8)

    def pattern(self) -> Pattern:
        return op(self.op_name)(*[Var("i%d" % k, optional=k > 0) for k in range(64)], name="f")

    def rewrite(self, m: Match, b: Builder) -> Entry:
        f = m.node("f")
        return ElemwiseProgram(b, self.inputs(m), f.name).build(f.attrs["expr"])
