"""bfloat16: fused bf16 vs MXNet's own AMP bf16, and both in float32, on BERT-base, GluonNLP's BERT and CNNs.

    python benchmarks/bench_precision.py [--models bert,gluonnlp,resnet50_v1,mobilenet1.0]
                                         [--layers 12] [--seqs 128,512] [--repeats 7] [--blocks 3] [--gemm]
                                         [--ceiling]

Models (batch 1, random weights):

* ``bert``: the encoder of ``bench_bert.py`` (``builtin`` variant: LayerNorm and LeakyReLU(gelu)
  ops), at each of ``--seqs``;
* ``gluonnlp``: GluonNLP 0.10's ``bert_12_768_12`` (interleaved attention ops, valid lengths; needs
  ``gluonnlp``), at each of ``--seqs``;
* ``resnet50_v1``, ``mobilenet1.0``: the Gluon model zoo's, 224×224.

Each model's systems are timed in one process, round-robin:

* ``mx fp32``: MXNet's default bind (oneDNN subgraph backend on) of the float32 model;
* ``mx amp bf16``: ``mx.contrib.amp.convert_model(sym, args, aux, target_dtype="bfloat16",
  cast_optional_params=True)``, default bind (where AMP fails, the reason is printed instead);
* ``fused fp32``: ``fusion.fuse(sym, args, aux)``;
* ``fused bf16``: ``fusion.fuse(sym, args, aux, precision="bf16")`` (``force=True`` on a CPU
  without native bfloat16, where the figures then say so);
* ``amp+fused``: the AMP model passed through ``fusion.fuse`` (AMP then fuse).

Printed per system: the median of ``blocks × repeats`` timed runs, the p10–p90 spread, the
speed-up over MXNet fp32 and over AMP bf16, the same for the best run (on a shared machine the
best run is the one least disturbed by others), and the max relative error of its output
against MXNet fp32 (``max|Δ| / max|ref|``) on the same input.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fusion.native import env as _env  # noqa: E402

_env.configure_threads()

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402

import fusion  # noqa: E402
from fusion.check.bench import executor, time_samples  # noqa: E402
from fusion.precision.policy import BF16, native_bf16_reason, to_bf16  # noqa: E402
from fusion.check.verify import run as run_model  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_bert import encoder, random_weights  # noqa: E402


def amp_bf16(sym, arg, aux):
    from mxnet.contrib import amp
    # on copies: convert_model replaces entries of the dicts it is given with their bf16 casts
    return amp.convert_model(sym, {k: v.copy() for k, v in arg.items()}, {k: v.copy() for k, v in aux.items()},
                             target_dtype="bfloat16", cast_optional_params=True)


def bert_model(seq, args):
    hidden, heads, ffn = 768, 12, 3072
    sym = encoder(args.layers, hidden, heads, ffn, written=False)
    arg = {k: mx.nd.array(v) for k, v in random_weights(sym, seq, hidden).items()}
    x = np.random.default_rng(1).standard_normal((1, seq, hidden)).astype(np.float32)
    return sym, arg, {}, {"data": x}


def gluonnlp_model(seq, args):
    import collections

    import gluonnlp as nlp
    vocab = nlp.vocab.BERTVocab(collections.Counter("w%d" % i for i in range(30000)))
    mx.random.seed(0)
    with mx.name.NameManager():
        model, _ = nlp.model.get_model("bert_12_768_12", dataset_name=None, vocab=vocab, pretrained=False,
                                       use_pooler=True, use_decoder=False, use_classifier=False,
                                       hparam_allow_override=True, num_layers=args.layers)
    model.initialize(mx.init.Normal(0.02))
    model.hybridize()
    rng = np.random.default_rng(0)
    feed = {"data0": rng.integers(0, 30000, (1, seq)).astype(np.float32),
            "data1": np.zeros((1, seq), np.float32), "data2": np.array([seq * 3 // 4], np.float32)}
    model(*[mx.nd.array(feed[k]) for k in ("data0", "data1", "data2")])
    sym = model._cached_graph[1]
    params = {p.name: p.data() for p in model.collect_params().values()}
    aux_names = set(sym.list_auxiliary_states())
    return (sym, {k: v for k, v in params.items() if k not in aux_names},
            {k: v for k, v in params.items() if k in aux_names}, feed)


def cnn_model(name):
    from fusion.testing import zoo_model
    sym, arg, aux = zoo_model(name)
    x = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    return sym, arg, aux, {"data": x}


def sharing(params, *originals):
    """The fused model's params with the caller's own arrays where they hold the same values
    (fusion.fuse returns copies): one copy of BERT-base's weights fewer in memory."""
    out = {}
    for k, v in params.items():
        same = [o[k] for o in originals if k in o and o[k].shape == v.shape and o[k].dtype == v.dtype
                and (o[k].asnumpy().view(np.uint8) == v.asnumpy().view(np.uint8)).all()]
        out[k] = same[0] if same else v
    return out


