"""Applying rules: filter structural matches, rewrite them in batches, repeat to a fixpoint.

One pass runs every rule once, in decreasing ``benefit``.  For a rule, every
node is tried as an anchor from the graph's outputs backwards; the first
structural match that passes the filters below is taken, and its nodes are
claimed for the rest of the pass.  A candidate is rejected, with the reason
recorded in the report, when

* an interior node's output is used outside the match or is a graph head
  (the rewrite would have to keep computing it);
* it overlaps a match already taken in this pass;
* replacing it would create a cycle (only possible when the rewrite also
  replaces interior outputs, see ``Rule.exports``);
* the rule is inference-only and the mode is ``training``;
* the rule's own ``check`` refuses it.

The matches taken are then rewritten in topological order; the values they
replace are redirected to the new ones and the graph is compacted.  Passes
repeat until one changes nothing, so ``fuse(fuse(g)) == fuse(g)``.
"""
from __future__ import annotations

import json
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple, Union

import numpy as np

from ..ir.attrs import Attrs
from ..ir.errors import FusionError
from ..ir.graph import Entry, Graph, Node
from ..ir.matcher import Match, State, Trace, match_pattern
from ..ir.names import GIVES_BACK
from ..ir.pattern import required_ops
from ..precision.policy import FLOAT32, BF16_CODE, PARAM_DTYPES, cast_slots, dtype_name, is_bf16, reduced_attrs, to_bf16
from .reasons import NearMiss
from .report import FusionReport
from .selfcheck import Candidate, SelfCheck

MAX_PASSES = 32


