"""GluonCV's detection, segmentation, pose and pre-activation models: fused vs MXNet's default bind.

    pip install gluoncv==0.10.5.post0            # not a dependency of the project
    python benchmarks/bench_cv.py [--models gcv_resnet50_v2,simple_pose_resnet18_v1b]
                                  [--repeats 10] [--rounds 1] [--self-check] [--json out.json]

The ten models of ``benchmarks/cv_models.py`` (random weights, randomized BatchNorm statistics,
batch 1 at GluonCV's input sizes) are fused with their input shapes and timed in one process,
round-robin: the original with MXNet's default bind (its oneDNN subgraph backend on), the fused
model with the default bind, and the original with the backend off (``MXNET_SUBGRAPH_BACKEND=NONE``,
read by MXNet at bind: ``fusion.bench.executor(..., subgraph=False)``).  Per system the median
and the p10-p90 spread of the timed calls; ``fused/default`` = original median ÷ fused median
(above 1: faster), ``vs off`` = original with the backend off ÷ fused.  With ``--rounds R`` the
timing is repeated and every round printed.  The CPU model and the load average (before and
after each model) are printed: the machines are shared.

Every fused model is verified first on one random input: each output's ``max|fused − original|
/ max|original|`` with the original bound with the backend off (MXNet's default bind has
known bugs), beside the original's own spread (the same figure for the original bound with the
backend on): OK where the fused model's error is within that spread (or below 1e-4).  Detectors'
outputs (ids, scores, boxes after NMS: near-ties swap places) are compared as sets of rows, each
row against its nearest, where the element-by-element comparison does not pass; where that does not
pass either, piecewise at the NMS inputs as ``fusion.verify`` does (``fusion/check/cuts.py``: an
NMS choosing other boxes among near-ties of a random-weight detector is not an error, a wrong value
before or after it still is).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fusion.native.env import configure_threads  # noqa: E402  (must run before mxnet is imported)

configure_threads()

import numpy as np  # noqa: E402

import fusion  # noqa: E402
from fusion.check.bench import executor, time_samples  # noqa: E402
from fusion.native.env import subgraph_backend
from fusion.check.verify import bind  # noqa: E402

from cv_models import MODELS, build  # noqa: E402

FLOOR = 1e-4        # an error below this passes whatever the original's own spread


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    from fusion.engine.cost import cpu_identity
    return cpu_identity()[0]


def load() -> str:
    return "%.1f %.1f %.1f" % os.getloadavg()


def counts(symbol) -> collections.Counter:
    return collections.Counter(n["op"] for n in json.loads(symbol.tojson())["nodes"] if n["op"] != "null")


def outputs(symbol, arg, aux, inputs, subgraph: bool):
    with subgraph_backend(subgraph):
        exe = bind(symbol, arg, aux, inputs)
    return [o.asnumpy() for o in exe.forward(is_train=False)]


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    """max|a − ref| / max|ref| over the elements finite in both (NaN/inf at other places: inf)."""
    fa, fr = np.isfinite(a), np.isfinite(ref)
    if a.shape != ref.shape or not np.array_equal(fa, fr):
        return float("inf")
    if not fr.any():
        return 0.0
    scale = float(np.max(np.abs(ref[fr]))) or 1.0
    return float(np.max(np.abs(a[fa] - ref[fr]))) / scale


def detections(outs):
    """The outputs as rows of detections (B·K, fields) when they all are (B, K, …) lists, as a
    detector's ids, scores and boxes after NMS are; else None."""
    if len(outs) < 2 or any(o.ndim < 2 or o.shape[:2] != outs[0].shape[:2] for o in outs):
        return None
    return np.concatenate([o.reshape(o.shape[0] * o.shape[1], -1) for o in outs], axis=1)


def set_err(got: np.ndarray, ref: np.ndarray) -> float:
    """Detections compared as sets: each row of ``got`` against its nearest row of ``ref`` (and the
    reverse), relative to max|ref| (rows come out of sorting / NMS: near-ties swap places)."""
    if got.shape != ref.shape or not np.array_equal(np.isfinite(got), np.isfinite(ref)):
        return float("inf")
    g, r = np.nan_to_num(got), np.nan_to_num(ref)
    d = np.abs(g[:, None, :] - r[None, :, :]).max(axis=2)
    scale = float(np.max(np.abs(r))) or 1.0
    return float(max(d.min(axis=1).max(), d.min(axis=0).max())) / scale


def check(sym, arg, aux, fused, inputs):
    """(fused model's worst error, the original's own on/off spread, how compared, ok) against the
    original bound with the backend off."""
    ref = outputs(sym, arg, aux, inputs, subgraph=False)
    on = outputs(sym, arg, aux, inputs, subgraph=True)
    got = outputs(fused.symbol, fused.arg_params, fused.aux_params, inputs, subgraph=True)
    err = max(rel_err(g, r) for g, r in zip(got, ref))
    spread = max(rel_err(o, r) for o, r in zip(on, ref))
    how = "element by element"
    if err > max(spread, FLOOR) and detections(ref) is not None:
        err, spread = set_err(detections(got), detections(ref)), set_err(detections(on), detections(ref))
        how = "detections as sets (nearest rows)"
    if err > max(spread, FLOOR):
        # NMS choosing among near-ties (a random-weight detector's scores): compared piecewise, cut at
        # the NMS inputs as fusion.verify does (fusion/check/cuts.py)
        from fusion.check.cuts import piecewise
        from fusion.check.rowsets import row_layouts
        from fusion.check.verify import compare, run
        pw = piecewise(sym, arg, aux, fused.symbol, fused.arg_params, fused.aux_params, inputs, sym.list_outputs(),
                       row_layouts(sym, arg, aux, {k: v.shape for k, v in inputs.items()}), run, compare)
        if pw is not None and max(pw[0].max_rel, pw[1].max_rel) < err:
            err = max(pw[0].max_rel, pw[1].max_rel)
            how = "piecewise at the inputs of %s (as a whole: %s)" % (", ".join(pw[2]), how)
    return err, spread, how, err <= max(spread, FLOOR)