def run(sym, arg, aux, inputs, args):
    shapes = {k: v.shape for k, v in inputs.items()}
    models, fuse_s, notes = {}, {}, []
    models["mx fp32"] = (sym, arg, aux)
    try:
        models["mx amp bf16"] = amp_bf16(sym, arg, aux)
        run_model(*models["mx amp bf16"], inputs, subgraph=True)
    except Exception as e:  # noqa: BLE001 -- AMP cannot convert every model: say why
        models.pop("mx amp bf16", None)
        notes.append("MXNet AMP bf16 fails: %s" % str(e).strip().splitlines()[0][:200])
    for name, precision in (("fused fp32", "float32"), ("fused bf16", "bf16")):
        t0 = time.perf_counter()
        r = fusion.fuse(sym, arg, aux, input_shapes=shapes, precision=precision, force=True)
        fuse_s[name] = time.perf_counter() - t0
        models[name] = (r.symbol, sharing(r.arg_params, arg), sharing(r.aux_params, aux))
    if "mx amp bf16" in models:
        r = fusion.fuse(*models["mx amp bf16"], input_shapes=shapes)
        models["amp+fused"] = (r.symbol, sharing(r.arg_params, arg, models["fused bf16"][1]),
                               sharing(r.aux_params, aux))
        notes.append("amp+fused: fused as %s" % r.report.precision)
    ref = run_model(sym, arg, aux, inputs, subgraph=True)[0]
    errs = {}
    for name, (s, a, x_aux) in models.items():
        out = run_model(s, a, x_aux, inputs, subgraph=True)[0].astype(np.float32)
        errs[name] = float(np.abs(out - ref).max() / np.abs(ref).max())
    systems = {name: executor(s, a, x_aux, inputs) for name, (s, a, x_aux) in models.items()}
    samples = {k: [] for k in systems}
    for _ in range(args.blocks):
        for k, v in time_samples(systems, repeats=args.repeats, warmup=1).items():
            samples[k] += v
    return samples, errs, fuse_s, notes


def report(title, samples, errs, fuse_s, notes, args):
    med = {k: 1e3 * statistics.median(v) for k, v in samples.items()}
    best = {k: 1e3 * min(v) for k, v in samples.items()}
    base = "mx amp bf16" if "mx amp bf16" in med else None
    print("\n%s (medians of %d×%d runs, interleaved)" % (title, args.blocks, args.repeats))
    print("%-12s %9s %17s %9s %9s | %8s %9s %9s | %9s" % (
        "system", "median ms", "p10-p90 ms", "vs fp32", "vs amp", "best ms", "vs fp32", "vs amp", "rel err"))
    for k, v in samples.items():
        q = np.percentile(np.array(v) * 1e3, [10, 90])
        vs_amp = ("%8.2fx" % (med[base] / med[k])) if base else "%9s" % "-"
        best_amp = ("%8.2fx" % (best[base] / best[k])) if base else "%9s" % "-"
        print("%-12s %9.1f %8.1f-%-8.1f %8.2fx %s | %8.1f %8.2fx %s | %9.1e" % (
            k, med[k], q[0], q[1], med["mx fp32"] / med[k], vs_amp,
            best[k], best["mx fp32"] / best[k], best_amp, errs[k]))
    print("fuse time: %s" % ", ".join("%s %.1f s" % kv for kv in fuse_s.items()))
    for n in notes:
        print(n)


