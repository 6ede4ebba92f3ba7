"""Per-layer CPU profile: the fused model's convolutions (oneDNN 3.x inside ``fused_region``) against
ONNX Runtime's on the same graph, layer by layer.

    OMP_NUM_THREADS=2 python benchmarks/profile_cpu_layers.py [--model resnet50_v1b] [--runs 20]
                                                               [--against ort|mxnet]
                                                               [--json out.json] [--top 15]

Where ``bench_cpu_engines.py`` finds ONNX Runtime ahead of the fused model, this says whether the
convolutions themselves are slower (the kernels oneDNN picks on this CPU) or the time goes
elsewhere (reorders, the ops around the region, MXNet's dispatch).  Both run the same model: the
fused symbol, and its ``mxfuse --to-onnx`` export (``bench_cpu_engines.export_onnx_file``) in ONNX
Runtime with all graph optimizations.

* ours: the fused model in a child process with ``ONEDNN_VERBOSE=profile_exec`` (set before oneDNN
  loads): every primitive's execution time, oneDNN 3.x's (the region: ``onednn_verbose``) and
  MXNet's own oneDNN's for the ops outside regions (``dnnl_verbose``), ``--runs`` forward calls
  after two warm-up calls;
* ONNX Runtime: ``SessionOptions.enable_profiling`` (per node kernel times), the same calls;
* or, ``--against mxnet``, the original (unfused) model under MXNet's default bind, in a child
  process of its own with the same verbose mode: where the fused model is *slower than MXNet*, which
  layers lose and what runs them (how CIFAR ResNeXt-29's loss was found: the 1×1 convolutions after
  each grouped one ran oneDNN's gemm kernel in the region, MXNet's ran ``jit_1x1``).

Convolutions are paired by what they compute: input channels, output channels, groups, kernel and
the input and output planes (the same layer on both sides; layers of the same shape are summed
and counted).  Printed: the CPU, per layer kind the mean time per call on each side and the ratio,
the layers where ours is slowest against ONNX Runtime (``--top``), and the totals of convolutions
and of everything else, beside each engine's wall clock (median of the same number of calls, in
the parent process, without profiling).  Sums of kernel times are not wall clock: what the wall
clock holds beyond them is dispatch, threads waiting and layout copies outside the kernels (the
verbose mode and the profiler each add a little of their own).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

#: oneDNN's convolution problem: [g<G>]mb<N>_ic<C>oc<K>_ih<H>oh<P>kh<R>sh..._iw<W>ow<Q>kw<S>...
_PROBLEM = re.compile(r"^(?:g(\d+))?mb\d+_ic(\d+)oc(\d+)_ih(\d+)oh(\d+)kh(\d+)\D.*_iw(\d+)ow(\d+)kw(\d+)")


def conv_key(groups: int, ic: int, oc: int, kh: int, kw: int, ih: int, iw: int, oh: int, ow: int) -> str:
    return "conv %dx%d %d->%d%s %dx%d->%dx%d" % (kh, kw, ic, oc, " g%d" % groups if groups > 1 else "", ih, iw, oh, ow)


def parse_verbose(lines):
    """{key: [total ms, count]} of oneDNN verbose ``exec`` lines; keys: a convolution's ``conv_key``,
    else "<library> <primitive kind>"."""
    out = collections.defaultdict(lambda: [0.0, 0])
    for line in lines:
        f = line.strip().split(",")
        if len(f) < 6 or f[1] != "exec" or not f[0].endswith("_verbose"):
            continue
        lib = "fused_region" if f[0] == "onednn_verbose" else "MXNet"
        kind, problem = f[3], f[-2]
        try:
            ms = float(f[-1])
        except ValueError:
            continue
        m = _PROBLEM.match(problem) if kind == "convolution" else None
        if m:
            g = int(m.group(1) or 1)
            key = conv_key(g, int(m.group(2)), int(m.group(3)), int(m.group(6)), int(m.group(9)), int(m.group(4)),
                           int(m.group(7)), int(m.group(5)), int(m.group(8)))     # ic, oc: all groups
        else:
            key = "%s %s" % (lib, kind)
        out[key][0] += ms
        out[key][1] += 1
    return out


def parse_ort_profile(path: str):
    """{key: [total ms, count]} of ONNX Runtime's per-node kernel times (convolutions by ``conv_key``)."""
    with open(path) as f:
        events = json.load(f)
    out = collections.defaultdict(lambda: [0.0, 0])
    for ev in events:
        if ev.get("cat") != "Node" or not str(ev.get("name", "")).endswith("_kernel_time"):
            continue
        a = ev.get("args", {})
        op = a.get("op_name", "?")
        ms = float(ev.get("dur", 0)) / 1000.0
        key = "ORT %s" % op
        if op in ("Conv", "FusedConv"):
            try:
                ins = [list(d.values())[0] for d in a["input_type_shape"]]
                outs = [list(d.values())[0] for d in a["output_type_shape"]]
                x, w, y = ins[0], ins[1], outs[0]
                groups = x[1] // w[1]
                key = conv_key(groups, x[1], w[0], w[2], w[3], x[2], x[3], y[2], y[3])
            except (KeyError, IndexError, ZeroDivisionError, TypeError):
                pass
        out[key][0] += ms
        out[key][1] += 1
    return out


