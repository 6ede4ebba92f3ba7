r"""Un-fusing: every ``fused_*`` op back into stock MXNet ops (``fusion.unfuse``, ``mxfuse --unfuse``).

A fused model then loads where mxnet-fusion is not installed.  Parameter
transforms stay applied (folded convolutions remain folded); parameters keep
their names, so the fused model's params file goes with the un-fused symbol.

=========================  ==========================================================
fused op                   stock ops
=========================  ==========================================================
fused_dense                FullyConnected [→ Activation | LeakyReLU | tanh-GELU ops]
fused_add_layer_norm       broadcast_add → LayerNorm (the sum is the 2nd output)
fused_elemwise             the program's ops (broadcast_*, scalar ops, where on broadcast_like'd operands)
fused_attention            head split (Reshape/transpose/slice_axis) → batch_dot(q, k, transpose_b) ·scale
                           [+ mask | where] → softmax [use_length] → batch_dot(·, v) → head merge
=========================  ==========================================================
"""
from __future__ import annotations

import re
from typing import List

from fusion.errors import FusionError
from fusion.graph import Entry
from fusion.matcher import Match
from fusion.pattern import Pattern, Var, op
from fusion.rewrite import Builder
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


# ---------------------------------------------------------------- fused_dense

def _activation(b: Builder, x: Entry, act: str, slope: float, name: str) -> Entry:
    if act in ("none", "", None):
        return x
    if act in ("relu", "sigmoid", "tanh", "softrelu"):
        return b.op("Activation", [x], attrs={"act_type": act}, name=name)
    if act == "leaky":
        return b.op("LeakyReLU", [x], attrs={"act_type": "leaky", "slope": slope}, name=name)
    if act == "gelu_erf":
        return b.op("LeakyReLU", [x], attrs={"act_type": "gelu"}, name=name)
    if act == "gelu_tanh":
        return ElemwiseProgram(b, [x], name).build(
            "mul(mul(x0, 0.5), add(tanh(mul(add(x0, mul(mul(mul(x0, x0), x0), 0.044715)), 0.7978845608028654)), 1))")
    raise FusionError("fused_dense activation %r has no stock equivalent" % act)


class UnfuseDense(_Unfuse):
    def __init__(self):
        super().__init__("fused_dense", 3)

    def rewrite(self, m: Match, b: Builder) -> Entry:
        f = m.node("f")
        ins = self.inputs(m)
        no_bias = bool(f.param("no_bias", False))
        attrs = {"num_hidden": int(f.attrs["num_hidden"]), "flatten": bool(f.param("flatten", True)),
                 "no_bias": no_bias}
        fc = b.op("FullyConnected", ins[:2] if no_bias else ins[:3], attrs=attrs, name=f.name + "_fc")
        return _activation(b, fc, f.attrs.get("act", "none"), float(f.param("slope", 0.25)), f.name)


# ---------------------------------------------------------------- fused_add_layer_norm

class UnfuseAddLayerNorm(_Unfuse):
    def __init__(self):
        super().__init__("fused_add_layer_norm", 4)

    def rewrite(self, m: Match, b: Builder):
        f = m.node("f")
        a, bb, g, be = self.inputs(m)
        s = b.op("broadcast_add", [a, bb], name=f.name + "_sum")
        y = b.op("LayerNorm", [s, g, be], attrs={"axis": -1, "eps": float(f.param("eps", 1e-5))}, name=f.name)
        if f.param("output_sum", False):
            return {Entry(f, 0): y, Entry(f, 1): s}
        return y


# ---------------------------------------------------------------- fused_elemwise

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


# ---------------------------------------------------------------- fused_attention

