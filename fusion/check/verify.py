"""Numerical verification: run the original and the fused model on the same inputs and compare.

``max_rel`` is, per output, ``max|fused − original| / max|original|`` over the
elements finite in both (the error relative to the output's scale, which stays
meaningful where single elements are near zero), and the largest over all
outputs is reported.  NaN and ±inf are compared on their own: a NaN/inf where
the original has a finite value (or the reverse, or another NaN/inf) fails
verification, with the count; NaN/inf in the original at the same places in
the fused model are reported, not hidden.

The inputs are drawn to fit how the model reads each one (``input_domains``):
token and segment ids feeding an ``Embedding`` (also through Cast/Reshape/slice
…) are integers in ``[0, input_dim)``; valid lengths feeding a softmax
``length``, a ``SequenceMask`` or an attention valid length are in ``[1, S]``;
``where`` conditions and masks multiplied into a larger tensor are 0/1; other
inputs are N(0, 1).  Two different draws are run (or the user's own inputs,
``verify(..., inputs=...)``/``mxfuse --inputs FILE.npz``), and an output that is
one constant over every element of every draw is reported: it cannot tell a
right model from a wrong one ("verification is weak").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..ir.errors import FusionError
from ..precision.policy import as_float32, astype

DEFAULT_RTOL = 1e-4
DRAWS = 2           # random draws compared when no inputs are given


@dataclass
class VerifyResult:
    """The comparison of every output: errors on the finite elements, NaN/inf apart.

    ``nonfinite`` lists outputs whose NaN/inf differ from the original's (a failure);
    ``notes`` what the original computes as NaN/inf (compared at the same places);
    ``constant`` the outputs that are one constant over all verification inputs.
    """

    max_abs: float
    max_rel: float
    per_output: List[Tuple[str, float, float]] = field(default_factory=list)   # (name, abs, rel)
    # (output index, name, NaN/inf where the original is finite, finite where it is not, other NaN/inf)
    nonfinite_mismatch: List[Tuple[int, str, int, int, int]] = field(default_factory=list)
    # (output index, name, NaN/inf elements of the original, elements) — summed over the draws
    nonfinite_original: List[Tuple[int, str, int, int]] = field(default_factory=list)
    constant: List[str] = field(default_factory=list)
    # outputs of sorting/NMS compared as sets of rows (fusion/check/rowsets.py): {output index: RowLayout}
    row_sets: Dict[int, Any] = field(default_factory=dict)
    moved_rows: Dict[int, int] = field(default_factory=dict)      # rows that changed places (worst draw)
    positional_max_rel: Optional[float] = None                    # the error had they been compared in place
    positional_per_output: Dict[int, float] = field(default_factory=dict)
    # the original's own spread: its outputs with MXNet's oneDNN backend on (its default bind) against off
    spread: Optional[float] = None
    spread_per_output: List[Tuple[str, float]] = field(default_factory=list)
    # what the memory plan ran smaller (fusion/engine/memory.py), one line each
    memory_notes: List[str] = field(default_factory=list)
    # where the whole comparison failed and the model has NMS: the comparison cut at the NMS inputs
    # (fusion/check/cuts.py): {"cuts": [names], "whole_max_rel": the whole comparison's error,
    # "inputs": [(cut name, field of its input: scores/boxes/class ids/…, rel)]}; the errors above are then
    # the piecewise ones
    piecewise: Optional[Dict[str, Any]] = None
    # where a compared value still differed by more than the tolerance: each such value judged against the
    # original run in float64 (fusion/check/cuts.py: rounding_check): {"kind": "output"/"cut", "index",
    # "value": its name, "max_rel", "original_f32": the original's own error against float64, "fused": the
    # fused model's}; one entry {"value": None, "why": …} where MXNet could not run them in float64
    rounding: Optional[List[Dict[str, Any]]] = None

    @property
    def nonfinite(self) -> List[str]:
        """The NaN/inf mismatches, one line per output (a failure)."""
        out = []
        for i, name, lost, gained, changed in self.nonfinite_mismatch:
            parts = [s for s in ("%d NaN/inf where the original is finite" % lost if lost else "",
                                 "%d finite where the original is NaN/inf" % gained if gained else "",
                                 "%d other NaN/inf than the original's" % changed if changed else "") if s]
            out.append("%s: %s" % (_label(i, name), ", ".join(parts)))
        return out

    @property
    def notes(self) -> List[str]:
        """What the original computes as NaN/inf (reported, compared position by position)."""
        return ["%s: the original computes NaN/inf at %d of %d element(s); errors are over the elements "
                "finite in both" % (_label(i, name), bad, size) for i, name, bad, size in self.nonfinite_original]

    def ok(self, rtol: float = DEFAULT_RTOL) -> bool:
        if not np.isfinite(self.max_rel) or self.nonfinite:
            return False
        return self.max_rel <= rtol or self.within_rounding(rtol)

    def within_rounding(self, rtol: float = DEFAULT_RTOL) -> bool:
        """Whether every value that differs by more than ``rtol`` was judged against float64 and is no
        farther from it than the original's own float32 rounding allows (``cuts.ROUNDING_FACTOR``)."""
        from .cuts import within_rounding

        if not self.rounding or any(e.get("value") is None for e in self.rounding):
            return False
        judged = {(e["kind"], e["index"]): e for e in self.rounding}
        compared = [("output", i, rel) for i, (_, _, rel) in enumerate(self.per_output)]
        if self.piecewise is not None:
            compared += [("cut", j, rel) for j, (_, _, rel) in enumerate(self.piecewise["inputs"])]
        for kind, index, rel in compared:
            if not rel <= rtol:
                e = judged.get((kind, index))
                if e is None or not within_rounding(e, rtol):
                    return False
        return True

    @property
    def weak(self) -> bool:
        return bool(self.constant)

    def status(self, rtol: float = DEFAULT_RTOL) -> str:
        """"MISMATCH", "WEAK" (matches, but an output is constant) or "OK"."""
        return "MISMATCH" if not self.ok(rtol) else "WEAK" if self.weak else "OK"

    def problems(self) -> List[str]:
        """One line each: NaN/inf mismatches, NaN/inf of the original, constant outputs."""
        out = list(self.nonfinite) + list(self.notes)
        if self.constant:
            out.append("verification is weak: %s %s constant over the verification inputs (a wrong model "
                       "could match it)" % (", ".join(self.constant), "is" if len(self.constant) == 1 else "are"))
        return out

    def failure(self, rtol: float = DEFAULT_RTOL) -> Optional[str]:
        """Why verification failed (one line), or None."""
        if self.ok(rtol):
            return None
        if self.nonfinite:
            return "fused outputs differ from the original: " + "; ".join(self.nonfinite)
        spread = "" if self.spread is None else "; the original's own spread, MXNet's backend on vs off: %.3g" % (
            self.spread)
        from .cuts import ROUNDING_FACTOR

        worst = max((e for e in self.rounding or [] if e.get("value") is not None), default=None,
                    key=lambda e: e["fused"] - ROUNDING_FACTOR * e["original_f32"])
        if worst is not None:
            spread += "; against the original run in float64, %s is %.3g off, the original's float32 %.3g" % (
                worst["value"], worst["fused"], worst["original_f32"])
        return "fused outputs differ from the original (max rel error %.3g > %.3g%s)" % (self.max_rel, rtol, spread)

    def comparison(self, index: int) -> str:
        """How output ``index`` was compared: "by position" or as a set of rows (and which)."""
        layout = self.row_sets.get(index)
        return "by position" if layout is None else "as " + layout.describe()

    def details(self) -> List[str]:
        """How the outputs of sorting ops were compared (one line per sorting op's layout), and the
        original's own spread."""
        out = []
        groups: Dict[Any, List[int]] = {}
        for i, layout in sorted(self.row_sets.items()):
            groups.setdefault(layout, []).append(i)
        for layout, members in groups.items():
            labels = ", ".join(_label(i, self.per_output[i][0] if i < len(self.per_output) else "?") for i in members)
            moved = max(self.moved_rows.get(i, 0) for i in members)
            by_place = max(self.positional_per_output.get(i, 0.0) for i in members)
            out.append("%s compared as %s: %s" % (
                labels, layout.describe(), "%d row(s) changed places (compared by position: max rel error %.3g)"
                % (moved, by_place) if moved else "no row changed places"))
        if self.piecewise is not None:
            pw = self.piecewise
            out.append("compared piecewise at the inputs of %s (the whole model: max rel error %.3g, NMS, sorts "
                       "and steps choosing among near-ties): the inputs cut max rel %s, the outputs from the "
                       "original's values there max rel %.3g" % (", ".join("'%s'" % c for c in pw["cuts"]), pw["whole_max_rel"],
                                                ", ".join("%s %.3g" % (f, r) for _, f, r in pw["inputs"]),
                                                pw["outputs_max_rel"]))
        if self.rounding:
            from .cuts import ROUNDING_FACTOR

            why = [e["why"] for e in self.rounding if e.get("value") is None]
            judged = [e for e in self.rounding if e.get("value") is not None]
            if judged:
                out.append("judged against the original run in float64 (a fused value within %g× the original's "
                           "own float32 error is its rounding): %s" % (ROUNDING_FACTOR, "; ".join(
                               "%s: fused %.3g, the original's float32 %.3g" % (e["value"], e["fused"],
                                                                               e["original_f32"]) for e in judged)))
            if why:
                out.append("not judged against float64: %s%s" % (
                    why[0], " (and %d more)" % (len(why) - 1) if len(why) > 1 else ""))
        if self.spread is not None:
            out.append("the original's own spread (its outputs with MXNet's oneDNN backend on vs off, compared "
                       "the same way): max rel %.3g" % self.spread)
        out.extend(n[len("verify: "):] if n.startswith("verify: ") else n for n in self.memory_notes)
        return out

    def to_dict(self, rtol: float = DEFAULT_RTOL) -> Dict[str, Any]:
        return {"max_abs": self.max_abs, "max_rel": self.max_rel, "rtol": rtol, "ok": self.ok(rtol),
                "status": self.status(rtol), "problems": self.problems(), "failure": self.failure(rtol),
                "comparison": [{"output": name, "kind": "row_set" if i in self.row_sets else "positional",
                                **({"row_axis": self.row_sets[i].row_axis, "lines": list(self.row_sets[i].lines),
                                    "source": self.row_sets[i].source, "moved_rows": self.moved_rows.get(i, 0),
                                    "positional_max_rel": self.positional_per_output.get(i)}
                                   if i in self.row_sets else {})}
                               for i, (name, _, _) in enumerate(self.per_output)],
                "positional_max_rel": self.positional_max_rel,
                "piecewise": None if self.piecewise is None else {
                    "cuts": list(self.piecewise["cuts"]), "whole_max_rel": self.piecewise["whole_max_rel"],
                    "inputs": [{"cut": c, "field": f, "max_rel": r} for c, f, r in self.piecewise["inputs"]],
                    "outputs_max_rel": self.piecewise["outputs_max_rel"]},
                "float64": None if self.rounding is None else [dict(e) for e in self.rounding],
                "original_spread": None if self.spread is None else {
                    "max_rel": self.spread, "per_output": [{"output": n, "max_rel": r}
                                                           for n, r in self.spread_per_output]},
                "details": self.details()}

    def __str__(self) -> str:
        text = "max abs error %.3g, max rel error %.3g over %d output(s)" % (
            self.max_abs, self.max_rel, len(self.per_output))
        return "; ".join([text] + self.problems() + self.details())


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