class Context:
    """What rules may read besides the graph: the mode, the precision and parameter values."""

    def __init__(self, graph: Graph, arg_params: Mapping[str, Any], aux_params: Mapping[str, Any], mode: str,
                 input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
                 input_dtypes: Optional[Mapping[str, Any]] = None, precision: str = FLOAT32,
                 device: str = "cpu"):
        self.graph = graph
        self.mode = mode
        #: where the fused graph will run, 'cpu' or 'gpu': a library op is emitted only if the
        #: loaded op library implements it there (fusion.native.library.capabilities())
        self.device = device
        #: 'float32' or 'bfloat16' (fusion/precision/policy.py's policy decides what that changes)
        self.precision = precision
        #: under reduced precision: weights cast, and fused ops whose weight stayed float32 (with why)
        self.precision_cast: List[str] = []
        self.precision_kept: Dict[str, str] = {}
        #: fused ops that write bfloat16 values between ops (precision.between_ops, after the rules)
        self.precision_between: List[str] = []
        #: parameter variables shared by the replacements of a batch (bfloat16 weights): they join
        #: the graph when a batch commits (compact() drops those no committed node reads)
        self.pending_params: List[Node] = []
        #: what each committed replacement stands for: a node a rule created -> the nodes of the user's
        #: graph it replaces (through earlier replacements), and a replacing value -> the user's value
        #: it replaces (read by fusion/precision/half.py, which gives fused ops the dtypes AMP gave those)
        self.origins: Dict[Node, Tuple[Node, ...]] = {}
        self.lineage: Dict[Entry, Entry] = {}
        #: an MXNet AMP float16 graph read as its float32 model (fusion.precision.half.HalfGraph), or None
        self.half: Any = None
        self.input_dtypes = {k: str(v) for k, v in (input_dtypes or {}).items()}
        self.memo: Dict[Any, Any] = {}      # rules' derived facts about values (they never change)
        #: the names of the rules this run applies (run_rules sets them): a rule may stand aside for
        #: another one that runs after it and takes the same nodes (CNN blocks for regions)
        self.rules: FrozenSet[str] = frozenset()
        #: set by a rule whose refusal opens candidates other rules stood aside for: the engine runs
        #: one more pass even if this one changed nothing (a finite set of refusals: it ends)
        self.another_pass = False
        #: while a rule runs: node id -> the anchor of the match of this pass that holds it
        self.claimed: Dict[int, str] = {}
        self.input_shapes = {k: tuple(v) for k, v in (input_shapes or {}).items()}
        self._probes: Optional[List[Dict[str, tuple]]] = None
        self._small: Optional[Tuple[List[Dict[str, tuple]], int]] = None
        self._partial: Optional[Dict[Entry, tuple]] = None
        self._fact_cache: Dict[int, list] = {}
        self.arg_params = dict(arg_params)
        self.aux_params = dict(aux_params)
        self._numpy: Dict[str, np.ndarray] = {}
        self.new_args: Dict[str, np.ndarray] = {}
        self.new_aux: Dict[str, np.ndarray] = {}
        # where each new parameter goes: the device context of the parameters it was computed from
        self.new_contexts: Dict[str, Any] = {}
        self.names: Set[str] = {nd.name for nd in graph.nodes} | set(self.arg_params) | set(self.aux_params)
        if self.input_shapes:
            self._make_probes()

    @property
    def has_params(self) -> bool:
        return bool(self.arg_params or self.aux_params)

    def value(self, entry: Entry) -> Optional[np.ndarray]:
        """The value of the parameter that produces ``entry`` (None if it is not a known parameter)."""
        node = entry.node
        if not node.is_variable:
            return None
        name = node.name
        if name in self._numpy:
            return self._numpy[name]
        for store in (self.new_args, self.new_aux):
            if name in store:
                return store[name]
        raw = self.arg_params.get(name, self.aux_params.get(name))
        if raw is None:
            return None
        arr = raw.asnumpy() if hasattr(raw, "asnumpy") else np.asarray(raw)
        arr.setflags(write=False)   # rules compute new arrays; the caller's stay untouched
        self._numpy[name] = arr
        return arr

    def array(self, entry: Entry) -> Any:
        """The parameter producing ``entry`` as an NDArray (as given, or made once from a new parameter),
        for binding without a copy; None if it is not a known parameter."""
        node = entry.node
        if not node.is_variable:
            return None
        raw = self.arg_params.get(node.name, self.aux_params.get(node.name))
        if raw is not None and hasattr(raw, "asnumpy"):
            return raw
        v = self.value(entry)
        if v is None:
            return None
        import mxnet as mx
        key = ("ndarray", node.name)
        if key not in self.memo:
            self.memo[key] = mx.nd.array(v, dtype=v.dtype)
        return self.memo[key]

    def evaluate(self, entry: Entry, seed: int = 0,
                 input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
                 replacing: Optional[Tuple[Node, np.ndarray]] = None) -> Optional[np.ndarray]:
        """The value of ``entry`` computed by MXNet, with random data inputs of the given shapes
        (default: the user's; e.g. one of ``probes``); ``replacing`` (node, value): that node's
        output taken as ``value`` (a comparison's result replaced by test codes, to see where each
        lands).

        None when an input shape is unknown or MXNet cannot run it.  Meant for values that do
        not depend on the data (masks built from positions): call it with two seeds to check.
        """
        shapes = self.input_shapes if input_shapes is None else input_shapes
        import json

        import mxnet as mx

        data = self.graph.to_json()         # compacts the graph: the positions read below are current
        data["heads"] = [[int(entry.node.pos), entry.index, 0]]
        given = "__evaluate_replaced"
        if replacing is not None:
            pos = int(replacing[0].pos)
            data["nodes"][pos] = {"op": "null", "name": given, "inputs": []}
            data["arg_nodes"] = sorted(set(data["arg_nodes"]) | {pos})
        try:
            sym = mx.sym.load_json(json.dumps(data))
            rng = np.random.default_rng(seed)
            args = {}
            variables = {n.name: n for n in self.graph.variables()}
            for name in sym.list_arguments():
                v = replacing[1] if replacing is not None and name == given else self.value(Entry(variables[name]))
                if v is None:
                    shape = shapes.get(name)
                    if shape is None:
                        return None
                    v = rng.standard_normal(shape).astype(np.float32)
                args[name] = mx.nd.array(v, dtype=v.dtype)
            from ..native.env import subgraph_backend
            from .selfcheck import misread_nodes
            if misread_nodes(sym, args):     # MXNet would misread (or crash on) these shapes
                return None
            with subgraph_backend(False):
                exe = sym.bind(mx.cpu(), args, grad_req="null")
            return exe.forward(is_train=False)[0].asnumpy()
        except Exception:       # not computable here: the caller keeps the value as it is
            return None

    def _param_shape(self, name: str) -> Optional[tuple]:
        """A parameter's shape without copying its values out of MXNet."""
        for store in (self.new_args, self.new_aux, self.arg_params, self.aux_params):
            if name in store:
                return tuple(store[name].shape)
        return None

    def param_context(self, name: str) -> Any:
        """The device context of parameter ``name`` (the caller's NDArray's, or where a new parameter
        goes); None for a NumPy array or an unknown name."""
        if name in self.new_contexts:
            return self.new_contexts[name]
        raw = self.arg_params.get(name, self.aux_params.get(name))
        return getattr(raw, "context", None)

    def _param_dtype(self, name: str) -> Optional[str]:
        """The dtype of parameter ``name`` as MXNet's type inference takes it by name (None for
        bfloat16, which MXNet's Python API cannot pass: such variables declare it, ``__dtype__``)."""
        for store in (self.new_args, self.new_aux, self.arg_params, self.aux_params):
            if name in store:
                return None if is_bf16(store[name].dtype) else dtype_name(store[name].dtype)
        return None

    @property
    def probes(self) -> List[Dict[str, tuple]]:
        """Input shapes the facts are inferred at: the user's, then alternates (see fusion/engine/facts.py)."""
        if self._probes is None:
            self._probes = [dict(self.input_shapes)]
        return self._probes

    def _make_probes(self) -> None:
        """Probes are derived from the graph as the user gave it (a rewrite must not narrow the
        shapes it accepts), with its shapes there kept as the first facts."""
        from .facts import make_probes
        params = {nd.name: self._param_shape(nd.name) for nd in self.graph.variables()
                  if self._param_shape(nd.name) is not None}
        self.graph.compact()
        found = make_probes(self.graph, params, self.input_shapes)
        self._probes = [p for p, _ in found]
        for k, (_, shapes) in enumerate(found):
            if shapes:
                self._fact_cache[k] = [dict(shapes), {}, self.graph.version, set(self.graph.nodes)]

    def small_probes(self) -> Tuple[List[Dict[str, tuple]], int]:
        """The self-check's probes around a smaller copy of the input shapes, and the smallest size
        shrunk (fusion/facts.small_probes; ([], 0) when none).  Made on first use, from the graph as
        the self-check first sees it (before any rewrite is committed).  Their facts are kept after
        ``probes``': probe index ``len(probes) + k``."""
        if self._small is None:
            self._small = ([], 0)
            if self.input_shapes:
                from .facts import small_probes
                params = {nd.name: self._param_shape(nd.name) for nd in self.graph.variables()
                          if self._param_shape(nd.name) is not None}
                self.graph.compact()
                found, smallest = small_probes(self.graph, params, self.input_shapes)
                base = len(self.probes)
                for k, (_, shapes) in enumerate(found):
                    if shapes:
                        self._fact_cache[base + k] = [dict(shapes), {}, self.graph.version, set(self.graph.nodes)]
                self._small = ([p for p, _ in found], smallest)
        return self._small

    def partial_shape(self, entry: Entry) -> Optional[tuple]:
        """The shape of ``entry`` as far as it is known without the data inputs' sizes: its rank, with
        None for each size that depends on them (fusion/facts.partial_shapes: channels come from the
        weights, batch and spatial sizes do not); the whole shape where it is known.  Found once, on
        the graph before its first rewrite, and carried to the values that replace those values."""
        full = self.shape(entry)
        if full is None and entry.node.is_variable:
            full = self._param_shape(entry.node.name)
        if full is not None:
            return full
        if self._partial is None:
            self._find_partial()
        return self._partial.get(entry)

    def _find_partial(self) -> None:
        from .facts import partial_shapes
        self._partial = {}
        if not self.input_shapes:
            params = {nd.name: self._param_shape(nd.name) for nd in self.graph.variables()
                      if self._param_shape(nd.name) is not None}
            self.graph.compact()
            self._partial = partial_shapes(self.graph, params)

    def committed(self, replaced: Mapping[Entry, Entry]) -> None:
        """A batch of rewrites is about to be committed (the graph is still as before it): facts
        known only here (partial shapes) pass to the values that replace the old ones."""
        if self._partial is None and not self.input_shapes:
            self._find_partial()        # before the first library op joins the graph
        if self._partial:
            for old, new in replaced.items():
                if old in self._partial and new not in self._partial:
                    self._partial[new] = self._partial[old]

    def probe_shapes(self, probe: int) -> Dict[str, tuple]:
        """The input shapes of probe ``probe``: one of ``probes``, or after them the small ones."""
        if probe < len(self.probes):
            return self.probes[probe]
        small = self._small[0] if self._small else []
        k = probe - len(self.probes)
        return small[k] if k < len(small) else {}

    def _facts(self, probe: int):
        """(shapes, dtypes) of the current graph at probe ``probe``, kept across graph versions:
        rewrites keep every surviving value's shape, so values not seen yet are inferred again
        at most once per graph version."""
        cache = self._fact_cache.setdefault(probe, [{}, {}, -1, set()])
        return cache

    def _lookup(self, entry: Entry, probe: int, kind: int):
        cache = self._facts(probe)
        value = cache[kind].get(entry)
        if value is None and cache[2] != self.graph.version:
            self.graph.compact()
            if cache[2] < 0 or not self._infer_new(probe, cache):
                from .facts import infer
                shapes = self._variable_shapes(probe)
                dtypes = self._variable_dtypes() if probe == 0 else None
                # the small probes: a reshape that divides sizes computed first (facts.infer's guard)
                s, t = infer(self.graph, shapes, dtypes, guard=probe >= len(self.probes))
                cache[0].update(s)
                cache[1].update(t)
                cache[3] = set(self.graph.nodes)
            cache[2] = self.graph.version
            value = cache[kind].get(entry)
        return value

    def _infer_new(self, probe: int, cache: list) -> bool:
        """Infer only the nodes added since the last inference, from the values they read (a rewrite
        keeps every surviving value's shape); False when that is not possible."""
        from .facts import infer_nodes
        seen = cache[3]
        new = [nd for nd in self.graph.nodes if nd not in seen]
        if not new:
            return True
        params = {nd.name: self._param_shape(nd.name) for nd in new
                  if nd.is_variable and self._param_shape(nd.name) is not None}
        params.update({nd.name: self.probe_shapes(probe)[nd.name] for nd in new
                       if nd.is_variable and nd.name in self.probe_shapes(probe)})
        got = infer_nodes(new, cache[0], cache[1] if probe == 0 else None, params,
                          {nd.name: self._param_dtype(nd.name) for nd in new
                           if nd.is_variable and self._param_dtype(nd.name)} if probe == 0 else None)
        if got is None:
            return False
        cache[0].update(got[0])
        cache[1].update(got[1])
        seen.update(new)
        return True

    def _variable_shapes(self, probe: int) -> Dict[str, tuple]:
        shapes = dict(self.probe_shapes(probe))
        for nd in self.graph.variables():
            s = self._param_shape(nd.name)
            if s is not None:
                shapes[nd.name] = s
        return shapes

    def _variable_dtypes(self) -> Dict[str, str]:
        dtypes = {}
        for nd in self.graph.variables():
            t = self._param_dtype(nd.name) or self.input_dtypes.get(nd.name)
            if t is None and "__dtype__" not in nd.attrs:
                t = "float32"       # what bind gives an input of no declared dtype
            if t is not None:
                dtypes[nd.name] = t
        return dtypes

    def shape(self, entry: Entry) -> Optional[tuple]:
        """The shape of ``entry`` at the user's input shapes (None when MXNet cannot infer it)."""
        return self._lookup(entry, 0, 0)

    def shapes(self, entry: Entry) -> Tuple[tuple, ...]:
        """The shape of ``entry`` at every probe where it is known, the user's input shapes first
        (empty when unknown there).  A decision that depends on sizes must hold for all of them."""
        first = self.shape(entry)
        if first is None:
            return ()
        out = [first]
        for p in range(1, len(self.probes)):
            s = self._lookup(entry, p, 0)
            if s is not None:
                out.append(s)
        return tuple(out)

    def dtype(self, entry: Entry) -> Optional[str]:
        """The dtype of ``entry`` ('float32', 'int32', ...) from MXNet's type inference, or None."""
        return self._lookup(entry, 0, 1)

    def run_dtype(self, nodes: Sequence[Node]) -> str:
        """The dtype a fused op replacing ``nodes`` will compute in on the GPU: float16 where MXNet's
        AMP handed any of the ops it replaces a float16 value (fusion/precision/half.py gives it
        those dtypes after the rules), float32 otherwise."""
        half = self.half
        if half is None:
            return FLOAT32
        for n in (o for nd in nodes for o in self.origins.get(nd, (nd,))):
            if any(half.want.get((n, k)) == "float16" for k in range(len(n.inputs))):
                return "float16"
        return FLOAT32

    def unique_name(self, base: str) -> str:
        name = base
        k = 1
        while name in self.names:
            name = "%s_%d" % (base, k)
            k += 1
        self.names.add(name)
        return name


