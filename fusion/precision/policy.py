"""Reduced precision: the one policy of ``fuse(..., precision="bf16")``.

Like MXNet's AMP lists (``mx.contrib.amp.lists``), one table says what runs in bfloat16
and what stays float32:

* **bfloat16**: the operands of the matrix products of the fused ops listed in
  ``BF16_WEIGHTS`` — their weights are cast once at fuse time into new parameters
  (``<weight>_bf16``; the caller's arrays are never touched) and the activations are
  rounded to bfloat16 inside the kernel, per call.  Products accumulate in float32
  (oneDNN's bf16 matmul: ``vdpbf16ps`` / AMX).  The ops listed in ``BF16_ATTRS`` are given
  those attributes: ``fused_attention`` computes q·kᵀ and p·v from bfloat16 operands
  (``vdpbf16ps``, float32 accumulation) while its softmax statistics stay float32.
* **bfloat16 between ops** (``BF16_WRITERS`` / ``BF16_READERS``): a value is held in bfloat16
  only where every reader would round it to bfloat16 anyway — a ``fused_dense`` whose only
  readers are bfloat16-weight ``fused_dense`` data inputs (the FFN's first product feeding the
  second; a projection feeding the next) or the packed q/k/v input of a ``fused_attention`` with
  bfloat16 products (the QKV product), and a ``fused_attention`` whose only readers are such
  ``fused_dense`` inputs (the output projection), write their result rounded to nearest even
  (``out_dtype="bfloat16"``, after their float32 epilogue) and the readers take it as it is: the
  same bits, written once, half the bytes.  A value some readers round and others need in float32
  (a ``fused_add_layer_norm``'s output: the next projection's data and the residual stream) is
  written twice (``BF16_COPIES``): in float32, and rounded to bfloat16 as one more output that the
  rounding readers take.  ``between_ops`` decides, after the rules.
* **float32**: everything else — the other values between ops (the residual stream, LayerNorm
  inputs and outputs; model inputs and outputs keep their dtype), bias and activation epilogues,
  softmax statistics, masks and scaling, LayerNorm statistics (``fused_add_layer_norm``,
  ``LayerNorm``), reductions and elementwise chains (``fused_elemwise``), and every op MXNet
  keeps (a classifier head left to MXNet stays float32).  (``fused_add_layer_norm`` also reads and
  writes bfloat16 — float32 statistics inside — for graphs that hand it bfloat16; this policy
  keeps its values float32: its input is the residual stream, its output the next one.)

An AMP-converted graph (``amp.convert_model(..., target_dtype="bfloat16")``) is read as its
float32 model under this policy (``read_amp``).  A graph with convolutions (``AMP_CONVERTED``:
the fused ops have no bfloat16 convolution) goes the other way: under precision="bf16" MXNet's
AMP converts it first — its op lists decide what runs in bfloat16 around the convolutions — and
the rules fuse the AMP graph (``convert_convolutions``), as ``amp.convert_model`` then ``fuse()``
-- unless the rules of the run give convolutions to a ``fused_region`` (``BF16_CONVOLUTION_OPS``),
which computes its whole region in bfloat16 itself (``precision="bfloat16"``, its inputs, weights
and the values inside rounded to bfloat16, float32 accumulation, float32 outputs): then AMP is not
run, and convolutions outside the regions stay float32.

bfloat16 keeps float32's exponent range with an 8-bit significand (relative rounding
error 2⁻⁹ ≈ 2e-3 per operand): ``TOLERANCE`` is what ``fusion.verify``/``mxfuse
--verify`` and the per-rewrite self-check accept against the float32 original.

Native bfloat16 needs a CPU with ``avx512_bf16`` or ``amx_bf16`` (oneDNN dispatches to
them); elsewhere oneDNN emulates bf16, slower than float32, so ``precision="bf16"`` is
refused there unless forced.  ``ONEDNN_MAX_CPU_ISA`` (or ``DNNL_MAX_CPU_ISA``) set below
``AVX512_CORE_BF16`` hides the feature from oneDNN, and from this check.
"""
from __future__ import annotations

