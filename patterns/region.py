r"""Regions of a convolutional network → one ``fused_region`` (contract: ``cuda_kernels/fused_region/README.md``).

Matched: a maximal connected region of the ops below, grown backwards from its output over
producers whose values are read only inside it (the ``Region`` pattern: no interior value
escapes, so no cycle can form), after BatchNorm folding has run (``conv_bn_act``)::

    x (N, C, H, W) ─────────────┐                  the program
    Convolution 1×1 → relu      │                  conv 1×1   post [relu]
    Convolution 3×3 → relu      │                  conv 3×3   post [relu]
    Convolution 1×1             │                  conv 1×1   post [add x, relu]
    add ◄───────────────────────┘ → relu
    … (more blocks) … → Pooling(global)            pool global
    ✂ Flatten: not a region op, the region ends before it

    the ops a region takes (every value 4-D NCHW float32):
    Convolution 2-D: any groups, stride, pad, dilation, bias or not          → conv
    Deconvolution 2-D: one group, no target_shape, adj ≤ pad                 → deconv
    Pooling 2-D max | avg | global, valid | full; mean(axis=(2, 3), keepdims),
      AdaptiveAvgPooling2D(1)                                                → pool
    Concat(dim=1)                                                            → concat
    BatchNorm at inference, axis 1                                           → batchnorm
    add of equal shapes                                                      → post add | add
    mul, one side of the other's shape or (N, C, 1, 1) (an SE gate)          → post mul | mul
    broadcast_like(g, y) read by a product with y, g (N, C, 1, 1)            → read through: y · g
    activations, however written (below)                                     → post steps | act

Rewrite: ``y = fused_region(d_0 … d_{D−1}, p_0 … p_{P−1}, program=…, num_data=D, num_outputs=1)``:
the region's values entering it (``d``), then its parameters (weights, biases, BatchNorm's
γ, β, μ, σ² -- moving statistics as ordinary inputs), and the program: the region's ops in
topological order, each with ``post`` steps applied to its result.  An activation, a residual
add or an SE product becomes a step of the op that produced its input when nothing else reads
that input (``conv → relu`` is one conv with ``post [relu]``; ``add(conv₃, shortcut) → relu`` is
``post [add shortcut, relu]`` on conv₃ when the shortcut is made before it, else on the shortcut's
op); otherwise an ``add`` / ``mul`` op, or an ``act`` op (the identity) carrying the steps.

A gate broadcast to the map it scales, ``y · broadcast_like(g, y)`` (GluonCV's pose networks write
their SE products so), is the product by the gate ``y · g``: broadcast_like only repeats axes of
size 1, so where g is (N, C, 1, 1) with y's N and C and its output has y's shape or g's (whatever
``lhs_axes`` / ``rhs_axes`` say), every value it gives is ``g[n, c]``.  Other shapes (a gate of
another shape, axes that give neither shape) and other readers refuse it, with the reason.

Activations, every way they are written (GluonCV, Gluon, MXNet's ops, or one ``fused_elemwise``
the elementwise rule made of them: its program is read and mapped where the contract has the
function, refused with the reason where it has not)::

    Activation(relu) | relu                     → relu          (NaN: oneDNN's 0, as MXNet's own oneDNN path)
    Activation(sigmoid|tanh|softrelu) | sigmoid | tanh           → sigmoid | tanh | softrelu
    LeakyReLU(leaky, s) | LeakyReLU(elu, a) | LeakyReLU(gelu)    → leaky s | elu a | gelu (erf)
    clip(x, a, b)                               → clip a b      (ReLU6: clip 0 6)
    x · sigmoid(x)                              → swish         (Gluon's Swish(β = 1): x · sigmoid(1·x))
    x · (clip(x + 3, 0, 6) / 6) | x · clip(x + 3, 0, 6) / 6      → hard_swish    (GluonCV's HardSwish)
    clip(x + 3, 0, 6) / 6                       → hard_sigmoid α = 1/6, β = 1/2  (GluonCV's HardSigmoid)
    hard_sigmoid(x, α, β)                       → hard_sigmoid α β
    x + c, x − c, c − x, x · c, x / c           → linear: a·x + b  (x / c as x · (1/c), float32)

NaN and ±inf follow the op (oneDNN), not MXNet's per-op rules (the contract's numerics): MXNet's
``relu`` and ``clip`` ops keep a NaN that the region's relu (as ``Activation(relu)``) and clip turn
into a number -- only a NaN input shows it, and the un-fused program says the same (its relu is
``Activation(relu)``).  The mapping is exact in real arithmetic; in float32 the op computes each function its own way
(oneDNN's eltwise kernels, sums in another order, x / c as a product, hard-swish's two spellings
as one function): within the contract's 1e-4 (``--verify``'s measure), which the self-check
holds it to.  ``patterns/unfuse_region.py`` rebuilds the stock ops from the program: the
program's reference semantics.

Outputs: the anchor's value first, then each value inside that is also read outside or is a graph
output (``exported_nodes``, in graph order): the rewrite replaces each (``Rule.exported``), and no post
step runs in place over a value given back.

Cut (each region's cut and why is in the report, ``--explain`` lists every edge): at an op a
region does not take (``Flatten``, ``FullyConnected``, reshapes, a 3-D or NHWC convolution, a grouped
Deconvolution or one with ``target_shape``, an activation the contract lacks), at a value whose shape
or dtype is unknown or not 4-D float32, where a value read outside leads back into the region (``leads_back``: the region as
one op would read what follows from its own output) or past MAX_OUTPUTS values read outside, at
MAX_NODES nodes, and where the CPU's cost table (``fusion/engine/cost.py``; without entries its
conservative rule: two convolutions, or one and two other ops or steps) says the region does not
pay -- a refused region's ops are left to the other rules.  Refused: ``mode='training'`` (no
backward), ``device='gpu'`` (a CPU op), an op library without ``fused_region``.

``precision="bf16"``: the region's ``precision`` is ``bfloat16`` (``fusion/precision/policy.py``:
BF16_ATTRS), and MXNet's AMP does not convert the graph's convolutions first (the policy's
``convolutions_fused``, from ``RegionRule.emits``).

The CNN block rules stand aside where a region takes all of a candidate's ops (``taken_by_region``:
squeeze_excitation, dense_block, inverted_residual, grouped_conv, concat_bn_act) and fuse as before
in training, on the GPU, without this rule (``--rules default,-region``) and where a region was
refused; ``deconv_act`` stands aside the same way where a region takes the Deconvolution (a pose or
CenterNet head: backbone and head one region, oneDNN's deconvolution kernels inside it);
``split_attention`` (reshapes, softmax) takes ops no region takes and stays;
``pool_before_pointwise_conv`` (a stock rewrite) runs first and the region takes its result.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from fusion.engine.reasons import NearMiss, NeedsShapes
from fusion.engine.rewrite import Builder, implemented
from fusion.engine.rule import Rule
from fusion.ir.errors import FusionError
from fusion.ir.expr import parse_expr
from fusion.ir import opdefs
from fusion.ir.graph import Entry, Node
from fusion.ir.matcher import Match, State, Trace, leads_back, match_pattern
from fusion.ir.pattern import Const, Pattern, Region, Var, op

OP = "fused_region"
RULE = "region"
PROGRAM_VERSION = 1
MAX_NODES = 512          # per region; a longer chain becomes several regions (the cut says so)
MAX_INPUTS = 4096        # the pattern's count of distinct inputs, parameters included
MAX_OUTPUTS = 64         # values a region gives back: its anchor's and those read outside it (see exported)
MAX_CONCAT = 128

CONV_OPS = ("Convolution",)
DECONV_OPS = ("Deconvolution",)
POOL_OPS = ("Pooling",)
GLOBAL_MEAN_OPS = ("mean", "_contrib_AdaptiveAvgPooling2D")
CONCAT_OPS = ("Concat",)
BATCHNORM_OPS = ("BatchNorm",)
ADD_OPS = tuple(sorted(opdefs.ALIASES["add"]))
MUL_OPS = tuple(sorted(opdefs.ALIASES["mul"]))
ACT_OPS = ("Activation", "relu", "sigmoid", "tanh", "LeakyReLU", "clip", "hard_sigmoid")
GATE_BROADCAST_OPS = ("broadcast_like",)    # an SE gate broadcast to its map: read through (see the docstring)
SCALAR_OPS = {"_plus_scalar": "add", "_PlusScalar": "add", "_minus_scalar": "sub", "_MinusScalar": "sub",
              "_rminus_scalar": "rsub", "_RMinusScalar": "rsub", "_mul_scalar": "mul", "_MulScalar": "mul",
              "_div_scalar": "div", "_DivScalar": "div"}
ELEMENTWISE = frozenset(ADD_OPS + MUL_OPS + ACT_OPS + tuple(SCALAR_OPS) + ("fused_elemwise",))
ANCHOR_OPS = frozenset(CONV_OPS + DECONV_OPS + POOL_OPS + GLOBAL_MEAN_OPS + CONCAT_OPS + BATCHNORM_OPS) | ELEMENTWISE


def _f32(v) -> float:
    """A scalar as the float32 MXNet computes with (JSON writes it in full)."""
    return float(np.float32(float(v)))


# ---------------------------------------------------------------- the ops, their inputs bound by name

def _concat_pattern() -> Pattern:
    return op.Concat(Var("x0"), *(Var("x%d" % i, optional=True) for i in range(1, MAX_CONCAT)), name="op")


#: How each op a region takes reads its inputs: values (``x``, ``a``, ``b``, ``x0``…) and parameters
#: (``w``, ``b``, ``gamma``, …), bound by name.
PATTERNS: Dict[str, Pattern] = {
    "conv": op.Convolution(Var("x"), Const("w"), Const("bias", optional=True), name="op"),
    "deconv": op.Deconvolution(Var("x"), Const("w"), Const("bias", optional=True), name="op"),
    "pool": op.Pooling(Var("x"), name="op"),
    "global_mean": op(*GLOBAL_MEAN_OPS)(Var("x"), name="op"),
    "concat": _concat_pattern(),
    "batchnorm": op.BatchNorm(Var("x"), Const("gamma"), Const("beta"), Const("mean"), Const("var"), name="op"),
}
#: The elementwise ops' inputs are the leaves of their expression trees (``node_tree``), by slot.
_ARITY_OF = {**{o: 2 for o in ADD_OPS + MUL_OPS}, **{o: 1 for o in ACT_OPS + tuple(SCALAR_OPS)}}
_KIND_OF = {**{o: "conv" for o in CONV_OPS}, **{o: "deconv" for o in DECONV_OPS}, **{o: "pool" for o in POOL_OPS},
            **{o: "global_mean" for o in GLOBAL_MEAN_OPS}, **{o: "concat" for o in CONCAT_OPS},
            **{o: "batchnorm" for o in BATCHNORM_OPS}, **{o: "binary" for o in ADD_OPS + MUL_OPS},
            **{o: "unary" for o in ACT_OPS + tuple(SCALAR_OPS)},
            **{o: "gate_broadcast" for o in GATE_BROADCAST_OPS}}
_PARAM_ROLES = {"conv": ("w", "bias"), "deconv": ("w", "bias"), "batchnorm": ("gamma", "beta", "mean", "var")}


def bind(node: Node, ctx) -> Optional[Dict[str, Any]]:
    """The inputs of ``node`` by the names its op's pattern gives them (None: it does not read as the
    pattern says, e.g. a Convolution whose weight is computed)."""
    kind = _KIND_OF.get(node.op)
    if kind is None:
        return None
    for st in match_pattern(PATTERNS[kind], Entry(node), State({}, ()), Trace(ctx.graph, ctx)):
        return dict(st.bindings)
    return None


# ---------------------------------------------------------------- activations as expression trees

#: Expression trees (fusion/ir/expr.py's: (fn, [args]) | ("num", v) | ("in", k)) of the composite
#: activations; ``x0`` stands for the activated value, read twice where it is.
COMPOSITES: List[Tuple[Dict[str, Any], Any]] = [
    ({"eltwise": "hard_swish"}, parse_expr("mul(x0, div(clip(add(x0, 3.0), 0.0, 6.0), 6.0))")),
    ({"eltwise": "hard_swish"}, parse_expr("div(mul(x0, clip(add(x0, 3.0), 0.0, 6.0)), 6.0)")),
    ({"eltwise": "swish"}, parse_expr("mul(x0, sigmoid(x0))")),
    ({"eltwise": "swish"}, parse_expr("mul(x0, sigmoid(mul(x0, 1.0)))")),
    ({"eltwise": "hard_sigmoid", "alpha": _f32(1.0 / 6.0), "beta": 0.5},
     parse_expr("div(clip(add(x0, 3.0), 0.0, 6.0), 6.0)")),
]
_COMMUTATIVE = ("add", "mul")
#: One-argument functions of a tree and the step each is (extra arguments: numbers).
UNARY_STEPS: Dict[str, Callable[[List[float]], Dict[str, Any]]] = {
    "act_relu": lambda a: {"eltwise": "relu"},
    "relu": lambda a: {"eltwise": "relu"},
    "sigmoid": lambda a: {"eltwise": "sigmoid"},
    "tanh": lambda a: {"eltwise": "tanh"},
    "softrelu": lambda a: {"eltwise": "softrelu"},
    "gelu": lambda a: {"eltwise": "gelu"},
    "leaky": lambda a: {"eltwise": "leaky", "slope": a[0]},
    "elu": lambda a: {"eltwise": "elu", "alpha": a[0]},
    "clip": lambda a: {"eltwise": "clip", "lo": a[0], "hi": a[1]},
    "hard_sigmoid": lambda a: {"eltwise": "hard_sigmoid", "alpha": a[0], "beta": a[1]},
}
_ARITY = {"leaky": 1, "elu": 1, "clip": 2, "hard_sigmoid": 2}


def _num(v) -> Tuple[str, float]:
    return ("num", _f32(v))


def node_tree(node: Node) -> Any:
    """The expression tree of an elementwise op of a region over its inputs (``("in", slot)``)."""
    o = node.op
    x = ("in", 0)
    if o == "fused_elemwise":
        return parse_expr(node.attrs.raw("expr") or "")
    if o in ADD_OPS:
        return ("add", [x, ("in", 1)])
    if o in MUL_OPS:
        return ("mul", [x, ("in", 1)])
    if o in SCALAR_OPS:
        kind, c = SCALAR_OPS[o], _num(node.attrs["scalar"])
        return ("sub", [c, x]) if kind == "rsub" else (kind, [x, c])
    if o == "Activation":
        t = node.attrs.get("act_type")
        return ("act_relu" if t == "relu" else t, [x])
    if o == "LeakyReLU":
        t = node.param("act_type")
        return ("gelu", [x]) if t == "gelu" else (t, [x, _num(node.param("slope"))])
    if o == "clip":
        return ("clip", [x, _num(node.attrs["a_min"]), _num(node.attrs["a_max"])])
    if o == "hard_sigmoid":
        return ("hard_sigmoid", [x, _num(node.attrs.get("alpha", 0.2)), _num(node.attrs.get("beta", 0.5))])
    return (o, [x])         # relu, sigmoid, tanh


def _match_tree(tpl, t, env: Dict[str, Any]) -> bool:
    if tpl[0] == "in":
        if "x" in env:
            return env["x"] == t
        env["x"] = t
        return True
    if tpl[0] == "num":
        return t[0] == "num" and _f32(t[1]) == _f32(tpl[1])
    if t[0] != tpl[0] or len(t[1]) != len(tpl[1]):
        return False
    orders = [t[1]] + ([t[1][::-1]] if tpl[0] in _COMMUTATIVE and len(t[1]) == 2 else [])
    for args in orders:
        trial = dict(env)
        if all(_match_tree(p, a, trial) for p, a in zip(tpl[1], args)):
            env.update(trial)
            return True
    return False


class _Handle(NamedTuple):
    ref: Any                      # the program value (or, shape-only, None)
    shapes: Tuple[tuple, ...]     # its shape at every probe
    leaf: Any                     # the graph entry it is, when a leaf (foldability depends on its readers)


class Lowering:
    """Turns an expression tree into program pieces: steps, add/mul ops, act ops.  ``sink`` makes them
    (``ProgramBuilder``, or None: shapes only, to decide membership); ``leaf(t)`` gives the handle of
    a leaf; ``uses(entry)`` how often the region reads a leaf value and ``count(t, entry)`` how often
    a subtree does (a step folds into the op making a leaf only when that subtree reads it wholly)."""

    def __init__(self, leaf: Callable[[Any], _Handle], sink: Optional["ProgramBuilder"] = None,
                 uses: Optional[Callable[[Entry], int]] = None):
        self.leaf, self.sink, self.uses = leaf, sink, uses

    def lower(self, t) -> _Handle:
        if t[0] in ("in", "val"):
            return self.leaf(t)
        if t[0] == "num":
            raise FusionError("a constant expression (%r) is not a region value" % (t[1],))
        for step, tpl in COMPOSITES:
            env: Dict[str, Any] = {}
            if _match_tree(tpl, t, env):
                return self._step(self.lower(env["x"]), dict(step), t)
        fn, args = t
        nums = [a for a in args if a[0] == "num"]
        if fn in UNARY_STEPS:
            if args[0][0] == "num" or len(args) != 1 + _ARITY.get(fn, 0) or len(nums) != len(args) - 1:
                raise FusionError("%s(…) with a tensor parameter is not a region step" % fn)
            return self._step(self.lower(args[0]), UNARY_STEPS[fn]([_f32(a[1]) for a in args[1:]]), t)
        if fn in ("add", "sub", "mul", "div") and len(args) == 2 and len(nums) == 1:
            return self._step(self.lower(args[1] if args[0][0] == "num" else args[0]), _linear(fn, args), t)
        if fn in ("add", "mul") and len(args) == 2 and not nums:
            return self._binary(fn, self.lower(args[0]), self.lower(args[1]), t)
        raise FusionError("%s(…) is not an op or step of a region (%s)" % (fn, _spell(t)))

    def _foldable(self, h: _Handle, t) -> bool:
        if h.leaf is None:
            return True         # made inside this tree: read only by its parent
        return self.uses is not None and _count(t, h.leaf) == self.uses(h.leaf)

    def _step(self, h: _Handle, step: Dict[str, Any], t) -> _Handle:
        if self.sink is None:
            return _Handle(None, h.shapes, None)
        return _Handle(self.sink.step(h.ref, step, self._foldable(h, t)), h.shapes, None)

    def _binary(self, fn: str, a: _Handle, b: _Handle, t) -> _Handle:
        if len(a.shapes) != len(b.shapes):
            raise FusionError("the operands' shapes are not known at the same probe shapes")
        if fn == "add":
            if any(sa != sb for sa, sb in zip(a.shapes, b.shapes)):
                raise FusionError("add of shapes %s and %s: a region adds equal shapes" % (a.shapes[0], b.shapes[0]))
            full = a
        else:
            def gate(x, y) -> bool:      # y multiplies x: x's shape or (N, C, 1, 1)
                return all(sy == sx or tuple(sy) == (sx[0], sx[1], 1, 1) for sx, sy in zip(x.shapes, y.shapes))
            if gate(a, b):
                full = a
            elif gate(b, a):
                a, b = b, a
                full = a
            else:
                raise FusionError("mul of shapes %s and %s: a region multiplies equal shapes or by (N, C, 1, 1)"
                                  % (a.shapes[0], b.shapes[0]))
        if self.sink is None:
            return _Handle(None, full.shapes, None)
        equal = all(sa == sb for sa, sb in zip(a.shapes, b.shapes))
        ref = self.sink.binary(fn, a.ref, b.ref, self._foldable(a, t), self._foldable(b, t) and equal)
        return _Handle(ref, full.shapes, None)


def _linear(fn: str, args) -> Dict[str, Any]:
    """a·x + b of x + c, x − c, c − x, x · c, c · x, x / c (float32 constants; 1/c rounded once)."""
    left = args[0][0] == "num"
    c = _f32(args[0][1] if left else args[1][1])
    if fn == "add":
        scale, shift = 1.0, c
    elif fn == "sub":
        scale, shift = (-1.0, c) if left else (1.0, _f32(-c))
    elif fn == "mul":
        scale, shift = c, 0.0
    else:
        if left or c == 0.0:
            raise FusionError("div(%s) is not linear in x" % ("c, x" if left else "x, 0"))
        scale, shift = _f32(1.0 / np.float32(c)), 0.0
    return {"eltwise": "linear", "scale": scale, "shift": shift}


def _count(t, entry: Entry) -> int:
    """How often subtree ``t`` reads the value ``entry`` (a ``("val", entry)`` leaf)."""
    n, todo = 0, [t]
    while todo:
        s = todo.pop()
        if s[0] == "val":
            n += s[1] == entry
        elif s[0] not in ("num", "in"):
            todo.extend(s[1])
    return n


def _spell(t) -> str:
    if t[0] == "num":
        return repr(t[1])
    if t[0] in ("in", "val"):
        return "x" if t[0] == "val" else "x%d" % t[1]
    return "%s(%s)" % (t[0], ", ".join(_spell(a) for a in t[1]))


# ---------------------------------------------------------------- which nodes a region takes

def op_available() -> bool:
    """Whether the loaded op library implements fused_region on the CPU."""
    return implemented(OP, "cpu")


def inactive_reason(ctx) -> Optional[str]:
    """Why no region is made in this run at all (None: regions are made)."""
    if ctx.mode == "training":
        return ("fused_region is inference-only (no backward; BatchNorm reads its moving statistics): refused in "
                "mode='training', where the CNN block rules fuse")
    if getattr(ctx, "device", "cpu") != "cpu":
        return "fused_region is a CPU op (oneDNN 3.x): refused for device='gpu', where the CNN block rules fuse"
    if not op_available():
        return ("this op library has no CPU fused_region (cuda_kernels/fused_region/): rebuild it with "
                "python -m fusion.native.build")
    return None


def _shape_reason(e: Entry, ctx) -> Optional[str]:
    shapes = ctx.shapes(e)
    if not shapes:
        return NeedsShapes("the shape of '%s' is unknown" % e.node.name)
    if any(len(s) != 4 for s in shapes):
        return "'%s' has shape %s: a region's values are (N, C, H, W)" % (e.node.name, tuple(shapes[0]))
    dtype = ctx.dtype(e)
    if dtype != "float32":
        return ("'%s' is %s: a region computes float32 values" % (e.node.name, dtype) if dtype else
                NeedsShapes("the dtype of '%s' is unknown" % e.node.name))
    return None


def param_shape(e: Entry, ctx) -> Optional[tuple]:
    s = ctx.shape(e)
    if s is None and ctx.value(e) is not None:
        s = ctx.value(e).shape
    return None if s is None else tuple(int(d) for d in s)


def _param_reason(e: Entry, ctx) -> Optional[str]:
    if param_shape(e, ctx) is None:
        return NeedsShapes("the shape of parameter '%s' is unknown" % e.node.name)
    v = ctx.value(e)
    dtype = str(v.dtype) if v is not None else ctx.dtype(e)
    if dtype != "float32":
        return "parameter '%s' is %s, not float32" % (e.node.name, dtype)
    return None


def _pairs(node: Node, key: str, default: int) -> Tuple[int, int]:
    v = tuple(node.attrs[key]) if key in node.attrs and node.attrs[key] else ()
    return (int(v[0]), int(v[1])) if len(v) == 2 else (default, default)


def _true(v) -> bool:
    return v is True or str(v).lower() in ("true", "1")


def _attrs_reason(node: Node, kind: str, b: Dict[str, Any], ctx) -> Optional[str]:
    """What the contract cannot express in the op's attributes (None: it can)."""
    o, name = node.op, node.name
    if kind in ("conv", "deconv"):
        kernel = tuple(node.param("kernel", ()) or ())
        if len(kernel) != 2:
            return "%s '%s' is %d-D (kernel %s): a region takes 2-D %ss" % (o, name, len(kernel), kernel, o.lower())
        if node.param("layout") not in (None, "NCHW"):
            return "%s '%s' has layout %s: a region takes NCHW" % (o, name, node.param("layout"))
        if kind == "deconv":
            if int(node.param("num_group")) != 1:
                return "%s '%s' is grouped (num_group=%d): a region's deconv has one group" % (
                    o, name, int(node.param("num_group")))
            if any(int(v) for v in tuple(node.param("target_shape") or ())):
                return "%s '%s' sets target_shape (MXNet then computes its padding)" % (o, name)
            pad, adj = _pairs(node, "pad", 0), _pairs(node, "adj", 0)
            if any(a > p for a, p in zip(adj, pad)):
                return "%s '%s' has adj %s larger than pad %s" % (o, name, adj, pad)
        if _true(node.param("no_bias")) == ("bias" in b):
            return "%s '%s' has no_bias=%s with %d inputs" % (o, name, node.param("no_bias"), len(node.inputs))
        w = param_shape(b["w"], ctx)
        if w is not None and len(w) != 4:
            return "%s '%s' has a weight of shape %s" % (o, name, w)
        return None
    if kind == "pool":
        if node.attrs.get("layout") not in (None, "None", "NCHW"):
            return "Pooling '%s' has layout %s: a region takes NCHW" % (name, node.attrs.get("layout"))
        mode = node.attrs.get("pool_type", "max")
        if mode not in ("max", "avg"):
            return "Pooling '%s' is %s pooling: a region pools max or avg" % (name, mode)
        convention = node.attrs.get("pooling_convention", "valid")
        if not _true(node.attrs.get("global_pool", False)):
            if convention not in ("valid", "full"):
                return "Pooling '%s' uses the %s convention: a region takes valid or full" % (name, convention)
            if len(tuple(node.attrs.get("kernel", ()) or ())) != 2:
                return "Pooling '%s' is not 2-D (kernel %s)" % (name, node.attrs.get("kernel"))
        return None
    if kind == "global_mean":
        if o == "mean":
            axis = tuple(node.attrs.get("axis", ()) or ()) if not isinstance(node.attrs.get("axis"), int) else (
                node.attrs.get("axis"),)
            if sorted(a % 4 for a in axis) != [2, 3] or not _true(node.attrs.get("keepdims", False)) \
                    or _true(node.attrs.get("exclude", False)):
                return "mean '%s' is not over axes (2, 3) with keepdims: not a global pooling" % name
        else:
            size = node.attrs.get("output_size", 1)
            if tuple(size if isinstance(size, tuple) else (size,)) not in ((1,), (1, 1)):
                return "_contrib_AdaptiveAvgPooling2D '%s' has output_size %s, not 1" % (name, size)
        return None
    if kind == "concat":
        if int(node.param("dim", 1)) % 4 != 1:
            return "Concat '%s' joins axis %s: a region concatenates channels (dim=1)" % (name, node.param("dim", 1))
        return None
    if kind == "batchnorm":
        if int(node.param("axis")) % 4 != 1:
            return "BatchNorm '%s' normalizes axis %d: a region takes axis 1" % (name, node.param("axis"))
        if _true(node.param("output_mean_var")):
            return "BatchNorm '%s' also outputs its mean and variance" % name
        return None
    if o == "Activation" and node.attrs.get("act_type") not in ("relu", "sigmoid", "tanh", "softrelu"):
        return "Activation '%s' is %s: not a region step" % (name, node.attrs.get("act_type"))
    if o == "LeakyReLU" and (node.param("act_type") not in ("leaky", "elu", "gelu") or len(node.inputs) != 1):
        return "LeakyReLU '%s' is %s: a region takes leaky, elu and gelu" % (name, node.param("act_type"))
    return None


