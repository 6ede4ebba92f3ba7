"""Measure this CPU's cost table (``fusion/engine/cost.py``): fused ops against what they replace.

    python tools/measure_cpu_costs.py [--repeats 30] [--out fusion/engine/cost_tables/] [--dry-run]

Writes ``cpu-<model>-<flags>.json`` (the schema in ``fusion/engine/cost.py``) for the CPU it runs on:
its model name and flags, the date, this command, the load average, and one entry per case.
Rerun it on a new CPU kind and commit the file; ``fuse()`` then decides from it there.

Each case is a small graph bound with MXNet's default bind (its oneDNN subgraph backend on),
once as the rules leave it without cost decisions (``MXFUSION_NO_COST=1``: fused) and once as
MXNet runs it unfused, the two timed interleaved in one process (medians of ``--repeats``
calls); both include the same neighbouring ops, so the difference is what the rewrite changes:

* ``fused_elemwise`` where it adds layout reorders: BatchNorm [→ relu] between two 1×1
  convolutions, the first with a residual add (ResNet v2's pre-activation), at the channel and
  map sizes of ResNet's stages.
* ``bn_folding`` of a BatchNorm into a Deconvolution without a bias (it then gets one, which
  MXNet adds outside oneDNN's kernel) against the BatchNorm kept, same sizes as below.
* ``fused_deconv`` (Deconvolution 4×4 stride 2 → relu, the BatchNorm folded) between a 3×3 and a
  1×1 convolution, at the sizes of GluonCV's simple-pose and CenterNet heads.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from fusion.native.env import configure_threads  # noqa: E402  (must run before mxnet is imported)

configure_threads()

import numpy as np  # noqa: E402

#: (channels, map side) of the BatchNorm → relu cases: ResNet-50's stages at 224×224, and larger maps
ELEMWISE_SIZES = ((64, 56), (256, 56), (512, 28), (1024, 14), (2048, 7), (256, 120))
ELEMWISE_OPS = (("BatchNorm+relu", True),)      # BatchNorm alone is one op: no region


def _between_convs(channels: int, side: int, relu: bool):
    """(conv 1×1 + x) → BatchNorm [→ relu] → conv 1×1 (ResNet v2's pre-activation: the sum MXNet's
    oneDNN convolution writes in its blocked layout), random weights and BatchNorm statistics."""
    import mxnet as mx

    x = mx.sym.var("data")
    y = mx.sym.Convolution(x, num_filter=channels, kernel=(1, 1), no_bias=True, name="c1") + x
    y = mx.sym.BatchNorm(y, fix_gamma=False, name="bn")
    if relu:
        y = mx.sym.Activation(y, act_type="relu", name="act")
    y = mx.sym.Convolution(y, num_filter=channels, kernel=(1, 1), no_bias=True, name="c2")
    shape = (1, channels, side, side)
    rng = np.random.default_rng(channels + side)
    arg_shapes, _, aux_shapes = y.infer_shape(data=shape)
    arg = {n: mx.nd.array(rng.normal(0, 1.0 / np.sqrt(channels), s))
           for n, s in zip(y.list_arguments(), arg_shapes) if n != "data"}
    arg["bn_gamma"] = mx.nd.array(rng.uniform(0.5, 1.5, (channels,)))
    aux = {n: mx.nd.array(rng.uniform(0.5, 2.0, s)) for n, s in zip(y.list_auxiliary_states(), aux_shapes)}
    return y, arg, aux, shape


def measure_elemwise(repeats: int):
    from fusion.ir.graph import Graph
    from fusion.engine.rewrite import Context
    from patterns.elementwise import layout_case

    entries = []
    for label, relu in ELEMWISE_OPS:
        for channels, side in ELEMWISE_SIZES:
            sym, arg, aux, shape = _between_convs(channels, side, relu)
            fused, f, u = _timed_pair(sym, arg, aux, shape, "elementwise", repeats)
            if "fused_elemwise" not in fused.symbol.tojson():
                raise SystemExit("measure_cpu_costs: the elementwise rule did not fuse %s at %s" % (label, shape))
            graph = Graph.from_symbol(sym)
            region = [n for n in graph.nodes if n.op in ("BatchNorm", "Activation")]
            case = layout_case(region, Context(graph, arg, aux, "inference", {"data": shape}))
            entries.append({"op": "fused_elemwise", "dtype": "float32", "pass": "forward", "case": case,
                            "fused_ms": round(f, 4), "unfused_ms": round(u, 4), "reference": "MXNet default bind",
                            "graph": "conv 1x1 + x -> %s -> conv 1x1, %d channels, %dx%d" % (label, channels, side, side)})
            print("fused_elemwise %-16s C=%-5d %3dx%-3d fused %8.3f ms  unfused %8.3f ms  %.2fx"
                  % (label, channels, side, side, f, u, u / f))
            sys.stdout.flush()
    return entries


#: (channels in, channels out, input height, width) of 4×4 stride-2 deconvolutions: GluonCV's
#: simple-pose head at 256×192 and CenterNet's at 512×512
DECONV_SIZES = ((512, 256, 8, 6), (256, 256, 16, 12), (256, 256, 32, 24),
                (512, 256, 16, 16), (256, 128, 32, 32), (128, 64, 64, 64))


def _deconv_between_convs(c_in: int, c_out: int, h: int, w: int, batchnorm: bool = False):
    """conv 3×3 → Deconvolution 4×4/2 (bias: a BatchNorm folded; or no bias → BatchNorm) → relu →
    conv 1×1, random weights and BatchNorm statistics."""
    import mxnet as mx

    x = mx.sym.var("data")
    y = mx.sym.Convolution(x, num_filter=c_in, kernel=(3, 3), pad=(1, 1), no_bias=True, name="c1")
    y = mx.sym.Deconvolution(y, num_filter=c_out, kernel=(4, 4), stride=(2, 2), pad=(1, 1), no_bias=batchnorm,
                             name="deconv")
    if batchnorm:
        y = mx.sym.BatchNorm(y, fix_gamma=False, name="bn")
    y = mx.sym.Activation(y, act_type="relu", name="act")
    y = mx.sym.Convolution(y, num_filter=c_out, kernel=(1, 1), no_bias=True, name="c2")
    shape = (1, c_in, h, w)
    rng = np.random.default_rng(c_in + h)
    arg_shapes, _, _ = y.infer_shape(data=shape)
    arg = {n: mx.nd.array(rng.normal(0, 0.05, s)) for n, s in zip(y.list_arguments(), arg_shapes) if n != "data"}
    arg.update({n: mx.nd.array(rng.uniform(0.5, 1.5, (c_out,))) for n in arg if n.endswith("gamma")})
    _, _, aux_shapes = y.infer_shape(data=shape)
    aux = {n: mx.nd.array(rng.uniform(0.5, 2.0, s)) for n, s in zip(y.list_auxiliary_states(), aux_shapes)}
    return y, arg, aux, shape


def measure_deconv_fold(repeats: int):
    """BatchNorm folded into a Deconvolution without a bias (it gets one) against the BatchNorm kept."""
    entries = []
    for c_in, c_out, h, w in DECONV_SIZES:
        sym, arg, aux, shape = _deconv_between_convs(c_in, c_out, h, w, batchnorm=True)
        fused, f, u = _timed_pair(sym, arg, aux, shape, "conv_bn_act", repeats)
        if "BatchNorm" in fused.symbol.tojson():
            raise SystemExit("measure_cpu_costs: conv_bn_act did not fold at %s" % (shape,))
        case = {"conv": "Deconvolution", "adds_slow_path": True, "act": "relu", "c_out": c_out,
                "out_pixels": 4 * h * w}
        entries.append({"op": "bn_folding", "dtype": "float32", "pass": "forward", "case": case,
                        "fused_ms": round(f, 4), "unfused_ms": round(u, 4), "reference": "MXNet default bind",
                        "graph": "conv 3x3 -> Deconvolution 4x4/2 %d->%d at %dx%d -> BatchNorm (folded or not) "
                                 "-> relu -> conv 1x1" % (c_in, c_out, h, w)})
        print("bn_folding     %4d->%-4d %3dx%-3d folded %8.3f ms  kept %8.3f ms  %.2fx" % (c_in, c_out, h, w, f, u, u / f))
        sys.stdout.flush()
    return entries


def _timed_pair(sym, arg, aux, shape, rule: str, repeats: int):
    """(fused symbol result, median ms fused, median ms unfused) of ``rule`` made without cost decisions."""
    import fusion
    from fusion.check.bench import executor, time_samples

    os.environ["MXFUSION_NO_COST"] = "1"
    try:
        fused = fusion.fuse(sym, arg, aux, rules=[rule], input_shapes={"data": shape}, self_check=False)
    finally:
        os.environ.pop("MXFUSION_NO_COST", None)
    inputs = {"data": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
    systems = {"fused": executor(fused.symbol, fused.arg_params, fused.aux_params, inputs),
               "unfused": executor(sym, arg, aux, inputs)}
    ms = {k: float(np.median(v)) * 1e3 for k, v in time_samples(systems, repeats=repeats).items()}
    return fused, ms["fused"], ms["unfused"]


def measure_deconv(repeats: int):
    entries = []
    for c_in, c_out, h, w in DECONV_SIZES:
        sym, arg, aux, shape = _deconv_between_convs(c_in, c_out, h, w)
        fused, f, u = _timed_pair(sym, arg, aux, shape, "deconv_relu", repeats)
        if "fused_deconv" not in fused.symbol.tojson():
            raise SystemExit("measure_cpu_costs: the deconv_relu rule did not fuse at %s" % (shape,))
        case = {"kernel": "4x4/2", "relu": True, "adds_reorders": True, "c_in": c_in, "c_out": c_out,
                "out_pixels": 4 * h * w}
        entries.append({"op": "fused_deconv", "dtype": "float32", "pass": "forward", "case": case,
                        "fused_ms": round(f, 4), "unfused_ms": round(u, 4), "reference": "MXNet default bind",
                        "graph": "conv 3x3 -> Deconvolution 4x4/2 %d->%d at %dx%d -> relu -> conv 1x1"
                                 % (c_in, c_out, h, w)})
        print("fused_deconv   %4d->%-4d %3dx%-3d fused %8.3f ms  unfused %8.3f ms  %.2fx" % (c_in, c_out, h, w, f, u, u / f))
        sys.stdout.flush()
    return entries


def table_path(folder: str, device: str, flags) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "cpu"
    return os.path.join(folder, "cpu-%s%s.json" % (slug, "".join("-" + f for f in flags)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=30, help="timed calls per system and case (default 30)")
    ap.add_argument("--out", default=os.path.join(_REPO, "fusion", "engine", "cost_tables"), help="folder to write the table to")
    ap.add_argument("--dry-run", action="store_true", help="print the table instead of writing it")
    args = ap.parse_args(argv)
    from fusion.engine.cost import cpu_identity, validate

    device, flags = cpu_identity()
    load = os.getloadavg()
    print("%s, flags %s, load average %.1f %.1f %.1f" % (device, " ".join(flags) or "-", *load))
    entries = measure_elemwise(args.repeats) + measure_deconv_fold(args.repeats) + measure_deconv(args.repeats)
    table = validate({
        "device": device, "kind": "cpu", "cpu_flags": list(flags),
        "date": datetime.date.today().isoformat(),
        "command": "python tools/measure_cpu_costs.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "load_average": [round(v, 1) for v in load + os.getloadavg()],
        "entries": entries,
    }, "measured table")
    text = json.dumps(table, indent=1) + "\n"
    if args.dry_run:
        print(text)
        return 0
    os.makedirs(args.out, exist_ok=True)
    path = table_path(args.out, device, flags)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    print("wrote %s" % path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
