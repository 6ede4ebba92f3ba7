"""One view of an ONNX graph for the export's clean-up passes, and small op-chain patterns over it.

:class:`GraphView` answers what every pass asks of a graph: who writes a value (``producer``), who
reads it (``readers``, ``uses``), whether it is a graph output, the value of a constant (an
initializer, or a ``Constant`` node), static shapes and ranks from ONNX's shape inference, a name
not yet taken, and the removal of dead nodes and unread initializers.  It wraps either a model
(``GraphView.of(model)``) or the node list, initializer dict and output names of a graph still
being assembled (``GraphView(nodes, inits, outputs)``).  The indexes are taken when the view is
made (``refresh()`` takes them again): a pass that rewrites while it walks reads the graph as it
was before its first change, as a hand-written walk over a ``producer`` dict does.

A chain pattern describes a value computed by a chain (or small tree) of ops, matched backwards from
the node that reads it last::

    SLICE_SQUEEZE = Op("Squeeze", Op("Slice", Var("x"), Init("starts"), Init("ends"), Init("slice_axes"),
                                     Init("steps", optional=True), name="slice"),
                       Init("axes"), arity=(2,), name="squeeze")

* ``Op(op_type, *inputs)`` matches a node of that type (or of one of a tuple of types; ai.onnx unless
  ``domain=`` names another, ``domain=None``: any) whose leading inputs match ``inputs``; ``arity``
  restricts its number of inputs, ``where`` is a predicate on the node.  An interior ``Op`` is read by
  exactly one input and is no graph output (``one_reader=False`` lifts that); ``optional=True`` lets
  the chain skip it (its first input's pattern is then matched at the value itself);
  ``commutative=True`` tries two inputs in both orders, as written first.
* ``Var(name)`` is any value (bound twice, it must be the same value); ``Input(name)`` a graph input.
* ``Const(name, pred)`` is a constant operand (initializer or ``Constant`` node), ``Init`` an
  initializer only; ``pred`` is a predicate on its NumPy value; ``optional=True`` accepts a missing
  trailing input (bound to ``None``).

:func:`match` returns a :class:`Match` (``m["slice"]`` the node, ``m["x"]`` the value name, ``m["starts"]``
the array, ``m.name("starts")`` its value name) or ``None``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

STANDARD = ("", "ai.onnx")


def is_standard(node) -> bool:
    return node.domain in STANDARD


class GraphView:
    """Producers, readers, use counts, constants and names of one ONNX graph (see the module docstring)."""

    def __init__(self, nodes, inits: Dict[str, Any], outputs: Iterable[str], inputs: Optional[Mapping[str, Any]] = None,
                 model=None):
        self.nodes = nodes
        self.inits = inits
        self.outputs = set(outputs)
        self.inputs = dict(inputs or {})
        self.model = model
        self._shapes: Optional[Tuple[Optional[Dict[str, List[int]]], Dict[str, int]]] = None
        self.refresh()

    @classmethod
    def of(cls, model) -> "GraphView":
        g = model.graph
        return cls(g.node, {t.name: t for t in g.initializer}, [o.name for o in g.output],
                   {i.name: i for i in g.input}, model=model)

    @property
    def graph(self):
        return self.model.graph

    def refresh(self) -> "GraphView":
        """Take the indexes again (after the graph changed)."""
        self._producer: Dict[str, Any] = {}
        self._readers: Dict[str, List[Any]] = {}
        self._uses: Dict[str, int] = {}
        for n in self.nodes:
            for o in n.output:
                if o:
                    self._producer[o] = n
            for x in n.input:
                self._uses[x] = self._uses.get(x, 0) + 1
                if x:
                    self._readers.setdefault(x, []).append(n)
        self._shapes = None
        return self

    # -- edges ---------------------------------------------------------------------------------
    def producer(self, name: str, op: Optional[str] = None):
        """The node writing ``name`` (of type ``op``, a standard op, when given), else None."""
        p = self._producer.get(name)
        if p is None or op is None:
            return p
        return p if p.op_type == op and is_standard(p) else None

    def readers(self, name: str) -> List[Any]:
        """The nodes reading ``name``, once per input slot that reads it."""
        return self._readers.get(name, [])

    def uses(self, name: str) -> int:
        """How many node inputs read ``name``."""
        return self._uses.get(name, 0)

    def is_output(self, name: str) -> bool:
        return name in self.outputs

    def single_reader(self, name: str) -> bool:
        """``name`` is read by one node input and is no graph output (the value may go with its reader)."""
        return self.uses(name) == 1 and name not in self.outputs

    # -- constants -----------------------------------------------------------------------------
    def init(self, name: str) -> Optional[np.ndarray]:
        """The value of initializer ``name``, else None."""
        from onnx import numpy_helper
        t = self.inits.get(name)
        return None if t is None else numpy_helper.to_array(t)

    def const(self, name: str) -> Optional[np.ndarray]:
        """The value of ``name`` when an initializer or a ``Constant`` node's ``value`` holds it, else None."""
        from onnx import numpy_helper
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        p = self._producer.get(name)
        if p is not None and p.op_type == "Constant" and p.output[0] == name:
            a = next((a for a in p.attribute if a.name == "value"), None)
            return None if a is None else numpy_helper.to_array(a.t)
        return None

    def ints(self, name: str, constants: bool = False) -> Optional[List[int]]:
        """The elements of initializer (or, with ``constants``, any constant) ``name`` as ints, else None."""
        v = self.const(name) if constants else self.init(name)
        return None if v is None else [int(a) for a in v.reshape(-1)]

    def add_init(self, array: np.ndarray, name: str) -> str:
        """A new initializer ``name`` holding ``array`` (in the model too when the view has one)."""
        from onnx import numpy_helper
        t = numpy_helper.from_array(array, name)
        self.inits[name] = t
        if self.model is not None:
            self.graph.initializer.append(t)
        return name

    # -- names ---------------------------------------------------------------------------------
    def taken(self) -> set:
        return {x for n in self.nodes for x in list(n.input) + list(n.output)} | set(self.inits) | set(self.inputs)

    def fresh(self, base: str) -> str:
        """``base``, or ``base_1``, ``base_2``, ... : the first name no node, initializer or input uses."""
        names = self.taken()
        name, i = base, 1
        while name in names:
            name, i = "%s_%d" % (base, i), i + 1
        return name

    # -- shapes --------------------------------------------------------------------------------
    def _inferred(self) -> Tuple[Optional[Dict[str, List[int]]], Dict[str, int]]:
        if self._shapes is None:
            import onnx
            static: Dict[str, List[int]] = {}
            ranks: Dict[str, int] = {}
            try:
                inferred = onnx.shape_inference.infer_shapes(self.model)
            except Exception:
                self._shapes = (None, {})
                return self._shapes
            g = inferred.graph
            for vi in list(g.value_info) + list(g.input) + list(g.output):
                if vi.type.tensor_type.HasField("shape"):
                    dims = vi.type.tensor_type.shape.dim
                    ranks[vi.name] = len(dims)
                    if all(d.HasField("dim_value") for d in dims):
                        static[vi.name] = [d.dim_value for d in dims]
            self._shapes = (static, ranks)
        return self._shapes

    def static_shapes(self) -> Optional[Dict[str, List[int]]]:
        """The shape of every value ONNX's shape inference knows in full (None: shape inference fails)."""
        return self._inferred()[0]

    def inferred_ranks(self) -> Dict[str, int]:
        """The rank of every value ONNX's shape inference knows (none when it fails)."""
        return self._inferred()[1]

    # -- removal -------------------------------------------------------------------------------
    def drop_unread_initializers(self) -> None:
        """Remove the initializers no node reads (in place)."""
        g = self.graph
        used = {x for n in g.node for x in n.input}
        keep = [t for t in g.initializer if t.name in used]
        del g.initializer[:]
        g.initializer.extend(keep)
        self.inits = {t.name: t for t in keep}

    def drop_dead(self) -> None:
        """Remove the nodes whose values nothing reads and the initializers no node reads (in place)."""
        g = self.graph
        used = {o.name for o in g.output}
        keep = []
        for n in reversed(list(g.node)):
            if any(o and o in used for o in n.output):
                keep.append(n)
                used.update(x for x in n.input if x)
        if len(keep) != len(g.node):
            keep.reverse()
            del g.node[:]
            g.node.extend(keep)
        inits = [t for t in g.initializer if t.name in used]
        if len(inits) != len(g.initializer):
            del g.initializer[:]
            g.initializer.extend(inits)
        self.inits = {t.name: t for t in g.initializer}
        self.refresh()