import os
from typing import Dict, Iterable, Mapping, Optional, Tuple

import numpy as np

from ..ir.errors import FusionError

#: MXNet's NumPy spelling of bfloat16 (``mxnet.ndarray.ndarray._DTYPE_NP_TO_MX``), code 12.
BF16 = np.dtype([("bfloat16", np.uint16)])
BF16_CODE = 12

FLOAT32 = "float32"
BFLOAT16 = "bfloat16"
#: Accepted spellings of ``precision``.
PRECISIONS = {"float32": FLOAT32, "fp32": FLOAT32, "bf16": BFLOAT16, "bfloat16": BFLOAT16}

#: Fused op -> input slots holding a weight that is cast to bfloat16 (only a known float32 parameter).
BF16_WEIGHTS: Dict[str, Tuple[int, ...]] = {"fused_dense": (1,)}

#: Fused op -> attributes it is given under precision="bf16" (inference only; the CPU kernels
#: compute in float32 where the CPU has no avx512_bf16, and the backward always does).
BF16_ATTRS: Dict[str, Dict[str, str]] = {"fused_attention": {"precision": "bfloat16"},
                                         "fused_region": {"precision": "bfloat16"}}

#: Fused op -> input slots that take a bfloat16 value as it is because they round a float32 one to
#: bfloat16 themselves (nearest even): ``fused_dense``'s data when its weight (BF16_WEIGHTS) is
#: bfloat16; ``fused_attention``'s one data input (q, k and v packed: layouts packed_qkv and
#: interleaved) when it computes its products in bfloat16 (precision="bfloat16", on a CPU with
#: native bfloat16, where its kernel rounds q, k and v before the products and applies the scale
#: after them) and has no causal band (whose skipping bounds read the float32 values).
BF16_READERS: Dict[str, Tuple[int, ...]] = {"fused_dense": (0,), "fused_attention": (0,)}
_READER_NEEDS: Dict[str, Dict[str, Tuple[str, str]]] = {
    "fused_attention": {"precision": (BFLOAT16, FLOAT32), "causal": ("False", "False")}}
#: fused_attention layouts whose q, k and v are one input
_ATTENTION_ONE_INPUT = ("packed_qkv", "interleaved")

#: Fused op -> the attributes that make it write its (float32-computed) result rounded to bfloat16,
#: when its weight (if it has one, BF16_WEIGHTS) is bfloat16 and its attributes are ``needs``
#: (attribute -> (needed value, default)).
BF16_WRITERS: Dict[str, Dict[str, str]] = {"fused_dense": {"out_dtype": BFLOAT16},
                                           "fused_attention": {"out_dtype": BFLOAT16}}
_WRITER_NEEDS: Dict[str, Dict[str, Tuple[str, str]]] = {"fused_dense": {"out_layout": ("plain", "plain")},
                                                        "fused_attention": {"precision": (BFLOAT16, FLOAT32)}}

#: Fused op -> the attribute (and its value) that makes it write one more output, last: its output 0
#: rounded to bfloat16 (nearest even).  The readers of output 0 that round it themselves
#: (``_rounds_input``) take that copy instead; the others keep reading output 0.  For a value with
#: both kinds of readers: a LayerNorm's output is the next projection's data and the residual stream.
BF16_COPIES: Dict[str, Tuple[str, str]] = {"fused_add_layer_norm": ("bf16_copy", "True")}


def is_bf16_copy(e) -> bool:
    """Whether graph entry ``e`` is the bfloat16 copy a BF16_COPIES op writes (its last output)."""
    copy = BF16_COPIES.get(e.node.op)
    return (copy is not None and str(e.node.attrs.raw(copy[0], "False")) == copy[1]
            and e.index == e.node.num_outputs - 1)

#: What stays float32 under precision="bf16" (for reports and docs; the kernels implement it).
FLOAT32_KEPT = ("values between ops other than fused_dense -> fused_dense, fused_dense -> fused_attention "
                "and fused_attention -> fused_dense (the residual stream, LayerNorm inputs and outputs), "
                "model inputs and outputs", "bias and activation epilogues",
                "fused_attention's softmax statistics, mask and scaling (its q·kᵀ and p·v run in bfloat16)",
                "LayerNorm statistics", "fused_elemwise chains and reductions", "ops left to MXNet")