def device_refusal(op: str, device: str, mode: str) -> Optional[str]:
    """Why ``op`` cannot be emitted for ``device`` (None: it can): a library op the loaded op
    library does not implement there, forward (and backward in training).  Stock MXNet ops pass."""
    from ..native import library as _native

    caps = _native.capabilities().get(op)
    if caps is None:
        return None
    if device not in caps["forward"]:
        return "%s has no %s implementation in this build" % (op, device)
    if mode == "training" and device not in caps["backward"]:
        return "%s has no %s backward in this build (training needs one)" % (op, device)
    return None


def implemented(op: str, device: str = "cpu") -> bool:
    """Whether the loaded op library implements library op ``op`` on ``device`` (its forward): for a
    rule that must know before it matches (others learn it from ``device_refusal`` when they emit)."""
    from ..native import library as _native

    return device in (_native.capabilities().get(op) or {}).get("forward", ())


class SlowerOnDevice(FusionError):
    """A rewrite declined for speed: the device's cost table (or its conservative rule) says the
    fused op is slower than the ops it replaces (the message is the report's reason)."""


def speed_refusal(ctx: Context, op: str, attrs: Attrs, inputs: Sequence[Entry], nodes: Sequence[Node]) -> Optional[str]:
    """Why ``op`` is not emitted on the GPU for speed (None: it is at least as fast), decided by
    fusion/engine/cost.py from the case bench_cuda.py measures (sizes from the inputs' shapes)."""
    if ctx.device != "gpu" or not op.startswith("fused_"):
        return None
    from . import cost

    dtype = ctx.run_dtype(nodes)
    shapes = [ctx.shape(e) if not e.node.is_variable else ctx._param_shape(e.node.name) or ctx.shape(e)
              for e in inputs]
    case, unseen = cost.gpu_case(op, attrs.to_json(), shapes, dtype)
    for pass_ in ("forward", "backward") if ctx.mode == "training" else ("forward",):
        d = cost.decide(op, dtype, pass_, case, kind="gpu", unseen=unseen)
        if not d.fuse:
            return "declined for speed on the GPU (%s %s%s): %s" % (
                dtype, op, "" if pass_ == "forward" else " backward", d.reason)
    return None


