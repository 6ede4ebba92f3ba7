"""The checks run on every generated graph, and how their results are judged.

Reference: the original graph bound with MXNet's oneDNN subgraph backend off
(MXNet 1.9.1's backend miscomputes some valid graphs).  Checks, in order:

==================  ===========================================================================
check               what must hold
==================  ===========================================================================
inference           ``fuse(sym, arg, aux, input_shapes, input_dtypes)`` does not raise; the fused
                    graph binds and runs; every output has the original's shape and dtype, its
                    values within tolerance, NaN/±inf at the same positions; Monte-Carlo Dropout and
                    random ops are kept; the outputs keep their names (``list_outputs()``, also
                    after unfuse, a second fuse, in training and in bf16: ``*.output_names``)
second              the fused graph binds and matches the original at the second shape (another
                    batch size, another sequence length where the graph allows)
unfuse              ``unfuse(fused)`` succeeds and matches the original, at both shapes
idempotence         ``fuse(fuse(g))`` does not raise and gives the same graph as ``fuse(g)`` (JSON
                    compared with names replaced by positions)
training            ``fuse(mode="training")``: forward(is_train) + backward with the same head
                    gradients: outputs and the gradient of every input and parameter match; no
                    parameter of the original is missing (frozen) and none is new; the same
                    step at the second shape
subgraph            the fused graph, and ``unfuse`` of it, bound with MXNet's default backend
                    (oneDNN subgraph on) match the reference, wherever the original does under that
                    backend or MXNet's miscomputation of it is the one fusion/engine/workarounds.py guards
                    against (a layer output also handed out while the backend fuses a reader into it)
gluon               the Gluon door: the graph as a ``SymbolBlock`` hybridized with
                    ``backend="fusion"`` (shapes and modes decided by the backend, not the caller)
                    matches the reference at the first shape and then, in the same block, at the
                    second; under ``autograd.record()`` (fused for training) its outputs and every
                    parameter's gradient match the original's
bf16                ``fuse(precision="bf16")`` (inference), and the Gluon door with
                    ``hybridize(backend="fusion", precision="bf16")``: the fused graph binds and
                    runs at both shapes, every output has the original's shape and dtype, NaN/±inf
                    where the original has them, and values within what bfloat16 rounding moves
                    the original by (see below); skipped, and counted, where the CPU has no native
                    bfloat16
==================  ===========================================================================

Tolerance: per output, ``max|fused − ref| ≤ RTOL·max|ref| + ATOL`` over the positions finite
in both (RTOL 1e-4, ATOL 1e-6; gradients 1e-3 and 1e-4: a gradient that is 0 in exact arithmetic,
e.g. of a bias every key shares before a softmax, comes out as rounding noise).  When that fails, the original is
run again on its inputs and parameters perturbed by ~1e-6 relative: positions where the
original itself moves that much (ill-conditioned: exp of large values, division by near-zero,
comparisons of computed values) are allowed ``8×`` the original's own movement; so is the
original's own rounding error, measured against the original run in float64.  A mismatch
explained that way is counted as ``ill_conditioned``, not reported.

bf16 is judged against the float32 original with ``RTOL_BF16·max|ref| + ATOL`` (the project's
bfloat16 tolerance, 2e-2), and where that fails, against ``2×`` the original's own movement when
its parameters, inputs and every value an op produces are moved by up to 2^-8 relative
(bfloat16 rounds by at most 2^-9): a rewrite may round what it computes, but no more than
bfloat16 storage of each value would.  Where ``fuse(precision="bf16")`` had MXNet's AMP convert
the graph first (convolutions), MXNet's AMP run of the original counts as one more such run,
elementwise: the fused graph starts from AMP's, whose own rounding can move an element of an
ill-conditioned graph further than the random runs show (a saturating op after a step that
magnifies rounding by 200×).  So does the original run with its parameters, inputs and every value
an op produces rounded to bfloat16 (``bf16_stored_run``), for every bf16 fuse: it is the rounding a
``fused_region`` under precision="bfloat16" (which AMP does not convert first) follows.

Graphs with random ops (Dropout with mode='always', uniform_like) are compared in shapes and
structure only; Dropout(p>0) makes the training comparison structural only.

Not findings: MXNet refusing the *original* graph (``invalid``: the generator's fault, counted
apart), the original failing at the second shape (that check is skipped), and the original
itself failing or differing under the subgraph backend (MXNet's own bug; counted) -- except where
the difference is the one the guard removes: the graphs fuse and unfuse write must then be right.
"""
from __future__ import annotations

import json
import re
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .case import Case

RTOL, ATOL = 1e-4, 1e-6
RTOL_BF16, BF16_NOISE, BF16_RUNS, BF16_FACTOR = 2e-2, 2.0 ** -8, 4, 2.0
RTOL_GRAD, ATOL_GRAD = 1e-3, 1e-4      # gradients mathematically 0 come out as rounding noise ~1e-6..1e-5
CHECKS = ("inference", "second", "unfuse", "idempotence", "training", "subgraph", "gluon", "bf16")
RANDOM_OPS = re.compile(r"^(_random_|random_|_sample_|sample_|_contrib_.*uniform|.*uniform_like|.*normal_like|_shuffle)")


def _misreads(sym, values) -> bool:
    """Whether MXNet 1.9.1 would not run ``sym`` as its inferred shapes say at these values
    (fusion.engine.facts.misread: a where condition of another shape, read as cond[i // ratio]; a reshape
    to another size), or reads past a tensor: softmax lengths longer than the axis they count.
    No input a fused model must reproduce."""
    from fusion.engine.selfcheck import misread_nodes
    if misread_nodes(sym, values):
        return True
    data = json.loads(sym.tojson())
    nodes = data["nodes"]
    internals = sym.get_internals()
    try:
        _, shapes, _ = internals.infer_shape_partial(**{k: tuple(np.shape(v)) for k, v in values.items()})
    except Exception:
        return False
    by_name = dict(zip(internals.list_outputs(), shapes))
    for n in nodes:
        a = n.get("attrs", {})
        if n["op"] in ("softmax", "log_softmax", "masked_softmax") and str(a.get("use_length", "")).lower() == "true" \
                and len(n["inputs"]) > 1:
            src, ln = nodes[n["inputs"][0][0]], nodes[n["inputs"][1][0]]
            if ln["op"] != "null" or ln["name"] not in values:
                continue
            shape = by_name.get(src["name"] if src["op"] == "null" else "%s_output" % src["name"])
            if not shape:
                continue
            axis = int(a.get("axis", -1))
            if np.size(values[ln["name"]]) and np.max(values[ln["name"]]) > shape[axis]:
                return True
    return False


@dataclass
class Finding:
    check: str          # e.g. "inference.values"
    detail: str

    @property
    def group(self) -> str:
        return self.check.split(".")[0]


def signature(check: str, detail: str) -> str:
    """A failure class: the check and its message with numbers, node names and shapes blurred."""
    lines = detail.splitlines()
    first = lines[0] if lines else ""
    if check in ("training.frozen_param", "training.new_param"):
        names = re.findall(r"[A-Za-z_][\w]*", first.split(":", 1)[-1])
        return "%s | %s" % (check, ", ".join(sorted({re.sub(r"\d+", "#", n) for n in names})))
    if check.endswith(("worker_crash", "timeout", "worker_crash_after_earlier")):
        stage = re.search(r"stage '([^']*)'", first)
        return "%s | in stage %s" % (check, stage.group(1) if stage else "?")
    if check == "idempotence.changed":
        fired = first.split("fired", 1)[-1].split(";")[0]
        door = " (JSON in other spellings)" if "other spellings" in first else ""
        return "%s | second fuse fired %s%s" % (check, "+".join(re.findall(r"'(\w+)'", fired)) or "nothing", door)
    where = (" @ " + lines[1].split(" <- ")[0]) if check.endswith("_error") and len(lines) > 1 else ""
    first = re.sub(r"\[\d\d:\d\d:\d\d\] ", "", first)
    first = re.sub(r"argument\(s\) .* have no value", "argument(s) … have no value", first)
    first = re.sub(r"(MXNetError: )+", "MXNetError: ", first)
    first = re.sub(r"\.\./src/\S+:\d+: (Check failed: retval: )?", "", first)
    first = re.sub(r"^at shapes \{.*?\}: ", "", first)
    first = re.sub(r"(Error in operator|used by) [\w.]+", r"\1 …", first)
    first = re.sub(r"'(?!fused_)[^']*'", "'…'", first)
    first = re.sub(r"\([^()]*\)", "(…)", first)
    first = re.sub(r"\[[^\[\]]*\]", "[…]", first)
    first = re.sub(r"[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?", "#", first)
    first = re.sub(r"\(\+# more\)|, e\.g\..*|: expected .*", "", first)
    first = re.sub(r"max \|Δ\| # at \(…\).*", "values differ", first)
    return "%s | %s%s" % (check, first.strip()[:160], where)