def _child(model: str, runs: int, original: bool = False) -> None:
    """In the child: fuse (unless ``original``), bind, 2 warm-up calls, then ``runs`` calls with
    verbose output marked."""
    import numpy as np
    from bench_cpu_engines import build, mx_engine
    import fusion
    sym, arg, aux, shapes = build(model)
    if not original:
        res = fusion.fuse(sym, arg, aux, input_shapes=shapes)
        sym, arg, aux = res.symbol, res.arg_params, res.aux_params
    rng = np.random.default_rng(0)
    inputs = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    _, step, _ = mx_engine(sym, arg, aux, inputs)
    for _ in range(2):
        step()
    sys.stdout.flush()
    print("PROFILE_START", flush=True)
    for _ in range(runs):
        step()
    sys.stdout.flush()
    print("PROFILE_END", flush=True)


def profile_ours(model: str, runs: int, original: bool = False):
    """{key: [total ms, count]} of the fused model's run (``original``: the unfused model's, MXNet's
    default bind), in a child process with oneDNN's verbose mode on."""
    env = dict(os.environ, ONEDNN_VERBOSE="profile_exec", DNNL_VERBOSE="1", MXNET_ONEDNN_VERBOSE="0")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", model, "--runs", str(runs)]
    p = subprocess.run(cmd + (["--child-original"] if original else []),
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        raise SystemExit("profile_cpu_layers: the %s model's run failed:\n%s"
                         % ("original" if original else "fused", p.stdout[-3000:]))
    text = p.stdout
    body = text.split("PROFILE_START", 1)[-1].split("PROFILE_END", 1)[0]
    return parse_verbose(body.splitlines())


def profile_ort(model: str, runs: int, folder: str):
    """ONNX Runtime's per-node profile, and both engines' wall clock without any profiling: the
    median of ``runs`` calls each, interleaved (ms)."""
    import numpy as np
    import onnxruntime as ort
    from bench_cpu_engines import build, export_onnx_file, mx_engine, ort_options
    import fusion
    sym, arg, aux, shapes = build(model)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    path = os.path.join(folder, "model.onnx")
    export_onnx_file(res, shapes, path)
    so = ort_options(spin=False)
    rng = np.random.default_rng(0)
    inputs = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    warm = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    feed = {i.name: inputs[i.name] for i in warm.get_inputs()}
    ours, _, _ = mx_engine(res.symbol, res.arg_params, res.aux_params, inputs)
    wall = interleaved_medians({"ours": ours, "ort": lambda: warm.run(None, feed)}, runs)
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(folder, "ort")
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    for _ in range(2 + runs):
        sess.run(None, feed)
    prof = parse_ort_profile(sess.end_profiling())
    # the first two calls (warm-up) are in the profile too: scale to the timed calls
    return {k: [v[0] * runs / (runs + 2), v[1] * runs // (runs + 2)] for k, v in prof.items()}, wall


def wall_against_mxnet(model: str, runs: int) -> dict:
    """Both models' wall clock without profiling, MXNet's default bind each: the median of ``runs``
    calls, interleaved (ms)."""
    import numpy as np
    from bench_cpu_engines import build, mx_engine
    import fusion
    sym, arg, aux, shapes = build(model)
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    rng = np.random.default_rng(0)
    inputs = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    ours, _, _ = mx_engine(res.symbol, res.arg_params, res.aux_params, inputs)
    theirs, _, _ = mx_engine(sym, arg, aux, inputs)
    return interleaved_medians({"ours": ours, "mxnet": theirs}, runs)


def interleaved_medians(calls: dict, runs: int) -> dict:
    """{name: median ms} of ``runs`` calls of each, interleaved, after two untimed rounds."""
    import time

    import numpy as np
    wall = {name: [] for name in calls}
    for k in range(2 + runs):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            if k >= 2:
                wall[name].append((time.perf_counter() - t0) * 1e3)
    return {k: float(np.median(v)) for k, v in wall.items()}


#: The column label of each baseline.
LABELS = {"ort": "ORT", "mxnet": "MXNet"}


def compare(ours, theirs, runs: int, top: int, against: str = "ort") -> dict:
    convs = sorted({k for k in list(ours) + list(theirs) if k.startswith("conv ")})
    rows = []
    for k in convs:
        a, b = ours.get(k, [0.0, 0]), theirs.get(k, [0.0, 0])
        rows.append({"layer": k, "count": max(a[1], b[1]) // max(runs, 1), "ours_ms": a[0] / runs,
                     against + "_ms": b[0] / runs})
    other_ours = {k: v[0] / runs for k, v in ours.items() if not k.startswith("conv ")}
    other_theirs = {k: v[0] / runs for k, v in theirs.items() if not k.startswith("conv ")}
    return {"against": against, "convolutions": rows, "other_ours": other_ours, "other_" + against: other_theirs,
            "conv_ours_ms": sum(r["ours_ms"] for r in rows),
            "conv_%s_ms" % against: sum(r[against + "_ms"] for r in rows),
            "top": sorted(rows, key=lambda r: r[against + "_ms"] - r["ours_ms"])[:top]}


def print_report(model: str, cmp: dict, runs: int, wall: dict) -> None:
    from bench_cpu_engines import ISA, cpu_model, threads
    from fusion.precision import policy
    a = cmp.get("against", "ort")
    lab = LABELS[a]
    flags = policy.cpu_flags()
    print("CPU: %s; ISA: %s; %d thread(s); model %s; per call, mean of %d calls (sums of kernel times)"
          % (cpu_model(), " ".join(f for f in ISA if f in flags) or "none of " + ",".join(ISA), threads(), model, runs))
    print("%-44s %5s %10s %10s %9s" % ("convolution (kernel in->out, plane)", "n", "ours ms", lab + " ms",
                                       lab + "/ours"))
    for r in cmp["convolutions"]:
        ratio = r[a + "_ms"] / r["ours_ms"] if r["ours_ms"] else float("nan")
        print("%-44s %5d %10.3f %10.3f %9.2f" % (r["layer"], r["count"], r["ours_ms"], r[a + "_ms"], ratio))
    co, ct = cmp["conv_ours_ms"], cmp["conv_%s_ms" % a]
    print("%-44s %5s %10.2f %10.2f %9.2f" % ("all convolutions", "", co, ct, ct / co if co else float("nan")))
    oo, ot = sum(cmp["other_ours"].values()), sum(cmp["other_" + a].values())
    print("%-44s %5s %10.2f %10.2f" % ("everything else", "", oo, ot))
    for k, v in sorted(cmp["other_ours"].items(), key=lambda kv: -kv[1])[:6]:
        print("   ours  %-36s %10.3f" % (k, v))
    for k, v in sorted(cmp["other_" + a].items(), key=lambda kv: -kv[1])[:6]:
        print("   %-5s %-36s %21.3f" % (lab, k, v))
    print("%-44s %5s %10.2f %10.2f %9.2f  (medians of %d calls, no profiling: the time outside the kernels "
          "is the difference)" % ("wall clock", "", wall["ours"], wall[a], wall["ours"] / wall[a], runs))
    print("where ours loses most to %s:" % ("ONNX Runtime" if a == "ort" else "MXNet's default bind"))
    for r in cmp["top"]:
        print("   %-44s ours %.3f ms, %s %.3f ms (%+.3f ms per call)" % (r["layer"], r["ours_ms"], lab, r[a + "_ms"],
                                                                     r["ours_ms"] - r[a + "_ms"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50_v1b", help="a model of bench_cpu_engines.py (default resnet50_v1b)")
    ap.add_argument("--runs", type=int, default=20, help="profiled calls per engine (default 20)")
    ap.add_argument("--top", type=int, default=10, help="layers listed where ours loses most (default 10)")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--against", choices=sorted(LABELS), default="ort",
                    help="ort: ONNX Runtime on the fused model's export (default); mxnet: the original model "
                         "under MXNet's default bind")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-original", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child, args.runs, original=args.child_original)
        return 0
    from bench_cpu_engines import known_models
    if args.model not in known_models():
        ap.error("unknown model %s; known: %s" % (args.model, ", ".join(known_models())))
    ours = profile_ours(args.model, args.runs)
    if not any(k.startswith("conv ") for k in ours):
        print("profile_cpu_layers: no convolution in the fused model's oneDNN verbose output (is fused_region in "
              "this op library?)", file=sys.stderr)
    if args.against == "mxnet":
        theirs = profile_ours(args.model, args.runs, original=True)
        wall = wall_against_mxnet(args.model, args.runs)
    else:
        with tempfile.TemporaryDirectory(prefix="mxf-prof-") as folder:
            theirs, wall = profile_ort(args.model, args.runs, folder)
    cmp = compare(ours, theirs, args.runs, args.top, args.against)
    print_report(args.model, cmp, args.runs, wall)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "runs": args.runs, "wall_ms": wall, **cmp}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
