"""``fuse()``: the public entry point of the engine."""
from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence

import numpy as np

from .ir.errors import FusionError
from .ir.graph import Graph, GraphError
from .engine.report import FusionReport
from .engine.rewrite import Context, run_rules
from .engine.selfcheck import SelfCheck
from .engine.workarounds import (backend_hazards, guard_layer_outputs, guard_new_nan_fusions, nan_changing_fusions,
                                 strip_guards)
from .precision.policy import dtype_name

MODES = ("inference", "training")


def _first_five(names: Sequence[str]) -> str:
    """The first five of ``names`` for a report note, "…" where there are more."""
    return ", ".join(names[:5]) + (" …" if len(names) > 5 else "")
DEVICES = ("cpu", "gpu")


@dataclass
class FusionResult:
    """The fused model: ``symbol`` with its ``arg_params``/``aux_params``, and the ``report``."""

    symbol: Any
    arg_params: Dict[str, Any]
    aux_params: Dict[str, Any]
    report: FusionReport
    graph: Graph

    def __iter__(self):  # sym, args, aux = fuse(...)
        return iter((self.symbol, self.arg_params, self.aux_params))


def _as_graph(symbol: Any) -> Graph:
    if isinstance(symbol, Graph):
        return symbol.copy()
    if isinstance(symbol, (str, bytes, dict)):
        graph = Graph.from_json(symbol)
        graph.check_loadable()      # MXNet has not seen this JSON: refuse what would crash it
        return graph
    if hasattr(symbol, "tojson"):
        return Graph.from_symbol(symbol)
    raise TypeError("fuse() takes an mx.sym.Symbol, Symbol JSON text or a Graph, not %s" % type(symbol).__name__)


def load_user_rules(spec: str) -> list:
    """Rules named ``"module:NAME"``: NAME is a Rule, a Rule subclass, or a list of them, in an importable module.

    ``"module"`` alone takes the module's ``RULES`` list, like the files of the rule library.
    """
    import importlib
    import os
    import sys

    from .engine.rule import Rule

    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:          # like `python -m`: modules beside the user are importable
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise FusionError("cannot import rule module '%s': %s" % (module_name, e)) from None
    obj = getattr(module, attr or "RULES", None)
    if obj is None:
        raise FusionError("module '%s' has no %s" % (module_name, attr or "RULES"))
    items = obj if isinstance(obj, (list, tuple)) else [obj]
    out = []
    for item in items:
        if isinstance(item, type) and issubclass(item, Rule):
            item = item()
        if not isinstance(item, Rule):
            raise FusionError("%s is not a fusion.Rule (got %s)" % (spec, type(item).__name__))
        out.append(item)
    return out


def resolve_rules(rules: Optional[Iterable[Any]]) -> list:
    """Rule objects from ``rules``: None (the default set), rule objects, rule/family names,
    ``"module:NAME"`` for rules of your own, and ``"default"`` for the whole library.  A name with
    a leading ``-`` takes that rule or family out (``["default", "-region"]``; exclusions alone
    start from the default set: ``"-region"``)."""
    from patterns import default_rules, rules_by_name   # the rule library; fusion/ never imports it at load

    if rules is None:
        return default_rules()
    if isinstance(rules, str):      # one name, not its characters
        rules = [rules]
    rules = list(rules)
    known = rules_by_name()
    known["default"] = default_rules()
    excluded = [r[1:] for r in rules if isinstance(r, str) and r.startswith("-")]
    wanted = [r for r in rules if not (isinstance(r, str) and r.startswith("-"))]
    if excluded and not wanted:
        wanted = ["default"]
    out = []
    for r in wanted:
        if isinstance(r, str):
            items = _named_rules(r, known)
            out.extend(x for x in items if x not in out)     # a family and one of its rules: once
        elif r not in out:
            out.append(r)
    for name in excluded:
        if name not in known:
            raise FusionError("unknown rule %r to leave out (known: %s)" % (name, ", ".join(sorted(known))))
        gone = {id(x) for x in known[name]}
        out = [x for x in out if id(x) not in gone]
    return out


def _named_rules(name: str, known: Dict[str, list]) -> list:
    if ":" in name or (name not in known and "." in name):
        return load_user_rules(name)
    if name in known:
        return known[name]
    raise FusionError("unknown rule %r (known: %s; or module:NAME for your own)" % (name, ", ".join(sorted(known))))


