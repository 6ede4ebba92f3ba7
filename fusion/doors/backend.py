"""The ``"fusion"`` backend for MXNet's partitioning API: ``hybridize(backend=...)`` and ``optimize_for``.

After ``import fusion``::

    net.hybridize(backend="fusion")                 # fused on the first call
    net.optimize_for(x, backend="fusion")           # fused now
    sym2 = sym.optimize_for("fusion", args, aux)    # plain symbols; new params are added to args

MXNet 1.9.1 looks backends up in a C++ registry, so this module wraps
``Symbol.optimize_for``: the backend name ``"fusion"`` runs :func:`fusion.fuse`,
every other name goes to MXNet unchanged.  Like MXNet's own partitioners,
new parameters (folded weights, under new names) are added to ``args``/``aux``
and nothing is removed: the caller's dicts still bind the original symbol, and
a Gluon block takes the new parameters from there (it owns the others).
Parameters a Gluon block's values cannot be fused with (NaN, dtypes the graph
refuses) leave its graph unfused, with a warning.

Backend options (keyword arguments of ``hybridize``/``optimize_for`` in
MXNet 1.9, e.g. ``hybridize(backend="fusion", mode="inference")``; a
``backend_opts={...}`` dict as in MXNet 2.0 is accepted too): ``mode`` (``"inference"`` or
``"training"``), ``rules`` (names, comma-separated or a list), ``precision`` (``"float32"``
or ``"bf16"``, see ``fusion.fuse``), ``force`` (bf16 on a CPU without it) and ``device``
(``"cpu"`` or ``"gpu"``; by default the device of the context MXNet passes to
``optimize_for`` -- a Gluon block's inputs' context -- so a block run on ``mx.gpu()``
gets only library ops the op library implements on the GPU), ``max_memory`` (what the
self-check of the first call may hold at once, e.g. ``"2G"``; default 60 % of the memory
available: see ``fusion.fuse``) and ``self_check`` (``False`` skips it).  Without
``mode``, a Gluon block is fused for training when its graph is built under
``autograd.record()`` in training mode — then only rewrites with a backward
apply — and for inference otherwise; switching between the two rebuilds
the cached graph.  The fused block's report is in ``block.fusion_report``.

Folded weights are computed when the graph is built: after changing a
block's parameters (``load_parameters``, training), call ``hybridize`` again
so the next call rebuilds it.
"""
from __future__ import annotations

import contextvars
import warnings
from typing import Any, Dict, Optional

BACKEND = "fusion"

_building_block: contextvars.ContextVar = contextvars.ContextVar("fusion_building_block", default=None)
_installed = False


def _mode_now() -> str:
    import mxnet as mx
    return "training" if mx.autograd.is_recording() and mx.autograd.is_training() else "inference"