def _memo(ctx, key: str) -> Dict[int, Any]:
    return ctx.memo.setdefault(("region", key, ctx.graph.version), {})


def refused_in(node: Node, ctx) -> Optional[str]:
    """The reason a region holding ``node`` was refused in this run (None: none was)."""
    got = ctx.memo.get(("region", "refused"), {}).get(id(node))
    return got[1] if got is not None and got[0] is node else None


def _remember_refused(nodes: Sequence[Node], reason: str, anchor: str, ctx) -> None:
    """The nodes of a refused region are no region's in this run: the block rules that stood aside for
    them (``taken_by_region``) take them in another pass, which the engine runs for them."""
    store = ctx.memo.setdefault(("region", "refused"), {})
    for n in nodes:
        if store.get(id(n), (None,))[0] is not n:
            store[id(n)] = (n, "in the region at '%s', refused: %s" % (anchor, reason))
            ctx.another_pass = True


def refusal(node: Node, ctx) -> Optional[str]:
    """Why ``node`` is not taken into a region (None: it is), asked once per graph version."""
    memo = _memo(ctx, "refusal")
    if id(node) not in memo:
        memo[id(node)] = _refusal(node, ctx)
    return memo[id(node)]


def _refusal(node: Node, ctx) -> Optional[str]:
    why = inactive_reason(ctx)
    if why is not None:
        return why
    kind = "elementwise" if node.op == "fused_elemwise" else _KIND_OF.get(node.op)
    if kind is None:
        return "%s '%s' is not a region op" % (node.op, node.name)
    if kind == "gate_broadcast":
        return _gate_broadcast_reason(node, ctx)
    if kind == "concat" and len(node.inputs) > MAX_CONCAT:
        return "Concat '%s' joins %d values (a region's concat takes up to %d)" % (node.name, len(node.inputs),
                                                                                 MAX_CONCAT)
    if kind in ("unary", "binary", "elementwise"):
        if node.op in _ARITY_OF and len(node.inputs) != _ARITY_OF[node.op]:
            return "%s '%s' has %d inputs" % (node.op, node.name, len(node.inputs))
        b = {"x%d" % i: e for i, e in enumerate(node.inputs)}
    else:
        b = bind(node, ctx)
    if b is None:
        return "%s '%s' reads computed values where a region reads parameters" % (node.op, node.name)
    reason = _attrs_reason(node, kind, b, ctx)
    if reason:
        return reason
    roles = _PARAM_ROLES.get(kind, ())
    for key in roles:
        if key in b:
            reason = _param_reason(b[key], ctx)
            if reason:
                return reason
    for key, e in b.items():
        if key not in roles and isinstance(e, Entry):
            reason = _shape_reason(e, ctx)
            if reason:
                return reason
    reason = _shape_reason(Entry(node), ctx)
    if reason:
        return reason
    if kind in ("unary", "binary", "elementwise"):
        try:
            tree = node_tree(node)
            if tree[0] in ("in", "num"):
                return "%s '%s' computes %s: nothing for a region to do" % (
                    node.op, node.name, "its input" if tree[0] == "in" else "a constant")
            Lowering(lambda t: _Handle(None, ctx.shapes(node.inputs[t[1]]), None)).lower(tree)
        except (FusionError, AssertionError, KeyError, IndexError, ValueError) as e:
            return "%s '%s': %s" % (node.op, node.name, e)
    return None


