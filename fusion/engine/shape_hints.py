"""Parameter shapes written into a fused graph, so that MXNet can bind it from the data's shapes alone.

MXNet's classic APIs bind a graph from its inputs' shapes and infer every parameter's: ``Module.bind
(data_shapes=...)``, ``simple_bind``, a ``gluon.SymbolBlock``'s deferred initialisation.  Its own
operators infer their parameters from the data (FullyConnected's weight from ``num_hidden`` and the
data's width); the library ops do too (``cuda_kernels/common/mxf_common.h``, ``fill_input``), but
MXNet 1.9.1's wrapper for library ops carries that only part of the way: it copies back the input
shapes an op fills, yet it sizes the buffer it hands the op by the inputs' dims counting an unknown
input as -1, so it writes past that buffer -- a crash in MXNet before the op runs where the unknown
inputs are as many as the known inputs' dims (a ``fused_dense`` of 2-D data with its weight and
bias unknown), heap damage elsewhere.  Only inputs MXNet already knows in part (Gluon's exported
hints such as ``(16, 0)``) pass safely.

So a fused graph carries the shape of every parameter it reads as the variable's ``__shape__``
attribute, MXNet's own shape hint (what ``mx.sym.var(name, shape=...)`` writes and Gluon exports):
MXNet's shape inference reads it for a variable before it asks any op, and a shape the caller
gives (``simple_bind(data=...)``, ``Module.bind``) takes precedence.  A parameter's shape does not
change with the data's, so the hint holds at every input shape.  Its dtype likewise, as
``__dtype__`` where the graph does not declare one (the library ops take a parameter's dtype as
given, where FullyConnected would take its data's).

Limits: a graph with library ops whose parameters carry no hint (written by hand, or hints
removed) binds from the data's shapes only where the op can fill them and MXNet's wrapper passes
them, as above; otherwise bind with the parameters' shapes or arrays (``bind(args=...)``).
"""
from __future__ import annotations

from typing import Optional

from ..ir.graph import Entry, Graph

HINT = "__shape__"
DTYPE_HINT = "__dtype__"


def is_library_op(op: str) -> bool:
    """An op of the project's op library (MXNet's wrapper for library ops does its shape inference)."""
    return op.startswith("fused_")


def hint_param_shapes(graph: Graph, ctx) -> int:
    """Write ``__shape__`` on the parameter variables of ``graph`` (in place) where it has a library op:
    every parameter with a known array (the caller's, or one a rule computed), and a variable a
    library op reads whose inferred shape is the same at every probe shape; and ``__dtype__`` where
    the variable declares none and its array is known.  Returns how many attributes were written."""
    if not any(is_library_op(nd.op) for nd in graph.op_nodes()):
        return 0
    read_by_library = {id(e.node) for nd in graph.op_nodes() if is_library_op(nd.op) for e in nd.inputs}
    inputs = set(ctx.input_shapes)
    count = 0
    for nd in graph.variables():
        if nd.name in inputs:
            continue
        shape = _array_shape(ctx, nd.name)
        code = _array_dtype_code(ctx, nd.name)
        if code is not None and DTYPE_HINT not in nd.attrs:
            nd.attrs[DTYPE_HINT] = str(code)
            count += 1
        if shape is None and id(nd) in read_by_library:
            shape = _stable_shape(ctx, Entry(nd))
        if not shape or not all(shape):     # no dims, or a 0 (MXNet's legacy shapes read both as unknown)
            continue
        if nd.attrs.raw(HINT) != _spelled(shape):
            nd.attrs[HINT] = _spelled(shape)
            count += 1
    if count:
        graph.mark_changed()
    return count


def _array_shape(ctx, name: str) -> Optional[tuple]:
    for store in (ctx.new_args, ctx.new_aux, ctx.arg_params, ctx.aux_params):
        if name in store:
            return tuple(int(d) for d in store[name].shape)
    return None


def _array_dtype_code(ctx, name: str) -> Optional[int]:
    """MXNet's code of the parameter's dtype (0 float32, ..., 12 bfloat16), None when unknown."""
    import numpy as np

    from ..precision.policy import BF16_CODE, is_bf16

    codes = {np.dtype(k): v for k, v in _np_to_mx().items() if k is not None and not isinstance(k, np.dtype)}
    for store in (ctx.new_args, ctx.new_aux, ctx.arg_params, ctx.aux_params):
        if name in store:
            dtype = store[name].dtype
            if is_bf16(dtype):
                return BF16_CODE
            try:
                return codes.get(np.dtype(dtype))
            except TypeError:
                return None
    return None


def _np_to_mx() -> dict:
    from mxnet.ndarray.ndarray import _DTYPE_NP_TO_MX
    return _DTYPE_NP_TO_MX


def _stable_shape(ctx, entry: Entry) -> Optional[tuple]:
    """The entry's inferred shape where it is one and the same at every probe (a parameter's), else None."""
    shapes = set(ctx.shapes(entry)) if ctx.input_shapes else set()
    if len(shapes) != 1:
        return None
    shape = next(iter(shapes))
    return shape if shape and all(int(d) > 0 for d in shape) else None


def _spelled(shape: tuple) -> str:
    """A shape as MXNet writes ``__shape__`` (``(16, 8)``, ``(4,)``)."""
    return "(%s)" % (", ".join(str(int(d)) for d in shape) + ("," if len(shape) == 1 else ""))