def optimize_symbol(symbol: Any, args: Optional[Dict[str, Any]] = None, aux: Optional[Dict[str, Any]] = None,
                    mode: Optional[str] = None, rules: Any = None, shape_dict: Optional[Dict[str, Any]] = None,
                    precision: Optional[str] = None, force: Any = False, device: Any = None,
                    ctx: Any = None, max_memory: Any = None, self_check: Any = True, **unused: Any):
    """Fuse ``symbol``; add the new parameters to ``args``/``aux`` like MXNet's partitioners (the
    caller's entries stay); return the new symbol."""
    from ..api import fuse_gc_off
    from ..ir.errors import FusionError, ParamsError

    nested = unused.pop("backend_opts", None) or {}   # MXNet 2.0 spelling: hybridize(backend_opts={...})
    mode, rules = nested.pop("mode", mode), nested.pop("rules", rules)
    precision, force = nested.pop("precision", precision), nested.pop("force", force)
    device = nested.pop("device", device)
    max_memory, self_check = nested.pop("max_memory", max_memory), nested.pop("self_check", self_check)
    unused.update(nested)
    if unused:
        raise ValueError("unknown option(s) for backend '%s': %s (known: mode, rules, precision, force, device, "
                         "max_memory, self_check)" % (BACKEND, ", ".join(sorted(unused))))
    self_check = str(self_check).lower() not in ("false", "0", "no")
    from ..api import check_device
    if device is None:      # the context MXNet partitions for (a Gluon block: its inputs')
        device = "cpu" if ctx is None or str(getattr(ctx, "device_type", "cpu")).startswith("cpu") else ctx
    device = check_device(device)
    if isinstance(rules, str):
        rules = [r.strip() for r in rules.split(",") if r.strip()]
    block = _building_block.get()
    if mode is None:
        mode = _mode_now() if block is not None else "inference"
    # Inputs are not parameters: a rule must never bake the current input into a weight.
    data_names = set(shape_dict or {})
    if block is not None and block._cached_graph:
        data_names |= {s.name for s in block._cached_graph[0]}
    params = {k: v for k, v in (args or {}).items() if k not in data_names}
    shapes = {k: tuple(v) for k, v in (shape_dict or {}).items()}
    shapes.update({k: tuple(v.shape) for k, v in (args or {}).items() if k in data_names})
    dtypes = {k: v.dtype.__name__ if hasattr(v.dtype, "__name__") else str(v.dtype)
              for k, v in (args or {}).items() if k in data_names}
    if mode not in ("inference", "training"):
        raise ValueError("mode must be inference or training, not %r" % (mode,))
    from ..precision.policy import resolve
    precision = resolve(precision, str(force).lower() in ("true", "1") or device == "gpu", mode)
    from ..api import check_device_precision
    check_device_precision(device, precision)
    try:
        from ..engine.memory import budget
        result = fuse_gc_off(symbol, params, aux or {}, rules, mode, shapes, dtypes, self_check, copy_params=False,
                              precision=precision, device=device,
                              max_memory=budget(max_memory) if self_check and shapes else None)
    except ParamsError as e:
        if block is None:
            raise
        warnings.warn("mxnet-fusion did not fuse this block: %s; it runs unfused" % e, RuntimeWarning)
        return symbol
    except FusionError:
        raise
    except Exception as e:      # never cost a Gluon user their model: run it as it was
        warnings.warn("mxnet-fusion could not fuse this graph (%s: %s); it runs unfused"
                      % (type(e).__name__, str(e).splitlines()[0] if str(e) else ""), RuntimeWarning)
        return symbol
    for store, new in ((args, result.arg_params), (aux, result.aux_params)):
        if store is None:
            if any(k not in (args or {}) for k in new):
                raise RuntimeError("backend '%s' created new parameters; pass an args dict to optimize_for" % BACKEND)
            continue
        for k, v in new.items():
            if k not in store:
                store[k] = v
    if block is not None:
        block.fusion_report = result.report
        block._fusion_mode = mode
    return result.symbol


def install() -> None:
    """Route backend ``"fusion"`` of ``Symbol.optimize_for`` and Gluon blocks to mxnet-fusion (idempotent)."""
    global _installed
    if _installed:
        return
    import mxnet as mx
    from mxnet.gluon import HybridBlock

    original_optimize_for = mx.sym.Symbol.optimize_for

    def optimize_for(self, backend, args=None, aux=None, ctx=None, shape_dict=None, type_dict=None,
                     stype_dict=None, skip_infer=False, **kwargs):
        if backend != BACKEND:
            return original_optimize_for(self, backend, args, aux, ctx, shape_dict, type_dict,
                                         stype_dict, skip_infer, **kwargs)
        return optimize_symbol(self, args, aux, shape_dict=shape_dict, ctx=ctx, **kwargs)

    optimize_for.__doc__ = original_optimize_for.__doc__
    mx.sym.Symbol.optimize_for = optimize_for

    original_build_cache = HybridBlock._build_cache
    original_call_cached_op = HybridBlock._call_cached_op

    def _build_cache(self, *args):
        if self._backend == BACKEND and self._cached_graph and not hasattr(self, "_fusion_source_graph"):
            self._fusion_source_graph = self._cached_graph   # a SymbolBlock's graph, kept to re-fuse from
        token = _building_block.set(self if self._backend == BACKEND else None)
        try:
            return original_build_cache(self, *args)
        finally:
            _building_block.reset(token)

    def _call_cached_op(self, *args):
        opts = self._backend_opts or {}
        if (self._backend == BACKEND and self._cached_op is not None
                and "mode" not in opts and "mode" not in (opts.get("backend_opts") or {})
                and getattr(self, "_fusion_mode", None) not in (None, _mode_now())):
            self._clear_cached_op()      # fused for the other mode: retrace and fuse again
            if hasattr(self, "_fusion_source_graph"):
                self._cached_graph = self._fusion_source_graph
        return original_call_cached_op(self, *args)

    HybridBlock._build_cache = _build_cache
    HybridBlock._call_cached_op = _call_cached_op
    _installed = True
