"""ONNX in and out: ``import_onnx`` builds an MXNet Symbol from an ONNX file, ``export_onnx`` writes one back.

Import strategy: our own importer, not MXNet 1.9.1's (``mx.contrib.onnx``).
MXNet's importer fails on what today's exporters write: initializers that
are not also graph inputs (KeyError), ``Flatten`` with axis != 1,
``LayerNormalization`` ("not implemented"), ``Erf`` (no translation), and
``Reshape`` whose shape is computed — the ``Shape -> Gather -> Unsqueeze ->
Concat`` chains of every BERT export — because it looks the shape up among
the initializers (KeyError).  Preparing the ONNX graph first would need a
constant-folding pass with shape inference anyway, and would still leave an
importer we do not control: tracebacks instead of one-line errors, the file's
names (``onnx::MatMul_134``) and ``MatMul``/``Add`` imported as
``linalg_gemm2``/``broadcast_add``, not the ``FullyConnected`` the fusion
rules match.  Importing the ~70 ops these models use directly is one table of
small functions, and gives:

* one-line :class:`GraphError`s naming the op and the node;
* constant folding while importing: every node whose inputs are all known
  (initializers, ``Constant``, and ``Shape`` of a tensor, whose shape MXNet
  infers from the input shapes) is evaluated with NumPy, so the dynamic-shape
  chains of BERT exports become plain ``Reshape(shape=...)`` attributes;
* MXNet's own spelling of each pattern, the one the rule library matches:
  ``MatMul(x, W) [+ b]`` -> ``FullyConnected(flatten=False)``, ``Gemm`` ->
  ``FullyConnected``, ``LayerNormalization`` -> ``LayerNorm``, ``x / c`` ->
  ``_div_scalar``, ``x ** 2`` -> ``square``, ``MatMul(q, Transpose(k))`` ->
  ``batch_dot(..., transpose_b=True)``, same-shape ``Add`` -> ``elemwise_add``;
* parameter and node names made valid, unique MXNet names (``[A-Za-z0-9_]``).

Files the importer reads besides plain exporter output: opsets 13-21 (``OPSET_RANGE``, checked op by
op); MXNet's own exporter (``FullyConnected(flatten=False)`` written as ``Flatten(axis=-1) -> Gemm ->
Reshape``, LayerNorm's ``+ beta`` as ``- (-beta)``: both read back in the forms the rules match); and
ONNX Runtime's transformers optimizer, whose ``com.microsoft`` contrib ops (``Attention``,
``MultiHeadAttention``, ``SkipLayerNormalization``, ``BiasGelu``, ``FastGelu``, ``Gelu``,
``FusedMatMul``, ``EmbedLayerNormalization``) are written out as the stock ops of the unfused model
(``FullyConnected`` per Q/K/V, ``batch_dot``/``softmax`` with an additive mask, ``LayerNorm``, GELU), with
ORT's defaults (scale 1/sqrt(head size), mask_filter_value -10000, epsilon 1e-12) and mask forms.
Attributes an importer does not read are refused (``_KNOWN_ATTRS``), not ignored.

Values inside the importer are either NumPy arrays (known now) or MXNet
symbols (known at run time).  Integer and boolean tensors that reach run time
are carried as float32, as MXNet models do.  ``Reshape`` targets keep the
leading dimensions that equal the input's as ``0`` (copy), so a graph whose
shapes were folded for batch 1 still runs for other batch sizes when the
rest of the shape allows it.

Export uses MXNet's exporter (``mx.onnx``) with its quirks handled here: it
stamps the newest opset of the installed onnx package (19) while emitting
opset-12/13 nodes, and checks the graph against that opset (``ReduceMean``'s
axes attribute fails): we convert for the opset asked (default 13), stamp it
and check against it.  It sorts graph outputs by name (we restore the
symbol's order); it tells ``1 - x`` from ``x - 1`` by the node's
auto-generated *name* (``_rminusscalar0``), so renamed ``_rminus_scalar``/
``_rdiv_scalar`` nodes came out wrong (replaced here); and it lacks ``erf``,
``rsqrt``, ``where`` and a few scalar ops (added).  ``fused_*`` ops are
exported through :data:`FUSED_OP_EXPORTERS`; an op without an exporter is a
one-line error.  The file is written to a temporary file, run in ONNX Runtime
against MXNet on random inputs, and renamed into place only if they match.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..ir.errors import FusionError, GraphError

__all__ = ["import_onnx", "export_onnx", "FUSED_OP_EXPORTERS", "SUPPORTED_OPS", "node_io"]

_FLT_MAX = 3.4028234663852886e38


def _first_line(text: str) -> str:
    for line in str(text).strip().splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


# --------------------------------------------------------------------------------------------
# Import
# --------------------------------------------------------------------------------------------



def import_onnx(path_or_model: Any, *, input_shapes: Optional[Mapping[str, Sequence[int]]] = None):
    """(symbol, arg_params, aux_params) of the ONNX model at ``path_or_model`` (a path or a ModelProto).

    ``input_shapes`` maps input names to shapes; it is needed where the file
    leaves dimensions symbolic (a leading symbolic dimension defaults to 1).
    Shapes only matter where the graph computes with them (``Shape`` chains),
    which are folded for these shapes.
    """
    model = _load(path_or_model)
    return _Importer(model, dict(input_shapes or {})).run()


def _load(path_or_model: Any):
    import onnx

    if isinstance(path_or_model, onnx.ModelProto):
        model, where, external = path_or_model, "ONNX model", set()
    else:
        path = os.fspath(path_or_model)
        where = "'%s'" % path
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise GraphError("cannot read ONNX file '%s': %s" % (path, e.strerror or e)) from None
        model = onnx.ModelProto()
        try:
            model.ParseFromString(data)
        except Exception as e:  # protobuf's DecodeError and friends
            raise GraphError("%s is not a valid ONNX model (truncated or not ONNX): %s"
                             % (where, _first_line(e) or type(e).__name__)) from None
        external = {t.name for t in model.graph.initializer
                    if t.HasField("data_location") and t.data_location == onnx.TensorProto.EXTERNAL}
        if model.graph.node and external:
            try:
                from onnx.external_data_helper import load_external_data_for_model
                load_external_data_for_model(model, os.path.dirname(os.path.abspath(path)))
            except Exception as e:
                raise GraphError("%s: cannot load external tensor data: %s" % (where, _first_line(e))) from None
    g = model.graph
    if model.ir_version <= 0 or not g.output or not g.node:
        raise GraphError("%s is not a valid ONNX model (truncated or not ONNX): no %s"
                         % (where, "IR version" if model.ir_version <= 0 else "outputs" if not g.output else "nodes"))
    opsets = [imp.version for imp in model.opset_import if imp.domain in ("", "ai.onnx")]
    if not opsets or not OPSET_RANGE[0] <= opsets[-1] <= OPSET_RANGE[1]:
        raise GraphError("%s uses ONNX opset %s; the importer supports opsets %d-%d (convert it, e.g. with "
                         "onnx.version_converter)" % (where, opsets[-1] if opsets else "(none)", *OPSET_RANGE))
    _check_initializers(g, where, external)
    known = {i.name for i in g.input} | {t.name for t in g.initializer} | {""}
    for node in g.node:
        for name in node.input:
            if name not in known:
                raise GraphError("%s: node '%s' (%s) reads '%s', which nothing defines before it "
                                 "(truncated file, or nodes not in topological order)"
                                 % (where, node.name, node.op_type, name))
        known.update(node.output)
    for out in g.output:
        if out.name not in known:
            raise GraphError("%s: graph output '%s' is not produced by any node" % (where, out.name))
    return model


def _check_initializers(g, where: str, external) -> None:
    """Each initializer holds as many values as its shape says (a truncated external data file does not)."""
    import onnx
    from onnx import helper

    for t in g.initializer:
        try:
            np_dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
        except (KeyError, ValueError, TypeError):
            raise GraphError("%s: initializer '%s' has an unknown data type (%d)" % (where, t.name, t.data_type)) from None
        want = int(np.prod(t.dims, dtype=np.int64))
        if t.data_type == onnx.TensorProto.STRING:
            have, unit = len(t.string_data), "strings"
        elif t.HasField("raw_data"):
            size = np.dtype(np_dtype).itemsize
            have, unit = len(t.raw_data), "bytes"
            want *= size
        else:
            field = helper.tensor_dtype_to_field(t.data_type)
            have, unit = len(getattr(t, field)), "values"
            if t.data_type in (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128):
                want *= 2
            elif t.data_type in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.BOOL,
                                 onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16,
                                 onnx.TensorProto.UINT16):
                pass                     # one value per int32 slot
            if have == 0 and want == 0:
                continue
        if have != want:
            raise GraphError("%s: initializer '%s' (%s, shape %s) holds %d %s, needs %d%s"
                             % (where, t.name, np.dtype(np_dtype).name, tuple(t.dims), have, unit, want,
                                " (its external data file is truncated?)" if t.name in external else ""))


# The default-domain opsets read.  Checked op by op from 13 to 21 for the ops of SUPPORTED_OPS: 14
# (Reshape allowzero; Add/Sub/Mul/Div/Relu/Identity types; BatchNormalization training_mode, refused),
# 15 (Shape start/end; Pow, BatchNormalization types), 16 (LeakyRelu, Where types), 17
# (LayerNormalization), 18 (Reduce* axes as an input, noop_with_empty_axes; Split num_outputs), 19
# (AveragePool dilations, refused; Cast saturate, float8 only; Constant/Equal/Reshape/Shape/Size
# types), 20 (Gelu; ReduceMax/ReduceMin, ConstantOfShape types), 21 (int4/uint4 types of Cast,
# Constant, ConstantOfShape, Flatten, Identity, Reshape, Shape, Size, Squeeze, Transpose, Unsqueeze).
OPSET_RANGE = (13, 21)


class _Importer:
    """One pass over the (topologically ordered) ONNX nodes; values are np.ndarray or mx.sym.Symbol."""

    def __init__(self, model, input_shapes: Dict[str, Sequence[int]]):
        import mxnet as mx
        import onnx
        from onnx import numpy_helper

        self.mx, self.onnx = mx, onnx
        self.model, self.graph = model, model.graph
        self.opset = 0
        for imp in model.opset_import:
            if imp.domain in ("", "ai.onnx"):
                self.opset = imp.version
        lo, hi = OPSET_RANGE
        if not lo <= self.opset <= hi:
            raise GraphError("ONNX opset %s is not supported: the importer reads opsets %d-%d "
                             "(convert the file with onnx.version_converter.convert_version)"
                             % (self.opset or "(none imported)", lo, hi))
        ms = [imp.version for imp in model.opset_import if imp.domain == "com.microsoft"]
        if ms and ms[0] != 1 and any(n.domain == "com.microsoft" for n in model.graph.node):
            raise GraphError("com.microsoft opset %d is not supported (ONNX Runtime's contrib ops are "
                             "version 1)" % ms[0])
        self.values: Dict[str, Any] = {}
        self.params: Dict[str, np.ndarray] = {}      # MXNet var name -> value
        self.shapes: Dict[str, Tuple[int, ...]] = {}  # MXNet var name -> shape (inputs and params)
        self.vars: Dict[str, Any] = {}               # ONNX value name -> mx var made from a constant
        self.names: set = set()
        self.shape_cache: Dict[int, Tuple[Any, Tuple[int, ...]]] = {}
        self.uses: Dict[str, int] = {}
        for node in self.graph.node:
            for name in node.input:
                self.uses[name] = self.uses.get(name, 0) + 1
        for out in self.graph.output:
            self.uses[out.name] = self.uses.get(out.name, 0) + 1
        # MatMul imported as FullyConnected without bias, waiting for a bias Add: out name -> parts
        self.pending_fc: Dict[str, Tuple[Any, Any, int, str]] = {}
        # Transpose outputs: name -> (input value, perm), so MatMul can use transpose_b
        self.transposes: Dict[str, Tuple[Any, Tuple[int, ...]]] = {}
        # Flatten(axis=rank-1) outputs: name -> the unflattened input (MXNet's exporter writes
        # FullyConnected(flatten=False) as Flatten(axis=-1) -> Gemm -> Reshape back)
        self.flattened: Dict[str, Any] = {}
        # Gemm outputs computed unflattened: name -> (the (..., N) symbol, its shape)
        self.unflattened: Dict[str, Tuple[Any, Tuple[int, ...]]] = {}

        for t in self.graph.initializer:
            self.values[t.name] = numpy_helper.to_array(t)
        for inp in self.graph.input:
            if inp.name in self.values:
                continue   # old exporters list initializers as inputs too
            name = self._unique(inp.name)
            shape = self._input_shape(inp, name, input_shapes)
            self.shapes[name] = shape
            self.values[inp.name] = mx.sym.var(name)
        unknown = set(input_shapes) - {i.name for i in self.graph.input} - set(self.shapes)
        if unknown:
            raise GraphError("input_shapes names %s, which %s not an input of the ONNX graph (inputs: %s)"
                             % (", ".join(sorted(unknown)), "is" if len(unknown) == 1 else "are",
                                ", ".join(sorted(self.shapes)) or "none"))

    # ---- names and shapes ----

    def _unique(self, name: str) -> str:
        base = re.sub(r"[^A-Za-z0-9_]", "_", name).strip("_") or "node"
        if base[0].isdigit():
            base = "v" + base
        out, i = base, 1
        while out in self.names:
            out, i = "%s_%d" % (base, i), i + 1
        self.names.add(out)
        return out

    def _input_shape(self, inp, name: str, given: Mapping[str, Sequence[int]]) -> Tuple[int, ...]:
        for key in (inp.name, name):
            if key in given:
                return tuple(int(d) for d in given[key])
        dims = inp.type.tensor_type.shape.dim
        shape, symbolic = [], []
        for i, d in enumerate(dims):
            if d.HasField("dim_value") and d.dim_value > 0:
                shape.append(d.dim_value)
            elif i == 0:
                shape.append(1)   # the batch dimension
            else:
                shape.append(None)
                symbolic.append(d.dim_param or "?")
        if symbolic or not inp.type.tensor_type.HasField("shape"):
            raise GraphError("input '%s' has symbolic dimension(s) %s; pass input_shapes={'%s': (...)}"
                             % (inp.name, ", ".join(symbolic) or "(no shape)", inp.name))
        return tuple(shape)

    def shape(self, sym) -> Tuple[int, ...]:
        hit = self.shape_cache.get(id(sym))
        if hit is None:
            with contextlib.redirect_stdout(io.StringIO()):   # MXNet prints every argument's shape on failure
                _, out, _ = sym.infer_shape(**{a: self.shapes[a] for a in sym.list_arguments()})
            hit = self.shape_cache[id(sym)] = (sym, tuple(out[0]))   # holding sym keeps its id unique
        return hit[1]

    def const_var(self, value: np.ndarray, hint: str, dtype=np.float32):
        """An MXNet variable holding the constant ``value`` (one per distinct ONNX value)."""
        name = self._unique(hint)
        arr = np.ascontiguousarray(np.asarray(value).astype(dtype))
        self.params[name] = arr
        self.shapes[name] = arr.shape
        return self.mx.sym.var(name)

    def as_sym(self, value, hint: str, onnx_name: Optional[str] = None):
        if not isinstance(value, np.ndarray):
            return value
        if onnx_name is not None and onnx_name in self.vars:
            cached = self.vars[onnx_name]
            if self.params[cached.name].shape == value.shape:
                return cached
        var = self.const_var(value, onnx_name or hint)
        if onnx_name is not None:
            self.vars[onnx_name] = var
        return var

    # ---- the pass ----

    def run(self):
        mx = self.mx
        for node in self.graph.node:
            self.node = node
            self.node_name = node.name or (node.output[0] if node.output else node.op_type)
            try:
                outs = self.convert(node)
            except FusionError:
                raise
            except mx.base.MXNetError as e:
                raise GraphError("ONNX node '%s' (%s): MXNet rejects it: %s"
                                 % (self.node_name, node.op_type, _first_line(e))) from None
            except (ValueError, IndexError, TypeError, KeyError, ZeroDivisionError) as e:
                raise GraphError("ONNX node '%s' (%s): cannot import: %s"
                                 % (self.node_name, node.op_type, _first_line(e) or type(e).__name__)) from None
            for name, value in zip(node.output, outs):
                if name:
                    self.values[name] = value
        heads = []
        for out in self.graph.output:
            value = self.values[out.name]
            if isinstance(value, np.ndarray):
                raise GraphError("graph output '%s' is a constant; MXNet symbols cannot output constants" % out.name)
            heads.append(value)
        sym = heads[0] if len(heads) == 1 else mx.sym.Group(heads)
        args, auxs = set(sym.list_arguments()), set(sym.list_auxiliary_states())
        arg_params = {k: mx.nd.array(v, dtype=v.dtype) for k, v in self.params.items() if k in args}
        aux_params = {k: mx.nd.array(v, dtype=v.dtype) for k, v in self.params.items() if k in auxs}
        return sym, arg_params, aux_params

    def attrs(self, node) -> Dict[str, Any]:
        from onnx import helper
        return {a.name: helper.get_attribute_value(a) for a in node.attribute}

    def convert(self, node) -> List[Any]:
        ins = [self.values[n] if n else None for n in node.input]
        attrs = self.attrs(node)
        domain = node.domain if node.domain not in ("", "ai.onnx") else ""
        key = node.op_type if not domain else domain + "." + node.op_type
        if key == "com.microsoft.Gelu":
            key = "Gelu"
        if node.op_type == "Constant" and not domain:
            return [self._constant(attrs)]
        if node.op_type in ("Shape", "Size") and not domain and ins and not isinstance(ins[0], np.ndarray):
            # known once input shapes are: MXNet infers it, and the shape chain folds to constants
            return [_fold_shape_only(node.op_type, np.array(self.shape(ins[0]), dtype=np.int64), attrs)]
        if all(v is None or isinstance(v, np.ndarray) for v in ins) and key in _FOLD:
            out = _FOLD[key](self, ins, attrs)
            return [np.asarray(o) for o in (out if isinstance(out, list) else [out])]
        handler = _SYMBOLIC.get(key)
        known = _KNOWN_ATTRS.get(key)
        if handler is not None and known is not None and set(attrs) - known:
            raise GraphError("ONNX node '%s' (%s): attribute(s) %s not supported (known: %s)"
                             % (self.node_name, node.op_type, ", ".join(sorted(set(attrs) - known)),
                                ", ".join(sorted(known)) or "none"))
        if handler is None:
            where = " (domain %s)" % domain if domain else ""
            if key in _FOLD:
                raise GraphError("ONNX op %s in node '%s' is supported only on constant inputs; its inputs here "
                                 "are computed at run time" % (node.op_type, self.node_name))
            raise GraphError("unsupported ONNX op %s%s in node '%s' (opset %d)"
                             % (node.op_type, where, self.node_name, self.opset))
        if ins and isinstance(ins[0], np.ndarray) and all(v is None or isinstance(v, np.ndarray) for v in ins):
            ins[0] = self.as_sym(ins[0], self.node_name + "_in", node.input[0])   # no NumPy version: run it
        out = handler(self, ins, attrs)
        return out if isinstance(out, list) else [out]

    def _constant(self, attrs) -> np.ndarray:
        from onnx import numpy_helper
        if "value" in attrs:
            return numpy_helper.to_array(attrs["value"])
        for key, dtype in (("value_float", np.float32), ("value_floats", np.float32),
                           ("value_int", np.int64), ("value_ints", np.int64)):
            if key in attrs:
                return np.array(attrs[key], dtype=dtype)
        raise GraphError("ONNX node '%s' (Constant): unsupported value attribute %s"
                         % (self.node_name, ", ".join(attrs) or "(none)"))

    def sym_op(self, name: str):
        """An MXNet symbol function by op name (``_div_scalar`` and friends live in ``_internal``)."""
        return getattr(self.mx.sym, name, None) or getattr(self.mx.sym._internal, name)

    def fail(self, what: str):
        raise GraphError("ONNX node '%s' (%s): %s" % (self.node_name, self.node.op_type, what))

    def op_name(self, suffix: str = "") -> str:
        return self._unique(self.node_name + suffix)

    def rank(self, value) -> int:
        return value.ndim if isinstance(value, np.ndarray) else len(self.shape(value))

    def axis(self, axis: int, rank: int) -> int:
        a = int(axis)
        if not -rank <= a < rank:
            self.fail("axis %d is out of range for rank %d" % (a, rank))
        return a + rank if a < 0 else a

    def const_input(self, value, what: str) -> np.ndarray:
        if value is not None and not isinstance(value, np.ndarray):
            self.fail("%s must be a constant (an initializer or computable from shapes)" % what)
        return value


def _fold_shape_only(op, shape, attrs):
    if op == "Size":
        return np.array(int(np.prod(shape)), dtype=np.int64)
    start, end = attrs.get("start", 0), attrs.get("end", None)
    return shape[start:end].copy()


# --------------------------------------------------------------------------------------------
# Constant folding with NumPy (shape arithmetic, initializer transforms)
# --------------------------------------------------------------------------------------------

_ONNX_TO_NP = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64,
               9: np.bool_, 10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64}


def _np_dtype(im, to: int):
    if to not in _ONNX_TO_NP:
        im.fail("unsupported tensor type %d" % to)
    return _ONNX_TO_NP[to]


def _axes_input(im, ins, attrs, index=1):
    """Axes from the attribute (older opsets) or the optional constant input (newer)."""
    if "axes" in attrs:
        return [int(a) for a in attrs["axes"]]
    if len(ins) > index and ins[index] is not None:
        return [int(a) for a in im.const_input(ins[index], "axes").reshape(-1)]
    return None


def _np_div(a, b):
    if np.issubdtype(np.result_type(a, b), np.integer):
        return (np.trunc(a / b)).astype(np.result_type(a, b))
    return a / b


def _np_gather(im, ins, attrs):
    data, idx = ins
    axis = im.axis(attrs.get("axis", 0), data.ndim)
    idx = np.where(idx < 0, idx + data.shape[axis], idx)
    return np.take(data, idx.astype(np.int64), axis=axis)


def _np_slice(im, ins, attrs):
    data = ins[0]
    if len(ins) > 1:
        starts, ends = ins[1], ins[2]
        axes = ins[3] if len(ins) > 3 and ins[3] is not None else np.arange(len(starts))
        steps = ins[4] if len(ins) > 4 and ins[4] is not None else np.ones(len(starts), np.int64)
    else:
        starts, ends = attrs["starts"], attrs["ends"]
        axes, steps = attrs.get("axes", list(range(len(starts)))), [1] * len(starts)
    index = [slice(None)] * data.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        index[im.axis(int(a), data.ndim)] = slice(int(s), int(e), int(st))
    return data[tuple(index)]


def _np_squeeze(im, ins, attrs):
    axes = _axes_input(im, ins, attrs)
    if axes is None:
        return np.squeeze(ins[0])
    return np.squeeze(ins[0], axis=tuple(im.axis(a, ins[0].ndim) for a in axes))


def _np_unsqueeze(im, ins, attrs):
    axes = _axes_input(im, ins, attrs)
    rank = ins[0].ndim + len(axes)
    out = ins[0]
    for a in sorted(im.axis(a, rank) for a in axes):
        out = np.expand_dims(out, a)
    return out


def _np_reshape(im, ins, attrs):
    data, shape = ins[0], [int(s) for s in ins[1]]
    if not attrs.get("allowzero", 0):
        shape = [data.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return data.reshape(shape)


def _np_split(im, ins, attrs):
    data = ins[0]
    axis = im.axis(attrs.get("axis", 0), data.ndim)
    sizes = attrs.get("split") or (list(ins[1]) if len(ins) > 1 and ins[1] is not None else None)
    n = len(im.node.output)
    if sizes is None:
        sizes = [-(-data.shape[axis] // n)] * n
        sizes[-1] = data.shape[axis] - sum(sizes[:-1])
    return list(np.split(data, np.cumsum(sizes)[:-1], axis=axis))


def _np_reduce(fn):
    def fold(im, ins, attrs):
        axes = _axes_input(im, ins, attrs) or None     # an empty axes input is no axes (opset 18)
        if axes is None and attrs.get("noop_with_empty_axes", 0):
            return ins[0]
        axes = None if axes is None else tuple(im.axis(a, ins[0].ndim) for a in axes)
        return np.asarray(fn(ins[0], axis=axes, keepdims=bool(attrs.get("keepdims", 1))))
    return fold


def _np_const_of_shape(im, ins, attrs):
    from onnx import numpy_helper
    value = numpy_helper.to_array(attrs["value"]) if "value" in attrs else np.zeros(1, np.float32)
    return np.full([int(s) for s in ins[0]], value.reshape(-1)[0], dtype=value.dtype)


def _np_erf(x):
    import math
    return np.vectorize(math.erf, otypes=[np.float64])(x).astype(x.dtype)


def _keep_dtype(fn):
    return lambda im, ins, attrs: np.asarray(fn(*ins)).astype(ins[0].dtype)


_FOLD: Dict[str, Callable] = {
    "Identity": lambda im, ins, a: ins[0],
    "Dropout": lambda im, ins, a: ins[0],
    "Cast": lambda im, ins, a: ins[0].astype(_np_dtype(im, a["to"])),
    "Shape": lambda im, ins, a: _fold_shape_only("Shape", np.array(ins[0].shape, np.int64), a),
    "Size": lambda im, ins, a: np.array(ins[0].size, np.int64),
    "Gather": _np_gather,
    "Unsqueeze": _np_unsqueeze,
    "Squeeze": _np_squeeze,
    "Concat": lambda im, ins, a: np.concatenate(ins, axis=int(a["axis"])),
    "Reshape": _np_reshape,
    "Flatten": lambda im, ins, a: ins[0].reshape(
        int(np.prod(ins[0].shape[:_flatten_axis(im, a, ins[0].ndim)])), int(np.prod(
            ins[0].shape[_flatten_axis(im, a, ins[0].ndim):]))),
    "Transpose": lambda im, ins, a: np.transpose(ins[0], a.get("perm")),
    "Slice": _np_slice,
    "Split": _np_split,
    "Add": _keep_dtype(np.add), "Sub": _keep_dtype(np.subtract), "Mul": _keep_dtype(np.multiply),
    "Div": lambda im, ins, a: np.asarray(_np_div(*ins)).astype(ins[0].dtype),
    "Pow": _keep_dtype(np.power), "Mod": _keep_dtype(np.mod),
    "Max": lambda im, ins, a: np.maximum.reduce(ins), "Min": lambda im, ins, a: np.minimum.reduce(ins),
    "Sum": lambda im, ins, a: np.add.reduce(ins),
    "Neg": _keep_dtype(np.negative), "Abs": _keep_dtype(np.abs), "Sqrt": _keep_dtype(np.sqrt),
    "Reciprocal": _keep_dtype(np.reciprocal), "Exp": _keep_dtype(np.exp), "Log": _keep_dtype(np.log),
    "Floor": _keep_dtype(np.floor), "Ceil": _keep_dtype(np.ceil), "Erf": lambda im, ins, a: _np_erf(ins[0]),
    "Relu": lambda im, ins, a: np.maximum(ins[0], 0).astype(ins[0].dtype),
    "Equal": lambda im, ins, a: np.equal(*ins), "Less": lambda im, ins, a: np.less(*ins),
    "Greater": lambda im, ins, a: np.greater(*ins), "Not": lambda im, ins, a: np.logical_not(ins[0]),
    "And": lambda im, ins, a: np.logical_and(*ins), "Or": lambda im, ins, a: np.logical_or(*ins),
    "Where": lambda im, ins, a: np.where(*ins),
    "Range": lambda im, ins, a: np.arange(ins[0], ins[1], ins[2]).astype(ins[0].dtype),
    "ConstantOfShape": _np_const_of_shape,
    "Expand": lambda im, ins, a: (ins[0] * np.ones([int(s) for s in ins[1]], dtype=ins[0].dtype)),
    "ReduceProd": _np_reduce(np.prod), "ReduceSum": _np_reduce(np.sum), "ReduceMean": _np_reduce(np.mean),
    "ReduceMax": _np_reduce(np.max), "ReduceMin": _np_reduce(np.min),
}


# --------------------------------------------------------------------------------------------
# Run-time ops: ONNX -> MXNet symbol
# --------------------------------------------------------------------------------------------

def _unary(mx_op: str, **kw):
    def conv(im, ins, attrs):
        return getattr(im.mx.sym, mx_op)(ins[0], name=im.op_name(), **kw)
    return conv


def _activation(act: str):
    return lambda im, ins, attrs: im.mx.sym.Activation(ins[0], act_type=act, name=im.op_name())


_SCALAR_OPS = {"Add": ("_plus_scalar", "_plus_scalar"), "Sub": ("_minus_scalar", "_rminus_scalar"),
               "Mul": ("_mul_scalar", "_mul_scalar"), "Div": ("_div_scalar", "_rdiv_scalar"),
               "Pow": ("_power_scalar", "_rpower_scalar"), "Max": ("_maximum_scalar", "_maximum_scalar"),
               "Min": ("_minimum_scalar", "_minimum_scalar"), "Equal": ("_equal_scalar", "_equal_scalar"),
               "Greater": ("_greater_scalar", "_lesser_scalar"), "Less": ("_lesser_scalar", "_greater_scalar")}
_ELEMWISE = {"Add": "elemwise_add", "Sub": "elemwise_sub", "Mul": "elemwise_mul", "Div": "elemwise_div"}
_BROADCAST = {"Add": "broadcast_add", "Sub": "broadcast_sub", "Mul": "broadcast_mul", "Div": "broadcast_div",
              "Pow": "broadcast_power", "Max": "broadcast_maximum", "Min": "broadcast_minimum",
              "Equal": "broadcast_equal", "Greater": "broadcast_greater", "Less": "broadcast_lesser",
              "And": "broadcast_logical_and", "Or": "broadcast_logical_or"}


def _binary(op: str):
    def conv(im, ins, attrs, names=None):
        """``names``: the ONNX names of a and b (constants are cached by name), None for a value that is
        not the named one (default: the node's first two inputs)."""
        a, b = ins
        mx = im.mx
        names = list(im.node.input[:2]) if names is None else list(names)
        if op == "Sub" and isinstance(b, np.ndarray) and not isinstance(a, np.ndarray) \
                and np.issubdtype(b.dtype, np.floating) and b.size > 1:
            # x - c as x + (-c), bitwise the same: MXNet's exporter writes LayerNorm's "+ beta" as
            # "- (-beta)", and the layer-norm rules match the Add (-c is not the value named c)
            return _binary("Add")(im, [a, np.negative(b)], attrs, [names[0], None])
        if op == "Add":
            fused = _fc_bias(im, a, b, names)
            if fused is not None:
                return fused
        for x, c, rev in ((a, b, False), (b, a, True)):
            if isinstance(c, np.ndarray) and c.size == 1 and c.ndim <= im.rank(x):
                value = float(c.reshape(-1)[0])
                if op == "Pow" and not rev and value in (2.0, 0.5, 1.0):
                    return {2.0: mx.sym.square, 0.5: mx.sym.sqrt, 1.0: mx.sym.identity}[value](x, name=im.op_name())
                name = _SCALAR_OPS[op][1 if rev else 0] if op in _SCALAR_OPS else None
                if name is not None:
                    return im.sym_op(name)(x, scalar=value, name=im.op_name())
        ra, rb = im.rank(a), im.rank(b)
        a, b = _align(im, a, rb - ra, "a"), _align(im, b, ra - rb, "b")
        a = im.as_sym(a, im.node_name + "_a", names[0] if ra >= rb else None)
        b = im.as_sym(b, im.node_name + "_b", names[1] if rb >= ra else None)
        if op in _ELEMWISE and im.shape(a) == im.shape(b):
            return getattr(mx.sym, _ELEMWISE[op])(a, b, name=im.op_name())
        return getattr(mx.sym, _BROADCAST[op])(a, b, name=im.op_name())
    return conv


def _align(im, x, extra: int, tag: str):
    """Prepend ``extra`` unit dimensions (ONNX broadcasting is right-aligned, MXNet's is not)."""
    if extra <= 0:
        return x
    if isinstance(x, np.ndarray):
        return x.reshape((1,) * extra + x.shape)
    for i in range(extra):
        x = im.mx.sym.expand_dims(x, axis=0, name=im.op_name("_expand%s%d" % (tag, i)))
    return x


def _variadic(op: str):
    def conv(im, ins, attrs):
        acc = ins[0]
        for i, x in enumerate(ins[1:]):
            acc = _binary(op)(im, [acc, x], attrs, [im.node.input[0] if i == 0 else None, im.node.input[i + 1]])
        return acc
    return conv


def _matmul(im, ins, attrs):
    a, b = ins
    mx = im.mx
    if isinstance(b, np.ndarray) and not isinstance(a, np.ndarray):
        if b.ndim != 2 or im.rank(a) < 2:
            im.fail("MatMul with a constant of rank %d and an input of rank %d is not supported"
                    % (b.ndim, im.rank(a)))
        weight = im.as_sym(np.ascontiguousarray(b.T), im.node_name + "_weight")
        name = im.op_name()
        out = mx.sym.FullyConnected(a, weight, num_hidden=b.shape[1], no_bias=True, flatten=False, name=name)
        if im.uses.get(im.node.output[0], 0) == 1:
            im.pending_fc[im.node.output[0]] = (a, weight, b.shape[1], name)
        return out
    ra, rb = im.rank(a), im.rank(b)
    if ra != rb or ra < 2:
        im.fail("MatMul of ranks %d and %d is not supported (needs equal ranks >= 2)" % (ra, rb))
    transpose_b = False
    src = im.transposes.get(im.node.input[1])
    # k.transpose(-1, -2) after the head split: use batch_dot(transpose_b=True) and keep the split
    # transpose (0, 2, 1, 3) that q and v have too, when the last axis stays innermost that way.
    if src is not None and im.uses.get(im.node.input[1], 0) == 1 and src[1][-2] == len(src[1]) - 1:
        inner, perm = src
        swapped = perm[:-2] + (perm[-1], perm[-2])
        b, transpose_b = inner, True
        if swapped != tuple(range(len(perm))):
            b = mx.sym.transpose(inner, axes=swapped, name=im.op_name("_transpose_b"))
    a = im.as_sym(a, im.node_name + "_a", im.node.input[0])
    b = im.as_sym(b, im.node_name + "_b", None if transpose_b else im.node.input[1])
    sa, sb = im.shape(a), im.shape(b)
    if sa[:-2] != sb[:-2]:
        im.fail("MatMul broadcasting over batch dimensions %s vs %s is not supported" % (sa[:-2], sb[:-2]))
    if ra == 2:
        return mx.sym.dot(a, b, transpose_b=transpose_b, name=im.op_name())
    return mx.sym.batch_dot(a, b, transpose_b=transpose_b, name=im.op_name())


def _fc_bias(im, a, b, names):
    """MatMul(x, W) + bias, the bias a constant vector: one FullyConnected with bias."""
    for x_name, bias in ((names[0], b), (names[1], a)):
        pending = im.pending_fc.get(x_name)
        if pending is None or not isinstance(bias, np.ndarray):
            continue
        data, weight, n, name = pending
        if bias.size != n or bias.shape[-1:] != (n,) or im.rank(data) < bias.ndim:
            continue
        del im.pending_fc[x_name]
        bias_var = im.as_sym(bias.reshape(n), im.node_name + "_bias")
        return im.mx.sym.FullyConnected(data, weight, bias_var, num_hidden=n, flatten=False, name=name)
    return None


def _gemm(im, ins, attrs):
    """Y = alpha·A'·B' + beta·C (A' = Aᵀ with transA, B' = Bᵀ with transB), C broadcast to (M, N).

    A constant B becomes FullyConnected's weight (alpha folded in), and a C that is one value per
    column (shape (N,), (1, N), (1,) or ()) its bias; any other C is added after, broadcast."""
    a, b = ins[0], ins[1]
    c = ins[2] if len(ins) > 2 else None
    alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
    trans_a, trans_b = bool(attrs.get("transA", 0)), bool(attrs.get("transB", 0))
    mx = im.mx
    for what, v in (("A", a), ("B", b)):
        if im.rank(v) != 2:
            im.fail("input %s has rank %d; Gemm takes 2-D A and B" % (what, im.rank(v)))
    a = im.as_sym(a, im.node_name + "_a", im.node.input[0])
    if trans_a:
        a = mx.sym.transpose(a, axes=(1, 0), name=im.op_name("_transpose_a"))
    m_rows = im.shape(a)[0]
    if c is not None and beta == 0.0:
        c = None
    if isinstance(b, np.ndarray):
        w = b if trans_b else b.T                      # (N, K)
        n = w.shape[0]
        weight = im.as_sym(np.ascontiguousarray(w * np.float32(alpha) if alpha != 1.0 else w),
                           im.node_name + "_weight", im.node.input[1] if alpha == 1.0 and trans_b else None)
        bias = None
        if isinstance(c, np.ndarray) and c.ndim <= 2 and c.size in (1, n) and \
                (c.ndim == 0 or c.shape[-1] in (1, n)) and (c.ndim < 2 or c.shape[0] == 1):
            bias_value = np.broadcast_to(c.reshape(-1) * np.float32(beta), (n,)).astype(np.float32)
            plain = beta == 1.0 and c.shape == (n,)
            bias = im.as_sym(np.ascontiguousarray(bias_value), im.node_name + "_bias",
                             im.node.input[2] if plain else None)
            c = None
        src = im.flattened.get(im.node.input[0])
        if src is not None and not trans_a and c is None:
            # Flatten(axis=-1) -> Gemm: FullyConnected(flatten=False) on the unflattened input, the form
            # the rules match; the Reshape back to (..., N) that follows gives it back unchanged
            full = mx.sym.FullyConnected(src, weight, bias, num_hidden=n, no_bias=bias is None, flatten=False,
                                         name=im.op_name())
            if im.uses.get(im.node.output[0], 0) == 1:
                im.unflattened[im.node.output[0]] = (full, im.shape(full))
            return mx.sym.reshape(full, shape=(-1, n), name=im.op_name("_flat"))
        out = mx.sym.FullyConnected(a, weight, bias, num_hidden=n, no_bias=bias is None,
                                    name=im.op_name() if c is None else im.op_name("_fc"))
    else:
        b = im.as_sym(b, im.node_name + "_b", im.node.input[1])
        n = im.shape(b)[0 if trans_b else 1]
        out = mx.sym.dot(a, b, transpose_b=trans_b, name=im.op_name() if c is None and alpha == 1.0
                         else im.op_name("_dot"))
        if alpha != 1.0:
            out = im.sym_op("_mul_scalar")(out, scalar=alpha, name=im.op_name() if c is None
                                           else im.op_name("_alpha"))
    if c is None:
        return out
    c_shape = c.shape if isinstance(c, np.ndarray) else im.shape(c)
    try:
        np.broadcast_shapes(c_shape, (m_rows, n))
        ok = len(c_shape) <= 2 and tuple(np.broadcast_shapes(c_shape, (m_rows, n))) == (m_rows, n)
    except ValueError:
        ok = False
    if not ok:
        im.fail("C of shape %s does not broadcast to the output (%d, %d)" % (tuple(c_shape), m_rows, n))
    if isinstance(c, np.ndarray):
        c = im.as_sym(np.ascontiguousarray((c * np.float32(beta)).reshape((1,) * (2 - c.ndim) + c.shape)
                                           .astype(np.float32)), im.node_name + "_c")
    else:
        if beta != 1.0:
            c = im.sym_op("_mul_scalar")(c, scalar=beta, name=im.op_name("_beta"))
        c = _align(im, c, 2 - len(c_shape), "c")
    if im.shape(c) == (m_rows, n):
        return mx.sym.elemwise_add(out, c, name=im.op_name())
    return mx.sym.broadcast_add(out, c, name=im.op_name())


def _pads(im, attrs, nd: int, in_shape=None, kernel=None, strides=None, dilations=None):
    """Symmetric (begin == end) padding per spatial axis; auto_pad resolved from the input shape."""
    auto = attrs.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        pads = []
        for i in range(nd):
            size, k, s, d = in_shape[2 + i], kernel[i], strides[i], dilations[i]
            total = max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)
            pads.append((total // 2, total - total // 2) if auto == "SAME_UPPER" else (total - total // 2, total // 2))
        begin, end = [p[0] for p in pads], [p[1] for p in pads]
    elif auto == "VALID":
        begin = end = [0] * nd
    else:
        p = list(attrs.get("pads", [0] * 2 * nd))
        begin, end = p[:nd], p[nd:]
    return tuple(int(x) for x in begin), tuple(int(x) for x in end)


def _maybe_pad(im, x, begin, end, value=0.0):
    """MXNet's Convolution/Pooling pad symmetrically; asymmetric padding becomes a Pad op first."""
    if begin == end:
        return x, begin
    if len(begin) not in (2, 3):
        im.fail("asymmetric padding is supported for 2-D and 3-D inputs only")
    width = (0, 0, 0, 0) + tuple(v for be in zip(begin, end) for v in be)
    return im.mx.sym.pad(x, mode="constant", pad_width=width, constant_value=value,
                         name=im.op_name("_pad")), (0,) * len(begin)


def _conv(im, ins, attrs):
    x, w = ins[0], ins[1]
    bias = ins[2] if len(ins) > 2 else None
    im.const_input(w, "the weight")
    nd = w.ndim - 2
    kernel = tuple(attrs.get("kernel_shape", w.shape[2:]))
    strides = tuple(attrs.get("strides", (1,) * nd))
    dilations = tuple(attrs.get("dilations", (1,) * nd))
    begin, end = _pads(im, attrs, nd, im.shape(x), kernel, strides, dilations)
    x, pad = _maybe_pad(im, x, begin, end)
    args = [x, im.as_sym(w, im.node_name + "_weight", im.node.input[1])]
    if bias is not None:
        args.append(im.as_sym(im.const_input(bias, "the bias"), im.node_name + "_bias", im.node.input[2]))
    return im.mx.sym.Convolution(*args, kernel=kernel, stride=strides, dilate=dilations, pad=pad,
                                 num_filter=w.shape[0], num_group=int(attrs.get("group", 1)),
                                 no_bias=bias is None, name=im.op_name())


def _pool(pool_type: str):
    def conv(im, ins, attrs):
        x = ins[0]
        if len(im.node.output) > 1 and im.node.output[1]:
            im.fail("the Indices output is not supported")
        kernel = tuple(attrs["kernel_shape"])
        nd = len(kernel)
        strides = tuple(attrs.get("strides", (1,) * nd))
        dilations = tuple(attrs.get("dilations", (1,) * nd))
        if any(d != 1 for d in dilations):
            im.fail("dilated pooling is not supported")
        begin, end = _pads(im, attrs, nd, im.shape(x), kernel, strides, dilations)
        include = bool(attrs.get("count_include_pad", 0))
        if begin != end and pool_type == "avg" and not include:
            im.fail("asymmetric padding with count_include_pad=0 is not supported")
        x, pad = _maybe_pad(im, x, begin, end, -_FLT_MAX if pool_type == "max" else 0.0)
        return im.mx.sym.Pooling(x, kernel=kernel, stride=strides, pad=pad, pool_type=pool_type,
                                 pooling_convention="full" if attrs.get("ceil_mode", 0) else "valid",
                                 count_include_pad=include, name=im.op_name())
    return conv


def _global_pool(pool_type: str):
    def conv(im, ins, attrs):
        nd = im.rank(ins[0]) - 2
        return im.mx.sym.Pooling(ins[0], kernel=(1,) * nd, global_pool=True, pool_type=pool_type,
                                 name=im.op_name())
    return conv


def _batch_norm(im, ins, attrs):
    if attrs.get("training_mode", 0) or (len(im.node.output) > 1 and any(im.node.output[1:])):
        im.fail("training mode (running-statistics outputs) is not supported")
    x = ins[0]
    consts = [im.const_input(v, what) for v, what in zip(ins[1:], ("scale", "B", "mean", "var"))]
    names = ("_gamma", "_beta", "_moving_mean", "_moving_var")
    args = [im.const_var(v, im.node_name + n) for v, n in zip(consts, names)]
    return im.mx.sym.BatchNorm(x, *args, eps=float(attrs.get("epsilon", 1e-5)),
                               momentum=float(attrs.get("momentum", 0.9)), fix_gamma=False,
                               use_global_stats=True, axis=1, name=im.op_name())


def _flatten_axis(im, attrs, rank: int) -> int:
    """Flatten's axis: in [-rank, rank], a negative one counting from the back (-1 keeps the last dim)."""
    a = int(attrs.get("axis", 1))
    if not -rank <= a <= rank:
        im.fail("axis %d is out of range for rank %d (Flatten takes [-%d, %d])" % (a, rank, rank, rank))
    return a + rank if a < 0 else a


def _flatten(im, ins, attrs):
    x = ins[0]
    shape = im.shape(x)
    axis = _flatten_axis(im, attrs, len(shape))
    if axis == len(shape) - 1 and len(shape) > 2 and im.uses.get(im.node.output[0], 0) == 1:
        im.flattened[im.node.output[0]] = x
    if axis == 1:
        return im.mx.sym.flatten(x, name=im.op_name())
    if axis == 0:
        return im.mx.sym.reshape(x, shape=(1, -1), name=im.op_name())
    # (prod(shape[:axis]), prod(shape[axis:])) written without the leading sizes: batch-size agnostic
    return im.mx.sym.reshape(x, shape=(-1, int(np.prod(shape[axis:]))), name=im.op_name())


def _reshape_result(in_shape, target, allowzero) -> Optional[Tuple[int, ...]]:
    """The shape ONNX's Reshape gives ``in_shape`` for ``target`` (None where it does not divide)."""
    out = [in_shape[i] if s == 0 and not allowzero else s for i, s in enumerate(target)]
    if -1 in out:
        rest = int(np.prod([s for s in out if s != -1]))
        total = int(np.prod(in_shape))
        if rest == 0 or total % rest:
            return None
        out[out.index(-1)] = total // rest
    return tuple(out) if int(np.prod(out)) == int(np.prod(in_shape)) else None


def _reshape(im, ins, attrs):
    x = ins[0]
    target = [int(s) for s in im.const_input(ins[1], "the target shape").reshape(-1)]
    if attrs.get("allowzero", 0) and 0 in target:
        im.fail("allowzero=1 with a zero in the shape (an empty tensor) is not supported")
    in_shape = im.shape(x)
    bad = [s for s in target if s < -1]
    if bad or target.count(-1) > 1:
        im.fail("invalid target shape %s (sizes are >= 0, with at most one -1)" % (target,))
    if not attrs.get("allowzero", 0) and any(s == 0 and i >= len(in_shape) for i, s in enumerate(target)):
        im.fail("target shape %s copies (0) a dimension past the input's rank %d" % (target, len(in_shape)))
    full = im.unflattened.get(im.node.input[0])
    if full is not None and _reshape_result(in_shape, target, attrs.get("allowzero", 0)) == full[1]:
        return full[0]
    # Leading sizes equal to the input's become 0 (copy): the folded shape stays batch-size agnostic.
    out = list(target)
    for i, s in enumerate(target):
        if i < len(in_shape) and s == in_shape[i] and -1 not in target[:i]:
            out[i] = 0
        else:
            break
    if -1 not in out and out.count(0) == len(out) and len(out) == len(in_shape):
        return x
    return im.mx.sym.reshape(x, shape=tuple(out), name=im.op_name())


def _transpose(im, ins, attrs):
    x = ins[0]
    rank = im.rank(x)
    perm = tuple(int(p) for p in attrs.get("perm", range(rank - 1, -1, -1)))
    im.transposes[im.node.output[0]] = (x, perm)
    return im.mx.sym.transpose(x, axes=perm, name=im.op_name())


def _squeeze(im, ins, attrs):
    x = ins[0]
    shape = im.shape(x)
    axes = _axes_input(im, ins, attrs)
    axes = tuple(i for i, d in enumerate(shape) if d == 1) if axes is None else \
        tuple(sorted(im.axis(a, len(shape)) for a in axes))
    if not axes:
        return x
    return im.mx.sym.squeeze(x, axis=axes, name=im.op_name())


def _unsqueeze(im, ins, attrs):
    x = ins[0]
    axes = _axes_input(im, ins, attrs)
    rank = im.rank(x) + len(axes)
    for i, a in enumerate(sorted(im.axis(a, rank) for a in axes)):
        x = im.mx.sym.expand_dims(x, axis=a, name=im.op_name("" if i == 0 else "_%d" % i))
    return x


def _concat(im, ins, attrs):
    rank = max(im.rank(v) for v in ins)
    axis = im.axis(attrs["axis"], rank)
    parts = [im.as_sym(v, "%s_in%d" % (im.node_name, i), im.node.input[i]) for i, v in enumerate(ins)
             if not (isinstance(v, np.ndarray) and v.size == 0)]
    return im.mx.sym.concat(*parts, dim=axis, name=im.op_name())


def _slice(im, ins, attrs):
    x = ins[0]
    shape = im.shape(x)
    if len(ins) > 1:
        starts, ends = (im.const_input(v, "starts/ends").reshape(-1) for v in ins[1:3])
        axes = ins[3] if len(ins) > 3 and ins[3] is not None else np.arange(len(starts))
        steps = ins[4] if len(ins) > 4 and ins[4] is not None else np.ones(len(starts), np.int64)
    else:
        starts, ends = attrs["starts"], attrs["ends"]
        axes, steps = attrs.get("axes", list(range(len(starts)))), [1] * len(starts)
    for i, (s, e, a, st) in enumerate(zip(starts, ends, axes, steps)):
        a = im.axis(int(a), len(shape))
        idx = slice(int(s), int(e), int(st)).indices(shape[a])
        if int(st) == 1:
            x = im.mx.sym.slice_axis(x, axis=a, begin=idx[0], end=max(idx[1], idx[0]),
                                     name=im.op_name("" if i == 0 else "_%d" % i))
        else:
            begin, end, step = [None] * len(shape), [None] * len(shape), [None] * len(shape)
            begin[a], end[a], step[a] = idx[0], (idx[1] if idx[1] >= 0 else None), idx[2]
            x = im.mx.sym.slice(x, begin=tuple(begin), end=tuple(end), step=tuple(step),
                                name=im.op_name("" if i == 0 else "_%d" % i))
    return x


def _split(im, ins, attrs):
    x = ins[0]
    shape = im.shape(x)
    axis = im.axis(attrs.get("axis", 0), len(shape))
    sizes = attrs.get("split")
    if sizes is None and len(ins) > 1 and ins[1] is not None:
        sizes = [int(s) for s in im.const_input(ins[1], "split")]
    n = len(im.node.output)
    if sizes is None:
        sizes = [-(-shape[axis] // n)] * n
        sizes[-1] = shape[axis] - sum(sizes[:-1])
    outs, start = [], 0
    for i, size in enumerate(sizes):
        outs.append(im.mx.sym.slice_axis(x, axis=axis, begin=start, end=start + int(size),
                                         name=im.op_name("_%d" % i)))
        start += int(size)
    return outs


def _gather(im, ins, attrs):
    data, idx = ins
    mx = im.mx
    if isinstance(data, np.ndarray):
        axis = im.axis(attrs.get("axis", 0), data.ndim)
        if data.ndim == 2 and axis == 0:   # an embedding lookup
            weight = im.as_sym(data, im.node_name + "_weight", im.node.input[0])
            return mx.sym.Embedding(idx, weight, input_dim=data.shape[0], output_dim=data.shape[1],
                                    name=im.op_name())
        return mx.sym.take(im.as_sym(data, im.node_name + "_data", im.node.input[0]), idx, axis=axis,
                           name=im.op_name())
    shape = im.shape(data)
    axis = im.axis(attrs.get("axis", 0), len(shape))
    if not isinstance(idx, np.ndarray):
        return mx.sym.take(data, idx, axis=axis, mode="clip", name=im.op_name())
    idx = np.where(idx < 0, idx + shape[axis], idx).astype(np.int64)
    if idx.ndim == 0:
        i = int(idx)
        part = mx.sym.slice_axis(data, axis=axis, begin=i, end=i + 1, name=im.op_name("_slice"))
        return mx.sym.squeeze(part, axis=axis, name=im.op_name())
    indices = im.const_var(idx, im.node_name + "_indices")
    return mx.sym.take(data, indices, axis=axis, name=im.op_name())


def _cast(im, ins, attrs):
    to = _np_dtype(im, attrs["to"])
    if to == np.float32:
        return ins[0]   # run-time values are float32 already
    if to == np.bool_:
        return im.sym_op("_not_equal_scalar")(ins[0], scalar=0.0, name=im.op_name())
    if np.issubdtype(to, np.integer):
        return im.mx.sym.trunc(ins[0], name=im.op_name())   # integers are carried as float32
    return im.mx.sym.Cast(ins[0], dtype=np.dtype(to).name, name=im.op_name())


def _softmax(mx_op: str):
    def conv(im, ins, attrs):
        x = ins[0]
        rank = im.rank(x)
        if im.opset >= 13:
            axis = im.axis(attrs.get("axis", -1), rank)
            axis = -1 if axis == rank - 1 else axis      # MXNet's spelling of the last axis, as rules expect
            return getattr(im.mx.sym, mx_op)(x, axis=axis, name=im.op_name())
        axis = im.axis(attrs.get("axis", 1), rank)   # before opset 13: over all axes from `axis` on
        if axis == rank - 1:
            return getattr(im.mx.sym, mx_op)(x, axis=-1, name=im.op_name())
        flat = im.mx.sym.reshape(x, shape=(0,) * axis + (-1,), name=im.op_name("_flatten"))
        y = getattr(im.mx.sym, mx_op)(flat, axis=-1, name=im.op_name("_inner"))
        return im.mx.sym.reshape_like(y, x, name=im.op_name())
    return conv


def _layer_norm(im, ins, attrs):
    if len(im.node.output) > 1 and any(im.node.output[1:]):
        im.fail("the Mean/InvStdDev outputs are not supported")
    x = ins[0]
    shape = im.shape(x)
    axis = im.axis(attrs.get("axis", -1), len(shape))
    norm_shape = shape[axis:]
    size = int(np.prod(norm_shape))
    scale = np.broadcast_to(im.const_input(ins[1], "Scale"), norm_shape).reshape(size)
    bias = ins[2] if len(ins) > 2 and ins[2] is not None else np.zeros(size, np.float32)
    bias = np.broadcast_to(im.const_input(bias, "B"), norm_shape).reshape(size)
    gamma = im.as_sym(scale, im.node_name + "_gamma", im.node.input[1] if ins[1].shape == (size,) else None)
    beta = im.as_sym(bias, im.node_name + "_beta",
                     im.node.input[2] if len(ins) > 2 and ins[2] is not None and ins[2].shape == (size,) else None)
    eps = float(attrs.get("epsilon", 1e-5))
    if axis == len(shape) - 1:
        return im.mx.sym.LayerNorm(x, gamma, beta, axis=-1, eps=eps, name=im.op_name())
    flat = im.mx.sym.reshape(x, shape=(0,) * axis + (-1,), name=im.op_name("_flatten"))
    y = im.mx.sym.LayerNorm(flat, gamma, beta, axis=-1, eps=eps, name=im.op_name("_inner"))
    return im.mx.sym.reshape_like(y, x, name=im.op_name())


def _reduce(mx_op: str):
    def conv(im, ins, attrs):
        x = ins[0]
        axes = _axes_input(im, ins, attrs) or None     # an empty axes input is no axes (opset 18)
        keep = bool(attrs.get("keepdims", 1))
        if axes is None and attrs.get("noop_with_empty_axes", 0):
            return x
        rank = im.rank(x)
        kw = {} if axes is None else {"axis": tuple(sorted(im.axis(a, rank) for a in axes))}
        if mx_op in ("mean", "max") and keep and rank in (4, 5) and kw.get("axis") == tuple(range(2, rank)):
            # the mean/max over all spatial axes (how torch.export writes adaptive_avg_pool2d(x, 1))
            return im.mx.sym.Pooling(x, kernel=(1,) * (rank - 2), global_pool=True,
                                     pool_type="avg" if mx_op == "mean" else "max", name=im.op_name())
        return getattr(im.mx.sym, mx_op)(x, keepdims=keep, name=im.op_name(), **kw)
    return conv


def _clip(im, ins, attrs):
    lo, hi = attrs.get("min", -_FLT_MAX), attrs.get("max", _FLT_MAX)
    if len(ins) > 1 and ins[1] is not None:
        lo = float(im.const_input(ins[1], "min"))
    if len(ins) > 2 and ins[2] is not None:
        hi = float(im.const_input(ins[2], "max"))
    if lo == 0.0 and hi >= _FLT_MAX:
        return im.mx.sym.Activation(ins[0], act_type="relu", name=im.op_name())
    return im.mx.sym.clip(ins[0], a_min=float(lo), a_max=float(hi), name=im.op_name())


def _gelu(im, ins, attrs):
    approx = attrs.get("approximate", b"none")
    approx = approx.decode() if isinstance(approx, bytes) else approx
    if approx == "tanh":
        return _gelu_tanh(im, ins[0])
    if approx != "none":
        im.fail("approximate=%r is not supported (none or tanh)" % approx)
    return im.mx.sym.LeakyReLU(ins[0], act_type="gelu", name=im.op_name())


def _where(im, ins, attrs):
    shapes = [v.shape if isinstance(v, np.ndarray) else im.shape(v) for v in ins]
    out_shape = tuple(np.broadcast_shapes(*shapes))
    parts = []
    for i, v in enumerate(ins):
        v = _align(im, v, len(out_shape) - len(shapes[i]), str(i))
        if isinstance(v, np.ndarray):
            v = np.broadcast_to(v, out_shape)
            parts.append(im.as_sym(np.ascontiguousarray(v), "%s_in%d" % (im.node_name, i)))
        elif im.shape(v) != out_shape:
            parts.append(im.mx.sym.broadcast_to(v, shape=out_shape, name=im.op_name("_bcast%d" % i)))
        else:
            parts.append(v)
    return im.mx.sym.where(*parts, name=im.op_name())


def _expand(im, ins, attrs):
    x = ins[0]
    target = tuple(int(s) for s in im.const_input(ins[1], "the shape"))
    shape = im.shape(x)
    out_shape = tuple(np.broadcast_shapes(shape, target))
    x = _align(im, x, len(out_shape) - len(shape), "x")
    if out_shape == shape:
        return x
    return im.mx.sym.broadcast_to(x, shape=out_shape, name=im.op_name())


def _identity(im, ins, attrs):
    if im.node.op_type == "Dropout" and len(im.node.output) > 1 and im.node.output[1]:
        im.fail("the mask output is not supported")
    return ins[0]


_SYMBOLIC: Dict[str, Callable] = {
    "Identity": _identity, "Dropout": _identity,
    "Relu": _activation("relu"), "Sigmoid": _activation("sigmoid"), "Tanh": _activation("tanh"),
    "Softplus": _activation("softrelu"), "Softsign": _activation("softsign"),
    "LeakyRelu": lambda im, ins, a: im.mx.sym.LeakyReLU(ins[0], act_type="leaky", slope=float(a.get("alpha", 0.01)),
                                                       name=im.op_name()),
    "Elu": lambda im, ins, a: im.mx.sym.LeakyReLU(ins[0], act_type="elu", slope=float(a.get("alpha", 1.0)),
                                                 name=im.op_name()),
    "HardSigmoid": lambda im, ins, a: im.mx.sym.hard_sigmoid(ins[0], alpha=float(a.get("alpha", 0.2)),
                                                            beta=float(a.get("beta", 0.5)), name=im.op_name()),
    "Gelu": _gelu,
    "Exp": _unary("exp"), "Log": _unary("log"), "Sqrt": _unary("sqrt"), "Abs": _unary("abs"),
    "Neg": _unary("negative"), "Reciprocal": _unary("reciprocal"), "Erf": _unary("erf"),
    "Floor": _unary("floor"), "Ceil": _unary("ceil"), "Not": _unary("logical_not"),
    "Add": _binary("Add"), "Sub": _binary("Sub"), "Mul": _binary("Mul"), "Div": _binary("Div"),
    "Pow": _binary("Pow"), "Equal": _binary("Equal"), "Greater": _binary("Greater"), "Less": _binary("Less"),
    "And": _binary("And"), "Or": _binary("Or"),
    "Max": _variadic("Max"), "Min": _variadic("Min"), "Sum": _variadic("Add"),
    "MatMul": _matmul, "Gemm": _gemm,
    "Conv": _conv, "MaxPool": _pool("max"), "AveragePool": _pool("avg"),
    "GlobalAveragePool": _global_pool("avg"), "GlobalMaxPool": _global_pool("max"),
    "BatchNormalization": _batch_norm,
    "Flatten": _flatten, "Reshape": _reshape, "Transpose": _transpose, "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze, "Concat": _concat, "Slice": _slice, "Split": _split, "Gather": _gather,
    "Cast": _cast, "Softmax": _softmax("softmax"), "LogSoftmax": _softmax("log_softmax"),
    "LayerNormalization": _layer_norm,
    "ReduceMean": _reduce("mean"), "ReduceSum": _reduce("sum"), "ReduceMax": _reduce("max"),
    "ReduceMin": _reduce("min"), "ReduceProd": _reduce("prod"),
    "Clip": _clip, "Where": _where, "Expand": _expand,
}


# --------------------------------------------------------------------------------------------
# ONNX Runtime contrib ops (domain com.microsoft), as its transformers optimizer writes them:
# imported as the stock MXNet ops the rules fuse (FullyConnected, batch_dot/softmax, LayerNorm, GELU).
# --------------------------------------------------------------------------------------------

_MASK_FILTER = -10000.0   # ORT's default mask_filter_value


def _refuse_inputs(im, ins, names: Dict[int, str]):
    for i, what in names.items():
        if len(ins) > i and ins[i] is not None:
            im.fail("input %d (%s) is not supported" % (i, what))


def _refuse_outputs(im, names: Dict[int, str]):
    for i, what in names.items():
        if len(im.node.output) > i and im.node.output[i]:
            im.fail("output %d (%s) is not supported" % (i, what))


def _with_bias(im, x, x_name: str, bias: Optional[np.ndarray], tag: str):
    """x + bias (a constant vector over the last axis): into a waiting FullyConnected when x is one."""
    if bias is None:
        return x
    pending = im.pending_fc.get(x_name)
    n = bias.size
    if pending is not None and pending[2] == n:
        data, weight, _, name = pending
        del im.pending_fc[x_name]
        bias_var = im.as_sym(bias.reshape(n), im.node_name + tag)
        return im.mx.sym.FullyConnected(data, weight, bias_var, num_hidden=n, flatten=False, name=name)
    b = im.as_sym(bias.reshape((1,) * (im.rank(x) - 1) + (n,)), im.node_name + tag)
    return im.mx.sym.broadcast_add(x, b, name=im.op_name(tag))


def _const_1d(im, value, what: str) -> Optional[np.ndarray]:
    if value is None:
        return None
    v = im.const_input(value, what)
    if v.ndim != 1:
        im.fail("%s must be 1-D, got shape %s" % (what, v.shape))
    return v.astype(np.float32)


def _skip_layer_norm(im, ins, attrs):
    """SkipLayerNormalization(input, skip, gamma[, beta][, bias]) = LayerNorm(input + skip + bias)."""
    _refuse_outputs(im, {1: "mean", 2: "inv_std_var"})
    x, skip = ins[0], ins[1]
    gamma = _const_1d(im, ins[2], "gamma")
    beta = _const_1d(im, ins[3] if len(ins) > 3 else None, "beta")
    bias = _const_1d(im, ins[4] if len(ins) > 4 else None, "bias")
    mx = im.mx
    x = _with_bias(im, x, im.node.input[0], bias, "_bias")
    shape = im.shape(x)
    if not isinstance(skip, np.ndarray) and im.shape(skip) == shape:
        s = mx.sym.elemwise_add(x, skip, name=im.op_name("_add"))
    else:
        skip = _align(im, skip, len(shape) - im.rank(skip), "skip")
        skip = im.as_sym(skip, im.node_name + "_skip", im.node.input[1])
        s = mx.sym.broadcast_add(x, skip, name=im.op_name("_add"))
    n = shape[-1]
    if gamma.size != n or (beta is not None and beta.size != n):
        im.fail("gamma/beta of size %d/%s for a hidden size of %d" % (gamma.size, None if beta is None
                                                                      else beta.size, n))
    beta = np.zeros(n, np.float32) if beta is None else beta
    g = im.as_sym(gamma, im.node_name + "_gamma", im.node.input[2])
    b = im.as_sym(beta, im.node_name + "_beta", im.node.input[3] if len(ins) > 3 and ins[3] is not None else None)
    y = mx.sym.LayerNorm(s, g, b, axis=-1, eps=float(attrs.get("epsilon", 1e-12)), name=im.op_name())
    return [y, None, None, s]


def _bias_gelu(im, ins, attrs):
    """BiasGelu(A, B) = Gelu(A + B), the erf form."""
    x = _with_bias(im, ins[0], im.node.input[0], _const_1d(im, ins[1], "the bias"), "_bias")
    return im.mx.sym.LeakyReLU(x, act_type="gelu", name=im.op_name())


def _gelu_tanh(im, x):
    """0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), written out as the gelu_tanh rule matches it."""
    mx, f = im.mx, im.sym_op
    cube = f("_power_scalar")(x, scalar=3.0, name=im.op_name("_cube"))
    poly = mx.sym.elemwise_add(x, f("_mul_scalar")(cube, scalar=0.044715, name=im.op_name("_a")),
                               name=im.op_name("_poly"))
    t = mx.sym.tanh(f("_mul_scalar")(poly, scalar=float(np.sqrt(2.0 / np.pi)), name=im.op_name("_k")),
                    name=im.op_name("_tanh"))
    return mx.sym.elemwise_mul(f("_mul_scalar")(x, scalar=0.5, name=im.op_name("_half")),
                               f("_plus_scalar")(t, scalar=1.0, name=im.op_name("_one")), name=im.op_name())


def _fast_gelu(im, ins, attrs):
    """FastGelu(X[, bias]): the tanh approximation of GELU of X + bias."""
    bias = _const_1d(im, ins[1] if len(ins) > 1 else None, "the bias")
    return _gelu_tanh(im, _with_bias(im, ins[0], im.node.input[0], bias, "_bias"))


def _fused_matmul(im, ins, attrs):
    """FusedMatMul(A, B) = alpha · A' · B' (transA/transB swap the last two axes)."""
    if attrs.get("transBatchA", 0) or attrs.get("transBatchB", 0):
        im.fail("transBatchA/transBatchB are not supported")
    a, b = ins
    alpha = float(attrs.get("alpha", 1.0))
    trans_a, trans_b = bool(attrs.get("transA", 0)), bool(attrs.get("transB", 0))
    mx = im.mx
    if isinstance(b, np.ndarray) and not trans_a and b.ndim == 2:
        w = (b.T if trans_b else b) * np.float32(alpha)
        return _matmul(im, [a, np.ascontiguousarray(w.astype(np.float32))], {})
    a = im.as_sym(a, im.node_name + "_a", im.node.input[0])
    b = im.as_sym(b, im.node_name + "_b", im.node.input[1])
    ra, rb = im.rank(a), im.rank(b)
    if ra != rb or ra < 2 or im.shape(a)[:-2] != im.shape(b)[:-2]:
        im.fail("operands of shapes %s and %s are not supported (needs equal ranks >= 2 and the same "
                "batch dimensions)" % (im.shape(a), im.shape(b)))
    fn = mx.sym.dot if ra == 2 else mx.sym.batch_dot
    out = fn(a, b, transpose_a=trans_a, transpose_b=trans_b,
             name=im.op_name() if alpha == 1.0 else im.op_name("_mm"))
    if alpha != 1.0:
        out = im.sym_op("_mul_scalar")(out, scalar=alpha, name=im.op_name())
    return out


def _split_heads(im, x, heads: int, tag: str):
    """(B, S, H·D) -> (B, H, S, D)."""
    y = im.mx.sym.reshape(x, shape=(0, 0, heads, -1), name=im.op_name("_%s_split" % tag))
    return im.mx.sym.transpose(y, axes=(0, 2, 1, 3), name=im.op_name("_%s_heads" % tag))


def _key_mask(im, mask, keys, batch: int, sq: int, sk: int, fill: float):
    """ORT's mask_index / key_padding_mask forms -> an additive (B, 1, 1|Sq, Sk) mask (0 or ``fill``).

    Written without the batch and sequence sizes (positions from ``keys``, the (B, Sk, ·) keys), so the
    imported graph runs at other sizes too."""
    mx, f = im.mx, im.sym_op
    shape = mask.shape if isinstance(mask, np.ndarray) else im.shape(mask)
    mask = im.as_sym(mask, im.node_name + "_mask")
    if len(shape) == 1 and shape[0] in (batch, 2 * batch):
        pos = mx.sym.reshape(mx.sym.contrib.arange_like(keys, axis=1, name=im.op_name("_positions")),
                             shape=(1, -1), name=im.op_name("_positions_row"))
        if shape[0] == batch:
            ends = mx.sym.reshape(mask, shape=(-1, 1), name=im.op_name("_ends"))
        else:    # left padding: exclusive ends, then inclusive starts
            pair = mx.sym.reshape(mask, shape=(2, -1), name=im.op_name("_pair"))
            ends = mx.sym.reshape(mx.sym.slice_axis(pair, axis=0, begin=0, end=1, name=im.op_name("_end_row")),
                                  shape=(-1, 1), name=im.op_name("_ends"))
        out = mx.sym.broadcast_greater_equal(pos, ends, name=im.op_name("_past_end"))
        if shape[0] == 2 * batch:
            starts = mx.sym.reshape(mx.sym.slice_axis(pair, axis=0, begin=1, end=2, name=im.op_name("_start_row")),
                                    shape=(-1, 1), name=im.op_name("_starts"))
            before = mx.sym.broadcast_lesser(pos, starts, name=im.op_name("_before_start"))
            out = mx.sym.broadcast_logical_or(out, before, name=im.op_name("_outside"))
        out = mx.sym.expand_dims(mx.sym.expand_dims(out, axis=1, name=im.op_name("_mask3")), axis=1,
                                 name=im.op_name("_mask4"))
    elif len(shape) == 2 and shape == (batch, sk):
        out = f("_lesser_equal_scalar")(mask, scalar=0.0, name=im.op_name("_masked"))
        out = mx.sym.expand_dims(mx.sym.expand_dims(out, axis=1, name=im.op_name("_mask3")), axis=1,
                                 name=im.op_name("_mask4"))
    elif len(shape) == 3 and shape == (batch, sq, sk):
        out = mx.sym.expand_dims(f("_lesser_equal_scalar")(mask, scalar=0.0, name=im.op_name("_masked")), axis=1,
                                 name=im.op_name("_mask4"))
    else:
        im.fail("a mask of shape %s is not supported (supported: (B), (2·B), (B, Sk), (B, Sq, Sk) with B=%d, "
                "Sq=%d, Sk=%d)" % (tuple(shape), batch, sq, sk))
    return f("_mul_scalar")(out, scalar=fill, name=im.op_name("_mask_add"))


def _attend(im, q, k, v, heads: int, attrs, mask, attention_bias, head_size: int):
    """softmax(scale·q·kᵀ + masks)·v over heads, in the form the attention rules match; (B, Sq, H·Dv)."""
    mx, f = im.mx, im.sym_op
    qs, ks = im.shape(q), im.shape(k)
    batch, sq, sk = qs[0], qs[1], ks[1]
    scale = float(attrs.get("scale", 0.0)) or 1.0 / float(np.sqrt(head_size))
    fill = float(attrs.get("mask_filter_value", _MASK_FILTER))
    qh, kh, vh = (_split_heads(im, t, heads, tag) for t, tag in ((q, "q"), (k, "k"), (v, "v")))
    scores = mx.sym.batch_dot(qh, kh, transpose_b=True, name=im.op_name("_qk"))
    scores = f("_mul_scalar")(scores, scalar=scale, name=im.op_name("_scaled"))
    additive = []
    if mask is not None:
        additive.append(_key_mask(im, mask, k, batch, sq, sk, fill))
    if attrs.get("unidirectional", 0):
        if sq != sk:   # ORT 1.32 (measured): rows 0..Sq-2 see keys j <= i, its last row every key
            im.fail("unidirectional=1 with %d queries and %d keys is not supported (only self-attention, "
                    "Sq = Sk)" % (sq, sk))
        # keys after the causal band are dropped, not given mask_filter_value: ONNX Runtime's row of
        # only padded keys and later keys attends to the padded ones (measured, left padding)
        # (from the positions of q and k, so the graph runs at other sequence lengths)
        rows = mx.sym.reshape(mx.sym.contrib.arange_like(q, axis=1, name=im.op_name("_rows")), shape=(-1, 1),
                              name=im.op_name("_row_col"))
        cols = mx.sym.reshape(mx.sym.contrib.arange_like(k, axis=1, name=im.op_name("_cols")), shape=(1, -1),
                              name=im.op_name("_col_row"))
        later = mx.sym.broadcast_greater(cols, rows, name=im.op_name("_later"))
        later = mx.sym.expand_dims(mx.sym.expand_dims(later, axis=0, name=im.op_name("_causal3")), axis=0,
                                   name=im.op_name("_causal4"))
        additive.append(f("_mul_scalar")(later, scalar=-_FLT_MAX, name=im.op_name("_causal")))
    if attention_bias is not None:
        ab_shape = attention_bias.shape if isinstance(attention_bias, np.ndarray) else im.shape(attention_bias)
        if len(ab_shape) != 4 or ab_shape[2:] != (sq, sk) or ab_shape[0] not in (1, batch) \
                or ab_shape[1] not in (1, heads):
            im.fail("attention_bias of shape %s is not (B or 1, H or 1, %d, %d)" % (tuple(ab_shape), sq, sk))
        additive.append(im.as_sym(attention_bias, im.node_name + "_attention_bias"))
    for i, m in enumerate(additive):
        scores = mx.sym.broadcast_add(scores, m, name=im.op_name("_masked%d" % i))
    probs = mx.sym.softmax(scores, axis=-1, name=im.op_name("_softmax"))
    ctx = mx.sym.batch_dot(probs, vh, name=im.op_name("_ctx"))
    ctx = mx.sym.transpose(ctx, axes=(0, 2, 1, 3), name=im.op_name("_merge"))
    return mx.sym.reshape(ctx, shape=(0, 0, -1), name=im.op_name())


def _attention(im, ins, attrs):
    """Attention(input, weights[, bias][, mask_index]): the packed Q/K/V projection split into three
    FullyConnected, then multi-head attention (no past/present)."""
    _refuse_inputs(im, ins, {4: "past", 6: "past_sequence_length"})
    _refuse_outputs(im, {1: "present"})
    for key in ("do_rotary", "past_present_share_buffer"):
        if attrs.get(key, 0):
            im.fail("%s=%s is not supported" % (key, attrs[key]))
    heads = int(attrs["num_heads"])
    x = ins[0]
    w = im.const_input(ins[1], "weights")
    bias = _const_1d(im, ins[2] if len(ins) > 2 else None, "bias")
    if im.rank(x) != 3 or w.ndim != 2:
        im.fail("input of rank %d and weights of rank %d (needs (B, S, K) and (K, N))" % (im.rank(x), w.ndim))
    total = w.shape[1]
    sizes = [int(s) for s in attrs.get("qkv_hidden_sizes", [])] or [total // 3] * 3
    if len(sizes) != 3 or sum(sizes) != total or sizes[0] != sizes[1] or any(s % heads or s <= 0 for s in sizes):
        im.fail("qkv_hidden_sizes %s do not split weights of width %d into Q, K (equal) and V, each a "
                "multiple of num_heads=%d" % (sizes, total, heads))
    if bias is not None and bias.size != total:
        im.fail("bias of size %d for weights of width %d" % (bias.size, total))
    parts, start = [], 0
    for size, tag in zip(sizes, "qkv"):
        wp = np.ascontiguousarray(w[:, start:start + size].T.astype(np.float32))
        args = [x, im.const_var(wp, im.node_name + "_%s_weight" % tag)]
        if bias is not None:
            args.append(im.const_var(bias[start:start + size], im.node_name + "_%s_bias" % tag))
        parts.append(im.mx.sym.FullyConnected(*args, num_hidden=size, no_bias=bias is None, flatten=False,
                                              name=im.op_name("_" + tag)))
        start += size
    mask = ins[3] if len(ins) > 3 else None
    attention_bias = ins[5] if len(ins) > 5 else None
    return [_attend(im, *parts, heads, attrs, mask, attention_bias, sizes[0] // heads), None]


def _multi_head_attention(im, ins, attrs):
    """MultiHeadAttention(query, key, value[, bias][, key_padding_mask][, attention_bias]), 3-D Q, K, V."""
    _refuse_inputs(im, ins, {6: "past_key", 7: "past_value", 8: "past_sequence_length", 9: "cache_indirection"})
    _refuse_outputs(im, {1: "present_key", 2: "present_value", 3: "qk"})
    heads = int(attrs["num_heads"])
    q = ins[0]
    k = ins[1] if len(ins) > 1 else None
    v = ins[2] if len(ins) > 2 else None
    if k is None or v is None or any(im.rank(t) != 3 for t in (q, k, v)):
        im.fail("only separate 3-D query, key and value are supported (not packed QKV/KV or past key/value)")
    sizes = [im.shape(t)[-1] for t in (q, k, v)]
    if sizes[0] != sizes[1] or any(s % heads for s in sizes):
        im.fail("hidden sizes %s: Q and K must match and each be a multiple of num_heads=%d" % (sizes, heads))
    bias = _const_1d(im, ins[3] if len(ins) > 3 else None, "bias")
    if bias is not None:
        if bias.size != sum(sizes):
            im.fail("bias of size %d for Q, K, V of widths %s" % (bias.size, sizes))
        offsets = np.cumsum([0] + sizes)
        q, k, v = (_with_bias(im, t, im.node.input[i], bias[offsets[i]:offsets[i + 1]], "_%s_bias" % "qkv"[i])
                   for i, t in enumerate((q, k, v)))
    q, k, v = (im.as_sym(t, im.node_name + "_" + tag) for t, tag in ((q, "q"), (k, "k"), (v, "v")))
    mask = ins[4] if len(ins) > 4 else None
    attention_bias = ins[5] if len(ins) > 5 else None
    return [_attend(im, q, k, v, heads, attrs, mask, attention_bias, sizes[0] // heads), None, None, None]


_SYMBOLIC.update({
    "com.microsoft.SkipLayerNormalization": _skip_layer_norm,
    "com.microsoft.BiasGelu": _bias_gelu,
    "com.microsoft.FastGelu": _fast_gelu,
    "com.microsoft.FusedMatMul": _fused_matmul,
    "com.microsoft.Attention": _attention,
    "com.microsoft.MultiHeadAttention": _multi_head_attention,
})


def _embed_layer_norm(im, ins, attrs):
    """EmbedLayerNormalization(input_ids, segment_ids, word_embedding, position_embedding,
    segment_embedding, gamma, beta[, mask][, position_ids]) = LayerNorm(word[ids] + position[pos] +
    segment[seg]); mask_index (output 1) = the number of mask values equal to 1 per row (0 without a mask)."""
    mx, f = im.mx, im.sym_op
    get = lambda i: ins[i] if len(ins) > i else None   # noqa: E731
    ids, seg_ids = get(0), get(1)
    tables = [im.const_input(get(i), what) for i, what in ((2, "word_embedding"), (3, "position_embedding"),
                                                          (4, "segment_embedding"))]
    if (seg_ids is None) != (tables[2] is None):
        im.fail("segment_ids and segment_embedding must be given together")
    gamma, beta = _const_1d(im, get(5), "gamma"), _const_1d(im, get(6), "beta")
    mask, position_ids = get(7), get(8)
    if im.rank(ids) != 2:
        im.fail("input_ids of rank %d (needs (B, S))" % im.rank(ids))
    hidden = tables[0].shape[1]

    def lookup(index, table, tag):
        weight = im.as_sym(table.astype(np.float32), im.node_name + tag, None)
        return mx.sym.Embedding(im.as_sym(index, im.node_name + tag + "_ids"), weight, input_dim=table.shape[0],
                                output_dim=hidden, name=im.op_name(tag))

    total = lookup(ids, tables[0], "_word")
    if position_ids is None:
        position_ids = mx.sym.contrib.arange_like(ids, axis=1, name=im.op_name("_positions"))
    pos = lookup(position_ids, tables[1], "_position")
    if im.rank(pos) == 2:                                  # (S, H) from positions 0..S-1
        pos = mx.sym.expand_dims(pos, axis=0, name=im.op_name("_position_b"))
    total = mx.sym.broadcast_add(total, pos, name=im.op_name("_sum_pos")) if im.shape(pos)[0] != im.shape(total)[0] \
        else mx.sym.elemwise_add(total, pos, name=im.op_name("_sum_pos"))
    if seg_ids is not None:
        total = mx.sym.elemwise_add(total, lookup(seg_ids, tables[2], "_segment"), name=im.op_name("_sum"))
    y = mx.sym.LayerNorm(total, im.as_sym(gamma, im.node_name + "_gamma", im.node.input[5]),
                         im.as_sym(beta, im.node_name + "_beta", im.node.input[6]), axis=-1,
                         eps=float(attrs.get("epsilon", 1e-12)), name=im.op_name())
    if mask is not None:
        mask_index = mx.sym.sum(f("_equal_scalar")(im.as_sym(mask, im.node_name + "_mask"), scalar=1.0,
                                                   name=im.op_name("_ones")), axis=1, name=im.op_name("_mask_index"))
    else:
        mask_index = mx.sym.zeros_like(mx.sym.slice_axis(ids, axis=1, begin=0, end=1, name=im.op_name("_col")),
                                       name=im.op_name("_mask_zero"))
        mask_index = mx.sym.reshape(mask_index, shape=(-1,), name=im.op_name("_mask_index"))
    return [y, mask_index, total]


_SYMBOLIC["com.microsoft.EmbedLayerNormalization"] = _embed_layer_norm

# Attributes read by these importers; any other attribute is refused (a contrib op's newer attribute
# would otherwise be ignored silently).
_KNOWN_ATTRS: Dict[str, set] = {
    "Gemm": {"alpha", "beta", "transA", "transB"},
    "Flatten": {"axis"},
    "Reshape": {"allowzero"},
    "com.microsoft.SkipLayerNormalization": {"epsilon"},
    "com.microsoft.BiasGelu": set(),
    "com.microsoft.FastGelu": set(),
    "com.microsoft.FusedMatMul": {"alpha", "transA", "transB", "transBatchA", "transBatchB"},
    "com.microsoft.Attention": {"num_heads", "scale", "mask_filter_value", "unidirectional", "qkv_hidden_sizes",
                                "do_rotary", "past_present_share_buffer", "rotary_embedding_dim"},
    "com.microsoft.MultiHeadAttention": {"num_heads", "scale", "mask_filter_value", "unidirectional"},
    "com.microsoft.EmbedLayerNormalization": {"epsilon", "mask_index_type"},
}

SUPPORTED_OPS = tuple(sorted(set(_SYMBOLIC) | set(_FOLD) | {"Constant", "com.microsoft.Gelu"}))


# Export lives in fusion/onnx/export.py; its public names are kept here.
from .export import DEFAULT_OPSET, FUSED_OP_EXPORTERS, export_onnx, node_io  # noqa: E402,F401