class Builder:
    """Creates the replacement of one match; its nodes go just before the anchor."""

    def __init__(self, ctx: Context, anchor: Node, resolve, match: Optional[Match] = None):
        self.ctx = ctx
        self.anchor = anchor
        self._resolve = resolve
        self._match = match
        self.created: List[Node] = []
        self.params_added = 0
        #: what the rule says about this rewrite for the report (its record's "details"): a
        #: one-line "summary", and "lines" that --explain shows below it
        self.details: Dict[str, Any] = {}
        #: set by a rule whose rewrite only does what MXNet's own default bind already does with the
        #: ops it replaces (a BatchNorm folded into a convolution, which MXNet's oneDNN backend folds at
        #: bind too; a no-op removed): a short plural noun phrase naming the kind ("BatchNorm folds into
        #: convolutions ..."), counted per kind in the report's first line, which says "nothing to fuse
        #: beyond MXNet's own bind" when every rewrite is such a one
        self.same_as_bind: Optional[str] = None
        self._params: List[tuple] = []
        self._where: Any = self     # the match's source context, once known (self: not yet)

    @property
    def mode(self) -> str:
        return self.ctx.mode

    def value(self, entry: Entry) -> Optional[np.ndarray]:
        return self.ctx.value(entry)

    def _place(self, node: Node, after: Optional[Node] = None) -> Node:
        if after is not None:
            node.pos = after.pos + 1e-4 + len(self.created) * 1e-6
        else:
            node.pos = self.anchor.pos - 0.5 + len(self.created) * 1e-5
        self.created.append(node)
        return node

    def op(self, op: str, inputs: Sequence[Entry], attrs: Union[Attrs, Mapping[str, Any], None] = None,
           name: Optional[str] = None, num_outputs: int = 1, extra: Optional[Dict[str, Any]] = None,
           after: Optional[Node] = None):
        """Add an operator node; returns its output Entry (a list of them when ``num_outputs > 1``).

        ``name`` is used as given (a rewrite may reuse the name of the node it replaces);
        without one, a fresh name is derived from the anchor's.  The node goes just before
        the anchor, or just after ``after``: a replacement of an interior value that readers
        outside the match take (``Rule.outside_use_ok``) goes where that value was, since
        those readers may come before the anchor.
        """
        reason = device_refusal(op, self.ctx.device, self.ctx.mode)
        if reason:
            raise FusionError(reason)
        a = attrs.copy() if isinstance(attrs, Attrs) else Attrs.from_values(attrs or {})
        slow = speed_refusal(self.ctx, op, a, inputs, self._match.nodes if self._match is not None else ())
        if slow:
            raise SlowerOnDevice(slow)
        if self.ctx.mode != "training":
            a.update(reduced_attrs(op, self.ctx.precision))
        slots = cast_slots(op, self.ctx.precision)
        if slots:
            inputs = [self._reduced(e, op) if k in slots else e for k, e in enumerate(inputs)]
        node = Node(op, name or self.ctx.unique_name(self.anchor.name + "_fused"), a,
                    [self._resolve(e) for e in inputs], extra=dict(extra or {}), num_outputs=num_outputs)
        self._place(node, after)
        outs = [Entry(node, i) for i in range(num_outputs)]
        return outs if num_outputs > 1 else outs[0]

    def _reduced(self, entry: Entry, op: str) -> Entry:
        """The weight ``entry`` of a new ``op`` as the precision policy wants it: a bfloat16 copy
        (a new parameter, cast once) of a known float32 parameter; else ``entry`` as it is."""
        value = self.ctx.value(entry)
        where = "%s '%s'" % (op, self.anchor.name)
        if value is None:
            self.ctx.precision_kept[where] = "its weight '%s' is not a known parameter" % entry.node.name
            return entry
        if is_bf16(value.dtype):
            return entry
        if value.dtype != np.float32:
            self.ctx.precision_kept[where] = "its weight '%s' is %s" % (entry.node.name, dtype_name(value.dtype))
            return entry
        self.ctx.precision_kept.pop(where, None)
        # one copy per weight, however many fused ops read it (ALBERT shares every layer's)
        key = ("bf16_cast", entry.node.name)
        node = self.ctx.memo.get(key)
        if node is None or node.dead:
            if self.ctx.mode == "training":
                raise FusionError("precision='bf16' adds parameters; it is for inference")
            unique = self.ctx.unique_name(entry.node.name + "_bf16")
            self.ctx.new_args[unique] = to_bf16(value)
            where_ctx = self.ctx.param_context(entry.node.name)
            if where_ctx is not None:
                self.ctx.new_contexts[unique] = where_ctx
            # placed first (a variable): any fused op of this or a later pass may read it
            node = Node("null", unique, Attrs.from_values({"__dtype__": str(BF16_CODE)}), pos=-1.0)
            self.ctx.memo[key] = node
            self.ctx.pending_params.append(node)
            self.ctx.precision_cast.append(unique)
            self.params_added += 1
        return Entry(node)

    def param(self, name: str, value: np.ndarray, aux: bool = False) -> Entry:
        """Add a new parameter variable (a fresh name, never one the caller already has).

        Refused in training: a new parameter would be trained on its own (or stand for
        parameters that would then stop training)."""
        if self.ctx.mode == "training":
            raise FusionError("it would add parameter '%s'; in training every parameter must stay the one "
                              "the optimizer updates" % name)
        value = np.ascontiguousarray(value)
        if dtype_name(value.dtype) not in PARAM_DTYPES:
            raise FusionError("it would add parameter '%s' of dtype %s, which MXNet has no arrays of"
                              % (name, value.dtype.name))
        unique = self.ctx.unique_name(name)
        (self.ctx.new_aux if aux else self.ctx.new_args)[unique] = value
        if self._where is self:
            self._where = self._source_context()
        where = self._where
        if where is not None:
            self.ctx.new_contexts[unique] = where
        self.params_added += 1
        self._params.append((unique, aux))
        return Entry(self._place(Node("null", unique)))

    def _source_context(self) -> Any:
        """The device context of the parameters the match reads (the first one's, in graph order,
        should they differ); None when they are NumPy arrays or there are none."""
        m = self._match
        if m is None:
            return None
        sources = [v.node if isinstance(v, Entry) else v for v in m.bindings.values()
                   if isinstance(v, (Entry, Node))]
        sources += [e.node for nd in m.nodes for e in nd.inputs]
        for nd in sorted({id(n): n for n in sources if n.is_variable}.values(), key=lambda n: n.pos):
            where = self.ctx.param_context(nd.name)
            if where is not None:
                return where
        return None

    def discard(self) -> None:
        """Forget this replacement (refused): the parameters it added go too."""
        for name, aux in self._params:
            (self.ctx.new_aux if aux else self.ctx.new_args).pop(name, None)
            self.ctx.new_contexts.pop(name, None)
        self._params.clear()
        self.created.clear()