def fuse(symbol: Any, arg_params: Optional[Mapping[str, Any]] = None,
         aux_params: Optional[Mapping[str, Any]] = None, *, rules: Optional[Iterable[Any]] = None,
         mode: str = "inference", input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
         input_dtypes: Optional[Mapping[str, Any]] = None, self_check: bool = True,
         precision: str = "float32", force: bool = False, device: str = "cpu",
         max_memory: Any = None) -> FusionResult:
    """Fuse ``symbol`` with ``rules`` (default: the whole rule library) and return a FusionResult.

    ``arg_params``/``aux_params`` map names to NDArrays (or NumPy arrays); they
    enable parameter transforms such as BatchNorm folding.  They are checked like
    ``mxfuse`` checks a params file (dtypes the graph accepts, no NaN/inf, no negative
    moving variance): a :class:`~fusion.ir.errors.ParamsError` names the array otherwise.
    Neither the symbol nor the arrays passed in are modified, and the result shares no
    memory with them: its params are NDArrays (also for NumPy input), copies of the
    caller's arrays on their own device context, and new arrays (folded parameters, under
    new names) on the context of the parameters they were computed from.  ``rules`` is a
    list of rules or names, or one name.  ``mode="training"`` applies only rewrites valid in training.
    ``input_shapes`` (name -> shape of the data inputs) lets rules that need
    tensor shapes (e.g. head layouts of attention) check them exactly;
    ``input_dtypes`` (name -> dtype, default float32 unless the graph says otherwise)
    keeps float32-only fused ops away from other inputs.

    ``self_check`` (on by default): before a rewrite is accepted, the subgraph it replaces
    and its replacement are run side by side by MXNet on random inputs, at the input
    shapes given and at other shapes the graph accepts (another batch size, another
    sequence length), outputs and — in training — gradients compared; a rewrite that
    does not match is refused with the mismatch as its reason (``report.self_check``
    counts what was checked).  It needs ``input_shapes``: without them nothing is checked.

    ``precision="bf16"`` (inference only): the fused ops' matrix products run in bfloat16
    with float32 accumulation — their weights cast once into new parameters (``<w>_bf16``),
    everything else float32 as ``fusion/precision/policy.py``'s policy says; the self-check then
    accepts the bfloat16 tolerance against the float32 original.  Refused (FusionError, with
    the reason) on a CPU without native bfloat16 unless ``force=True``.  A graph with convolutions
    (which the fused ops have no bfloat16 form of) is converted by MXNet's own AMP first and the
    rules fuse the AMP graph (``precision.convert_convolutions``).

    ``device`` ("cpu" or "gpu"): where the fused graph will run.  A library op is emitted only
    if the loaded op library implements it on that device (its capability query; in training,
    its backward too): other candidates are refused with that reason.  On "gpu" the choices
    that only serve MXNet's CPU (oneDNN) backend -- leaving convolution tails and BatchNorm
    after a Concat to it -- do not apply.  The self-check still runs on the CPU.  On "gpu" a
    library op is also emitted only where the GPU's cost table (fusion/engine/cost.py; without
    one, its conservative rule) says it is at least as fast as the ops it replaces, and a float16
    graph (MXNet's AMP float16, inference) is fused as its float32 model and then given back the
    dtypes AMP gave it: float16 fused ops where AMP ran float16 (fusion/precision/half.py).

    ``max_memory`` (bytes, or a size such as ``"4G"``; default: 60 % of the memory available): what
    the self-check may hold at once (fusion/engine/memory.py).  Where its usual plan would need
    more, it runs smaller (fewer rewrites per MXNet executor, the graph's values not kept or not
    computed) and ``report.notes`` says so; where even one rewrite checked on its own would not fit,
    :class:`~fusion.engine.memory.OverBudget` (a FusionError) says how much it needs.
    """
    if mode not in MODES:
        raise ValueError("mode must be one of %s, not %r" % (", ".join(MODES), mode))
    device = check_device(device)
    from .precision.policy import resolve
    precision = resolve(precision, True if device == "gpu" else force, mode)
    check_device_precision(device, precision)
    from .engine.memory import budget
    limit = budget(max_memory) if self_check and input_shapes else None
    return fuse_gc_off(symbol, arg_params, aux_params, rules, mode, input_shapes, input_dtypes, self_check,
                        precision=precision, device=device, max_memory=limit)


