"""Every CPU inference engine on one machine, in one run: MXNet, mxnet-fusion, ONNX Runtime, OpenVINO.

    OMP_NUM_THREADS=2 python benchmarks/bench_cpu_engines.py [--models resnet50_v1b,densenet121] [--cv]
                                                             [--rounds 20] [--quick] [--json out.json]
                                                             [--engines mx,fused,ort] [--ort-spin]

Models (batch 1, random weights; GluonCV 0.10 builds the CNNs, ``pip install gluoncv==0.10.5.post0``,
not a dependency of the project): ResNet-50 v1b and v2, MobileNetV3-Large, DenseNet-121,
SE-ResNeXt50 32x4d, ResNeSt50 (224×224), InceptionV3 (299×299), and for contrast BERT-base
(the 12-layer encoder of ``bench_bert.py``, sequence 128); ``--cv`` adds the ten detection,
segmentation and pose models of ``bench_cv.py``; ``tiny_cnn`` (no GluonCV needed) is what the
test suite runs (``tests/test_bench_cpu_engines.py``).

Engines (columns), each on the same input:

* ``mx``          MXNet's default bind of the float32 model (``simple_bind``, its oneDNN subgraph
                  backend on: what a user gets) — the baseline of every ratio;
* ``mx_off``      the same with ``MXNET_SUBGRAPH_BACKEND=NONE``;
* ``fused``       ``fusion.fuse(sym, arg, aux, input_shapes=...)``, default bind;
* ``fused_bf16``  the same with ``precision="bf16"``; only on a CPU with ``avx512_bf16`` or
                  ``amx_bf16`` (else "n/a: no bf16 on this CPU");
* ``amp_bf16``    MXNet's AMP (``mx.contrib.amp.convert_model(..., target_dtype="bfloat16",
                  cast_optional_params=True)``, as ``fusion/precision/policy.py`` uses it), default
                  bind; a reference, on the same CPUs as ``fused_bf16``;
* ``ort``         ONNX Runtime (CPU, all graph optimizations, intra-op threads = OMP_NUM_THREADS)
                  on the project's own ``mxfuse --to-onnx`` export of the fused float32 model
                  (``fusion/doors/cli.py``: ``export_onnx`` target ort, opset 17, validated in ONNX
                  Runtime against MXNet as it is written; a fused op ONNX has no form for is exported
                  un-fused); ORT's worker threads do not spin between runs (they would take the cores
                  from the engine timed next; ``--ort-spin`` lets them);
* ``ov_f32``, ``ov_default``  OpenVINO (where ``openvino`` is installed; an optional dependency of
                  this benchmark only) on the same ONNX file: ``INFERENCE_PRECISION_HINT=f32``, and
                  OpenVINO's default (bfloat16 on a CPU with native bfloat16), latency hint, the same
                  thread count.

Preparation (fuse, AMP conversion, ONNX export + validation, session creation, compile, bind) is
timed apart and printed per engine, never in the timed path.  The engines are then timed round by
round (one call of each per round, the order rotated each round, after warm-up rounds): per engine
the median and the p10-p90 spread of its calls, and ``vs mx`` = MXNet default bind median ÷ engine
median (above 1: faster).  Correctness per engine: ``max|Δ| / max|ref|`` of its outputs against MXNet
with the subgraph backend off on the same input ("!" where above 1e-4 for float32 engines, 2e-2 for
bfloat16 ones, or above the MXNet default bind's own spread where that is larger: a detector's outputs
after NMS are compared element by element here, and near-ties swap places; ``bench_cv.py`` compares
them as sets of rows).
Printed first: the CPU (model name, the ISA flags that matter), the thread count, the versions.  An
engine failing on a model prints its error in its cell; the run goes on.  ``--quick``: 3 rounds,
1 warm-up round, fused without the self-check.

The machine is shared: wrap a timing run in ``flock /tmp/mxf-bench.lock`` and read the p10-p90
spreads before the medians.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
import traceback

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fusion.native.env import configure_threads  # noqa: E402  (must run before mxnet is imported)

configure_threads()

import numpy as np  # noqa: E402

import fusion  # noqa: E402
from fusion.check.verify import run as run_model  # noqa: E402
from fusion.native.env import quiet_native_stderr, subgraph_backend  # noqa: E402
from fusion.precision import policy as P  # noqa: E402

#: model -> (GluonCV model zoo name, input shape NCHW)
ZOO = {
    "resnet50_v1b": ("resnet50_v1b", (1, 3, 224, 224)),
    "resnet50_v2": ("resnet50_v2", (1, 3, 224, 224)),
    "mobilenetv3_large": ("mobilenetv3_large", (1, 3, 224, 224)),
    "densenet121": ("densenet121", (1, 3, 224, 224)),
    "se_resnext50_32x4d": ("se_resnext50_32x4d", (1, 3, 224, 224)),
    "resnest50": ("resnest50", (1, 3, 224, 224)),
    "inceptionv3": ("inceptionv3", (1, 3, 299, 299)),
}
BERT = "bert_base"          # bench_bert.py's encoder, 12 layers, sequence 128
TINY = "tiny_cnn"           # for the test suite: no GluonCV
DEFAULT_MODELS = list(ZOO) + [BERT]

ENGINES = ("mx", "mx_off", "fused", "fused_bf16", "amp_bf16", "ort", "ov_f32", "ov_default")
LABELS = {"mx": "mx fp32", "mx_off": "mx off", "fused": "fused fp32", "fused_bf16": "fused bf16",
          "amp_bf16": "amp bf16", "ort": "ort fp32", "ov_f32": "ov fp32", "ov_default": "ov default"}
BF16_ENGINES = ("fused_bf16", "amp_bf16")
FP32_TOL = 1e-4
BF16_TOL = P.TOLERANCE[P.BFLOAT16]
ISA = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


# ---------------------------------------------------------------- the machine

def cpu_model() -> str:
    from fusion.engine.cost import cpu_identity
    return cpu_identity()[0]


def versions() -> dict:
    import mxnet as mx

    out = {"mxnet_fusion": fusion.__version__, "mxnet": mx.__version__, "numpy": np.__version__,
           "python": platform.python_version()}
    for mod in ("onnx", "onnxruntime", "openvino", "gluoncv"):
        try:
            m = __import__(mod)
            out[mod] = getattr(m, "__version__", None) or m.get_version()
        except Exception as e:     # noqa: BLE001  (an optional engine: say why it is absent)
            out[mod] = "not installed (%s)" % _one_line(e)
    return out


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # MXNet's errors: the line that says what failed, not the stack trace around it
    pick = next((ln for ln in lines if "Check failed" in ln or "Error" in ln), lines[0] if lines else "")
    return ("%s: %s" % (type(e).__name__, pick))[:300]


def threads() -> int:
    return int(os.environ.get("OMP_NUM_THREADS") or 1)


# ---------------------------------------------------------------- the models

def tiny_cnn():
    """conv-BN-ReLU, a residual pair, global pool, dense: every engine's path in a second."""
    import mxnet as mx

    S = mx.sym

    def cbr(x, name, nf, act=True):
        x = S.BatchNorm(S.Convolution(x, num_filter=nf, kernel=(3, 3), pad=(1, 1), no_bias=True, name=name),
                        fix_gamma=False, name=name + "_bn")
        return S.Activation(x, act_type="relu", name=name + "_relu") if act else x

    x = cbr(S.var("data"), "c1", 16)
    x = S.Activation(cbr(cbr(x, "c2", 16), "c3", 16, act=False) + x, act_type="relu", name="res_relu")
    x = S.Pooling(x, global_pool=True, kernel=(1, 1), pool_type="avg", name="gap")
    sym = S.FullyConnected(S.flatten(x), num_hidden=10, name="fc")
    shape = (1, 3, 16, 16)
    rng = np.random.default_rng(0)
    arg_shapes, _, aux_shapes = sym.infer_shape(data=shape)
    arg = {n: mx.nd.array(rng.uniform(0.5, 1.5, s) if n.endswith("gamma") else rng.normal(0, 0.3, s))
           for n, s in zip(sym.list_arguments(), arg_shapes) if n != "data"}
    aux = {n: mx.nd.array(rng.uniform(0.5, 2.0, s) if n.endswith("var") else rng.normal(0, 0.2, s))
           for n, s in zip(sym.list_auxiliary_states(), aux_shapes)}
    return sym, arg, aux, {"data": shape}