def _escape_reason(m: Match, users: Dict[Node, List], heads: Set[int], exported: Set[int],
                   rule: Any = None) -> Optional[str]:
    inside = {id(n) for n in m.nodes}
    for nd in m.nodes:
        is_anchor = nd is m.anchor
        if id(nd) in exported:
            continue
        for user, slot in users.get(nd, ()):
            e = user.inputs[slot]
            if id(user) in inside or is_anchor:     # the anchor's outputs: see _outputs_reason
                continue
            if rule is not None and rule.outside_use_ok(m, e, user):
                continue
            return ("output %d of %s '%s' is also used by %s '%s' outside the match"
                    % (e.index, nd.op, nd.name, user.op, user.name))
        if not is_anchor and id(nd) in heads:
            return "%s '%s' inside the match is a graph output" % (nd.op, nd.name)
    return None


#: Ops of a quantized graph (mx.contrib.quantization): quantize/dequantize/requantize, the int8 ops, and
#: oneDNN's quantized subgraph ops.  Their numbers are quantize_model's choice (ranges, rounding), so no
#: rule replaces them; rules still fuse the float parts around them.
QUANTIZATION_OPS = ("_contrib_quantize", "_contrib_dequantize", "_contrib_requantize", "_sg_mkldnn_", "_sg_onednn_")