def check_device_precision(device: str, precision: str) -> None:
    from .precision.policy import FLOAT32
    if device == "gpu" and precision != FLOAT32:
        raise FusionError("precision='bf16' is the CPU's policy (a float32 op reading bfloat16 weights through "
                          "oneDNN); the GPU kernels take one dtype for all their tensors: fuse for "
                          "device='gpu' in float32")


def check_device(device: Any) -> str:
    """``device`` as fuse() takes it ("cpu" or "gpu"; an mx.Context's device type works too)."""
    name = getattr(device, "device_type", device)
    if name == "cpu_pinned":
        name = "cpu"
    if name not in DEVICES:
        raise ValueError("device must be one of %s, not %r" % (", ".join(DEVICES), device))
    return name


def fuse_gc_off(*args, **kwargs) -> FusionResult:
    """``fuse`` on arguments already checked (``fuse`` and the Gluon backend call it)."""
    # The IR allocates many small acyclic objects; Python's cyclic collector would rescan
    # them all again and again on large graphs (a third of the time at 100k nodes).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        try:
            return _fuse(*args, **kwargs)
        except _HalfNotLowered as e:        # AMP's float16 graph fused as it is, casts and all
            result = _fuse(*args, read_half=False, **kwargs)
            result.report.notes.insert(0, e.note)
            return result
    finally:
        if gc_was_enabled:
            gc.enable()


class _HalfNotLowered(Exception):
    """A float16 graph whose lowering MXNet does not take: fused again as it is (``note`` says why)."""

    def __init__(self, note: str):
        super().__init__(note)
        self.note = note


def _dtype_names(input_dtypes: Optional[Mapping[str, Any]]) -> Optional[Dict[str, str]]:
    """``input_dtypes`` by name ('float32', 'bfloat16', ...): given as dtypes, types or names, MXNet's
    bfloat16 included (NumPy has no name for it); a one-line error for what is no dtype."""
    if input_dtypes is None:
        return None
    out = {}
    for k, v in input_dtypes.items():
        try:
            out[k] = dtype_name(v)
        except TypeError:
            raise FusionError("input_dtypes['%s'] = %r is not a dtype" % (k, v)) from None
    return out