def stats(samples):
    ms = np.asarray(samples) * 1e3
    return float(np.median(ms)), float(np.percentile(ms, 10)), float(np.percentile(ms, 90))


def bench(name: str, repeats: int, rounds: int, self_check: bool) -> dict:
    load_before = load()
    sym, arg, aux, shape = build(name)
    t = time.perf_counter()
    fused = fusion.fuse(sym, arg, aux, input_shapes={"data": shape}, self_check=self_check)
    fuse_s = time.perf_counter() - t
    rng = np.random.default_rng(0)
    inputs = {"data": rng.standard_normal(shape).astype(np.float32)}
    err, spread, how, ok = check(sym, arg, aux, fused, inputs)
    before, after = counts(sym), counts(fused.symbol)
    library = {k: v for k, v in sorted(after.items()) if k.startswith("fused_")}
    print("\n%s %s: fused in %.1f s%s; ops %d -> %d; library ops %s" % (
        name, "x".join(map(str, shape)), fuse_s, " (self-check on)" if self_check else "",
        sum(before.values()), sum(after.values()), library or "none"))
    print("  verify (%s): max rel err %.1e against the original (backend off); the original's own backend "
          "on/off spread %.1e: %s" % (how, err, spread, "OK" if ok else "MISMATCH"))
    for line in fused.report.to_text().splitlines():
        if line.startswith("  rejected") and "stays MXNet's" in line:
            print("  declined for speed:" + line.split(":", 1)[1][:200])
            break
    systems = {"original": executor(sym, arg, aux, inputs),
               "fused": executor(fused.symbol, fused.arg_params, fused.aux_params, inputs),
               "original_off": executor(sym, arg, aux, inputs, subgraph=False)}
    rows = []
    for r in range(rounds):
        s = {k: stats(v) for k, v in time_samples(systems, repeats=repeats, warmup=2).items()}
        rows.append(s)
        print("  round %d: original %.2f ms [%.2f-%.2f]  fused %.2f ms [%.2f-%.2f]  original, backend off %.2f ms "
              "[%.2f-%.2f]  fused/default %.3fx  fused vs off %.3fx"
              % (r + 1, *s["original"], *s["fused"], *s["original_off"], s["original"][0] / s["fused"][0],
                 s["original_off"][0] / s["fused"][0]))
        sys.stdout.flush()
    print("  load average before %s, after %s" % (load_before, load()))
    return {"model": name, "shape": list(shape), "fuse_s": round(fuse_s, 2), "ops": [sum(before.values()),
            sum(after.values())], "library_ops": library, "max_rel_err": err, "original_spread": spread, "compared": how, "ok": ok,
            "rounds": [{k: {"median_ms": v[0], "p10_ms": v[1], "p90_ms": v[2]} for k, v in s.items()} for s in rows],
            "load_before": load_before, "load_after": load()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated (default: all ten)")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per system per round (default 10)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds per model (default 1)")
    ap.add_argument("--self-check", action="store_true", help="fuse with the per-rewrite self-check (slow)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        ap.error("unknown model(s) %s; known: %s" % (", ".join(unknown), ", ".join(MODELS)))
    try:
        import gluoncv  # noqa: F401
    except ImportError:
        print("bench_cv: needs GluonCV (pip install gluoncv==0.10.5.post0)", file=sys.stderr)
        return 2
    import mxnet as mx
    print("%s; mxnet %s, OMP_NUM_THREADS=%s, batch 1; medians of interleaved calls [p10-p90], %d per system "
          "and round; load average %s" % (cpu_model(), mx.__version__, os.environ.get("OMP_NUM_THREADS"),
                                          args.repeats, load()))
    results, failed = [], []
    for n in names:
        try:
            results.append(bench(n, args.repeats, args.rounds, args.self_check))
        except Exception as e:     # one model's failure does not stop the others
            print("\n%s: FAILED: %s: %s" % (n, type(e).__name__, str(e).splitlines()[0] if str(e) else ""))
            failed.append(n)
        sys.stdout.flush()
    print("\n%-30s %10s %10s %10s %9s %9s  %s" % ("model", "orig ms", "fused ms", "off ms", "fused/def", "vs off",
                                                 "verify"))
    for r in results:
        s = r["rounds"][-1]
        o, f, x = s["original"]["median_ms"], s["fused"]["median_ms"], s["original_off"]["median_ms"]
        print("%-30s %10.2f %10.2f %10.2f %8.3fx %8.3fx  %s" % (r["model"], o, f, x, o / f, x / f,
                                                             "OK" if r["ok"] else "MISMATCH"))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cpu": cpu_model(), "results": results}, fh, indent=1)
    if failed:
        print("failed: %s" % ", ".join(failed))
    return 0 if all(r["ok"] for r in results) and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
