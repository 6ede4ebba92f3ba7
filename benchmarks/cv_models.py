"""GluonCV's detection, segmentation, pose and pre-activation models with random weights.

    from cv_models import MODELS, build
    sym, arg, aux, shape = build("ssd_512_resnet50_v1_voc")

GluonCV 0.10 (``pip install gluoncv==0.10.5.post0``; not a dependency of the project) builds
each network with ``pretrained=False`` (and ``pretrained_base=False``), batch 1, at the input
size GluonCV uses for it; the weights are Xavier, every BatchNorm's statistics randomized
(variances positive: GluonCV's SSD heads name some BatchNorm statistics so that the
initializer draws them like weights) so that folding is not trivially exact; biases N(0, 0.2)
(``fusion.testing.gcv_zoo``).
"""
from __future__ import annotations

from typing import Dict, Tuple


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


def build(name: str, seed: int = 0):
    """(symbol, arg_params, aux_params, input shape) of GluonCV model ``name`` (a key of MODELS)."""
    from fusion.testing.gcv_zoo import gcv_zoo_model

    zoo_name, shape = MODELS[name]
    sym, arg, aux = gcv_zoo_model(zoo_name, shape, seed, bn_by_nodes=True)
    return sym, arg, aux, shape