def _gate_broadcast_reason(node: Node, ctx) -> Optional[str]:
    """Why ``broadcast_like(g, y)`` is not a gate broadcast a region reads through (None: it is): its
    readers are products with y, g is (N, C, 1, 1) with y's N and C, and its output has y's shape or
    g's, at every probe."""
    name = node.name
    if len(node.inputs) != 2:
        return "broadcast_like '%s' has %d inputs" % (name, len(node.inputs))
    gate, like = node.inputs
    for u, slot in ctx.graph.consumers().get(node, ()):
        if u.op not in MUL_OPS or len(u.inputs) != 2 or u.inputs[1 - slot] != like:
            return ("broadcast_like '%s' is read by %s '%s': a region reads it only as the gate of a product "
                    "with the value it takes its shape from ('%s')" % (name, u.op, u.name, like.node.name))
    for e in (gate, like, Entry(node)):
        reason = _shape_reason(e, ctx)
        if reason:
            return reason
    gs, ls, outs = ctx.shapes(gate), ctx.shapes(like), ctx.shapes(Entry(node))
    if not len(gs) == len(ls) == len(outs):
        return NeedsShapes("the shapes around broadcast_like '%s' are not known at the same probe shapes" % name)
    for g, y, out in zip(gs, ls, outs):
        g, y, out = tuple(g), tuple(y), tuple(out)
        if g != (y[0], y[1], 1, 1):
            return ("broadcast_like '%s' broadcasts '%s' of shape %s, not an (N, C, 1, 1) gate of '%s' %s"
                    % (name, gate.node.name, g, like.node.name, y))
        if out not in (y, g):
            return ("broadcast_like '%s' (lhs_axes=%s, rhs_axes=%s) gives shape %s, neither '%s''s %s nor the "
                    "gate's %s: not the gate broadcast over the map" % (
                        name, node.attrs.get("lhs_axes"), node.attrs.get("rhs_axes"), out, like.node.name, y, g))
    return None


