"""The detection heads' ops as MXNet runs them against the library's: ``_contrib_box_nms`` /
``fused_box_nms``, ``Pooling(max)`` of a plain array / ``fused_max_pool``, ``_contrib_ROIAlign`` /
``fused_roi_align``, on the GluonCV detectors' shapes.

    python benchmarks/bench_detection_ops.py [--repeats 7]

The shapes and attributes of the GluonCV detectors' NMS calls (batch 1): YOLOv3 on COCO (every
anchor × 80 classes: 851,760 rows, top 400), SSD-512 on VOC (122,640 rows, top 400), Faster
R-CNN's proposal NMS (28,500 rows, top 6,000, no classes) and its per-class detection NMS (20 × 300
rows).  Rows are random: scores uniform in [0, 1), class ids uniform, boxes 5–100 px wide in a
500 px image, so most rows are valid and many overlap.  Both ops run interleaved on the same
input; per case the median and p10–p90 of each (ms), the ratio, and whether both outputs are equal
bit for bit.  Then CenterNet's 3×3 stride-1 peak pooling of its 20×128×128 heatmap (and
YOLO-sized and ResNet-stem-sized max poolings of plain arrays), and Faster R-CNN's RoI Align
(300 RoIs of 16–300 px over a 1024×38×50 feature map, 14×14 bins, sample ratio 2).
"""
from __future__ import annotations

import argparse
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from fusion.native.env import configure_threads  # noqa: E402  (must run before mxnet is imported)

configure_threads()

import numpy as np  # noqa: E402

CASES = [
    ("yolo3_mobilenet1.0_coco", (1, 851760, 6),
     dict(coord_start=2, score_index=1, id_index=0, force_suppress=False, overlap_thresh=0.45, topk=400,
          valid_thresh=0.01)),
    ("ssd_512_mobilenet1.0_voc", (1, 122640, 6),
     dict(coord_start=2, score_index=1, id_index=0, force_suppress=False, overlap_thresh=0.45, topk=400,
          valid_thresh=0.01)),
    ("faster_rcnn proposals", (1, 28500, 5),
     dict(coord_start=1, score_index=0, id_index=-1, force_suppress=True, overlap_thresh=0.7, topk=6000)),
    ("faster_rcnn detections", (20, 300, 6),
     dict(coord_start=2, score_index=1, id_index=0, force_suppress=False, overlap_thresh=0.3, topk=400,
          valid_thresh=0.0001)),
]


POOLS = [  # (case, input shape, kernel, stride, pad): max pooling of a plain (not oneDNN-blocked) array
    ("center_net peaks", (1, 20, 128, 128), 3, 1, 1),
    ("coco-sized peaks", (1, 80, 104, 104), 3, 1, 1),
    ("stem-sized pool", (1, 64, 256, 256), 3, 2, 1),
]


def rows(rng, shape, attrs):
    x = rng.uniform(0, 1, size=shape).astype(np.float32)
    if attrs["id_index"] >= 0:
        x[..., attrs["id_index"]] = rng.randint(0, 80, size=shape[:-1])
    c0 = attrs["coord_start"]
    xy = rng.uniform(0, 500, size=shape[:-1] + (2,))
    x[..., c0:c0 + 2] = xy
    x[..., c0 + 2:c0 + 4] = xy + rng.uniform(5, 100, size=xy.shape)
    return x


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    import mxnet as mx

    from fusion.native import library
    library.load()
    rng = np.random.RandomState(0)
    print("%-24s %-16s %22s %22s %8s  %s" % ("case", "rows", "MXNet ms [p10-p90]", "fused ms [p10-p90]",
                                             "speed-up", "equal"))
    for name, shape, attrs in CASES:
        x = mx.nd.array(rows(rng, shape, attrs))
        timed(name, "x".join(map(str, shape)),
              {"mxnet": lambda: mx.nd.contrib.box_nms(x, **attrs),
               "fused": lambda: mx.nd.fused_box_nms(x, **attrs)[0]},   # (its second output: MXNet's hidden one)
              args.repeats)
    for name, shape, k, st, pad in POOLS:
        x = mx.nd.array(rng.standard_normal(shape).astype(np.float32))
        attrs = dict(kernel=(k, k), stride=(st, st), pad=(pad, pad))
        timed(name, "x".join(map(str, shape)), {"mxnet": lambda: mx.nd.Pooling(x, pool_type="max", **attrs),
                                                  "fused": lambda: mx.nd.fused_max_pool(x, **attrs)}, args.repeats)
    feat = mx.nd.array(rng.standard_normal((1, 1024, 38, 50)).astype(np.float32))
    xy = rng.uniform(0, 700, size=(300, 2))
    rois = mx.nd.array(np.concatenate([np.zeros((300, 1)), xy, xy + rng.uniform(16, 300, size=(300, 2))],
                                      1).astype(np.float32))
    attrs = dict(pooled_size=(14, 14), spatial_scale=0.0625, sample_ratio=2)
    timed("faster_rcnn RoI Align", "300 RoIs, 1024x38x50",
          {"mxnet": lambda: mx.nd.contrib.ROIAlign(feat, rois, **attrs),
           "fused": lambda: mx.nd.fused_roi_align(feat, rois, **attrs)}, args.repeats)


def timed(name, what, calls, repeats):
    from fusion.check.bench import time_samples
    outs = {k: f().asnumpy() for k, f in calls.items()}
    times = {k: np.asarray(v) * 1e3 for k, v in
             time_samples({k: (lambda f=f: f().wait_to_read()) for k, f in calls.items()}, repeats, warmup=1).items()}
    q = {k: np.percentile(v, [50, 10, 90]) for k, v in times.items()}
    print("%-24s %-16s %8.2f [%6.2f-%6.2f] %8.2f [%6.2f-%6.2f] %7.1fx  %s" % (
        name, what, *q["mxnet"], *q["fused"], q["mxnet"][0] / q["fused"][0],
        np.array_equal(outs["mxnet"], outs["fused"], equal_nan=True)))


if __name__ == "__main__":
    main()