def _quantized_reason(m: Match) -> Optional[str]:
    for nd in m.nodes:
        if nd.op.startswith(QUANTIZATION_OPS):
            return ("would replace %s '%s' of a quantized graph: quantization ops stay as "
                    "mx.contrib.quantization made them (quantize first, then fuse)" % (nd.op, nd.name))
    return None


def _not_a_candidate(rule, m: Match) -> Optional[str]:
    """The rule's own reason when it says ``m`` only looks like its candidate (a NearMiss): an engine
    filter's refusal of such a match (an interior value read outside) is no news either."""
    try:
        reason = rule.check(m)
    except Exception:   # a rule's bug shows where the match is a real candidate
        return None
    return reason if isinstance(reason, NearMiss) else None


def _internal(rule, e: Exception) -> str:
    return "internal error in rule %s (%s: %s); the subgraph is left as it was" % (
        rule.name, type(e).__name__, str(e).splitlines()[0] if str(e) else "")


def _key(rule, m: Match) -> str:
    """What identifies a candidate within its rule family (see ``Rule.key``)."""
    return m.node(rule.key).name if rule.key and m.has(rule.key) else m.anchor.name


class _Pass:
    def __init__(self, graph: Graph, ctx: Context, report: FusionReport, checker: Optional[SelfCheck] = None):
        self.graph = graph
        self.ctx = ctx
        self.report = report
        self.checker = checker
        self.first_pass = True   # near-misses are reported on the user's graph, not on our rewrites

    def run_rule(self, rule) -> int:
        graph = self.graph
        pattern, required = _compiled(rule)
        by_op = graph.nodes_by_op()
        if any(not any(op_name in by_op for op_name in group) for group in required):
            return 0            # an op every match needs is not in the graph
        roots = pattern.roots()
        users_cache: list = []          # consumers, computed on first need
        heads = {id(e.node) for e in graph.heads}
        rr = self.report.rule(rule)
        taken: Dict[int, str] = {}
        self.ctx.claimed = taken        # node id -> the anchor of the match of this rule that holds it
        matches: List[Match] = []
        if roots:
            anchors = sorted((n for op_name in roots for n in by_op.get(op_name, ())), key=lambda n: -n.pos)
        else:
            anchors = reversed(graph.nodes)
        for anchor in anchors:
            if anchor.is_variable or id(anchor) in taken:
                continue
            try:
                self._candidates(rule, rr, anchor, pattern, users_cache, heads, taken, matches)
            except Exception as e:   # a rule's bug must not cost the user the whole model: skip this candidate
                self.report.reject(rule, anchor.name, anchor.name, _internal(rule, e))
        try:
            return self._apply(rule, rr, matches)
        finally:
            self.ctx.claimed = {}

    def _candidates(self, rule, rr, anchor, pattern, users_cache, heads, taken, matches) -> None:
        """Try ``anchor``: take the first structural match passing every filter, or record why none did."""
        graph, ctx = self.graph, self.ctx
        trace = Trace(graph, ctx)
        first_reason = first_key = None
        accepted = None
        for st in match_pattern(pattern, Entry(anchor), State({}, ()), trace):
            m = Match(anchor, st, ctx)
            exported = rule.exported(m)
            if not users_cache:
                users_cache.append(graph.consumers())
            reason = _escape_reason(m, users_cache[0], heads, exported, rule)
            if reason is None:
                owner = next((taken[id(n)] for n in m.nodes if id(n) in taken), None)
                if owner is not None:
                    reason = "overlaps the %s match already taken at '%s'" % (rule.name, owner)
            if reason is None and exported:
                reason = _cycle_reason(m, users_cache[0], matches)
            if reason is None:
                reason = _quantized_reason(m)
            if reason is None and rule.inference_only and ctx.mode == "training":
                reason = rule.training_reason
            if reason is None:
                reason = rule.check(m)
            elif first_reason is None:
                reason = _not_a_candidate(rule, m) or reason
            if reason is None:
                accepted = m
                break
            if first_reason is None:
                first_reason, first_key = reason, _key(rule, m)
        if accepted is not None:
            for n in accepted.nodes:
                taken[id(n)] = anchor.name
            matches.append(accepted)
            self.report.forget_rejections(rule, _key(rule, accepted), fused_at=anchor.name)
            rr.near_misses.pop(anchor.name, None)
        elif first_reason is not None and (rule.quiet_refusals or isinstance(first_reason, NearMiss)):
            rr.near_misses[anchor.name] = first_reason         # --explain lists it; not news otherwise
        elif first_reason is not None:
            self.report.reject(rule, anchor.name, first_key, first_reason)
        elif self.first_pass and trace.excluded:
            rr.near_misses[anchor.name] = trace.excluded
        elif self.first_pass and trace.depth >= 2 and trace.reason:
            rr.near_misses[anchor.name] = trace.reason

    def _apply(self, rule, rr, matches: List[Match]) -> int:
        """Build every match's replacement, check them, commit the ones that pass."""
        if not matches:
            return 0
        candidates: List[Candidate] = []
        builders: List[Builder] = []
        for m in sorted(matches, key=lambda m: m.anchor.pos):
            # Replacements read the values of the graph as it is; the commit below redirects
            # them to what other replacements of this batch put in their place.
            b = Builder(self.ctx, m.anchor, lambda e: e, m)
            try:
                out = rule.rewrite(m, b)
                mapping = out if isinstance(out, dict) else {m.anchor_entry: out}
                reason = _outputs_reason(m, mapping, self.graph) or _training_reason(m, b, mapping, self.ctx)
            except SlowerOnDevice as e:
                reason = str(e)
            except FusionError as e:
                reason = "rewrite failed: %s" % e
            except Exception as e:   # a rule's bug: keep the original subgraph, say so
                reason = _internal(rule, e)
            if reason is not None:
                rr.rejected[m.anchor.name] = reason
                b.discard()
                _tell_refused(rule, m, reason)
                continue
            candidates.append(_candidate(rule, m, b, mapping, self.graph))
            builders.append(b)
        verdicts = self.checker.run(rule, candidates) if self.checker is not None else [None] * len(candidates)
        replaced: Dict[Entry, Entry] = {}
        created: List[Node] = []
        applied = 0
        for c, b, reason in zip(candidates, builders, verdicts):
            m = c.match
            if reason is not None:
                self.report.reject(rule, m.anchor.name, _key(rule, m), reason)
                b.discard()
                _tell_refused(rule, m, reason)
                continue
            replaced.update(c.replaces)
            created.extend(b.created)
            self._note_origins(m, b, c.replaces)
            applied += 1
            record = {"anchor": m.anchor.name, "nodes": [n.name for n in m.nodes],
                      "new": [n.name for n in b.created if not n.is_variable]}
            if b.details:
                record["details"] = dict(b.details)
            if b.same_as_bind:
                record["same_as_bind"] = b.same_as_bind
            rr.fused.append(record)
            rr.nodes_removed += len(m.nodes) - sum(1 for n in b.created if not n.is_variable)
            rr.params_added += b.params_added
        if not applied:
            return 0

        def resolve(e: Entry) -> Entry:
            while e in replaced:
                e = replaced[e]
            return e

        self.ctx.committed(replaced)
        if self.checker is not None:
            self.checker.committed(replaced)
        graph = self.graph
        graph.nodes.extend(created)
        graph.nodes.extend(self.ctx.pending_params)
        self.ctx.pending_params.clear()
        for nd in graph.nodes:
            nd.inputs = [resolve(e) for e in nd.inputs]
        graph.heads = [resolve(e) for e in graph.heads]
        graph.mark_changed()
        graph.compact()
        return applied


    def _note_origins(self, m: Match, b: "Builder", replaces: Dict[Entry, Entry]) -> None:
        origins = self.ctx.origins
        mine = tuple(dict.fromkeys(o for n in m.nodes for o in origins.get(n, (n,))))    # each once
        for n in b.created:
            if not n.is_variable:
                origins[n] = mine
        made = set(b.created)
        given: Dict[Node, Dict[int, Entry]] = {}
        for old, new in replaces.items():
            if new.node in made:        # a value the rewrite made (not one it forwards, as a removed Dropout)
                self.ctx.lineage[new] = self.ctx.lineage.get(old, old)
                if new.node.num_outputs > 1:
                    given.setdefault(new.node, {})[new.index] = self.ctx.lineage[new]
        for n, outs in given.items():   # which of the user's values each output is (fusion/ir/names.py)
            n.attrs[GIVES_BACK] = json.dumps([[outs[i].node.name, outs[i].index] if i in outs else None
                                              for i in range(n.num_outputs)], separators=(",", ":"))


