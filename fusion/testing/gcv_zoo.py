"""GluonCV's own model zoo (the ``gluoncv`` package) with random weights, for tests and timings.

``gcv_zoo_model(name, shape)`` gives (symbol, arg_params, aux_params) of
``gluoncv.model_zoo.get_model(name, pretrained=False)``: nothing is downloaded.  Weights
are Xavier, BatchNorm γ/β/statistics random with positive variances (a detection head's
BatchNorm that Gluon would start at variance 0 included), biases N(0, 0.2).  Needs
``gluoncv`` (``pip install gluoncv==0.10.5.post0``; then put ``numpy<1.24`` back, which
MXNet 1.9.1 needs).
"""
from __future__ import annotations

import functools
from typing import Tuple

import numpy as np


def gcv_zoo_model(name: str, input_shape: Tuple[int, ...], seed: int = 0, bn_by_nodes: bool = False, **kwargs):
    """(symbol, arg_params, aux_params); ``bn_by_nodes``: the BatchNorm parameters found by the nodes'
    inputs (``randomize_batchnorm_of``: also those GluonCV's SSD heads name like weights) rather than
    by their names."""
    import gluoncv
    import mxnet as mx

    from . import gluon_export

    mx.random.seed(seed)
    kwargs = dict(pretrained=False, **kwargs)
    with mx.name.NameManager():
        try:
            net = gluoncv.model_zoo.get_model(name, **dict({"pretrained_base": False}, **kwargs))
        except (TypeError, Warning):    # a classifier (e.g. resnet50_v2): no pretrained base to leave out
            # (darknet53 passes it on to a Block, which raises Warning at an unknown keyword)
            net = gluoncv.model_zoo.get_model(name, **kwargs)
    sym, arg, aux = gluon_export(net, input_shape, seed, init=_xavier(), bn_by_nodes=bn_by_nodes)
    rng = np.random.default_rng(seed + 1)
    for k in sorted(arg):
        if k.endswith("_bias"):
            arg[k] = mx.nd.array(rng.normal(0.0, 0.2, arg[k].shape))
    return sym, arg, aux


def _xavier():
    """Xavier for weights of 2 or more axes; a vector some GluonCV head asks Xavier for (a BatchNorm's
    γ) gets ones (randomized afterwards), where plain Xavier refuses it."""
    return _xavier_or_ones()(magnitude=2.0)


@functools.lru_cache(maxsize=None)
def _xavier_or_ones():
    """The initializer class, registered with MXNet once."""
    import mxnet as mx

    @mx.init.register
    class _XavierOrOnes(mx.init.Xavier):
        def _init_weight(self, name, arr):
            if len(arr.shape) < 2:
                arr[:] = 1.0
            else:
                super()._init_weight(name, arr)

    return _XavierOrOnes
