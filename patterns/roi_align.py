r"""RoI Align: ``_contrib_ROIAlign`` → ``fused_roi_align``, the same values, vectorized over channels.

Matched::

    data (N, C, H, W), rois (R, 5) [batch index, x1, y1, x2, y2]
    _contrib_ROIAlign(pooled_size, spatial_scale, sample_ratio, aligned, position_sensitive=False)

Rewrite: ``fused_roi_align(data, rois)`` with the same attributes.  MXNet 1.9.1 samples each
RoI's bins one channel plane at a time; the library op computes MXNet's sampling table (positions
and bilinear weights, the same float arithmetic) once per RoI and sums every bin over a block of
channels at once from a channel-last copy of the features, each element's sum in MXNet's order:
the same values bit for bit (``tests/test_roi_align.py``).  Faster R-CNN's 300 RoIs of 1024
channels, 14×14 bins: ``benchmarks/bench_detection_ops.py``.

A RoI whose batch index is negative is ignored by MXNet, which leaves its output unwritten
(whatever the memory held); the library op writes zeros there.  A batch index past the data is
an error (MXNet reads past the data).

Refused: ``position_sensitive``, values other than float32, a device without the op, and
``mode='training'`` (the library op has no backward).
"""
from __future__ import annotations

from typing import List, Optional

from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.ir.pattern import Pattern, Var, op
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from ._dtypes import float32_reason

ATTRS = ("pooled_size", "spatial_scale", "sample_ratio", "aligned")


class RoIAlign(Rule):
    name = "roi_align"
    family = ""
    key = "roi"
    benefit = 5
    inference_only = True
    training_reason = "fused_roi_align has no backward; refused in mode='training'"
    description = "_contrib_ROIAlign → fused_roi_align (MXNet's sampling, summed over blocks of channels; the same values)"

    def pattern(self) -> Pattern:
        return op("_contrib_ROIAlign")(Var("data"), Var("rois"), name="roi")

    def check(self, m: Match) -> Optional[str]:
        roi = m.node("roi")
        if m.ctx.device != "cpu":
            return "fused_roi_align has no %s implementation" % m.ctx.device
        if roi.param("position_sensitive", False):
            return "ROIAlign '%s' is position-sensitive" % roi.name
        reason = float32_reason([m["data"], m["rois"]], m.ctx)
        if reason:
            return reason
        unknown = sorted(k for k in roi.attrs if k not in ATTRS + ("position_sensitive",) and not k.startswith("__"))
        if unknown:
            return "ROIAlign '%s' has attributes this rule does not know: %s" % (roi.name, ", ".join(unknown))
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        roi = m.node("roi")
        attrs = {k: roi.attrs[k] for k in ATTRS if k in roi.attrs}
        return b.op("fused_roi_align", [m["data"], m["rois"]], attrs=attrs, name=roi.name)


RULES: List[Rule] = [RoIAlign()]
