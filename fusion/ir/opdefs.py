"""What the engine needs to know about MXNet's operators: defaults, op families, the registry.

MXNet omits an attribute from Symbol JSON when it has its default value, so a
rule reading ``eps`` from a ``BatchNorm`` must fall back to MXNet's default
(``1e-3``), not to Gluon's (``1e-5``).  The defaults below are MXNet 1.9.1's.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import Any, Dict, FrozenSet, List, Optional

DEFAULTS: Dict[str, Dict[str, Any]] = {
    "BatchNorm": dict(eps=1e-3, momentum=0.9, fix_gamma=True, use_global_stats=False,
                      output_mean_var=False, axis=1, cudnn_off=False),
    "Convolution": dict(no_bias=False, num_group=1, layout=None, stride=(), dilate=(), pad=()),
    "Deconvolution": dict(no_bias=True, num_group=1, layout=None, stride=(), dilate=(), pad=(),
                          adj=(), target_shape=()),
    "FullyConnected": dict(no_bias=False, flatten=True),
    "LeakyReLU": dict(act_type="leaky", slope=0.25, lower_bound=0.125, upper_bound=0.334),
    "softmax": dict(axis=-1, temperature=None, use_length=False),
    "log_softmax": dict(axis=-1, temperature=None, use_length=False),
    "Dropout": dict(p=0.5, mode="training", axes=()),
    "LayerNorm": dict(axis=-1, eps=1e-5, output_mean_var=False),
    "batch_dot": dict(transpose_a=False, transpose_b=False),
    "_linalg_gemm2": dict(transpose_a=False, transpose_b=False, alpha=1.0, axis=-2),
    "linalg_gemm2": dict(transpose_a=False, transpose_b=False, alpha=1.0, axis=-2),
}

# Binary ops whose two inputs may be swapped without changing the result.
COMMUTATIVE: FrozenSet[str] = frozenset({
    "elemwise_add", "broadcast_add", "broadcast_plus", "_add", "_plus", "_Plus",
    "elemwise_mul", "broadcast_mul", "_mul", "_Mul",
    "broadcast_maximum", "broadcast_minimum", "_maximum", "_minimum", "_Maximum", "_Minimum",
})

# Spellings of the same op (MXNet registers aliases; JSON carries whichever the frontend used).
ALIASES: Dict[str, FrozenSet[str]] = {
    "add": frozenset({"elemwise_add", "broadcast_add", "broadcast_plus", "_add", "_plus", "_Plus"}),
    "mul": frozenset({"elemwise_mul", "broadcast_mul", "_mul", "_Mul"}),
    "sub": frozenset({"elemwise_sub", "broadcast_sub", "broadcast_minus", "_sub", "_minus", "_Minus"}),
    "div": frozenset({"elemwise_div", "broadcast_div", "_div", "_Div"}),
    "gemm2": frozenset({"linalg_gemm2", "_linalg_gemm2"}),
}

# Scalar-op forms: kind -> MXNet op taking (x, scalar=c).
SCALAR_OPS: Dict[str, FrozenSet[str]] = {
    "add": frozenset({"_plus_scalar", "_PlusScalar"}),
    "sub": frozenset({"_minus_scalar", "_MinusScalar"}),
    "rsub": frozenset({"_rminus_scalar", "_RMinusScalar"}),
    "mul": frozenset({"_mul_scalar", "_MulScalar"}),
    "div": frozenset({"_div_scalar", "_DivScalar"}),
    "rdiv": frozenset({"_rdiv_scalar", "_RDivScalar"}),
    "pow": frozenset({"_power_scalar", "_PowerScalar"}),
    "rpow": frozenset({"_rpower_scalar", "_RPowerScalar"}),
    "max": frozenset({"_maximum_scalar", "_MaximumScalar"}),
    "min": frozenset({"_minimum_scalar", "_MinimumScalar"}),
}


def default(op: str, key: str) -> Any:
    """MXNet's default for attribute ``key`` of ``op``; KeyError when we do not know it."""
    return DEFAULTS[op][key]


@lru_cache(maxsize=1)
def _registry_snapshot() -> FrozenSet[str]:
    return _list_ops()


