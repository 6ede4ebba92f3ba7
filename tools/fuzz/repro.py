"""Standalone reproducer scripts: the graph written with ``mx.sym``, its values, and the failing check.

A reproducer needs only the project (``fusion``), MXNet and NumPy: run it from the project
root (``.venv/bin/python fuzz_failures/<file>.py``); it prints what differs and exits 1 while
the failure is there, 0 once it is fixed.
"""
from __future__ import annotations

import base64
import json
import os
import re
from typing import Dict

import numpy as np

from .case import Case
from .oracle import Finding

_DTYPE_CODES = {"0": "float32", "1": "float64", "2": "float16", "3": "uint8", "4": "int32", "5": "int8", "6": "int64"}

HARNESS = r'''
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("MXNET_CPU_PARALLEL_SIZE", "2000000000")
sys.path.insert(0, os.environ.get("PROJECT_ROOT", os.getcwd()))     # run from the project root
import base64                                                       # noqa: E402
import numpy as np                                                  # noqa: E402
import mxnet as mx                                                  # noqa: E402
import fusion                                                       # noqa: E402
from fusion.native.env import subgraph_backend                           # noqa: E402

S, I = mx.sym, mx.sym._internal
RTOL, ATOL, RTOL_GRAD, ATOL_GRAD = 1e-4, 1e-6, 1e-3, 1e-4


def b64(text, dtype, shape):
    return np.frombuffer(base64.b64decode(text), dtype=dtype).reshape(shape).copy()


def nd(d):
    return {k: (v.copy() if isinstance(v, mx.nd.NDArray) else mx.nd.array(v, dtype=v.dtype)) for k, v in d.items()}


def run(sym, arg, aux, x, subgraph=False):
    """Inference outputs (MXNet's oneDNN subgraph backend off unless asked)."""
    vals = nd({**arg, **x})
    with subgraph_backend(subgraph):
        exe = sym.bind(mx.cpu(), {n: vals[n] for n in sym.list_arguments()},
                       aux_states={n: nd(aux)[n] for n in sym.list_auxiliary_states()}, grad_req="null")
    return [o.asnumpy() for o in exe.forward(is_train=False)]


def train(sym, arg, aux, x):
    """forward(is_train=True) + backward with fixed head gradients: (outputs, gradients)."""
    vals = nd({**arg, **x})
    args = {n: vals[n] for n in sym.list_arguments()}
    grads = {n: mx.nd.zeros(v.shape, dtype=v.dtype) for n, v in args.items() if np.issubdtype(np.dtype(v.dtype), np.floating)}
    req = {n: ("write" if n in grads else "null") for n in args}
    with subgraph_backend(False):
        exe = sym.bind(mx.cpu(), args, args_grad=grads, grad_req=req,
                       aux_states={n: nd(aux)[n] for n in sym.list_auxiliary_states()})
    outs = exe.forward(is_train=True)
    values = [o.asnumpy() for o in outs]     # before the backward: it updates BatchNorm's moving stats unannounced
    rng = np.random.RandomState(5)
    exe.backward([mx.nd.array(rng.standard_normal(o.shape), dtype=o.dtype) for o in outs])
    return values, {n: g.asnumpy() for n, g in grads.items()}


def differs(ref, got, rtol=RTOL, atol=ATOL):
    """Why got is not ref: shape, dtype, NaN/inf positions, or max|d| > rtol*max|ref| + atol (None when equal)."""
    if ref.shape != got.shape or ref.dtype != got.dtype:
        return "shape/dtype %s %s, expected %s %s" % (got.shape, got.dtype, ref.shape, ref.dtype)
    a, b = ref.astype(np.float64), got.astype(np.float64)
    pos = (np.isnan(a) != np.isnan(b)) | (np.isinf(a) != np.isinf(b)) | (np.isinf(a) & np.isinf(b) & (a != b))
    if pos.any():
        i = np.unravel_index(np.argmax(pos), a.shape)
        return "NaN/inf differ at %d position(s), e.g. %s: expected %r, got %r" % (pos.sum(), i, a[i], b[i])
    fin = np.isfinite(a)
    if not fin.any():
        return None
    err = np.where(fin, np.abs(a - b), 0)
    tol = rtol * np.abs(a[fin]).max() + atol
    if err.max() > tol:
        i = np.unravel_index(np.argmax(err), a.shape)
        return "max|d| %.3g > %.2g at %s: expected %r, got %r" % (err.max(), tol, i, a[i], b[i])
    return None


def report(what, ref, got, names, rtol=RTOL, atol=ATOL):
    bad = False
    if len(ref) != len(got):
        print("FAIL %s: %d outputs, expected %d" % (what, len(got), len(ref)))
        return True
    for n, a, b in zip(names, ref, got):
        m = differs(a, b, rtol, atol)
        if m:
            print("FAIL %s '%s': %s" % (what, n, m))
            bad = True
    return bad


def fused_ops(sym):
    import json
    return [n["op"] for n in json.loads(sym.tojson())["nodes"] if n["op"] != "null"]


def training_dropouts(sym):
    import json
    return sum(1 for n in json.loads(sym.tojson())["nodes"]
               if n["op"] == "Dropout" and float(n.get("attrs", {}).get("p", 0.5)) > 0)


def sampling_ops(sym):
    """Ops that sample at inference (Dropout with mode='always' and p > 0, random ops): the fused graph keeps them."""
    import json
    import re
    out = []
    for n in json.loads(sym.tojson())["nodes"]:
        a = n.get("attrs", {})
        if n["op"] == "Dropout" and a.get("mode") == "always" and float(a.get("p", 0.5)) > 0:
            out.append("Dropout(always)")
        elif re.match(r"^(_random_|random_|_sample_|sample_|.*uniform_like|.*normal_like|_shuffle)", n["op"]):
            out.append(n["op"])
    return sorted(out)
'''