def member(node: Node, ctx) -> bool:
    return refusal(node, ctx) is None and refused_in(node, ctx) is None


def exportable(node: Node, ctx) -> bool:
    """Whether a region may give back ``node``'s value as one of its outputs (a gate broadcast is read
    through, its value never made)."""
    return _KIND_OF.get(node.op) != "gate_broadcast"


def exported_nodes(region: Sequence[Node], ctx) -> List[Node]:
    """The nodes of ``region`` (in order, the anchor -- the last -- aside) whose values are read outside
    it or are graph outputs: the region's outputs after its anchor's."""
    inside = {id(n) for n in region}
    users, heads = ctx.graph.consumers(), {id(e.node) for e in ctx.graph.heads}
    return [n for n in region[:-1]
            if id(n) in heads or any(id(u) not in inside for u, _ in users.get(n, ()))]


def why_not(node: Node, ctx) -> Optional[str]:
    """The near-miss of a convolution no region takes (the other ops' refusals are the cuts' reasons;
    an op library without fused_region is not news: regions are then simply not made)."""
    if node.op not in CONV_OPS or refused_in(node, ctx) is not None or not op_available():
        return None
    return refusal(node, ctx)


def taken_by_region(m: Match) -> Optional[NearMiss]:
    """For the CNN block rules: a NearMiss when the regions of this run take every op of ``m`` (the
    region rule runs and fused_region is made here, and each op is one a region takes); None otherwise."""
    ctx = m.ctx
    if RULE not in getattr(ctx, "rules", ()) or inactive_reason(ctx) is not None:
        return None
    if m.nodes and all(member(n, ctx) for n in m.nodes):
        return NearMiss("taken by a region: fused_region takes all of these ops (rule region; "
                        "--rules default,-region keeps this rule)")
    return None


