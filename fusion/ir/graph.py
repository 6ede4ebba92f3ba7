"""Lossless graph IR over MXNet Symbol JSON.

A :class:`Graph` is the Symbol JSON (``nodes``, ``arg_nodes``, ``node_row_ptr``,
``heads``, graph ``attrs``) with its integer references resolved into objects:
a :class:`Node` holds its inputs as :class:`Entry` values ``(node, output
index, version)``.  Keys of a node that the engine does not interpret (e.g.
``subgraphs`` of control-flow ops, ``control_deps``) are carried along
verbatim.  Attributes are :class:`~fusion.ir.attrs.Attrs`: typed on read,
written back in MXNet's spelling, unchanged strings kept as they were.

Nodes are kept in topological order (the order of the JSON).  A rewrite
places the nodes it creates just before the node it replaces, so the order
stays topological without re-sorting; :meth:`Graph.compact` then drops what
no head reaches and renumbers.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple

import networkx as nx

from . import opdefs
from .attrs import Attrs
from .errors import GraphError

_NODE_KEYS = ("op", "name", "attrs", "attr", "param", "inputs")


def symbol_json(symbol: Any) -> str:
    """``symbol.tojson()`` with every node kept: MXNet 1.9's ``tojson``/``save`` drop the
    ``amp_cast`` nodes of an AMP-converted graph unless told not to, which leaves a graph that
    no longer binds (a bfloat16 weight meets a float32 input)."""
    try:
        return symbol.tojson(remove_amp_cast=False)
    except TypeError:       # a symbol-like object without that option
        return symbol.tojson()


class Node:
    """One operator (or, with ``op == "null"``, one variable) of the graph."""

    __slots__ = ("op", "name", "attrs", "inputs", "extra", "num_outputs", "pos", "dead")

    def __init__(self, op: str, name: str, attrs: Optional[Attrs] = None,
                 inputs: Optional[List["Entry"]] = None, extra: Optional[Dict[str, Any]] = None,
                 num_outputs: int = 1, pos: float = 0.0):
        self.op = op
        self.name = name
        self.attrs = attrs if attrs is not None else Attrs()
        self.inputs: List[Entry] = list(inputs or [])
        self.extra = extra or {}
        self.num_outputs = num_outputs
        self.pos = pos
        self.dead = False

    @property
    def is_variable(self) -> bool:
        return self.op == "null"

    def param(self, key: str, default: Any = ...) -> Any:
        """Attribute ``key`` as a typed value, falling back to MXNet's default for this op."""
        if key in self.attrs:
            return self.attrs[key]
        try:
            return opdefs.default(self.op, key)
        except KeyError:
            if default is ...:
                raise KeyError("%s '%s' has no attribute %r and no known default" % (self.op, self.name, key))
            return default

    def __repr__(self) -> str:
        return "<%s '%s'>" % (self.op, self.name)


class Entry(NamedTuple):
    """Output ``index`` of ``node`` (``version`` is MXNet's variable version, normally 0)."""

    node: Node
    index: int = 0
    version: int = 0

    def __repr__(self) -> str:
        return "%s[%d]" % (self.node.name, self.index) if self.index else repr(self.node.name)


