"""Building blocks shared by the families: every spelling of add/mul/scale, activations, GELU forms.

Each helper draws its spelling from the Builder's Draw, the canonical/simplest form first.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import mxnet as mx

S = mx.sym
I = mx.sym._internal

SQRT2 = math.sqrt(2.0)
TANH_K = math.sqrt(2.0 / math.pi)
TANH_A = 0.044715


# ---------------------------------------------------------------------------- binary ops
def without_regions_sometimes(b, p: float = 0.4) -> None:
    """Now and then a CNN graph is fused without regions (``rules=["default", "-region"]``), so that
    the block rules a region stands in for are exercised too.  Drawn last, after the graph: a seed gives
    the graph it gave before."""
    if b.d.maybe(p, label="without regions"):
        b.flag("no_regions")


def add(b, x, y, same_shape: bool = False, label: str = "add"):
    """x + y in one of MXNet's spellings (elemwise forms only when the shapes are equal), either order."""
    forms = ["broadcast_add"] + (["elemwise_add", "operator"] if same_shape else [])
    f = b.d.choice(forms, label=label + " spelling")
    if b.d.maybe(0.5, label=label + " swap"):
        x, y = y, x
    if f == "broadcast_add":
        return S.broadcast_add(x, y)
    if f == "elemwise_add":
        return S.elemwise_add(x, y)
    return x + y


def mul(b, x, y, same_shape: bool = False, label: str = "mul"):
    forms = ["broadcast_mul"] + (["elemwise_mul", "operator"] if same_shape else [])
    f = b.d.choice(forms, label=label + " spelling")
    if b.d.maybe(0.5, label=label + " swap"):
        x, y = y, x
    if f == "broadcast_mul":
        return S.broadcast_mul(x, y)
    if f == "elemwise_mul":
        return S.elemwise_mul(x, y)
    return x * y


def sub(b, x, y, same_shape: bool = False, label: str = "sub"):
    f = b.d.choice(["broadcast_sub"] + (["elemwise_sub", "operator"] if same_shape else []), label=label)
    if f == "broadcast_sub":
        return S.broadcast_sub(x, y)
    if f == "elemwise_sub":
        return S.elemwise_sub(x, y)
    return x - y


def div(b, x, y, same_shape: bool = False, label: str = "div"):
    f = b.d.choice(["broadcast_div"] + (["elemwise_div", "operator"] if same_shape else []), label=label)
    if f == "broadcast_div":
        return S.broadcast_div(x, y)
    if f == "elemwise_div":
        return S.elemwise_div(x, y)
    return x / y


def scale(b, x, c: float, allow_param: bool = True, label: str = "scale"):
    """x·c as _mul_scalar / _div_scalar(1/c) / an operator / broadcast_mul|div by a 1-element parameter."""
    forms = ["mul_scalar", "div_scalar", "operator_mul", "operator_rmul", "operator_div"]
    if allow_param:
        forms += ["param_mul", "param_div"]
    f = b.d.choice(forms, label=label)
    if f == "mul_scalar":
        return I._mul_scalar(x, scalar=c)
    if f == "div_scalar":
        return I._div_scalar(x, scalar=1.0 / c)
    if f == "operator_mul":
        return x * c
    if f == "operator_rmul":
        return c * x
    if f == "operator_div":
        return x / (1.0 / c)
    shape = b.d.choice([(1,), (1, 1), (1, 1, 1)], label=label + " param shape")
    if f == "param_mul":
        return S.broadcast_mul(x, b.param("temp", shape, value=[c]))
    return S.broadcast_div(x, b.param("temp", shape, value=[1.0 / c]))


# ---------------------------------------------------------------------------- activations
PLAIN_ACTS = ("relu", "sigmoid", "tanh", "softrelu", "softsign")