# ---------------------------------------------------------------- the program

class ProgramBuilder:
    """The program of one region (see cuda_kernels/fused_region/README.md), made op by op."""

    def __init__(self, region: Sequence[Node], ctx):
        self.ctx = ctx
        self.region = list(region)
        self.inside = {id(n) for n in region}
        #: the values the region gives back, in output order: the anchor's, then those read outside it
        self.outputs: List[Entry] = [Entry(region[-1])] + [Entry(n) for n in exported_nodes(region, ctx)]
        self.data: List[Entry] = []
        self.params: List[Entry] = []
        self.ops: List[Dict[str, Any]] = []
        self._data: Dict[Entry, int] = {}
        self._params: Dict[Entry, int] = {}
        self.value: Dict[Entry, Any] = {}       # a graph value inside -> its program value ("in", i) | ("op", k)
        self.convs, self.mmacs = 0, 0.0

    # -- references
    def ref(self, e: Entry) -> Any:
        if id(e.node) in self.inside:
            return self.value[e]
        if e not in self._data:
            self._data[e] = len(self.data)
            self.data.append(e)
        return ("in", self._data[e])

    def param(self, e: Entry) -> int:
        if e not in self._params:
            self._params[e] = len(self.params)
            self.params.append(e)
        return self._params[e]

    def add(self, d: Dict[str, Any]) -> Any:
        self.ops.append(d)
        return ("op", len(self.ops) - 1)

    # -- what lowering makes
    def step(self, ref, step: Dict[str, Any], foldable: bool) -> Any:
        if foldable and ref[0] == "op":
            self.ops[ref[1]].setdefault("post", []).append(step)
            return ref
        return self.add({"op": "act", "in": ref, "post": [step]})

    @staticmethod
    def _before(u, k: int) -> bool:
        return u[0] == "in" or u[1] < k

    def binary(self, fn: str, a, b, a_foldable: bool, b_foldable: bool) -> Any:
        """a + b, or a · b with b of a's shape or (N, C, 1, 1): a step of the op making a (or, for equal
        shapes, b) where nothing else reads it and the other operand is made before it; else an op."""
        for x, y, ok in ((a, b, a_foldable), (b, a, b_foldable)):
            if ok and x[0] == "op" and x != y and self._before(y, x[1]):
                self.ops[x[1]].setdefault("post", []).append({fn: y})
                return x
        return self.add({"op": fn, "in": [a, b]})

    # -- the region's ops
    def build(self) -> "ProgramBuilder":
        ctx, region = self.ctx, self.region
        users = ctx.graph.consumers()
        anchor = region[-1]
        given = {id(e.node) for e in self.outputs}
        inline = {id(n) for n in region if id(n) not in given and n.op in ELEMENTWISE and _inlined(n, users, self.inside)}
        # gate broadcasts are read through: their products read the gate itself (y · g)
        through = {id(n) for n in region if _KIND_OF.get(n.op) == "gate_broadcast"}
        trees = {}

        def operand(e: Entry):
            while id(e.node) in through:
                e = e.node.inputs[0]
            return tree(e.node) if id(e.node) in inline else ("val", e)

        def tree(n: Node):
            return _substitute(node_tree(n), n, operand)

        for n in region:
            if n.op in ELEMENTWISE and id(n) not in inline:
                trees[id(n)] = tree(n)
        uses: Dict[Entry, int] = {}
        for n in region:
            if id(n) in through:
                continue
            if n.op in ELEMENTWISE:
                if id(n) in trees:
                    for e in _leaves(trees[id(n)]):
                        uses[e] = uses.get(e, 0) + 1
            else:
                for e in n.inputs:
                    uses[e] = uses.get(e, 0) + 1
        for e in self.outputs:      # a value given back stays as it is: no step runs in place over it
            uses[e] = uses.get(e, 0) + 1

        def leaf(t) -> _Handle:
            e = t[1]
            return _Handle(self.ref(e), ctx.shapes(e), e)

        lowering = Lowering(leaf, self, lambda e: uses.get(e, 0))
        for n in region:
            if id(n) in inline or id(n) in through:
                continue
            if n.op in ELEMENTWISE:
                self.value[Entry(n)] = lowering.lower(trees[id(n)]).ref
            else:
                self.value[Entry(n)] = self._op(n)
        refs = [self.value[e] for e in self.outputs]
        if len(set(refs)) != len(refs):
            raise FusionError("two of the region's outputs are one program value")
        self.output_refs = refs
        return self

    def _op(self, n: Node) -> Any:
        ctx = self.ctx
        kind = _KIND_OF[n.op]
        b = bind(n, ctx)
        if kind == "conv":
            kh, kw = tuple(n.param("kernel"))
            w = param_shape(b["w"], ctx)
            out = ctx.shape(Entry(n))
            self.convs += 1
            self.mmacs += float(np.prod(out)) * float(np.prod(w[1:])) / 1e6
            return self.add({"op": "conv", "in": self.ref(b["x"]), "weight": self.param(b["w"]),
                             "bias": self.param(b["bias"]) if "bias" in b else None,
                             "kernel": [kh, kw], "stride": list(_pairs(n, "stride", 1)), "pad": list(_pairs(n, "pad", 0)),
                             "dilate": list(_pairs(n, "dilate", 1)), "groups": int(n.param("num_group")),
                             "filters": int(n.attrs["num_filter"])})
        if kind == "deconv":
            kh, kw = tuple(n.param("kernel"))
            x = ctx.shape(b["x"])
            self.convs += 1
            self.mmacs += float(np.prod(x)) * float(n.param("num_filter")) * kh * kw / 1e6
            return self.add({"op": "deconv", "in": self.ref(b["x"]), "weight": self.param(b["w"]),
                             "bias": self.param(b["bias"]) if "bias" in b else None,
                             "kernel": [kh, kw], "stride": list(_pairs(n, "stride", 1)), "pad": list(_pairs(n, "pad", 0)),
                             "dilate": list(_pairs(n, "dilate", 1)), "adj": list(_pairs(n, "adj", 0)),
                             "filters": int(n.param("num_filter"))})
        if kind in ("pool", "global_mean"):
            if kind == "pool":
                mode = n.attrs.get("pool_type", "max")
                glob = _true(n.attrs.get("global_pool", False))
                kernel = tuple(n.attrs.get("kernel", ()) or ()) or (1, 1)
                d = {"op": "pool", "in": self.ref(b["x"]), "mode": mode, "kernel": [int(k) for k in kernel[:2]],
                     "stride": list(_pairs(n, "stride", 1)), "pad": list(_pairs(n, "pad", 0)),
                     "convention": "valid" if glob else n.attrs.get("pooling_convention", "valid"), "global": glob}
                if mode == "avg":
                    cip = n.attrs.get("count_include_pad", None)
                    d["count_include_pad"] = True if cip is None else _true(cip)
            else:
                d = {"op": "pool", "in": self.ref(b["x"]), "mode": "avg", "kernel": [1, 1], "stride": [1, 1],
                     "pad": [0, 0], "convention": "valid", "global": True, "count_include_pad": True}
            return self.add(d)
        if kind == "concat":
            return self.add({"op": "concat", "in": [self.ref(b["x%d" % i]) for i in range(len(n.inputs))]})
        if kind == "batchnorm":
            return self.add({"op": "batchnorm", "in": self.ref(b["x"]), "gamma": self.param(b["gamma"]),
                             "beta": self.param(b["beta"]), "mean": self.param(b["mean"]), "var": self.param(b["var"]),
                             "eps": float(n.param("eps")), "fix_gamma": bool(_true(n.param("fix_gamma")))})
        raise FusionError("%s '%s' is not a region op" % (n.op, n.name))

    # -- the result
    def program(self) -> Dict[str, Any]:
        D = len(self.data)

        def number(r) -> int:
            return r[1] if r[0] == "in" else D + r[1]

        ops = []
        for d in self.ops:
            out = {}
            for k, v in d.items():
                if k == "in":
                    out[k] = [number(r) for r in v] if isinstance(v, list) else number(v)
                elif k == "post":
                    out[k] = [{sk: (number(sv) if sk in ("add", "mul") else sv) for sk, sv in s.items()} for s in v]
                else:
                    out[k] = v
            ops.append(out)
        return {"version": PROGRAM_VERSION, "params": [list(param_shape(e, self.ctx)) for e in self.params],
                "ops": ops, "outputs": [number(r) for r in self.output_refs]}

    @property
    def steps(self) -> int:
        return sum(len(d.get("post", ())) for d in self.ops)

    def case(self) -> Dict[str, Any]:
        """The cost case (fusion/engine/cost.py): convolutions, other ops and steps, multiply-adds."""
        return {"convs": self.convs, "other_ops": len(self.ops) - self.convs + self.steps,
                "mmacs": round(self.mmacs, 3)}