# ---------------------------------------------------------------- inputs that exercise the model

# A multiplication by an input that broadcasts into a larger operand masks it when the input
# is otherwise only read by masking ops (1 - m, comparisons, where).
_MUL = frozenset({"elemwise_mul", "broadcast_mul", "_mul", "_Mul"})
_MASKING = _MUL | {"_rminus_scalar", "where", "logical_not", "broadcast_logical_and", "broadcast_logical_or",
                   "_equal_scalar", "_not_equal_scalar"}


def _length_domain(node: Any, slot: int, shape_of) -> Optional[Tuple]:
    """Valid lengths in [1, S] (selfcheck's draws allow 0, which a user's data never holds)."""
    from ..engine.inputs import attention_keys, softmax_length_bound

    if node.op in ("softmax", "log_softmax", "masked_softmax") and slot == 1 and node.param("use_length", False):
        n = softmax_length_bound(node, shape_of)
        return None if n is None else ("int", 1, n)
    if node.op == "fused_attention" and node.param("mask_kind", "none") == "valid_length" and slot >= 1:
        data = {"plain": 3, "bshd": 3, "packed_qkv": 1, "interleaved": 1,
                "interleaved_encdec": 2}.get(node.param("layout", "plain"), 3)
        if slot == data:
            n = attention_keys(node, shape_of)
            return None if n is None else ("int", 1, n)
    return None