def drop_dead(model):
    """``model`` without the nodes whose values nothing reads and the initializers no node reads."""
    GraphView.of(model).drop_dead()
    return model


# ----------------------------------------------------------------------------------------------
# chain patterns
# ----------------------------------------------------------------------------------------------

class Pat:
    """Base class of the chain-pattern nodes."""
    optional = False


class Var(Pat):
    """Any value, bound as ``name``."""

    def __init__(self, name: Optional[str] = None):
        self.name = name


class Input(Var):
    """A graph input, bound as ``name``."""


class Const(Pat):
    """A constant operand (initializer or ``Constant`` node) whose value satisfies ``pred``; bound as ``name``."""
    initializer_only = False

    def __init__(self, name: Optional[str] = None, pred: Optional[Callable[[np.ndarray], bool]] = None,
                 optional: bool = False):
        self.name, self.pred, self.optional = name, pred, optional


class Init(Const):
    """A constant operand that is an initializer."""
    initializer_only = True


class Op(Pat):
    """A node of ``op_type`` whose inputs match ``inputs`` (see the module docstring)."""

    def __init__(self, op_type: Any, *inputs: Pat, name: Optional[str] = None, domain: Optional[str] = "",
                 one_reader: bool = True, commutative: bool = False, arity: Optional[Sequence[int]] = None,
                 optional: bool = False, where: Optional[Callable[[Any], bool]] = None):
        self.op_type, self.inputs, self.name, self.domain = op_type, inputs, name, domain
        self.one_reader, self.commutative, self.arity = one_reader, commutative, arity
        self.optional, self.where = optional, where
        if commutative and len(inputs) != 2:
            raise ValueError("a commutative pattern takes two inputs")