CHECK_CODE = {
    "inference": r'''
ref = run(sym, arg, aux, inputs)
res = fusion.fuse(FUSE_INPUT, nd(arg), nd(aux), **FUSE_KW)
print("fused ops:", fused_ops(res.symbol))
try:
    got = run(res.symbol, res.arg_params, res.aux_params, inputs)
except Exception as e:
    print("FAIL fused graph does not run:", str(e).splitlines()[0][:500]); sys.exit(1)
if sampling_ops(sym):       # the graph samples: its values cannot be compared, what samples must stay
    if sampling_ops(res.symbol) != sampling_ops(sym):
        print("FAIL the fused graph samples with %s, the original with %s" % (sampling_ops(res.symbol), sampling_ops(sym)))
        sys.exit(1)
    sys.exit(0)
sys.exit(1 if report("inference", ref, got, sym.list_outputs()) else 0)
''',
    "second": r'''
res = fusion.fuse(FUSE_INPUT, nd(arg), nd(aux), **FUSE_KW)
print("fused ops:", fused_ops(res.symbol))
ref2 = run(sym, arg, aux, inputs2)          # the original binds at the second shape
try:
    got2 = run(res.symbol, res.arg_params, res.aux_params, inputs2)
except Exception as e:
    print("FAIL fused graph does not run at the second shape:", str(e).splitlines()[0][:500]); sys.exit(1)
sys.exit(1 if report("second shape", ref2, got2, sym.list_outputs()) else 0)
''',
    "unfuse": r'''
res = fusion.fuse(FUSE_INPUT, nd(arg), nd(aux), **FUSE_KW)
print("fused ops:", fused_ops(res.symbol))
try:
    u = fusion.unfuse(res.symbol, input_shapes={k: v.shape for k, v in inputs.items()},
                      arg_params=res.arg_params, aux_params=res.aux_params)
    print("unfused ops:", fused_ops(u))
    bad = report("unfuse", run(sym, arg, aux, inputs), run(u, res.arg_params, res.aux_params, inputs), sym.list_outputs())
    if inputs2 is not None:
        bad |= report("unfuse, second shape", run(sym, arg, aux, inputs2), run(u, res.arg_params, res.aux_params, inputs2),
                      sym.list_outputs())
except Exception as e:
    print("FAIL unfuse:", str(e).splitlines()[0][:500]); sys.exit(1)
sys.exit(1 if bad else 0)
''',
    "idempotence": r'''
import json
res = fusion.fuse(FUSE_INPUT, nd(arg), nd(aux), **FUSE_KW)
print("fused ops:", fused_ops(res.symbol))
try:
    again = fusion.fuse(res.symbol, res.arg_params, res.aux_params, **FUSE_KW)
except Exception as e:
    print("FAIL fuse(fuse(g)) raises:", str(e).splitlines()[0][:500]); sys.exit(1)
canon = lambda s: [(n["op"], n.get("attrs"), [e[:2] for e in n["inputs"]]) for n in json.loads(s.tojson())["nodes"]]
if canon(again.symbol) != canon(res.symbol):
    print("FAIL fuse(fuse(g)) != fuse(g); second fuse fired", {k: len(r.fused) for k, r in again.report.rules.items() if r.fused})
    print("   ", fused_ops(res.symbol), "->", fused_ops(again.symbol)); sys.exit(1)
''',
    "training": r'''
ref_out, ref_grad = train(sym, arg, aux, inputs)
res = fusion.fuse(FUSE_INPUT, nd(arg), nd(aux), mode="training", **FUSE_KW)
print("fused ops:", fused_ops(res.symbol))
bad = False
frozen = sorted(set(arg) - set(res.symbol.list_arguments()))
new = sorted(set(res.symbol.list_arguments()) - set(sym.list_arguments()))
if frozen or new:
    print("FAIL parameters no longer trained:", frozen, " new arguments:", new); bad = True
arg_f = {**arg, **{k: v.asnumpy() for k, v in res.arg_params.items() if k not in arg}}
aux_f = {**aux, **{k: v.asnumpy() for k, v in res.aux_params.items() if k not in aux}}
if training_dropouts(res.symbol) < training_dropouts(sym):
    print("FAIL Dropout(p>0) removed in training"); bad = True
try:
    out, grad = train(res.symbol, arg_f, aux_f, inputs)
except Exception as e:
    print("FAIL fused graph does not train:", str(e).splitlines()[0][:500]); sys.exit(1)
if training_dropouts(sym) or sampling_ops(sym):     # random in training: shapes only
    sys.exit(1 if bad or [o.shape for o in out] != [o.shape for o in ref_out] else 0)
bad |= report("training output", ref_out, out, sym.list_outputs())
common = [n for n in sorted(ref_grad) if n in grad]
bad |= report("gradient", [ref_grad[n] for n in common], [grad[n] for n in common], common, RTOL_GRAD, ATOL_GRAD)
if inputs2 is not None:         # fused at the first shape, trained at the second
    ref_out, ref_grad = train(sym, arg, aux, inputs2)
    try:
        out, grad = train(res.symbol, arg_f, aux_f, inputs2)
    except Exception as e:
        print("FAIL fused graph does not train at the second shape:", str(e).splitlines()[0][:500]); sys.exit(1)
    bad |= report("training output, second shape", ref_out, out, sym.list_outputs())
    bad |= report("gradient, second shape", [ref_grad[n] for n in common], [grad[n] for n in common], common,
                  RTOL_GRAD, ATOL_GRAD)
sys.exit(1 if bad else 0)
''',
    "output_names": r'''
from fusion.precision.policy import native_bf16_reason
want, bad = sym.list_outputs(), False
tries = [("inference", {}), ("training", dict(mode="training"))]
if native_bf16_reason() is None:
    tries.append(("bf16", dict(precision="bf16")))
for label, kw in tries:
    res = fusion.fuse(FUSE_INPUT, nd(arg), nd(aux), **kw, **FUSE_KW)
    said = [n for n in res.report.notes if "output name(s) changed" in n]
    for what, got in ((label, res.symbol.list_outputs()),
                      (label + ", fused again", fusion.fuse(res.symbol, res.arg_params, res.aux_params,
                                                            **kw, **FUSE_KW).symbol.list_outputs()),
                      (label + ", unfused", fusion.unfuse(res.symbol).list_outputs())):
        diff = ["%s -> %s" % (a, b) for a, b in zip(want, got) if a != b]
        if len(got) != len(want) or (diff and not (said and all(any(d in n for n in said) for d in diff))):
            print("FAIL %s: output names %s, the model's %s" % (what, got, want)); bad = True
sys.exit(1 if bad else 0)
''',
    "subgraph": r'''
ref = run(sym, arg, aux, inputs)
assert not report("original with the subgraph backend", ref, run(sym, arg, aux, inputs, subgraph=True), sym.list_outputs())
res = fusion.fuse(FUSE_INPUT, nd(arg), nd(aux), **FUSE_KW)
print("fused ops:", fused_ops(res.symbol))
try:
    got = run(res.symbol, res.arg_params, res.aux_params, inputs, subgraph=True)
except Exception as e:
    print("FAIL fused graph does not bind with MXNet's default backend:", str(e).splitlines()[0][:500]); sys.exit(1)
sys.exit(1 if report("fused, default bind", ref, got, sym.list_outputs()) else 0)
''',
    "gluon": r'''
def gluon(backend, xs, train=False):
    """The graph as a SymbolBlock hybridized with `backend`, called on each input dict in turn."""
    names = list(xs[0])
    block = mx.gluon.SymbolBlock(sym, [mx.sym.var(n) for n in names])
    for p in block.collect_params().values():
        v = {**arg, **aux}[p.name]
        p._dtype = v.dtype
        p.shape = v.shape
        if not np.issubdtype(v.dtype, np.floating):
            p.grad_req = "null"
        p.initialize(init=mx.init.Constant(0), force_reinit=True)
        p.set_data(mx.nd.array(v, dtype=v.dtype))
    with subgraph_backend(False):
        block.hybridize(**({"backend": backend} if backend else {}))
        if not train:
            outs = [block(*[mx.nd.array(x[n], dtype=x[n].dtype) for n in names]) for x in xs]
            return [[o.asnumpy() for o in (g if isinstance(g, (list, tuple)) else [g])] for g in outs]
        x = [mx.nd.array(xs[0][n], dtype=xs[0][n].dtype) for n in names]
        for v in x:
            if np.issubdtype(np.dtype(v.dtype), np.floating):
                v.attach_grad()
        with mx.autograd.record(train_mode=True):
            got = block(*x)
        got = list(got) if isinstance(got, (list, tuple)) else [got]
        rng = np.random.RandomState(5)
        mx.autograd.backward(got, [mx.nd.array(rng.standard_normal(o.shape), dtype=o.dtype) for o in got])
        grads = {p.name: p.grad().asnumpy() for p in block.collect_params().values() if p.grad_req != "null"}
        grads.update({n: v.grad.asnumpy() for n, v in zip(names, x) if v.grad is not None})
        return [o.asnumpy() for o in got], grads

xs = [inputs] + ([inputs2] if inputs2 is not None else [])
ref, plain = [run(sym, arg, aux, x) for x in xs], gluon(None, xs)
try:
    got = gluon("fusion", xs)
except Exception as e:
    print("FAIL hybridize(backend='fusion') raises:", str(e).splitlines()[0][:500]); sys.exit(1)
bad = False
for k, (r, g) in enumerate(zip(ref, got)):
    bad |= report("hybridize(backend='fusion'), call %d" % (k + 1), r, g, sym.list_outputs())
if not training_dropouts(sym) and not sampling_ops(sym):
    try:
        ref_out, ref_grad = gluon(None, xs, train=True)
        out, grad = gluon("fusion", xs, train=True)
        bad |= report("training output", ref_out, out, sym.list_outputs())
        common = [n for n in sorted(ref_grad) if n in grad]
        bad |= report("gradient", [ref_grad[n] for n in common], [grad[n] for n in common], common, RTOL_GRAD, ATOL_GRAD)
    except Exception as e:
        print("FAIL training through hybridize(backend='fusion'):", str(e).splitlines()[0][:500]); bad = True
sys.exit(1 if bad else 0)
''',
    "bf16": r'''
RTOL_BF16 = 2e-2    # the project's bfloat16 tolerance (the fuzzer also allows the original's movement under bf16 rounding)
try:
    res = fusion.fuse(FUSE_INPUT, nd(arg), nd(aux), precision="bf16", **FUSE_KW)
except Exception as e:
    print("FAIL fuse(precision='bf16') raises:", str(e).splitlines()[0][:500]); sys.exit(1)
print("fused ops:", fused_ops(res.symbol))
bad = False
for label, x in (("bf16", inputs), ("bf16, second shape", inputs2)):
    if x is None:
        continue
    ref = run(sym, arg, aux, x)
    try:
        got = run(res.symbol, res.arg_params, res.aux_params, x)
    except Exception as e:
        print("FAIL the bf16-fused graph does not run (%s):" % label, str(e).splitlines()[0][:500]); sys.exit(1)
    bad |= report(label, ref, got, sym.list_outputs(), RTOL_BF16)
sys.exit(1 if bad else 0)
''',
}