def build(name: str):
    """(symbol, arg_params, aux_params, input shapes) of ``name``."""
    import mxnet as mx

    if name == TINY:
        return tiny_cnn()
    if name == BERT:
        from bench_bert import encoder, random_weights
        seq, hidden = 128, 768
        sym = encoder(12, hidden, 12, 3072, written=False)
        arg = {k: mx.nd.array(v) for k, v in random_weights(sym, seq, hidden).items()}
        return sym, arg, {}, {"data": (1, seq, hidden)}
    if name in ZOO:
        from fusion.testing.gcv_zoo import gcv_zoo_model
        zoo_name, shape = ZOO[name]
        sym, arg, aux = gcv_zoo_model(zoo_name, shape, 0, bn_by_nodes=True)
        return sym, arg, aux, {"data": shape}
    from cv_models import build as build_cv
    sym, arg, aux, shape = build_cv(name)
    return sym, arg, aux, {"data": shape}


def known_models() -> list:
    from cv_models import MODELS
    return list(ZOO) + [BERT, TINY] + list(MODELS)


# ---------------------------------------------------------------- the engines

class NotApplicable(Exception):
    """An engine that does not apply here (its cell says why; not an error)."""


def mx_engine(sym, arg, aux, inputs, subgraph: bool = True):
    """MXNet as a user binds it: ``simple_bind`` (the subgraph backend as ``subgraph`` says), the
    parameters copied in; ``bind`` with the arrays where simple_bind cannot allocate them (a model
    with bfloat16 parameters: AMP's, precision='bf16')."""
    import mxnet as mx

    from fusion.check.verify import bind

    shapes = {k: tuple(v.shape) for k, v in inputs.items()}
    how = ""
    with subgraph_backend(subgraph):
        exe = None
        if not any(P.is_bf16(v.dtype) for v in list(arg.values()) + list(aux.values())):
            try:
                exe = sym.simple_bind(mx.cpu(), grad_req="null", **shapes)
                exe.copy_params_from(arg, aux, allow_extra_params=True)
                for k, v in inputs.items():
                    exe.arg_dict[k][:] = v
            except mx.base.MXNetError as e:
                exe, how = None, "bound with its arrays (simple_bind: %s)" % _one_line(e)
        if exe is None:
            exe = bind(sym, arg, aux, {k: mx.nd.array(v, dtype=v.dtype) for k, v in inputs.items()})

    def step():
        return [o.asnumpy() for o in exe.forward(is_train=False)]

    def timed():
        for o in exe.forward(is_train=False):
            o.wait_to_read()
    return timed, step, how


