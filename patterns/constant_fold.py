r"""Clean-ups: Dropout (inference) and identity copies removed, computations on parameters
alone precomputed (inference).

``dropout`` — at inference MXNet's ``Dropout`` is the identity (unless ``mode='always'``,
Monte-Carlo dropout, which is kept)::

    y = Dropout(x)            →   y = x

``identity`` — MXNet's ``_copy`` (``identity``; what Gluon's ``Dropout(0.0)`` writes, so a
GluonNLP model built with ``dropout=0`` has one between each attention's softmax and its
value product) is the identity in value and gradient, in inference and training::

    y = _copy(x)              →   y = x

A model output keeps its name (``fuse`` names the value as the output was named).

``reshape_identity`` — reshapes (``Reshape``, ``expand_dims``, ``squeeze``, ``Flatten``) that
give back the shape of the value they start from, at every probe shape, only view the same
elements in the same order (GluonNLP's attention cell splits the probabilities into (B, H, S, S)
and merges them back before the value product)::

    y = Reshape(Reshape(x, (-1, H, 0, 0), reverse=True), (-1, 0, 0), reverse=True)   →   y = x

``constant_fold`` — an op all of whose inputs are parameters with known values (GluonNLP
builds its interleaved QKV weight with ``Reshape``/``Concat``/``stack`` of the separate
q/k/v weights on every call) is evaluated once, with MXNet's own op, and replaced by a new
parameter holding the result::

    W = Concat(Reshape(Wq), Reshape(Wk), Reshape(Wv))     →   W = <new parameter>

Repeated to a fixpoint, whole parameter-only chains fold, and the rules that need their
weights as parameters (``dense_act``'s ``Const("w")``) see them.  Both are inference-only:
in training the parameters change and the computation must stay.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from fusion.ir.errors import FusionError
from fusion.ir.graph import Entry, Node
from fusion.ir.matcher import Match
from fusion.ir.pattern import Chain, Pattern, Region, Var, op
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from .attention import chain_shape

# Deterministic ops that only rearrange or combine values: safe to evaluate ahead of time.
FOLDABLE = frozenset({
    "Reshape", "reshape", "Concat", "concat", "stack", "transpose", "SwapAxis", "expand_dims", "squeeze",
    "slice", "slice_axis", "slice_like", "Flatten", "Cast", "cast", "broadcast_to", "tile", "repeat", "_copy",
    "elemwise_add", "elemwise_sub", "elemwise_mul", "elemwise_div", "broadcast_add", "broadcast_sub",
    "broadcast_mul", "broadcast_div", "_plus_scalar", "_minus_scalar", "_mul_scalar", "_div_scalar",
    "_rminus_scalar", "_rdiv_scalar", "negative", "sqrt", "rsqrt", "square", "reciprocal",
})
#: How the report counts a removed no-op (``Builder.same_as_bind``): MXNet's bind runs these as a
#: pass-through at inference, in place where it can, so removing one promises no speed-up.
NO_OP = "no-op(s) removed (Dropout at inference, identity copies or reshapes), which MXNet's bind passes through"
MAX_BYTES = 1 << 30     # do not materialize anything larger than the model's own weights would be


class Dropout(Rule):
    name = "dropout"
    family = "inference_cleanup"
    benefit = 200
    inference_only = True
    training_reason = "Dropout is active in training; kept in mode='training'"
    description = "Dropout is the identity at inference: removed"

    def pattern(self) -> Pattern:
        return op.Dropout(Var("x"), name="dropout")

    def check(self, m: Match) -> Optional[str]:
        if m.node("dropout").param("mode") == "always":
            return "Dropout(mode='always') samples at inference too (Monte-Carlo dropout)"
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        b.same_as_bind = NO_OP
        return m["x"]


class Identity(Rule):
    name = "identity"
    family = "inference_cleanup"
    benefit = 200
    description = "_copy (identity) is the identity, value and gradient: removed (inference and training)"

    def pattern(self) -> Pattern:
        return op._copy(Var("x"), name="copy")

    def rewrite(self, m: Match, b: Builder) -> Entry:
        b.same_as_bind = NO_OP
        return m["x"]


# ops that only view their input in another shape, elements in the same (row-major) order
RESHAPES = ("Reshape", "reshape", "_npx_reshape", "expand_dims", "squeeze", "Flatten", "flatten")


class ReshapeRoundTrip(Rule):
    name = "reshape_identity"
    family = "inference_cleanup"
    benefit = 200
    quiet_refusals = True       # every other reshape is refused: near-misses (--explain), not news
    description = ("a chain of reshapes giving back its input's shape at every input shape is the identity: "
                   "removed (inference and training)")

    def pattern(self) -> Pattern:
        return op(*RESHAPES)(Chain(RESHAPES, Var("x"), "chain"), name="reshape")

    def check(self, m: Match) -> Optional[str]:
        before, after = m.ctx.shapes(m["x"]), m.ctx.shapes(m.anchor_entry)
        if not before or not after or len(before) != len(after):
            return "the shapes around '%s' are unknown (pass input shapes)" % m.anchor.name
        for a, b in zip(before, after):
            if tuple(a) != tuple(b):
                return "'%s' gives %s from %s: not the same shape" % (m.anchor.name, tuple(b), tuple(a))
        # the probes can miss a size equal to another by coincidence: the chain alone, at its
        # input's sizes each grown alone and all together, must give its input's shape wherever
        # it runs (a chain that names a size gives another shape, or cannot run, elsewhere)
        chain = [m.anchor_entry] + list(m["chain"])
        shape = tuple(before[0])
        variants = [tuple(d * 2 for d in shape)]
        for i in range(len(shape)):
            for grown in (shape[i] * 2, shape[i] + 1):
                variants.append(shape[:i] + (grown,) + shape[i + 1:])
        for v in variants:
            out = chain_shape(chain, v)
            if out is not None and out != v:
                return "'%s' gives %s from %s: not the same shape at every size" % (m.anchor.name, out, v)
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        b.same_as_bind = NO_OP
        return m["x"]


def _foldable(node: Node, ctx) -> bool:
    if node.op not in FOLDABLE or not node.inputs:
        return False
    for e in node.inputs:
        if e.node.op != "null":
            return False
        v = ctx.value(e)
        if v is None or v.nbytes > MAX_BYTES:
            return False
    return True


def _why_not_folded(node: Node, ctx) -> Optional[str]:
    """Reported: parameters-only ops not folded because the result would be too large."""
    if node.op not in FOLDABLE or not node.inputs or any(e.node.op != "null" for e in node.inputs):
        return None
    values = [ctx.value(e) for e in node.inputs]
    big = next((v for v in values if v is not None and v.nbytes > MAX_BYTES), None)
    if big is None:
        return None
    return "'%s' reads a %d-byte parameter (limit %d): not materialized" % (node.name, big.nbytes, MAX_BYTES)


class ConstantFold(Rule):
    name = "constant_fold"
    family = "inference_cleanup"
    benefit = 190
    inference_only = True
    training_reason = "folding parameters into a new one would stop their training; kept in mode='training'"
    description = "ops computing on parameters alone are evaluated once into a new parameter"

    def pattern(self) -> Pattern:
        return Region(_foldable, "op", min_nodes=1, max_nodes=1, ops=FOLDABLE, why_not=_why_not_folded)

    def rewrite(self, m: Match, b: Builder) -> Entry:
        import mxnet as mx

        node = m["op"][0]
        fn = getattr(mx.nd, node.op, None) or getattr(mx.nd._internal, node.op)
        args = [mx.nd.array(b.value(e), dtype=b.value(e).dtype) for e in node.inputs]
        out = fn(*args, **node.attrs.to_json())
        value = (out[0] if isinstance(out, (list, tuple)) else out).asnumpy()
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            # fuse() and mxfuse refuse parameters holding NaN or inf (a corrupt file, as a rule):
            # the fused model must load and fuse again like any other
            raise FusionError("the folded value holds NaN or inf, which a parameter may not")
        return b.param(node.name + "_const", value)


RULES: List[Rule] = [Dropout(), Identity(), ReshapeRoundTrip(), ConstantFold()]
