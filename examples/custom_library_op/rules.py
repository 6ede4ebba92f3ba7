"""A rule lowering ``clip(x, 0, 6)`` onto ``my_relu6``, a C++ op from the user's own library.

    python examples/custom_library_op/rules.py        # builds libmy_relu6.so, fuses, verifies, trains a step

Use it from the command line with ``mxfuse ... --rules default,examples.custom_library_op.rules:RULES``
after loading the library (importing this module builds and loads it).
"""
import os
import subprocess
import sys

import mxnet as mx
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from fusion.rules import OneOf, Rule, Var, op  # noqa: E402


def build_and_load(out_dir=HERE):
    """Compile my_relu6.cc against the headers in the MXNet wheel and load it into MXNet."""
    mxdir = os.path.dirname(mx.__file__)
    lib = os.path.join(out_dir, "libmy_relu6.so")
    src = os.path.join(HERE, "my_relu6.cc")
    exports = os.path.join(HERE, "lib_api.map")   # export only MXNet's entry points (see the file)
    if not os.path.exists(lib) or os.path.getmtime(lib) < max(os.path.getmtime(src), os.path.getmtime(exports)):
        subprocess.run(["g++", "-shared", "-fPIC", "-std=c++17", "-O2", "-I", os.path.join(mxdir, "include"),
                        src, os.path.join(mxdir, "src", "lib_api.cc"), "-o", lib,
                        "-Wl,--version-script=" + exports, "-Wl,-Bsymbolic"], check=True)
    mx.library.load(lib, verbose=False)
    return lib


class ClipToRelu6(Rule):
    name = "my_relu6"
    benefit = 200
    description = "clip(x, 0, 6) → my_relu6 (user library op)"

    def pattern(self):
        return op.clip(Var("x"), a_min=OneOf(0, 0.0), a_max=OneOf(6, 6.0), name="clip")

    def rewrite(self, m, b):
        return b.op("my_relu6", [m["x"]], name=m.anchor.name)


build_and_load()
RULES = [ClipToRelu6()]


def main():
    import fusion

    x = mx.sym.var("data")
    y = mx.sym.FullyConnected(mx.sym.clip(mx.sym.FullyConnected(x, num_hidden=8, name="fc1"), 0, 6),
                              num_hidden=3, name="fc2")
    rng = np.random.default_rng(0)
    shapes, _, _ = y.infer_shape(data=(4, 5))
    arg = {n: mx.nd.array(rng.normal(0, 2, s)) for n, s in zip(y.list_arguments(), shapes) if n != "data"}
    res = fusion.fuse(y, arg, {}, rules=RULES, mode="training")
    print(res.report)
    print("verify:", fusion.verify(y, res, (arg, {}), {"data": (4, 5)}))
    grads = []
    data = mx.nd.array(rng.standard_normal((4, 5)))
    for s, p in ((y, arg), (res.symbol, res.arg_params)):
        args = dict(p, data=data)
        g = {k: mx.nd.zeros(v.shape) for k, v in args.items() if k != "data"}
        exe = s.bind(mx.cpu(), args, args_grad=g)
        exe.forward(is_train=True)
        exe.backward(mx.nd.ones(exe.outputs[0].shape))
        grads.append({k: v.asnumpy() for k, v in g.items()})
    worst = max(float(np.abs(grads[0][k] - grads[1][k]).max()) for k in grads[0])
    print("gradients through my_relu6 vs clip: max difference %.2e" % worst)
    assert worst < 1e-5
    return worst


if __name__ == "__main__":
    main()
