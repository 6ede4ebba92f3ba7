r"""Maximal regions of elementwise, broadcast and scalar ops → one ``fused_elemwise``.

Matched: a connected region of the ops below, grown backwards from its output
over producers whose values are used only inside the region (TVM FuseOps-style:
no interior value escapes, so no cycle can form), at least two ops, at most 32
ops and 8 distinct inputs::

    add sub mul div power maximum minimum (elemwise_*, broadcast_*, _plus, …)
    scalar forms (_plus_scalar, _rminus_scalar, _rdiv_scalar, _power_scalar, …, comparisons)
    negative abs exp log sqrt rsqrt square reciprocal tanh sigmoid relu erf clip where
    Activation(relu|sigmoid|tanh)  LeakyReLU(leaky|gelu)  hard_sigmoid
    broadcast comparisons (greater, lesser_equal, …)
    BatchNorm (inference, with params): y = x·s + t, s = γ/√(σ²+ε), t = β − μ·s
    Dropout (inference: identity)     fused_elemwise (its program is inlined)

An op reading a value that is not float32 — an input declared with another dtype, a
``Cast`` to one, ``shape_array`` and the like — stays out: the fused op computes in float32.

Rewrite: ``y = fused_elemwise(x0, …, xk, expr=…)`` whose program is the region's
expression over its inputs (constants written with all their digits), evaluated in
one pass with NumPy broadcasting — e.g. hard-swish ``x·clip(x+3, 0, 6)/6`` becomes
``div(mul(x0, clip(add(x0, 3.0), 0.0, 6.0)), 6.0)``.  The output shape is the
broadcast of the inputs, as for the chain of broadcast ops it replaces.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional

import numpy as np

from fusion.graph import Entry, Node
from fusion.matcher import Match
from fusion.pattern import Pattern, Region
from fusion.rewrite import Builder
from fusion.rule import Rule

from ._dtypes import not_float32 as _not_float32


def _c(v) -> str:
    return repr(float(v))


def _binary(fn: str) -> Callable:
    return lambda n, a: "%s(%s, %s)" % (fn, a[0], a[1])


def _unary(fn: str) -> Callable:
    return lambda n, a: "%s(%s)" % (fn, a[0])


def _scalar(fn: str, reverse: bool = False) -> Callable:
    if reverse:
        return lambda n, a: "%s(%s, %s)" % (fn, _c(n.attrs["scalar"]), a[0])
    return lambda n, a: "%s(%s, %s)" % (fn, a[0], _c(n.attrs["scalar"]))


def _gelu(x: str) -> str:
    return "mul(mul(%s, 0.5), add(erf(mul(%s, 0.7071067811865476)), 1.0))" % (x, x)


EXPR: Dict[str, Callable] = {}
for _names, _fn in (
        (("elemwise_add", "broadcast_add", "broadcast_plus", "_add", "_plus", "_Plus"), _binary("add")),
        (("elemwise_sub", "broadcast_sub", "broadcast_minus", "_sub", "_minus", "_Minus"), _binary("sub")),
        (("elemwise_mul", "broadcast_mul", "_mul", "_Mul"), _binary("mul")),
        (("elemwise_div", "broadcast_div", "_div", "_Div"), _binary("div")),
        (("broadcast_power", "_power", "_Power"), _binary("pow")),
        (("broadcast_maximum", "_maximum", "_Maximum"), _binary("max")),
        (("broadcast_minimum", "_minimum", "_Minimum"), _binary("min")),
        (("broadcast_greater", "_greater"), _binary("gt")),
        (("broadcast_greater_equal", "_greater_equal"), _binary("ge")),
        (("broadcast_lesser", "_lesser"), _binary("lt")),
        (("broadcast_lesser_equal", "_lesser_equal"), _binary("le")),
        (("broadcast_equal", "_equal"), _binary("eq")),
        (("broadcast_not_equal", "_not_equal"), _binary("ne")),
        (("_plus_scalar", "_PlusScalar"), _scalar("add")),
        (("_minus_scalar", "_MinusScalar"), _scalar("sub")),
        (("_rminus_scalar", "_RMinusScalar"), _scalar("sub", True)),
        (("_mul_scalar", "_MulScalar"), _scalar("mul")),
        (("_div_scalar", "_DivScalar"), _scalar("div")),
        (("_rdiv_scalar", "_RDivScalar"), _scalar("div", True)),
        (("_power_scalar", "_PowerScalar"), _scalar("pow")),
        (("_rpower_scalar", "_RPowerScalar"), _scalar("pow", True)),
        (("_maximum_scalar", "_MaximumScalar"), _scalar("max")),
        (("_minimum_scalar", "_MinimumScalar"), _scalar("min")),
        (("_greater_scalar",), _scalar("gt")), (("_greater_equal_scalar",), _scalar("ge")),
        (("_lesser_scalar",), _scalar("lt")), (("_lesser_equal_scalar",), _scalar("le")),
        (("_equal_scalar",), _scalar("eq")), (("_not_equal_scalar",), _scalar("ne")),
        (("negative",), _unary("neg")), (("abs",), _unary("abs")), (("exp",), _unary("exp")),
        (("log",), _unary("log")), (("sqrt",), _unary("sqrt")), (("rsqrt",), _unary("rsqrt")),
        (("square",), _unary("square")), (("tanh",), _unary("tanh")), (("sigmoid",), _unary("sigmoid")),
        (("relu",), _unary("relu")), (("erf",), _unary("erf")),
):
    for _name in _names:
        EXPR[_name] = _fn
EXPR["reciprocal"] = lambda n, a: "div(1.0, %s)" % a[0]
EXPR["clip"] = lambda n, a: "clip(%s, %s, %s)" % (a[0], _c(n.attrs["a_min"]), _c(n.attrs["a_max"]))
EXPR["where"] = lambda n, a: "where(%s, %s, %s)" % (a[0], a[1], a[2])
EXPR["Activation"] = lambda n, a: "%s(%s)" % (n.attrs["act_type"], a[0])
EXPR["hard_sigmoid"] = lambda n, a: "clip(add(mul(%s, %s), %s), 0.0, 1.0)" % (
    a[0], _c(n.param("alpha", 0.2)), _c(n.param("beta", 0.5)))
EXPR["LeakyReLU"] = lambda n, a: (_gelu(a[0]) if n.param("act_type") == "gelu" else
                                  "where(gt(%s, 0.0), %s, mul(%s, %s))" % (a[0], a[0], a[0], _c(n.param("slope"))))
EXPR["Dropout"] = lambda n, a: a[0]
EXPR["_copy"] = lambda n, a: a[0]
EXPR["identity"] = lambda n, a: a[0]
EXPR["fused_elemwise"] = lambda n, a: re.sub(r"\bx(\d+)\b", lambda t: a[int(t.group(1))], n.attrs["expr"])


def _batchnorm_scale_shift(node: Node, ctx) -> Optional[tuple]:
    """(scale, shift, axis, rank) of an inference BatchNorm with known params, else None."""
    if len(node.inputs) != 5 or ctx.mode != "inference" or node.param("output_mean_var"):
        return None
    vals = [ctx.value(e) for e in node.inputs[1:]]
    if any(v is None for v in vals[1:]) or (vals[0] is None and not node.param("fix_gamma")):
        return None
    shape = ctx.shape(node.inputs[0])
    if shape is None:
        return None
    gamma, beta, mean, var = (v.astype(np.float64).ravel() if v is not None else None for v in vals)
    if gamma is None or node.param("fix_gamma"):
        gamma = np.ones_like(beta)
    if np.any(var + node.param("eps") <= 0):
        return None
    scale = gamma / np.sqrt(var + node.param("eps"))
    axis = node.param("axis") % len(shape)
    return scale, beta - mean * scale, axis, len(shape)


_CONV = ("Convolution", "Deconvolution", "FullyConnected")
_TAIL = ("Activation", "LeakyReLU", "clip", "relu", "sigmoid", "tanh",
         "elemwise_add", "broadcast_add", "broadcast_plus", "_plus", "_Plus", "_add")


def _conv_tail(node: Node, depth: int = 3) -> bool:
    """Whether ``node`` is in the activation / residual-add tail of a convolution (or dense layer).

    MXNet's oneDNN backend fuses Convolution with its activation, its residual add
    and the activation after it into one kernel (FullyConnected with its activation);
    taking those ops into a fused_elemwise would undo that, so they are left to it.
    """
    if depth == 0 or node.op not in _TAIL:
        return False
    return any(e.node.op in _CONV or _conv_tail(e.node, depth - 1) for e in node.inputs)


def why_not(node: Node, ctx) -> Optional[str]:
    """The reportable reasons an elementwise op stays out of every region."""
    if _conv_tail(node):
        return ("%s '%s' is in the tail of a convolution or dense layer: left to MXNet's oneDNN "
                "backend, which fuses it there" % (node.op, node.name))
    bad = next((e for e in node.inputs if _not_float32(e, ctx)), None)
    if bad is not None:
        return ("%s '%s' reads '%s', which is not float32: fused_elemwise computes in float32"
                % (node.op, node.name, bad.node.name))
    return None


def member(node: Node, ctx) -> bool:
    if _conv_tail(node):
        return False
    if any(_not_float32(e, ctx) for e in node.inputs):
        return False
    if node.op == "Activation":
        return node.attrs.get("act_type") in ("relu", "sigmoid", "tanh")
    if node.op == "LeakyReLU":
        return node.param("act_type") in ("leaky", "gelu") and len(node.inputs) == 1
    if node.op == "Dropout":
        return ctx.mode == "inference"
    if node.op == "BatchNorm":
        return _batchnorm_scale_shift(node, ctx) is not None
    if node.op == "fused_elemwise":
        return True
    return node.op in EXPR and (node.op != "where" or len(node.inputs) == 3)


class Elementwise(Rule):
    name = "elementwise"
    family = "elementwise"
    benefit = 10
    description = "maximal regions of elementwise/broadcast/scalar ops → one fused_elemwise pass"

    def pattern(self) -> Pattern:
        return Region(member, "region", ops=set(EXPR) | {"BatchNorm"}, why_not=why_not)

    def check(self, m: Match) -> Optional[str]:
        region = m["region"]
        if all(n.op in ("Dropout", "_copy", "identity") for n in region):
            return "only identity ops"
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        region = m["region"]
        inside = {id(n): n for n in region}
        inputs: List[Entry] = []
        slots: Dict[Entry, str] = {}

        def arg(e: Entry) -> str:
            if id(e.node) in inside:
                return exprs[id(e.node)]
            if e not in slots:
                slots[e] = "x%d" % len(inputs)
                inputs.append(e)
            return slots[e]

        exprs: Dict[int, str] = {}
        for n in region:                              # topological order
            if n.op == "BatchNorm":
                scale, shift, axis, rank = _batchnorm_scale_shift(n, m.ctx)
                bshape = [1] * rank
                bshape[axis] = -1
                s = b.param(n.name + "_scale", scale.reshape(bshape).astype(np.float32))
                t = b.param(n.name + "_shift", shift.reshape(bshape).astype(np.float32))
                exprs[id(n)] = "add(mul(%s, %s), %s)" % (arg(n.inputs[0]), arg(s), arg(t))
            else:
                exprs[id(n)] = EXPR[n.op](n, [arg(e) for e in n.inputs])
        return b.op("fused_elemwise", inputs, attrs={"expr": exprs[id(region[-1])], "num_args": len(inputs)},
                    name=m.anchor.name)


RULES: List[Rule] = [Elementwise()]
