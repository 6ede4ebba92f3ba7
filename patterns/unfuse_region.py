r"""``fused_region`` → the stock MXNet ops of its program: the op's reference semantics.

The program (``cuda_kernels/fused_region/README.md``) is read op by op, each op's ``post`` steps
after it::

    conv       Convolution(x, W[, b], kernel, stride, pad, dilate, num_group, num_filter, no_bias)
    pool       Pooling(x, pool_type, kernel, stride, pad, pooling_convention, global_pool
               [, count_include_pad])
    concat     Concat(x₀, …, dim=1)
    add        elemwise_add(a, b)                 mul       broadcast_mul(a, b)
    batchnorm  BatchNorm(x, γ, β, μ, σ², eps, fix_gamma, axis=1)   μ, σ² auxiliary states again
    act        (the identity: its steps apply to its input)

    relu | sigmoid | tanh | softrelu    Activation(act_type)
    leaky s | elu a | gelu              LeakyReLU(leaky, slope=s) | LeakyReLU(elu, slope=a) | LeakyReLU(gelu)
    clip lo hi                          clip(a_min=lo, a_max=hi)
    swish                               elemwise_mul(x, Activation(sigmoid)(x))
    hard_swish                          elemwise_mul(x, _div_scalar(clip(_plus_scalar(x, 3), 0, 6), 6))
    hard_sigmoid α β                    hard_sigmoid(alpha=α, beta=β)
    linear a b                          _mul_scalar(x, a) [→ _plus_scalar(·, b)]  (b alone: _plus_scalar;
                                        a = −1: _rminus_scalar(x, b))
    {"add": v} | {"mul": v}             elemwise_add(x, v) | broadcast_mul(x, v)

The parameters keep their names: a BatchNorm's moving mean and variance, ordinary inputs of the
fused op (``arg_params`` of the fused model), are auxiliary states of the BatchNorm again (move
them to ``aux_params`` to bind: ``sym.list_auxiliary_states()`` names them).  The stock op that makes
the region's output is named after the fused node (the graph's output names stay).  A program this
reads wrongly (an unknown op, step or field, a value read before it is made) is refused with the
reason, the fused op kept.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule
from fusion.ir.errors import FusionError
from fusion.ir.graph import Entry, Node
from fusion.ir.matcher import Match
from fusion.ir.pattern import Pattern, Region

from ._unfuse_base import UnfuseRule

OP = "fused_region"
_ACT_TYPES = ("relu", "sigmoid", "tanh", "softrelu")


def _pair(v, what: str) -> tuple:
    if not isinstance(v, list) or len(v) != 2 or not all(isinstance(i, int) for i in v):
        raise FusionError("%s is %r, not two whole numbers" % (what, v))
    return tuple(v)


class _Stock:
    """Writes one region's program as stock ops with ``b``; values by their program numbers."""

    def __init__(self, b: Builder, f: Node, program: Dict[str, Any]):
        self.b, self.f, self.program = b, f, program
        D = int(f.attrs["num_data"])
        self.params: List[Entry] = list(f.inputs[D:])
        if len(self.params) != len(program.get("params", ())):
            raise FusionError("%s '%s' has %d parameter inputs, its program %d" % (
                OP, f.name, len(self.params), len(program.get("params", ()))))
        self.values: List[Entry] = list(f.inputs[:D])
        outputs = program.get("outputs")
        if not isinstance(outputs, list) or not outputs:
            raise FusionError("the program has no outputs")
        #: program value -> the name its last stock op gets (the fused node's outputs keep their names)
        self.names = {}
        for k, v in enumerate(outputs):
            self.names.setdefault(v, f.name if k == 0 else "%s_output%d" % (f.name, k))

    def value(self, v, where: str) -> Entry:
        if not isinstance(v, int) or not 0 <= v < len(self.values):
            raise FusionError("%s reads value %r, which is not made before it" % (where, v))
        return self.values[v]

    def param(self, d: Dict[str, Any], key: str, where: str) -> Optional[Entry]:
        p = d.get(key)
        if p is None and key == "bias":
            return None
        if not isinstance(p, int) or not 0 <= p < len(self.params):
            raise FusionError("%s: %s is %r, not a parameter number" % (where, key, p))
        return self.params[p]

    def op(self, op_name: str, inputs: List[Entry], attrs: Dict[str, Any], name: str) -> Entry:
        return self.b.op(op_name, inputs, attrs=attrs, name=name)

    def build(self) -> Dict[int, Entry]:
        ops = self.program.get("ops")
        if not isinstance(ops, list):
            raise FusionError("the program has no ops")
        for k, d in enumerate(ops):
            where = "op %d (%s)" % (k, d.get("op") if isinstance(d, dict) else d)
            if not isinstance(d, dict):
                raise FusionError("%s is not an object" % where)
            number = len(self.values)
            post = d.get("post") or []
            final = self.names.get(number)
            base = "%s_op%d_%s" % (self.f.name, k, d.get("op"))
            y = self._op(d, where, final if not post else base)
            for j, step in enumerate(post):
                last = j == len(post) - 1
                y = self._step(y, step, "%s post %d" % (where, j),
                               final if last and final else "%s_post%d" % (base, j))
            self.values.append(y)
        outs = {}
        for k, v in enumerate(self.program["outputs"]):
            outs[k] = self.value(v, "output %d" % k)
        return outs

    def _op(self, d: Dict[str, Any], where: str, name: str) -> Entry:
        kind = d.get("op")
        if kind in ("conv", "deconv"):
            w, bias = self.param(d, "weight", where), self.param(d, "bias", where)
            attrs = {"kernel": _pair(d["kernel"], where + " kernel"), "stride": _pair(d["stride"], where + " stride"),
                     "pad": _pair(d["pad"], where + " pad"), "dilate": _pair(d["dilate"], where + " dilate"),
                     "num_filter": int(d["filters"]), "no_bias": bias is None}
            if kind == "conv":
                attrs["num_group"] = int(d["groups"])
            else:
                attrs.update(adj=_pair(d.get("adj", [0, 0]), where + " adj"), num_group=1)
            ins = [self.value(d["in"], where), w] + ([bias] if bias is not None else [])
            return self.op("Convolution" if kind == "conv" else "Deconvolution", ins, attrs, name)
        if kind == "pool":
            if d.get("mode") not in ("max", "avg") or d.get("convention") not in ("valid", "full"):
                raise FusionError("%s: mode %r / convention %r" % (where, d.get("mode"), d.get("convention")))
            attrs = {"pool_type": d["mode"], "kernel": _pair(d["kernel"], where + " kernel"),
                     "stride": _pair(d["stride"], where + " stride"), "pad": _pair(d["pad"], where + " pad"),
                     "pooling_convention": d["convention"], "global_pool": bool(d.get("global", False))}
            if d["mode"] == "avg":
                attrs["count_include_pad"] = bool(d.get("count_include_pad", True))
            return self.op("Pooling", [self.value(d["in"], where)], attrs, name)
        if kind == "concat":
            ins = [self.value(v, where) for v in d["in"]]
            return self.op("Concat", ins, {"dim": 1, "num_args": len(ins)}, name)
        if kind in ("add", "mul"):
            a, b = (self.value(v, where) for v in d["in"])
            return self.op("elemwise_add" if kind == "add" else "broadcast_mul", [a, b], {}, name)
        if kind == "batchnorm":
            ins = [self.value(d["in"], where)] + [self.param(d, k, where) for k in ("gamma", "beta", "mean", "var")]
            return self.op("BatchNorm", ins, {"eps": float(d["eps"]), "fix_gamma": bool(d["fix_gamma"]), "axis": 1},
                           name)
        if kind == "act":
            return self.value(d["in"], where)
        raise FusionError("%s: unknown op %r" % (where, kind))

    def _step(self, x: Entry, s: Dict[str, Any], where: str, name: str) -> Entry:
        if not isinstance(s, dict):
            raise FusionError("%s is not an object" % where)
        if "add" in s:
            return self.op("elemwise_add", [x, self.value(s["add"], where)], {}, name)
        if "mul" in s:
            return self.op("broadcast_mul", [x, self.value(s["mul"], where)], {}, name)
        kind = s.get("eltwise")
        if kind in _ACT_TYPES:
            return self.op("Activation", [x], {"act_type": kind}, name)
        if kind == "leaky":
            return self.op("LeakyReLU", [x], {"act_type": "leaky", "slope": float(s["slope"])}, name)
        if kind == "elu":
            return self.op("LeakyReLU", [x], {"act_type": "elu", "slope": float(s["alpha"])}, name)
        if kind == "gelu":
            return self.op("LeakyReLU", [x], {"act_type": "gelu"}, name)
        if kind == "clip":
            return self.op("clip", [x], {"a_min": float(s["lo"]), "a_max": float(s["hi"])}, name)
        if kind == "hard_sigmoid":
            return self.op("hard_sigmoid", [x], {"alpha": float(s["alpha"]), "beta": float(s["beta"])}, name)
        if kind == "swish":
            g = self.op("Activation", [x], {"act_type": "sigmoid"}, name + "_sigmoid")
            return self.op("elemwise_mul", [x, g], {}, name)
        if kind == "hard_swish":       # GluonCV's HardSwish: x * (clip(x + 3, 0, 6) / 6)
            g = self.op("_plus_scalar", [x], {"scalar": 3.0}, name + "_plus3")
            g = self.op("clip", [g], {"a_min": 0.0, "a_max": 6.0}, name + "_relu6")
            g = self.op("_div_scalar", [g], {"scalar": 6.0}, name + "_div6")
            return self.op("elemwise_mul", [x, g], {}, name)
        if kind == "linear":
            a, c = float(s["scale"]), float(s["shift"])
            if c == 0.0:
                return self.op("_mul_scalar", [x], {"scalar": a}, name)
            if a == 1.0:
                return self.op("_plus_scalar", [x], {"scalar": c}, name)
            if a == -1.0:
                return self.op("_rminus_scalar", [x], {"scalar": c}, name)
            return self.op("_plus_scalar", [self.op("_mul_scalar", [x], {"scalar": a}, name + "_scale")],
                           {"scalar": c}, name)
        raise FusionError("%s: unknown step %r" % (where, s))


