r"""GELU written out → one op.

erf form (exact GELU) → ``LeakyReLU(act_type='gelu')``, which MXNet computes as
``0.5·x·(1 + erf(x/√2))``::

    u = x / √2 | x · (1/√2)                       _div_scalar | _mul_scalar
    y = 0.5·x · (1 + erf(u))                     mul(_mul_scalar(x, .5), _plus_scalar(erf(u), 1))
      | (x · (1 + erf(u))) · 0.5
      | x · ((1 + erf(u)) · 0.5)
      | x · (0.5 + 0.5·erf(u))

tanh form (the approximation) → ``fused_elemwise`` evaluating the same expression
with the graph's own constants, in one pass::

    c = x³ | x·x·x | x²·x                         _power_scalar(x, 3) | mul chains | square
    t = tanh(k · (x + a·c))                      k ≈ √(2/π), a ≈ 0.044715
    y = 0.5·x·(1 + t), arranged as above

Constants must be those of GELU (to 1e-6 relative for the erf form, 1e-3 for the
tanh form, whose constants are printed with few digits in many models) or the
match is refused with the constant in the reason.  Both patterns are also used by
``dense_act`` to fuse a GELU straight into the FullyConnected before it.
"""
from __future__ import annotations

import math
from typing import List, Optional

from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.ir.pattern import Pattern, Var, op, scalar
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from ._dtypes import float32_reason

SQRT2 = math.sqrt(2.0)
TANH_K = math.sqrt(2.0 / math.pi)
TANH_A = 0.044715


def _half_forms(x: Pattern, bracket_inner: Pattern) -> Pattern:
    """0.5·x·(1 + inner) in the four ways the 0.5 is commonly placed."""
    bracket = scalar("add", bracket_inner, name="one")
    return (op.mul(scalar("mul", x, name="half"), bracket, name="prod")
            | scalar("mul", op.mul(x, bracket, name="prod"), name="half")
            | op.mul(x, scalar("mul", bracket, name="half"), name="prod")
            | op.mul(x, scalar("add", scalar("mul", bracket_inner, name="half"), name="one"), name="prod"))


def gelu_erf_pattern(x: Pattern = None) -> Pattern:
    """The erf form over ``x`` (default: any value, bound as "x")."""
    x = Var("x") if x is None else x
    u = scalar("div", x, name="u") | scalar("mul", x, name="u")
    return _half_forms(x, op.erf(u, name="inner"))


def gelu_tanh_pattern(x: Pattern = None) -> Pattern:
    """The tanh form over ``x``."""
    x = Var("x") if x is None else x
    cube = (scalar("pow", x, name="cube") | op.mul(op.mul(x, x), x, name="cube")
            | op.mul(op.square(x), x, name="cube"))
    inner_sum = op.add(x, scalar("mul", cube, name="a"), name="poly")
    return _half_forms(x, op.tanh(scalar("mul", inner_sum, name="k"), name="inner"))


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


def _scalar(m: Match, name: str) -> float:
    return float(m.node(name).attrs["scalar"])


def _half_reason(m: Match) -> Optional[str]:
    split = m.node("half").inputs[0].node is m.node("inner")     # 0.5 + 0.5·f form
    one, half = _scalar(m, "one"), _scalar(m, "half")
    if not _close(half, 0.5, 1e-6) or not _close(one, 0.5 if split else 1.0, 1e-6):
        return "constants %g and %g do not make 0.5·(1+…)" % (half, one)
    return None


TRAINING_REASON = ("in training the written form is kept: its gradient is the product rule's, NaN where an "
                   "infinite gradient meets a zero factor, which GELU's own derivative is not (the "
                   "elementwise rule fuses it as written)")


def gelu_erf_reason(m: Match) -> Optional[str]:
    """Why a matched erf form is not exactly GELU (None when it is)."""
    u = m.node("u")
    c = _scalar(m, "u")
    if not _close(c, SQRT2 if u.op.lower().startswith("_div") else 1 / SQRT2, 1e-6):
        return "erf argument is x·%g, not x/√2" % (c if "mul" in u.op.lower() else 1 / c)
    return _half_reason(m)


def gelu_tanh_reason(m: Match) -> Optional[str]:
    if m.node("cube").op.startswith("_power") and _scalar(m, "cube") != 3:
        return "power %g is not a cube" % _scalar(m, "cube")
    if not _close(_scalar(m, "k"), TANH_K, 1e-3) or not _close(_scalar(m, "a"), TANH_A, 1e-3):
        return "constants %g, %g are not GELU's √(2/π), 0.044715" % (_scalar(m, "k"), _scalar(m, "a"))
    return _half_reason(m)


def gelu_tanh_expr(m: Match, arg: str = "x0") -> str:
    """The tanh GELU as a fused_elemwise program, with the graph's own constants."""
    k, a = repr(_scalar(m, "k")), repr(_scalar(m, "a"))
    return ("mul(mul({x}, 0.5), add(tanh(mul(add({x}, mul(mul(mul({x}, {x}), {x}), {a})), {k})), 1))"
            .format(x=arg, a=a, k=k))


class GeluErf(Rule):
    name = "gelu_erf"
    family = "gelu"
    benefit = 50
    description = "0.5·x·(1+erf(x/√2)) written out → LeakyReLU(act_type='gelu')"

    def pattern(self) -> Pattern:
        return gelu_erf_pattern()

    def check(self, m: Match) -> Optional[str]:
        if m.ctx.mode == "training":
            return TRAINING_REASON
        return gelu_erf_reason(m)

    def rewrite(self, m: Match, b: Builder) -> Entry:
        return b.op("LeakyReLU", [m["x"]], attrs={"act_type": "gelu"}, name=m.anchor.name)


class GeluTanh(Rule):
    name = "gelu_tanh"
    family = "gelu"
    benefit = 50
    description = "0.5·x·(1+tanh(√(2/π)(x+0.044715x³))) written out → one fused_elemwise"

    def pattern(self) -> Pattern:
        return gelu_tanh_pattern()

    def check(self, m: Match) -> Optional[str]:
        if m.ctx.mode == "training":
            return TRAINING_REASON
        return float32_reason([m["x"]], m.ctx) or gelu_tanh_reason(m)

    def rewrite(self, m: Match, b: Builder) -> Entry:
        return b.op("fused_elemwise", [m["x"]], attrs={"expr": gelu_tanh_expr(m), "num_args": 1},
                    name=m.anchor.name)


RULES: List[Rule] = [GeluErf(), GeluTanh()]