def _inlined(n: Node, users, inside) -> bool:
    """An elementwise op whose one reader is an elementwise op of the region reading it once: its
    expression becomes part of that reader's."""
    readers = users.get(n, ())
    if len(readers) != 1:
        return False
    u, slot = readers[0]
    if id(u) not in inside or u.op not in ELEMENTWISE:
        return False
    if u.op == "fused_elemwise":
        return sum(1 for leaf in _tree_inputs(node_tree(u)) if leaf == slot) == 1
    return True


def _tree_inputs(t) -> List[int]:
    out, todo = [], [t]
    while todo:
        s = todo.pop()
        if s[0] == "in":
            out.append(s[1])
        elif s[0] not in ("num", "val"):
            todo.extend(s[1])
    return out


def _substitute(t, node: Node, value: Callable[[Entry], Any]):
    """``t`` with each ``("in", k)`` replaced by ``value(node.inputs[k])``."""
    if t[0] == "in":
        return value(node.inputs[t[1]])
    if t[0] in ("num", "val"):
        return t
    return (t[0], [_substitute(a, node, value) for a in t[1]])


def _leaves(t) -> List[Entry]:
    out, todo = [], [t]
    while todo:
        s = todo.pop()
        if s[0] == "val":
            out.append(s[1])
        elif s[0] not in ("num", "in"):
            todo.extend(s[1])
    return out


