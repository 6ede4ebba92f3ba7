"""Outputs that come out of sorting or NMS: which axis holds rows, and comparing them as sets of rows.

A detection model ends in ``_contrib_box_nms`` (or ``topk``, ``argsort``, ``sort``,
``_contrib_MultiBoxDetection``): its rows are ordered by score.  Two detections whose scores
differ in the 7th digit (0.9924057 and 0.9924055) may change places when the arithmetic
before them is summed in another order — the same detections, another order.  Compared
position by position that is a mismatch of a whole box; compared as a set of rows it is not.

**Which axis holds rows.**  From each graph output the graph is followed back through ops
that keep row identity to the sorting op, and the layout is carried forward again:

* the sorting op: ``box_nms``/``MultiBoxDetection`` on ``(…, N, K)`` — rows on axis −2, each
  leading axis (batch) sorted on its own, the K values of a row its content; ``topk`` (values,
  indices; not ``mask``), ``sort``, ``argsort`` — the sorted axis, every other axis a line
  sorted on its own;
* ops that keep it: slicing (``slice_axis``, ``slice``, ``split`` — of the rows too: the rows
  kept are still rows), ``Concat`` of values of the same sorting op, elementwise ops of one
  operand, and of several where every other operand is one value along the row axis
  (``broadcast_mul(boxes, scale)`` of a scale (1, 1, 4)), ``transpose``/``SwapAxis`` (the axes
  move), and reshapes (``Reshape``, ``expand_dims``, ``squeeze``, ``Flatten``) that keep each row's
  values together: a shape that still reads (lines, rows, content) with the content unchanged —
  merging the lines into the rows is allowed (matched across them, a weaker check), splitting rows
  or mixing them with their content is not.

Anything else makes the output positional.  **Comparing**: per output group of one sorting op
and one (lines, rows) shape, each line's rows are matched, all outputs of the group jointly (the
class id, score and box of a detection move together): rows equal in place stay matched, the
others are paired by minimal total cost (the largest difference of a row's values, each output
scaled by its own magnitude; SciPy's ``linear_sum_assignment`` when installed, else the
cheapest pairs first), then the values are compared as ``fusion.verify`` compares any output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..ir.graph import Entry, Graph, Node

NMS = frozenset({"_contrib_box_nms", "_contrib_box_non_maximum_suppression", "_contrib_MultiBoxDetection"})
SORTS = frozenset({"topk", "sort", "argsort"})
_SLICES = frozenset({"slice_axis", "slice", "crop", "_slice"})
_SPLITS = frozenset({"split", "SliceChannel", "_split_v2"})
_RESHAPES = frozenset({"Reshape", "reshape", "expand_dims", "squeeze", "Flatten", "flatten", "reshape_like"})
_BINARY = frozenset({"elemwise_add", "elemwise_sub", "elemwise_mul", "elemwise_div", "_plus", "_minus", "_mul",
                     "_div", "_Plus", "_Minus", "_Mul", "_Div", "_maximum", "_minimum", "_Maximum", "_Minimum",
                     "where", "_grad_add"})
_UNARY = frozenset({"Cast", "cast", "amp_cast", "_copy", "identity", "BlockGrad", "stop_gradient", "clip", "abs",
                    "sign", "round", "rint", "ceil", "floor", "trunc", "fix", "exp", "log", "sqrt", "square",
                    "sigmoid", "relu", "tanh", "Activation", "negative", "reciprocal", "softsign", "erf",
                    "log1p", "expm1", "LeakyReLU", "hard_sigmoid", "zeros_like", "ones_like"})
#: rows of a line above which the rows equal in place are kept without looking further
ASSIGN_ALL_BELOW = 512
#: rows paired by cost at most (more: a model that differs everywhere; paired in sorted order)
MAX_ASSIGNED = 2048


@dataclass(frozen=True)
class RowLayout:
    """Where the rows of an output are: ``row_axis``; ``lines``: axes sorted independently (a batch)."""

    source: str                 # "_contrib_box_nms 'ssd0_box_nms0'"
    row_axis: int
    lines: Tuple[int, ...]

    def describe(self) -> str:
        return "a set of rows along axis %d%s (ordered by %s)" % (
            self.row_axis, ", per index of axis %s" % ", ".join(map(str, self.lines)) if self.lines else "",
            self.source)


def _is_elementwise(op: str) -> bool:
    return op in _UNARY or op.endswith("_scalar") or op.startswith("_scalar")


def row_layouts(symbol: Any, arg_params: Mapping[str, Any], aux_params: Mapping[str, Any],
                input_shapes: Mapping[str, Sequence[int]]) -> Dict[int, RowLayout]:
    """{output index: its row layout} for the outputs that hold the rows of a sorting op."""
    from ..engine.facts import infer

    graph = Graph.from_symbol(symbol)
    if not any(nd.op in NMS or nd.op in SORTS for nd in graph.nodes):
        return {}
    known = {k: tuple(v.shape) for k, v in list(arg_params.items()) + list(aux_params.items())}
    known.update({k: tuple(v) for k, v in input_shapes.items()})
    shapes, _ = infer(graph, known)
    walk = _Walk(shapes)
    out = {}
    for i, e in enumerate(graph.heads):
        layout = walk.layout(e)
        if layout is not None:
            out[i] = layout
    return out


class _Walk:
    def __init__(self, shapes: Mapping[Entry, Tuple[int, ...]]):
        self.shapes = shapes
        self.memo: Dict[Entry, Optional[RowLayout]] = {}

    def layout(self, entry: Entry) -> Optional[RowLayout]:
        stack = [entry]
        while stack:            # inputs first, without recursion (long chains of slices)
            e = stack[-1]
            missing = [i for i in self._inputs(e.node) if i not in self.memo]
            if missing:
                stack.extend(missing)
                continue
            stack.pop()
            if e not in self.memo:
                try:
                    self.memo[e] = self._layout(e)
                except (KeyError, TypeError, ValueError, IndexError):  # attributes this reading does not know
                    self.memo[e] = None
        return self.memo[entry]

    def _inputs(self, nd: Node) -> List[Entry]:
        if nd.is_variable or nd.op in NMS or nd.op in SORTS:
            return []
        if nd.op in _SLICES or nd.op in _SPLITS or nd.op in _RESHAPES or _is_elementwise(nd.op) or \
                nd.op in ("transpose", "SwapAxis", "swapaxes", "Concat", "concat") or nd.op in _BINARY or \
                nd.op.startswith("broadcast_"):
            return list(nd.inputs)
        return []

    def _shape(self, e: Entry) -> Optional[Tuple[int, ...]]:
        return self.shapes.get(e)

    def _layout(self, e: Entry) -> Optional[RowLayout]:
        nd = e.node
        out = self._shape(e)
        if out is None or nd.is_variable:
            return None
        n = len(out)
        src = "%s '%s'" % (nd.op, nd.name)
        if nd.op in NMS:
            if e.index != 0 or n < 2:
                return None
            return RowLayout(src, n - 2, tuple(range(n - 2)))
        if nd.op in SORTS:
            if nd.op == "topk" and str(nd.attrs.get("ret_typ", "indices")) == "mask":
                return None
            if e.index >= (2 if nd.op == "topk" else 1):
                return None
            axis = nd.param("axis", -1)
            if axis is None or str(axis) == "None":
                return RowLayout(src, 0, ()) if n == 1 else None
            a = int(axis) % n
            return RowLayout(src, a, tuple(i for i in range(n) if i != a))
        ins = [self.memo.get(i) for i in nd.inputs]
        if nd.op in _SLICES:
            return ins[0]
        if nd.op in _SPLITS:
            return self._split(nd, ins[0], self._shape(nd.inputs[0]), n)
        if nd.op in _RESHAPES:
            return _reshaped(ins[0], self._shape(nd.inputs[0]), out)
        if nd.op in ("transpose",):
            axes = tuple(int(a) for a in (nd.param("axes", ()) or ())) or tuple(reversed(range(n)))
            return _moved(ins[0], axes)
        if nd.op in ("SwapAxis", "swapaxes"):
            a, b = int(nd.param("dim1", 0)) % n, int(nd.param("dim2", 0)) % n
            axes = list(range(n))
            axes[a], axes[b] = axes[b], axes[a]
            return _moved(ins[0], tuple(axes))
        if nd.op in ("Concat", "concat"):
            return ins[0] if ins and all(x is not None and x == ins[0] for x in ins) else None
        if _is_elementwise(nd.op) or nd.op in _BINARY or nd.op.startswith("broadcast_"):
            return self._elementwise(nd, ins, out)
        return None

    def _split(self, nd: Node, layout: Optional[RowLayout], shape, n: int) -> Optional[RowLayout]:
        if layout is None or shape is None:
            return None
        axis = int(nd.param("axis", 1)) % len(shape)
        if not nd.param("squeeze_axis", False) or n == len(shape):
            return layout
        if axis == layout.row_axis:
            return None         # one row each, squeezed away
        shift = lambda a: a - 1 if a > axis else a     # noqa: E731
        return RowLayout(layout.source, shift(layout.row_axis), tuple(shift(a) for a in layout.lines if a != axis))

    def _elementwise(self, nd: Node, ins: List[Optional[RowLayout]], out) -> Optional[RowLayout]:
        found = None
        for slot, (e, lay) in enumerate(zip(nd.inputs, ins)):
            s = self._shape(e)
            if s is None:
                return None
            if lay is not None and len(s) == len(out):
                if found is not None and lay != found:
                    return None
                found = lay
        if found is None:
            return None
        for e, lay in zip(nd.inputs, ins):
            if lay == found:
                continue
            s = self._shape(e)          # one value along the row axis (broadcast from the right)
            k = found.row_axis - (len(out) - len(s))
            if 0 <= k < len(s) and s[k] != 1:
                return None
        return found


def _moved(layout: Optional[RowLayout], axes: Tuple[int, ...]) -> Optional[RowLayout]:
    if layout is None:
        return None
    where = {a: i for i, a in enumerate(axes)}
    return RowLayout(layout.source, where[layout.row_axis], tuple(sorted(where[a] for a in layout.lines)))


def _reshaped(layout: Optional[RowLayout], shape, out) -> Optional[RowLayout]:
    """The layout after a reshape that keeps each row's values together (see module docs)."""
    if layout is None or shape is None or out is None:
        return None
    r = layout.row_axis
    if layout.lines != tuple(range(r)):
        return None             # lines after the rows (a transposed layout): their order is mixed
    L, N, C = int(np.prod(shape[:r])), int(shape[r]), int(np.prod(shape[r + 1:]))
    for k in range(len(out)):
        lines, rows, content = int(np.prod(out[:k])), int(out[k]), int(np.prod(out[k + 1:]))
        if content == C and lines * rows == L * N and rows % N == 0 and (N > 1 or rows == 1):
            return RowLayout(layout.source, k, tuple(range(k)))
    return None