def _domain_of(entry_users, users_of, shape_of) -> Optional[Tuple]:
    from ..engine.inputs import input_domain

    return input_domain(entry_users, users_of, shape_of, domain=_length_domain, max_depth=8)


def _is_mask(entry_users, users_of, shape_of, size: int, depth: int = 0) -> bool:
    """Read only by masking ops, at least once multiplied into a larger tensor or made an additive
    mask (``(1 − m)·(−10000)``, BERT's way)."""
    from ..engine.inputs import PASS_THROUGH

    masks = False
    for node, slot in entry_users:
        if node.op in PASS_THROUGH and slot == 0 and depth < 8:
            if not _is_mask(users_of(node), users_of, shape_of, size, depth + 1):
                return False
            masks = True
            continue
        if node.op not in _MASKING:
            return False
        if node.op in _MUL and len(node.inputs) == 2:
            other = shape_of(node.inputs[1 - slot])
            if other is None or int(np.prod(other)) <= size:
                return False
            masks = True
        elif node.op == "_rminus_scalar":
            if float(node.param("scalar", 0)) != 1.0:
                return False
            if _additive_mask(users_of(node), users_of):
                masks = True
    return masks


def _additive_mask(entry_users, users_of) -> bool:
    """``x·c`` with ``|c| ≥ 1000`` (a large negative or positive bias where ``x`` is 1), added to something."""
    if not entry_users:
        return False
    for node, _ in entry_users:
        if node.op != "_mul_scalar" or abs(float(node.param("scalar", 0))) < 1e3:
            return False
        if not all(u.op in ("elemwise_add", "broadcast_add", "_plus", "_Plus") for u, _ in users_of(node)):
            return False
    return True


def input_domains(symbol: Any, arg_params: Mapping[str, Any], aux_params: Mapping[str, Any],
                  input_shapes: Mapping[str, Sequence[int]]) -> Dict[str, Tuple]:
    """How the model reads each data input (of ``input_shapes``): name -> ("int", lo, hi) (both
    included), ("bool",) or ("real",)."""
    from ..engine.facts import infer
    from ..ir.graph import Entry, Graph

    graph = Graph.from_symbol(symbol)
    known = {k: tuple(v.shape) for k, v in list(arg_params.items()) + list(aux_params.items())}
    known.update({k: tuple(v) for k, v in input_shapes.items()})
    shapes, _ = infer(graph, known)
    users = graph.consumers()

    def users_of(node):
        return users.get(node, [])

    def shape_of(e: Entry):
        return shapes.get(e)

    out: Dict[str, Tuple] = {}
    for nd in graph.variables():
        if nd.name in arg_params or nd.name in aux_params or nd.name not in input_shapes:
            continue
        d = _domain_of(users_of(nd), users_of, shape_of)
        if d is None and _is_mask(users_of(nd), users_of, shape_of, int(np.prod(input_shapes[nd.name]))):
            d = ("bool",)
        out[nd.name] = d or ("real",)
    return out


