"""GluonCV's own model zoo (the ``gluoncv`` package) with random weights, for tests and timings.

``gcv_zoo_model(name, shape)`` gives (symbol, arg_params, aux_params) of
``gluoncv.model_zoo.get_model(name, pretrained=False)``: nothing is downloaded.  Weights
are Xavier, BatchNorm γ/β/statistics random with positive variances (a detection head's
BatchNorm that Gluon would start at variance 0 included), biases N(0, 0.2).  Needs
``gluoncv`` (``pip install gluoncv==0.10.5.post0``; then put ``numpy<1.24`` back, which
MXNet 1.9.1 needs).
"""
from __future__ import annotations

from typing import Tuple

import numpy as np


def gcv_zoo_model(name: str, input_shape: Tuple[int, ...], seed: int = 0, **kwargs):
    import gluoncv
    import mxnet as mx

    from . import randomize_batchnorm

    mx.random.seed(seed)
    with mx.name.NameManager():
        net = gluoncv.model_zoo.get_model(name, pretrained=False, pretrained_base=False, **kwargs)
    net.initialize(_xavier())
    net.hybridize()
    net(mx.nd.zeros(input_shape))
    sym = net._cached_graph[1]
    params = {p.var().name: p.data() for p in net.collect_params().values()}
    aux_names = set(sym.list_auxiliary_states())
    arg = {k: v for k, v in params.items() if k not in aux_names}
    aux = {k: v for k, v in params.items() if k in aux_names}
    randomize_batchnorm(arg, aux, seed)
    rng = np.random.default_rng(seed + 1)
    for k in sorted(arg):
        if k.endswith("_bias"):
            arg[k] = mx.nd.array(rng.normal(0.0, 0.2, arg[k].shape))
    return sym, arg, aux


def _xavier():
    """Xavier for weights of 2 or more axes; a vector some GluonCV head asks Xavier for (a BatchNorm's
    γ) gets ones (randomized afterwards), where plain Xavier refuses it."""
    import mxnet as mx

    @mx.init.register
    class _XavierOrOnes(mx.init.Xavier):
        def _init_weight(self, name, arr):
            if len(arr.shape) < 2:
                arr[:] = 1.0
            else:
                super()._init_weight(name, arr)

    return _XavierOrOnes(magnitude=2.0)