def _tell_refused(rule, m: Match, reason: str) -> None:
    try:
        rule.refused(m, reason)
    except Exception:   # a rule's bug in its bookkeeping must not cost the user the model
        pass


def _candidate(rule, m: Match, b: "Builder", mapping: Dict[Entry, Entry], graph: Graph) -> Candidate:
    """The rewrite as the self-check sees it: the values compared are those something outside the
    match reads.  A value read only by users the rule vouches for (``Rule.outside_use_ok``, e.g.
    positions taken off a head split) is compared through those users."""
    inside = {id(n) for n in m.nodes}
    heads = set(graph.heads)
    users = graph.consumers()
    compared: Dict[Entry, Entry] = {}
    old_extra: List[Node] = []
    new_extra: List[Node] = []
    for old, new in mapping.items():
        outside = [(u, slot) for u, slot in users.get(old.node, ()) if u.inputs[slot] == old and id(u) not in inside]
        if old in heads or any(not rule.outside_use_ok(m, old, u) for u, _ in outside):
            compared[old] = new
            continue
        for u, _ in outside:
            twin = Node(u.op, u.name, u.attrs, [new if e == old else e for e in u.inputs], num_outputs=u.num_outputs)
            old_extra.append(u)
            new_extra.append(twin)
            for k in range(u.num_outputs):
                compared[Entry(u, k)] = Entry(twin, k)
    return Candidate(m, b.created, compared, replaces=mapping, old_extra=old_extra, new_extra=new_extra)


