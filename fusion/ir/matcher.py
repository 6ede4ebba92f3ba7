"""Structural matching of a pattern against the graph, anchored at the pattern's output.

The matcher walks the pattern from its output backwards through the graph's
inputs, trying alternatives and both orders of commutative ops with
backtracking.  It yields every structural match; the rewriter then filters
them (escaping interior outputs, cycles, overlaps, the rule's own check).
When nothing matches, :class:`Trace` keeps the failure that got furthest,
which is what ``--explain`` shows as a near-miss.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from .graph import Entry, Node
from .pattern import AnyOf, Chain, Const, OpPattern, Pattern, Region, Var


class State:
    __slots__ = ("bindings", "nodes", "depth")

    def __init__(self, bindings: Dict[str, Union[Node, Entry]], nodes: Tuple[Node, ...], depth: int = 0):
        self.bindings = bindings
        self.nodes = nodes
        self.depth = depth      # ops matched by op patterns (chains and regions do not count for near-misses)

    def bind(self, name: Optional[str], value: Union[Node, Entry]) -> "State":
        if name is None:
            return self
        b = dict(self.bindings)
        b[name] = value
        return State(b, self.nodes, self.depth)

    def add(self, node: Node, name: Optional[str], core: bool = True) -> "State":
        nodes = self.nodes if any(n is node for n in self.nodes) else self.nodes + (node,)
        st = State(self.bindings, nodes, self.depth + (1 if core else 0))
        return st.bind(name, node)


class _Lazy:
    __slots__ = ("fn",)

    def __init__(self, fn: Any):
        self.fn = fn


class Trace:
    """The deepest structural failure seen while matching at one anchor.

    Failures are frequent (every node tried as an anchor fails somewhere), so
    the message is only formatted when read.
    """

    __slots__ = ("depth", "_fmt", "_args", "graph", "ctx", "excluded")

    def __init__(self, graph: Any = None, ctx: Any = None) -> None:
        self.graph = graph      # for patterns that look at consumers (Region)
        self.ctx = ctx
        self.excluded: Optional[str] = None   # a Region's why_not for a refused anchor
        self.depth = 0
        self._fmt: Optional[str] = None
        self._args: tuple = ()

    def fail(self, st: State, fmt: str, *args: Any) -> None:
        if st.depth > self.depth:
            self.depth, self._fmt, self._args = st.depth, fmt, args

    def snapshot(self) -> tuple:
        return self.depth, self._fmt, self._args

    def restore(self, snap: tuple) -> None:
        self.depth, self._fmt, self._args = snap

    @property
    def reason(self) -> Optional[str]:
        if self._fmt is None:
            return None
        return self._fmt % tuple(a.fn() if isinstance(a, _Lazy) else a for a in self._args)


def _where(parent: Optional[Node], slot: int) -> str:
    return "the anchor" if parent is None else "input %d of %s '%s'" % (slot, parent.op, parent.name)


def _satisfies(value: Any, constraint: Any) -> bool:
    if callable(constraint) and not isinstance(constraint, type):
        try:
            return bool(constraint(value))
        except Exception:  # a predicate that cannot judge this value does not match it
            return False
    return value == constraint


def match_pattern(p: Pattern, entry: Entry, st: State, trace: Trace,
                  parent: Optional[Node] = None, slot: int = 0) -> Iterator[State]:
    """Yield every way ``p`` matches the value ``entry`` given the bindings so far."""
    node = entry.node
    if isinstance(p, Var):
        if isinstance(p, Const) and not node.is_variable:
            trace.fail(st, "%s must be a parameter (a value from the params), but is computed by %s '%s'",
                       _Lazy(lambda: _where(parent, slot)), node.op, node.name)
            return
        bound = st.bindings.get(p.name)
        if bound is None:
            yield st.bind(p.name, entry)
        elif bound == entry:
            yield st
        else:
            trace.fail(st, "%s must be the same value as %r, which the pattern reads twice; found %r",
                       _Lazy(lambda: _where(parent, slot)), bound, entry)
        return
    if isinstance(p, AnyOf):
        # Failures of alternatives that lost to one that matched explain nothing: drop them.
        snap = trace.snapshot()
        for alt in p.alternatives:
            for st2 in match_pattern(alt, entry, st, trace, parent, slot):
                trace.restore(snap)
                yield st2
        return
    if isinstance(p, Chain):
        chain = [entry]
        while len(chain) <= p.max_len and chain[-1].node.op in p.ops and len(chain[-1].node.inputs) == 1:
            chain.append(chain[-1].node.inputs[0])
        for k in range(len(chain) - 1, -1, -1):     # longest chain first
            st2 = st
            for e in chain[:k]:
                st2 = st2.add(e.node, None, core=False)
            st2 = st2.bind(p.name, tuple(chain[:k]))
            yield from match_pattern(p.inner, chain[k], st2, trace, chain[k - 1].node if k else parent, 0 if k else slot)
        return
    if isinstance(p, Region):
        nodes = _grow_region(p, entry, trace)
        if len(nodes) < p.min_nodes:
            return
        for n in nodes:
            st = st.add(n, None, core=False)
        yield st.bind(p.name, tuple(nodes))
        return
    assert isinstance(p, OpPattern), p
    if node.op not in p.ops:
        trace.fail(st, "%s: expected %s, found %s '%s'", _Lazy(lambda: _where(parent, slot)), p.label,
                   "variable" if node.op == "null" else node.op, node.name)
        return
    if entry.index != p.index:
        trace.fail(st, "%s: uses output %d of '%s', expected output %d", _Lazy(lambda: _where(parent, slot)), entry.index, node.name, p.index)
        return
    if p.name is not None and p.name in st.bindings and st.bindings[p.name] is not node:
        trace.fail(st, "%s: '%s' must be the same node as '%s'", _Lazy(lambda: _where(parent, slot)), node.name, st.bindings[p.name])
        return
    for key, constraint in p.attrs.items():
        value = node.param(key, None)
        if not _satisfies(value, constraint):
            trace.fail(st, "%s '%s': %s=%r, expected %r", node.op, node.name, key, value, constraint)
            return
    n = len(node.inputs)
    if not p.required <= n <= len(p.inputs):
        trace.fail(st, "%s '%s' has %d inputs, expected %d", node.op, node.name, n, p.required)
        return
    st = st.bind(p.name, node) if p.keep else st.add(node, p.name)
    orders: List[Sequence[Pattern]] = [p.inputs]
    if p.commutative:
        orders.append(p.inputs[::-1])
    snap = trace.snapshot()
    for pats in orders:
        for st2 in _match_inputs(pats, node, 0, st, trace):
            if len(orders) > 1:
                trace.restore(snap)
            yield st2


def _grow_region(p: Region, entry: Entry, trace: Trace) -> List[Node]:
    anchor = entry.node
    if entry.index != 0 or anchor.op == "null":
        return []
    if not p.member(anchor, trace.ctx):
        if p.why_not is not None:
            trace.excluded = p.why_not(anchor, trace.ctx)
        return []
    users = trace.graph.consumers()
    heads = {id(e.node) for e in trace.graph.heads}
    inside = {id(anchor)}
    region = [anchor]
    size = p.size if p.size is not None and p.max_size is not None else None
    total = size(anchor) if size else 0

    def external_inputs(nodes) -> set:
        ids = {id(n) for n in nodes}
        return {e for n in nodes for e in n.inputs if id(e.node) not in ids}

    claimed = getattr(trace.ctx, "claimed", {})     # nodes other matches of this pass hold: grown around
    outputs = 1

    grown = True
    while grown and len(region) < p.max_nodes:
        grown = False
        for nd in list(region):
            for e in nd.inputs:
                cand = e.node
                if (id(cand) in inside or cand.op == "null" or e.index != 0 or id(cand) in claimed
                        or not p.member(cand, trace.ctx)):
                    continue
                outside = [u for u, _ in users.get(cand, ()) if id(u) not in inside]
                given_back = bool(outside) or id(cand) in heads
                if given_back:
                    if (outputs >= p.max_outputs or (p.exportable is not None and not p.exportable(cand, trace.ctx))
                            or leads_back(outside, inside, users, anchor.pos)):
                        continue
                if size and total + size(cand) > p.max_size:
                    continue
                if len(external_inputs(region + [cand])) > p.max_inputs:
                    continue
                outputs += given_back
                inside.add(id(cand))
                region.append(cand)
                if size:
                    total += size(cand)
                grown = True
                if len(region) >= p.max_nodes:
                    break
    region.sort(key=lambda n: n.pos)
    return region


def leads_back(starts: Sequence[Node], inside: set, users: Dict[Node, List[Tuple[Node, int]]],
               last: float) -> Optional[Node]:
    """The first node of ``inside`` (ids) that a path from ``starts`` (outside) reaches, or None.  The
    graph's nodes are in topological order (``pos``), so the walk stops past ``last``, the largest
    position inside."""
    seen, todo = set(), [n for n in starts if n.pos <= last]
    while todo:
        n = todo.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if id(n) in inside:
            return n
        todo.extend(u for u, _ in users.get(n, ()) if u.pos <= last)
    return None


def _match_inputs(pats: Sequence[Pattern], node: Node, k: int, st: State, trace: Trace) -> Iterator[State]:
    if k == len(node.inputs):
        yield st
        return
    for st2 in match_pattern(pats[k], node.inputs[k], st, trace, node, k):
        yield from _match_inputs(pats, node, k + 1, st2, trace)


class Match:
    """One structural match: bound nodes and values, by the names the pattern gave them."""

    def __init__(self, anchor: Node, st: State, ctx: Any):
        self.anchor = anchor
        self.bindings = st.bindings
        self.nodes: Tuple[Node, ...] = st.nodes
        self.ctx = ctx

    @property
    def anchor_entry(self) -> Entry:
        return Entry(self.anchor, 0, 0)

    def has(self, name: str) -> bool:
        """Whether ``name`` was bound (optional steps and inputs may be absent)."""
        return name in self.bindings

    def __getitem__(self, name: str) -> Union[Node, Entry]:
        return self.bindings[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.bindings.get(name, default)

    def node(self, name: str) -> Node:
        v = self.bindings[name]
        return v if isinstance(v, Node) else v.node

    def value(self, name: str) -> Optional[np.ndarray]:
        """The parameter value bound to Const ``name`` (None when absent or no params were given)."""
        v = self.bindings.get(name)
        if v is None:
            return None
        return self.ctx.value(v if isinstance(v, Entry) else Entry(v))

    def shape(self, name: str) -> Optional[Tuple[int, ...]]:
        """The shape of the value bound to ``name``: inferred, or its parameter value's (None when
        neither is known)."""
        v = self.bindings.get(name)
        if v is None:
            return None
        s = self.ctx.shape(v if isinstance(v, Entry) else Entry(v))
        if s is None and self.value(name) is not None:
            s = self.value(name).shape
        return None if s is None else tuple(int(d) for d in s)

    def external_inputs(self) -> List[Entry]:
        inside = {id(n) for n in self.nodes}
        seen, out = set(), []
        for nd in self.nodes:
            for e in nd.inputs:
                if id(e.node) not in inside and e not in seen:
                    seen.add(e)
                    out.append(e)
        return out

    def __repr__(self) -> str:
        return "Match(%s)" % ", ".join("%s=%r" % kv for kv in self.bindings.items())