# ---------------------------------------------------------------------------- the graph as mx.sym code
def _ident(name: str, used: set) -> str:
    base = re.sub(r"\W", "_", name)
    if not base or base[0].isdigit() or base in ("sym", "arg", "aux", "inputs", "inputs2", "S", "I", "np", "mx"):
        base = "v_" + base
    out, i = base, 1
    while out in used:
        out, i = "%s_%d" % (base, i), i + 1
    used.add(out)
    return out


def _callee(op: str) -> str:
    import mxnet as mx

    for prefix, mod in (("_contrib_", "contrib"), ("_linalg_", "linalg"), ("_random_", "random"),
                        ("_sparse_", "sparse"), ("_image_", "image")):
        if op.startswith(prefix) and hasattr(getattr(mx.sym, mod), op[len(prefix):]):
            return "S.%s.%s" % (mod, op[len(prefix):])
    if not op.startswith("_") and hasattr(mx.sym, op):
        return "S." + op
    if hasattr(mx.sym._internal, op):
        return "I." + op
    return "getattr(S, %r)" % op


def symbol_code(sym) -> str:
    """Python code building ``sym`` with mx.sym calls (names and attributes as in its JSON)."""
    data = json.loads(sym.tojson())
    outputs = sym.get_internals().list_outputs()
    # visible outputs per node: the internals list them node by node, in the JSON's order
    multi, visible, k = set(), {}, 0
    for i, n in enumerate(data["nodes"]):
        if n["op"] == "null":
            k += 1
            continue
        count = 0
        while k < len(outputs) and outputs[k].startswith(n["name"] + "_"):
            k, count = k + 1, count + 1
        visible[i] = count
        if count > 1:
            multi.add(n["name"])
    refs = [e for n in data["nodes"] for e in n["inputs"]] + data["heads"]
    if any(e[0] in visible and e[1] >= visible[e[0]] for e in refs):
        # a hidden output (box_nms's second) read: mx.sym's calls cannot reach it, the JSON can
        return "sym = mx.sym.load_json(%r)" % sym.tojson()
    lines, used, var = [], set(), {}

    def ref(e) -> str:
        node = data["nodes"][e[0]]
        v = var[e[0]]
        return "%s[%d]" % (v, e[1]) if node["name"] in multi or e[1] else v

    for i, n in enumerate(data["nodes"]):
        var[i] = _ident(n["name"], used)
        attrs = n.get("attrs", {})
        if n["op"] == "null":
            kw = ""
            if "__dtype__" in attrs:
                kw = ", dtype=%r" % _DTYPE_CODES.get(attrs["__dtype__"], attrs["__dtype__"])
            rest = {k: v for k, v in attrs.items() if k != "__dtype__"}
            if rest:
                kw += ", attr=%r" % rest
            lines.append("%s = S.var(%r%s)" % (var[i], n["name"], kw))
            continue
        args = [ref(e) for e in n["inputs"]]
        kws = ["%s=%r" % (k, v) for k, v in attrs.items() if not k.startswith("__")]
        lines.append("%s = %s(%s)" % (var[i], _callee(n["op"]), ", ".join(args + kws + ["name=%r" % n["name"]])))
    heads = [ref(h) for h in data["heads"]]
    lines.append("sym = %s" % (heads[0] if len(heads) == 1 else "S.Group([%s])" % ", ".join(heads)))
    return "\n".join(lines)


