"""Reading and writing exported models (``NAME-symbol.json`` + ``NAME-0000.params``) safely.

Reading validates everything a rewrite relies on and raises a one-line
:class:`GraphError`/:class:`ParamsError` naming the problem.  Writing is
atomic (:mod:`fusion.files.publish`): each file goes to a temporary file in the
target folder and is renamed into place only when every file of the model
has been written, and never over the files the model was read from.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import numpy as np

from ..ir.errors import FusionError, GraphError, ParamsError
from ..ir.graph import Graph, first_line, symbol_json
from ..precision.policy import PARAM_DTYPES, dtype_name
from .publish import TEMP_PREFIX, publish  # noqa: F401  (TEMP_PREFIX: for callers that read it here)


def read_graph(path: str) -> Graph:
    """Load a Symbol JSON file; every op must be known to MXNet (with the libraries loaded now)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise GraphError("cannot read symbol file '%s': %s" % (path, e.strerror or e)) from None
    try:
        graph = Graph.from_json(data)
    except GraphError as e:
        raise GraphError("%s: %s" % (path, e)) from None
    unknown = graph.unknown_ops()
    if unknown:
        raise GraphError("%s: unknown op(s) %s (not registered in MXNet %s; load the library that defines them)"
                         % (path, ", ".join(unknown), _mx_version()))
    try:
        graph.check_loadable()
    except GraphError as e:
        raise GraphError("%s: %s" % (path, e)) from None
    return graph


def _mx_version() -> str:
    import mxnet as mx
    return mx.__version__


