"""Where GluonCV models spend their time once fused: MXNet's profiler, per operator, under the default bind.

    MXNET_EXEC_BULK_EXEC_INFERENCE=0 python benchmarks/profile_cv.py [--models a,b] [--runs 3]

Each model of ``benchmarks/cv_models.py`` is fused with its input shapes, bound with MXNet's
default bind (oneDNN subgraph backend on) and run ``--runs`` times under ``mx.profiler``
(aggregate statistics; bulk execution must be off to see single operators); per model the
share of the operators' total time per operator, largest first, and the share of oneDNN
convolutions (``_sg_mkldnn_conv``, ``Convolution``, ``Deconvolution``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fusion.native.env import configure_threads  # noqa: E402

configure_threads()
os.environ.setdefault("MXNET_EXEC_BULK_EXEC_INFERENCE", "0")

import numpy as np  # noqa: E402

import fusion  # noqa: E402
from fusion.check.bench import executor  # noqa: E402

from cv_models import MODELS, build  # noqa: E402

CONVS = ("_sg_mkldnn_conv", "Convolution", "Deconvolution", "fused_deconv")


def profile(name: str, runs: int, out_dir: str):
    import mxnet as mx

    sym, arg, aux, shape = build(name)
    res = fusion.fuse(sym, arg, aux, input_shapes={"data": shape}, self_check=False)
    inputs = {"data": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
    step = executor(res.symbol, res.arg_params, res.aux_params, inputs)
    for _ in range(2):
        step()
    path = os.path.join(out_dir, "profile_%s.json" % name)
    mx.profiler.set_config(profile_all=True, aggregate_stats=True, filename=path)
    mx.profiler.set_state("run")
    for _ in range(runs):
        step()
    mx.profiler.set_state("stop")
    stats = json.loads(mx.profiler.dumps(reset=True, format="json"))
    ops = stats.get("Time", {}).get("operator", {})
    total = sum(v["Total"] for v in ops.values()) or 1.0
    rows = sorted(((k, v["Total"] / runs, v["Count"] // runs) for k, v in ops.items()), key=lambda r: -r[1])
    conv = sum(t for k, t, _ in rows if k in CONVS) * runs / total
    print("\n%s %s: %.1f ms of operator time a run; convolutions %.0f %%" % (name, "x".join(map(str, shape)),
                                                                          total / runs, 100 * conv))
    print("  " + ", ".join("%s %.0f%% (%d)" % (k, 100 * t * runs / total, c) for k, t, c in rows[:9]))
    sys.stdout.flush()
    return {"model": name, "ms": total / runs, "conv_share": conv,
            "ops": [{"op": k, "ms": t, "calls": c} for k, t, c in rows]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="/tmp", help="folder for the profiler's files")
    ap.add_argument("--json", help="also write the shares to this file")
    args = ap.parse_args(argv)
    print("load average %.1f %.1f %.1f" % os.getloadavg())
    found = [profile(n, args.runs, args.out) for n in args.models.split(",") if n]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