@dataclass
class Outcome:
    """What the oracle concluded about one case."""

    valid: bool = True
    invalid_reason: str = ""
    findings: List[Finding] = field(default_factory=list)
    fired: Dict[str, int] = field(default_factory=dict)        # rule -> matches fused (inference)
    rejected: Dict[str, int] = field(default_factory=dict)     # rule -> candidates rejected (inference)
    fired_training: Dict[str, int] = field(default_factory=dict)
    counters: Dict[str, int] = field(default_factory=dict)     # skips, ill-conditioned, MXNet's own failures
    suppressed: List[Tuple[str, str]] = field(default_factory=list)   # (check, mismatch) judged not a finding
    seconds: float = 0.0

    def count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1


class _Fail(Exception):
    pass


def _first_line(e: BaseException) -> str:
    text = str(e)
    lines = [l for l in text.splitlines() if l.strip()]
    # MXNet errors carry a C++ stack; the line naming the error is the useful one
    for l in lines:
        if "Error" in l and ("Check failed" in l or "MXNetError" in l or "Error in operator" in l):
            return (type(e).__name__ + ": " + l.strip())[:400]
    return (type(e).__name__ + ": " + (lines[-1] if lines else "")).strip()[:400]


# ---------------------------------------------------------------------------- running graphs
def _nd(v):
    import mxnet as mx

    if isinstance(v, mx.nd.NDArray):
        return v.copy()
    return mx.nd.array(v, dtype=v.dtype)


COMPARISONS = {"broadcast_lesser", "broadcast_lesser_equal", "broadcast_greater", "broadcast_greater_equal",
               "broadcast_equal", "broadcast_not_equal", "_lesser", "_lesser_equal", "_greater", "_greater_equal",
               "_equal", "_not_equal", "_lesser_scalar", "_lesser_equal_scalar", "_greater_scalar",
               "_greater_equal_scalar", "_equal_scalar", "_not_equal_scalar"}
_NUDGE = [0.0]      # forward(): operands of comparisons scaled by 1 ± this (0: not at all)


def _rewritten(sym, replace):
    """``sym`` with each node passed through ``replace(node, inputs, add)``: ``inputs`` are the node's
    inputs in the new graph, ``add(op, name, inputs, **attrs)`` appends a node and returns its entry;
    ``replace`` returns the node to put in its place (it keeps the name, so outputs keep theirs)."""
    import mxnet as mx

    data = json.loads(sym.tojson())
    remap, out = {}, []

    def add(op, name, inputs, **attrs):
        out.append({"op": op, "name": name, "inputs": inputs, **({"attrs": attrs} if attrs else {})})
        return [len(out) - 1, 0, 0]

    for i, n in enumerate(data["nodes"]):
        ins = [[remap[e[0]], e[1], e[2] if len(e) > 2 else 0] for e in n.get("inputs", [])]
        out.append(replace(dict(n), ins, add))
        remap[i] = len(out) - 1
    data["nodes"] = out
    data["arg_nodes"] = [k for k, n in enumerate(out) if n["op"] == "null"]
    data["heads"] = [[remap[h[0]], h[1], h[2] if len(h) > 2 else 0] for h in data["heads"]]
    data.pop("node_row_ptr", None)
    return mx.sym.load_json(json.dumps(data))


def _nudged(sym, rel: float):
    """``sym`` with the first operand of every comparison scaled by ``1 + rel``, the second by
    ``1 - rel``: a comparison of two values equal within rounding (x <= gelu(x) where erf
    saturates) flips under a change of one ulp."""
    def replace(n, ins, add):
        if n["op"] in COMPARISONS:
            ins = [add("_mul_scalar", "%s_nudge%d" % (n["name"], k), [e], scalar=repr(1.0 + (rel if k == 0 else -rel)))
                   for k, e in enumerate(ins)]
        n["inputs"] = ins
        return n
    return _rewritten(sym, replace)


EQUALITIES = {"broadcast_equal": True, "_equal": True, "_equal_scalar": True,
              "broadcast_not_equal": False, "_not_equal": False, "_not_equal_scalar": False}
_SNAP = [0.0]       # forward(): equality comparisons hold within this relative distance (0: exactly)


def _snapped(sym, rel: float):
    """``sym`` with every equality comparison deciding "equal" within ``rel`` of the larger
    operand: ``eq(gelu(y), y)`` where one order of the arithmetic gives y exactly and MXNet's
    oneDNN kernel gives it one ulp lower.  Nudging the operands (``_nudged``) makes equal values
    unequal; this makes values one rounding apart equal."""
    def replace(n, ins, add):
        equal = EQUALITIES.get(n["op"])
        if equal is None:
            n["inputs"] = ins
            return n
        base = n["name"] + "_snap"
        if n["op"].endswith("_scalar"):
            scalar = float(n.get("attrs", {}).get("scalar", "0"))
            dist = add("abs", base + "_dist", [add("_minus_scalar", base + "_d", [ins[0]], scalar=repr(scalar))])
            size = add("_maximum_scalar", base + "_size", [add("abs", base + "_a", [ins[0]])], scalar=repr(abs(scalar)))
        else:
            dist = add("abs", base + "_dist", [add("broadcast_sub", base + "_d", ins[:2])])
            size = add("broadcast_maximum", base + "_size",
                       [add("abs", base + "_a", [ins[0]]), add("abs", base + "_b", [ins[1]])])
        limit = add("_mul_scalar", base + "_limit", [size], scalar=repr(rel))
        return {"op": "broadcast_lesser_equal" if equal else "broadcast_greater", "name": n["name"],
                "inputs": [dist, limit]}
    return _rewritten(sym, replace)


# Inputs that are read as whole numbers or positions (an index, a length, a dtype cast to an
# integer): rounding noise there would change which element is read, not the rounding.
INDEX_INPUTS = {"Embedding": (0,), "take": (1,), "pick": (1,), "batch_take": (1,), "one_hot": (0,),
                "gather_nd": (1,), "scatter_nd": (1,), "SequenceMask": (1,), "SequenceLast": (1,),
                "SequenceReverse": (1,), "softmax": (1,), "log_softmax": (1,), "masked_softmax": (1,),
                "_contrib_index_copy": (1,), "_contrib_index_array": (0,)}
_NOISE: List[Optional[tuple]] = [None]   # forward(): (rel, seed) — rounding noise at every op output
_STORED_BF16 = [False]     # forward(): every op output rounded to bfloat16 (_noised's stored_bf16)
NOISE_RUNS = 12     # at most, and only while a mismatch is left unexplained


