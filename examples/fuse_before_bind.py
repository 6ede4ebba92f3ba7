"""Door 2 — Python: ``fusion.fuse()`` before ``bind``.

    python examples/fuse_before_bind.py [--quick]
"""
from _common import MODEL, repeats, speedups  # first: thread settings before mxnet loads

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402

import fusion
from fusion.check.bench import executor, time_interleaved

sym, arg, aux = mx.model.load_checkpoint(MODEL, 0)
result = fusion.fuse(sym, arg, aux, input_shapes={"data": (1, 3, 224, 224)})
print(result.report)

x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
exe = result.symbol.bind(mx.cpu(), {**result.arg_params, "data": mx.nd.array(x)}, aux_states=result.aux_params)
print("fused output:", exe.forward(is_train=False)[0].shape)
print("verify:", fusion.verify((sym, arg, aux), result, inputs={"data": x}))
times = time_interleaved({
    "fused": executor(result.symbol, result.arg_params, result.aux_params, {"data": x}),
    "mxnet_default": executor(sym, arg, aux, {"data": x}),
    "mxnet_subgraph_off": executor(sym, arg, aux, {"data": x}, subgraph=False),
}, repeats=repeats())
print("median latency:", speedups(times))