def gelu_erf(b, x, wrong: bool = False, label: str = "gelu_erf"):
    """0.5·x·(1 + erf(x/√2)) in the four arrangements the rule knows, or a near-variant with a wrong constant."""
    u_c, half, one = SQRT2, 0.5, 1.0
    if wrong:
        which = b.d.choice(["u", "half", "one"], label=label + " wrong")
        if which == "u":
            u_c = b.d.choice([1.41, 2.0, 1.0], label=label + " u")
        elif which == "half":
            half = b.d.choice([0.49, 1.0], label=label + " half")
        else:
            one = b.d.choice([1.01, 2.0], label=label + " one")
    u = I._div_scalar(x, scalar=u_c) if b.d.maybe(0.5, label=label + " u form") else I._mul_scalar(x, scalar=1.0 / u_c)
    e = S.erf(u)
    form = b.d.choice([1, 2, 3, 4], label=label + " arrangement")
    if form == 1:
        return mul(b, I._mul_scalar(x, scalar=half), I._plus_scalar(e, scalar=one), same_shape=True, label=label)
    if form == 2:
        return I._mul_scalar(mul(b, x, I._plus_scalar(e, scalar=one), same_shape=True, label=label), scalar=half)
    if form == 3:
        return mul(b, x, I._mul_scalar(I._plus_scalar(e, scalar=one), scalar=half), same_shape=True, label=label)
    return mul(b, x, I._plus_scalar(I._mul_scalar(e, scalar=half), scalar=one * half), same_shape=True, label=label)


def gelu_tanh(b, x, wrong: bool = False, label: str = "gelu_tanh"):
    """0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³))), constants exact, printed short, or wrong."""
    k, a = TANH_K, TANH_A
    const = b.d.choice(["exact", "short", "wrong"] if wrong else ["exact", "short"], label=label + " constants")
    if const == "short":
        k, a = 0.79788, 0.0447
    elif const == "wrong":
        k, a = b.d.choice([(0.8, TANH_A), (TANH_K, 0.05), (1.0, 0.1)], label=label + " wrong")
    cube_form = b.d.choice(["power", "mul3", "square_mul", "power2"], label=label + " cube")
    if cube_form == "power":
        cube = I._power_scalar(x, scalar=3.0)
    elif cube_form == "power2":       # not a cube: must be refused
        cube = I._power_scalar(x, scalar=2.0)
    elif cube_form == "mul3":
        cube = (x * x) * x
    else:
        cube = S.square(x) * x
    inner = S.tanh(I._mul_scalar(x + I._mul_scalar(cube, scalar=a), scalar=k))
    form = b.d.choice([1, 2, 3, 4], label=label + " arrangement")
    if form == 1:
        return I._mul_scalar(x, scalar=0.5) * I._plus_scalar(inner, scalar=1.0)
    if form == 2:
        return I._mul_scalar(x * I._plus_scalar(inner, scalar=1.0), scalar=0.5)
    if form == 3:
        return x * I._mul_scalar(I._plus_scalar(inner, scalar=1.0), scalar=0.5)
    return x * I._plus_scalar(I._mul_scalar(inner, scalar=0.5), scalar=0.5)


