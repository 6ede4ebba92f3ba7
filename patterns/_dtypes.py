"""Which values the float32-only fused ops must not take."""
from __future__ import annotations

from typing import Iterable, Optional

import numpy as np

from fusion.ir.graph import Entry
from fusion.precision.policy import is_bf16

# MXNet's dtype codes (mshadow): 0 float32, 1 float64, 2 float16, 3 uint8, 4 int32, 5 int8, 6 int64, ...
_FLOAT32_NAMES = {"float32", "0", None}
_INT_PRODUCERS = {"shape_array", "size_array", "argmax", "argmin", "argsort", "topk"}


def not_float32(entry: Entry, ctx) -> bool:
    """Whether ``entry`` holds something else than float32: MXNet's type inference decides
    (``ctx.dtype``); where it cannot tell, whether it is known or very likely to.

    The fused ops compute in float32; a value of integer ids (e.g. a padding mask built
    from token ids) or of half precision must stay with MXNet's own ops.
    """
    dtype = ctx.dtype(entry) if hasattr(ctx, "dtype") else None
    if dtype is not None:
        return dtype != "float32"
    types = _types_without_shapes(ctx)
    if entry in types:
        return types[entry] != "float32"
    node = entry.node
    if node.op == "null":
        dtype = node.attrs.get("__dtype__")
        if dtype is None:
            dtype = ctx.input_dtypes.get(node.name)
        if dtype is None and ctx.value(entry) is not None:
            dtype = str(ctx.value(entry).dtype)
        return str(dtype) not in {"float32", "0", "None"}
    if node.op in ("Cast", "cast", "amp_cast"):
        return str(node.attrs.get("dtype")) not in _FLOAT32_NAMES
    if node.op in _INT_PRODUCERS:
        return True
    if "dtype" in node.attrs and node.op not in ("fused_elemwise",):
        return str(node.attrs.get("dtype")) not in _FLOAT32_NAMES
    return False



def _types_without_shapes(ctx) -> dict:
    """MXNet's type inference over the graph when no shapes are known (types need none): the
    given input dtypes and the parameters' own, other inputs float32 as bind makes them."""
    graph = getattr(ctx, "graph", None)
    if graph is None or not hasattr(ctx, "memo"):
        return {}
    key = ("types_without_shapes", graph.version)
    if key not in ctx.memo:
        from fusion.engine.facts import infer_dtypes
        given = dict(getattr(ctx, "input_dtypes", {}) or {})
        stores = [getattr(ctx, k, None) or {} for k in ("new_args", "new_aux", "arg_params", "aux_params")]
        for nd in graph.variables():
            for store in stores:
                if nd.name in store:
                    if not is_bf16(store[nd.name].dtype):     # bfloat16: declared by the variable itself
                        given[nd.name] = np.dtype(store[nd.name].dtype).name
                    break
        ctx.memo[key] = infer_dtypes(graph, given)
    return ctx.memo[key]


def float32_reason(entries: Iterable[Entry], ctx) -> Optional[str]:
    """A reason when one of ``entries`` is not float32 (the fused ops compute in float32)."""
    for e in entries:
        if not_float32(e, ctx):
            return "'%s' is not float32; the fused op computes in float32" % e.node.name
    return None