def gemms(args):
    """fused_dense alone, float32 vs bfloat16 weight, on BERT-base's layer shapes (M = seq rows)."""
    rng = np.random.default_rng(0)
    print("\nfused_dense alone (bias, no activation), executor, medians of %d×%d interleaved runs"
          % (args.blocks, args.repeats))
    print("%-18s %10s %10s %10s %10s %8s | %10s %10s %8s" % ("M x K -> N", "fp32 ms", "bf16 ms", "fp32 GF/s",
                                                         "bf16 GF/s", "speedup", "best fp32", "best bf16", "speedup"))
    for m in (int(s) for s in args.seqs.split(",")):
        for k, n in ((768, 768), (768, 3072), (3072, 768)):
            x = mx.nd.array(rng.standard_normal((m, k)).astype(np.float32))
            w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
            b = mx.nd.array(rng.standard_normal(n).astype(np.float32))
            runs = {}
            for name, wv, dt in (("fp32", mx.nd.array(w), np.float32), ("bf16", mx.nd.array(to_bf16(w), dtype=BF16), BF16)):
                s = mx.sym.fused_dense(mx.sym.var("x"), mx.sym.var("w", dtype=dt), mx.sym.var("b"), num_hidden=n)
                runs[name] = executor(s, {"w": wv, "b": b}, {}, {"x": x})
            samples = {k2: [] for k2 in runs}
            for _ in range(args.blocks):
                for k2, v in time_samples(runs, repeats=args.repeats * 5, warmup=2).items():
                    samples[k2] += v
            med = {k2: statistics.median(v) for k2, v in samples.items()}
            best = {k2: min(v) for k2, v in samples.items()}
            flop = 2.0 * m * k * n
            print("%-18s %10.3f %10.3f %10.0f %10.0f %7.2fx | %10.0f %10.0f %7.2fx" % (
                "%d x %d -> %d" % (m, k, n), 1e3 * med["fp32"], 1e3 * med["bf16"], flop / med["fp32"] / 1e9,
                flop / med["bf16"] / 1e9, med["fp32"] / med["bf16"], flop / best["fp32"] / 1e9,
                flop / best["bf16"] / 1e9, best["fp32"] / best["bf16"]))


def ceiling(args):
    """oneDNN's bf16 matmul alone (benchmarks/dnnl_bf16_ceiling.cc, built here against the
    onednn-devel-cpu-gomp wheel), in a process of its own: what fused_dense can reach."""
    import shutil
    import subprocess
    import tempfile

    from fusion.native.library import _dnnl_include
    if not shutil.which("g++"):
        print("\nceiling: no g++ here")
        return
    lib = os.path.join(sys.prefix, "lib")
    d = tempfile.mkdtemp(prefix="mxf_ceiling_")
    exe = os.path.join(d, "ceiling")
    try:
        subprocess.run(["g++", "-O2", "-march=native", "-std=c++17",
                        os.path.join(os.path.dirname(os.path.abspath(__file__)), "dnnl_bf16_ceiling.cc"),
                        "-I" + _dnnl_include(), "-L" + lib, "-l:libdnnl.so.3", "-Wl,-rpath," + lib, "-o", exe],
                       check=True, capture_output=True, text=True)
        print("\noneDNN matmul alone (weights prepacked), %d timed runs each" % (args.repeats * args.blocks * 5))
        out = subprocess.run([exe, str(args.repeats * args.blocks * 5)] + args.seqs.split(","), check=True,
                             capture_output=True, text=True)
        print(out.stdout, end="")
    except (OSError, subprocess.CalledProcessError) as e:
        print("\nceiling: %s" % (getattr(e, "stderr", None) or e))
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="bert", help="comma-separated: bert, gluonnlp, resnet50_v1, mobilenet1.0")
    ap.add_argument("--layers", type=int, default=12, help="encoder layers of the BERTs (0: only --gemm)")
    ap.add_argument("--seqs", default="128")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per block and system")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--gemm", action="store_true", help="also time fused_dense alone on BERT's layer shapes")
    ap.add_argument("--ceiling", action="store_true",
                    help="also time oneDNN's matmul alone (bf16/f32 source and destination) on the same shapes")
    args = ap.parse_args()
    why = native_bf16_reason()
    print("mxnet %s, OMP_NUM_THREADS=%s, batch 1; bf16 %s"
          % (mx.__version__, os.environ.get("OMP_NUM_THREADS"), "native" if why is None else "EMULATED (%s)" % why))
    for model in (m.strip() for m in args.models.split(",") if m.strip()):
        if model in ("bert", "gluonnlp"):
            if args.layers <= 0:
                continue
            for seq in (int(s) for s in args.seqs.split(",")):
                build = bert_model if model == "bert" else gluonnlp_model
                title = ("BERT-base encoder (%d layers)" if model == "bert" else "GluonNLP bert_12_768_12 (%d layers)"
                         ) % args.layers
                report("%s, seq %d" % (title, seq), *run(*build(seq, args), args), args)
        else:
            report("%s, 1x3x224x224" % model, *run(*cnn_model(model), args), args)
    if args.gemm:
        gemms(args)
    if args.ceiling:
        ceiling(args)
    print("vs X: time of X / time of the system (higher is faster); best: fastest single run; "
          "rel err: max|Δ|/max|ref| against mx fp32")


if __name__ == "__main__":
    main()
