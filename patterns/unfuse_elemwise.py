"""``fused_elemwise`` → the stock ops of its program (see ``patterns/unfuse.py``).

Every program has a stock form that computes the same values, NaN, ±inf and ±0
included, at any input shapes the fused op accepts:

* each function becomes the MXNet op it is named after (``relu`` → ``relu``,
  ``act_relu`` → ``Activation(relu)``, ``gelu`` → ``LeakyReLU(gelu)``,
  ``clip``/``hard_sigmoid``/``leaky`` with constant parameters → ``clip`` /
  ``hard_sigmoid`` / ``LeakyReLU(leaky)``), binary functions → ``broadcast_*``
  (NumPy broadcasting, as the kernel's), a constant operand → the scalar op
  (``sub(2, x)`` → ``_rminus_scalar``; ``max(c, x)``, whose NaN and tie rules depend
  on the operand order, → ``broadcast_maximum`` of a filled tensor and x);
* ``where``, which MXNet takes on equal shapes only: its operands are first broadcast
  to their common shape by adding a tensor of -0 of that shape (``x + -0 == x`` for
  every x, -0 and NaN included), built with ``zeros_like`` (which reads no values);
* ``clip``/``hard_sigmoid``/``leaky`` with tensor parameters (the rules never emit
  them): the same comparisons and selections written with ``where`` (the forward pass
  is exact; the gradient on the boundaries is where's);
* constant subexpressions, and inputs the program does not read (the fused op's
  output still has the broadcast shape of all its inputs): a -0 tensor of that shape.
"""
from __future__ import annotations

from typing import List, Optional

from fusion.ir.errors import FusionError
from fusion.ir.expr import parse_expr
from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.ir.pattern import Pattern, Var, op
from fusion.engine.rewrite import Builder

from ._unfuse_base import UnfuseRule


_BINARY = {"add": "broadcast_add", "sub": "broadcast_sub", "mul": "broadcast_mul", "div": "broadcast_div",
           "pow": "broadcast_power", "max": "broadcast_maximum", "min": "broadcast_minimum",
           "lt": "broadcast_lesser", "le": "broadcast_lesser_equal", "gt": "broadcast_greater",
           "ge": "broadcast_greater_equal", "eq": "broadcast_equal", "ne": "broadcast_not_equal"}
# fn -> (op for fn(x, c), op for fn(c, x)); None: no scalar op computes fn(c, x) exactly
_SCALAR = {"add": ("_plus_scalar", "_plus_scalar"), "sub": ("_minus_scalar", "_rminus_scalar"),
           "mul": ("_mul_scalar", "_mul_scalar"), "div": ("_div_scalar", "_rdiv_scalar"),
           "pow": ("_power_scalar", "_rpower_scalar"), "max": ("_maximum_scalar", None),
           "min": ("_minimum_scalar", None),
           "lt": ("_lesser_scalar", "_greater_scalar"), "le": ("_lesser_equal_scalar", "_greater_equal_scalar"),
           "gt": ("_greater_scalar", "_lesser_scalar"), "ge": ("_greater_equal_scalar", "_lesser_equal_scalar"),
           "eq": ("_equal_scalar", "_equal_scalar"), "ne": ("_not_equal_scalar", "_not_equal_scalar")}
_UNARY = {"neg": "negative", "abs": "abs", "exp": "exp", "log": "log", "sqrt": "sqrt", "rsqrt": "rsqrt",
          "tanh": "tanh", "sigmoid": "sigmoid", "relu": "relu", "erf": "erf", "square": "square",
          "log1p": "log1p", "expm1": "expm1"}
_ACTIVATION = {"act_relu": "relu", "softrelu": "softrelu", "softsign": "softsign"}


def _spell(v: float) -> str:
    return "nan" if v != v else ("inf" if v == float("inf") else "-inf" if v == -float("inf") else repr(v))


def _inputs_read(tree, acc: set) -> set:
    todo = [tree]
    while todo:
        t = todo.pop()
        if t[0] == "in":
            acc.add(t[1])
        elif t[0] not in ("num", "val"):
            todo.extend(t[1])
    return acc