class Match:
    """What a pattern bound: nodes (``Op`` names), value names (``Var``), arrays (``Const``)."""

    def __init__(self):
        self.bound: Dict[str, Any] = {}
        self.names: Dict[str, str] = {}

    def __getitem__(self, key: str):
        return self.bound[key]

    def __contains__(self, key: str) -> bool:
        return key in self.bound

    def name(self, key: str) -> str:
        """The value name a ``Var``, ``Const`` or ``Op`` binding stands for."""
        return self.names[key]

    def _copy(self) -> "Match":
        m = Match()
        m.bound, m.names = dict(self.bound), dict(self.names)
        return m


def _domain_ok(pat: Op, node) -> bool:
    if pat.domain is None:
        return True
    return node.domain in STANDARD if pat.domain in STANDARD else node.domain == pat.domain


def _node_ok(view: GraphView, pat: Op, node) -> bool:
    types = (pat.op_type,) if isinstance(pat.op_type, str) else pat.op_type
    if node.op_type not in types or not _domain_ok(pat, node):
        return False
    if pat.arity is not None and len(node.input) not in pat.arity:
        return False
    return pat.where is None or bool(pat.where(node))


def _bind(m: Match, key: Optional[str], value: Any, name: str) -> bool:
    if key is None:
        return True
    if key in m.names and m.names[key] != name:
        return False
    m.bound[key], m.names[key] = value, name
    return True


def _value(view: GraphView, pat: Pat, name: str, m: Match) -> Optional[Match]:
    """``m`` extended by ``pat`` matched at value ``name`` (None: no match)."""
    if isinstance(pat, Op):
        node = view.producer(name)
        if node is None or not _node_ok(view, pat, node) or (pat.one_reader and not view.single_reader(name)):
            return _value(view, pat.inputs[0], name, m) if pat.optional else None
        got = _inputs(view, pat, node, m)
        if got is None and pat.optional:
            return _value(view, pat.inputs[0], name, m)
        return got
    m = m._copy()
    if isinstance(pat, Const):
        v = view.init(name) if pat.initializer_only else view.const(name)
        if v is None or (pat.pred is not None and not pat.pred(v)):
            return None
        return m if _bind(m, pat.name, v, name) else None
    if isinstance(pat, Input) and name not in view.inputs:
        return None
    return m if _bind(m, pat.name, name, name) else None


def _inputs(view: GraphView, pat: Op, node, m: Match) -> Optional[Match]:
    m = m._copy()
    if not _bind(m, pat.name, node, node.output[0] if node.output else ""):
        return None
    orders = [list(pat.inputs)]
    if pat.commutative:
        orders.append(list(reversed(pat.inputs)))
    for order in orders:
        got: Optional[Match] = m
        for i, p in enumerate(order):
            if i >= len(node.input) or not node.input[i]:
                if isinstance(p, Const) and p.optional:
                    if p.name is not None:
                        got.bound[p.name], got.names[p.name] = None, ""
                    continue
                got = None
                break
            got = _value(view, p, node.input[i], got)
            if got is None:
                break
        if got is not None:
            return got
    return None


def match(view: GraphView, pattern: Op, node) -> Optional[Match]:
    """``pattern`` matched with ``node`` as its last op (None: no match)."""
    if not _node_ok(view, pattern, node):
        return None
    return _inputs(view, pattern, node, Match())


def matches(view: GraphView, pattern: Op) -> Iterator[Tuple[Any, Match]]:
    """(node, match) for every node of the view, in order, where ``pattern`` matches."""
    for n in list(view.nodes):
        m = match(view, pattern, n)
        if m is not None:
            yield n, m