#: max|fused − original| / max|original| accepted by verify and the self-check, per precision
#: (float16: an AMP float16 graph fused for the GPU, fusion/precision/half.py — its values rounded
#: at other places than AMP's graph rounds them, 2⁻¹¹ relative each; a 2-layer BERT measured 1e-4).
TOLERANCE = {FLOAT32: 1e-4, BFLOAT16: 2e-2, "float16": 1e-2}

# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) that stop below avx512_core_bf16
_ISA_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


def is_bf16(dtype) -> bool:
    try:
        return np.dtype(dtype) == BF16
    except TypeError:
        return str(dtype) == BFLOAT16


def np_dtype(dtype) -> np.dtype:
    """NumPy's dtype of a dtype, a type or a dtype's name, MXNet's bfloat16 included: MXNet's type
    inference, AMP and this package name it 'bfloat16', which NumPy does not know (``np.dtype``
    raises TypeError); its arrays have MXNet's NumPy spelling of it, ``BF16``."""
    return BF16 if is_bf16(dtype) else np.dtype(dtype)


def as_float32(a: np.ndarray) -> np.ndarray:
    """A bfloat16 array (MXNet's dtype, whose NumPy spelling is a structured type no arithmetic
    takes) as the float32 values it holds, exactly; any other array as it is."""
    return from_bf16(a) if is_bf16(a.dtype) else a


def astype(a: np.ndarray, dtype) -> np.ndarray:
    """``a.astype(dtype)`` where either side may be MXNet's bfloat16 (rounded to nearest even)."""
    if is_bf16(dtype):
        return a if is_bf16(a.dtype) else to_bf16(as_float32(np.asarray(a)))
    return as_float32(np.asarray(a)).astype(np_dtype(dtype), copy=False)


_NAMES: Dict = {}


def dtype_name(dtype) -> str:
    """NumPy's name of a dtype, with MXNet's bfloat16 called 'bfloat16' (NumPy says 'void16');
    remembered (asked for every value of a large graph)."""
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):
        name = BFLOAT16 if is_bf16(dtype) else np.dtype(dtype).name
        try:
            _NAMES[dtype] = name
        except TypeError:
            pass
        return name


#: The dtypes MXNet 1.9 has NDArrays of (see mxnet.ndarray.ndarray._DTYPE_NP_TO_MX).
PARAM_DTYPES = ("float32", "float64", "float16", "uint8", "int8", "int32", "int64", "bool", "bfloat16")


def cpu_flags() -> set:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16_reason() -> Optional[str]:
    """None when this CPU computes bfloat16 products natively, else why not."""
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        cap = os.environ.get(var, "").strip().upper()
        if cap in _ISA_WITHOUT_BF16:
            return "%s=%s hides bfloat16 instructions from oneDNN" % (var, cap)
    flags = cpu_flags()
    if not flags & {"avx512_bf16", "amx_bf16"}:
        return "this CPU has no native bfloat16 dot products (neither avx512_bf16 nor amx_bf16 among its flags)"
    return None


def resolve(precision: Optional[str], force: bool = False, mode: str = "inference") -> str:
    """The canonical precision ('float32' or 'bfloat16'), or a one-line FusionError saying why not."""
    if precision is None:
        return FLOAT32
    key = str(precision).lower()
    if key not in PRECISIONS:
        raise FusionError("precision must be float32 or bf16 (fp32/bfloat16 also accepted), not %r: the fused "
                          "ops compute in float32, or in bfloat16 with float32 accumulation" % (precision,))
    canon = PRECISIONS[key]
    if canon == BFLOAT16:
        if mode == "training":
            raise FusionError("precision='bf16' is for inference: it adds bfloat16 copies of the weights, "
                              "which training would not update")
        why = None if force else native_bf16_reason()
        if why:
            raise FusionError("precision='bf16' refused: %s; oneDNN would emulate bfloat16, slower than "
                              "float32 (force=True / mxfuse --force-precision fuses in bf16 anyway)" % why)
    return canon