def array_code(v: np.ndarray) -> str:
    v = np.asarray(v)
    if v.size <= 48:
        def lit(x):
            if np.isnan(x):
                return "np.nan"
            if np.isinf(x):
                return "np.inf" if x > 0 else "-np.inf"
            return repr(float(x)) if np.issubdtype(v.dtype, np.floating) else repr(int(x))
        body = "[%s]" % ", ".join(lit(x) for x in v.reshape(-1))
        return "np.array(%s, dtype=%r).reshape(%r)" % (body, str(v.dtype), tuple(v.shape))
    text = base64.b64encode(np.ascontiguousarray(v).tobytes()).decode()
    return "b64(%r, %r, %r)" % (text, str(v.dtype), tuple(v.shape))


def dict_code(name: str, d: Dict[str, np.ndarray]) -> str:
    if not d:
        return "%s = {}" % name
    return "%s = {\n%s\n}" % (name, "\n".join("    %r: %s," % (k, array_code(v)) for k, v in d.items()))


def write(case: Case, finding: Finding, path: str, shrunk_from: int = 0) -> None:
    """Write the reproducer of ``finding`` on ``case`` to ``path``."""
    group = "output_names" if finding.check.endswith(".output_names") else finding.group
    if group not in CHECK_CODE:
        group = "inference"
    ops = case.op_count()
    head = ["#!/usr/bin/env python3", '"""Reproducer: %s on a %s graph (%d ops%s; fuzz seed %d).' % (
        finding.check, case.family, ops, ", shrunk from %d" % shrunk_from if shrunk_from and shrunk_from != ops else "",
        case.seed)]
    head.append("")
    head.append("Found: " + finding.detail.splitlines()[0])
    if case.flags:
        head.append("Case flags: %s" % ", ".join(sorted(case.flags)))
    head.append("Run from the project root: .venv/bin/python %s   (exits 1 while it fails)"
                % os.path.join(os.path.basename(os.path.dirname(os.path.abspath(path))), os.path.basename(path)))
    head.append('"""')
    parts = ["\n".join(head), HARNESS, "# ---------------------------------------------------------------- the graph"]
    parts.append(symbol_code(case.symbol))
    if case.json_text is not None:
        parts.append("# fuse() reads the graph as Symbol JSON text in other spellings MXNet accepts (op aliases)")
        parts.append("JSON_TEXT = %r" % case.json_text)
        parts.append("sym = mx.sym.load_json(JSON_TEXT)")
        fuse_input = "JSON_TEXT"
    else:
        fuse_input = "sym"
    parts.append("# ---------------------------------------------------------------- parameters and inputs")
    parts.append(dict_code("arg", case.arg))
    parts.append(dict_code("aux", case.aux))
    parts.append(dict_code("inputs", case.inputs()))
    parts.append(dict_code("inputs2", case.inputs(second=True)) + "   # the second shape" if case.has_second
                 else "inputs2 = None")
    if "no_shapes" in case.flags:
        kw = "{}      # fused without input shapes"
    else:
        kw = "dict(input_shapes={k: v.shape for k, v in inputs.items()}, input_dtypes={k: str(v.dtype) for k, v in inputs.items()})"
    if {"no_regions", "nan"} & case.flags:       # as the oracle fuses it (Oracle.without_regions)
        kw = 'dict(%s, rules=["default", "-region"])   # fused without regions' % kw.split("#")[0].strip()
    parts.append("FUSE_KW = " + kw)
    parts.append("# ---------------------------------------------------------------- the check: " + finding.check)
    parts.append(CHECK_CODE[group].replace("FUSE_INPUT", fuse_input).strip("\n"))
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")