def _fuse(symbol, arg_params, aux_params, rules, mode, input_shapes, input_dtypes, self_check,
          copy_params: bool = True, precision: str = "float32", device: str = "cpu",
          read_half: bool = True, max_memory: Any = None) -> FusionResult:
    """``fuse`` itself; ``copy_params=False`` returns the caller's arrays themselves (the backend,
    which hands only the new ones on)."""
    from .files.modelio import check_param_values

    start = time.perf_counter()
    input_dtypes = _dtype_names(input_dtypes)
    given = symbol
    rule_list = resolve_rules(rules)
    amp_convs = None
    own_convs = None        # the fused op that takes the convolutions into bfloat16 itself (a region)
    if precision != "float32" and mode == "inference" and device == "cpu":
        from .native import library as _native
        from .precision.policy import convolutions_fused
        own_convs = convolutions_fused([op for r in rule_list for op in getattr(r, "emits", ())],
                                       _native.capabilities())
    if own_convs is None and precision != "float32" and copy_params and mode == "inference" and device == "cpu":
        from .precision.policy import convert_convolutions   # the convolutions run in bfloat16 through MXNet's AMP
        amp_convs = convert_convolutions(symbol, arg_params, aux_params, input_shapes, input_dtypes)
        if amp_convs is not None:
            symbol, arg_params, aux_params, amp_convs = amp_convs
    elif own_convs is None and precision != "float32" and mode == "inference" and device == "cpu":
        from .precision.policy import kept_convolutions
        amp_convs = kept_convolutions(symbol)
    graph = _as_graph(symbol)
    names = _output_names(given, graph)
    graph.canonicalize_ops()
    miscomputed = backend_hazards(graph)       # the model as given, under MXNet's default bind
    nan_fused = {u.name for _, u, _ in nan_changing_fusions(graph)}
    if arg_params or aux_params:
        check_param_values(graph, None, arg_params or {}, aux_params or {}, input_dtypes)
    amp = None
    if copy_params and mode == "inference" and device == "cpu":   # (the backend hands on only new
        # params: not there; the GPU kernels take float32 only: an AMP graph keeps AMP's casts there)
        from .precision.policy import BFLOAT16, read_amp
        amp = read_amp(graph, arg_params or {}, aux_params or {}) if amp_convs is None else None
        if amp is not None:
            arg_params, aux_params, amp = amp
            precision = BFLOAT16
    half, half_refused = None, None
    if device == "gpu" and read_half:
        half, half_refused, arg_params, aux_params = _read_half(graph, arg_params, aux_params, input_dtypes, mode)
        if half is not None and input_dtypes:       # the rules see the float32 model's inputs
            input_dtypes = {k: "float32" if dtype_name(v) == "float16" else v for k, v in input_dtypes.items()}
    report = FusionReport(mode=mode)
    report.precision = precision
    if half_refused:
        report.notes.append(half_refused)
    report.device = device
    _note_miscomputed(report, miscomputed)
    graph.compact()
    report.nodes_before, report.ops_before = len(graph.nodes), len(graph.op_nodes())
    strip_guards(graph)
    if input_shapes:
        _refuse_reading_past_buffers(graph, arg_params or {}, aux_params or {}, input_shapes)
    ctx = Context(graph, arg_params or {}, aux_params or {}, mode, input_shapes, input_dtypes, precision, device)
    ctx.half = half
    checker = SelfCheck(ctx, enabled=self_check, budget=max_memory if self_check and input_shapes else None)
    run_rules(graph, rule_list, ctx, report, checker)
    report.self_check = checker.stats if self_check else None
    if self_check and input_shapes:
        report.notes.extend(n for n in checker.budget.notes if n not in report.notes)
        report.extra["memory"] = checker.budget.to_dict()
    if not input_shapes:
        _count_wanting_shapes(report)
    if mode == "inference":
        from .precision.policy import between_ops
        ctx.precision_between = between_ops(graph, precision)
    fused16 = None
    if half is not None:
        from .precision.half import FLOAT16, lower_half
        fused16 = lower_half(graph, half, ctx.origins, ctx.lineage, ctx.arg_params, ctx.aux_params, ctx.new_args)
        report.precision = FLOAT16
    _precision_notes(graph, ctx, report, amp, amp_convs)
    if own_convs is not None:
        _own_convolutions_note(graph, own_convs, report)
    if device != "cpu":
        _device_note(device, mode, report)
        if os.environ.get("MXFUSION_NO_COST", "") in ("", "0"):
            _cost_note(report)
    _keep_output_names(graph, names, report, _float32_vars(graph, ctx))
    guarded = guard_layer_outputs(graph)
    if guarded:
        report.notes.append("%d layer output(s) read more than once pass through an identity Reshape before an "
                            "activation (MXNet 1.9.1's oneDNN backend otherwise hands the other readers the "
                            "activation's result): %s" % (len(guarded), _first_five(guarded)))
    guarded = guard_new_nan_fusions(graph, nan_fused)
    if guarded:
        report.notes.append("%d op(s) now right after a layer pass through an identity Reshape (MXNet 1.9.1's oneDNN "
                            "backend would fuse them into the layer and change their NaN and inf results): %s"
                            % (len(guarded), _first_five(guarded)))
    from .engine.shape_hints import hint_param_shapes     # Module.bind / SymbolBlock: shapes from the data alone
    hint_param_shapes(graph, ctx)
    report.nodes_after, report.ops_after = len(graph.nodes), len(graph.op_nodes())
    sym = graph.to_symbol()
    arg_out, aux_out = _collect_params(graph, ctx, set(sym.list_auxiliary_states()), copy_params)
    if half is not None:
        _check_half(sym, half, fused16, arg_out, aux_out, input_shapes, report)
    report.params_removed = (len(ctx.arg_params) + len(ctx.aux_params)) - sum(
        1 for n in list(arg_out) + list(aux_out) if n in ctx.arg_params or n in ctx.aux_params)
    report.seconds = time.perf_counter() - start
    return FusionResult(sym, arg_out, aux_out, report, graph)


