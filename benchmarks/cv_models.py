"""GluonCV's detection, segmentation, pose and pre-activation models with random weights.

    from cv_models import MODELS, build
    sym, arg, aux, shape = build("ssd_512_resnet50_v1_voc")

GluonCV 0.10 (``pip install gluoncv==0.10.5.post0``; not a dependency of the project) builds
each network with ``pretrained=False`` (and ``pretrained_base=False``), batch 1, at the input
size GluonCV uses for it; the weights are Xavier, every BatchNorm's statistics randomized
(variances positive: GluonCV's SSD heads name some BatchNorm statistics so that the
initializer draws them like weights) so that folding is not trivially exact.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

#: GluonCV model name -> (name in GluonCV's model zoo, input shape NCHW)
MODELS: Dict[str, Tuple[str, Tuple[int, int, int, int]]] = {
    "gcv_resnet50_v2": ("resnet50_v2", (1, 3, 224, 224)),
    "simple_pose_resnet18_v1b": ("simple_pose_resnet18_v1b", (1, 3, 256, 192)),
    "yolo3_mobilenet1.0_coco": ("yolo3_mobilenet1.0_coco", (1, 3, 416, 416)),
    "center_net_resnet18_v1b_voc": ("center_net_resnet18_v1b_voc", (1, 3, 512, 512)),
    "ssd_512_mobilenet1.0_voc": ("ssd_512_mobilenet1.0_voc", (1, 3, 512, 512)),
    "ssd_512_resnet50_v1_voc": ("ssd_512_resnet50_v1_voc", (1, 3, 512, 512)),
    "faster_rcnn_resnet50_v1b_voc": ("faster_rcnn_resnet50_v1b_voc", (1, 3, 600, 800)),
    "fcn_resnet50_voc": ("fcn_resnet50_voc", (1, 3, 480, 480)),
    "psp_resnet50_ade": ("psp_resnet50_ade", (1, 3, 480, 480)),
    "deeplab_resnet50_ade": ("deeplab_resnet50_ade", (1, 3, 480, 480)),
}


def _randomize_batchnorm(sym, arg: Dict, aux: Dict, seed: int) -> None:
    """Every BatchNorm's gamma, beta, mean and (positive) variance drawn at random, found by the
    BatchNorm nodes' inputs rather than by parameter names."""
    import json

    import mxnet as mx

    rng = np.random.default_rng(seed)
    graph = json.loads(sym.tojson())
    nodes = graph["nodes"]
    ranges = ((0.5, 1.5), None, None, (0.5, 2.0))      # gamma, beta, mean, var
    for n in nodes:
        if n["op"] != "BatchNorm":
            continue
        for k, (src, _, _) in enumerate(n["inputs"][1:5]):
            name = nodes[src]["name"]
            store = arg if name in arg else aux if name in aux else None
            if store is None:
                continue
            shape = store[name].shape
            lo_hi = ranges[k]
            value = rng.uniform(*lo_hi, shape) if lo_hi else rng.normal(0.0, 0.2, shape)
            store[name] = mx.nd.array(value)


def _initializer():
    """Xavier for weights, ones for vectors: GluonCV's SSD gives some BatchNorm parameters an
    initializer of their own, which Xavier would then be asked to apply to a vector."""
    import mxnet as mx

    @mx.init.register
    class XavierOrOnes(mx.init.Xavier):
        def _init_weight(self, name, arr):
            if len(arr.shape) < 2:
                arr[:] = 1.0
            else:
                super()._init_weight(name, arr)

    return XavierOrOnes


def build(name: str, seed: int = 0):
    """(symbol, arg_params, aux_params, input shape) of GluonCV model ``name`` (a key of MODELS)."""
    import mxnet as mx
    from gluoncv import model_zoo

    zoo_name, shape = MODELS[name]
    mx.random.seed(seed)
    kwargs = {"pretrained": False}
    if zoo_name != "resnet50_v2":
        kwargs["pretrained_base"] = False
    net = model_zoo.get_model(zoo_name, **kwargs)
    net.initialize(_initializer()(magnitude=2.0), force_reinit=True)
    net.hybridize()
    net(mx.nd.zeros(shape))
    sym = net._cached_graph[1]
    params = {p.var().name: p.data() for p in net.collect_params().values()}
    aux_names = set(sym.list_auxiliary_states())
    arg_names = set(sym.list_arguments())
    arg = {k: v for k, v in params.items() if k in arg_names}
    aux = {k: v for k, v in params.items() if k in aux_names}
    _randomize_batchnorm(sym, arg, aux, seed)
    return sym, arg, aux, shape