def activation(b, x, channels: Optional[int] = None, kinds: Optional[Sequence[str]] = None, label: str = "act"):
    """An activation in any of the forms a rule may meet (and some it must refuse).

    ``channels``: size of axis 1 (for prelu's γ); None leaves prelu out.
    Returns (symbol, kind).
    """
    all_kinds = ["Activation", "op", "leaky", "gelu", "elu", "selu", "prelu", "rrelu", "clip", "hard_sigmoid",
                 "gelu_erf", "gelu_erf_wrong", "gelu_tanh", "gelu_tanh_wrong", "swish"]
    weights = [6, 3, 2, 2, 1, 1, 1, 1, 1, 1, 3, 1, 2, 1, 1]
    if kinds is not None:
        pairs = [(k, w) for k, w in zip(all_kinds, weights) if k in kinds]
        all_kinds, weights = [p[0] for p in pairs], [p[1] for p in pairs]
    if channels is None and "prelu" in all_kinds:
        i = all_kinds.index("prelu")
        del all_kinds[i], weights[i]
    kind = b.d.choice(all_kinds, weights, label=label)
    if kind == "Activation":
        t = b.d.choice(PLAIN_ACTS, [4, 3, 3, 2, 1], label=label + " act_type")
        return S.Activation(x, act_type=t), "Activation:" + t
    if kind == "op":
        t = b.d.choice(["relu", "sigmoid", "tanh", "softsign"], label=label + " op")
        return getattr(S, t)(x), t
    if kind == "leaky":
        slope = b.d.choice([0.25, 0.01, 0.1, 1.0, -0.5], label=label + " slope")
        if b.d.maybe(0.3, label=label + " default slope"):
            return S.LeakyReLU(x), "leaky"
        return S.LeakyReLU(x, act_type="leaky", slope=slope), "leaky"
    if kind in ("gelu", "elu", "selu"):
        return S.LeakyReLU(x, act_type=kind), kind
    if kind == "prelu":
        shape = b.d.choice([(channels,), (1,)], label=label + " prelu gamma")
        return S.LeakyReLU(x, b.param("prelu_gamma", shape, kind="small"), act_type="prelu"), "prelu"
    if kind == "rrelu":
        b.flag("no_train")       # random in training, and MXNet 1.9.1 crashes in its backward here
        return S.LeakyReLU(x, act_type="rrelu")[0], "rrelu"
    if kind == "clip":
        lo = b.d.choice([0.0, -1.0, -0.5], label=label + " clip lo")
        hi = lo + b.d.choice([6.0, 1.0, 0.5], label=label + " clip hi")
        return S.clip(x, a_min=lo, a_max=hi), "clip"
    if kind == "hard_sigmoid":
        if b.d.maybe(0.5, label=label + " hs defaults"):
            return S.hard_sigmoid(x, alpha=b.d.choice([0.2, 1 / 6.0], label=label + " hs alpha"), beta=0.5), "hard_sigmoid"
        return S.hard_sigmoid(x), "hard_sigmoid"
    if kind == "gelu_erf":
        return gelu_erf(b, x, label=label + " gelu"), kind
    if kind == "gelu_erf_wrong":
        return gelu_erf(b, x, wrong=True, label=label + " gelu"), kind
    if kind == "gelu_tanh":
        return gelu_tanh(b, x, label=label + " gelu"), kind
    if kind == "gelu_tanh_wrong":
        return gelu_tanh(b, x, wrong=True, label=label + " gelu"), kind
    return x * S.sigmoid(x), "swish"


def maybe_activation(b, x, p: float = 0.6, channels: Optional[int] = None, kinds=None, label: str = "act"):
    if b.d.maybe(p, label=label + "?"):
        return activation(b, x, channels, kinds, label)[0]
    return x


# ---------------------------------------------------------------------------- shapes
def broadcasts(b, full_tmpl, tmpl, same_shape: bool = False) -> bool:
    """Whether a value of ``tmpl`` broadcasts with one of ``full_tmpl`` (to the same shape, if ``same_shape``)."""
    import numpy as np

    a, c = b.shape(full_tmpl), b.shape(tmpl)
    try:
        out = np.broadcast_shapes(a, c)
    except ValueError:
        return False
    return out == a or not same_shape


def broadcast_shape_of(b, full: Tuple, label: str = "bshape", allow_scalar: bool = True):
    """A shape broadcastable to ``full`` (as a template: entries may be dim names): full, trailing, with 1s."""
    rank = len(full)
    kind = b.d.choice(["full", "ones_some", "trailing", "last", "scalar"] if allow_scalar
                      else ["full", "ones_some", "trailing", "last"], label=label)
    if kind == "full":
        return tuple(full)
    if kind == "trailing":
        k = b.d.int(1, rank, label=label + " keep")
        return tuple(full[rank - k:])
    if kind == "last":
        return (full[-1],)
    if kind == "scalar":
        return (1,)
    return tuple(1 if b.d.maybe(0.5, label=label + " one %d" % i) else f for i, f in enumerate(full))
