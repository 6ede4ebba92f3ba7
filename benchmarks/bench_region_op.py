"""A whole CNN backbone as one ``fused_region`` op against MXNet's default bind of the same network.

    OMP_NUM_THREADS=2 MXNET_CPU_PARALLEL_SIZE=2000000000 flock /tmp/mxf-bench.lock \\
        python benchmarks/bench_region_op.py [--models resnet50_v1b,mobilenetv3_large,densenet121]
                                             [--precision float32,bfloat16] [--repeats 30]

Batch 1 at 224x224, GluonCV's models with random weights (``gcv_zoo_model``).  ``to_program``
below converts the exported graph into one region program, op for op (Convolution, BatchNorm,
activations, scalar arithmetic, adds, muls, pooling, concat; GluonCV's hard-swish
``x * (clip(x + 3, 0, 6) / 6)`` and hard-sigmoid as one eltwise), up to the first op a region does
not take (the classifier's Flatten / Dropout): the backbone with its global pooling.  The op folds
the BatchNorms into the convolutions itself when it packs the weights.  The same part of the
stock graph (its internal output) bound with MXNet's default bind (oneDNN subgraph backend on) is
the baseline; both are bound in one process and timed round-robin (median, p10-p90 of the rounds).
``first call`` is bind + the first forward (the op builds its primitives and packs its weights
there).  Each fused output is checked against the stock one (max|d|/max|ref|).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from fusion.native.env import configure_threads  # noqa: E402  (must run before mxnet is imported)

configure_threads()

import numpy as np  # noqa: E402

import mxnet as mx  # noqa: E402
from fusion.check.bench import executor, time_samples  # noqa: E402
from fusion.engine.cost import cpu_identity  # noqa: E402
from fusion.native import library  # noqa: E402
from fusion.native.env import subgraph_backend  # noqa: E402
from fusion.precision import policy  # noqa: E402
from fusion.testing.gcv_zoo import gcv_zoo_model  # noqa: E402

SHAPE = (1, 3, 224, 224)
MODELS = ("resnet50_v1b", "mobilenetv3_large", "densenet121")


class Unsupported(Exception):
    pass


def _tuple(s, default):
    if s is None:
        return list(default)
    v = [int(x) for x in s.strip("()[] ").replace(" ", "").split(",") if x]
    return v * 2 if len(v) == 1 else v


def _bool(s, default):
    return default if s is None else str(s).lower() in ("1", "true")


def to_program(sym, data="data"):
    """(program, parameter names, name of the stock graph's node giving the region's output): the
    graph's ops in order until the first one a region does not take."""
    g = json.loads(sym.tojson())
    nodes = g["nodes"]
    readers = [0] * len(nodes)
    for n in nodes:
        for i in n["inputs"]:
            readers[i[0]] += 1
    attrs = [n.get("attrs", {}) for n in nodes]

    def scalar(k, op):
        return nodes[k]["op"] == op and float(attrs[k].get("scalar", "nan"))

    def hard_sigmoid_src(k):
        """x where node k is clip(x + 3, 0, 6) / 6 with its inner nodes read once, else None."""
        if scalar(k, "_div_scalar") != 6.0:
            return None
        c = nodes[k]["inputs"][0][0]
        if nodes[c]["op"] != "clip" or readers[c] != 1 or float(attrs[c]["a_min"]) != 0 or float(attrs[c]["a_max"]) != 6:
            return None
        p = nodes[c]["inputs"][0][0]
        if scalar(p, "_plus_scalar") != 3.0 or readers[p] != 1:
            return None
        return nodes[p]["inputs"][0][0], (c, p)

    skip, hard_swish = set(), {}
    for k, n in enumerate(nodes):   # the hard-sigmoid chains' inner nodes are not ops of their own
        hs = hard_sigmoid_src(k)
        if hs:
            skip.update(hs[1])
        # x * hard_sigmoid(x), the hard-sigmoid read by nothing else: GluonCV's hard-swish
        if n["op"] in ("elemwise_mul", "broadcast_mul", "_Mul", "_mul"):
            hs = hard_sigmoid_src(n["inputs"][1][0])
            if hs and hs[0] == n["inputs"][0][0] and readers[n["inputs"][1][0]] == 1:
                hard_swish[k] = hs[0]
                skip.add(n["inputs"][1][0])
    value, params, pnames, ops = {}, {}, [], []

    def param(k):
        name = nodes[k]["name"]
        if name not in params:
            params[name] = len(pnames)
            pnames.append(name)
        return params[name]

    def val(entry):
        k = entry[0]
        if nodes[k]["op"] == "null":
            if nodes[k]["name"] != data:
                raise Unsupported("a parameter read as data: " + nodes[k]["name"])
            return 0
        return value[k]

    def emit(k, op):
        ops.append(op)
        value[k] = len(ops)   # value 0 is the data input

    last = None
    for k, n in enumerate(nodes):
        op, a, ins = n["op"], attrs[k], n["inputs"]
        if op == "null" or k in skip:
            continue
        try:
            if op == "Convolution":
                if a.get("layout", "NCHW") != "NCHW" or len(_tuple(a["kernel"], ())) != 2:
                    raise Unsupported(op)
                bias = None if _bool(a.get("no_bias"), False) else param(ins[2][0])
                emit(k, {"op": "conv", "in": val(ins[0]), "weight": param(ins[1][0]), "bias": bias,
                         "kernel": _tuple(a["kernel"], ()), "stride": _tuple(a.get("stride"), (1, 1)),
                         "pad": _tuple(a.get("pad"), (0, 0)), "dilate": _tuple(a.get("dilate"), (1, 1)),
                         "groups": int(a.get("num_group", 1)), "filters": int(a["num_filter"])})
            elif op == "BatchNorm":
                if int(a.get("axis", 1)) != 1:
                    raise Unsupported(op)
                emit(k, {"op": "batchnorm", "in": val(ins[0]), "gamma": param(ins[1][0]), "beta": param(ins[2][0]),
                         "mean": param(ins[3][0]), "var": param(ins[4][0]), "eps": float(a.get("eps", 1e-3)),
                         "fix_gamma": _bool(a.get("fix_gamma"), True)})
            elif op in ("Activation", "relu", "sigmoid", "tanh"):
                f = {"relu": "relu", "sigmoid": "sigmoid", "tanh": "tanh", "softrelu": "softrelu"}[a.get("act_type", op)]
                emit(k, {"op": "act", "in": val(ins[0]), "post": [{"eltwise": f}]})
            elif op == "clip":
                emit(k, {"op": "act", "in": val(ins[0]),
                         "post": [{"eltwise": "clip", "lo": float(a["a_min"]), "hi": float(a["a_max"])}]})
            elif op in ("_plus_scalar", "_minus_scalar", "_mul_scalar", "_div_scalar"):
                hs = hard_sigmoid_src(k)
                if hs:
                    step = {"eltwise": "hard_sigmoid", "alpha": 1 / 6, "beta": 0.5}
                    emit(k, {"op": "act", "in": val([hs[0]]), "post": [step]})
                else:
                    s = float(a["scalar"])
                    scale, shift = {"_plus_scalar": (1, s), "_minus_scalar": (1, -s), "_mul_scalar": (s, 0),
                                    "_div_scalar": (1 / s, 0)}[op]
                    emit(k, {"op": "act", "in": val(ins[0]),
                             "post": [{"eltwise": "linear", "scale": scale, "shift": shift}]})
            elif op in ("elemwise_add", "broadcast_add", "_Plus", "_plus"):
                emit(k, {"op": "add", "in": [val(ins[0]), val(ins[1])]})
            elif op in ("elemwise_mul", "broadcast_mul", "_Mul", "_mul"):
                if k in hard_swish:
                    emit(k, {"op": "act", "in": val(ins[0]), "post": [{"eltwise": "hard_swish"}]})
                else:
                    emit(k, {"op": "mul", "in": [val(ins[0]), val(ins[1])]})
            elif op == "Pooling":
                glob = _bool(a.get("global_pool"), False)
                emit(k, {"op": "pool", "in": val(ins[0]), "mode": a.get("pool_type", "max"), "global": glob,
                         "kernel": _tuple(a.get("kernel"), (1, 1)), "stride": _tuple(a.get("stride"), (1, 1)),
                         "pad": _tuple(a.get("pad"), (0, 0)), "convention": a.get("pooling_convention", "valid"),
                         "count_include_pad": _bool(a.get("count_include_pad"), True)})
                if a.get("pool_type", "max") not in ("max", "avg") or (not glob and len(_tuple(a["kernel"], ())) != 2):
                    raise Unsupported(op)
            elif op in ("Concat", "concat"):
                if int(a.get("dim", 1)) != 1:
                    raise Unsupported(op)
                emit(k, {"op": "concat", "in": [val(i) for i in ins]})
            else:
                raise Unsupported(op)
        except Unsupported:
            break
        last = k
    program = {"version": 1, "params": None, "ops": ops, "outputs": [value[last]]}
    return program, pnames, nodes[last]["name"]