def input_dtypes(symbol: Any, arg_params: Mapping[str, Any], aux_params: Mapping[str, Any]) -> Dict[str, str]:
    """The dtype MXNet's type inference gives each data input with the parameters' dtypes
    (float32, or the float dtype the parameters need; see ``modelio.fitting_input_dtypes``)."""
    from ..files.modelio import fitting_input_dtypes
    from ..precision.policy import is_bf16

    # bfloat16 parameters (AMP's, or precision="bf16") cannot be given to MXNet's Python type
    # inference by name; their variables declare it in the graph
    given = {k: np.dtype(v.dtype).name for k, v in list(arg_params.items()) + list(aux_params.items())
             if not is_bf16(v.dtype)}
    types = fitting_input_dtypes(symbol, given) or {}
    return {n: types.get(n, "float32") for n in symbol.list_arguments() if n not in arg_params}


def random_inputs(symbol: Any, arg_params: Mapping[str, Any], input_shapes: Mapping[str, Sequence[int]],
                  seed: int = 0, aux_params: Optional[Mapping[str, Any]] = None) -> Dict[str, np.ndarray]:
    """Random values for every argument of ``symbol`` that is not a parameter, each drawn in the
    domain the model reads it in (see the module docs) and of the dtype the model gives it."""
    from ..engine.inputs import draw

    aux_params = aux_params or {}
    data_names = [n for n in symbol.list_arguments() if n not in arg_params]
    missing = [n for n in data_names if n not in input_shapes]
    if missing:
        raise FusionError("no shape given for input(s) %s (use --shape NAME=D1,D2,...)" % ", ".join(missing))
    shapes = {n: tuple(input_shapes[n]) for n in data_names}
    domains = input_domains(symbol, arg_params, aux_params, shapes)
    dtypes = input_dtypes(symbol, arg_params, aux_params)
    rng = np.random.default_rng(seed)
    out = {}
    for n in data_names:
        d = domains.get(n, ("real",))
        out[n] = draw(rng, shapes[n], dtypes.get(n, "float32"), None if d[0] == "real" else d)
    return out


def load_inputs(path: str, symbol: Any, arg_params: Mapping[str, Any],
                aux_params: Optional[Mapping[str, Any]] = None,
                input_shapes: Optional[Mapping[str, Sequence[int]]] = None) -> Dict[str, np.ndarray]:
    """The inputs in ``path`` (an ``.npz`` of arrays named like the model's inputs), each cast to
    the dtype the model gives it; a one-line error when the file, the names or the shapes given
    in ``input_shapes`` do not fit."""
    import zipfile

    data_names = [n for n in symbol.list_arguments() if n not in arg_params]
    try:
        with np.load(path, allow_pickle=False) as f:
            loaded = {k: f[k] for k in f.files}
    except FileNotFoundError:
        raise FusionError("cannot read inputs file '%s': no such file" % path) from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise FusionError("cannot read inputs file '%s' (expected an .npz of arrays named like the inputs): %s"
                          % (path, str(e).splitlines()[0] if str(e) else type(e).__name__)) from None
    if not isinstance(loaded, dict):
        raise FusionError("inputs file '%s' is one array; save an .npz with one array per input (%s)"
                          % (path, ", ".join(data_names)))
    extra = sorted(set(loaded) - set(data_names))
    missing = [n for n in data_names if n not in loaded]
    if extra or missing:
        raise FusionError("inputs file '%s' does not name the model's inputs: %s (inputs: %s)" % (
            path, "; ".join(x for x in ("missing %s" % ", ".join(missing) if missing else "",
                                        "not inputs: %s" % ", ".join(extra) if extra else "") if x),
            ", ".join(data_names)))
    dtypes = input_dtypes(symbol, arg_params, aux_params or {})
    out = {}
    for n in data_names:
        a = loaded[n]
        if a.dtype.kind not in "biuf":
            raise FusionError("input '%s' in '%s' has dtype %s; expected numbers" % (n, path, a.dtype))
        want = (input_shapes or {}).get(n)
        if want is not None and tuple(want) != a.shape:
            raise FusionError("input '%s' in '%s' has shape %s but --shape gives %s"
                              % (n, path, ",".join(map(str, a.shape)), ",".join(map(str, want))))
        out[n] = astype(a, dtypes.get(n, "float32"))         # MXNet's bfloat16 too
    return out


# ---------------------------------------------------------------- running and comparing