class UnfuseAttention(_Unfuse):
    def __init__(self):
        super().__init__("fused_attention", 4)

    def _split(self, b: Builder, x: Entry, heads: int, rank: int) -> Entry:
        """(B, S, H·D) → (B·H, S, D), or (B, H, S, D) when the mask is given per (B, H, Sq, Sk)."""
        t = b.op("Reshape", [x], attrs={"shape": (0, 0, heads, -1)})
        t = b.op("transpose", [t], attrs={"axes": (0, 2, 1, 3)})
        return b.op("Reshape", [t], attrs={"shape": (-3, 0, 0)}) if rank == 3 else t

    def _merge(self, b: Builder, o: Entry, heads: int, name: str, rank: int) -> Entry:
        t = b.op("Reshape", [o], attrs={"shape": (-4, -1, heads, 0, 0)}) if rank == 3 else o
        t = b.op("transpose", [t], attrs={"axes": (0, 2, 1, 3)})
        return b.op("Reshape", [t], attrs={"shape": (0, 0, -3)}, name=name)

    def _interleaved(self, b: Builder, x: Entry, heads: int, parts: int, index: int) -> Entry:
        """(S, B, H·parts·D) → part ``index`` as (B·H, S, D), as MXNet's interleaved ops read it."""
        t = b.op("Reshape", [x], attrs={"shape": (0, 0, heads, parts, -1)})
        t = b.op("slice_axis", [t], attrs={"axis": 3, "begin": index, "end": index + 1})
        t = b.op("Reshape", [t], attrs={"shape": (0, 0, 0, -1)})                     # (S, B, H, D)
        t = b.op("transpose", [t], attrs={"axes": (1, 2, 0, 3)})                       # (B, H, S, D)
        return b.op("Reshape", [t], attrs={"shape": (-3, 0, 0)})

    def rewrite(self, m: Match, b: Builder) -> Entry:
        f = m.node("f")
        ins = self.inputs(m)
        layout = f.param("layout", "plain")
        heads = int(f.param("heads", 1))
        mask_kind = f.param("mask_kind", "none")
        if f.param("causal", False):
            raise FusionError("causal fused_attention has no stock form here")
        data = {"plain": 3, "bshd": 3, "packed_qkv": 1, "interleaved": 1, "interleaved_encdec": 2}[layout]
        mask = ins[data] if mask_kind != "none" else None
        rank = 3
        if layout in ("bshd", "packed_qkv") and mask_kind in ("additive", "boolean"):
            # the kernel reads a rank-4 mask per (B, H, Sq, Sk) and a lower-rank one per (B·H, Sq, Sk)
            shape = m.ctx.shape(mask)
            if shape is None:
                raise FusionError("the rank of mask '%s' of %s is unknown: pass input shapes to unfuse"
                                  % (mask.node.name, f.name))
            rank = 4 if len(shape) == 4 else 3
        if layout == "plain":
            q, k, v = ins[:3]
        elif layout == "bshd":
            q, k, v = (self._split(b, x, heads, rank) for x in ins[:3])
        elif layout == "packed_qkv":
            parts = b.op("split", [ins[0]], attrs={"num_outputs": 3, "axis": -1}, num_outputs=3)
            q, k, v = (self._split(b, p, heads, rank) for p in parts)
        elif layout == "interleaved":
            q, k, v = (self._interleaved(b, ins[0], heads, 3, i) for i in range(3))
        else:
            q = self._interleaved(b, ins[0], heads, 1, 0)
            k, v = (self._interleaved(b, ins[1], heads, 2, i) for i in range(2))
        s = b.op("batch_dot", [q, k], attrs={"transpose_b": True})
        s = b.op("_mul_scalar", [s], attrs={"scalar": float(f.attrs["scale"])})
        softmax_in, extra = [s], {"axis": -1}
        if mask_kind == "additive":
            softmax_in = [b.op("broadcast_add", [s, mask])]
        elif mask_kind == "boolean":
            fill = b.op("_mul_scalar", [b.op("ones_like", [s])], attrs={"scalar": float(f.param("mask_value", -1e18))})
            softmax_in = [b.op("where", [b.op("broadcast_like", [mask, s]), s, fill])]
        elif mask_kind == "valid_length":
            softmax_in, extra = [s, mask], {"axis": -1, "use_length": True}
        p = b.op("softmax", softmax_in, attrs=extra)
        o = b.op("batch_dot", [p, v], name=f.name if layout == "plain" else None)
        if layout in ("plain",):
            return o
        if layout in ("bshd", "packed_qkv"):
            return self._merge(b, o, heads, f.name, rank)
        t = b.op("Reshape", [o], attrs={"shape": (-4, -1, heads, 0, 0)})               # (B, H, S, D)
        t = b.op("transpose", [t], attrs={"axes": (2, 0, 1, 3)})                         # (S, B, H, D)
        return b.op("Reshape", [t], attrs={"shape": (0, 0, -3)}, name=f.name)


RULES: List[Rule] = [UnfuseDense(), UnfuseAddLayerNorm(), UnfuseElemwise(), UnfuseAttention()]