def read_params(path: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Load ``NAME-0000.params`` into (arg_params, aux_params) as MXNet saved them (``arg:``/``aux:`` keys)."""
    import mxnet as mx

    if not os.path.isfile(path):
        raise ParamsError("cannot read params file '%s': no such file" % path)
    try:
        loaded = mx.nd.load(path)
    except mx.base.MXNetError as e:
        raise ParamsError("cannot load params file '%s' (truncated or not an MXNet params file): %s"
                          % (path, first_line(str(e)))) from None
    if isinstance(loaded, list) and not loaded:
        return {}, {}           # what mx.nd.save writes for a model without parameters
    if not isinstance(loaded, dict):
        raise ParamsError("params file '%s' holds an unnamed list of arrays, expected arg:/aux: names" % path)
    arg, aux = {}, {}
    for key, value in loaded.items():
        kind, _, name = key.partition(":")
        if kind == "arg" and name:
            arg[name] = value
        elif kind == "aux" and name:
            aux[name] = value
        else:
            raise ParamsError("params file '%s' has key '%s'; expected 'arg:NAME' or 'aux:NAME'" % (path, key))
    return arg, aux


def _check_layer_shapes(graph: Graph, shapes: Mapping[str, Tuple[int, ...]]) -> None:
    """Shapes MXNet cannot check without the input shape: weights against the layer's attributes."""
    def expect(node, slot, want, what):
        if slot >= len(node.inputs):
            return
        name = node.inputs[slot].node.name
        got = shapes.get(name)
        if got is None:
            return
        if len(got) != len(want) or any(w is not None and w != g for w, g in zip(want, got)):
            shown = "(" + ", ".join("?" if w is None else str(w) for w in want) + ")"
            raise ParamsError("parameter '%s' has shape %s but %s '%s' (%s) needs %s"
                              % (name, tuple(got), node.op, node.name, what, shown))

    for nd in graph.op_nodes():
        if nd.op in ("Convolution", "Deconvolution"):
            kernel = tuple(nd.param("kernel"))
            nf, groups = nd.param("num_filter"), nd.param("num_group")
            layout = str(nd.param("layout") or "")
            if nd.op == "Convolution":
                spatial = (None,) + kernel if not layout.endswith("C") else kernel + (None,)
                expect(nd, 1, (nf,) + spatial, "num_filter=%d, kernel=%s" % (nf, kernel))
            elif nf % groups == 0:
                expect(nd, 1, (None, nf // groups) + kernel, "num_filter=%d, num_group=%d, kernel=%s" % (nf, groups, kernel))
            if not nd.param("no_bias"):
                expect(nd, 2, (nf,), "num_filter=%d" % nf)
        elif nd.op == "Embedding":
            dims = (nd.param("input_dim"), nd.param("output_dim"))
            expect(nd, 1, dims, "input_dim=%d, output_dim=%d" % dims)
        elif nd.op == "FullyConnected":
            nh = nd.param("num_hidden")
            expect(nd, 1, (nh, None), "num_hidden=%d" % nh)
            if not nd.param("no_bias"):
                expect(nd, 2, (nh,), "num_hidden=%d" % nh)


def validate_params(graph: Graph, symbol: Any, arg: Mapping[str, Any], aux: Mapping[str, Any],
                    input_shapes: Optional[Mapping[str, Tuple[int, ...]]] = None) -> None:
    """Check that params fit the graph: names, arg/aux kind, shapes, finite values, variances."""
    import mxnet as mx

    args, auxs = set(symbol.list_arguments()), set(symbol.list_auxiliary_states())
    for name in arg:
        if name not in args:
            hint = " (it is an auxiliary state: save it as 'aux:%s')" % name if name in auxs else ""
            raise ParamsError("parameter '%s' is not an argument of the graph%s" % (name, hint))
    for name in aux:
        if name not in auxs:
            hint = " (it is an argument: save it as 'arg:%s')" % name if name in args else ""
            raise ParamsError("auxiliary state '%s' is not an auxiliary state of the graph%s" % (name, hint))
    missing_aux = sorted(auxs - set(aux))
    if arg and missing_aux:
        raise ParamsError("auxiliary state(s) missing from params: %s" % ", ".join(missing_aux[:5]))
    shapes = {k: v.shape for k, v in list(arg.items()) + list(aux.items())}
    _check_layer_shapes(graph, shapes)
    try:
        # MXNet's shape inference overrides some given shapes (e.g. BatchNorm's gamma) instead of
        # refusing them, so compare what it infers from the inputs with what the params hold.
        if input_shapes:
            with contextlib.redirect_stdout(io.StringIO()):   # MXNet prints every argument's shape on failure
                inferred = symbol.infer_shape(**shapes, **input_shapes)
        elif any(nd.op.startswith("fused_") for nd in graph.nodes):
            return      # MXNet 1.9.1 can crash inferring a library op's shapes from unknown inputs
        else:
            inferred = symbol.infer_shape_partial(**shapes)
    except mx.base.MXNetError as e:
        if not input_shapes and not _infers_without_params(symbol):
            # Some ops cannot infer anything without the data shapes (arange_like of an input of
            # unknown rank): the failure says nothing about the params, and nothing more can be
            # checked by inference here (the per-layer checks above still ran).
            inferred = None
        else:
            what = "parameter and input shapes (--shape)" if input_shapes else "parameter shapes"
            raise ParamsError("%s do not fit the graph: %s" % (what, first_line(str(e)))) from None
    names = symbol.list_arguments() + symbol.list_auxiliary_states()
    for name, want in zip(names, list(inferred[0]) + list(inferred[2]) if inferred else []):
        got = shapes.get(name)
        if got is not None and want and 0 not in want and tuple(want) != tuple(got):
            raise ParamsError("parameter shapes do not fit the graph: '%s' has shape %s, the graph needs %s"
                              % (name, tuple(got), tuple(want)))
    check_param_values(graph, symbol, arg, aux)


def _numpy(value: Any) -> np.ndarray:
    return value.asnumpy() if hasattr(value, "asnumpy") else np.asarray(value)


class _FiniteCheck:
    """Raises ParamsError for the first array added that holds NaN or inf.  Small arrays are checked
    together (one NumPy call for many: a graph of 100k nodes has tens of thousands of them)."""
    BATCH = 1 << 20

    def __init__(self):
        self.pending: List[Tuple[str, np.ndarray]] = []
        self.size = 0

    def add(self, name: str, array: np.ndarray) -> None:
        if array.size >= self.BATCH:
            self._check([(name, array)])
            return
        self.pending.append((name, array))
        self.size += array.size
        if self.size >= self.BATCH:
            self.done()

    def done(self) -> None:
        if self.pending:
            self._check(self.pending)
        self.pending, self.size = [], 0

    @staticmethod
    def _check(items: List[Tuple[str, np.ndarray]]) -> None:
        whole = items[0][1] if len(items) == 1 else np.concatenate([a.ravel() for _, a in items])
        if np.isfinite(whole).all():
            return
        for name, array in items:
            if not np.isfinite(array).all():
                raise ParamsError("parameter '%s' contains NaN or inf" % name)


def check_param_values(graph: Graph, symbol: Any, arg: Mapping[str, Any], aux: Mapping[str, Any],
                       input_dtypes: Optional[Mapping[str, Any]] = None) -> None:
    """The checks of parameter values that ``mxfuse`` and ``fuse()`` share: dtypes MXNet has and the
    graph's type inference accepts, no NaN or inf, no negative BatchNorm moving variance.
    Raises a one-line :class:`ParamsError` naming the array.  ``symbol``: the graph as MXNet's
    Symbol, or None to make it only where needed (type inference, when a dtype is not float32)."""
    dtypes = {}
    finite = _FiniteCheck()
    for name, value in list(arg.items()) + list(aux.items()):
        dtype = dtype_name(value.dtype)
        if dtype not in PARAM_DTYPES:
            raise ParamsError("parameter '%s' has dtype %s; MXNet arrays are %s"
                              % (name, dtype, ", ".join(PARAM_DTYPES)))
        dtypes[name] = dtype
        if dtype.startswith("float"):
            finite.add(name, _numpy(value))
    finite.done()
    for nd in graph.op_nodes():
        if nd.op == "BatchNorm" and len(nd.inputs) == 5:
            var = nd.inputs[4].node.name
            if var in aux and (_numpy(aux[var]) < 0).any():
                raise ParamsError("BatchNorm '%s' has a negative moving variance in '%s'" % (nd.name, var))
    input_dtypes = {k: dtype_name(v) for k, v in (input_dtypes or {}).items()}
    if any(t != "float32" for t in list(dtypes.values()) + list(input_dtypes.values())):
        _check_param_dtypes(graph, graph.to_symbol() if symbol is None else symbol, dtypes, input_dtypes)
    # float32 everywhere is what bind gives a graph: where MXNet's type inference refuses that,
    # the graph is at fault, not its parameters (and binding it says so)


def _check_param_dtypes(graph: Graph, symbol: Any, dtypes: Dict[str, str], input_dtypes: Dict[str, str]) -> None:
    """MXNet's type inference must accept the parameters' dtypes with the data inputs of one float
    dtype (float32, what bind gives an input, or one of the parameters'), unless ``input_dtypes``
    says: a float16 weight among float32 ones is refused at bind ("This layer requires uniform
    type").  The error names the parameter whose dtype differs from what the graph computes in
    with the most common dtype given to the other parameters and the inputs."""
    names = symbol.list_inputs()        # arguments and auxiliary states (asking for each is slower)
    read = set(names)
    dtypes = {k: t for k, t in dtypes.items() if k in read}        # params the graph does not read: ignored
    input_dtypes = {k: t for k, t in input_dtypes.items() if k in read}
    if not dtypes or any(nd.op.startswith("fused_") for nd in graph.op_nodes()):
        return      # library ops: MXNet 1.9.1's wrappers are not safe to infer from partial facts
    if "bfloat16" in dtypes.values():
        return      # MXNet's Python type inference cannot be given bfloat16 (AMP's params): bind checks them
    infer = _type_inference(symbol, dtypes, input_dtypes, names)
    if _first_fit(infer, dtypes) is not None:
        return
    counts = _dtype_counts(dtypes)
    floats = [t for t in counts if np.dtype(t).kind == "f"]
    common = max(counts, key=lambda t: (counts[t], t == "float32"))
    data_dtype = common if common in floats else "float32"
    base = {k: t for k, t in dtypes.items() if t == common}
    ref = infer(base, data_dtype)
    if not isinstance(ref, str):
        names = symbol.list_arguments() + symbol.list_auxiliary_states()
        needed = dict(zip(names, list(ref[0]) + list(ref[2])))
        order = {n: i for i, n in enumerate(names)}
        for name in sorted((k for k in dtypes if k not in base), key=lambda k: order.get(k, len(order))):
            err = infer(dict(base, **{name: dtypes[name]}), data_dtype)
            if isinstance(err, str):
                want = needed.get(name)
                if want is not None and dtype_name(want) != dtypes[name]:
                    raise ParamsError("parameter '%s' has dtype %s where the graph computes in %s (with the other "
                                      "parameters); save it as %s" % (name, dtypes[name], dtype_name(want),
                                                                      dtype_name(want)))
                raise ParamsError("parameter '%s' has dtype %s, which does not fit the graph: %s"
                                  % (name, dtypes[name], err))
    raise ParamsError("parameter dtypes do not fit the graph: %s" % infer(dtypes, data_dtype))


def _dtype_counts(dtypes: Mapping[str, str]) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for t in dtypes.values():
        counts[t] = counts.get(t, 0) + 1
    return counts


def _type_inference(symbol: Any, dtypes: Mapping[str, str], input_dtypes: Mapping[str, str],
                    names: List[str]):
    """``infer(given, data_dtype)``: MXNet's partial type inference with the parameters' dtypes
    ``given`` and every other input of ``names`` (the symbol's arguments, or all its inputs) not
    in ``input_dtypes`` of ``data_dtype``; the error's first line when MXNet refuses."""
    import mxnet as mx

    inputs = [n for n in names if n not in dtypes and n not in input_dtypes]

    def infer(given, data_dtype):
        try:
            return symbol.infer_type_partial(**given, **input_dtypes, **{n: data_dtype for n in inputs})
        except mx.base.MXNetError as e:
            return first_line(str(e))
    return infer


def fitting_input_dtypes(symbol: Any, dtypes: Mapping[str, str],
                         input_dtypes: Optional[Mapping[str, str]] = None) -> Optional[Dict[str, str]]:
    """The dtype of every argument of ``symbol`` when its data inputs (those not in ``input_dtypes``)
    get one float dtype that MXNet's type inference accepts with the parameters' ``dtypes``:
    float32 (what bind gives an input) or else one of the parameters' float dtypes, the most common
    first.  None when none fits."""
    arguments = symbol.list_arguments()
    # bfloat16 cannot be given to MXNet's Python type inference (its variables declare it in the graph)
    dtypes = {k: t for k, t in dtypes.items() if t != "bfloat16"}
    fit = _first_fit(_type_inference(symbol, dtypes, dict(input_dtypes or {}), arguments), dtypes)
    if fit is None:
        return None
    data_dtype, got = fit
    return {n: dtype_name(x) if x is not None else data_dtype for n, x in zip(arguments, got[0])}


def _first_fit(infer, dtypes: Mapping[str, str]):
    """(data dtype, MXNet's inferred types) for the first data dtype that fits (see
    fitting_input_dtypes), or None."""
    counts = _dtype_counts(dtypes)
    floats = sorted((t for t in counts if np.dtype(t).kind == "f"), key=lambda t: -counts[t])
    for t in ["float32"] + [t for t in floats if t != "float32"]:
        got = infer(dict(dtypes), t)
        if not isinstance(got, str):
            return t, got
    return None


#: Inputs of an op that hold a layer's parameters (slot numbers), where the op reads nothing else there.
_PARAM_SLOTS = {"Convolution": (1, 2), "Deconvolution": (1, 2), "FullyConnected": (1, 2), "Embedding": (1,),
                "BatchNorm": (1, 2, 3, 4), "LayerNorm": (1, 2), "InstanceNorm": (1, 2), "GroupNorm": (1, 2),
                "LeakyReLU": (1,), "RNN": (1,)}


def weight_variables(graph: Graph, symbol: Any, input_shapes: Optional[Mapping[str, Tuple[int, ...]]] = None) -> List[str]:
    """The graph's variables that are weights, in the graph's order: its auxiliary states, the variables
    read only where a layer takes its parameters (a Convolution's weight and bias, a BatchNorm's gamma…),
    and, given the data inputs' shapes, every other argument whose shape MXNet infers from them (a
    data input's shape is given, a weight's follows from the layers)."""
    import mxnet as mx

    readers: Dict[str, List[Tuple[str, int]]] = {}
    for nd in graph.nodes:
        for slot, e in enumerate(nd.inputs):
            if e.node.op == "null":
                readers.setdefault(e.node.name, []).append((nd.op, slot))
    weights = set(symbol.list_auxiliary_states())
    for name, uses in readers.items():
        if uses and all(slot in _PARAM_SLOTS.get(op, ()) for op, slot in uses):
            weights.add(name)
    if input_shapes:
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                inferred = symbol.infer_shape_partial(**dict(input_shapes))[0]
        except mx.base.MXNetError:
            inferred = None
        for name, shape in zip(symbol.list_arguments(), inferred or ()):
            if name not in input_shapes and shape and 0 not in shape:
                weights.add(name)
    return [n for n in symbol.list_arguments() + symbol.list_auxiliary_states() if n in weights]


def _infers_without_params(symbol: Any) -> bool:
    """Whether MXNet's partial shape inference runs on the graph with no shape given at all."""
    import mxnet as mx

    try:
        symbol.infer_shape_partial()
    except mx.base.MXNetError:
        return False
    return True


_DIM = re.compile(r"\s*[0-9]+\s*$")
_MAX_RANK = 32


def max_tensor_size() -> int:
    """The most elements MXNet takes in one dimension and in one tensor: 2^31 - 1 unless it was
    built with USE_INT64_TENSOR_SIZE (then 2^63 - 1)."""
    from mxnet.ndarray.ndarray import _int64_enabled
    return 2 ** 63 - 1 if _int64_enabled() else 2 ** 31 - 1


def parse_shape(text: str) -> Tuple[str, Tuple[int, ...]]:
    """``"data=1,3,224,224"`` -> ("data", (1, 3, 224, 224)): positive dimensions whose product MXNet takes."""
    name, sep, dims = text.partition("=")
    parts = [d for d in dims.split(",") if d.strip()]
    shape = tuple(int(d) for d in parts) if all(_DIM.match(d) for d in parts) else ()
    if not sep or not name.strip() or not shape or any(d <= 0 for d in shape):
        raise FusionError("cannot parse --shape '%s': expected NAME=D1,D2,... with positive integers" % text)
    if len(shape) > _MAX_RANK:
        raise FusionError("--shape '%s' has %d dimensions; at most %d (NumPy's limit: --verify and the "
                          "self-check draw inputs with it)" % (text, len(shape), _MAX_RANK))
    limit = max_tensor_size()
    size = 1
    for d in shape:
        size *= d
    if size > limit:
        raise FusionError("--shape '%s' has %d elements; MXNet %s takes at most %d (2^%d - 1) per tensor"
                          % (text, size, _mx_version(), limit, limit.bit_length()))
    return name.strip(), shape


def output_paths(out: str, model_path: str) -> Tuple[str, str]:
    """``OUT_PREFIX-symbol.json`` and ``OUT_PREFIX-0000.params``; ``OUT`` ending in / (or a folder) keeps the model's name."""
    if not out.strip():
        raise FusionError("-o '%s' names no output: give a prefix (out/model) or a folder (out/)" % out)
    if out.endswith(os.sep) or os.path.isdir(out):
        base = os.path.basename(model_path)
        for suffix in ("-symbol.json", ".json", ".onnx"):
            if base.endswith(suffix):
                base = base[: -len(suffix)]
                break
        out = os.path.join(out, base)
    return out + "-symbol.json", out + "-0000.params"


def write_model(prefix_paths: Tuple[str, str], symbol: Any, arg: Mapping[str, Any], aux: Mapping[str, Any],
                protect: Iterable[str] = ()) -> None:
    """Write symbol and params atomically (both or neither); refuse to write over any path in ``protect``."""
    publish(model_files(prefix_paths, symbol, arg, aux), inputs=protect)


def model_files(prefix_paths: Tuple[str, str], symbol: Any, arg: Mapping[str, Any],
                aux: Mapping[str, Any]) -> List[Tuple[str, str, Callable[[str], None]]]:
    """The (what, path, writer) triples of a model's two files, for :func:`fusion.files.publish.publish`."""
    import mxnet as mx

    sym_path, params_path = prefix_paths
    payload = {"arg:" + k: v for k, v in arg.items()}
    payload.update({"aux:" + k: v for k, v in aux.items()})
    return [("the model's symbol file", sym_path, lambda tmp: _write_text(tmp, symbol_json(symbol))),
            ("the model's params file", params_path, lambda tmp: mx.nd.save(tmp, payload))]


def text_file(what: str, path: str, text: Union[str, Callable[[], str]]) -> Tuple[str, str, Callable[[str], None]]:
    """A (what, path, writer) triple of a text file (``text`` may be computed when it is written)."""
    return what, path, lambda tmp: _write_text(tmp, text() if callable(text) else text)


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def write_text_atomic(path: str, text: str, protect: Iterable[str] = ()) -> None:
    publish([text_file("file", path, text)], inputs=protect)