def run(symbol: Any, arg_params: Mapping[str, Any], aux_params: Mapping[str, Any],
        inputs: Mapping[str, np.ndarray], ctx: Any = None, subgraph: bool = False) -> List[np.ndarray]:
    """Bind ``symbol`` for inference and return its outputs as NumPy arrays.

    On the CPU, float16 ops MXNet's CPU runs only in float32 (FullyConnected, the interleaved
    attention products of an AMP float16 graph) are computed as a GPU computes them: in float32
    from their float16 inputs, the output rounded to float16 (``precision.half.as_the_gpu_computes``).

    By default MXNet's oneDNN subgraph backend is off: verification compares the
    arithmetic of the graphs, and MXNet 1.9.1's backend aborts the process on some
    valid graphs (e.g. Convolution → BatchNorm over a non-channel axis).
    """
    from ..native.env import subgraph_backend

    if ctx is None or getattr(ctx, "device_type", "cpu") == "cpu":     # float16 GEMMs: as a GPU computes them
        from ..precision.half import as_the_gpu_computes
        symbol = as_the_gpu_computes(symbol, arg_params, aux_params,
                                     {k: np.asarray(v).dtype if not hasattr(v, "dtype") else v.dtype
                                      for k, v in inputs.items()})
    with subgraph_backend(subgraph):
        exe = bind(symbol, arg_params, aux_params, inputs, ctx)
    return [o.asnumpy() for o in exe.forward(is_train=False)]


def run_many(symbol: Any, arg_params: Mapping[str, Any], aux_params: Mapping[str, Any],
             feeds: Sequence[Mapping[str, np.ndarray]], ctx: Any = None, subgraph: bool = False,
             each: Optional[Any] = None) -> List[Any]:
    """``run`` on each of ``feeds`` (the same names and shapes) with one executor: bound once, its inputs
    copied in for each further feed — one bind and one first run (oneDNN's weight reorders, its
    primitives made) for all of them.  The outputs of each feed, or what ``each(k, outputs)`` makes of
    the ``k``-th (then the outputs are not kept)."""
    import mxnet as mx

    from ..native.env import subgraph_backend

    if not feeds:
        return []
    first = feeds[0]
    if ctx is None or getattr(ctx, "device_type", "cpu") == "cpu":
        from ..precision.half import as_the_gpu_computes
        symbol = as_the_gpu_computes(symbol, arg_params, aux_params,
                                     {k: np.asarray(v).dtype if not hasattr(v, "dtype") else v.dtype
                                      for k, v in first.items()})
    with subgraph_backend(subgraph):
        exe = bind(symbol, arg_params, aux_params, first, ctx)
    got = [o.asnumpy() for o in exe.forward(is_train=False)]
    outs = [got if each is None else each(0, got)]
    for k, feed in enumerate(feeds[1:], 1):
        try:
            for name, value in feed.items():
                if name in exe.arg_dict:
                    exe.arg_dict[name][:] = value
        except (mx.base.MXNetError, ValueError, TypeError):      # a dtype NDArray assignment does not take
            with subgraph_backend(subgraph):
                exe = bind(symbol, arg_params, aux_params, feed, ctx)
        got = [o.asnumpy() for o in exe.forward(is_train=False)]
        outs.append(got if each is None else each(k, got))
    del exe
    return outs


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
        # among the arguments where a fused op read it as an input (a fused_region's BatchNorm
        # statistics) and the un-fused symbol reads it as an auxiliary state again
        v = aux_params.get(name, arg_params.get(name))
        if v is None:
            raise FusionError("auxiliary state '%s' has no value" % name)
        aux[name] = v.as_in_context(ctx) if isinstance(v, mx.nd.NDArray) else mx.nd.array(v, ctx=ctx, dtype=v.dtype)
    return symbol.bind(ctx, args, aux_states=aux, grad_req="null")


def _run_or_say(symbol, arg, aux, feeds, what: str, each: Any = None) -> List[Any]:
    """``run_many`` (outputs as float32 values: bfloat16 compared as the values it holds), with MXNet's
    refusal as a one-line error (e.g. a float16 model on a CPU without fp16 GEMM)."""
    import mxnet as mx

    from ..ir.graph import first_line

    def as_values(k, outs):
        values = [as_float32(o) for o in outs]
        return values if each is None else each(k, values)

    try:
        return run_many(symbol, arg, aux, feeds, each=as_values)
    except mx.base.MXNetError as e:
        raise FusionError("%s does not run on the verification inputs: %s" % (what, first_line(str(e)))) from None


def _label(index: int, name: str) -> str:
    return "output %d ('%s')" % (index, name)


def compare(reference: Sequence[np.ndarray], candidate: Sequence[np.ndarray], names: Sequence[str]) -> VerifyResult:
    """Errors on the elements finite in both; NaN/±inf compared position by position."""
    if len(reference) != len(candidate):
        raise FusionError("the fused model has %d outputs, the original %d" % (len(candidate), len(reference)))
    result = VerifyResult(0.0, 0.0)
    for i, (name, a, b) in enumerate(zip(names, reference, candidate)):
        if a.shape != b.shape:
            raise FusionError("output '%s' has shape %s after fusion, %s before" % (name, b.shape, a.shape))
        lost, gained, changed, n_bad, abs_err, scale = _errors(a, b)
        if lost or gained or changed:
            result.nonfinite_mismatch.append((i, name, lost, gained, changed))
        if n_bad:
            result.nonfinite_original.append((i, name, n_bad, a.size))
        rel = abs_err / scale if scale > 0 else abs_err
        result.per_output.append((name, abs_err, rel))
        result.max_abs, result.max_rel = max(result.max_abs, abs_err), max(result.max_rel, rel)
    return result


#: elements compared at a time: the float64 copies of a block, not of a whole output (a segmentation
#: model's 150×480×480 scores took 1.4 GB of temporaries at once)
_BLOCK = 1 << 20


