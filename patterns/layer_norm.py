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
(mean, biased variance, ``1/√(σ²+ε)``).  ``broadcast_mul``/``broadcast_add`` align
trailing axes, so γ and β act along axis ``a`` only when their shape, padded on the
left with 1s to x's rank, is 1 everywhere but at ``a`` where it is ``C = x.shape[a]``
(a 1-D γ over the last axis always is; anything else is decided from x's shape at
every probe shape, and refused when x's shape is unknown).  A γ/β of another shape
than ``(C,)`` is passed through ``Reshape`` (so it keeps its gradient in training);
an absent one becomes ``ones_like``/``zeros_like`` of ``arange_like(x, axis=a)`` (C values
whatever C is at run time).  No parameter is added.
"""
from __future__ import annotations

from typing import List, Optional


from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.ir.pattern import Const, Pattern, Var, op, scalar
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule


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


def reduced_axis(node) -> Optional[int]:
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
        axes = {n: reduced_axis(m.node(n)) for n in ("mean", "var") + (("mean_var",) if m.has("mean_var") else ())}
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
        plan = _affine_plan(m)
        return plan if isinstance(plan, str) else None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        axis = reduced_axis(m.node("mean"))
        eps = _scalar_value(m, "eps", "eps_value")
        c, shapes = _affine_plan(m)
        params = []
        positions = None
        for name, fill in (("gamma", "ones_like"), ("beta", "zeros_like")):
            if not m.has(name):
                # ones/zeros with one value per element of the normalized axis, whatever its size
                if positions is None:
                    positions = b.op("_contrib_arange_like", [m["x"]], attrs={"axis": axis},
                                     name=m.anchor.name + "_positions")
                params.append(b.op(fill, [positions], name=m.anchor.name + "_" + name))
            elif shapes[name] == (c,):
                params.append(m[name])
            else:   # the same values as (C,): a view computed in the graph, so a trained γ/β keeps its gradient
                params.append(b.op("Reshape", [m[name]], attrs={"shape": (c,)}, name=m.node(name).name + "_flat"))
        return b.op("LayerNorm", [m["x"]] + params, attrs={"axis": axis, "eps": eps}, name=m.anchor.name)


def _affine_plan(m: Match):
    """(C, {"gamma"/"beta": shape}) when γ and β scale and shift along the normalized axis alone, else
    the reason they do not.

    ``broadcast_mul``/``broadcast_add`` align trailing axes (NumPy-style): a γ of shape ``g``
    acts per element of axis ``a`` of an ``r``-dimensional x iff ``g``, padded on the left
    with 1s to rank ``r``, is 1 everywhere but at ``a``, where it is ``C = x.shape[a]``, and
    the result keeps x's shape.  With ``a`` the last axis and a 1-D γ this holds for every
    shape of x; otherwise it is decided from x's shape at every probe.
    """
    axis = reduced_axis(m.node("mean"))
    shapes = {}
    for name in ("gamma", "beta"):
        if m.has(name):
            shape = m.ctx.shape(m[name])
            if shape is None:
                v = m.value(name)
                if v is None:
                    return "needs the value or shape of '%s' to check it holds one value per channel" % m.node(name).name
                shape = v.shape
            shapes[name] = tuple(shape)
    xs = m.ctx.shapes(m["x"])
    if not xs:
        if axis != -1 or any(len(s) != 1 for s in shapes.values()):
            return "the shape of '%s' is unknown (pass input shapes): cannot tell γ/β's axis" % m["x"].node.name
        if not shapes:
            return None, {}         # ones/zeros follow x at run time
        sizes = {s[0] for s in shapes.values()}
        return (sizes.pop(), shapes) if len(sizes) == 1 else "γ and β have different sizes %s" % sorted(sizes)
    channels = set()
    for x_shape in xs:
        r = len(x_shape)
        if not -r <= axis < r:
            return "axis %d is out of range for '%s' of rank %d" % (axis, m["x"].node.name, r)
        a = axis % r
        channels.add(x_shape[a])
        for name, g in shapes.items():
            if len(g) > r:
                return "'%s' of shape %s has more axes than '%s' %s" % (m.node(name).name, g, m["x"].node.name, x_shape)
            padded = (1,) * (r - len(g)) + g
            if any(d != 1 for i, d in enumerate(padded) if i != a) or padded[a] != x_shape[a]:
                return ("'%s' of shape %s does not act along axis %d of %s (MXNet broadcasts it along the "
                        "trailing axes)" % (m.node(name).name, g, axis, x_shape))
    if len(channels) != 1 and shapes:
        return "the normalized axis changes size with the input (%s): γ/β cannot be fixed" % sorted(channels)
    return (channels.pop() if len(channels) == 1 else None), shapes


RULES: List[Rule] = [DecomposedLayerNorm()]