def _outputs_reason(m: Match, mapping: Dict[Entry, Entry], graph: Graph) -> Optional[str]:
    """Every output of a matched node that something outside the match reads must be replaced."""
    inside = {id(n) for n in m.nodes}
    users = graph.consumers()
    for nd in m.nodes:
        for user, slot in users.get(nd, ()):
            e = user.inputs[slot]
            if id(user) not in inside and e not in mapping:
                return ("output %d of %s '%s' is read by %s '%s', and the rewrite does not produce it"
                        % (e.index, nd.op, nd.name, user.op, user.name))
    for e in graph.heads:
        if id(e.node) in inside and e not in mapping:
            return "output %d of %s '%s' is a graph output the rewrite does not produce" % (e.index, e.node.op, e.node.name)
    return None


def _training_reason(m: Match, b: "Builder", mapping: Dict[Entry, Entry], ctx: "Context") -> Optional[str]:
    """In training, a rewrite keeps reading every variable the matched nodes read (no parameter is
    folded, copied or baked into an attribute: each keeps receiving its gradient)."""
    if ctx.mode != "training":
        return None
    if any(n.op.startswith("fused_") for n in b.created):
        key = ("has_prelu", ctx.graph.version)
        if key not in ctx.memo:
            from .workarounds import has_prelu
            ctx.memo[key] = has_prelu(ctx.graph)
        if ctx.memo[key]:
            return ("the graph has a LeakyReLU(prelu): MXNet 1.9.1 computes prelu's γ gradient wrong when "
                    "a library op runs before or after it in training")
        key = ("zero_gradient", ctx.graph.version)
        if key not in ctx.memo:
            from .workarounds import zero_gradient
            ctx.memo[key] = zero_gradient(ctx.graph)
        if any(id(e.node) in ctx.memo[key] for e in mapping):
            return ("its result gets no gradient (what reads it ends in BlockGrad or the like): MXNet skips "
                    "the backward of what it replaces, a library op's would run (0 · NaN is NaN)")
        from .workarounds import ZERO_GRADIENT
        # what a library op reads and MXNet gives no gradient: harmless where its backward gives
        # zeros anyway (a comparison, positions) or there is none (a variable)
        quiet = next((e for n in b.created if n.op.startswith("fused_") for e in n.inputs
                      if not e.node.is_variable and e.node.op not in ZERO_GRADIENT
                      and id(e.node) in ctx.memo[key]), None)
        if quiet is not None:
            return ("%s '%s' gets no gradient (what reads it ends in a comparison, BlockGrad or the like): "
                    "MXNet skips its backward; the library op's backward would hand it zeros and run it "
                    "(0 · inf is NaN)" % (quiet.node.op, quiet.node.name))
    read = {id(e.node) for n in b.created for e in n.inputs} | {id(e.node) for e in mapping.values()}
    for nd in m.nodes:
        for e in nd.inputs:
            if e.node.is_variable and id(e.node) not in read:
                return ("parameter '%s' would no longer be read: in training it must keep receiving its "
                        "gradient" % e.node.name)
    return None


def _cycle_reason(m: Match, users: Dict[Node, List], taken: Sequence[Match]) -> Optional[str]:
    """Why replacing ``m`` (whose rewrite also replaces interior values, ``Rule.exported``) would make
    the graph cyclic, or None: a path from one of its nodes through nodes outside it back into it --
    in the graph where each match already ``taken`` in this batch is one node as well (two matches
    that each read the other's values are a cycle neither shows alone)."""
    inside = {id(n) for n in m.nodes}
    group: Dict[int, int] = {id(n): k for k, t in enumerate(taken) for n in t.nodes}
    entered: Set[int] = set()
    seen: Set[int] = set()
    todo = [u for n in m.nodes for u, _ in users.get(n, ()) if id(u) not in inside]
    while todo:
        n = todo.pop()
        if id(n) in inside:
            src = next((e.node for e in n.inputs if id(e.node) not in inside), n)
            return ("fusing would create a cycle: '%s' inside the match reads '%s', which depends on the match's "
                    "own outputs" % (n.name, src.name))
        if id(n) in seen:
            continue
        seen.add(id(n))
        k = group.get(id(n))
        if k is not None and k not in entered:       # one node with the other match: all of its outputs
            entered.add(k)
            todo.extend(taken[k].nodes)
        todo.extend(u for u, _ in users.get(n, ()))
    return None


_PATTERNS: Dict[int, Any] = {}


def _compiled(rule) -> Any:
    key = id(rule)
    p = _PATTERNS.get(key)
    if p is None or p[0] is not rule:
        pattern = rule.pattern()
        p = _PATTERNS[key] = (rule, (pattern, required_ops(pattern)))
    return p[1]


def run_rules(graph: Graph, rules: Sequence[Any], ctx: Context, report: FusionReport,
              checker: Optional[SelfCheck] = None) -> None:
    """Apply ``rules`` to ``graph`` (in place) until a whole pass changes nothing.

    ``checker`` runs each batch of rewrites side by side with what they replace before
    they are committed (see fusion/engine/selfcheck.py)."""
    ordered = sorted(rules, key=lambda r: (-r.benefit, r.name))
    names = [r.name for r in ordered]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError("rule names must be unique: %s" % ", ".join(sorted(dup)))
    for r in ordered:
        report.rule(r)
    ctx.rules = frozenset(names)
    p = _Pass(graph, ctx, report, checker)
    for k in range(MAX_PASSES):
        report.passes = k + 1
        ctx.another_pass = False
        changed = sum(p.run_rule(r) for r in ordered)
        p.first_pass = False
        if changed == 0 and not ctx.another_pass:
            return
    raise FusionError("rules did not reach a fixpoint after %d passes (a rule keeps rewriting its own output)" % MAX_PASSES)