def _errors(a: np.ndarray, b: np.ndarray) -> Tuple[int, int, int, int, float, float]:
    """(finite in a only, finite in b only, other NaN/inf differing, non-finite in a, the largest
    |a - b| where both are finite, the largest |a| there), in float64, block by block."""
    fa, fb = as_float32(a).reshape(-1), as_float32(b).reshape(-1)   # bfloat16: its values
    lost = gained = changed = n_bad = 0
    abs_err = scale = 0.0
    for start in range(0, fa.size, _BLOCK):
        a64 = fa[start:start + _BLOCK].astype(np.float64)
        b64 = fb[start:start + _BLOCK].astype(np.float64)
        fin_a, fin_b = np.isfinite(a64), np.isfinite(b64)
        # a NaN/inf where the other is finite, or another NaN/inf (NaN vs inf, +inf vs -inf)
        lost += int(np.count_nonzero(fin_a & ~fin_b))
        gained += int(np.count_nonzero(~fin_a & fin_b))
        other = ~fin_a & ~fin_b
        if other.any():
            changed += int(np.count_nonzero(other & ~((np.isnan(a64) & np.isnan(b64)) | (a64 == b64))))
        n_bad += int(np.count_nonzero(~fin_a))
        both = fin_a & fin_b
        if both.any():
            x, y = a64[both], b64[both]
            abs_err = max(abs_err, float(np.abs(x - y).max()))
            scale = max(scale, float(np.abs(x).max()))
    return lost, gained, changed, n_bad, abs_err, scale


def _constant(draws: Sequence[np.ndarray]) -> bool:
    """One value at every element of every draw (NaN counts as a value)."""
    first = draws[0].ravel()[:1]
    if first.size == 0:
        return False
    for d in draws:
        flat = d.ravel()
        same = np.array_equal(flat, np.broadcast_to(first, flat.shape), equal_nan=np.issubdtype(flat.dtype, np.floating))
        if not same:
            return False
    return True


def _merge(results: Sequence[VerifyResult]) -> VerifyResult:
    """One result over several draws: the worst errors, NaN/inf counts summed per output."""
    out = VerifyResult(0.0, 0.0)
    mismatch: Dict[Tuple[int, str], List[int]] = {}
    original: Dict[Tuple[int, str], List[int]] = {}
    for r in results:
        out.max_abs, out.max_rel = max(out.max_abs, r.max_abs), max(out.max_rel, r.max_rel)
        for i, name, *counts in r.nonfinite_mismatch:
            acc = mismatch.setdefault((i, name), [0] * len(counts))
            acc[:] = [x + y for x, y in zip(acc, counts)]
        for i, name, *counts in r.nonfinite_original:
            acc = original.setdefault((i, name), [0] * len(counts))
            acc[:] = [x + y for x, y in zip(acc, counts)]
    out.nonfinite_mismatch = [(i, name, *c) for (i, name), c in sorted(mismatch.items())]
    out.nonfinite_original = [(i, name, *c) for (i, name), c in sorted(original.items())]
    out.per_output = [(name, max(r.per_output[i][1] for r in results), max(r.per_output[i][2] for r in results))
                      for i, (name, _, _) in enumerate(results[0].per_output)]
    return out


def verify_plan(original: Any, input_shapes: Mapping[str, Sequence[int]], budget: Any, fused: Any = None,
                spread: bool = True, draws: int = DRAWS) -> bool:
    """verify's memory plan (fusion/engine/memory.py), decided from the inferred shapes before anything
    runs: one executor alive at a time (each freed before the next is bound), the original's outputs
    of every draw kept, the other models' compared as they come.  Returns whether the original's own
    spread is measured too (its run with MXNet's oneDNN backend on, which keeps a reordered copy of
    the weights besides); raises ``OverBudget`` where one run of the original (or of ``fused``:
    without it, taken as the original's size) would not fit."""
    from ..engine.memory import fmt_bytes, model_memory

    sym0, arg0, aux0 = _unpack(original)
    est0 = model_memory(sym0, arg0, aux0, input_shapes, input_dtypes(sym0, arg0, aux0))
    if est0 is None:            # shapes MXNet cannot infer: nothing to plan with, run as usual
        return spread
    est1 = None
    if fused is not None:
        sym1, arg1, aux1 = _unpack(fused)
        est1 = model_memory(sym1, arg1, aux1, {k: v for k, v in input_shapes.items() if k in sym1.list_arguments()},
                            input_dtypes(sym1, arg1, aux1))
    # the original's outputs of every draw, one other model's, and compare()'s float64 copies of a pair
    kept = est0.outputs * (draws + 5) + est0.inputs * draws
    # a fused op's own buffers (a region's arena of the values inside it) are not values of the fused
    # graph: it is taken as the original's size, whose values those are, and its edge copies
    one = max(est0.run(), est0.run() + est1.own_buffers if est1 is not None else 0,
              est1.run() if est1 is not None else 0) + kept
    shapes = ", ".join("%s=%s" % (k, ",".join(map(str, v))) for k, v in input_shapes.items())
    budget.estimates["verify"] = {"one_run": one, "one_run_with_the_backend": est0.run(True) + kept,
                                  "outputs_kept": kept}
    if not budget.allows(one):
        raise budget.refuse("verify", one, "one run of the model at %s, one executor at a time" % shapes)
    if spread and not budget.allows(est0.run(True) + kept):
        budget.note("verify: the original's own spread (a run with MXNet's oneDNN backend on: about %s) not "
                    "measured, over the memory budget of %s" % (fmt_bytes(est0.run(True) + kept),
                                                                fmt_bytes(budget.limit or 0)))
        return False
    return spread