# ---------------------------------------------------------------- matching

def _canonical(a: np.ndarray, layout: RowLayout) -> Tuple[np.ndarray, tuple]:
    """``a`` as (lines, rows, content), and what undoes it."""
    content = tuple(i for i in range(a.ndim) if i != layout.row_axis and i not in layout.lines)
    order = layout.lines + (layout.row_axis,) + content
    t = np.transpose(a, order)
    lines = int(np.prod([a.shape[i] for i in layout.lines])) if layout.lines else 1
    return t.reshape(lines, a.shape[layout.row_axis], -1), (order, t.shape)


def _uncanonical(c: np.ndarray, undo: tuple) -> np.ndarray:
    order, tshape = undo
    return np.transpose(c.reshape(tshape), np.argsort(order))


def _costs(a: np.ndarray, b: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """cost[i, j]: the largest scaled difference between row i of ``a`` and row j of ``b`` (NaN
    equal to NaN, other non-finite differences infinite)."""
    d = np.abs(a[:, None, :].astype(np.float64) - b[None, :, :].astype(np.float64)) / scale
    same = (a[:, None, :] == b[None, :, :]) | (np.isnan(a[:, None, :]) & np.isnan(b[None, :, :]))
    d = np.where(same, 0.0, np.where(np.isfinite(d), d, np.inf))
    return d.max(axis=2) if d.shape[2] else np.zeros(d.shape[:2])


def _assign(cost: np.ndarray) -> np.ndarray:
    """For each row i, the column it is paired with: minimal total cost."""
    finite = np.where(np.isfinite(cost), cost, 1e300)
    try:
        from scipy.optimize import linear_sum_assignment
    except ImportError:
        linear_sum_assignment = None
    if linear_sum_assignment is not None:
        rows, cols = linear_sum_assignment(finite)
        out = np.empty(len(rows), dtype=int)
        out[rows] = cols
        return out
    out = np.full(cost.shape[0], -1)
    used = np.zeros(cost.shape[1], dtype=bool)
    for flat in np.argsort(finite, axis=None, kind="stable"):       # cheapest pairs first
        i, j = divmod(int(flat), cost.shape[1])
        if out[i] < 0 and not used[j]:
            out[i], used[j] = j, True
    return out


def _in_place(a: np.ndarray, b: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The cost of each row against the row in its own place (``_costs``' diagonal)."""
    d = np.abs(a - b) / scale
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    d = np.where(same, 0.0, np.where(np.isfinite(d), d, np.inf))
    return d.max(axis=1) if d.shape[1] else np.zeros(a.shape[0])


def _match_line(a: np.ndarray, b: np.ndarray, scale: np.ndarray, rtol: float) -> np.ndarray:
    """perm with b[perm] matching a row for row."""
    n = a.shape[0]
    perm = np.arange(n)
    if n > ASSIGN_ALL_BELOW:        # many rows: those equal in place stay, the rest are paired
        free = np.flatnonzero(_in_place(a, b, scale) > rtol)
    else:
        free = np.arange(n)
    if len(free) == 0:
        return perm
    if len(free) > MAX_ASSIGNED:    # most rows differ (a failing model): pair them in sorted order
        order_a = np.lexsort(a[free].T[::-1])
        order_b = np.lexsort(b[free].T[::-1])
        perm[free[order_a]] = free[order_b]
        return perm
    cost = _costs(a[free], b[free], scale)
    if np.all(np.diag(cost) <= cost.min(axis=1)):        # in place already as good as any
        return perm
    perm[free] = free[_assign(cost)]
    return perm


def align_rows(reference: Sequence[np.ndarray], candidate: Sequence[np.ndarray],
               layouts: Mapping[int, RowLayout], rtol: float = 1e-4) -> Tuple[List[np.ndarray], Dict[int, int]]:
    """``candidate`` with the rows of each ranked output put in the order of ``reference``'s, and
    per ranked output how many rows changed places.  Outputs of one sorting op with the same
    (lines, rows) are matched jointly."""
    out = list(candidate)
    moved: Dict[int, int] = {}
    groups: Dict[tuple, List[int]] = {}
    canon: Dict[int, tuple] = {}
    for i, lay in layouts.items():
        if i >= len(reference) or reference[i].shape != candidate[i].shape or reference[i].size == 0:
            continue
        ca, undo = _canonical(reference[i], lay)
        cb, _ = _canonical(candidate[i], lay)
        canon[i] = (ca, cb, undo)
        groups.setdefault((lay.source, ca.shape[0], ca.shape[1]), []).append(i)
    for members in groups.values():
        a = np.concatenate([canon[i][0].astype(np.float64) for i in members], axis=2)
        b = np.concatenate([canon[i][1].astype(np.float64) for i in members], axis=2)
        scale = np.concatenate([np.full(canon[i][0].shape[2], _magnitude(canon[i][0])) for i in members])
        perms = [_match_line(a[l], b[l], scale, rtol) for l in range(a.shape[0])]
        changed = int(sum(np.count_nonzero(p != np.arange(len(p))) for p in perms))
        for i in members:
            cb = canon[i][1]
            aligned = np.stack([cb[l][perms[l]] for l in range(cb.shape[0])])
            out[i] = _uncanonical(aligned, canon[i][2]).astype(candidate[i].dtype, copy=False)
            moved[i] = changed
    return out, moved


def _magnitude(a: np.ndarray) -> float:
    fin = np.abs(a[np.isfinite(a)]) if a.size else np.zeros(0)
    m = float(fin.max()) if fin.size else 0.0
    return m if m > 0 else 1.0