def ort_options(spin: bool):
    """ONNX Runtime's session options here: all graph optimizations, OMP_NUM_THREADS intra-op threads,
    sequential, worker threads spinning only when ``spin``."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads()
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


def ort_engine(path: str, inputs, spin: bool):
    import onnxruntime as ort

    sess = ort.InferenceSession(path, ort_options(spin), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    feed = {n: inputs[n] for n in names}

    def step():
        return sess.run(None, feed)
    return step, step


def ov_engine(path: str, inputs, precision):
    """OpenVINO's CPU plugin on the ONNX file; ``precision`` None: its default."""
    try:
        import openvino as ov
    except ImportError as e:
        raise NotApplicable("n/a: openvino not installed (%s)" % e) from None
    core = ov.Core()
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads()}
    if precision is not None:
        config["INFERENCE_PRECISION_HINT"] = precision
    compiled = core.compile_model(core.read_model(path), "CPU", config)
    request = compiled.create_infer_request()
    feed = {p.get_any_name(): inputs[p.get_any_name()] for p in compiled.inputs}
    runs_in = compiled.get_property("INFERENCE_PRECISION_HINT")
    note = "runs in %s" % getattr(runs_in, "get_type_name", lambda: str(runs_in))()

    def timed():
        request.infer(feed)

    def step():
        res = request.infer(feed)
        return [np.array(res[o]) for o in compiled.outputs]
    return timed, step, note


