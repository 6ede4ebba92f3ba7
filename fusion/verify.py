"""Numerical verification: run the original and the fused model on the same random inputs.

``max_rel`` is, per output, ``max|fused − original| / max|original|`` (the
error relative to the output's scale, which stays meaningful where single
elements are near zero), and the largest over all outputs is reported.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .errors import FusionError

DEFAULT_RTOL = 1e-4


@dataclass
class VerifyResult:
    max_abs: float
    max_rel: float
    per_output: List[Tuple[str, float, float]] = field(default_factory=list)   # (name, abs, rel)

    def ok(self, rtol: float = DEFAULT_RTOL) -> bool:
        return bool(np.isfinite(self.max_rel)) and self.max_rel <= rtol

    def __str__(self) -> str:
        return "max abs error %.3g, max rel error %.3g over %d output(s)" % (self.max_abs, self.max_rel, len(self.per_output))


def _unpack(model: Any, params: Any = None):
    """(symbol, arg_params, aux_params) from a Symbol, a FusionResult or a tuple."""
    if hasattr(model, "symbol") and hasattr(model, "arg_params"):
        return model.symbol, dict(model.arg_params), dict(model.aux_params)
    if isinstance(model, (tuple, list)):
        sym, arg, aux = (tuple(model) + ({}, {}))[:3]
        return sym, dict(arg or {}), dict(aux or {})
    arg, aux = {}, {}
    if isinstance(params, (tuple, list)):
        arg, aux = dict(params[0] or {}), dict(params[1] or {})
    elif isinstance(params, Mapping):
        aux_names = set(model.list_auxiliary_states())
        arg = {k: v for k, v in params.items() if k not in aux_names}
        aux = {k: v for k, v in params.items() if k in aux_names}
    return model, arg, aux


def random_inputs(symbol: Any, arg_params: Mapping[str, Any], input_shapes: Mapping[str, Sequence[int]],
                  seed: int = 0) -> Dict[str, np.ndarray]:
    """Random normal values for every argument of ``symbol`` that is not a parameter."""
    rng = np.random.default_rng(seed)
    data_names = [n for n in symbol.list_arguments() if n not in arg_params]
    missing = [n for n in data_names if n not in input_shapes]
    if missing:
        raise FusionError("no shape given for input(s) %s (use --shape NAME=D1,D2,...)" % ", ".join(missing))
    return {n: rng.standard_normal(tuple(input_shapes[n])).astype(np.float32) for n in data_names}


def run(symbol: Any, arg_params: Mapping[str, Any], aux_params: Mapping[str, Any],
        inputs: Mapping[str, np.ndarray], ctx: Any = None, subgraph: bool = False) -> List[np.ndarray]:
    """Bind ``symbol`` for inference and return its outputs as NumPy arrays.

    By default MXNet's oneDNN subgraph backend is off: verification compares the
    arithmetic of the graphs, and MXNet 1.9.1's backend aborts the process on some
    valid graphs (e.g. Convolution → BatchNorm over a non-channel axis).
    """
    from .bench import subgraph_backend

    with subgraph_backend(subgraph):
        exe = bind(symbol, arg_params, aux_params, inputs, ctx)
    return [o.asnumpy() for o in exe.forward(is_train=False)]


def bind(symbol: Any, arg_params: Mapping[str, Any], aux_params: Mapping[str, Any],
         inputs: Mapping[str, Any], ctx: Any = None):
    """An executor of ``symbol`` with parameters and inputs bound (no gradients)."""
    import mxnet as mx

    ctx = ctx or mx.cpu()
    args = {}
    for name in symbol.list_arguments():
        v = inputs.get(name, arg_params.get(name))
        if v is None:
            raise FusionError("argument '%s' has neither a value nor an input shape" % name)
        args[name] = v.as_in_context(ctx) if isinstance(v, mx.nd.NDArray) else mx.nd.array(v, ctx=ctx, dtype=v.dtype)
    aux = {}
    for name in symbol.list_auxiliary_states():
        v = aux_params.get(name)
        if v is None:
            raise FusionError("auxiliary state '%s' has no value" % name)
        aux[name] = v.as_in_context(ctx) if isinstance(v, mx.nd.NDArray) else mx.nd.array(v, ctx=ctx)
    return symbol.bind(ctx, args, aux_states=aux, grad_req="null")


def compare(reference: Sequence[np.ndarray], candidate: Sequence[np.ndarray], names: Sequence[str]) -> VerifyResult:
    if len(reference) != len(candidate):
        raise FusionError("the fused model has %d outputs, the original %d" % (len(candidate), len(reference)))
    per, worst_abs, worst_rel = [], 0.0, 0.0
    for name, a, b in zip(names, reference, candidate):
        if a.shape != b.shape:
            raise FusionError("output '%s' has shape %s after fusion, %s before" % (name, b.shape, a.shape))
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
        abs_err = float(diff.max()) if diff.size else 0.0
        scale = float(np.abs(a).max()) if a.size else 0.0
        rel = abs_err / scale if scale > 0 else abs_err
        if not (np.isfinite(a).all() == np.isfinite(b).all()):
            abs_err = rel = float("inf")
        per.append((name, abs_err, rel))
        worst_abs, worst_rel = max(worst_abs, abs_err), max(worst_rel, rel)
    return VerifyResult(worst_abs, worst_rel, per)


def verify(original: Any, fused: Any, params: Any = None, input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
           *, seed: int = 0, inputs: Optional[Mapping[str, np.ndarray]] = None) -> VerifyResult:
    """Bind the original and the fused model on the same random inputs and compare every output.

    ``original`` is an ``mx.sym.Symbol`` (its parameters in ``params``: a tuple
    ``(arg_params, aux_params)`` or one dict) or a tuple ``(symbol, arg, aux)``;
    ``fused`` is a :class:`~fusion.api.FusionResult` or such a tuple.
    """
    sym0, arg0, aux0 = _unpack(original, params)
    sym1, arg1, aux1 = _unpack(fused)
    if inputs is None:
        inputs = random_inputs(sym0, arg0, input_shapes or {}, seed)
    ref = run(sym0, arg0, aux0, inputs)
    out = run(sym1, arg1, aux1, {k: v for k, v in inputs.items() if k in set(sym1.list_arguments())})
    return compare(ref, out, sym0.list_outputs())