def _noised(sym, rel: float, dtypes: Dict[str, Any], stored_bf16: bool = False):
    """``sym`` with every float32 value an op produces multiplied elementwise by a random factor in
    [1 - rel, 1 + rel] (MXNet's uniform sampler: seed it before running): the rounding differences
    any other order of the same arithmetic may have, at every step.  Where the original's result
    moves with them (a division by a sum that cancels to exactly 0 in one order and not in
    another), any rewrite's result is as right as the original's.
    ``stored_bf16``: every such value rounded to bfloat16 (nearest even: ``amp_cast`` there and back)
    instead, as a graph that holds each value in bfloat16 between its steps computes it."""
    import mxnet as mx

    internals = sym.get_internals()
    known = set(sym.list_inputs())
    try:
        _, out_types, _ = internals.infer_type_partial(**{k: t for k, t in dtypes.items() if k in known})
    except mx.base.MXNetError:
        return sym
    float_out = {name for name, t in zip(internals.list_outputs(), out_types or []) if t == np.float32}
    data = json.loads(sym.tojson())
    nodes = data["nodes"]
    index_read = set()
    for n in nodes:
        for k in INDEX_INPUTS.get(n["op"], ()):
            if k < len(n.get("inputs", [])):
                index_read.add(tuple(n["inputs"][k][:2]))
        if n["op"] in ("Cast", "cast", "amp_cast") and "int" in n.get("attrs", {}).get("dtype", ""):
            index_read.update(tuple(e[:2]) for e in n["inputs"])
    out, remap = [], {}          # remap[(old node, output)] = [new node, output]
    for i, n in enumerate(nodes):
        n = dict(n)
        n["inputs"] = [list(remap[(e[0], e[1])]) + [0] for e in n.get("inputs", [])]
        out.append(n)
        k_new = len(out) - 1
        count = len(data["node_row_ptr"]) and (data["node_row_ptr"][i + 1] - data["node_row_ptr"][i]) \
            if "node_row_ptr" in data else 1
        for k in range(count):
            remap[(i, k)] = (k_new, k)
            label = n["name"] + ("_output" if count == 1 else "_output%d" % k)
            if n["op"] == "null" or (i, k) in index_read or label not in float_out:
                continue
            if stored_bf16:
                out.append({"op": "amp_cast", "name": "%s_bf16_%d" % (n["name"], k), "attrs": {"dtype": "bfloat16"},
                            "inputs": [[k_new, k, 0]]})
                out.append({"op": "amp_cast", "name": "%s_stored%d" % (n["name"], k), "attrs": {"dtype": "float32"},
                            "inputs": [[len(out) - 1, 0, 0]]})
                remap[(i, k)] = (len(out) - 1, 0)
                continue
            out.append({"op": "_random_uniform_like", "name": "%s_noise%d" % (n["name"], k),
                        "attrs": {"low": repr(1.0 - rel), "high": repr(1.0 + rel)}, "inputs": [[k_new, k, 0]]})
            out.append({"op": "elemwise_mul", "name": "%s_noised%d" % (n["name"], k),
                        "inputs": [[k_new, k, 0], [len(out) - 1, 0, 0]]})
            remap[(i, k)] = (len(out) - 1, 0)
    data["nodes"] = out
    data["arg_nodes"] = [k for k, n in enumerate(out) if n["op"] == "null"]
    data["heads"] = [list(remap[(h[0], h[1])]) + [0] for h in data["heads"]]
    data.pop("node_row_ptr", None)
    return mx.sym.load_json(json.dumps(data))


def _rounding_runs(sym, arg: Dict, aux: Dict, inputs: Dict):
    """``sym`` as the current run wants it: comparisons nudged (_NUDGE), equalities within rounding
    (_SNAP), rounding noise (_NOISE)."""
    import mxnet as mx

    if _NUDGE[0]:
        sym = _nudged(sym, _NUDGE[0])
    if _SNAP[0]:
        sym = _snapped(sym, _SNAP[0])
    if _NOISE[0] is not None or _STORED_BF16[0]:
        dtypes = {k: np.asarray(v.asnumpy() if hasattr(v, "asnumpy") else v).dtype
                  for k, v in {**arg, **aux, **inputs}.items()}
        if _STORED_BF16[0]:
            sym = _noised(sym, 0.0, dtypes, stored_bf16=True)
        else:
            rel, seed = _NOISE[0]
            sym = _noised(sym, rel, dtypes)
            mx.random.seed(seed)
    return sym


def _rounded_bf16(values: Dict) -> Dict:
    """float32 arrays rounded to bfloat16 (nearest even; kept float32); others as they are."""
    from fusion.precision.policy import from_bf16, to_bf16

    out = {}
    for k, v in (values or {}).items():
        a = v.asnumpy() if hasattr(v, "asnumpy") else np.asarray(v)
        out[k] = from_bf16(to_bf16(a)).reshape(a.shape) if a.dtype == np.float32 else a
    return out


def bf16_stored_run(sym, arg: Dict, aux: Dict, inputs: Dict) -> List[np.ndarray]:
    """The original run with its parameters, inputs and every float32 value an op produces rounded
    to bfloat16: the arithmetic of a graph that stores each value in bfloat16 (float32 inside each
    op), as MXNet's AMP graph and a ``fused_region`` under precision="bfloat16" do."""
    _STORED_BF16[0] = True
    try:
        return forward(sym, _rounded_bf16(arg), _rounded_bf16(aux), _rounded_bf16(inputs))
    finally:
        _STORED_BF16[0] = False


# Ops whose result grows without bound as the operand at these input slots nears a point
# (a divisor or a log's argument near 0): rounding noise there is magnified without limit.
SINGULAR_INPUTS = {"broadcast_div": (1,), "elemwise_div": (1,), "_div": (1,), "_rdiv_scalar": (0,),
                   "sqrt": (0,), "rsqrt": (0,), "cbrt": (0,), "rcbrt": (0,), "reciprocal": (0,),
                   "log": (0,), "log2": (0,), "log10": (0,), "log1p": (0,), "_power_scalar": (0,),
                   "_rpower_scalar": (0,), "broadcast_power": (0, 1), "_power": (0, 1)}


NEAR_OVERFLOW = 2.0 ** 120       # finite values this large overflow under a rescaling by 2^8


def _noise_dominated(sym, arg: Dict, aux: Dict, inputs: Dict[str, np.ndarray], rel: float = 2.0 ** -20) -> set:
    """Indices of ``sym``'s outputs that depend on a value no order of the arithmetic pins down:
    one rounding noise moves by its whole size (a sum that cancels to noise: its sign, or whether
    it is 0, is an accident of the order) where an op singular at 0 reads it (a division by it,
    its square root); or one within 2^8 of overflowing (MXNet's max pooling of NaN gives
    -FLT_MAX), where folding a scale into a weight overflows before or after the sum.  Any order
    of the same arithmetic may give any of those outputs: the original's value is one sample
    among them, and the perturbed reruns, which later ops can damp, do not show it.  ``rel``: the
    size of the rounding noise (bfloat16's for the bf16 check)."""
    import mxnet as mx

    data = json.loads(sym.tojson())
    nodes = data["nodes"]
    internals = sym.get_internals()
    labels = set(internals.list_outputs())
    values = {}         # label of an op's (only) output -> its node
    for i, n in enumerate(nodes):
        if n["op"] != "null" and n["name"] + "_output" in labels:
            values[n["name"] + "_output"] = i
    singular = set()    # labels of values read at a singular slot
    for n in nodes:
        for k in SINGULAR_INPUTS.get(n["op"], ()):
            if k < len(n["inputs"]):
                label = nodes[n["inputs"][k][0]]["name"] + "_output"
                if label in values:
                    singular.add(label)
    order = sorted(values)
    if not order:
        return set()
    group = internals[order[0]] if len(order) == 1 else mx.sym.Group([internals[l] for l in order])
    moved = set()
    try:
        ref = forward(group, arg, aux, inputs)
        for label, a in zip(order, ref):
            a = a.astype(np.float64)
            if (np.isfinite(a) & (np.abs(a) >= NEAR_OVERFLOW)).any():
                moved.add(values[label])
        for seed in (7, 8, 9) if singular else ():
            _NOISE[0] = (rel, seed)
            try:
                got = forward(group, arg, aux, inputs)
            finally:
                _NOISE[0] = None
            for label, a, b in zip(order, ref, got):
                if label not in singular:
                    continue
                a, b = a.astype(np.float64), b.astype(np.float64)
                with np.errstate(invalid="ignore"):
                    if ((np.isfinite(a) != np.isfinite(b)) | (np.abs(b - a) >= np.abs(a))).any():
                        moved.add(values[label])
    except Exception:
        return set()
    # outputs reached from a moved value
    reach = set(moved)
    for i, n in enumerate(nodes):
        if any(e[0] in reach for e in n["inputs"]):
            reach.add(i)
    return {k for k, h in enumerate(data["heads"]) if h[0] in reach}


def as_read(sym, arg: Dict, aux: Dict) -> Tuple[Dict, Dict]:
    """The fused model's params split as the un-fused ``sym`` reads them: a fused op's inputs are
    arguments, and its stock ops may read some as auxiliary states (a fused_region's BatchNorm
    statistics)."""
    aux_names = set(sym.list_auxiliary_states())
    params = {**arg, **aux}
    return ({k: v for k, v in params.items() if k not in aux_names},
            {k: v for k, v in params.items() if k in aux_names})


def forward(sym, arg: Dict, aux: Dict, inputs: Dict[str, np.ndarray], subgraph: bool = False) -> List[np.ndarray]:
    """Inference outputs of ``sym`` (parameters and inputs by name), as NumPy arrays."""
    import mxnet as mx
    from fusion.native.env import subgraph_backend

    sym = _rounding_runs(sym, arg, aux, inputs)

    names = sym.list_arguments()
    vals = {**arg, **inputs}
    missing = [n for n in names if n not in vals]
    if missing:
        was_aux = [n for n in missing if n in aux]
        raise _Fail("the graph's argument(s) %s have no value in its arg_params%s" % (
            ", ".join(missing), " (given as auxiliary states: %s)" % ", ".join(was_aux) if was_aux else ""))
    args = {n: _nd(vals[n]) for n in names}
    auxs = {n: _nd(aux[n]) for n in sym.list_auxiliary_states()}
    with subgraph_backend(subgraph):
        exe = sym.bind(mx.cpu(), args, aux_states=auxs, grad_req="null")
    outs = exe.forward(is_train=False)
    return [o.asnumpy() for o in outs]