class UnfuseRegion(UnfuseRule):
    def __init__(self):
        super().__init__(OP, 1)

    def pattern(self) -> Pattern:
        # the fused node alone (a Region of one node): its inputs, hundreds in a long region, are read
        # from the node, not matched one by one
        return Region(lambda n, ctx: n.op == OP, "f", min_nodes=1, max_nodes=1, ops=(OP,))

    def check(self, m: Match) -> Optional[str]:
        f = m.anchor
        try:
            program(f)
        except FusionError as e:
            return str(e)
        return None

    def rewrite(self, m: Match, b: Builder):
        f = m.anchor
        try:
            outs = _Stock(b, f, program(f)).build()
        except (KeyError, TypeError, ValueError) as e:
            raise FusionError("%s '%s': its program is malformed (%s: %s)" % (OP, f.name, type(e).__name__, e)) from None
        if len(outs) == 1:
            return outs[0]
        return {Entry(f, k): e for k, e in outs.items()}


def program(f: Node) -> Dict[str, Any]:
    """The program of fused_region ``f`` (FusionError naming what is wrong)."""
    try:
        p = json.loads(f.attrs.raw("program") or "")
    except ValueError as e:
        raise FusionError("%s '%s': its program is not JSON (%s)" % (OP, f.name, e)) from None
    if not isinstance(p, dict) or p.get("version") != 1:
        raise FusionError("%s '%s': a program of version %r (this reads version 1)" % (
            OP, f.name, p.get("version") if isinstance(p, dict) else None))
    if "num_data" not in f.attrs:
        raise FusionError("%s '%s' has no num_data" % (OP, f.name))
    return p


RULES: List[Rule] = [UnfuseRegion()]