def _read_half(graph: Graph, arg_params, aux_params, input_dtypes, mode: str):
    """AMP's float16 graph read as its float32 model for device='gpu' (fusion/precision/half.py):
    ``(HalfGraph or None, why it is not read or None, arg_params, aux_params)``."""
    from .precision.half import HalfRefused, is_half_graph, read_half

    arg_params, aux_params = arg_params or {}, aux_params or {}
    if not is_half_graph(graph, arg_params, aux_params):
        return None, None, arg_params, aux_params
    why = None
    if mode != "inference":
        why = "float16 graphs are read for inference only"
    else:
        try:
            half, arg_params, aux_params = read_half(graph, arg_params, aux_params, input_dtypes)
            return half, None, arg_params, aux_params
        except HalfRefused as e:
            why = str(e)
    return None, ("float16 graph not read for device='gpu' (%s): the fused ops take only its float32 parts, "
                  "its float16 parts stay MXNet's" % why), arg_params, aux_params


def _check_half(sym, half, fused16, arg_out, aux_out, input_shapes, report: FusionReport) -> None:
    """The lowered float16 graph as MXNet infers it: its outputs in AMP's dtypes, or fused again as it is."""
    from .precision.half import check_lowered

    why = check_lowered(sym, half, arg_out, aux_out, input_shapes)
    if why is not None:
        raise _HalfNotLowered("float16 graph not read for device='gpu' (%s): fused as it is, the fused ops "
                              "take only its float32 parts" % why)
    made = ", ".join("%d %s" % (n, op) for op, n in sorted(fused16.items())) or "none"
    report.extra["float16"] = {"casts_read": half.casts, "params_float16": len(half.params16),
                               "fused_float16": dict(fused16)}
    report.notes.append("float16 graph for the GPU (MXNet's AMP: %d amp_cast/amp_multicast read through; %d float16 "
                        "parameter(s) widened for the rules and kept float16): fused as its float32 model, then every "
                        "op given the dtypes the graph gave it -- fused ops reading float16 (fused_dense and "
                        "fused_attention computing their products in it): %s; casts kept where "
                        "MXNet's own ops read another dtype; the self-check ran in float32 on the CPU"
                        % (half.casts, len(half.params16), made))


def _refuse_reading_past_buffers(graph: Graph, arg_params: Mapping[str, Any], aux_params: Mapping[str, Any],
                                 input_shapes: Mapping[str, Sequence[int]]) -> None:
    """FusionError where the model does not run at ``input_shapes``: a reshape to a fully given shape of
    another size, which MXNet 1.9.1 infers without comparing sizes and then runs reading past its input's
    buffer (undefined outputs; without oneDNN it stops with a size check).  GluonCV's SiamRPN hard-codes its
    cross-correlation's 24×24, which a 287×287 search image gives."""
    from .engine.facts import SIZE_KEEPING, first_misread, infer

    shapes = {k: tuple(v.shape) for k, v in list(arg_params.items()) + list(aux_params.items())}
    shapes.update({k: tuple(v) for k, v in input_shapes.items()})
    found, _ = infer(graph, shapes)
    e = first_misread(found, ops=SIZE_KEEPING)
    if e is not None:
        nd, out, ins = e.node, found[e], found[e.node.inputs[0]]
        given = ", ".join("%s=%s" % (k, ",".join(map(str, v))) for k, v in input_shapes.items())
        raise FusionError(
            "the model does not run at input shapes %s: %s '%s' makes %s of %s (%d values of %d; MXNet "
            "1.9.1 reads past its input there, its outputs are undefined)"
            % (given, nd.op, nd.name, tuple(out), tuple(ins), int(np.prod(out)), int(np.prod(ins))))


def _note_miscomputed(report: FusionReport, miscomputed: Sequence[str]) -> None:
    """Where MXNet's own default bind computes the model as given wrong (fusion/engine/workarounds.py): said
    in the report (``mxfuse`` also warns on stderr), with what the fused model does instead."""
    if not miscomputed:
        return
    report.extra["mxnet_miscomputes_original"] = list(miscomputed)
    report.notes.append(
        "warning: MXNet 1.9.1's default bind (its oneDNN subgraph backend) computes this model wrong as given: "
        "%d layer output(s) are graph outputs or read elsewhere while it fuses a reader into the layer (%s), and "
        "those outputs get the reader's value; the fused model routes such reads through an identity Reshape "
        "and runs right (compare with MXNET_SUBGRAPH_BACKEND=NONE)"
        % (len(miscomputed), _first_five(miscomputed)))