def train_step(sym, arg: Dict, aux: Dict, inputs: Dict[str, np.ndarray], seed: int):
    """forward(is_train=True) + backward with seeded head gradients: (outputs, {argument: gradient})."""
    import mxnet as mx
    from fusion.native.env import subgraph_backend

    sym = _rounding_runs(sym, arg, aux, inputs)

    names = sym.list_arguments()
    vals = {**arg, **inputs}
    args = {n: _nd(vals[n]) for n in names}
    grads, req = {}, {}
    for n in names:
        if np.issubdtype(np.dtype(args[n].dtype), np.floating):
            grads[n] = mx.nd.zeros(args[n].shape, dtype=args[n].dtype)
            req[n] = "write"
        else:
            req[n] = "null"
    auxs = {n: _nd(aux[n]) for n in sym.list_auxiliary_states()}
    with subgraph_backend(False):
        exe = sym.bind(mx.cpu(), args, args_grad=grads, grad_req=req, aux_states=auxs)
    outs = exe.forward(is_train=True)
    rng = np.random.RandomState(seed)
    heads = [mx.nd.array(rng.standard_normal(o.shape), dtype=o.dtype) for o in outs]
    # the outputs are read before the backward: MXNet's BatchNorm backward updates its moving
    # statistics (auxiliary states) without declaring the write, so an output that is such a
    # state read after it races with the update (either value can come back)
    values = [o.asnumpy() for o in outs]
    exe.backward(heads)
    return values, {n: g.asnumpy() for n, g in grads.items()}