class Graph:
    """An MXNet symbolic graph, loaded losslessly from Symbol JSON."""

    def __init__(self, nodes: List[Node], heads: List[Entry], attrs: Optional[Dict[str, Any]] = None):
        self.nodes = nodes
        self.heads = heads
        self.attrs = attrs if attrs is not None else {"mxnet_version": ["int", 10901]}
        self._users: Optional[Dict[Node, List[Tuple[Node, int]]]] = None
        self._by_op: Optional[Tuple[int, Dict[str, List[Node]]]] = None
        self._compacted = False
        self.version = 0      # bumped by every compact(): caches keyed on it (consumers, shapes) go stale

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_json(cls, data: Any) -> "Graph":
        """Load Symbol JSON (a string, bytes or an already parsed dict); raise GraphError when malformed."""
        if isinstance(data, (bytes, bytearray)):
            try:
                data = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise GraphError("symbol file is not UTF-8 text: %s" % e) from None
        if isinstance(data, str):
            if not data.strip():
                raise GraphError("symbol JSON is empty")
            try:
                data = json.loads(data)
            except json.JSONDecodeError as e:
                raise GraphError("symbol file is not valid JSON (%s at line %d column %d)"
                                 % (e.msg, e.lineno, e.colno)) from None
            except RecursionError:
                raise GraphError("symbol file nests JSON arrays or objects too deep to read "
                                 "(more than %d levels)" % sys.getrecursionlimit()) from None
        if not isinstance(data, dict) or "nodes" not in data or "heads" not in data:
            raise GraphError("not an MXNet Symbol JSON: expected an object with 'nodes' and 'heads'")
        jnodes, jheads = data["nodes"], data["heads"]
        if not isinstance(jnodes, list) or not isinstance(jheads, list):
            raise GraphError("'nodes' and 'heads' must be lists")
        n = len(jnodes)
        row_ptr = data.get("node_row_ptr")
        if row_ptr is not None and not _int_list(row_ptr):
            raise GraphError("'node_row_ptr' must be a list of whole numbers (true/false are not numbers)")
        counts = None
        if isinstance(row_ptr, list) and len(row_ptr) == n + 1:
            counts = [row_ptr[i + 1] - row_ptr[i] for i in range(n)]
        if not isinstance(data.get("attrs", {}), dict):
            raise GraphError("the graph's 'attrs' must be an object")
        nodes: List[Node] = []
        for i, jn in enumerate(jnodes):
            if not isinstance(jn, dict) or not isinstance(jn.get("op"), str) or not isinstance(jn.get("name"), str):
                raise GraphError("node %d is malformed: needs string 'op' and 'name'" % i)
            raw_attrs = jn.get("attrs", jn.get("attr", jn.get("param", {}))) or {}
            if not isinstance(raw_attrs, dict):
                raise GraphError("node %d ('%s') has attributes that are not an object" % (i, jn["name"]))
            bad = next((k for k, v in raw_attrs.items() if not isinstance(v, (str, int, float))), None)
            if bad is not None:
                raise GraphError("node %d ('%s') attribute '%s' is %s, not a string"
                                 % (i, jn["name"], bad, type(raw_attrs[bad]).__name__))
            extra = {k: v for k, v in jn.items() if k not in _NODE_KEYS}
            nout = counts[i] if counts and counts[i] > 0 else 1
            nodes.append(Node(jn["op"], jn["name"], Attrs({k: str(v) for k, v in raw_attrs.items()}),
                              extra=extra, num_outputs=nout, pos=float(i)))
        for i, jn in enumerate(jnodes):
            ins = jn.get("inputs", [])
            if not isinstance(ins, list):
                raise GraphError("node %d ('%s') has 'inputs' that is not a list" % (i, jn["name"]))
            try:                                  # the common, well-formed case, checked cheaply
                nodes[i].inputs = [Entry(nodes[e[0]], e[1], e[2]) for e in ins
                                   if type(e) is list and len(e) == 3 and type(e[0]) is int
                                   and type(e[1]) is int and type(e[2]) is int and e[2] >= 0
                                   and 0 <= e[0] < n and 0 <= e[1] < nodes[e[0]].num_outputs]
                if len(nodes[i].inputs) != len(ins):
                    raise ValueError
            except (TypeError, ValueError, IndexError, KeyError):
                nodes[i].inputs = [cls._entry(nodes, e, i, k) for k, e in enumerate(ins)]
        heads = [cls._entry(nodes, e, None, k) for k, e in enumerate(jheads)]
        if not heads:
            raise GraphError("the graph has no heads (outputs)")
        arg_nodes = data.get("arg_nodes")   # written anew from the nodes, so a stale list is harmless,
        if arg_nodes is not None and not _int_list(arg_nodes):      # but not one of another type
            raise GraphError("'arg_nodes' must be a list of node numbers (true/false are not numbers)")
        graph = cls(nodes, heads, data.get("attrs", {"mxnet_version": ["int", 10901]}))
        graph._check_acyclic()
        return graph

    @staticmethod
    def _entry(nodes: List[Node], e: Any, owner: Optional[int], k: int) -> Entry:
        def where() -> str:
            return "head %d" % k if owner is None else "node %d ('%s') input %d" % (owner, nodes[owner].name, k)

        if type(e) is not list or not 2 <= len(e) <= 3 or not _int_list(e) or e[-1] < 0:
            raise GraphError("%s is malformed: expected [node_id, output_index(, version)] of whole numbers, "
                             "got %s" % (where(), _short(e)))
        nid, idx = e[0], e[1]
        if not 0 <= nid < len(nodes):
            raise GraphError("%s points to node %d, past the node list (%d nodes)" % (where(), nid, len(nodes)))
        node = nodes[nid]
        if idx < 0 or (node.num_outputs > 1 and idx >= node.num_outputs):
            raise GraphError("%s uses output %d of %s, which has %s"
                             % (where(), idx, _described(node, {id(node): nid}), _outputs(node)))
        if node.num_outputs == 1 and idx > 0:
            node.num_outputs = idx + 1  # node_row_ptr absent: learn the count from its uses
        return Entry(node, idx, e[2] if len(e) == 3 else 0)

    def _check_acyclic(self) -> None:
        # Symbol JSON lists producers before consumers; only a file that does not is checked further.
        if all(e.node.pos < nd.pos for nd in self.nodes for e in nd.inputs):
            return
        g = self.to_networkx()
        if not nx.is_directed_acyclic_graph(g):
            cycle = nx.find_cycle(g)
            names = " -> ".join(self.nodes[u].name for u, _ in cycle)
            raise GraphError("the graph has a cycle: %s" % names)
        # A DAG listed out of order: sort it once, keeping the file's order where it is free.
        order = list(nx.lexicographical_topological_sort(g, key=lambda k: k))
        self.nodes = [self.nodes[k] for k in order]
        for p, nd in enumerate(self.nodes):
            nd.pos = float(p)

    @classmethod
    def from_symbol(cls, symbol: Any) -> "Graph":
        return cls.from_json(symbol_json(symbol))

    # ------------------------------------------------------------------ saving
    def to_json(self) -> Dict[str, Any]:
        """The graph as a Symbol JSON dict (nodes reachable from the heads, in topological order)."""
        self.compact()
        index = {id(nd): i for i, nd in enumerate(self.nodes)}
        jnodes, row_ptr = [], [0]
        for nd in self.nodes:
            jn: Dict[str, Any] = {"op": nd.op, "name": nd.name}
            if len(nd.attrs):
                jn["attrs"] = nd.attrs.to_json()
            jn["inputs"] = [[index[id(e.node)], e.index, e.version] for e in nd.inputs]
            jn.update(nd.extra)
            jnodes.append(jn)
            row_ptr.append(row_ptr[-1] + nd.num_outputs)
        return {
            "nodes": jnodes,
            "arg_nodes": [i for i, nd in enumerate(self.nodes) if nd.is_variable],
            "node_row_ptr": row_ptr,
            "heads": [[index[id(e.node)], e.index, e.version] for e in self.heads],
            "attrs": self.attrs,
        }

    def to_json_str(self) -> str:
        try:
            return json.dumps(self.to_json())
        except RecursionError:
            raise GraphError("a node carries a value nested too deep to write as JSON") from None

    def to_symbol(self):
        """The graph as an ``mx.sym.Symbol`` (raises GraphError when MXNet refuses it)."""
        import mxnet as mx
        self.check_expr_depth()
        try:
            return mx.sym.load_json(self.to_json_str())
        except mx.base.MXNetError as e:
            raise GraphError("MXNet cannot load the graph: %s" % first_line(str(e))) from None

    # ------------------------------------------------------------------ what MXNet would crash on
    def check_loadable(self) -> None:
        """Raise GraphError for what MXNet 1.9.1 would not refuse but crash on, later, in native code.

        Run on graphs read from a file (``Graph.from_json`` itself needs no MXNet): an entry naming
        an output its op does not have (a SIGSEGV or SIGABRT at bind), a ``fused_elemwise``
        expression nested deeper than its parser's stack allows.
        """
        self.check_expr_depth()
        for nd in self.variables():
            nd.num_outputs = 1
        for nd in self.op_nodes():
            count = opdefs.num_outputs(nd.op, nd.attrs.to_json(), len(nd.inputs), nd.extra.get("subgraphs"))
            if count is not None:
                nd.num_outputs = count
        index = {id(nd): i for i, nd in enumerate(self.nodes)}
        for i, nd in enumerate(self.nodes):
            for k, e in enumerate(nd.inputs):
                if e.index >= e.node.num_outputs:
                    raise GraphError("node %d ('%s') input %d uses output %d of %s, which has %s"
                                     % (i, nd.name, k, e.index, _described(e.node, index), _outputs(e.node)))
        for k, e in enumerate(self.heads):
            if e.index >= e.node.num_outputs:
                raise GraphError("head %d uses output %d of %s, which has %s"
                                 % (k, e.index, _described(e.node, index), _outputs(e.node)))

    def check_expr_depth(self) -> None:
        for nd in self.nodes:
            if nd.op == "fused_elemwise":
                depth = expr_depth(nd.attrs.raw("expr") or "")
                if depth > MAX_EXPR_DEPTH:
                    raise GraphError("fused_elemwise '%s' has an expression nested %d deep, more than the %d "
                                     "MXNet can load safely" % (nd.name, depth, MAX_EXPR_DEPTH))

    # ------------------------------------------------------------------ queries
    def op_nodes(self) -> List[Node]:
        return [nd for nd in self.nodes if not nd.is_variable]

    def variables(self) -> List[Node]:
        return [nd for nd in self.nodes if nd.is_variable]

    def consumers(self) -> Dict[Node, List[Tuple[Node, int]]]:
        """node -> [(consumer, input slot)] over the live graph (cached until the next compact())."""
        if self._users is None:
            users: Dict[Node, List[Tuple[Node, int]]] = defaultdict(list)
            for nd in self.nodes:
                for slot, e in enumerate(nd.inputs):
                    users[e[0]].append((nd, slot))
            self._users = users
        return self._users

    def to_networkx(self) -> nx.DiGraph:
        """Edges producer -> consumer, nodes numbered by their position in ``self.nodes``."""
        index = {id(nd): i for i, nd in enumerate(self.nodes)}
        g = nx.DiGraph()
        g.add_nodes_from(range(len(self.nodes)))
        g.add_edges_from((index[id(e.node)], i) for i, nd in enumerate(self.nodes) for e in nd.inputs)
        return g

    def nodes_by_op(self) -> Dict[str, List[Node]]:
        """op -> its nodes in topological order (cached until the next compact())."""
        if self._by_op is None or self._by_op[0] != self.version:
            index: Dict[str, List[Node]] = defaultdict(list)
            for nd in self.nodes:
                index[nd.op].append(nd)
            self._by_op = (self.version, index)
        return self._by_op[1]

    def count_ops(self) -> Dict[str, int]:
        counts: Dict[str, int] = {}
        for nd in self.op_nodes():
            counts[nd.op] = counts.get(nd.op, 0) + 1
        return counts

    def unknown_ops(self) -> List[str]:
        """Ops in the graph that MXNet (with the libraries loaded now) does not know."""
        return sorted({nd.op for nd in self.op_nodes() if not opdefs.is_registered(nd.op)})

    # ------------------------------------------------------------------ editing
    def compact(self) -> None:
        """Drop nodes no head reaches, order by position, renumber positions 0..n-1.

        A no-op when nothing changed since the last call (``mark_changed`` says otherwise).
        """
        if self._compacted:
            return
        self._users = None
        self.version += 1
        nodes = self.nodes
        nodes.sort(key=lambda nd: nd.pos)        # nearly sorted: rewrites append their nodes at the end
        for nd in nodes:
            nd.dead = True
        for e in self.heads:
            e.node.dead = False
        for nd in reversed(nodes):               # topological order: consumers come after producers
            if not nd.dead:
                for e in nd.inputs:
                    e.node.dead = False
        kept = [nd for nd in nodes if not nd.dead]
        for i, nd in enumerate(kept):
            nd.pos = float(i)
        if any(e.node.pos >= nd.pos for nd in kept for e in nd.inputs):
            kept = _in_order(kept)
        self.nodes = kept
        self._compacted = True

    def mark_changed(self) -> None:
        """Nodes were added or rewired: the next compact() has work to do."""
        self._compacted = False

    def canonicalize_ops(self) -> None:
        """Spell every op as MXNet registers it (``_Plus`` → ``elemwise_add``, ``swapaxes`` →
        ``SwapAxis``), as ``Symbol.tojson()`` would: rules match one spelling of each op, and a
        graph read from JSON written by another tool fuses as it would after a round trip."""
        for nd in self.nodes:
            # an op with subgraphs (oneDNN's _sg_mkldnn_*, control flow) is spelled as registered already;
            # MXNet crashes loading one without its subgraph, which is how canonical_name asks
            if not nd.is_variable and "subgraphs" not in nd.extra:
                nd.op = opdefs.canonical_name(nd.op, nd.attrs.to_json(), len(nd.inputs))

    def copy(self) -> "Graph":
        """A deep copy (new Node objects), so that rewriting never touches the caller's graph."""
        return Graph.from_json(self.to_json())

    def unique_name(self, base: str, taken: Optional[set] = None) -> str:
        names = taken if taken is not None else {nd.name for nd in self.nodes}
        if base not in names:
            return base
        k = 1
        while "%s_%d" % (base, k) in names:
            k += 1
        return "%s_%d" % (base, k)


