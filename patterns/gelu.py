r"""GELU written out in its erf form → ``LeakyReLU(act_type='gelu')``.

Matched (each product in any operand order; ``·0.5`` may sit on x, on the
bracket, on the whole product, or be split as ``0.5 + 0.5·erf``)::

    u = x / √2 | x · (1/√2)                       _div_scalar | _mul_scalar
    y = 0.5·x · (1 + erf(u))                     mul(_mul_scalar(x, .5), _plus_scalar(erf(u), 1))
      | (x · (1 + erf(u))) · 0.5
      | x · ((1 + erf(u)) · 0.5)
      | x · (0.5 + 0.5·erf(u))

Rewrite: ``y = LeakyReLU(x, act_type='gelu')``, which MXNet computes as
``0.5·x·(1 + erf(x/√2))`` — the same function; constants must equal 0.5, 1 and
√2 to 1e-6 relative or the match is refused.  (The tanh approximation is a
different function and is not rewritten to this op.)
"""
from __future__ import annotations

import math
from typing import List, Optional

from fusion.graph import Entry
from fusion.matcher import Match
from fusion.pattern import Pattern, Var, op, scalar
from fusion.rewrite import Builder
from fusion.rule import Rule

SQRT2 = math.sqrt(2.0)


def gelu_erf_pattern() -> Pattern:
    x = Var("x")
    u = scalar("div", x, name="u") | scalar("mul", x, name="u")
    erf = op.erf(u, name="erf")
    bracket = scalar("add", erf, name="one")
    half_x = scalar("mul", x, name="half")
    return (op.mul(half_x, bracket, name="prod")
            | scalar("mul", op.mul(x, bracket, name="prod"), name="half")
            | op.mul(x, scalar("mul", bracket, name="half"), name="prod")
            | op.mul(x, scalar("add", scalar("mul", erf, name="half"), name="one"), name="prod"))


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * abs(b)


class GeluErf(Rule):
    name = "gelu_erf"
    family = "gelu"
    benefit = 50
    description = "0.5·x·(1+erf(x/√2)) written out → LeakyReLU(act_type='gelu')"

    def pattern(self) -> Pattern:
        return gelu_erf_pattern()

    def check(self, m: Match) -> Optional[str]:
        u = m.node("u")
        c = float(u.attrs["scalar"])
        if not _close(c, SQRT2 if u.op.lower().startswith("_div") else 1 / SQRT2):
            return "erf argument is x·%g, not x/√2" % (c if "mul" in u.op.lower() else 1 / c)
        one, half = float(m.node("one").attrs["scalar"]), float(m.node("half").attrs["scalar"])
        split = m.node("half").inputs[0].node is m.node("erf")        # 0.5 + 0.5·erf form
        if not _close(half, 0.5) or not _close(one, 0.5 if split else 1.0):
            return "constants %g and %g do not make 0.5·(1+erf)" % (half, one)
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        return b.op("LeakyReLU", [m["x"]], attrs={"act_type": "gelu"}, name=m.anchor.name)


RULES: List[Rule] = [GeluErf()]