def gluon_runs(sym, arg: Dict, aux: Dict, inputs: Sequence[Dict[str, np.ndarray]], backend: Optional[str],
               train_seed: Optional[int] = None, **backend_opts):
    """``sym`` as a Gluon ``SymbolBlock`` (data inputs in the order of ``inputs[0]``) hybridized with
    ``backend`` (None: plain), called once per entry of ``inputs`` in the same block.  Inference:
    a list of output lists.  With ``train_seed``: one call under ``autograd.record()``, backward
    with ``train_step``'s head gradients; returns (outputs, {parameter: gradient})."""
    import mxnet as mx
    from fusion.native.env import subgraph_backend

    names = list(inputs[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block = mx.gluon.SymbolBlock(sym, [mx.sym.var(n) for n in names])
    values = {**arg, **aux}
    for pname, prm in block.collect_params().items():
        v = values[prm.name]
        prm._dtype = v.dtype
        prm.shape = v.shape
        if not np.issubdtype(v.dtype, np.floating):
            prm.grad_req = "null"
        prm.initialize(init=mx.init.Constant(0), ctx=mx.cpu(), force_reinit=True)
        prm.set_data(mx.nd.array(v, dtype=v.dtype))
    with subgraph_backend(False):
        if backend:
            block.hybridize(backend=backend, **backend_opts)
        else:
            block.hybridize()
        if train_seed is None:
            outs = []
            for x in inputs:
                got = block(*[mx.nd.array(x[n], dtype=x[n].dtype) for n in names])
                got = got if isinstance(got, (list, tuple)) else [got]
                outs.append([o.asnumpy() for o in got])
            return outs
        xs = [mx.nd.array(inputs[0][n], dtype=inputs[0][n].dtype) for n in names]
        for x in xs:        # every output then is in the recorded graph, and inputs get gradients too
            if np.issubdtype(np.dtype(x.dtype), np.floating):
                x.attach_grad()
        with mx.autograd.record(train_mode=True):
            got = block(*xs)
        got = list(got) if isinstance(got, (list, tuple)) else [got]
        values = [o.asnumpy() for o in got]        # before the backward, as in train_step
        rng = np.random.RandomState(train_seed)
        heads = [mx.nd.array(rng.standard_normal(o.shape), dtype=o.dtype) for o in got]
        mx.autograd.backward(got, heads)
        grads = {prm.name: prm.grad().asnumpy() for prm in block.collect_params().values() if prm.grad_req != "null"}
        grads.update({n: x.grad.asnumpy() for n, x in zip(names, xs) if x.grad is not None})
        return values, grads


def perturbed(values: Dict[str, np.ndarray], seed: Optional[int], rel: float = 2.0 ** -20) -> Dict[str, np.ndarray]:
    """Float values moved by ~``rel`` relative (integers, 0/1 masks and non-finite values unchanged).

    ``seed`` None: the values as they are (a plain rerun); ``"f64"``: float32 values as float64
    (the original run in double precision: a reference for its own rounding error).
    """
    if seed is None:
        return dict(values)
    if seed == "f64":
        out = {}
        for k, v in values.items():
            v = v.asnumpy() if hasattr(v, "asnumpy") else np.asarray(v)
            out[k] = v.astype(np.float64) if v.dtype == np.float32 else v
        return out
    rng = np.random.RandomState(seed)
    out = {}
    for k, v in values.items():
        v = v.asnumpy() if hasattr(v, "asnumpy") else np.asarray(v)
        if np.issubdtype(v.dtype, np.floating) and v.size and not np.all(np.isin(v, (0.0, 1.0))):
            p = v * (1 + rel * rng.uniform(-1, 1, v.shape))
            out[k] = np.where(np.isfinite(v), p, v).astype(v.dtype)
        else:
            out[k] = v
    return out


# ---------------------------------------------------------------------------- comparing
def mismatch(ref: np.ndarray, got: np.ndarray, rtol: float, dev: Optional[np.ndarray] = None,
             atol: float = ATOL, wild: Optional[np.ndarray] = None, dev_factor: float = 8.0) -> Optional[str]:
    """Why ``got`` is not ``ref`` within tolerance (None when it is); ``dev``: the original's own
    movement, of which ``dev_factor`` times is allowed besides."""
    if ref.shape != got.shape:
        return "shape %s, expected %s" % (got.shape, ref.shape)
    if ref.dtype != got.dtype:
        return "dtype %s, expected %s" % (got.dtype, ref.dtype)
    if ref.size == 0:
        return None
    a, b = ref.astype(np.float64), got.astype(np.float64)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    inf_a, inf_b = np.isinf(a), np.isinf(b)
    bad_pos = (nan_a != nan_b) | (inf_a != inf_b) | (inf_a & inf_b & (np.sign(a) != np.sign(b)))
    if dev is not None:
        bad_pos &= ~np.isnan(dev)          # the original itself changes finiteness there
    if wild is not None:
        # where the original's own runs move it by half its size (a division by rounding noise),
        # its value says nothing: any value, an infinite one too, is as right
        bad_pos &= ~wild
        b = np.where(wild, a, b)
    if bad_pos.any():
        i = np.unravel_index(np.argmax(bad_pos), a.shape)
        return "NaN/inf at %d position(s) differ, e.g. %s: expected %r, got %r" % (
            int(bad_pos.sum()), tuple(int(t) for t in i), float(a[i]), float(b[i]))
    fin = np.isfinite(a) & np.isfinite(b)
    if not fin.any():
        return None
    scale = float(np.abs(a[fin]).max())
    err = np.where(fin, np.abs(a - b), 0.0)
    allowed = rtol * scale + atol
    if dev is not None:
        allowed = allowed + dev_factor * np.where(np.isnan(dev), np.inf, dev)
    over = err > allowed
    if over.any():
        i = np.unravel_index(np.argmax(np.where(over, err, -1)), a.shape)
        return "max |Δ| %.3g at %s (expected %.6g, got %.6g; output scale %.3g, tolerance %.2g)" % (
            float(err[i]), tuple(int(t) for t in i), float(a[i]), float(b[i]), scale,
            float(np.broadcast_to(allowed, a.shape)[i]))
    return None


def _wild(ref: np.ndarray, others: Sequence[np.ndarray]) -> np.ndarray:
    """Finite values of the original that one of its own runs (perturbed, float64) moves by half
    their size or more, elementwise."""
    a = ref.astype(np.float64)
    out = np.zeros(a.shape, bool)
    for o in others:
        o = o.astype(np.float64)
        if o.shape != a.shape:
            continue
        with np.errstate(invalid="ignore"):
            out |= np.isfinite(a) & (a != 0) & (~np.isfinite(o) | (np.abs(o - a) >= 0.5 * np.abs(a)))
    return out


def _movement(ref: np.ndarray, others: Sequence[np.ndarray]) -> np.ndarray:
    """How far the original itself is from its runs on perturbed inputs and in float64 (NaN where
    finiteness changes): elementwise, plus a quarter of the largest movement anywhere (rounding
    noise amplified by an ill-conditioned step lands on different elements in different runs)."""
    a = ref.astype(np.float64)
    dev = np.zeros(a.shape)
    for o in others:
        o = o.astype(np.float64)
        if o.shape != a.shape:
            continue
        flip = np.isfinite(a) != np.isfinite(o)
        d = np.where(np.isfinite(a) & np.isfinite(o), np.abs(a - o), 0.0)
        dev = np.maximum(dev, d)
        dev = np.where(flip, np.nan, dev)
    # the spread is taken where the value means something: not where a run moves it by half its
    # size or more (_wild: compared as anything), which would let any error pass everywhere
    finite = dev[np.isfinite(dev) & ~_wild(ref, others)]
    return dev + (0.25 * float(finite.max()) if finite.size else 0.0)


def canonical(sym_or_json) -> str:
    """Graph JSON with node names replaced by positions (variables keep theirs: they are the interface)."""
    data = json.loads(sym_or_json if isinstance(sym_or_json, str) else sym_or_json.tojson())
    nodes = []
    for i, n in enumerate(data["nodes"]):
        nodes.append({"op": n["op"], "name": n["name"] if n["op"] == "null" else i,
                      "attrs": {k: v for k, v in sorted(n.get("attrs", {}).items()) if not k.startswith("__")},
                      "inputs": [e[:2] for e in n.get("inputs", [])]})
    return json.dumps({"nodes": nodes, "heads": [e[:2] for e in data["heads"]]}, sort_keys=True)


def op_counts(sym) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for n in json.loads(sym.tojson())["nodes"]:
        if n["op"] != "null":
            out[n["op"]] = out.get(n["op"], 0) + 1
    return out


def _random_ops(sym) -> List[str]:
    """Ops that sample: Dropout(p>0, mode='always') at inference and random ops."""
    out = []
    for n in json.loads(sym.tojson())["nodes"]:
        a = n.get("attrs", {})
        if n["op"] == "Dropout" and a.get("mode") == "always" and float(a.get("p", 0.5)) > 0:
            out.append("Dropout(always)")
        elif RANDOM_OPS.match(n["op"]):
            out.append(n["op"])
    return sorted(out)


def _ungraded_heads(sym, values: Dict[str, np.ndarray]) -> bool:
    """Whether an output of ``sym`` is one of its inputs (a variable passed through), or reads no
    floating-point variable (``values``: every variable's value), so has no gradient to record."""
    data = json.loads(sym.tojson())
    nodes = data["nodes"]
    graded: Dict[int, bool] = {}
    for i, n in enumerate(nodes):       # nodes are in topological order
        if n["op"] == "null":
            v = values.get(n["name"])
            graded[i] = v is not None and np.issubdtype(np.asarray(v).dtype, np.floating)
        else:
            graded[i] = any(graded[e[0]] for e in n["inputs"])
    return any(nodes[h[0]]["op"] == "null" or not graded[h[0]] for h in data["heads"])


def _training_dropouts(sym) -> int:
    return sum(1 for n in json.loads(sym.tojson())["nodes"]
               if n["op"] == "Dropout" and float(n.get("attrs", {}).get("p", 0.5)) > 0)


# ---------------------------------------------------------------------------- the oracle
class Oracle:
    """Runs the checks of one case.  ``stage(name)`` is called before each step (for crash reports)."""

    def __init__(self, case: Case, stage: Callable[[str], None] = lambda s: None,
                 only: Optional[Sequence[str]] = None):
        self.case = case
        self.stage = stage
        self.only = set(only) if only else None
        self.out = Outcome()

    # -- helpers ---------------------------------------------------------------
    def _wanted(self, check: str) -> bool:
        return self.only is None or check in self.only

    def _find(self, check: str, detail: str) -> None:
        self.out.findings.append(Finding(check, detail))

    def without_regions(self) -> bool:
        """Fused without regions: the graph says so (its family exercises the block rules), or it reads
        NaN -- fused_region's contract does not promise MXNet's per-op NaN rules (oneDNN's relu and clip
        give numbers where MXNet's relu and clip ops keep NaN), which this oracle holds every other op to."""
        return bool({"no_regions", "nan"} & self.case.flags)

    def fuse_kwargs(self) -> Dict[str, Any]:
        c = self.case
        kw: Dict[str, Any] = {"rules": ["default", "-region"]} if self.without_regions() else {}
        if "no_shapes" in c.flags:
            return kw
        return dict(kw, input_shapes=c.shapes(), input_dtypes=c.dtypes())

    def door_opts(self) -> Dict[str, Any]:
        """The Gluon door's options to match ``fuse_kwargs``'s rules."""
        return {"rules": "default,-region"} if self.without_regions() else {}

    def _fuse(self, mode: str, symbol=None, arg=None, aux=None, **extra):
        import fusion

        c = self.case
        src = symbol if symbol is not None else (c.json_text if c.json_text is not None else c.symbol)
        given = (_nds(c.arg) if arg is None else arg, _nds(c.aux) if aux is None else aux)
        res = fusion.fuse(src, given[0], given[1], mode=mode, **self.fuse_kwargs(), **extra)
        self._names(("bf16" if extra.get("precision") else mode) + ("" if symbol is None else ".again"),
                    (symbol if symbol is not None else c.symbol).list_outputs(), res.symbol.list_outputs(),
                    res.report.notes)
        if arg is None:          # the caller's arrays stay as they were
            for store, ref in ((given[0], c.arg), (given[1], c.aux)):
                changed = [k for k, v in store.items() if not np.array_equal(v.asnumpy(), ref[k], equal_nan=True)]
                if changed:
                    self._find("%s.mutated_params" % (extra.get("precision") and "bf16" or mode),
                               "fuse() changed the caller's arrays: %s" % ", ".join(sorted(changed)))
        return res

    def _names(self, check: str, want: List[str], got: List[str], notes: Sequence[str] = ()) -> None:
        """The result's outputs are named as the model's (code reads them by name), or the report
        says which are not (a parameter handed out as an output that AMP holds in bfloat16 now:
        no node can be named as it), counted as ``output_names_reported``."""
        if got != want:
            diff = ["%s -> %s" % (a, b) for a, b in zip(want, got) if a != b] or ["%d outputs, expected %d" % (
                len(got), len(want))]
            said = [n for n in notes if "output name(s) changed" in n]
            if len(got) == len(want) and said and all(any(d in n for n in said) for d in diff):
                self.out.count("output_names_reported")
                return
            self._find(check + ".output_names", "output names changed: %s" % ", ".join(diff[:3]))

    def _compare(self, check: str, ref: List[np.ndarray], got: List[np.ndarray], rtol: float,
                 rerun: Optional[Callable[[int], List[np.ndarray]]], names: Sequence[str], atol: float = ATOL,
                 inputs: Optional[Dict[str, np.ndarray]] = None, grads: bool = False) -> None:
        """Compare output lists; on a mismatch ask ``rerun(seed)`` (the original, perturbed) whether it is
        conditioning.  ``inputs``: the original's inputs for these outputs (its values inside are
        examined when reruns leave a mismatch; see _noise_dominated).  ``grads``: the lists are
        gradients, which every output's head gradient reaches: any output that rounding noise decides
        makes them all undecided."""
        if len(ref) != len(got):
            self._find(check + ".outputs", "%d outputs, expected %d" % (len(got), len(ref)))
            return
        bad = [(i, mismatch(a, b, rtol, atol=atol)) for i, (a, b) in enumerate(zip(ref, got))]
        bad = [(i, m) for i, m in bad if m]
        if not bad:
            return
        if rerun is not None and not any(m.startswith(("shape", "dtype")) for _, m in bad):
            try:
                again = rerun(None)
                if len(again) != len(ref) or any(mismatch(a, b, rtol, atol=atol) for a, b in zip(ref, again)):
                    # the original itself gives another result on the same values: it reads memory it
                    # never wrote (e.g. parameters of the wrong size MXNet does not refuse); no verdict
                    self.out.count("original_nondeterministic")
                    return
                others = [rerun(s) for s in (101, 202)]
                try:
                    exact = rerun("f64")
                except Exception:        # some op has no float64 kernel
                    exact = None
                for rel in (2.0 ** -22, -2.0 ** -22):     # comparisons of values equal within rounding
                    _NUDGE[0] = rel
                    try:
                        others.append(rerun(None))
                    except Exception:
                        pass
                    finally:
                        _NUDGE[0] = 0.0
                _SNAP[0] = 2.0 ** -20               # equalities of values one rounding apart
                try:
                    others.append(rerun(None))
                except Exception:
                    pass
                finally:
                    _SNAP[0] = 0.0

                def unexplained():
                    out = []
                    for i, m in bad:
                        runs = [o[i] for o in others] + ([exact[i]] if exact is not None else [])
                        dev = _movement(ref[i], runs)
                        m2 = mismatch(ref[i], got[i], rtol, dev, atol, _wild(ref[i], runs))
                        if m2:
                            out.append((i, m2))
                    return out

                still = unexplained()
                # rounding differences at every step: where a value's sign is rounding noise (a sum
                # that cancels), each run flips it at random, so runs go on while they explain more
                for seed in range(7, 7 + NOISE_RUNS):
                    if not still:
                        break
                    _NOISE[0] = (2.0 ** -20, seed)
                    try:
                        others.append(rerun(None))
                    except Exception:
                        break
                    finally:
                        _NOISE[0] = None
                    still = unexplained()
                if still and inputs is not None:
                    dominated = _noise_dominated(self.sym0, self.case.arg, self.case.aux, inputs)
                    if grads:       # every gradient is reached from every output
                        still = [] if dominated else still
                    else:
                        still = [(i, m) for i, m in still if i not in dominated]
                if not still:
                    self.out.count("ill_conditioned")
                    self.out.suppressed.append((check, bad[0][1]))
                    return
                bad = still
            except Exception:        # the perturbed original did not run: judge as it is
                pass
        i, m = bad[0]
        kind = "shape" if m.startswith(("shape", "dtype")) else ("nan" if m.startswith("NaN") else "values")
        more = " (+%d more)" % (len(bad) - 1) if len(bad) > 1 else ""
        self._find("%s.%s" % (check, kind), "%s '%s': %s%s" % ("gradient" if check.endswith(".grad") else "output",
                                                                 names[i], m, more))

    # -- the run ---------------------------------------------------------------
    def run(self) -> Outcome:
        import time

        t0 = time.perf_counter()
        try:
            self._run()
        finally:
            self.out.seconds = time.perf_counter() - t0
        return self.out

    def _run(self) -> None:
        import mxnet as mx

        c = self.case
        sym0 = mx.sym.load_json(c.json_text) if c.json_text is not None else c.symbol
        self.sym0 = sym0
        names = sym0.list_outputs()
        x1 = c.inputs()
        self.stage("original")
        try:
            if _misreads(sym0, {**c.arg, **c.aux, **x1}):
                raise ValueError("MXNet misreads the original at these values (e.g. softmax lengths past "
                                 "the axis: it reads past the row)")
            ref = forward(sym0, c.arg, c.aux, x1)
        except Exception as e:
            self.out.valid = False
            self.out.invalid_reason = _first_line(e)
            return
        random = bool(_random_ops(sym0))
        x2 = ref2 = None
        if c.has_second and any(self._wanted(k) for k in ("second", "unfuse", "gluon", "training", "bf16")):
            self.stage("original.second")
            x2 = c.inputs(second=True)
            try:
                if _misreads(sym0, {**c.arg, **c.aux, **x2}):
                    raise ValueError("MXNet misreads the original at the second shape")
                ref2 = forward(sym0, c.arg, c.aux, x2)
            except Exception:
                self.out.count("second_shape_invalid")
                x2 = None
        ref_rerun = (lambda s: forward(sym0, perturbed(c.arg, s), _p(c.aux, s, 1), _p(x1, s, 2))) \
            if not random else None

        res = None
        if any(self._wanted(k) for k in ("inference", "second", "unfuse", "idempotence", "subgraph")):
            self.stage("fuse")
            try:
                res = self._fuse("inference")
            except Exception as e:
                self._find("inference.fuse_error", _first_line(e) + "\n" + _short_tb(e))
            if res is not None:
                for name, r in res.report.rules.items():
                    if r.fused:
                        self.out.fired[name] = self.out.fired.get(name, 0) + len(r.fused)
                    if r.rejected:
                        self.out.rejected[name] = self.out.rejected.get(name, 0) + len(r.rejected)
        fused_ok = False
        if res is not None and self._wanted("inference"):
            self.stage("fused")
            fx = {k: v for k, v in x1.items()}
            try:
                got = forward(res.symbol, res.arg_params, res.aux_params, fx)
                fused_ok = True
            except Exception as e:
                self._find("inference.bind", _first_line(e))
            if fused_ok:
                if random:
                    self._compare_shapes("inference", ref, got, names)
                    lost = _lost(_random_ops(sym0), _random_ops(res.symbol))
                    if lost:
                        self._find("inference.random_removed", "the fused graph lost %s" % ", ".join(lost))
                else:
                    self._compare("inference", ref, got, RTOL, ref_rerun, names, inputs=x1)
        if res is not None and x2 is not None and self._wanted("second"):
            self.stage("fused.second")
            try:
                got2 = forward(res.symbol, res.arg_params, res.aux_params, x2)
                if random:
                    self._compare_shapes("second", ref2, got2, names)
                else:
                    self._compare("second", ref2, got2, RTOL, lambda s: forward(
                        sym0, perturbed(c.arg, s), _p(c.aux, s, 1), _p(x2, s, 2)), names, inputs=x2)
            except Exception as e:
                self._find("second.bind", "at shapes %s: %s" % (c.shapes(second=True), _first_line(e)))
        unfused = None
        if res is not None and self._wanted("unfuse"):
            unfused = self._unfuse(res, sym0, ref, x1, ref2, x2, names, random, ref_rerun)
        if res is not None and self._wanted("idempotence"):
            self.stage("idempotence")
            try:
                again = self._fuse("inference", res.symbol, res.arg_params, res.aux_params)
                if canonical(again.symbol) != canonical(res.symbol):
                    fired = {k: len(r.fused) for k, r in again.report.rules.items() if r.fused}
                    door = " (graph given as JSON in other spellings)" if c.json_text is not None else ""
                    self._find("idempotence.changed", "fuse(fuse(g)) != fuse(g)%s: the second fuse fired %s; ops %s -> %s"
                               % (door, fired or "nothing", op_counts(res.symbol), op_counts(again.symbol)))
            except Exception as e:
                self._find("idempotence.error", _first_line(e))
        if self._wanted("training") and "no_train" not in c.flags:
            self._training(sym0, x1, names, random, x2)
        if res is not None and self._wanted("subgraph") and "no_subgraph" not in c.flags and not random and fused_ok:
            self._subgraph(sym0, res, ref, x1, names, ref_rerun, unfused)
        if self._wanted("gluon") and not random and x1:
            self._gluon(sym0, ref, x1, ref2, x2, names, ref_rerun)
        if self._wanted("bf16"):
            self._bf16(sym0, ref, x1, ref2, x2, names, random)

    def _compare_shapes(self, check: str, ref, got, names) -> None:
        if len(ref) != len(got):
            self._find(check + ".outputs", "%d outputs, expected %d" % (len(got), len(ref)))
            return
        for n, a, b in zip(names, ref, got):
            if a.shape != b.shape or a.dtype != b.dtype:
                self._find(check + ".shape", "output '%s': %s %s, expected %s %s" % (n, b.shape, b.dtype, a.shape, a.dtype))
                return

    def _unfuse(self, res, sym0, ref, x1, ref2, x2, names, random, ref_rerun):
        """The unfuse check; the unfused symbol (None where unfuse failed), for the subgraph check."""
        import fusion

        c = self.case
        self.stage("unfuse")
        try:
            u = fusion.unfuse(res.symbol, input_shapes=c.shapes(), arg_params=res.arg_params,
                              aux_params=res.aux_params)
        except Exception as e:
            self._find("unfuse.error", _first_line(e))
            return
        self._names("unfuse", sym0.list_outputs(), u.list_outputs())
        left = sorted(op for op in op_counts(u) if op.startswith("fused_"))
        if left:
            self._find("unfuse.left", "fused ops left: %s" % left)
        self.stage("unfuse.run")
        try:
            got = forward(u, *as_read(u, res.arg_params, res.aux_params), x1)
        except Exception as e:
            self._find("unfuse.bind", _first_line(e))
            return None
        if random:
            self._compare_shapes("unfuse", ref, got, names)
        else:
            self._compare("unfuse", ref, got, RTOL, ref_rerun, names, inputs=x1)
        if x2 is not None:
            self.stage("unfuse.second")
            try:
                got2 = forward(u, *as_read(u, res.arg_params, res.aux_params), x2)
            except Exception as e:
                self._find("unfuse.second_bind", _first_line(e))
                return u
            if random:
                self._compare_shapes("unfuse.second", ref2, got2, names)
            else:
                self._compare("unfuse.second", ref2, got2, RTOL, lambda s: forward(
                    sym0, perturbed(c.arg, s), _p(c.aux, s, 1), _p(x2, s, 2)), names, inputs=x2)
        return u

    def _training(self, sym0, x1, names, random, x2=None) -> None:
        c = self.case
        self.stage("training.original")
        try:
            ref_out, ref_grad = train_step(sym0, c.arg, c.aux, x1, seed=5)
        except Exception:
            self.out.count("training_original_fails")      # e.g. an op without a backward
            return
        self.stage("training.fuse")
        try:
            res = self._fuse("training")
        except Exception as e:
            self._find("training.fuse_error", _first_line(e) + "\n" + _short_tb(e))
            return
        for name, r in res.report.rules.items():
            if r.fused:
                self.out.fired_training[name] = self.out.fired_training.get(name, 0) + len(r.fused)
        orig_params = set(c.arg)
        fused_args = set(res.symbol.list_arguments())
        frozen = sorted(orig_params - fused_args)
        if frozen:
            self._find("training.frozen_param", "parameters no longer trained: %s" % ", ".join(frozen))
        new = sorted(fused_args - set(sym0.list_arguments()))
        if new:
            self._find("training.new_param", "new arguments: %s" % ", ".join(new))
        if _training_dropouts(res.symbol) < _training_dropouts(sym0):
            self._find("training.dropout_removed", "Dropout(p>0) removed in mode='training' (%d -> %d)"
                       % (_training_dropouts(sym0), _training_dropouts(res.symbol)))
        self.stage("training.fused")
        arg_f = {k: v for k, v in c.arg.items()}
        arg_f.update({k: (v.asnumpy() if hasattr(v, "asnumpy") else v) for k, v in res.arg_params.items() if k not in arg_f})
        aux_f = {k: v for k, v in c.aux.items()}
        aux_f.update({k: (v.asnumpy() if hasattr(v, "asnumpy") else v) for k, v in res.aux_params.items() if k not in aux_f})
        try:
            out, grad = train_step(res.symbol, arg_f, aux_f, x1, seed=5)
        except Exception as e:
            self._find("training.bind", _first_line(e))
            return
        if random or "random_train" in c.flags or _training_dropouts(sym0):
            self._compare_shapes("training", ref_out, out, names)
            return
        self.out.count("training_checked")
        self._compare_training("training", sym0, x1, names, ref_out, ref_grad, out, grad)
        if x2 is None:
            return
        self.stage("training.second")        # fused at the first shape, trained at the second
        try:
            ref_out2, ref_grad2 = train_step(sym0, c.arg, c.aux, x2, seed=5)
        except Exception:
            self.out.count("training_original_fails_second")
            return
        try:
            out2, grad2 = train_step(res.symbol, arg_f, aux_f, x2, seed=5)
        except Exception as e:
            self._find("training.second_bind", "at shapes %s: %s" % (c.shapes(second=True), _first_line(e)))
            return
        self.out.count("training_checked_second")
        self._compare_training("training.second", sym0, x2, names, ref_out2, ref_grad2, out2, grad2)

    def _compare_training(self, check, sym0, x1, names, ref_out, ref_grad, out, grad) -> None:
        """Outputs and gradients of one training step; reruns of the original's step judge conditioning."""
        c = self.case
        rerun_cache: Dict[tuple, Tuple] = {}

        def rerun_full(s):
            key = (s, _NUDGE[0], _NOISE[0])     # the nudged / noisy runs are runs of their own
            if key not in rerun_cache:
                rerun_cache[key] = train_step(sym0, perturbed(c.arg, s), _p(c.aux, s, 1), _p(x1, s, 2), seed=5)
            return rerun_cache[key]

        self._compare(check, ref_out, out, RTOL, lambda s: rerun_full(s)[0], names, inputs=x1)
        common = [n for n in sorted(ref_grad) if n in grad]
        self._compare(check + ".grad",
                      [ref_grad[n] for n in common], [grad[n] for n in common], RTOL_GRAD,
                      lambda s: [rerun_full(s)[1][n] for n in common], common, ATOL_GRAD, inputs=x1, grads=True)

    def _subgraph(self, sym0, res, ref, x1, names, ref_rerun, unfused=None) -> None:
        from fusion.ir.graph import Graph
        from fusion.engine.workarounds import backend_hazards

        c = self.case
        self.stage("subgraph.original")
        try:
            orig_on = forward(sym0, c.arg, c.aux, x1, subgraph=True)
        except Exception:
            self.out.count("mxnet_subgraph_fails_original")
            return
        if any(mismatch(a, b, RTOL) for a, b in zip(ref, orig_on)) or len(orig_on) != len(ref):
            self.out.count("mxnet_subgraph_differs_original")
            if not backend_hazards(Graph.from_symbol(sym0)):
                return          # another of MXNet's faults: nothing to hold the written graphs to
            self.out.count("mxnet_subgraph_differs_original_guarded")
        self.stage("subgraph.fused")
        try:
            got = forward(res.symbol, res.arg_params, res.aux_params, x1, subgraph=True)
        except Exception as e:
            self._find("subgraph.bind", _first_line(e))
            return
        self._compare("subgraph", ref, got, RTOL, ref_rerun, names, inputs=x1)
        if unfused is not None:
            self.stage("subgraph.unfused")
            try:
                got = forward(unfused, *as_read(unfused, res.arg_params, res.aux_params), x1, subgraph=True)
            except Exception as e:
                self._find("subgraph.unfuse_bind", _first_line(e))
                return
            self._compare("subgraph.unfuse", ref, got, RTOL, ref_rerun, names, inputs=x1)


    def _gluon_original_runs(self, sym0, xs, refs) -> bool:
        """Whether the original runs through the Gluon door as bound (Gluon's own limits are not
        findings: counted, and the door's check is skipped)."""
        c = self.case
        try:
            plain = gluon_runs(sym0, c.arg, c.aux, xs, None)
        except Exception:
            self.out.count("gluon_original_fails")
            return False
        if any(len(p) != len(r) or any(mismatch(a, b, RTOL) for a, b in zip(r, p)) for p, r in zip(plain, refs)):
            self.out.count("gluon_original_differs")
            return False
        return True

    def _gluon(self, sym0, ref, x1, ref2, x2, names, ref_rerun) -> None:
        c = self.case
        self.stage("gluon.original")
        xs = [x1] + ([x2] if x2 is not None else [])
        if not self._gluon_original_runs(sym0, xs, [ref, ref2]):
            return
        self.stage("gluon.fused")
        try:
            got = gluon_runs(sym0, c.arg, c.aux, xs, "fusion", **self.door_opts())
        except Exception as e:
            self._find("gluon.error", _first_line(e) + "\n" + _short_tb(e))
            return
        self.out.count("gluon_checked")
        self._compare("gluon", ref, got[0], RTOL, ref_rerun, names, inputs=x1)
        if x2 is not None:
            self.out.count("gluon_checked_second")
            self._compare("gluon.second", ref2, got[1], RTOL, lambda s: forward(
                sym0, perturbed(c.arg, s), _p(c.aux, s, 1), _p(x2, s, 2)), names, inputs=x2)
        if "no_train" in c.flags or "random_train" in c.flags or _training_dropouts(sym0):
            return
        if _ungraded_heads(sym0, {**c.arg, **c.aux, **x1}):
            # MXNet's CachedOp records an output that is a graph input, or that no float value
            # reaches, in some graphs and not in others, the original's included ("Cannot
            # differentiate node because it is not in a computational graph")
            self.out.count("gluon_training_ungraded_output")
            return
        self.stage("gluon.training")
        try:
            ref_out, ref_grad = gluon_runs(sym0, c.arg, c.aux, [x1], None, train_seed=5)
        except Exception:
            self.out.count("gluon_training_original_fails")
            return
        try:
            out, grad = gluon_runs(sym0, c.arg, c.aux, [x1], "fusion", train_seed=5, **self.door_opts())
        except Exception as e:
            self._find("gluon.training_error", _first_line(e) + "\n" + _short_tb(e))
            return
        missing = sorted(set(ref_grad) - set(grad))
        if missing:
            self._find("gluon.training_frozen", "parameters without a gradient: %s" % ", ".join(missing))
        self.out.count("gluon_checked_training")
        self._compare_training("gluon.training", sym0, x1, names, ref_out, ref_grad, out, grad)

    def _bf16(self, sym0, ref, x1, ref2, x2, names, random) -> None:
        from fusion.precision.policy import native_bf16_reason

        c = self.case
        if native_bf16_reason() is not None:
            self.out.count("bf16_unsupported_cpu")
            return
        self.stage("bf16.fuse")
        try:
            res = self._fuse("inference", precision="bf16")
        except Exception as e:
            self._find("bf16.fuse_error", _first_line(e) + "\n" + _short_tb(e))
            return
        if any("held in bfloat16 between ops" in n for n in res.report.notes):
            self.out.count("bf16_values_between_ops")       # the policy's bfloat16 hand-overs reached
        if any("also written rounded to bfloat16" in n for n in res.report.notes):
            self.out.count("bf16_copies_between_ops")       # and its bfloat16 copies of float32 values
        for check, x, r in (("bf16", x1, ref), ("bf16.second", x2, ref2)):
            if x is None:
                continue
            self.stage(check)
            try:
                got = forward(res.symbol, res.arg_params, res.aux_params, x)
            except Exception as e:
                self._find(check + ".bind", "at shapes %s: %s" % (
                    c.shapes(second=check.endswith("second")), _first_line(e)))
                return
            self.out.count(check.replace(".", "_") + "_checked")
            amp = any("MXNet's AMP converted the graph first" in n for n in res.report.notes)
            nan_in = amp and any(v.dtype.kind == "f" and np.isnan(v).any() for v in {**c.arg, **c.aux, **x}.values())
            if nan_in:
                # oneDNN's bfloat16 relu (AMP's) gives 0 for NaN, MXNet's float32 relu keeps it: from a
                # NaN on, AMP's graph and the original may take different values, both MXNet's
                self.out.count("bf16_amp_nan_inputs")
            if random or nan_in:
                self._compare_shapes(check, r, got, names)
            else:
                self._compare_bf16(check, sym0, r, got, x, names, amp)
        if random or not x1:
            return
        # the Gluon door: hybridize(backend="fusion", precision="bf16") (no AMP there)
        xs = [x1] + ([x2] if x2 is not None else [])
        self.stage("bf16.gluon")
        if not self._gluon_original_runs(sym0, xs, [ref, ref2]):
            return
        try:
            got = gluon_runs(sym0, c.arg, c.aux, xs, "fusion", precision="bf16", **self.door_opts())
        except Exception as e:
            self._find("bf16.gluon.error", _first_line(e) + "\n" + _short_tb(e))
            return
        for check, x, r, g in zip(("bf16.gluon", "bf16.gluon.second"), xs, [ref, ref2], got):
            self.out.count(check.replace(".", "_") + "_checked")
            self._compare_bf16(check, sym0, r, g, x, names, False)

    def _amp_original(self, sym0, x) -> Optional[List[np.ndarray]]:
        """The original as ``fuse(precision="bf16")`` hands it to the rules when MXNet's AMP converts
        it first (``fusion.precision.policy.convert_convolutions``: float32 outputs), run on ``x``; None
        where that cannot be done."""
        from fusion.precision.policy import convert_convolutions

        c = self.case
        try:
            conv = convert_convolutions(sym0, _nds(c.arg), _nds(c.aux), {k: v.shape for k, v in x.items()},
                                        {k: str(v.dtype) for k, v in x.items()})
            if conv is None or "kept" in conv[3]:
                return None
            return forward(conv[0], conv[1], conv[2], x)      # outputs cast back to float32 there
        except Exception:
            return None

    def _compare_bf16(self, check, sym0, ref, got, x, names, amp: bool) -> None:
        """``got`` (fused in bfloat16) against the float32 original ``ref``: within RTOL_BF16, or within
        BF16_FACTOR× what moving every parameter, input and op output by up to BF16_NOISE (twice
        bfloat16's largest rounding error) moves the original.
        ``amp``: MXNet's AMP converted the graph first, and its bfloat16 kernels are oneDNN's, whose
        relu (and max pooling) give 0 for NaN where MXNet's float32 kernels keep NaN: a NaN of the
        original that comes out as a number (finite, or ±inf after a 0 met an inf) is counted
        (``bf16_amp_nan_dropped``), not reported."""
        c = self.case
        if len(ref) != len(got):
            self._find(check + ".outputs", "%d outputs, expected %d" % (len(got), len(ref)))
            return
        dropped = [np.isnan(a) & ~np.isnan(b) if amp and a.shape == b.shape and a.dtype.kind == "f" and b.dtype.kind == "f"
                   else None for a, b in zip(ref, got)]
        if any(d is not None and d.any() for d in dropped):
            self.out.count("bf16_amp_nan_dropped")
        bad = [(i, m) for i, (a, b) in enumerate(zip(ref, got)) for m in [mismatch(a, b, RTOL_BF16, wild=dropped[i])]
               if m]
        if bad and not any(m.startswith(("shape", "dtype")) for _, m in bad):
            runs = []
            for seed in range(BF16_RUNS):
                _NOISE[0] = (BF16_NOISE, 31 + seed)
                try:
                    runs.append(forward(sym0, perturbed(c.arg, 41 + seed, BF16_NOISE),
                                        perturbed(c.aux, 51 + seed, BF16_NOISE), perturbed(x, 61 + seed, BF16_NOISE)))
                except Exception:
                    break
                finally:
                    _NOISE[0] = None
            amp_out = self._amp_original(sym0, x) if amp else None
            try:
                stored = bf16_stored_run(sym0, c.arg, c.aux, x)
            except Exception:
                stored = None
            if len(runs) == BF16_RUNS:
                still = []
                for i, m in bad:
                    others = [o[i] for o in runs]
                    wild = _wild(ref[i], others)
                    if dropped[i] is not None:
                        wild = wild | dropped[i]
                    dev = _movement(ref[i], others)
                    if amp_out is not None and amp_out[i].shape == ref[i].shape:
                        # MXNet's AMP run of the original is a bfloat16 run of it too: where its own
                        # rounding moves an element further (an ill-conditioned step whose effect a
                        # saturating op hides from the random runs), the fused graph, which starts
                        # from AMP's, may move as far (elementwise: no spread elsewhere)
                        dev = np.fmax(dev, _run_movement(ref[i], amp_out[i]))
                    if stored is not None and stored[i].shape == ref[i].shape:
                        # the same for the original with every value stored in bfloat16 (the
                        # deterministic run a fused_region's rounding follows): where that one
                        # rounding moves an element further than the random runs show
                        dev = np.fmax(dev, _run_movement(ref[i], stored[i]))
                    m2 = mismatch(ref[i], got[i], RTOL_BF16, dev, ATOL, wild, BF16_FACTOR)
                    if m2:
                        still.append((i, m2))
                if still:
                    dominated = _noise_dominated(sym0, c.arg, c.aux, x, BF16_NOISE)
                    still = [(i, m) for i, m in still if i not in dominated]
                if len(still) < len(bad):
                    self.out.count("bf16_within_rounding")
                bad = still
        if not bad:
            return
        i, m = bad[0]
        kind = "shape" if m.startswith(("shape", "dtype")) else ("nan" if m.startswith("NaN") else "values")
        more = " (+%d more)" % (len(bad) - 1) if len(bad) > 1 else ""
        self._find("%s.%s" % (check, kind), "output '%s': %s%s" % (names[i], m, more))


def _run_movement(ref: np.ndarray, amp_out: np.ndarray) -> np.ndarray:
    """How far a bfloat16 run of the original (MXNet's AMP run, the bfloat16-stored run) is from it,
    elementwise (0 where either is not finite: a finiteness the run changes is not taken as movement)."""
    a, b = ref.astype(np.float64), amp_out.astype(np.float64)
    both = np.isfinite(a) & np.isfinite(b)
    return np.where(both, np.abs(a - np.where(both, b, 0.0)), 0.0)


def _p(values, seed: Optional[int], k: int):
    return perturbed(values, None if seed is None else seed + k)


def _nds(d: Dict[str, np.ndarray]):
    import mxnet as mx

    return {k: mx.nd.array(v, dtype=v.dtype) for k, v in d.items()}


def _lost(before: List[str], after: List[str]) -> List[str]:
    rest = list(after)
    lost = []
    for op in before:
        if op in rest:
            rest.remove(op)
        else:
            lost.append(op)
    return lost


def _short_tb(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    ours = [f for f in tb if "/fusion/" in f.filename or "/patterns/" in f.filename]
    return " <- ".join("%s:%d" % (f.filename.split("/")[-2] + "/" + f.filename.split("/")[-1], f.lineno)
                       for f in reversed(ours[-4:]))
