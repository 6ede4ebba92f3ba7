"""MXNet's _contrib_BilinearResize2D against fused_bilinear_resize, on the shapes of GluonCV's segmentation heads.

    OMP_NUM_THREADS=2 python benchmarks/bench_resize.py [--reps 15]

The shapes are those of psp_resnet50_ade and deeplab_resnet50_ade at 480x480 (batch 1): the
pyramid pooling's (1, 512, s, s) → 60x60 for s = 1, 2, 3, 6, DeepLab's image pooling (1, 256, 1, 1)
→ 60x60, and the heads' (1, 150, 60, 60) → 480x480 (twice per model: main and auxiliary head),
all align_corners=True (GluonCV's default), plus that last one with align_corners=False.  Each op
is bound on its own (MXNet's default bind) and the two run interleaved; printed per shape: the
median and the 10th-90th percentile of each, their ratio, and whether the outputs are equal bit
for bit.  The load average is printed with the figures (the machine may be shared).
"""
from __future__ import annotations

import argparse
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

os.environ.setdefault("OMP_NUM_THREADS", "2")
from fusion.native.env import configure_threads  # noqa: E402

configure_threads()

import numpy as np  # noqa: E402

# (input shape, output (H, W), align_corners)
SHAPES = [((1, 512, 1, 1), (60, 60), True), ((1, 512, 2, 2), (60, 60), True), ((1, 512, 3, 3), (60, 60), True),
          ((1, 512, 6, 6), (60, 60), True), ((1, 256, 1, 1), (60, 60), True),
          ((1, 150, 60, 60), (480, 480), True), ((1, 150, 60, 60), (480, 480), False)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)

    import mxnet as mx

    import fusion  # noqa: F401  (loads the op library)
    from fusion.check.bench import time_samples
    from fusion.engine.cost import cpu_identity

    x = mx.sym.var("data")
    print("OMP_NUM_THREADS=%s  %s  load average %s" % (os.environ.get("OMP_NUM_THREADS"), cpu_identity()[0],
                                                       " ".join("%.2f" % v for v in os.getloadavg())))
    print("%-20s %-10s %-5s  %22s  %22s  %6s  %s" % ("input", "output", "ac", "MXNet ms (p10-p90)",
                                                   "fused ms (p10-p90)", "ratio", "bitwise"))
    rng = np.random.default_rng(0)
    for shape, (oh, ow), ac in SHAPES:
        data = mx.nd.array(rng.standard_normal(shape).astype(np.float32))
        stock = mx.sym.contrib.BilinearResize2D(x, height=oh, width=ow, align_corners=ac)
        fused = mx.sym.fused_bilinear_resize(x, height=str(oh), width=str(ow), align_corners=str(ac))
        exs = [s.bind(mx.cpu(), {"data": data}, grad_req="null") for s in (stock, fused)]
        outs = [ex.forward()[0].asnumpy() for ex in exs]
        same = outs[0].shape == outs[1].shape and bool((outs[0].view(np.uint32) == outs[1].view(np.uint32)).all())
        fns = [lambda ex=ex: ex.forward()[0].wait_to_read() for ex in exs]
        t_stock, t_fused = (np.asarray(t) for t in time_samples(dict(enumerate(fns)), args.reps, warmup=2).values())
        cols = ["%7.3f (%6.3f-%6.3f)" % (1e3 * np.median(t), 1e3 * np.percentile(t, 10), 1e3 * np.percentile(t, 90))
                for t in (t_stock, t_fused)]
        print("%-20s %-10s %-5s  %22s  %22s  %5.1fx  %s" % (str(shape), "%dx%d" % (oh, ow), ac, cols[0], cols[1],
                                                         np.median(t_stock) / np.median(t_fused), same))
        sys.stdout.flush()
    print("load average after: %s" % " ".join("%.2f" % v for v in os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