# fused_elemwise's expression parser recurses once per nesting level, ~420 bytes of stack each:
# MXNet's load_json crashed at depth ~19,000 on an 8 MiB stack, ~2,500 on 1 MiB, ~600 on 256 KiB.
# The elementwise rule writes at most 256 levels; files nesting deeper than this are refused.
MAX_EXPR_DEPTH = 4096


def _in_order(nodes: List[Node]) -> List[Node]:
    """``nodes`` (positions 0..n-1, each node's producers among them) in topological order, each
    node as early as its position allows: a rewrite that gives back several values (a region read
    at several points) puts its node where some readers of its values stood before it."""
    import heapq

    waiting = {id(nd): len({id(e.node) for e in nd.inputs}) for nd in nodes}
    readers: Dict[int, List[Node]] = defaultdict(list)
    for nd in nodes:
        for src in {id(e.node): e.node for e in nd.inputs}.values():
            readers[id(src)].append(nd)
    ready = [(nd.pos, nd) for nd in nodes if waiting[id(nd)] == 0]     # positions are distinct: never a tie
    heapq.heapify(ready)
    out: List[Node] = []
    while ready:
        _, nd = heapq.heappop(ready)
        out.append(nd)
        for r in readers[id(nd)]:
            waiting[id(r)] -= 1
            if waiting[id(r)] == 0:
                heapq.heappush(ready, (r.pos, r))
    if len(out) != len(nodes):
        raise GraphError("a rewrite left the graph with a cycle (%d of %d nodes in order)" % (len(out), len(nodes)))
    for i, nd in enumerate(out):
        nd.pos = float(i)
    return out