def build(name):
    sym, arg, aux = gcv_zoo_model(name, SHAPE, 0, bn_by_nodes=True)
    program, pnames, out_name = to_program(sym)
    params = dict(arg, **aux)
    program["params"] = [list(params[p].shape) for p in pnames]
    internals = sym.get_internals()
    outs = [o for o in internals.list_outputs() if o in (out_name + "_output", out_name + "_output0", out_name)]
    body = internals[outs[0]]
    return body, arg, aux, program, pnames


def fused_symbol(program, pnames, precision):
    return mx.sym.fused_region(mx.sym.var("data"), *[mx.sym.var(p) for p in pnames], program=json.dumps(program),
                               num_data=1, num_outputs=1, precision=precision)


def last_plan():
    h = ctypes.CDLL(library.library_path())
    h.mxf_region_last_plan.restype = ctypes.c_char_p
    return h.mxf_region_last_plan().decode()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--precision", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--plan", action="store_true", help="print each region's primitives")
    args = ap.parse_args(argv)
    cpu, flags = cpu_identity()
    print("CPU: %s; flags: %s; OMP_NUM_THREADS=%s; MXFUSION_REGION_LAYOUT=%s"
          % (cpu, ", ".join(flags) or "-", os.environ.get("OMP_NUM_THREADS"),
             os.environ.get("MXFUSION_REGION_LAYOUT", "auto")))
    precisions = [p for p in args.precision.split(",") if p]
    if "bfloat16" in precisions and policy.native_bf16_reason():
        print("bfloat16 skipped:", policy.native_bf16_reason())
        precisions.remove("bfloat16")
    x = mx.nd.array(np.random.default_rng(0).normal(0, 1, SHAPE).astype(np.float32))
    for name in [m for m in args.models.split(",") if m]:
        body, arg, aux, program, pnames = build(name)
        params = dict(arg, **aux)
        print("\n%s, %s: %d ops in the region program, %d parameters"
              % (name, "x".join(map(str, SHAPE)), len(program["ops"]), len(pnames)))
        systems = {"mxnet default bind": executor(body, arg, aux, {"data": x})}
        with subgraph_backend(False):
            ref_exe = body.bind(mx.cpu(), dict({k: v for k, v in arg.items() if k in body.list_arguments()}, data=x),
                                aux_states={k: aux[k] for k in body.list_auxiliary_states()}, grad_req="null")
            ref = ref_exe.forward(is_train=False)[0].asnumpy()
        first = {}
        for prec in precisions:
            sym = fused_symbol(program, pnames, prec)
            t0 = time.perf_counter()
            # its own (plain) arrays, as a fused model has: the stock graph's oneDNN convolutions reorder
            # the shared ones in place, which MXNet then hands a library op as a copy per call
            exe = sym.bind(mx.cpu(), dict({p: params[p].copy() for p in pnames}, data=x), grad_req="null")
            out = exe.forward(is_train=False)[0].asnumpy()
            first[prec] = (time.perf_counter() - t0) * 1e3
            plan = last_plan()
            err = float(np.abs(out - ref).max() / np.abs(ref).max())
            tol = policy.TOLERANCE[prec]
            lines = plan.splitlines()
            refs = [ln for ln in lines if ": ref:" in ln]
            info = {k: next((ln for ln in lines if ln.startswith(k)), "?") for k in ("arena", "built", "weights")}
            prims = sum(1 for ln in lines if ln.startswith(("op ", "value ", "output ")) and "weights:" not in ln
                        and ": in place, " not in ln)
            print("  %-9s first call (bind + build + pack) %.0f ms (%s, %s); max|d|/max|ref| %.2e (%s %.0e); "
                  "%d primitives per call, %s; reference code: %s"
                  % (prec, first[prec], info["built"], info["weights"], err, "within" if err <= tol else "OVER", tol,
                     prims, info["arena"], "; ".join(refs) if refs else "none"))
            if args.plan:
                print(plan)

            def step(exe=exe):
                for o in exe.forward(is_train=False):
                    o.wait_to_read()
            systems["fused_region " + prec] = step
        samples = time_samples(systems, repeats=args.repeats)
        base = float(np.median(samples["mxnet default bind"]))
        for k, v in samples.items():
            ms = np.asarray(v) * 1e3
            med = float(np.median(ms))
            print("  %-22s %8.2f ms  [p10 %.2f - p90 %.2f]  %s" % (
                k, med, np.percentile(ms, 10), np.percentile(ms, 90),
                "" if k.startswith("mxnet") else "%.2fx vs MXNet" % (base * 1e3 / med)))
        if "float32" in precisions and "bfloat16" in precisions:
            f32 = float(np.median(samples["fused_region float32"]))
            bf16 = float(np.median(samples["fused_region bfloat16"]))
            print("  bfloat16 vs float32 region: %.2fx" % (f32 / bf16))


if __name__ == "__main__":
    main()