def _list_ops() -> FrozenSet[str]:
    import mxnet as mx
    size = ctypes.c_uint()
    names = ctypes.POINTER(ctypes.c_char_p)()
    mx.base.check_call(mx.base._LIB.MXListAllOpNames(ctypes.byref(size), ctypes.byref(names)))
    return frozenset(names[i].decode() for i in range(size.value))


def registered_ops() -> FrozenSet[str]:
    """Names of all operators MXNet knows now, including ops from loaded libraries."""
    ops = _registry_snapshot()
    return ops


def is_registered(op: str) -> bool:
    if op in _registry_snapshot():
        return True
    # A library may have been loaded since the snapshot (mx.library.load): look again once.
    _registry_snapshot.cache_clear()
    return op in _registry_snapshot()


_CANONICAL: Dict[str, str] = {}


def canonical_name(op: str, attrs: Dict[str, str], num_inputs: int) -> str:
    """The name MXNet registers ``op`` under (``_Plus`` → ``elemwise_add``, ``reshape`` → ``Reshape``,
    ``sum_axis`` → ``sum``): what ``Symbol.tojson()`` writes.  ``op`` itself when MXNet cannot tell."""
    name = _CANONICAL.get(op)
    if name is not None:
        return name
    import json

    import mxnet as mx
    nodes = [{"op": "null", "name": "x%d" % i, "inputs": []} for i in range(num_inputs)]
    nodes.append({"op": op, "name": "n", "attrs": dict(attrs), "inputs": [[i, 0, 0] for i in range(num_inputs)]})
    try:
        sym = mx.sym.load_json(json.dumps({"nodes": nodes, "arg_nodes": list(range(num_inputs)),
                                            "heads": [[num_inputs, 0, 0]], "attrs": _VERSION}))
        name = json.loads(sym.tojson())["nodes"][-1]["op"]
    except Exception:       # attributes MXNet refuses here: keep the spelling, try again on another node
        return op
    _CANONICAL[op] = name
    return name


_VERSION = {"mxnet_version": ["int", 10901]}    # without it MXNet logs a "legacy JSON upgrade" per load
_NUM_OUTPUTS: Dict[str, Optional[int]] = {}


def num_outputs(op: str, attrs: Dict[str, str], num_inputs: int, subgraphs: Any = None) -> Optional[int]:
    """How many outputs MXNet gives ``op`` with these attributes and inputs (hidden ones included,
    e.g. BatchNorm's 3), or None when MXNet refuses to build the op alone (it will refuse the graph).

    MXNet 1.9.1 does not check the output index of a graph's entries when it loads Symbol JSON:
    a head or input naming an output an op does not have crashes it later (SIGSEGV, SIGABRT).
    The op is built alone, once per op, attributes and input count.
    """
    import json

    extra = {"subgraphs": subgraphs} if subgraphs is not None else {}
    try:        # the common case, attributes of strings: a cheap key (a 100k-node graph asks for each op)
        key: Any = (op, tuple(sorted(attrs.items())), num_inputs) if subgraphs is None else None
        hash(key)
    except TypeError:
        key = None
    if key is None:
        key = json.dumps([op, attrs, num_inputs, extra], sort_keys=True)
    if key in _NUM_OUTPUTS:
        return _NUM_OUTPUTS[key]
    import mxnet as mx
    nodes: List[Dict[str, Any]] = [{"op": "null", "name": "x%d" % i, "inputs": []} for i in range(num_inputs)]
    nodes.append(dict(extra, op=op, name="n", attrs=dict(attrs), inputs=[[i, 0, 0] for i in range(num_inputs)]))
    try:
        sym = mx.sym.load_json(json.dumps({"nodes": nodes, "arg_nodes": list(range(num_inputs)),
                                            "heads": [[num_inputs, 0, 0]], "attrs": _VERSION}))
        row_ptr = json.loads(sym.tojson())["node_row_ptr"]
        count: Optional[int] = row_ptr[-1] - row_ptr[-2]
    except Exception:       # attributes MXNet refuses: loading the whole graph will say so, in one line
        count = None
    _NUM_OUTPUTS[key] = count
    return count