def export_onnx_file(fused, shapes, path: str):
    """The fused model as ``mxfuse --to-onnx`` writes it (target ort, opset 17, validated in ONNX
    Runtime against MXNet); what the validation said."""
    from fusion.doors.cli import _export_onnx
    return _export_onnx(fused, shapes, path, {"target": "ort", "opset": None})


# ---------------------------------------------------------------- one model

def rel_err(got, ref) -> float:
    """max over outputs of max|got − ref| / max|ref| (inf where shapes or NaN/inf places differ)."""
    if len(got) != len(ref):
        return float("inf")
    worst = 0.0
    for g, r in zip(got, ref):
        g, r = P.as_float32(np.asarray(g)).astype(np.float64), P.as_float32(np.asarray(r)).astype(np.float64)
        if g.shape != r.shape or not np.array_equal(np.isfinite(g), np.isfinite(r)):
            return float("inf")
        fin = np.isfinite(r)
        if fin.any():
            scale = float(np.abs(r[fin]).max()) or 1.0
            worst = max(worst, float(np.abs(g[fin] - r[fin]).max()) / scale)
    return worst


def prepare(name, sym, arg, aux, shapes, inputs, engines, args, tmp):
    """engine -> dict(timed, step, prep_s, note) or dict(error)/dict(na)."""
    out = {}
    bf16_reason = P.native_bf16_reason()

    def attempt(key, make):
        if key not in engines:
            return
        t = time.perf_counter()
        try:
            got = make()
            timed, step = got[0], got[1]
            note = "; ".join(x for x in got[2:] if x)
            out[key] = {"timed": timed, "step": step, "prep_s": time.perf_counter() - t, "note": note,
                        "bf16": key in BF16_ENGINES or "runs in bf16" in note}
        except NotApplicable as e:
            out[key] = {"na": str(e)}
        except Exception as e:      # noqa: BLE001  (one engine's failure: its cell, the run goes on)
            out[key] = {"error": _one_line(e), "prep_s": time.perf_counter() - t}
            if args.verbose:
                traceback.print_exc()
        gc.collect()

    def timed_prep(fn):
        """(result, seconds) of fn()."""
        t = time.perf_counter()
        r = fn()
        return r, time.perf_counter() - t

    attempt("mx", lambda: mx_engine(sym, arg, aux, inputs, subgraph=True))
    attempt("mx_off", lambda: mx_engine(sym, arg, aux, inputs, subgraph=False))

    fused_holder = {}

    def fused():
        res, s = timed_prep(lambda: fusion.fuse(sym, arg, aux, input_shapes=shapes, self_check=not args.quick))
        fused_holder["res"] = res
        timed, step, how = mx_engine(res.symbol, res.arg_params, res.aux_params, inputs)
        lib = sorted({n.op for n in fusion.Graph.from_symbol(res.symbol).op_nodes() if n.op.startswith("fused_")})
        return timed, step, "fuse %.1f s; %s" % (s, ", ".join(lib) if lib else "no library ops"), how

    need_fused = "fused" in engines or "ort" in engines or "ov_f32" in engines or "ov_default" in engines
    if need_fused:
        if "fused" in engines:
            attempt("fused", fused)
        else:
            try:
                fused_holder["res"] = fusion.fuse(sym, arg, aux, input_shapes=shapes, self_check=not args.quick)
            except Exception as e:      # noqa: BLE001
                fused_holder["error"] = _one_line(e)

    def fused_bf16():
        if bf16_reason is not None:
            raise NotApplicable("n/a: no bf16 on this CPU")
        res, s = timed_prep(lambda: fusion.fuse(sym, arg, aux, input_shapes=shapes, precision="bf16",
                                                self_check=not args.quick))
        timed, step, how = mx_engine(res.symbol, res.arg_params, res.aux_params, inputs)
        amp = any(n.op == "amp_cast" for n in fusion.Graph.from_symbol(res.symbol).op_nodes())
        return timed, step, "fuse %.1f s%s" % (s, "; convolutions in bf16 through MXNet's AMP" if amp else ""), how

    def amp_bf16():
        if bf16_reason is not None:
            raise NotApplicable("n/a: no bf16 on this CPU")
        from mxnet.contrib import amp
        (asym, aarg, aaux), s = timed_prep(lambda: amp.convert_model(
            sym, {k: v.copy() for k, v in arg.items()}, {k: v.copy() for k, v in aux.items()},
            target_dtype="bfloat16", cast_optional_params=True))
        timed, step, how = mx_engine(asym, aarg, aaux, inputs)
        return timed, step, "convert %.1f s" % s, how

    attempt("fused_bf16", fused_bf16)
    attempt("amp_bf16", amp_bf16)

    onnx_path = os.path.join(tmp, name + ".onnx")
    onnx_state = {}

    def onnx_file():
        if "path" in onnx_state or "error" in onnx_state:
            if "error" in onnx_state:
                raise RuntimeError("the ONNX export failed: %s" % onnx_state["error"])
            return onnx_state
        if "res" not in fused_holder:
            onnx_state["error"] = "no fused model (%s)" % fused_holder.get("error", "fuse failed")
            raise RuntimeError(onnx_state["error"])
        t = time.perf_counter()
        try:
            said = export_onnx_file(fused_holder["res"], shapes, onnx_path)
        except Exception as e:      # noqa: BLE001
            onnx_state["error"] = _one_line(e)
            raise
        onnx_state.update(path=onnx_path, export_s=time.perf_counter() - t, said=said)
        return onnx_state

    def ort():
        try:
            import onnxruntime  # noqa: F401
        except ImportError as e:
            raise NotApplicable("n/a: onnxruntime not installed (%s)" % e) from None
        st = onnx_file()
        t = time.perf_counter()
        timed, step = ort_engine(st["path"], inputs, args.ort_spin)
        return timed, step, "export+validate %.1f s (ORT vs MXNet: %s), session %.1f s" % (
            st["export_s"], st["said"], time.perf_counter() - t)

    def ov(precision):
        def make():
            try:
                import openvino  # noqa: F401
            except ImportError as e:
                raise NotApplicable("n/a: openvino not installed (%s)" % _one_line(e)) from None
            st = onnx_file()
            t = time.perf_counter()
            timed, step, note = ov_engine(st["path"], inputs, precision)
            return timed, step, "%s; compile %.1f s" % (note, time.perf_counter() - t)
        return make

    attempt("ort", ort)
    attempt("ov_f32", ov("f32"))
    attempt("ov_default", ov(None))
    return out


