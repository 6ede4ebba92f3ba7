r"""FullyConnected [+ bias] [+ activation] → ``fused_dense``.

Matched::

    z = FullyConnected(x, W[, b], flatten=f)
    z = z | z + c                                 broadcast_add/elemwise_add of a bias parameter (N,) / (1,…,N)
                                                  that keeps z's shape (decided at every probe shape)
    y = z | act(z)                                Activation(relu|sigmoid|tanh|softrelu), relu, sigmoid, tanh,
                                                  LeakyReLU(leaky|gelu), GELU written out (erf or tanh form)

Rewrite: ``y = fused_dense(x, W, b', act=…, flatten=f)`` with ``b' = b + c``
(a new parameter at inference; in training ``b + reshape(c)`` computed in the graph,
so that both keep their gradients) — one GEMM through oneDNN's sgemm on a weight
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

from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.engine.report import no_value_reason
from fusion.ir.pattern import Const, OneOf, Pattern, Var, op
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from ._dtypes import float32_reason
from .gelu import TRAINING_REASON as GELU_TRAINING_REASON
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
            if a.op == "Activation":       # Activation(relu) runs through oneDNN (NaN → 0), the relu op does not
                kind = a.attrs["act_type"]
                return ("act_relu" if kind == "relu" else kind), None
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
            if m.ctx.mode == "training":
                return GELU_TRAINING_REASON
            reason = gelu_erf_reason(m) if m.node("inner").op == "erf" else gelu_tanh_reason(m)
            if reason:
                return reason
            if m.node("inner").op == "tanh":
                k, a = float(m.node("k").attrs["scalar"]), float(m.node("a").attrs["scalar"])
                if abs(k - 0.7978845608028654) > 1e-7 or abs(a - 0.044715) > 1e-9:
                    return "tanh-GELU constants %g, %g differ from the kernel's (it uses √(2/π), 0.044715)" % (k, a)
        if m.has("bias_add"):
            return self._bias_reason(m)
        return None

    @staticmethod
    def _bias_reason(m: Match) -> Optional[str]:
        """Why the added value is not one bias per output feature (None when it is).

        ``broadcast_add`` aligns trailing axes (NumPy-style, ranks padded with 1s on the left):
        ``c`` is a per-feature bias iff it holds ``num_hidden`` values along its last axis, 1s
        elsewhere, and the sum has the FullyConnected's own shape — at every probe shape.
        """
        fc, add = m.node("fc"), m.node("bias_add")
        hidden = int(fc.param("num_hidden"))
        name = m.node("bias2").name
        c_shape = m.ctx.shape(m["bias2"])
        if c_shape is None:
            c = m.value("bias2")
            if c is None:
                return no_value_reason(m.ctx, name, "bias")
            c_shape = c.shape
        c_shape = tuple(c_shape)
        if not c_shape or c_shape[-1] != hidden or any(d != 1 for d in c_shape[:-1]):
            return "'%s' of shape %s is not one value per output feature (%d) along the last axis" % (
                name, c_shape, hidden)
        if add.op == "elemwise_add" and len(c_shape) > 1:
            return "elemwise_add of '%s' %s needs the FullyConnected's exact shape" % (name, c_shape)
        if len(c_shape) == 1 or (len(c_shape) == 2 and fc.param("flatten")):
            return None        # the sum keeps the layer's shape whatever the batch
        outs, sums = m.ctx.shapes(Entry(fc)), m.ctx.shapes(Entry(add))
        if not outs or len(outs) != len(sums):
            return "the shapes around the add of '%s' %s are unknown (pass input shapes)" % (name, c_shape)
        for o, s in zip(outs, sums):
            if tuple(o) != tuple(s):
                return "adding '%s' %s broadcasts the layer's output %s to %s" % (name, c_shape, o, s)
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        fc = m.node("fc")
        act, slope = self._act(m)
        attrs = {"num_hidden": int(fc.param("num_hidden")), "flatten": bool(fc.param("flatten")), "act": act}
        if slope is not None:
            attrs["slope"] = slope
        inputs = [m["x"], m["w"]]
        if m.has("bias_add"):
            inputs.append(self._bias(m, b))
        elif m.has("b"):
            inputs.append(m["b"])
        else:
            attrs["no_bias"] = True
        return b.op("fused_dense", inputs, attrs=attrs, name=m.anchor.name)


    @staticmethod
    def _bias(m: Match, b: Builder) -> Entry:
        """The layer's bias with the added one merged in: a new parameter at inference; in
        training the sum is computed in the graph, so both parameters keep their gradients."""
        fc = m.node("fc")
        c, prior = m.value("bias2"), m.value("b") if m.has("b") else None
        if m.ctx.mode != "training" and c is not None and (prior is not None or not m.has("b")):
            bias = c.reshape(-1) + prior.reshape(-1) if prior is not None else c.reshape(-1)
            return b.param(fc.name + "_fused_bias", bias.astype(c.dtype))
        extra = m["bias2"]
        if len(m.ctx.shape(extra) or (c.shape if c is not None else ())) != 1:
            extra = b.op("Reshape", [extra], attrs={"shape": (-1,)}, name=fc.name + "_bias_flat")
        if not m.has("b"):
            return extra
        return b.op("elemwise_add", [m["b"], extra], name=fc.name + "_bias_sum")


RULES: List[Rule] = [DenseAct()]