def build_program(region: Sequence[Node], ctx) -> ProgramBuilder:
    """The program of ``region`` (FusionError: the region cannot be written as one)."""
    try:
        return ProgramBuilder(region, ctx).build()
    except FusionError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AssertionError) as e:
        raise FusionError("the region cannot be written as a program (%s: %s)" % (type(e).__name__, e)) from None


# ---------------------------------------------------------------- where a region was cut, and why

def _cut_reason(e: Entry, region: Sequence[Node], ctx, users, heads) -> str:
    """Why the region does not reach back over ``e``, a value it reads (in the order the pattern's
    growth asks: a variable, another output than the first, an op no region takes, a value read
    outside that the region could not give back)."""
    nd, region_ids = e.node, {id(n) for n in region}
    if nd.is_variable:
        return "a graph input"
    if nd.op == OP:
        return "the output of another region"
    if e.index != 0:
        return "output %d of %s '%s' (a region takes an op's first output)" % (e.index, nd.op, nd.name)
    why = refusal(nd, ctx)
    if why:
        return why
    holder = getattr(ctx, "claimed", {}).get(id(nd))
    if holder is not None and holder != region[-1].name:
        return "in the region at '%s'" % holder
    outside = [u for u, _ in users.get(nd, ()) if id(u) not in region_ids]
    if outside or id(nd) in heads:
        read = ("also read by %s '%s' outside the region" % (outside[0].op, outside[0].name) if outside
                else "'%s' is also a graph output" % nd.name)
        if not exportable(nd, ctx):
            return read + " (a gate broadcast is read through, never made)"
        back = leads_back(outside, region_ids, users, region[-1].pos)
        if back is not None:
            return read + ", which leads back into it (to %s '%s'): one op cannot give it and read what " \
                          "follows from it" % (back.op, back.name)
        if len(exported_nodes(region, ctx)) + 1 >= MAX_OUTPUTS:
            return read + "; the region gives back its limit of %d values" % MAX_OUTPUTS
    return refused_in(nd, ctx) or "the region reached its limit of %d nodes or %d inputs" % (MAX_NODES, MAX_INPUTS)


