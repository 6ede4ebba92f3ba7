r"""Max pooling of a plain-layout value: ``Pooling(max)`` → ``fused_max_pool``, the same values, vectorized.

Matched::

    x (N, C, H, W)    computed by an op MXNet runs outside oneDNN (sigmoid, an elementwise or
                      broadcast op, a library op) or a graph input: a plain NCHW array
    Pooling(pool_type='max', 2-D kernel, stride, pad < kernel, pooling_convention valid | full)

Rewrite: ``fused_max_pool(x)`` with the same kernel, stride, pad and convention.  MXNet 1.9.1
runs such a pooling through oneDNN's reference implementation, one window at a time (CenterNet's
3×3 stride-1 peak extraction on a 20×128×128 heatmap: 11 ms on two cores, 0.3 ms here); the
library op takes the same maximum (MXNet's comparison: a NaN never wins, a window of NaN or −inf
gives −FLT_MAX) over contiguous output rows.  A pooling whose input comes from one of MXNet's
oneDNN ops (a convolution, BatchNorm, Activation, an add, another pooling, a concatenation …) stays:
there MXNet pools in oneDNN's blocked layout with a fast kernel, and a library op would pay
reorders.

Refused: average or other pooling, global pooling, a layout other than NCHW, not 2-D, the
``same`` convention, values other than float32, an input from a oneDNN op (above), a device
without the op, and ``mode='training'`` (the library op has no backward).
"""
from __future__ import annotations

from typing import List, Optional

from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.ir.pattern import Pattern, Var, op
from fusion.engine.reasons import NearMiss
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from ._block_shapes import layout_reason, not_2d
from ._dtypes import float32_reason

#: Ops whose CPU output is a plain (not oneDNN-blocked) array in MXNet 1.9.1: mshadow's
#: elementwise, broadcast and scalar ops (besides the library's own fused_* ops and graph inputs).
PLAIN_PRODUCERS = frozenset({
    "sigmoid", "tanh", "relu", "exp", "log", "sqrt", "rsqrt", "square", "abs", "negative", "reciprocal", "clip",
    "hard_sigmoid", "softsign", "erf", "Cast", "cast", "amp_cast", "_contrib_BilinearResize2D",
    "broadcast_add", "broadcast_sub", "broadcast_mul", "broadcast_div", "broadcast_maximum", "broadcast_minimum",
    "broadcast_plus", "broadcast_minus", "broadcast_power", "broadcast_equal", "broadcast_greater",
    "elemwise_sub", "elemwise_mul", "elemwise_div", "_maximum", "_minimum", "_mul", "_div", "_sub", "_minus",
    "_plus_scalar", "_minus_scalar", "_rminus_scalar", "_mul_scalar", "_div_scalar", "_rdiv_scalar",
    "_maximum_scalar", "_minimum_scalar", "_power_scalar", "_rpower_scalar",
})


def _pair(v, default) -> tuple:
    t = tuple(int(x) for x in (v or ()))
    return t if t else (default, default)


class MaxPool(Rule):
    name = "max_pool"
    family = ""
    key = "pool"
    benefit = 5
    inference_only = True
    training_reason = "fused_max_pool has no backward; refused in mode='training'"
    description = ("Pooling(max, 2-D) of a plain-layout value (not from a oneDNN op) → fused_max_pool "
                   "(MXNet runs oneDNN's reference pooling there)")

    def pattern(self) -> Pattern:
        return op.Pooling(Var("x"), name="pool")

    def check(self, m: Match) -> Optional[str]:
        pool = m.node("pool")
        if m.ctx.device != "cpu":
            return "fused_max_pool has no %s implementation" % m.ctx.device
        if pool.param("pool_type", "max") != "max":
            return NearMiss("Pooling '%s' is %s pooling (only max)" % (pool.name, pool.param("pool_type")))
        if pool.param("global_pool", False):
            return NearMiss("Pooling '%s' is global" % pool.name)
        reason = layout_reason(pool)
        if reason:
            return reason
        kernel = tuple(pool.param("kernel", ()) or ())
        if len(kernel) != 2:
            return not_2d(pool)
        convention = pool.param("pooling_convention", "valid")
        if convention not in ("valid", "full"):
            return "Pooling '%s' uses the %r convention" % (pool.name, convention)
        pad = _pair(pool.param("pad", ()), 0)
        if any(p >= k for p, k in zip(pad, kernel)):
            return "Pooling '%s' pads %s, not less than its kernel %s" % (pool.name, pad, kernel)
        reason = float32_reason([m["x"]], m.ctx)
        if reason:
            return reason
        src = m["x"].node
        if src.op != "null" and not src.op.startswith("fused_") and src.op not in PLAIN_PRODUCERS:
            # every pooling of a convolution (a ResNet's stem): a near-miss (--explain), not news
            return NearMiss("the input of Pooling '%s' comes from %s '%s', which MXNet runs in oneDNN's layout: its "
                            "own pooling is fast there" % (pool.name, src.op, src.name))
        shape = m.ctx.partial_shape(m["x"])
        if shape is not None and len(shape) != 4:
            return NearMiss("the input of Pooling '%s' is not (N, C, H, W)" % pool.name)
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        pool = m.node("pool")
        attrs = {"kernel": tuple(int(k) for k in pool.param("kernel")),
                 "stride": _pair(pool.param("stride", ()), 1), "pad": _pair(pool.param("pad", ()), 0),
                 "pooling_convention": pool.param("pooling_convention", "valid")}
        return b.op("fused_max_pool", [m["x"]], attrs=attrs, name=pool.name)


RULES: List[Rule] = [MaxPool()]