def to_bf16(value: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (MXNet's dtype), rounded to nearest even; NaN stays NaN."""
    f = np.ascontiguousarray(value, dtype=np.float32)
    u = f.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        rounded[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return rounded.view(BF16)


def from_bf16(value: np.ndarray) -> np.ndarray:
    """bfloat16 (MXNet's dtype, or its uint16 bits) -> float32, exactly."""
    bits = np.ascontiguousarray(value).view(np.uint16).astype(np.uint32) << np.uint32(16)
    return bits.view(np.float32)


def cast_slots(op: str, precision: str) -> Tuple[int, ...]:
    """Input slots of a new ``op`` whose float32 weight the policy casts at ``precision``."""
    return BF16_WEIGHTS.get(op, ()) if precision == BFLOAT16 else ()


def reduced_attrs(op: str, precision: str) -> Dict[str, str]:
    """Attributes the policy gives a new ``op`` at ``precision`` (none at float32)."""
    return BF16_ATTRS.get(op, {}) if precision == BFLOAT16 else {}


def tolerance(precision: str) -> float:
    return TOLERANCE.get(precision, TOLERANCE[FLOAT32])


def guard_amp() -> None:
    """Make MXNet's AMP (``mx.contrib.amp.convert_symbol``/``convert_model``/``convert_hybrid_block``)
    refuse a graph with fused ops, with the reason, instead of failing deep in its type inference:
    AMP's op lists do not know them (they take float32 activations), so AMP goes first, or
    ``fuse(..., precision="bf16")`` is used instead."""
    import functools

    try:
        from mxnet.contrib.amp import amp
    except ImportError:         # an MXNet without AMP: nothing to guard
        return
    convert = amp.convert_symbol
    if getattr(convert, "_fusion_guard", False):
        return

    @functools.wraps(convert)
    def convert_symbol(sym, *args, **kwargs):
        try:
            fused = sorted({o for o in _ops(sym) if o.startswith("fused_")})
        except Exception:       # not a symbol we can read: AMP says what is wrong with it
            fused = []
        if fused:
            raise FusionError("AMP cannot convert a fused graph (%s: mxnet-fusion's ops, which AMP's op lists do "
                              "not know and which take float32 activations); convert the original model with AMP "
                              "first and fuse after, or fuse the float32 model with precision='bf16'"
                              % ", ".join(fused))
        return convert(sym, *args, **kwargs)

    convert_symbol._fusion_guard = True
    amp.convert_symbol = convert_symbol        # convert_model / convert_hybrid_block call it from here
    import mxnet.contrib.amp as package
    package.convert_symbol = convert_symbol


# -- graphs converted by MXNet's AMP --------------------------------------------------------------

AMP_OPS = ("amp_cast", "amp_multicast")


def read_amp(graph, arg_params: Dict, aux_params: Dict):
    """Read a graph converted by MXNet's AMP (``amp.convert_model(..., target_dtype="bfloat16")``)
    as its float32 model fused under this policy (in place): every ``amp_cast`` / ``amp_multicast``
    is removed (its readers take its input), every bfloat16 parameter is widened to float32 —
    exactly: a bfloat16 value is a float32 value — and the fused ops then cast the weights of
    their products back to the same bfloat16 bits (``BF16_WEIGHTS``).  A graph output AMP
    gave in bfloat16 is cast back to bfloat16 (model outputs keep their dtype).

    Returns ``(arg_params, aux_params, what)`` — the params with the widened arrays, and a
    summary for the report (casts removed, the ops AMP ran in bfloat16) — or ``None`` where the
    graph is not read so, with nothing changed: no AMP casts, a cast to another dtype (float16),
    a data input that AMP made bfloat16 (the model's input dtype would change), or a convolution
    AMP runs in bfloat16 (the fused ops have no bfloat16 convolution: read so, a CNN would lose
    AMP's bfloat16 convolutions; its float32 parts fuse around them as they are).
    """
    from ..ir.attrs import Attrs
    from ..ir.graph import Entry, Node

    casts = [nd for nd in graph.op_nodes() if nd.op in AMP_OPS]
    if not casts:
        return None
    for nd in casts:
        if nd.op == "amp_cast" and str(nd.attrs.raw("dtype")) not in (BFLOAT16, FLOAT32):
            return None
    params = set(arg_params) | set(aux_params)
    for nd in graph.variables():
        if nd.name not in params and is_bf16_code(nd.attrs.raw("__dtype__")):
            return None
    # the ops AMP ran in bfloat16: those reading a cast to bfloat16 or a bfloat16 parameter
    bf16_params = {k for store in (arg_params, aux_params) for k, v in store.items() if is_bf16(v.dtype)}
    if not bf16_params and not any(nd.op == "amp_cast" and str(nd.attrs.raw("dtype")) == BFLOAT16 for nd in casts):
        # no bfloat16 anywhere: a float32 model that uses amp_multicast itself to match dtypes (GluonCV's
        # SSD box decoder, cast_narrow=True) is not an AMP graph, and its precision stays float32
        return None
    ran_bf16 = {(nd.name, nd.op) for nd in graph.op_nodes() if nd.op not in AMP_OPS and any(
        (e.node.op == "amp_cast" and e.node.attrs.raw("dtype") == BFLOAT16) or e.node.name in bf16_params
        for e in nd.inputs)}
    if any(op in ("Convolution", "Deconvolution") for _, op in ran_bf16):
        return None
    head_bf16 = _bf16_heads(graph, arg_params, aux_params)
    target = {}
    for nd in casts:            # in topological order: a cast of a cast reads through both
        for i in range(nd.num_outputs if nd.op == "amp_multicast" else 1):
            src = nd.inputs[i]
            target[Entry(nd, i)] = target.get(src, src)
    for nd in graph.nodes:
        nd.inputs = [target.get(e, e) for e in nd.inputs]
    heads = []
    for k, e in enumerate(graph.heads):
        if e in target and head_bf16[k]:
            e = e                       # the cast itself stays: the output's dtype and name
        elif e in target:
            e = target[e]
        elif head_bf16[k]:
            cast = Node("amp_cast", graph.unique_name(e.node.name + "_amp_cast_bfloat16"),
                        Attrs.from_values({"dtype": BFLOAT16}), [e], pos=e.node.pos + 0.5)
            graph.nodes.append(cast)
            e = Entry(cast)
        heads.append(e)
    graph.heads = heads
    for nd in graph.variables():
        if is_bf16_code(nd.attrs.raw("__dtype__")):
            del nd.attrs["__dtype__"]
    widened = []

    def widen(store):
        out = {}
        for k, v in store.items():
            if is_bf16(v.dtype):
                v = from_bf16(v.asnumpy() if hasattr(v, "asnumpy") else np.asarray(v))
                widened.append(k)
            out[k] = v
        return out

    arg_out, aux_out = widen(arg_params), widen(aux_params)
    graph.mark_changed()
    graph.compact()
    what = {"casts": sum(1 for nd in casts if not any(h.node is nd for h in graph.heads)),
            "widened": len(widened), "ran_bf16": ran_bf16}
    return arg_out, aux_out, what


def is_bf16_code(raw) -> bool:
    return raw is not None and str(raw) == str(BF16_CODE)


def _bf16_heads(graph, arg_params, aux_params):
    """Per graph output: whether AMP's graph gives it in bfloat16 (False where MXNet cannot tell)."""
    try:
        sym = graph.to_symbol()
        known = {k: v.dtype for store in (arg_params, aux_params) for k, v in store.items()}
        names = sym.list_arguments() + sym.list_auxiliary_states()
        _, out_types, _ = sym.infer_type_partial(**{k: known[k] for k in names if k in known})
        return [t is not None and is_bf16(t) for t in out_types]
    except Exception:           # noqa: BLE001 -- unknown dtypes: the outputs are taken as float32
        return [False] * len(graph.heads)


# -- bfloat16 values between fused ops ---------------------------------------------------------

def _bf16_weight(graph_node, op: str) -> bool:
    """Whether the fused op reads its product's weight (BF16_WEIGHTS) in bfloat16: a variable
    declared bfloat16 (the casts this policy adds, or a caller's bfloat16 parameter)."""
    slots = BF16_WEIGHTS.get(op, ())
    if not slots:
        return False
    for k in slots:
        src = graph_node.inputs[k].node if k < len(graph_node.inputs) else None
        if src is None or not src.is_variable or not is_bf16_code(src.attrs.raw("__dtype__")):
            return False
    return True


def _needs(graph_node, needs: Dict[str, Tuple[str, str]]) -> bool:
    return all(str(graph_node.attrs.raw(k, default)) == want for k, (want, default) in needs.items())


def _rounds_input(reader, slot: int) -> bool:
    """Whether input ``slot`` of ``reader`` is only ever rounded to bfloat16 (nearest even) by it."""
    op = reader.op
    if slot not in BF16_READERS.get(op, ()) or not _needs(reader, _READER_NEEDS.get(op, {})):
        return False
    if op in BF16_WEIGHTS and not _bf16_weight(reader, op):
        return False
    if op == "fused_attention":
        # one input holding q, k and v (every data input changes dtype together), and the kernel's
        # bfloat16 products: a CPU without them computes in float32 from the float32 values
        return str(reader.attrs.raw("layout", "plain")) in _ATTENTION_ONE_INPUT and native_bf16_reason() is None
    return True


def between_ops(graph, precision: str) -> list:
    """Make the values between fused ops bfloat16 where every reader rounds them to bfloat16 anyway
    (in place; precision='bfloat16' only).  A writer (BF16_WRITERS: a bfloat16-weight fused_dense,
    a fused_attention with bfloat16 products) qualifies when its output is no graph output and each
    of its readers is a BF16_READERS slot that rounds its input to bfloat16 (``_rounds_input``):
    the readers then see the same bits they computed before (both round to nearest even), so the
    rewrite is exact.  A BF16_COPIES op read by such a slot writes its output 0 a second time, rounded
    (one more output), and those slots read the copy (exact for the same reason).  Returns the names
    of the writers changed."""
    if precision != BFLOAT16:
        return []
    users = graph.consumers()
    heads = {e.node for e in graph.heads}
    changed = []
    for nd in graph.op_nodes():
        attrs = BF16_WRITERS.get(nd.op)
        if not attrs or nd in heads or nd.num_outputs != 1:
            continue
        if (nd.op in BF16_WEIGHTS and not _bf16_weight(nd, nd.op)) or not _needs(nd, _WRITER_NEEDS.get(nd.op, {})):
            continue
        if all(str(nd.attrs.raw(k)) == v for k, v in attrs.items()):
            changed.append(nd.name)         # already so (a graph fused before)
            continue
        readers = users.get(nd, [])
        if readers and all(_rounds_input(r, slot) for r, slot in readers):
            for k, v in attrs.items():
                nd.attrs[k] = v
            changed.append(nd.name)
    from ..ir.graph import Entry
    for nd in graph.op_nodes():
        copy = BF16_COPIES.get(nd.op)
        if not copy:
            continue
        key, value = copy
        if str(nd.attrs.raw(key, "False")) == value:
            changed.append(nd.name)         # already so (a graph fused before)
            continue
        rounding = [(r, slot) for r, slot in users.get(nd, [])
                    if r.inputs[slot].index == 0 and _rounds_input(r, slot)]
        if not rounding:
            continue
        nd.attrs[key] = value
        index = nd.num_outputs
        nd.num_outputs += 1
        for r, slot in rounding:
            r.inputs[slot] = Entry(nd, index, r.inputs[slot].version)
        changed.append(nd.name)
    if changed:
        graph.mark_changed()
    return changed


# -- convolutions under precision="bf16": MXNet's AMP converts them ------------------------------

#: Fused ops that compute the convolutions they take in bfloat16 themselves (their BF16_ATTRS): a
#: ``fused_region`` under precision="bf16" converts its inputs and weights to bfloat16 inside, and
#: its convolutions run there (oneDNN, float32 accumulation).  Where the rules of a run can emit one
#: and the op library implements it on the CPU, MXNet's AMP does not convert the graph first
#: (``convolutions_fused``): AMP's bfloat16 convolutions between MXNet's ops make a CNN slower than
#: float32 (DESIGN.md); convolutions no region takes then stay float32 (the report counts them).
BF16_CONVOLUTION_OPS = ("fused_region",)


def convolutions_fused(emitted: Iterable[str], capabilities: Mapping[str, Mapping[str, Iterable[str]]]
                       ) -> Optional[str]:
    """The op among ``emitted`` (the library ops the rules of a run can emit, ``Rule.emits``) that takes
    a graph's convolutions into bfloat16 itself and that the op library implements on the CPU
    (``capabilities``: ``fusion.native.library.capabilities()``); None: MXNet's AMP converts them."""
    for op in emitted:
        if op in BF16_CONVOLUTION_OPS and "cpu" in (capabilities.get(op) or {}).get("forward", ()):
            return op
    return None


def computes_reduced(graph) -> bool:
    """Whether a fused graph computes in bfloat16 anywhere: a variable declared bfloat16 (a weight cast
    by this policy), or a fused op given its bfloat16 attributes (BF16_ATTRS): its stock form is
    then compared with it at the bfloat16 tolerance (``fusion.unfuse``'s check)."""
    if any(is_bf16_code(nd.attrs.raw("__dtype__")) for nd in graph.variables()):
        return True
    return any(nd.op in BF16_ATTRS and all(str(nd.attrs.raw(k)) == v for k, v in BF16_ATTRS[nd.op].items())
               for nd in graph.op_nodes())


#: Ops the fused library has no bfloat16 form of, which MXNet's AMP runs in bfloat16 (oneDNN):
#: under precision="bf16" a graph holding them is converted by AMP first (``convert_convolutions``).
AMP_CONVERTED = ("Convolution", "Deconvolution")


def convert_convolutions(symbol, arg_params: Dict, aux_params: Dict, input_shapes: Optional[Dict] = None,
                         input_dtypes: Optional[Dict] = None):
    """precision='bf16' on a graph with convolutions (``AMP_CONVERTED``): MXNet's own AMP
    (``amp.convert_model(..., target_dtype="bfloat16", cast_optional_params=True)``, AMP's op
    lists deciding what runs in bfloat16 around them) converts the graph first, on copies of the
    caller's arrays; the fusion rules then run on the AMP graph (as for ``amp.convert_model`` then
    ``fuse()``).  A graph output AMP leaves in bfloat16 is cast back to float32 (model outputs keep
    their dtype).

    Returns ``(symbol, arg_params, aux_params, what)`` or None with nothing done: no convolution,
    a graph AMP converted already, or one holding fused ops (fused before).  Where AMP cannot
    convert the graph, or MXNet cannot run AMP's graph once at ``input_shapes`` (AMP's lists put an
    op in bfloat16 that has no bfloat16 kernel: ``Activation(act_type='softsign')``), or the input
    shapes are not given so that this cannot be tried, the graph is returned as it is with
    ``what["kept"]`` saying why: its convolutions stay float32."""
    import mxnet as mx

    sym = symbol if isinstance(symbol, mx.sym.Symbol) else None
    if sym is None:
        return None
    ops = _ops(sym)
    converted = sum(1 for o in ops if o in AMP_CONVERTED)
    if not converted or any(o in AMP_OPS or o.startswith("fused_") for o in ops):
        return None
    from mxnet.contrib import amp

    def copies(store):
        return {k: (v.copy() if isinstance(v, mx.nd.NDArray) else mx.nd.array(np.asarray(v), dtype=np.asarray(v).dtype))
                for k, v in (store or {}).items()}

    try:
        asym, aarg, aaux = amp.convert_model(sym, copies(arg_params), copies(aux_params), target_dtype=BFLOAT16,
                                             cast_optional_params=True)
    except FusionError:
        raise
    except Exception as e:  # noqa: BLE001 -- MXNet's reason, on one line
        return symbol, arg_params, aux_params, {"converted": converted, "kept": "MXNet's AMP cannot convert the graph "
                                                "(%s)" % _mxnet_reason(e)}
    fails, out_types = _amp_graph_run(asym, aarg, aaux, input_shapes, input_dtypes)
    if fails:
        return symbol, arg_params, aux_params, {"converted": converted, "kept": fails}
    known = {k: v.dtype for store in (aarg, aaux) for k, v in store.items()}
    if any(is_bf16(t) for t in out_types):     # the dtypes MXNet gave (its type inference can say otherwise)
        outs = [asym[i] for i in range(len(out_types))]
        asym = mx.sym.Group([mx.sym.amp_cast(o, dtype=FLOAT32, name=o.name + "_float32")
                             if is_bf16(t) else o for o, t in zip(outs, out_types)])
        if len(out_types) == 1:
            asym = asym[0]
    what = {"converted": converted, "bf16_params": sorted(k for k, v in known.items() if is_bf16(v))}
    return asym, aarg, aaux, what


def _ops(sym) -> list:
    """The op of every node of an ``mx.sym.Symbol`` ("null" for variables)."""
    import json
    return [n["op"] for n in json.loads(sym.tojson())["nodes"]]


def kept_convolutions(symbol) -> Optional[Dict]:
    """The Gluon backend (which can only add parameters to a block, not change the dtype of its own)
    does not run ``convert_convolutions``: what the report says about the convolutions that stay
    float32 there, or None (no convolution)."""
    import mxnet as mx
    if not isinstance(symbol, mx.sym.Symbol):
        return None
    n = sum(1 for o in _ops(symbol) if o in AMP_CONVERTED)
    if not n:
        return None
    return {"converted": n, "kept": "the Gluon backend does not convert them (MXNet's AMP, which runs them in "
                                    "bfloat16, gives new bfloat16 parameters the block cannot take); fuse() or "
                                    "mxfuse --precision bf16 on the exported model runs them in bfloat16"}


def _mxnet_reason(e: BaseException) -> str:
    """The line of an MXNet error that says what failed (its messages start with a traceback)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    said = [ln for ln in lines if ("Error" in ln or "Check failed" in ln) and not ln.startswith("Traceback")]
    return (said or lines or [type(e).__name__])[-1][:300]


def _amp_graph_run(asym, arg: Dict, aux: Dict, input_shapes: Optional[Dict], input_dtypes: Optional[Dict]):
    """AMP's graph run once at ``input_shapes`` (inputs zero): ``(None, its output dtypes)``, or
    ``(why it cannot be taken, None)``: MXNet cannot run it, or the input shapes are not all known,
    so that cannot be tried."""
    import mxnet as mx

    from ..native.env import subgraph_backend

    shapes = {k: tuple(v) for k, v in (input_shapes or {}).items()}
    unknown = [n for n in asym.list_arguments() if n not in arg and n not in shapes]
    if unknown:
        return ("the shape of input(s) %s is not given, so AMP's graph cannot be run once to check that MXNet "
                "has a bfloat16 kernel for each op AMP puts in bfloat16; pass input_shapes" % ", ".join(unknown)), None
    dtypes = {k: np_dtype(v) for k, v in (input_dtypes or {}).items()}
    try:
        args = {n: arg[n] if n in arg else mx.nd.zeros(shapes[n], dtype=dtypes.get(n, np.float32))
                for n in asym.list_arguments()}
        with subgraph_backend(False):       # MXNet's own kernels, as the self-check binds
            exe = asym.bind(mx.cpu(), args, aux_states={n: aux[n] for n in asym.list_auxiliary_states()},
                            grad_req="null")
        outs = exe.forward(is_train=False)
        for o in outs:
            o.wait_to_read()
    except Exception as e:  # noqa: BLE001 -- MXNet's reason, on one line
        return "MXNet cannot run AMP's graph of it: %s" % _mxnet_reason(e), None
    return None, [o.dtype for o in outs]
