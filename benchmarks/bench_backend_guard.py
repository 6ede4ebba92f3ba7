"""What the oneDNN guard (fusion/engine/workarounds.py) costs under MXNet's default bind.

    python benchmarks/bench_backend_guard.py [--repeats 200]

A layer output that is also a graph output, read by an op MXNet 1.9.1's oneDNN backend fuses into the
layer, is miscomputed by that backend; fused graphs route such a read through an identity
``Reshape(shape=(-2,))``.  Per case, interleaved (median of ``--repeats`` calls, with p10-p90):

* ``unguarded``: the graph as written, default bind -- the backend fuses the reader into the layer and
  hands the other output the wrong value (the speed a user of the wrong graph sees);
* ``guarded``: the graph with the guard, default bind -- right;
* ``split``: the graph as written with that fusion switched off (``MXNET_DISABLE_ONEDNN_FUSE_FC_ELTWISE``
  / ``MXNET_DISABLE_MKLDNN_FUSE_CONV_RELU``) -- right, the op boundary without the Reshape.

``guarded / split`` is the Reshape's own cost; ``guarded / unguarded`` the price of a right answer.
Cases: BERT-base's FFN input projection (128 x 768 -> 3072) read by GELU, and ResNet-50's first
3x3 stage convolution + BatchNorm (1 x 64 x 56 x 56) read by relu, each layer also an output.
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fusion.native import env as _env  # noqa: E402

_env.configure_threads()

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402

import fusion  # noqa: E402, F401
from fusion.check.bench import executor, time_samples  # noqa: E402
from fusion.ir.graph import Graph  # noqa: E402
from fusion.engine.workarounds import guard_layer_outputs  # noqa: E402

S = mx.sym


def fc_gelu():
    fc = S.FullyConnected(S.var("data"), num_hidden=3072, flatten=False, name="ffn1")
    return S.Group([S.LeakyReLU(fc, act_type="gelu"), fc]), {"data": (1, 128, 768)}, \
        "MXNET_DISABLE_ONEDNN_FUSE_FC_ELTWISE"


def conv_bn_relu():
    x = S.Convolution(S.var("data"), kernel=(3, 3), pad=(1, 1), num_filter=64, name="conv")
    bn = S.BatchNorm(x, fix_gamma=False, name="bn")
    return S.Group([S.Activation(bn, act_type="relu"), bn]), {"data": (1, 64, 56, 56)}, \
        "MXNET_DISABLE_MKLDNN_FUSE_CONV_RELU"


def params(sym, shapes, seed=0):
    rng = np.random.default_rng(seed)
    a, _, x = sym.infer_shape(**shapes)
    arg = {n: mx.nd.array(rng.normal(0, 0.05, s)) for n, s in zip(sym.list_arguments(), a) if n not in shapes}
    aux = {n: mx.nd.array(rng.uniform(0.5, 1.5, s)) for n, s in zip(sym.list_auxiliary_states(), x)}
    inputs = {n: mx.nd.array(rng.normal(size=s)) for n, s in shapes.items()}
    return arg, aux, inputs


def guarded(sym):
    g = Graph.from_symbol(sym)
    assert guard_layer_outputs(g), "nothing to guard"
    return g.to_symbol()


def split_executor(sym, arg, aux, inputs, flag):
    os.environ[flag] = "1"          # read when MXNet builds its pass for this bind
    try:
        return executor(sym, arg, aux, inputs)
    finally:
        del os.environ[flag]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args()
    print("CPU: %s; load average %s" % (_cpu_name(), " ".join("%.1f" % v for v in os.getloadavg())))
    for name, make in (("FullyConnected -> GELU", fc_gelu), ("Convolution -> BatchNorm -> relu", conv_bn_relu)):
        sym, shapes, flag = make()
        arg, aux, inputs = params(sym, shapes)
        systems = {"unguarded": executor(sym, arg, aux, inputs),
                   "guarded": executor(guarded(sym), arg, aux, inputs),
                   "split": split_executor(sym, arg, aux, inputs, flag)}
        ref = executor(sym, arg, aux, inputs, subgraph=False)
        samples = time_samples(systems, repeats=args.repeats, warmup=10)
        del ref
        ms = {k: np.asarray(v) * 1e3 for k, v in samples.items()}
        med = {k: statistics.median(v) for k, v in ms.items()}
        print("%s:" % name)
        for k, v in ms.items():
            print("  %-10s %8.3f ms (p10-p90 %.3f-%.3f)" % (k, med[k], np.percentile(v, 10), np.percentile(v, 90)))
        print("  guarded / split %.3f (the Reshape's own cost), guarded / unguarded %.3f (the price of a right "
              "answer)" % (med["guarded"] / med["split"], med["guarded"] / med["unguarded"]))


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