def verify(original: Any, fused: Any, params: Any = None, input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
           *, seed: int = 0, inputs: Optional[Mapping[str, np.ndarray]] = None, spread: bool = True,
           max_memory: Any = None) -> VerifyResult:
    """Bind the original and the fused model on the same inputs and compare every output.

    ``original`` is an ``mx.sym.Symbol`` (its parameters in ``params``: a tuple
    ``(arg_params, aux_params)`` or one dict) or a tuple ``(symbol, arg, aux)``;
    ``fused`` is a :class:`~fusion.api.FusionResult` or such a tuple.  Without
    ``inputs``, two random draws fitted to the inputs' use (``random_inputs``,
    seeds ``seed`` and ``seed + 1``) are compared.

    Outputs that hold the rows of a sorting op (NMS, topk, argsort, sort) are compared as
    sets of rows (``fusion/check/rowsets.py``; ``result.comparison(i)`` says how each output was);
    where that fails and the graphs share NMS nodes, the model is also compared piecewise, cut at
    the NMS inputs (``fusion/check/cuts.py``; ``result.piecewise``), and passes if every piece does;
    with ``spread`` the original is also run with MXNet's oneDNN backend on, and how far its
    own outputs move (``result.spread``) is reported beside the error.

    ``max_memory`` (bytes, a size such as ``"4G"``, or a ``fusion.engine.memory.Budget``; default 60 %
    of the memory available): one executor is alive at a time; where the spread's run would not fit,
    it is left out (``result.memory_notes`` says so); where one run of a model would not fit,
    ``OverBudget`` (a FusionError) says how much it needs, before anything runs.
    """
    from ..engine.memory import collections_of_new_objects

    with collections_of_new_objects():
        return _verify(original, fused, params, input_shapes, seed, inputs, spread, max_memory)


def _verify(original, fused, params, input_shapes, seed, inputs, spread, max_memory) -> VerifyResult:
    from ..engine.memory import budget as make_budget, release
    from .rowsets import align_rows, row_layouts

    sym0, arg0, aux0 = _unpack(original, params)
    sym1, arg1, aux1 = _unpack(fused)
    if inputs is not None:
        draws = [dict(inputs)]
    else:
        draws = [random_inputs(sym0, arg0, input_shapes or {}, seed + k, aux0) for k in range(DRAWS)]
    budget = make_budget(max_memory)
    noted = len(budget.notes)
    spread = verify_plan((sym0, arg0, aux0), {k: v.shape for k, v in draws[0].items()}, budget,
                         (sym1, arg1, aux1), spread, len(draws))
    fused_args = set(sym1.list_arguments())
    names = sym0.list_outputs()
    layouts = row_layouts(sym0, arg0, aux0, {k: v.shape for k, v in draws[0].items()})
    results, positional, spreads, moved, positional_per_output, fused_outs = [], [], [], {}, {}, []
    # one executor at a time, each bound once for every draw and its storage handed back before the next;
    # the original's outputs kept, each other model's compared as it comes and dropped
    refs = _run_or_say(sym0, arg0, aux0, draws, "the original model")
    release()

    def take_fused(d: int, out: List[np.ndarray]) -> None:
        ref = refs[d]
        aligned, moved_now = align_rows(ref, out, layouts)
        results.append(compare(ref, aligned, names))
        fused_outs.append(aligned)          # kept for the float64 judgement (verify_plan counts them)
        if layouts:
            by_place = compare(ref, out, names)
            positional.append(by_place.max_rel)
            for i in layouts:
                positional_per_output[i] = max(positional_per_output.get(i, 0.0), by_place.per_output[i][2])
        for i, n in moved_now.items():
            moved[i] = max(moved.get(i, 0), n)

    _run_or_say(sym1, arg1, aux1, [{k: v for k, v in feed.items() if k in fused_args} for feed in draws],
                "the fused model", take_fused)
    release()
    if spread:
        _original_with_backend(sym0, arg0, aux0, draws, lambda d, own: spreads.append(
            compare(refs[d], align_rows(refs[d], own, layouts)[0], names)))
        release()
    result = _merge(results)
    result.memory_notes = budget.notes[noted:]
    if not result.ok():
        run64 = _float64_runner(sym0, arg0, aux0, {k: v.shape for k, v in draws[0].items()}, budget)
        _try_piecewise(result, (sym0, arg0, aux0), (sym1, arg1, aux1), draws, names, layouts, run64)
        release()
        if result.rounding is None and not result.nonfinite_mismatch and run64 is not None:
            from .cuts import rounding_check

            result.rounding = rounding_check(sym0, arg0, aux0, draws, refs, fused_outs, result.per_output, names,
                                             layouts, run64, compare) or None
            release()
    del fused_outs
    result.constant = [_label(i, name) for i, name in enumerate(names) if _constant([r[i] for r in refs])]
    result.row_sets, result.moved_rows = dict(layouts), moved
    result.positional_max_rel = max(positional) if positional else None
    result.positional_per_output = positional_per_output
    if spreads and len(spreads) == len(draws):
        merged = _merge(spreads)
        result.spread = merged.max_rel
        result.spread_per_output = [(name, rel) for name, _, rel in merged.per_output]
    return result