def run_rounds(ready: dict, rounds: int, warmup: int) -> dict:
    """engine -> seconds of each timed call, round by round (order rotated each round); an engine
    that raises is dropped with its error."""
    keys = list(ready)
    samples = {k: [] for k in keys}
    errors = {}
    for r in range(warmup + rounds):
        live = [k for k in keys if k not in errors]
        order = live[r % len(live):] + live[:r % len(live)] if live else []
        for k in order:
            t = time.perf_counter()
            try:
                ready[k]["timed"]()
            except Exception as e:      # noqa: BLE001
                errors[k] = "timing: " + _one_line(e)
                continue
            if r >= warmup:
                samples[k].append(time.perf_counter() - t)
    return samples, errors


def bench_model(name: str, engines, args) -> dict:
    t = time.perf_counter()
    sym, arg, aux, shapes = build(name)
    build_s = time.perf_counter() - t
    rng = np.random.default_rng(0)
    inputs = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    print("\n%s %s: built in %.1f s" % (name, " ".join("%s=%s" % (k, "x".join(map(str, s))) for k, s in shapes.items()),
                                        build_s))
    sys.stdout.flush()
    with quiet_native_stderr():
        ref = run_model(sym, arg, aux, inputs, subgraph=False)       # the correctness reference
    with tempfile.TemporaryDirectory(prefix="bench_cpu_engines-") as tmp:
        prepared = prepare(name, sym, arg, aux, shapes, inputs, engines, args, tmp)
        ready = {k: v for k, v in prepared.items() if "timed" in v}
        for k, v in ready.items():          # one untimed call each: the correctness figure
            try:
                v["rel_err"] = rel_err(v["step"](), ref)
            except Exception as e:      # noqa: BLE001
                v["error"] = "run: " + _one_line(e)
        ready = {k: v for k, v in ready.items() if "error" not in v}
        samples, errors = run_rounds(ready, args.rounds, args.warmup)
    spread = prepared.get("mx", {}).get("rel_err", 0.0) or 0.0
    row = {"model": name, "shapes": {k: list(s) for k, s in shapes.items()}, "engines": {}}
    base = None
    if samples.get("mx"):
        base = float(np.median(samples["mx"])) * 1e3
    for k in engines:
        v = prepared.get(k, {})
        cell = {}
        if "na" in v:
            cell["na"] = v["na"]
        elif "error" in v or k in errors:
            cell["error"] = errors.get(k) or v["error"]
        elif k in samples and samples[k]:
            ms = np.asarray(samples[k]) * 1e3
            med = float(np.median(ms))
            cell.update(median_ms=med, p10_ms=float(np.percentile(ms, 10)), p90_ms=float(np.percentile(ms, 90)),
                        calls=len(ms), vs_mx=(base / med) if base else None)
        if "rel_err" in v:
            cell["rel_err"] = v["rel_err"]
            tol = max(BF16_TOL if v.get("bf16") else FP32_TOL, spread)
            cell["within_tolerance"] = bool(v["rel_err"] <= tol)
            cell["tolerance"] = tol
        if "prep_s" in v:
            cell["prep_s"] = v["prep_s"]
        if v.get("note"):
            cell["note"] = v["note"]
        row["engines"][k] = cell
        print("  " + engine_line(k, cell))
    sys.stdout.flush()
    del prepared, ready
    gc.collect()
    return row