def _count_wanting_shapes(report: FusionReport) -> None:
    """How many candidates were refused only for want of input shapes (fusion/engine/reasons.py): the
    summary line says so, and the JSON report's ``more_with_input_shapes``."""
    from .engine.reasons import wants_shapes

    n = sum(1 for r in report.rules.values() for reason in r.rejected.values() if wants_shapes(reason))
    if n:
        report.extra["more_with_input_shapes"] = n


def _output_names(symbol: Any, graph: Graph) -> Optional[list]:
    """The output names MXNet gives the model as the caller handed it (``symbol``; ``graph`` is
    what was read from it): None where MXNet cannot load the graph (the result's own
    ``to_symbol`` then says why)."""
    if hasattr(symbol, "list_outputs") and not isinstance(symbol, Graph):
        return symbol.list_outputs()
    try:
        return graph.to_symbol().list_outputs()
    except GraphError:
        return None


def _float32_vars(graph: Graph, ctx: Context) -> set:
    """Variables known to hold float32: parameters by their arrays, inputs by input_dtypes
    (float32 unless given or the graph says otherwise)."""
    def f32(t) -> bool:
        try:
            return np.dtype(t) == np.float32
        except TypeError:          # bfloat16 (MXNet's own dtype): not a NumPy type name
            return False

    stores = {**ctx.arg_params, **ctx.aux_params}
    given = ctx.input_dtypes or {}
    out = set()
    for nd in graph.variables():
        if nd.name in stores:
            ok = f32(stores[nd.name].dtype)
        elif nd.name in given:
            ok = f32(given[nd.name])
        else:
            ok = str(nd.attrs.to_json().get("__dtype__", "0")) == "0"
        if ok:
            out.add(nd.name)
    return out


def _keep_output_names(graph: Graph, names: Optional[list], report: FusionReport,
                       float32_vars: Optional[set] = None) -> None:
    """The outputs named as the original named them (``fusion/ir/names.py``); the report's fused
    node names follow a fused node renamed on the way."""
    from .ir.names import keep_output_names

    if not names:
        return
    lost, renamed = keep_output_names(graph, names, float32_vars)
    if renamed:
        for rr in report.rules.values():
            for f in rr.fused:
                f["new"] = [renamed.get(n, n) for n in f["new"]]
    if lost:
        report.notes.append("%d output name(s) changed (an op's own output name, or a parameter handed out "
                            "that is held in another dtype now, which no node can be named as): %s"
                            % (len(lost), _first_five(lost)))


def _cost_note(report: FusionReport) -> None:
    """Which GPU cost table decided (or that none was measured for this GPU), and how many rewrites
    were declined for speed (each with its reason among the rejections)."""
    from .engine import cost

    name = cost.gpu_name()
    table = cost.table_for("gpu", name) if name else None
    declined = sum(1 for rr in report.rules.values() for r in rr.rejected.values()
                   if r.startswith("declined for speed"))
    if table is not None:
        which = "the cost table of %s measured %s (%s)" % (table["device"], table["date"], table.get("path", ""))
    else:
        which = ("no cost table measured for %s: its conservative rule (fusion/engine/cost.py GPU_FALLBACK, from what "
                 "an H200 measured; `make gpu-check` on the GPU measures a table)" % (name or "an unnamed GPU "
                                                                                         "(set MXFUSION_GPU)"))
    report.notes.append("GPU costs: %s decided; %d rewrite(s) declined for speed" % (which, declined))


def _device_note(device: str, mode: str, report: FusionReport) -> None:
    from .native import library as _native

    kind = "backward" if mode == "training" else "forward"
    ops = sorted(op for op, c in _native.capabilities().items()
                 if device in c["forward"] and (kind == "forward" or device in c["backward"]))
    report.notes.append("device %s: library ops with a %s %s in this op library: %s; the self-check runs on "
                        "the CPU" % (device, device, "forward and backward" if kind == "backward"
                                                 else "implementation",
                                                 ", ".join(ops) or "none (built without nvcc)"))


