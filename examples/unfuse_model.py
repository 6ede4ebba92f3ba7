"""Un-fusing: a fused model back into stock MXNet ops, loaded in a process without mxnet-fusion.

    python examples/unfuse_model.py [--quick]
"""
import os
import subprocess
import sys
import tempfile

import _common  # noqa: F401  (first: thread settings before mxnet loads)

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402

import fusion
from fusion import Graph

S = mx.sym
x = S.var("data")
h = S.FullyConnected(x, num_hidden=64, flatten=False, name="proj")
h = S.LayerNorm(h + x, S.var("g"), S.var("b"), name="ln")
y = S.Activation(S.FullyConnected(h, num_hidden=64, flatten=False, name="ffn"), act_type="relu")
rng = np.random.default_rng(0)
shapes, _, _ = y.infer_shape(data=(2, 8, 64))
arg = {n: mx.nd.array(rng.normal(0, 0.1, s)) for n, s in zip(y.list_arguments(), shapes) if n != "data"}

fused = fusion.fuse(y, arg, {})
plain = fusion.unfuse(fused.symbol)
print("fused ops:  ", Graph.from_symbol(fused.symbol).count_ops())
print("unfused ops:", Graph.from_symbol(plain).count_ops())

with tempfile.TemporaryDirectory() as d:
    plain.save(os.path.join(d, "m-symbol.json"))
    mx.nd.save(os.path.join(d, "m-0000.params"), {"arg:" + k: v for k, v in fused.arg_params.items()})
    data = rng.standard_normal((2, 8, 64)).astype(np.float32)
    np.save(os.path.join(d, "x.npy"), data)
    # a fresh interpreter that never imports mxnet-fusion loads and runs the un-fused model
    code = ("import mxnet as mx, numpy as np, sys; d=sys.argv[1]; "
            "s,a,_=mx.model.load_checkpoint(d+'/m',0); a['data']=mx.nd.array(np.load(d+'/x.npy')); "
            "np.save(d+'/y.npy', s.bind(mx.cpu(), a).forward()[0].asnumpy())")
    subprocess.run([sys.executable, "-c", code, d], check=True, cwd=d)
    out = np.load(os.path.join(d, "y.npy"))
exe = y.bind(mx.cpu(), dict(arg, data=mx.nd.array(data)))
want = exe.forward()[0].asnumpy()
err = float(np.abs(out - want).max() / np.abs(want).max())
print("un-fused model run without mxnet-fusion: max rel error vs the original %.1e" % err)
assert err < 1e-5
