"""GluonCV's own model zoo (the ``gluoncv`` package) with random weights, for tests and timings.

``gcv_zoo_model(name, shape)`` gives (symbol, arg_params, aux_params) of
``gluoncv.model_zoo.get_model(name, pretrained=False)``: nothing is downloaded.  Weights
are Xavier, BatchNorm γ/β/statistics random with positive variances (a detection head's
BatchNorm that Gluon would start at variance 0 included), biases N(0, 0.2).  Needs
``gluoncv`` (``pip install gluoncv==0.10.5.post0``; then put ``numpy<1.24`` back, which
MXNet 1.9.1 needs).

Two of GluonCV 0.10's constructors cannot build a network without downloading weights; while one
is built here (``_gluoncv_fixes``) they are helped past it: the TSN action models of a ResNet v1b
(``resnet50_v1b_kinetics400`` …) do not pass ``pretrained_base`` on and always load the ImageNet
backbone, and several (``inceptionv1_ucf101``, ``vgg16_ucf101`` …) move their parameters to a
context before anything initialized them.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Tuple

import numpy as np


def gcv_zoo_model(name: str, input_shape, seed: int = 0, bn_by_nodes: bool = False, **kwargs):
    """(symbol, arg_params, aux_params) at ``input_shape`` (a list of shapes for a network of several
    inputs); ``bn_by_nodes``: the BatchNorm parameters found by the nodes'
    inputs (``randomize_batchnorm_of``: also those GluonCV's SSD heads name like weights) rather than
    by their names."""
    import gluoncv
    import mxnet as mx

    from . import gluon_export

    mx.random.seed(seed)
    kwargs = dict(pretrained=False, **kwargs)
    with mx.name.NameManager(), _gluoncv_fixes():
        try:
            net = gluoncv.model_zoo.get_model(name, **dict({"pretrained_base": False}, **kwargs))
        except (TypeError, Warning):    # a classifier (e.g. resnet50_v2): no pretrained base to leave out
            # (darknet53 passes it on to a Block, which raises Warning at an unknown keyword)
            net = gluoncv.model_zoo.get_model(name, **kwargs)
    # several inputs (a list of shapes: SiamRPN's template and search image): called with one array of
    # zeros each, the symbol's inputs named data0, data1, …
    several = isinstance(input_shape, list)
    sym, arg, aux = gluon_export(net, () if several else input_shape, seed, init=_xavier(), bn_by_nodes=bn_by_nodes,
                                 call_with=[mx.nd.zeros(s) for s in input_shape] if several else None)
    rng = np.random.default_rng(seed + 1)
    for k in sorted(arg):
        if k.endswith("_bias"):
            arg[k] = mx.nd.array(rng.normal(0.0, 0.2, arg[k].shape))
    return sym, arg, aux


@contextlib.contextmanager
def _gluoncv_fixes():
    """GluonCV's action-recognition constructors made to build without weights (see the module's text)."""
    import mxnet as mx

    param = mx.gluon.parameter.Parameter
    reset_ctx = param.reset_ctx

    def reset_ctx_if_initialized(self, ctx):
        if self._data is None and not self._deferred_init:
            return                   # nothing to move: initialized later, on the context asked for then
        return reset_ctx(self, ctx)

    patched = []
    try:
        from gluoncv.model_zoo.action_recognition import actionrec_resnetv1b as tsn
    except ImportError:
        tsn = None
    if tsn is not None:
        for depth in (18, 34, 50, 101, 152):
            name = "resnet%d_v1b" % depth
            backbone = getattr(tsn, name, None)
            if backbone is not None:
                patched.append((name, backbone))
                setattr(tsn, name, functools.partial(_no_pretrained, backbone))
    param.reset_ctx = reset_ctx_if_initialized
    try:
        yield
    finally:
        param.reset_ctx = reset_ctx
        for name, backbone in patched:
            setattr(tsn, name, backbone)


def _no_pretrained(build, *args, **kwargs):
    kwargs["pretrained"] = False
    return build(*args, **kwargs)


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
