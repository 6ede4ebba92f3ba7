r"""FullyConnected [+ bias] [+ activation] → ``fused_dense``.

Matched::

    z = FullyConnected(x, W[, b], flatten=f)
    z = z | z + c                                 broadcast_add/elemwise_add of a bias parameter (N,) / (1,…,N)
    y = z | act(z)                                Activation(relu|sigmoid|tanh|softrelu), relu, sigmoid, tanh,
                                                  LeakyReLU(leaky|gelu), GELU written out (erf or tanh form)

Rewrite: ``y = fused_dense(x, W, b', act=…, flatten=f)`` with ``b' = b + c``
(a new parameter when both exist) — one GEMM through oneDNN's sgemm on a weight
prepared once, with bias and activation applied while the output tile is in cache.
The arithmetic is the same; only the summation order inside the GEMM differs, as
between any two BLAS libraries (fp32 error ~1e-6 relative).

A bare FullyConnected (no bias add, no activation) is rewritten too when it has
many rows (≥ 8, e.g. a projection over a sequence): the GEMM alone is faster than
MXNet's there, while on a few rows (a classifier head at small batch) MXNet's own
FullyConnected is as fast and is left alone — as is a ``flatten=True`` layer whose
batch size is unknown.  Refused: a bias add whose other operand is not a parameter
of N values; LeakyReLU kinds other than leaky/gelu (prelu, elu, selu, rrelu).
"""
from __future__ import annotations

from typing import List, Optional

from fusion.graph import Entry
from fusion.matcher import Match
from fusion.pattern import Const, OneOf, Pattern, Var, op
from fusion.rewrite import Builder
from fusion.rule import Rule

from ._dtypes import float32_reason
from .gelu import gelu_erf_pattern, gelu_erf_reason, gelu_tanh_pattern, gelu_tanh_reason

ACTIVATIONS = {"relu": "relu", "sigmoid": "sigmoid", "tanh": "tanh", "softrelu": "softrelu"}


def dense_act_pattern() -> Pattern:
    fc = op.FullyConnected(Var("x"), Const("w"), Const("b", optional=True), name="fc")
    z = fc.optional(lambda y: op.add(y, Const("bias2"), name="bias_add"))
    return (op.Activation(z, act_type=OneOf(*ACTIVATIONS), name="act")
            | op("relu", "sigmoid", "tanh")(z, name="act")
            | op.LeakyReLU(z, act_type=OneOf("leaky", "gelu"), name="act")
            | gelu_erf_pattern(z)
            | gelu_tanh_pattern(z)
            | z)


class DenseAct(Rule):
    name = "dense_act"
    family = "dense_act"
    key = "fc"
    benefit = 80
    description = "FullyConnected [+ bias] [+ activation] → fused_dense (oneDNN GEMM, fused epilogue)"

    def pattern(self) -> Pattern:
        return dense_act_pattern()

    def _act(self, m: Match):
        """(act attribute, slope) of the matched activation."""
        if m.has("act"):
            a = m.node("act")
            if a.op == "Activation":
                return a.attrs["act_type"], None
            if a.op == "LeakyReLU":
                kind = a.param("act_type")
                return ("gelu_erf", None) if kind == "gelu" else ("leaky", float(a.param("slope")))
            return a.op, None
        if m.has("inner"):
            return ("gelu_erf" if m.node("inner").op == "erf" else "gelu_tanh"), None
        return "none", None

    MIN_ROWS = 8

    def _rows(self, m: Match) -> Optional[int]:
        """Rows of the GEMM (product of the leading dims of x), when the shapes are known."""
        shape = m.ctx.shape(m["x"])
        if not shape:
            return None
        rows = 1
        for d in (shape[:1] if m.node("fc").param("flatten") else shape[:-1]):
            rows *= d
        return rows

    def check(self, m: Match) -> Optional[str]:
        reason = float32_reason([m["x"], m["w"]] + ([m["b"]] if m.has("b") else []), m.ctx)
        if reason:
            return reason
        rows = self._rows(m)
        if rows is not None and rows < self.MIN_ROWS:
            return "%d rows: MXNet's FullyConnected is as fast as fused_dense on so few" % rows
        if rows is None and m.node("fc").param("flatten"):
            # a classifier head, typically run at small batch where MXNet's own FullyConnected
            # (fused with its activation by oneDNN) is as fast: fuse it only when the rows are known
            return "FullyConnected(flatten=True) of unknown batch size is left to MXNet (pass input shapes)"
        if m.has("inner"):
            reason = gelu_erf_reason(m) if m.node("inner").op == "erf" else gelu_tanh_reason(m)
            if reason:
                return reason
            if m.node("inner").op == "tanh":
                k, a = float(m.node("k").attrs["scalar"]), float(m.node("a").attrs["scalar"])
                if abs(k - 0.7978845608028654) > 1e-7 or abs(a - 0.044715) > 1e-9:
                    return "tanh-GELU constants %g, %g differ from the kernel's (it uses √(2/π), 0.044715)" % (k, a)
        fc = m.node("fc")
        if m.has("bias_add"):
            c = m.value("bias2")
            hidden = int(fc.param("num_hidden"))
            if c is None:
                return "bias '%s' has no value (pass params)" % m.node("bias2").name
            if c.size != hidden or max(c.shape or (1,)) != hidden:
                return "bias '%s' of shape %s is not one value per output feature (%d)" % (
                    m.node("bias2").name, c.shape, hidden)
            if m.has("b") and m.value("b") is None:
                return "bias '%s' has no value (pass params)" % m.node("b").name
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        fc = m.node("fc")
        act, slope = self._act(m)
        attrs = {"num_hidden": int(fc.param("num_hidden")), "flatten": bool(fc.param("flatten")), "act": act}
        if slope is not None:
            attrs["slope"] = slope
        inputs = [m["x"], m["w"]]
        if m.has("bias_add"):
            extra = m.value("bias2").reshape(-1)
            bias = extra + m.value("b").reshape(-1) if m.has("b") else extra
            inputs.append(b.param(fc.name + "_fused_bias", bias.astype(m.value("bias2").dtype)))
        elif m.has("b"):
            inputs.append(m["b"])
        else:
            attrs["no_bias"] = True
        return b.op("fused_dense", inputs, attrs=attrs, name=m.anchor.name)


RULES: List[Rule] = [DenseAct()]
