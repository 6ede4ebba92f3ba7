"""From a seed (or a recorded choice sequence) to a :class:`~tools.fuzz.case.Case`.

After the family has built its outputs, graph-level variation is drawn:

* interior values made visible: 1–2 values from inside the graph become extra graph
  outputs (as they are, or through one more op), anywhere in the head list — an
  escaping interior value must stop exactly the rewrites that would lose it;
* the order of the outputs; a NaN (and maybe an inf) in one data input;
* the JSON door: the graph handed to ``fuse`` as Symbol JSON text with other
  spellings MXNet accepts (op aliases such as ``_Plus``/``broadcast_plus``/``reshape``,
  booleans as ``1``/``true``), as files written by other tools carry them;
* now and then ``fuse`` without input shapes (what Gluon and plain callers do).

Parameters MXNet names itself (``conv0_weight``, ``bn0_moving_var`` …) get values
by their suffix; data inputs and parameters the outputs do not use are dropped.
"""
from __future__ import annotations

import contextlib
import io
import json
import random
from typing import Dict, List, Optional, Sequence

import numpy as np

from .case import Builder, Case, Invalid
from .draw import Draw
from .families import FAMILIES

ALIASES: Dict[str, List[str]] = {
    "elemwise_add": ["_add", "_plus", "_Plus"], "elemwise_sub": ["_sub", "_minus", "_Minus"],
    "elemwise_mul": ["_mul", "_Mul"], "elemwise_div": ["_div", "_Div"], "broadcast_add": ["broadcast_plus"],
    "broadcast_sub": ["broadcast_minus"], "_plus_scalar": ["_PlusScalar"], "_minus_scalar": ["_MinusScalar"],
    "_rminus_scalar": ["_RMinusScalar"], "_mul_scalar": ["_MulScalar"], "_div_scalar": ["_DivScalar"],
    "_rdiv_scalar": ["_RDivScalar"], "_power_scalar": ["_PowerScalar"], "_rpower_scalar": ["_RPowerScalar"],
    "_maximum_scalar": ["_MaximumScalar"], "_minimum_scalar": ["_MinimumScalar"],
    "_greater_scalar": ["_GreaterScalar"], "_greater_equal_scalar": ["_GreaterEqualScalar"],
    "_lesser_scalar": ["_LesserScalar"], "_lesser_equal_scalar": ["_LesserEqualScalar"],
    "_equal_scalar": ["_EqualScalar"], "_not_equal_scalar": ["_NotEqualScalar"], "_mod_scalar": ["_ModScalar"],
    "Reshape": ["reshape"], "SwapAxis": ["swapaxes"], "SliceChannel": ["split"], "Concat": ["concat"],
    "Cast": ["cast"], "Flatten": ["flatten"], "_linalg_gemm2": ["linalg_gemm2"], "sum": ["sum_axis"],
    "max": ["max_axis"], "min": ["min_axis"], "BlockGrad": ["stop_gradient"], "_copy": ["identity"],
}
_BOOL_SPELLINGS = {"True": ["1", "true"], "False": ["0", "false"]}


def family_for(seed: int, families: Sequence[str]) -> str:
    """The family of graph ``seed`` in a run over ``families`` (weighted; deterministic)."""
    rng = random.Random(seed * 2654435761 % (1 << 32))
    return rng.choices(list(families), weights=[FAMILIES[f][1] for f in families])[0]


def respell(text: str, d: Draw) -> str:
    """The same graph in other spellings MXNet reads (op aliases, boolean attribute values)."""
    data = json.loads(text)
    for node in data["nodes"]:
        al = ALIASES.get(node["op"])
        if al and d.maybe(0.7, label="alias " + node["op"]):
            node["op"] = d.choice(al, label="alias of " + node["op"])
        for k, v in list(node.get("attrs", {}).items()):
            if v in _BOOL_SPELLINGS and d.maybe(0.5, label="bool spelling"):
                node["attrs"][k] = d.choice(_BOOL_SPELLINGS[v], label="bool")
    return json.dumps(data)


def _auto_value(name: str, shape, rng: np.random.RandomState) -> np.ndarray:
    if name.endswith("moving_var") or name.endswith("_var"):
        v = rng.uniform(0.1, 2.0, shape)
    elif name.endswith("gamma"):
        v = rng.uniform(0.5, 1.5, shape) * rng.choice([-1.0, 1.0, 1.0, 1.0], shape)
    elif name.endswith("weight"):
        fan = int(np.prod(shape[1:])) or 1
        v = rng.standard_normal(shape) / np.sqrt(fan)
    else:
        v = rng.normal(0.0, 0.5, shape)
    return v.astype(np.float32)


