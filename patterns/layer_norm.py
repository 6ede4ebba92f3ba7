r"""LayerNorm written out with elementwise ops (hand-written models, ONNX imports) → MXNet's ``LayerNorm``.

Matched subgraph (any of the spellings on each line)::

    μ  = mean(x, axis=a, keepdims=True)
    d  = x − μ                                   elemwise_sub | broadcast_sub | _minus
    s  = d² | d·d | d ** 2 | power(d, 2)         square | mul | _power_scalar | broadcast_power(d, Const 2)
    σ² = mean(s, axis=a, keepdims=True)          (d may be a second x − μ node)
    v  = σ² + ε                                  _plus_scalar | add(σ², Const ε)
    n  = d / sqrt(v) | d · rsqrt(v)
    y  = n [· γ] [+ β]                           mul / add with parameters, either operand order

Rewrite: ``y = LayerNorm(x, γ, β, axis=a, eps=ε)`` — the same arithmetic in one op
(mean, biased variance, ``1/√(σ²+ε)``).  γ and β must be parameters holding one
value per element of axis ``a`` (any shape of that size; they are reshaped to
``(C,)`` under a new name when needed); an absent γ/β becomes ones/zeros.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from fusion.graph import Entry
from fusion.matcher import Match
from fusion.pattern import Const, Pattern, Var, op, scalar
from fusion.rewrite import Builder
from fusion.rule import Rule


def _centered(x: Pattern, name: str, mean_name: str) -> Pattern:
    return op.sub(x, op.mean(x, name=mean_name), name=name)


def layer_norm_pattern() -> Pattern:
    x = Var("x")
    d = _centered(x, "d", "mean")
    dv = _centered(x, "d", "mean") | _centered(x, "d_var", "mean") | _centered(x, "d_var", "mean_var")
    square = (op.square(dv, name="sq") | op.mul(dv, dv, name="sq") | scalar("pow", dv, name="sq")
              | op.broadcast_power(dv, Const("two"), name="sq"))
    var = op.mean(square, name="var")
    v = scalar("add", var, name="eps") | op.add(var, Const("eps_value"), name="eps")
    norm = op.div(d, op.sqrt(v, name="root"), name="norm") | op.mul(d, op.rsqrt(v, name="root"), name="norm")
    scaled = norm.optional(lambda n: op.mul(n, Const("gamma"), name="scale"))
    return scaled.optional(lambda s: op.add(s, Const("beta"), name="shift"))


def _axis(node) -> Optional[int]:
    axis = node.param("axis", None)
    if isinstance(axis, tuple):
        axis = axis[0] if len(axis) == 1 else None
    return axis if isinstance(axis, int) and not node.param("exclude", False) else None


def _scalar_value(m: Match, node_name: str, const_name: str) -> Optional[float]:
    node = m.node(node_name)
    if "scalar" in node.attrs:
        return float(node.attrs["scalar"])
    v = m.value(const_name)
    return float(v.ravel()[0]) if v is not None and v.size == 1 else None


class DecomposedLayerNorm(Rule):
    name = "layer_norm"
    family = "layer_norm"
    benefit = 60
    description = "LayerNorm written out (mean, subtract, square, mean, +eps, rsqrt, ×γ, +β) → LayerNorm"

    def pattern(self) -> Pattern:
        return layer_norm_pattern()

    def check(self, m: Match) -> Optional[str]:
        axes = {n: _axis(m.node(n)) for n in ("mean", "var") + (("mean_var",) if m.has("mean_var") else ())}
        if None in axes.values():
            return "the means must reduce one axis (axis=%s)" % ", ".join("%r" % m.node(n).param("axis", None) for n in axes)
        if len(set(axes.values())) != 1:
            return "mean and variance reduce different axes %s" % sorted(set(axes.values()))
        for n in axes:
            if not m.node(n).param("keepdims", False):
                return "mean '%s' does not keep dims, so x − μ does not normalize along its axis" % m.node(n).name
        sq = m.node("sq")
        if sq.op in ("_power_scalar", "_PowerScalar") and float(sq.attrs["scalar"]) != 2.0:
            return "power %g is not a square" % float(sq.attrs["scalar"])
        if sq.op == "broadcast_power":
            two = m.value("two")
            if two is None or two.size != 1 or float(two.ravel()[0]) != 2.0:
                return "power exponent is not the constant 2"
        eps = _scalar_value(m, "eps", "eps_value")
        if eps is None or not eps > 0:
            return "ε must be a positive constant (found %r)" % eps
        sizes = []
        for name in ("gamma", "beta"):
            if m.has(name):
                v = m.value(name)
                if v is None:
                    return "needs the value of '%s' to check it holds one value per channel" % m.node(name).name
                if v.size != max(v.shape or (1,)):
                    return "'%s' has shape %s, not one value per channel" % (m.node(name).name, v.shape)
                sizes.append(v.size)
        if not sizes:
            return "no γ or β: the channel count is unknown, so LayerNorm's γ/β cannot be made"
        if len(set(sizes)) > 1:
            return "γ and β have different sizes %s" % sizes
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        axis = _axis(m.node("mean"))
        eps = _scalar_value(m, "eps", "eps_value")
        c = (m.value("gamma") if m.has("gamma") else m.value("beta")).size
        params = []
        for name, fill in (("gamma", 1.0), ("beta", 0.0)):
            if m.has(name) and m.value(name).shape == (c,):
                params.append(m[name])
            elif m.has(name):
                params.append(b.param(m.node(name).name + "_flat", m.value(name).reshape(c)))
            else:
                dtype = (m.value("gamma") if m.has("gamma") else m.value("beta")).dtype
                params.append(b.param(m.anchor.name + "_" + name, np.full(c, fill, dtype=dtype)))
        return b.op("LayerNorm", [m["x"]] + params, attrs={"axis": axis, "eps": eps}, name=m.anchor.name)


RULES: List[Rule] = [DecomposedLayerNorm()]