def _float64_runner(symbol, arg, aux, shapes, budget) -> Any:
    """``run(symbol', arg, aux, feeds)`` → the outputs of each feed in float64 (None where MXNet cannot
    run them so), for symbols cut from the original ``symbol``; or None where the original is not a
    float32 model or its float64 run would not fit the memory budget (said in ``budget``'s notes)."""
    import mxnet as mx

    from ..engine.memory import fmt_bytes, model_memory
    from ..precision.policy import is_bf16

    for v in list(arg.values()) + list(aux.values()):
        if is_bf16(v.dtype) or np.issubdtype(np.dtype(v.dtype), np.floating) and np.dtype(v.dtype) != np.float32:
            return None          # not a float32 model
    est = model_memory(symbol, arg, aux, shapes, input_dtypes(symbol, arg, aux))
    need = None if est is None else 2 * (est.run() + est.params)
    if need is not None and not budget.allows(need):
        budget.note("verify: the float64 judgement of the values that differ was left out: it needs %s "
                    "(the original in float64)" % fmt_bytes(need))
        return None
    cast: Dict[str, Dict[str, Any]] = {}

    def run(sym, a, u, feeds):
        if not cast:         # the parameters in float64, made once, when first needed
            cast["arg"] = {k: v.astype("float64") if np.dtype(v.dtype) == np.float32 else v for k, v in arg.items()}
            cast["aux"] = {k: v.astype("float64") if np.dtype(v.dtype) == np.float32 else v for k, v in aux.items()}
        feeds = [{k: np.asarray(v, np.float64) if np.asarray(v).dtype == np.float32 else v for k, v in f.items()}
                 for f in feeds]
        try:
            return run_many(sym, cast["arg"], cast["aux"], feeds)
        except (mx.base.MXNetError, FusionError, ValueError, TypeError):
            return None

    return run


def _try_piecewise(result: VerifyResult, original, fused, draws, names, layouts, run64=None) -> None:
    """Where it passes better: the piecewise comparison at the NMS, sort and step inputs replaces the
    errors of ``result`` (the whole comparison's kept in ``result.piecewise``), with its float64
    judgement (``run64``) of the values that still differ."""
    import mxnet as mx

    from .cuts import piecewise_many

    outs, cuts_cmp, cut_names, fields, judged = [], [], None, [], None
    try:
        per_draw = piecewise_many(*original, *fused, draws, names, layouts, run_many, compare, run64=run64)
    except (FusionError, ValueError, KeyError, mx.base.MXNetError):
        return        # a graph MXNet or the cut cannot take: the whole comparison stands
    if per_draw is None:
        return
    for got in per_draw:
        outs.append(got[0])
        cuts_cmp.append(got[1])
        cut_names, fields = got[2], got[3]
        judged = got[4] if len(got) > 4 else None
    out, at_cuts = _merge(outs), _merge(cuts_cmp)
    worst = max(out.max_rel, at_cuts.max_rel)
    if at_cuts.nonfinite_mismatch or out.nonfinite_mismatch or not worst < result.max_rel:
        return
    result.piecewise = {"cuts": cut_names, "whole_max_rel": result.max_rel,
                        "inputs": [(c, f, rel) for (c, f), (_, _, rel) in zip(fields, at_cuts.per_output)],
                        "outputs_max_rel": out.max_rel}
    result.max_abs, result.max_rel = max(out.max_abs, at_cuts.max_abs), worst
    result.per_output = out.per_output
    result.nonfinite_mismatch = out.nonfinite_mismatch
    result.rounding = judged or None


def _backend_aborts(symbol) -> bool:
    """Whether MXNet 1.9.1's oneDNN subgraph backend is known to abort the process (not raise) on
    this graph: a Convolution read by a BatchNorm over another axis than the channels (its conv
    pass folds the BatchNorm without checking the axis; measured: SIGABRT when the executor is
    freed).  Such graphs get no backend-on run, and no spread."""
    import json

    nodes = json.loads(symbol.tojson())["nodes"]
    for n in nodes:
        if n["op"] == "BatchNorm" and str(n.get("attrs", {}).get("axis", "1")) != "1" and n["inputs"] and \
                nodes[n["inputs"][0][0]]["op"] == "Convolution":
            return True
    return False


def _original_with_backend(symbol, arg, aux, feeds, each) -> None:
    """``each(k, outputs)`` of the original on each of ``feeds`` as MXNet's default bind computes them
    (oneDNN subgraph backend on); nothing where MXNet cannot run it so."""
    import mxnet as mx

    from ..native.env import quiet_native_stderr

    if _backend_aborts(symbol):
        return
    try:
        with quiet_native_stderr():            # MXNet's INFO line on binding with the backend
            run_many(symbol, arg, aux, feeds, subgraph=True, each=lambda k, outs: each(k, [as_float32(o) for o in outs]))
    except mx.base.MXNetError:
        return