def engine_line(k: str, cell: dict) -> str:
    head = "%-11s" % LABELS[k]
    if "na" in cell:
        return "%s %s" % (head, cell["na"])
    if "error" in cell and "median_ms" not in cell:
        return "%s ERROR %s" % (head, cell["error"])
    ratio = "%.2fx" % cell["vs_mx"] if cell.get("vs_mx") else "-"
    err = cell.get("rel_err")
    return "%s %9.2f ms [%.2f-%.2f]  vs mx %6s  max|Δ|/max|ref| %s%s  prep %.1f s%s" % (
        head, cell["median_ms"], cell["p10_ms"], cell["p90_ms"], ratio,
        "%.1e" % err if err is not None else "-", "" if cell.get("within_tolerance", True) else " !",
        cell.get("prep_s", 0.0), ("  (%s)" % cell["note"]) if cell.get("note") else "")


def table(rows, engines) -> str:
    w = 16
    lines = ["%-28s" % "model" + "".join("%*s" % (w, LABELS[k]) for k in engines)]
    for r in rows:
        cells = []
        for k in engines:
            c = r["engines"].get(k, {})
            if "median_ms" in c:
                s = ("%.1f" if c["median_ms"] >= 10 else "%.2f") % c["median_ms"] + (" %.2fx" % c["vs_mx"] if c.get("vs_mx") and k != "mx" else "")
                if not c.get("within_tolerance", True):
                    s += "!"
            elif "na" in c:
                s = "n/a"
            elif "error" in c:
                s = "error"
            else:
                s = "-"
            cells.append("%*s" % (w, s))
        lines.append("%-28s" % r["model"][:28] + "".join(cells))
    lines.append("median ms of interleaved calls; Nx = MXNet default bind (mx fp32) median / engine median "
                 "(above 1: faster); ! = max|Δ|/max|ref| beyond tolerance; n/a and errors: see each model's lines")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", help="comma-separated (default: %s)" % ",".join(DEFAULT_MODELS))
    ap.add_argument("--cv", action="store_true", help="also the ten models of bench_cv.py")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of %s" % ",".join(ENGINES))
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds, one call per engine each (default 20; "
                                                             "--quick: 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 3; --quick: 1)")
    ap.add_argument("--quick", action="store_true", help="3 rounds, 1 warm-up round, fuse without the self-check")
    ap.add_argument("--ort-spin", action="store_true", help="let ONNX Runtime's worker threads spin between runs")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--verbose", action="store_true", help="tracebacks of engine failures")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    engines = [e for e in args.engines.split(",") if e]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        ap.error("unknown engine(s) %s; known: %s" % (", ".join(bad), ", ".join(ENGINES)))
    names = [m for m in (args.models.split(",") if args.models else DEFAULT_MODELS) if m]
    if args.cv:
        from cv_models import MODELS
        names += [m for m in MODELS if m not in names]
    unknown = [m for m in names if m not in known_models()]
    if unknown:
        ap.error("unknown model(s) %s; known: %s" % (", ".join(unknown), ", ".join(known_models())))
    flags = P.cpu_flags()
    vers = versions()
    bf16 = P.native_bf16_reason()
    print("CPU: %s; ISA: %s; bf16: %s" % (cpu_model(), " ".join(f for f in ISA if f in flags) or "none of " +
                                         ",".join(ISA), "native" if bf16 is None else "no (%s)" % bf16))
    print("threads: OMP_NUM_THREADS=%s (ORT intra-op and OpenVINO the same; ORT spinning %s), "
          "MXNET_CPU_PARALLEL_SIZE=%s; batch 1" % (os.environ.get("OMP_NUM_THREADS"), "on" if args.ort_spin else "off",
                                                    os.environ.get("MXNET_CPU_PARALLEL_SIZE")))
    print("versions: " + ", ".join("%s %s" % kv for kv in vers.items()))
    print("%d timed rounds after %d warm-up round(s), engines interleaved (order rotated each round); "
          "load average %.1f %.1f %.1f" % (args.rounds, args.warmup, *os.getloadavg()))
    rows = []
    for n in names:
        try:
            rows.append(bench_model(n, engines, args))
        except Exception as e:      # noqa: BLE001  (a model that does not build: the others go on)
            print("\n%s: FAILED: %s" % (n, _one_line(e)))
            if args.verbose:
                traceback.print_exc()
            rows.append({"model": n, "error": _one_line(e), "engines": {k: {"error": "model"} for k in engines}})
        sys.stdout.flush()
    print("\nCPU: %s (%s), %s thread(s); load average %.1f %.1f %.1f" % (
        cpu_model(), " ".join(f for f in ISA if f in flags), os.environ.get("OMP_NUM_THREADS"), *os.getloadavg()))
    print(table(rows, engines))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cpu": cpu_model(), "isa": [f for f in ISA if f in flags], "native_bf16": bf16 is None,
                       "threads": os.environ.get("OMP_NUM_THREADS"), "versions": vers, "rounds": args.rounds,
                       "warmup": args.warmup, "ort_spinning": args.ort_spin, "results": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