def _precision_notes(graph: Graph, ctx: Context, report: FusionReport, amp_read: Optional[dict] = None,
                     amp_convs: Optional[dict] = None) -> None:
    """What reduced precision changed, and what it could not (AMP-converted graphs included)."""
    from .precision.policy import BF16_COPIES, BFLOAT16, FLOAT32_KEPT, tolerance

    if amp_convs is not None and "kept" in amp_convs:
        report.notes.append("precision bf16: the %d convolution(s) stay float32: %s" % (amp_convs["converted"],
                                                                                       amp_convs["kept"]))
        amp_convs = None
    if amp_convs is not None:
        report.notes.append("precision bf16: MXNet's AMP converted the graph first (its %d convolution(s), and what "
                            "AMP's op lists run in bfloat16 with them; %d parameter(s) bfloat16), the rules then "
                            "fused the AMP graph around them; model outputs stay float32"
                            % (amp_convs["converted"], len(amp_convs["bf16_params"])))

    if amp_read is not None:
        left = sorted(n.name for n in graph.op_nodes() if (n.name, n.op) in amp_read["ran_bf16"])
        report.notes.append("the graph was converted by MXNet's AMP (bfloat16): read as its float32 model under "
                            "precision='bf16' -- %d amp_cast/amp_multicast removed, %d bfloat16 parameter(s) "
                            "widened exactly to float32 (the fused ops' weights cast back to the same bits)%s"
                            % (amp_read["casts"], amp_read["widened"],
                               "; %d op(s) AMP ran in bfloat16 stay MXNet's and now run in float32: %s"
                               % (len(left), _first_five(left)) if left else ""))
    amp = sorted({n.op for n in graph.op_nodes() if n.op in ("amp_cast", "amp_multicast")})
    # an amp_multicast alone (GluonCV's SSD box decoder matches dtypes with it in a float32 model) is no
    # sign of AMP: a cast to a reduced dtype is
    reduced = any(n.op == "amp_cast" and str(n.attrs.raw("dtype")) not in ("float32", "None") for n in graph.op_nodes())
    if amp and reduced and amp_read is None and amp_convs is None and report.precision != "float16":
        report.notes.append("the graph was converted by MXNet's AMP (%s): the fused ops compute in float32 and "
                            "take no bfloat16/float16 values, so the reduced-precision parts stay MXNet's own "
                            "ops; for fused bfloat16 fuse the float32 model with precision='bf16' instead"
                            % ", ".join(amp))
    if ctx.precision != BFLOAT16:
        return
    used = {nd.name for nd in graph.variables()}
    cast = [n for n in ctx.precision_cast if n in used]
    if amp_convs is not None and not cast:
        return                  # AMP's op lists decided what runs in bfloat16 (the note above)
    report.notes.append("precision bf16: %d weight(s) cast once to bfloat16 (new parameters *_bf16; matrix "
                        "products accumulate in float32); float32 kept for: %s; self-check tolerance %g"
                        % (len(cast), "; ".join(FLOAT32_KEPT), tolerance(BFLOAT16)))
    copies_of = {nd.name for nd in graph.op_nodes() if nd.op in BF16_COPIES}
    between = [n for n in ctx.precision_between if n not in copies_of]
    copies = [n for n in ctx.precision_between if n in copies_of]
    if between:
        report.notes.append("precision bf16: %d fused op output(s) held in bfloat16 between ops (read only by "
                            "bfloat16 products, which rounded them anyway): %s" % (
                                len(between), _first_five(between)))
    if copies:
        report.notes.append("precision bf16: %d float32 output(s) also written rounded to bfloat16 for the readers "
                            "that round them (bf16_copy: the next product's data; the residual stream keeps "
                            "float32): %s" % (len(copies), _first_five(copies)))
    kept = {k: v for k, v in ctx.precision_kept.items() if k.split("'")[1] in {n.name for n in graph.op_nodes()}}
    if kept:
        report.notes.append("precision bf16: %d fused op(s) stay float32: %s" % (
            len(kept), "; ".join("%s: %s" % kv for kv in list(kept.items())[:5]) + (" …" if len(kept) > 5 else "")))


def _own_convolutions_note(graph: Graph, op: str, report: FusionReport) -> None:
    """precision='bf16' where the rules give convolutions to ``op`` (a fused_region), which runs them in
    bfloat16 itself: MXNet's AMP was not run, and what stayed outside is float32."""
    left = [n.name for n in graph.op_nodes() if n.op in ("Convolution", "Deconvolution")]
    taken = [n.name for n in graph.op_nodes() if n.op == op]
    if not left and not taken:
        return          # no convolution at all (a transformer): nothing to say
    report.notes.append("precision bf16: the convolutions run in bfloat16 inside %s (%d in this graph, "
                        "precision='bfloat16'; MXNet's AMP, whose bfloat16 convolutions between MXNet's ops are "
                        "slower than float32, was not run)%s" % (
                            op, len(taken), "; %d convolution(s) outside stay float32: %s" % (
                                len(left), _first_five(left)) if left else ""))


