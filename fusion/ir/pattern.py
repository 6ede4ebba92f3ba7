"""The pattern DSL: declarative descriptions of subgraphs to fuse.

Building blocks (in the spirit of TVM's dataflow patterns)::

    x = Var("x")                              # any value, bound as "x"
    w = Const("w")                            # a value produced by a variable (a parameter)
    conv = op("Convolution", "Deconvolution")(x, w, Const("b", optional=True), name="conv")
    bn = op.BatchNorm(conv, Const("gamma"), Const("beta"), Const("mean"), Const("var"), name="bn")
    act = bn.optional(lambda y: op.Activation(y, act_type=OneOf("relu", "tanh"), name="act"))
    gate = op.add(x, op.sigmoid(x))          # "add" matches elemwise_add, broadcast_add, _plus, ...
    scaled = scalar("div", x, name="s")       # _div_scalar(x, scalar=c), binds the scalar as "s"

* Names bind matched nodes (``name=``) and values (``Var``/``Const``); binding
  a name twice requires the same value (``x * sigmoid(x)``).
* Attribute constraints are keyword arguments: a value (compared with the
  typed attribute, MXNet's default used when absent) or a predicate.
* Commutative ops (add, mul, max, min) match their inputs in either order.
* :meth:`Pattern.optional` makes a step optional; ``a | b`` is an alternative.
  Alternatives are tried in order, longer first, with backtracking.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, FrozenSet, Iterable, Optional, Sequence, Union

from . import opdefs


class Pattern:
    """Base class of all pattern nodes."""

    def optional(self, wrap: Callable[["Pattern"], "Pattern"]) -> "Pattern":
        """``wrap(self)`` if present in the graph, else ``self``: an optional step after this one."""
        return AnyOf(wrap(self), self)

    def __or__(self, other: "Pattern") -> "Pattern":
        return AnyOf(self, other)

    def roots(self) -> FrozenSet[str]:
        """Ops an anchor node may have for this pattern to match there (empty: any node)."""
        return frozenset()


class Var(Pattern):
    """Any value; bound under ``name``."""

    def __init__(self, name: str, optional: bool = False):
        self.name = name
        self.optional_input = optional

    def __repr__(self) -> str:
        return "Var(%r)" % self.name


class Const(Var):
    """A value produced by a variable node: a parameter (its value comes from arg/aux params)."""

    def __repr__(self) -> str:
        return "Const(%r)" % self.name


class OneOf:
    """Attribute constraint: the value is one of ``values``."""

    def __init__(self, *values: Any):
        self.values = values

    def __call__(self, v: Any) -> bool:
        return v in self.values

    def __repr__(self) -> str:
        return " | ".join(repr(v) for v in self.values)


Constraint = Union[Any, Callable[[Any], bool]]


class OpPattern(Pattern):
    """An operator node with the given op name(s), input patterns and attribute constraints."""

    def __init__(self, ops: Iterable[str], inputs: Sequence[Pattern], name: Optional[str] = None,
                 index: int = 0, attrs: Optional[Dict[str, Constraint]] = None):
        self.ops = frozenset(ops)
        self.label = "|".join(sorted(self.ops))
        self.inputs = list(inputs)
        self.name = name
        self.index = index
        self.attrs = dict(attrs or {})
        self.commutative = bool(self.ops & opdefs.COMMUTATIVE) and len(self.inputs) == 2
        self.keep = False       # see kept()
        opt = [isinstance(p, Var) and p.optional_input for p in self.inputs]
        self.required = len(opt) - sum(opt)
        if any(opt[: self.required]):
            raise ValueError("optional inputs of %s must come last" % self.label)

    def roots(self) -> FrozenSet[str]:
        return self.ops

    def kept(self) -> "OpPattern":
        """This step as context only: matched and bound, but not part of what the rewrite replaces
        (its value may be used elsewhere, and it stays in the graph)."""
        self.keep = True
        return self

    def __repr__(self) -> str:
        return "%s(%s)" % (self.label, ", ".join(map(repr, self.inputs)))


class AnyOf(Pattern):
    """The first alternative that matches (tried in order, with backtracking)."""

    def __init__(self, *alternatives: Pattern):
        flat = []
        for a in alternatives:
            flat.extend(a.alternatives if isinstance(a, AnyOf) else [a])
        self.alternatives = flat

    def roots(self) -> FrozenSet[str]:
        out: set = set()
        for a in self.alternatives:
            r = a.roots()
            if not r:
                return frozenset()
            out |= r
        return frozenset(out)

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.alternatives))


class Chain(Pattern):
    """Zero or more single-input ops from ``ops`` applied on top of ``inner`` (longest first).

    Binds ``name`` to the tuple of the chain's entries, outermost first (empty when
    the chain has no op).  Used for layout shuffles (Reshape/transpose/...) whose
    number and order vary between models; the rule's ``check`` judges what they do.
    """

    def __init__(self, ops: Iterable[str], inner: Pattern, name: str, max_len: int = 8):
        self.ops = frozenset(ops)
        self.inner = inner
        self.name = name
        self.max_len = max_len

    def roots(self) -> FrozenSet[str]:
        inner = self.inner.roots()
        return self.ops | inner if inner else frozenset()

    def __repr__(self) -> str:
        return "Chain(%s, %r)" % ("|".join(sorted(self.ops)), self.inner)


class Region(Pattern):
    """A maximal connected region of ops accepted by ``member(node, ctx)``, anchored at its output.

    Grows backwards from the anchor over member producers whose outputs are used only
    inside the region (so no interior value escapes and no cycle can form, as in TVM's
    FuseOps), up to ``max_nodes`` ops and ``max_inputs`` distinct external inputs, and,
    when ``size(node)`` is given, up to ``max_size`` in the sum of the nodes' sizes (a
    node that stands for several ops, e.g. a fused one, counts as that many).
    With ``max_outputs`` > 1 it also takes producers whose output is read outside the region
    or is a graph output (``exportable(node, ctx)`` permitting), up to ``max_outputs``
    values in all with the anchor's: each becomes an output of the rewrite, which must
    replace it (``Rule.exported``).  Such a producer is taken only where no reader outside
    leads back into the region (the region as one op would then read its own output:
    ``leads_back`` in the matcher).
    Binds ``name`` to the region's nodes in topological order; regions smaller than
    ``min_nodes`` do not match.  ``why_not(node, ctx)``, when given, says why an anchor
    that ``member`` refuses was refused, for the exclusions worth reporting (it returns
    None for the rest); the report lists it among the rule's near-misses.
    """

    def __init__(self, member: Callable[[Any, Any], bool], name: str, min_nodes: int = 2,
                 max_nodes: int = 32, max_inputs: int = 8, ops: Iterable[str] = (),
                 why_not: Optional[Callable[[Any, Any], Optional[str]]] = None,
                 size: Optional[Callable[[Any], int]] = None, max_size: Optional[int] = None,
                 max_outputs: int = 1, exportable: Optional[Callable[[Any, Any], bool]] = None):
        self.member = member
        self.why_not = why_not
        self.ops = frozenset(ops)      # ops an anchor may have (empty: any); lets the engine skip the rest
        self.name = name
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.max_inputs = max_inputs
        self.size = size
        self.max_size = max_size
        self.max_outputs = max_outputs
        self.exportable = exportable

    def roots(self) -> FrozenSet[str]:
        return self.ops

    def __repr__(self) -> str:
        return "Region(%s)" % self.name


class _OpBuilder:
    """``op.Name(*inputs, name=..., **attrs)`` or ``op("A", "B")(*inputs, ...)``.

    The generic names ``add``, ``sub``, ``mul`` and ``div`` stand for all of
    MXNet's spellings (``elemwise_add``, ``broadcast_add``, ``_plus``, ...).
    """

    def __call__(self, *ops: str) -> Callable[..., OpPattern]:
        names: set = set()
        for o in ops:
            names |= opdefs.ALIASES.get(o, frozenset({o}))

        def build(*inputs: Pattern, name: Optional[str] = None, index: int = 0, **attrs: Constraint) -> OpPattern:
            return OpPattern(names, inputs, name=name, index=index, attrs=attrs)

        return build

    def __getattr__(self, op_name: str) -> Callable[..., OpPattern]:
        if op_name.startswith("__"):
            raise AttributeError(op_name)
        return self(op_name)


op = _OpBuilder()


def required_ops(p: Pattern) -> FrozenSet[FrozenSet[str]]:
    """Groups of ops every match of ``p`` contains one of: a graph without some group cannot match."""
    if isinstance(p, OpPattern):
        groups = {p.ops}
        for q in p.inputs:
            if not (isinstance(q, Var) and q.optional_input):
                groups |= required_ops(q)
        return frozenset(groups)
    if isinstance(p, AnyOf):
        sets = [required_ops(a) for a in p.alternatives]
        return frozenset.intersection(*sets) if sets else frozenset()
    if isinstance(p, Chain):
        return required_ops(p.inner)   # the chain may be empty, its inner pattern is always there
    if isinstance(p, Region) and p.ops:
        return frozenset({p.ops})
    return frozenset()          # Var, Const, Region without ops


def scalar(kind: str, x: Pattern, name: Optional[str] = None, **attrs: Constraint) -> OpPattern:
    """A scalar-op form, e.g. ``scalar("div", x, name="s")`` matches ``_div_scalar(x, scalar=c)``."""
    try:
        ops = opdefs.SCALAR_OPS[kind]
    except KeyError:
        raise ValueError("unknown scalar op kind %r (known: %s)" % (kind, ", ".join(sorted(opdefs.SCALAR_OPS))))
    return OpPattern(ops, [x], name=name, attrs=attrs)
