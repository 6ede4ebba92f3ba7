"""Helpers for tests, examples and benchmarks: model-zoo networks with random weights.

BatchNorm statistics are randomized (MXNet initializes mean 0 / variance 1,
which would make folding trivially exact), so a fold that mixes up the
channel axis, eps or fix_gamma shows up as a numerical mismatch.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np


def randomize_batchnorm(arg: Dict, aux: Dict, seed: int = 0) -> None:
    """Give every BatchNorm gamma/beta/moving stats non-trivial values (in place, on these dicts)."""
    import mxnet as mx

    rng = np.random.default_rng(seed)
    for store in (arg, aux):
        for name in sorted(store):
            shape = store[name].shape
            if name.endswith("_gamma"):
                store[name] = mx.nd.array(rng.uniform(0.5, 1.5, shape))
            elif name.endswith("_beta"):
                store[name] = mx.nd.array(rng.normal(0.0, 0.2, shape))
            elif name.endswith("_running_mean") or name.endswith("_moving_mean"):
                store[name] = mx.nd.array(rng.normal(0.0, 0.2, shape))
            elif name.endswith("_running_var") or name.endswith("_moving_var"):
                store[name] = mx.nd.array(rng.uniform(0.5, 2.0, shape))


def zoo_model(name: str, input_shape: Tuple[int, ...] = (1, 3, 224, 224), seed: int = 0, **kwargs):
    """(symbol, arg_params, aux_params) of ``mxnet.gluon.model_zoo.vision`` network ``name``."""
    import mxnet as mx
    from mxnet.gluon.model_zoo import vision

    mx.random.seed(seed)
    net = vision.get_model(name, **kwargs)
    net.initialize(mx.init.Xavier(magnitude=2.0))
    net.hybridize()
    net(mx.nd.zeros(input_shape))
    sym = net._cached_graph[1]
    params = {p.var().name: p.data() for p in net.collect_params().values()}
    aux_names = set(sym.list_auxiliary_states())
    arg = {k: v for k, v in params.items() if k not in aux_names}
    aux = {k: v for k, v in params.items() if k in aux_names}
    randomize_batchnorm(arg, aux, seed)
    return sym, arg, aux