def _out_reasons(anchor: Node, region_ids: set, ctx, users, heads) -> List[Tuple[str, str]]:
    """Why the region ends at ``anchor``: (what reads its output, why that is not in the region)."""
    out = [("the graph's outputs", "a graph output")] if id(anchor) in heads else []
    for u, _ in users.get(anchor, ()):
        if id(u) in region_ids:
            continue
        why = refusal(u, ctx) if u.op != OP else "another region"
        out.append(("%s '%s'" % (u.op, u.name), _short(why or refused_in(u, ctx) or "in another region", u)))
    return out


def _short(reason: str, node: Node) -> str:
    """``reason`` without the op and name it starts with (the line names them already)."""
    lead = "%s '%s' " % (node.op, node.name)
    if not reason.startswith(lead):
        return reason
    rest = reason[len(lead):]
    return rest[3:] if rest.startswith("is ") else rest


def describe(region: Sequence[Node], prog: ProgramBuilder, ctx) -> Dict[str, Any]:
    """The report's account of a region (``Builder.details``): a summary line, and a line per cut."""
    ids = {id(n) for n in region}
    users, heads = ctx.graph.consumers(), {id(e.node) for e in ctx.graph.heads}
    anchor = region[-1]
    ins = [("'%s'" % e.node.name + ("[%d]" % e.index if e.index else ""),
            _short(_cut_reason(e, region, ctx, users, heads), e.node)) for e in prog.data]
    outs = _out_reasons(anchor, ids, ctx, users, heads)
    given = [("'%s'" % e.node.name, ", ".join(sorted({"%s '%s'" % (u.op, u.name) for u, _ in users.get(e.node, ())
                                                        if id(u) not in ids})) or "a graph output")
             for e in prog.outputs[1:]]
    cut_in = "; ".join("%s (%s)" % kv for kv in ins[:2]) + (" (+%d more)" % (len(ins) - 2) if len(ins) > 2 else "")
    cut_out = "%s (%s)" % outs[0] if outs else "nothing"
    also = "; also gives back %s" % ", ".join(v for v, _ in given[:3]) + (
        " (+%d more)" % (len(given) - 3) if len(given) > 3 else "") if given else ""
    summary = ("region '%s': %d ops → %s (%d convolution(s), %d other op(s), %d post step(s)); "
               "cut at %s → … → %s%s" % (anchor.name, len(region), OP, prog.convs, len(prog.ops) - prog.convs,
                                          prog.steps, cut_in or "nothing", cut_out, also))
    lines = ["reads %s: %s" % kv for kv in ins] + ["read by %s: %s" % kv for kv in outs]
    lines += ["gives back %s, read by %s" % kv for kv in given]
    lines.append("%d data input(s), %d parameter(s), %d program op(s), %.1f M multiply-adds"
                 % (len(prog.data), len(prog.params), len(prog.ops), prog.mmacs))
    return {"summary": summary, "lines": lines, "ops": len(region), "convolutions": prog.convs,
            "program_ops": len(prog.ops), "post_steps": prog.steps, "data_inputs": len(prog.data),
            "params": len(prog.params), "outputs": len(prog.outputs),
            "cuts": {"inputs": [{"value": v, "reason": r} for v, r in ins],
                     "outputs": [{"reader": v, "reason": r} for v, r in outs]}}


# ---------------------------------------------------------------- the rule

class RegionRule(Rule):
    name = RULE
    # after bn_folding (20-40) and pool_before_pointwise_conv (19); before the block rules it stands in for
    # that run after it (grouped_conv 15-16, dense_block 15, inverted_residual 8: they take a refused
    # region's blocks in the same pass) and before elementwise (10)
    benefit = 18
    inference_only = True
    training_reason = "fused_region is inference-only (no backward); refused in mode='training'"
    emits = (OP,)
    description = ("maximal regions of convolutions, poolings, concatenations, BatchNorms, adds, SE products and "
                   "activations → one fused_region (oneDNN 3.x, CPU)")

    def pattern(self) -> Pattern:
        return Region(member, "region", min_nodes=2, max_nodes=MAX_NODES, max_inputs=MAX_INPUTS, ops=ANCHOR_OPS,
                      why_not=why_not, max_outputs=MAX_OUTPUTS, exportable=exportable)

    def exported(self, m: Match) -> set:
        return {id(n) for n in exported_nodes(m["region"], m.ctx)}

    def check(self, m: Match) -> Optional[str]:
        region, ctx = m["region"], m.ctx
        try:
            prog = build_program(region, ctx)
        except FusionError as e:
            return self._refuse(m, "the region cannot be written as a program: %s" % e)
        if prog.convs == 0:
            return self._refuse(m, NearMiss("no convolution in it (%s): a region needs one" % ", ".join(
                sorted({n.op for n in region}))))
        from fusion.engine import cost
        decision = cost.decide(OP, ctx.precision, "forward", prog.case(), kind="cpu")
        if not decision.fuse:
            return self._refuse(m, NearMiss("region of %d ops: %s" % (len(region), decision.reason)))
        return None

    @staticmethod
    def _refuse(m: Match, reason: str) -> str:
        _remember_refused(m["region"], reason, m.anchor.name, m.ctx)
        return reason

    def refused(self, m: Match, reason: str) -> None:
        _remember_refused(m["region"], reason, m.anchor.name, m.ctx)

    def rewrite(self, m: Match, b: Builder) -> Entry:
        region = m["region"]
        prog = build_program(region, m.ctx)
        program = prog.program()
        k = len(prog.outputs)
        attrs = {"program": json.dumps(program, separators=(",", ":")), "num_data": len(prog.data),
                 "num_outputs": k}
        y = b.op(OP, prog.data + prog.params, attrs=attrs, name=m.anchor.name, num_outputs=k)
        b.details.update(describe(region, prog, m.ctx))
        if k == 1:
            return y
        return dict(zip(prog.outputs, y))


RULES: List[Rule] = [RegionRule()]
