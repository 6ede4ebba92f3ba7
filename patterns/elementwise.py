r"""Maximal regions of elementwise, broadcast and scalar ops → one ``fused_elemwise``.

Matched: a connected region of the ops below, grown backwards from its output
over producers whose values are used only inside the region (TVM FuseOps-style:
no interior value escapes, so no cycle can form), at least two ops, at most 32
nodes, 8 distinct inputs and 256 program ops (an inlined ``fused_elemwise``
counts as the ops of its program, BatchNorm as two), so that no expression nests
deeper than 256: its parser recurses once per level, and MXNet's ``load_json``
crashed (SIGSEGV) on a 30,000-deep one — a long chain becomes several ops::

    add sub mul div power maximum minimum (elemwise_*, broadcast_*, _plus, …)
    scalar forms (_plus_scalar, _rminus_scalar, _rdiv_scalar, _power_scalar, …, comparisons)
    negative abs exp log sqrt rsqrt square reciprocal tanh sigmoid relu erf clip where
    Activation(relu|sigmoid|tanh)  LeakyReLU(leaky|gelu)  hard_sigmoid
    broadcast comparisons (greater, lesser_equal, …)
    BatchNorm (inference, with params): y = x·s + t, s = γ/√(σ²+ε), t = β − μ·s
    Dropout (inference, mode='training': identity)     fused_elemwise (its program is inlined)

Rewrite: ``y = fused_elemwise(x0, …, xk, expr=…)`` whose program is the region's
expression over its inputs, evaluated in one pass — e.g. hard-swish
``x·clip(x+3, 0, 6)/6`` becomes ``div(mul(x0, clip(add(x0, 3.0), 0.0, 6.0)), 6.0)``.

Each op becomes the program function that computes exactly what MXNet's op computes
(``cuda_kernels/fused_elemwise/README.md``), NaN, ±inf, ±0 and subnormals included:
``relu`` keeps NaN, ``Activation(relu)`` becomes ``act_relu`` (NaN → 0 where MXNet runs it
through oneDNN, at ranks 1–5), ``maximum``/``minimum`` keep MXNet's operand order (a NaN
left operand wins, a tie gives the right one), ``clip``/``hard_sigmoid``/``leaky``/``gelu``
are single functions with MXNet's forward and backward.  Scalars are written as the
float32 values MXNet computes with (``_mul_scalar(x, 0.1)`` multiplies by float32(0.1)).

Shapes.  The program broadcasts as NumPy does, which is what MXNet's ``broadcast_*`` ops
do (ranks aligned on the right); ``elemwise_*`` ops take equal shapes.  MXNet's
``where(cond, x, y)`` with a 1-D ``cond`` of length ``x.shape[0]`` selects whole rows,
which NumPy broadcasting would align with the last axis instead: the rewrite feeds the
kernel ``Reshape(cond, shape=(-1, 1, …, 1))`` (x's rank, any batch size), and keeps the
condition's producer out of the region; a ``where`` whose ranks are unknown is refused.
BatchNorm's scale and shift are given the shape ``(C, 1, …, 1)`` (the dims after the
channel axis), so the fused op also runs at other batch and spatial sizes.

Refused (the report says why): ops reading a value that is not float32 (the fused op
computes in float32), convolution/dense tails and BatchNorm after a Concat (left to oneDNN), ``Dropout`` that samples
at inference (``mode='always'``), a ``where`` of unknown rank.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from fusion.ir.errors import FusionError
from fusion.ir.graph import Entry, Node
from fusion.ir.matcher import Match
from fusion.ir.pattern import Pattern, Region
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from ._dtypes import not_float32 as _heuristic_not_float32


def _not_float32(entry: Entry, ctx) -> bool:
    """Whether ``entry`` holds something else than float32 (or might: then it stays out).

    MXNet's own type inference (``ctx.dtype``) decides; where it cannot tell (no input
    shapes: MXNet infers types only with every shape known when library ops are in the
    graph), the conservative heuristic (both in ``patterns/_dtypes.py``).
    """
    return _heuristic_not_float32(entry, ctx)


def _c(v) -> str:
    """A scalar as the float32 MXNet computes with, written so it parses back exactly."""
    return repr(float(np.float32(float(v))))


def _binary(fn: str) -> Callable:
    return lambda n, a: "%s(%s, %s)" % (fn, a[0], a[1])


def _unary(fn: str) -> Callable:
    return lambda n, a: "%s(%s)" % (fn, a[0])


def _scalar(fn: str, reverse: bool = False) -> Callable:
    if reverse:
        return lambda n, a: "%s(%s, %s)" % (fn, _c(n.attrs["scalar"]), a[0])
    return lambda n, a: "%s(%s, %s)" % (fn, a[0], _c(n.attrs["scalar"]))


ACTIVATIONS = {"relu": "act_relu", "sigmoid": "sigmoid", "tanh": "tanh"}

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
EXPR["reciprocal"] = lambda n, a: "div(1.0, %s)" % a[0]          # MXNet: 1.0f / x
EXPR["clip"] = lambda n, a: "clip(%s, %s, %s)" % (a[0], _c(n.attrs["a_min"]), _c(n.attrs["a_max"]))
EXPR["where"] = lambda n, a: "where(%s, %s, %s)" % (a[0], a[1], a[2])
EXPR["Activation"] = lambda n, a: "%s(%s)" % (ACTIVATIONS[n.attrs["act_type"]], a[0])
EXPR["hard_sigmoid"] = lambda n, a: "hard_sigmoid(%s, %s, %s)" % (
    a[0], _c(n.param("alpha", 0.2)), _c(n.param("beta", 0.5)))
EXPR["LeakyReLU"] = lambda n, a: ("gelu(%s)" % a[0] if n.param("act_type") == "gelu" else
                                  "leaky(%s, %s)" % (a[0], _c(n.param("slope"))))
EXPR["Dropout"] = lambda n, a: a[0]
EXPR["_copy"] = lambda n, a: a[0]
EXPR["identity"] = lambda n, a: a[0]
EXPR["fused_elemwise"] = lambda n, a: re.sub(r"\bx(\d+)\b", lambda t: a[int(t.group(1))], n.attrs.raw("expr"))


def batchnorm_scale_shift(node: Node, ctx) -> Optional[tuple]:
    """(scale, shift, axis, rank) of an inference BatchNorm with known params, else None."""
    if len(node.inputs) != 5 or ctx.mode != "inference" or node.param("output_mean_var"):
        return None
    vals = [ctx.value(e) for e in node.inputs[1:]]
    if any(v is None for v in vals[1:]) or (vals[0] is None and not node.param("fix_gamma")):
        return None
    # its rank is all this needs: known without input shapes too
    shape = ctx.partial_shape(node.inputs[0]) if hasattr(ctx, "partial_shape") else ctx.shape(node.inputs[0])
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


def _where_rows(node: Node, ctx) -> Optional[bool]:
    """For a ``where``: True when its 1-D condition selects rows of higher-rank branches,
    False when condition and branches have one rank, None when the shapes are unknown."""
    cond, x = ctx.shape(node.inputs[0]), ctx.shape(node.inputs[1])
    if cond is None or x is None:
        return None
    if len(cond) == len(x):
        return False
    return True if len(cond) == 1 else None


def _feeds_row_condition(node: Node, ctx) -> bool:
    """Whether ``node``'s value is the 1-D row-selecting condition of a ``where``: it must
    reach the kernel from outside, reshaped to (N, 1, …, 1)."""
    return any(u.op == "where" and slot == 0 and _where_rows(u, ctx)
               for u, slot in ctx.graph.consumers().get(node, ()))


def _dropout_identity(node: Node, ctx) -> bool:
    """Dropout is the identity at inference unless it samples there (mode='always')."""
    return ctx.mode == "inference" and node.param("mode") != "always"


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


def _reads_concat(node: Node) -> bool:
    """Whether ``node`` is a BatchNorm reading a Concat (DenseNet's pre-activation).

    MXNet's oneDNN Concat, BatchNorm and Activation keep such feature maps in oneDNN's
    blocked layouts between the convolutions; a library op there makes MXNet reorder them
    to NCHW and back: measured on DenseNet-121 at 0.64× MXNet's default bind with these
    BatchNorm → relu taken into fused_elemwise, at parity without.
    """
    return node.op == "BatchNorm" and bool(node.inputs) and node.inputs[0].node.op == "Concat"


def _training_comparison(node: Node, ctx) -> bool:
    """A comparison in training.  MXNet gives what a comparison reads a zero gradient, and the ops
    below it then either skip their backward (sigmoid, tanh, the broadcast_* ops: their gradient
    functions check for an all-zero gradient) or run it on zeros (Activation, LeakyReLU: 0 · NaN is
    NaN where their derivative is); a program's backward cannot tell which op a value came from,
    so in training the comparison stays a stock op."""
    from fusion.engine.workarounds import ZERO_GRADIENT

    return ctx.mode == "training" and node.op in ZERO_GRADIENT


def _onednn_bind(ctx) -> bool:
    """Whether the fused graph binds on the CPU, where MXNet's oneDNN backend takes convolution
    tails and BatchNorm after a Concat itself (``fuse(..., device="gpu")``: no oneDNN there)."""
    return getattr(ctx, "device", "cpu") == "cpu"


#: Ops whose oneDNN forms write oneDNN's blocked layouts under MXNet 1.9.1's default bind on the CPU.
_BLOCKED_SOURCES = ("Convolution", "Deconvolution", "_sg_mkldnn_conv")
#: Ops MXNet runs in oneDNN keeping the layout they read (a blocked input gives a blocked output),
#: with the Activation kinds it runs there.
_LAYOUT_KEEPING = {"BatchNorm": None, "Pooling": None, "Concat": None, "LRN": None,
                   "Activation": ("relu", "sigmoid", "tanh", "softrelu"),
                   "elemwise_add": None, "_plus": None, "_add": None, "_Plus": None}


def _keeps_layout(node: Node) -> bool:
    kinds = _LAYOUT_KEEPING.get(node.op, ())
    return node.op in _LAYOUT_KEEPING and (kinds is None or node.attrs.get("act_type") in kinds)


def _blocked(node: Node, depth: int = 32) -> bool:
    """Whether MXNet's default bind holds ``node``'s output in oneDNN's blocked layout: a
    convolution wrote it, through ops that keep the layout they read."""
    while depth > 0 and _keeps_layout(node) and node.inputs:
        if len(node.inputs) > 1 and node.op != "BatchNorm":
            return any(_blocked(e.node, depth - 1) for e in node.inputs)
        node, depth = node.inputs[0].node, depth - 1
    return node.op in _BLOCKED_SOURCES


def layout_case(region: List[Node], ctx) -> Dict[str, object]:
    """The cost case of replacing ``region`` by one fused_elemwise on the CPU (``fusion.engine.cost``):
    which ops it replaces, whether that adds layout reorders, and the output's size.

    Reorders are added where MXNet would run the whole region in oneDNN's blocked layout: every
    op of it keeps the layout (BatchNorm, relu, ...) and it reads a value a convolution wrote in
    that layout.  A library op there makes MXNet reorder its input to NCHW and its output back
    for the next convolution; elsewhere MXNet reorders as much either way."""
    inside = {id(n) for n in region}
    onednn_only = all(_keeps_layout(n) for n in region)
    reads_blocked = any(_blocked(e.node) for n in region for e in n.inputs if id(e.node) not in inside)
    labels = sorted({n.attrs.get("act_type") if n.op == "Activation" else
                     "add" if n.op != "BatchNorm" and _keeps_layout(n) else n.op for n in region})
    case: Dict[str, object] = {"ops": "+".join(str(x) for x in labels),
                               "adds_reorders": bool(onednn_only and reads_blocked)}
    shape = ctx.shape(Entry(region[-1]))
    if shape is not None:
        case["elements"] = int(np.prod(shape))
    return case


def layout_cost_reason(region: List[Node], ctx) -> Optional[str]:
    """Why ``region`` stays MXNet's on the CPU (None: fuse it): a fused_elemwise there would add
    layout reorders that the measured costs of this CPU (or, without them, the conservative rule
    of ``fusion.engine.cost``) say do not pay back."""
    from fusion.engine import cost

    case = layout_case(region, ctx)
    if not case["adds_reorders"]:
        return None
    decision = cost.decide("fused_elemwise", "float32", "forward", case, kind="cpu")
    if decision.fuse:
        return None
    return ("%s stays MXNet's: it sits where MXNet's oneDNN ops keep their blocked layout, which a "
            "fused_elemwise would make MXNet reorder; %s" % (", ".join("'%s'" % n.name for n in region[:3]) +
                                                           (", ..." if len(region) > 3 else ""), decision.reason))


def why_not(node: Node, ctx) -> Optional[str]:
    """The reportable reasons an elementwise op stays out of every region."""
    if _training_comparison(node, ctx):
        return ("%s '%s' is a comparison: in training, whether MXNet runs the backward of what it reads "
                "on its zero gradient depends on each op's gradient function; it stays a stock op"
                % (node.op, node.name))
    if _onednn_bind(ctx) and _reads_concat(node):
        return ("BatchNorm '%s' reads a Concat: left to MXNet's oneDNN backend, which keeps the "
                "concatenation in its own layout" % node.name)
    if _onednn_bind(ctx) and _conv_tail(node):
        return ("%s '%s' is in the tail of a convolution or dense layer: left to MXNet's oneDNN "
                "backend, which fuses it there" % (node.op, node.name))
    bad = next((e for e in node.inputs if _not_float32(e, ctx)), None)
    if bad is not None:
        return ("%s '%s' reads '%s', which is not float32: fused_elemwise computes in float32"
                % (node.op, node.name, bad.node.name))
    if node.op == "Dropout" and not _dropout_identity(node, ctx):
        return ("Dropout '%s' samples a mask %s: it is not the identity"
                % (node.name, "at inference (mode='always')" if ctx.mode == "inference" else "in training"))
    if node.op == "where" and len(node.inputs) == 3 and _where_rows(node, ctx) is None:
        return ("where '%s': the ranks of its condition and branches are unknown (pass input shapes); "
                "MXNet's 1-D condition selects rows, which broadcasting would not" % node.name)
    return None


def member(node: Node, ctx) -> bool:
    if (_onednn_bind(ctx) and (_conv_tail(node) or _reads_concat(node))) or _training_comparison(node, ctx):
        return False
    if any(_not_float32(e, ctx) for e in node.inputs):
        return False
    if _feeds_row_condition(node, ctx):
        return False
    if node.op == "Activation":
        return node.attrs.get("act_type") in ACTIVATIONS
    if node.op == "LeakyReLU":
        return node.param("act_type") in ("leaky", "gelu") and len(node.inputs) == 1
    if node.op == "Dropout":
        return _dropout_identity(node, ctx)
    if node.op == "BatchNorm":
        return batchnorm_scale_shift(node, ctx) is not None
    if node.op == "where":
        return len(node.inputs) == 3 and _where_rows(node, ctx) is not None
    if node.op == "fused_elemwise":
        # inlined: its output has the broadcast shape of all its inputs, the program's only
        # when the program reads every one of them
        read = {int(k) for k in re.findall(r"\bx(\d+)\b", node.attrs.raw("expr") or "")}
        return read == set(range(len(node.inputs)))
    return node.op in EXPR


MAX_PROGRAM_OPS = 256   # per fused_elemwise; ~600 levels fit a 256 KiB stack (fusion/ir/graph.py: MAX_EXPR_DEPTH)


def program_ops(node: Node) -> int:
    """How many ops ``node`` adds to a region's program (every op of the program is one call: one parenthesis)."""
    if node.op == "fused_elemwise":
        return max(1, (node.attrs.raw("expr") or "").count("("))
    return 2 if node.op == "BatchNorm" else 1


class Elementwise(Rule):
    name = "elementwise"
    family = "elementwise"
    benefit = 10
    description = "maximal regions of elementwise/broadcast/scalar ops → one fused_elemwise pass"
    MAX_INPUTS = 8     # the CUDA kernel's limit

    def pattern(self) -> Pattern:
        return Region(member, "region", ops=set(EXPR) | {"BatchNorm"}, why_not=why_not,
                      max_inputs=self.MAX_INPUTS, size=program_ops, max_size=MAX_PROGRAM_OPS)

    def check(self, m: Match) -> Optional[str]:
        region = m["region"]
        if all(n.op in ("Dropout", "_copy", "identity") for n in region):
            return "only identity ops"
        if _onednn_bind(m.ctx) and m.ctx.mode == "inference":
            return layout_cost_reason(region, m.ctx)
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        region = m["region"]
        inside = {id(n): n for n in region}
        inputs: List[Entry] = []
        slots: Dict[Tuple[Entry, bool], str] = {}

        def slot(e: Entry, rows_of: Optional[Entry] = None) -> str:
            """The input slot of external value ``e``; ``rows_of``: e is a 1-D condition
            selecting rows of that value, given to the kernel as (N, 1, …, 1)."""
            key = (e, rows_of is not None)
            if key not in slots:
                if rows_of is not None:
                    rank = len(m.ctx.shape(rows_of))
                    e = b.op("Reshape", [e], attrs={"shape": (-1,) + (1,) * (rank - 1)},
                             name=m.ctx.unique_name(e.node.name + "_rows"))
                slots[key] = "x%d" % len(inputs)
                inputs.append(e)
            return slots[key]

        def arg(e: Entry) -> str:
            return exprs[id(e.node)] if id(e.node) in inside else slot(e)

        exprs: Dict[int, str] = {}
        for n in region:                              # topological order
            if n.op == "BatchNorm":
                scale, shift, axis, rank = batchnorm_scale_shift(n, m.ctx)
                bshape = [-1] + [1] * (rank - axis - 1)     # (C, 1, …, 1): broadcasts at any batch size
                s = b.param(n.name + "_scale", scale.reshape(bshape).astype(np.float32))
                t = b.param(n.name + "_shift", shift.reshape(bshape).astype(np.float32))
                exprs[id(n)] = "add(mul(%s, %s), %s)" % (arg(n.inputs[0]), arg(s), arg(t))
            elif n.op == "where" and _where_rows(n, m.ctx):
                exprs[id(n)] = "where(%s, %s, %s)" % (slot(n.inputs[0], rows_of=n.inputs[1]),
                                                      arg(n.inputs[1]), arg(n.inputs[2]))
            else:
                exprs[id(n)] = EXPR[n.op](n, [arg(e) for e in n.inputs])
        if len(inputs) > self.MAX_INPUTS:
            raise FusionError("the region reads %d inputs (a row condition counts twice), more than %d"
                              % (len(inputs), self.MAX_INPUTS))
        if m.ctx.mode == "training":
            # the program computes a subexpression written twice once, and sums its readers'
            # gradients before they flow on -- as MXNet does for one node read twice, but not for
            # two nodes computing the same (g / 0 + 0 / 0 = NaN there, (g + 0) / 0 = inf here)
            seen: Dict[str, Node] = {}
            for n in region:
                other = seen.setdefault(exprs[id(n)], n)
                if other is not n:
                    raise FusionError("'%s' and '%s' compute the same value: in training the fused "
                                      "program would sum their gradients before MXNet does" % (other.name, n.name))
        return b.op("fused_elemwise", inputs, attrs={"expr": exprs[id(region[-1])], "num_args": len(inputs)},
                    name=m.anchor.name)


RULES: List[Rule] = [Elementwise()]