def _taps(b: Builder, outs: List) -> List:
    """Make 1–2 interior values visible: as extra outputs or through one more op."""
    import mxnet as mx

    d = b.d
    main = outs[0] if len(outs) == 1 else mx.sym.Group(outs)
    internals = main.get_internals()
    names = internals.list_outputs()
    inputs = set(main.list_arguments()) | set(main.list_auxiliary_states())
    # (LeakyReLU(rrelu)'s mask is not written at inference: never an output)
    cands = [i for i, n in enumerate(names) if n not in inputs and not n.endswith("_mask")]
    if not cands:
        return outs
    outs = list(outs)
    for t in range(d.int(1, 2, label="taps")):
        if d.maybe(0.1, label="tap a variable %d" % t):       # an input or a parameter as an output
            v = internals[d.choice([i for i, n in enumerate(names) if n in inputs], label="tap var %d" % t)]
        else:
            v = internals[d.choice(cands, label="tap %d" % t)]
        use = d.choice(["head", "square", "sum", "twice", "relu"], [6, 1, 1, 1, 1], label="tap use %d" % t)
        if use == "square":
            v = mx.sym.square(v)
        elif use == "sum":
            v = mx.sym.sum(v)
        elif use == "twice":
            v = mx.sym.broadcast_add(v, v)
        elif use == "relu":
            v = mx.sym.relu(v)
        outs.insert(d.int(0, len(outs), label="tap position %d" % t), v)
    return outs


def generate(seed: int, family: str, replay: Optional[Sequence[int]] = None) -> Case:
    """The case of ``seed`` in ``family`` (or of the choice sequence ``replay``)."""
    import mxnet as mx

    d = Draw(seed, replay)
    b = Builder(d, family)
    with mx.name.NameManager():
        try:
            outs = list(FAMILIES[family][0](b))
            if d.maybe(0.22, label="interior taps"):
                outs = _taps(b, outs)
            if len(outs) > 1 and d.maybe(0.3, label="shuffle heads"):
                order = list(range(len(outs)))
                for i in range(len(order) - 1, 0, -1):
                    j = d.int(0, i, label="shuffle")
                    order[i], order[j] = order[j], order[i]
                outs = [outs[i] for i in order]
            sym = outs[0] if len(outs) == 1 else mx.sym.Group(outs)
        except (ValueError, IndexError, KeyError, ZeroDivisionError, mx.base.MXNetError) as e:
            raise Invalid("generator: %s: %s" % (type(e).__name__, str(e).splitlines()[0][:200]))
    arg_names, aux_names = sym.list_arguments(), sym.list_auxiliary_states()
    specs = [s for s in b.specs if s.name in arg_names]
    params = {k: v for k, v in b.params.items() if k in arg_names or k in aux_names}
    known = {s.name: s.concrete(b.dims) for s in specs}
    known.update({k: v.shape for k, v in params.items()})
    try:
        with contextlib.redirect_stdout(io.StringIO()):       # MXNet prints the arguments on failure
            arg_shapes, _, aux_shapes = sym.infer_shape(**known)
    except mx.base.MXNetError as e:
        raise Invalid("shape inference: %s" % str(e).splitlines()[0][:300])
    if arg_shapes is None:
        raise Invalid("shape inference incomplete")
    rng = np.random.RandomState(b.value_seed % (1 << 31))
    for name, shape in list(zip(arg_names, arg_shapes)) + list(zip(aux_names, aux_shapes)):
        if name not in known:
            params[name] = _auto_value(name, shape, rng)
    arg = {k: v for k, v in params.items() if k in arg_names}
    aux = {k: v for k, v in params.items() if k in aux_names}
    if d.maybe(0.08, label="NaN input"):
        floats = [s for s in specs if s.kind in ("normal", "unit") and s.dtype == "float32"]
        if floats:
            d.choice(floats, label="NaN input which").nan = True
            b.flag("nan")
    json_text = respell(sym.tojson(), d) if d.maybe(0.1, label="JSON door") else None
    if d.maybe(0.07, label="fuse without shapes"):
        b.flag("no_shapes")
    return Case(seed=seed, family=family, choices=list(d.record), symbol=sym, arg=arg, aux=aux, specs=specs,
                dims={k: v for k, v in b.dims.items() if not k.startswith("_")},
                dims2={k: v for k, v in b.second_dims().items() if not k.startswith("_")},
                value_seed=b.value_seed, flags=set(b.flags), json_text=json_text, notes=list(b.notes))