def _collect_params(graph: Graph, ctx: Context, aux_names: set, copy_params: bool = True):
    """Parameters the fused graph still uses, as NDArrays: copies of the caller's (on their context),
    plus the new ones (on the context of their sources) — in ``aux`` when the fused graph reads them
    as auxiliary states, in ``arg`` otherwise (a moving mean that was also a graph output is an
    argument once its BatchNorm is folded away)."""
    import mxnet as mx

    used = {nd.name for nd in graph.variables()}
    arg_out: Dict[str, Any] = {}
    aux_out: Dict[str, Any] = {}
    for store, ours in ((ctx.arg_params, False), (ctx.aux_params, False), (ctx.new_args, True), (ctx.new_aux, True)):
        for k, v in store.items():
            if k not in used:
                continue
            if ours:
                v = _new_ndarray(v, ctx.new_contexts.get(k))
            elif not isinstance(v, mx.nd.NDArray):
                v = mx.nd.array(v, dtype=np.asarray(v).dtype)
            elif copy_params:       # the caller may update its arrays in place later
                v = v.copy()
            (aux_out if k in aux_names else arg_out)[k] = v
    return arg_out, aux_out


def _new_ndarray(value: np.ndarray, where: Any):
    """An NDArray of a new parameter on ``where`` (default cpu(0)); without a copy where MXNet can
    take the NumPy buffer (it is ours: computed by a rule, contiguous, used nowhere else)."""
    import mxnet as mx

    value = np.ascontiguousarray(value)
    if where is None or where == mx.cpu(0):
        if value.dtype.name in ("float32", "float64", "float16", "uint8", "int32", "int64"):
            return mx.nd.from_numpy(value, zero_copy=True)
        return mx.nd.array(value, dtype=value.dtype)
    return mx.nd.array(value, ctx=where, dtype=value.dtype)


def unfuse(symbol: Any, input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
           arg_params: Optional[Mapping[str, Any]] = None, aux_params: Optional[Mapping[str, Any]] = None,
           *, nodes: Optional[Iterable[str]] = None):
    """Rewrite every ``fused_*`` op of ``symbol`` back into stock MXNet ops; returns an ``mx.sym.Symbol``.

    ``input_shapes`` (and the params, for their shapes) are needed only where the
    stock form depends on a tensor's rank (attention masks given per head); with them,
    every stock form is also run against the fused op it replaces (the self-check of
    ``fuse``), and a fused op whose stock form does not match stays refused.

    Parameter transforms stay applied (folded convolutions remain folded) and parameter
    names are unchanged, so the fused model's params go with the result: it loads
    where mxnet-fusion is not installed.  ``nodes`` (names of fused nodes) un-fuses only those.
    """
    from patterns.unfuse import RULES, only_nodes

    from .precision.policy import BFLOAT16, FLOAT32, computes_reduced

    rules = RULES if nodes is None else [only_nodes(r, set(nodes)) for r in RULES]
    graph = _as_graph(symbol)
    nan_fused = {u.name for _, u, _ in nan_changing_fusions(graph)}
    names = _output_names(symbol, graph)
    report = FusionReport(mode="inference")
    # a model fused with precision="bf16": its stock form is checked against it at the bf16 tolerance
    reduced = computes_reduced(graph)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        ctx = Context(graph, arg_params or {}, aux_params or {}, "inference", input_shapes,
                      precision=BFLOAT16 if reduced else FLOAT32)
        run_rules(graph, rules, ctx, report, SelfCheck(ctx))
    finally:
        if gc_was_enabled:
            gc.enable()
    left = sorted({n.op for n in graph.op_nodes() if n.op.startswith("fused_")
                   and (nodes is None or n.name in nodes)})
    if left:
        reasons = "; ".join(r for rr in report.rules.values() for r in rr.rejected.values())
        raise FusionError("cannot unfuse %s: %s" % (", ".join(left), reasons or "no stock form"))
    _keep_output_names(graph, names, report)
    guard_layer_outputs(graph)      # stock ops again: keep them clear of MXNet's oneDNN backend bug
    guard_new_nan_fusions(graph, nan_fused)
    return graph.to_symbol()