def upstream(start: Iterable[Node], stop: Iterable[Node] = ()) -> Iterator[Node]:
    """Each node ``start`` reads from, directly or not (``start`` included), once; the nodes of ``stop``
    are neither yielded nor walked through."""
    seen = {id(n) for n in stop}
    todo = list(start)
    while todo:
        n = todo.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        yield n
        todo.extend(e.node for e in n.inputs)


def expr_depth(expr: str) -> int:
    """The deepest nesting of parentheses in a fused_elemwise expression."""
    depth = deepest = 0
    for ch in expr:
        if ch == "(":
            depth += 1
            if depth > deepest:
                deepest = depth
        elif ch == ")":
            depth -= 1
    return deepest


def _int_list(value: Any) -> bool:
    """A list of whole numbers (JSON's true/false are not: Python reads them as 1/0, MXNet refuses them)."""
    return type(value) is list and all(type(v) is int for v in value)


def _short(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _described(node: Node, index: Dict[int, int]) -> str:
    return "node %d ('%s', %s)" % (index[id(node)], node.name, "a variable" if node.is_variable else node.op)


def _outputs(node: Node) -> str:
    return "1 output" if node.num_outputs == 1 else "%d outputs" % node.num_outputs


def first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in lines:
        if "Check failed" in ln or "Error" in ln:
            return ln
    return lines[-1] if lines else text