class ElemwiseProgram:
    """Builds stock ops for a fused_elemwise program."""

    def __init__(self, b: Builder, inputs: List[Entry], name: str):
        self.b, self.inputs, self.name = b, list(inputs), name
        self._all_zero: Optional[Entry] = None

    def build(self, text: str) -> Entry:
        tree = parse_expr(text)
        out = self._emit(tree)
        if isinstance(out, float):
            return self._fill(out, self._zero_all())
        if len(_inputs_read(tree, set())) < len(self.inputs) or out in self.inputs:
            # the fused op's output has the broadcast shape of all its inputs (and is a new value)
            out = self._op("broadcast_add", [out, self._zero_all()])
        return out

    def _op(self, op_name: str, ins, **attrs) -> Entry:
        # floats spelled here: nan (a program may hold one) and -0.0 as MXNet parses them
        return self.b.op(op_name, ins, attrs={k: _spell(v) if isinstance(v, float) else v
                                              for k, v in attrs.items()})

    # -0 tensors: x + (-0) == x for every x (-0 and NaN included), so adding one broadcasts
    # a value to a shape without changing it; zeros_like reads only its input's shape
    def _neg_zero(self, e: Entry) -> Entry:
        return self._op("negative", [self._op("zeros_like", [e])])

    def _zero_of(self, entries: List[Entry]) -> Entry:
        z = self._neg_zero(entries[0])
        for e in entries[1:]:
            z = self._op("broadcast_add", [z, self._neg_zero(e)])
        return z

    def _zero_all(self) -> Entry:
        if self._all_zero is None:
            self._all_zero = self._zero_of(list(self.inputs))
        return self._all_zero

    def _fill(self, v: float, zero: Entry) -> Entry:
        """A tensor of zero's shape holding v (-0 + v == v for every v)."""
        return self._op("_plus_scalar", [zero], scalar=v)

    def _emit(self, tree):
        """The stock value of ``tree``: its calls in post-order, without recursion."""
        values: dict = {}           # id(node) -> its value (a node object may be reached twice)
        todo = [(tree, False)]
        while todo:
            t, ready = todo.pop()
            if id(t) in values:
                continue
            kind = t[0]
            if kind in ("num", "val"):
                values[id(t)] = t[1]
            elif kind == "in":
                values[id(t)] = self.inputs[t[1]]
            elif not ready:
                todo.append((t, True))
                todo.extend((a, False) for a in reversed(t[1]))
            else:
                values[id(t)] = self._call(kind, t, [values[id(a)] for a in t[1]])
        return values[id(tree)]

    def _call(self, kind: str, t, args):
        """``kind`` applied to the emitted values of its arguments."""
        if kind in ("where", "clip", "hard_sigmoid", "leaky") or (kind in _BINARY and all(
                isinstance(a, float) for a in args)) or (len(args) == 1 and isinstance(args[0], float)):
            return self._special(kind, t, args)
        if kind in _UNARY:
            return self._op(_UNARY[kind], args)
        if kind in _ACTIVATION:
            return self._op("Activation", args, act_type=_ACTIVATION[kind])
        if kind == "gelu":
            return self._op("LeakyReLU", args, act_type="gelu")
        if kind == "log_sigmoid":      # -softrelu(-x)
            return self._op("negative", [self._op("Activation", [self._op("negative", args)], act_type="softrelu")])
        if kind == "mish":             # x tanh(softrelu(x))
            sr = self._op("Activation", args, act_type="softrelu")
            return self._op("broadcast_mul", [args[0], self._op("tanh", [sr])])
        if kind in _BINARY:
            a, c = args
            if isinstance(c, float):
                return self._op(_SCALAR[kind][0], [a], scalar=c)
            if isinstance(a, float):
                if _SCALAR[kind][1] is None:   # keep the operand order: fill a tensor with the constant
                    return self._op(_BINARY[kind], [self._fill(a, self._neg_zero(c)), c])
                return self._op(_SCALAR[kind][1], [c], scalar=a)
            return self._op(_BINARY[kind], [a, c])
        raise FusionError("fused_elemwise function %r has no stock equivalent" % kind)

    def _special(self, kind: str, t, args) -> Entry:
        """Functions needing more than one stock op, and functions of constants only."""
        if all(isinstance(a, float) for a in args):       # a constant subexpression: fill, then compute
            args = [self._fill(args[0], self._zero_all())] + list(args[1:])
        x = args[0]
        if kind == "where":
            return self._where(*args)
        if kind == "clip":
            lo, hi = args[1], args[2]
            if isinstance(lo, float) and isinstance(hi, float) and not isinstance(x, float):
                return self._op("clip", [x], a_min=lo, a_max=hi)
            # MXNet's clip: x > hi ? hi : (x < lo ? lo : x)
            return self._where(self._binary("gt", x, hi), hi, self._where(self._binary("lt", x, lo), lo, x))
        if kind == "hard_sigmoid":
            alpha, beta = args[1], args[2]
            if isinstance(alpha, float) and isinstance(beta, float) and not isinstance(x, float):
                return self._op("hard_sigmoid", [x], alpha=alpha, beta=beta)
            r = self._binary("add", self._binary("mul", alpha, x), beta)
            r = self._where(self._binary("lt", 1.0, r), 1.0, r)
            return self._where(self._binary("gt", 0.0, r), 0.0, r)
        if kind == "leaky":
            slope = args[1]
            if isinstance(slope, float) and not isinstance(x, float):
                return self._op("LeakyReLU", [x], act_type="leaky", slope=slope)
            return self._where(self._binary("gt", x, 0.0), x, self._binary("mul", x, slope))
        # a unary or binary function of constants only: computed on a filled tensor
        return self._emit((kind, [("val", a) for a in args]))

    def _binary(self, kind: str, a, c):
        """kind(a, c) over emitted values (a tensor or a float each)."""
        if isinstance(a, float) and isinstance(c, float):
            a = self._fill(a, self._zero_all())
        return self._emit((kind, [("val", a), ("val", c)]))

    def _where(self, c, a, e) -> Entry:
        """MXNet's where on operands broadcast to their common shape (floats filled in)."""
        tensors = [v for v in (c, a, e) if not isinstance(v, float)]
        if not tensors:
            tensors = [self._zero_all()]
        zero = self._zero_of(tensors)
        full = [self._fill(v, zero) if isinstance(v, float) else self._op("broadcast_add", [v, zero])
                for v in (c, a, e)]
        return self._op("where", full)


class UnfuseElemwise(UnfuseRule):
    def __init__(self):
        super().__init__("fused_elemwise", 8)

    def pattern(self) -> Pattern:
        return op(self.op_name)(*[Var("i%d" % k, optional=k > 0) for k in range(64)], name="f")

    def rewrite(self, m: Match, b: Builder) -> Entry:
        f = m.node("f")
        return ElemwiseProgram(b, self.inputs(m), f.name).build(f.attrs.raw("expr"))
