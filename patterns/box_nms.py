r"""Non-maximum suppression: ``_contrib_box_nms`` → ``fused_box_nms``, the same output without sorting every box.

Matched::

    x (…, N, W)     rows [id?, score, 4 coordinates, …] as the attributes place them
    _contrib_box_nms(overlap_thresh, valid_thresh, topk, coord_start, score_index, id_index,
                     background_id, force_suppress, in_format, out_format)

Rewrite: ``fused_box_nms(x)`` with the same attributes.  MXNet 1.9.1 stable-sorts every valid
row (a detection head hands it each anchor × class: YOLOv3 on COCO 851,760 rows) and launches
one parallel kernel per reference box (Faster R-CNN's proposals: 6,000 launches); the library op
keeps the best ``topk`` rows of each batch in bounded heaps, in the stable sort's order (score
descending, then row), and suppresses greedily with MXNet's own area and IoU arithmetic, so the
output is the same, bit for bit (``tests/test_box_nms.py`` compares it with MXNet's over random
boxes with tied scores, NaN, both formats, classes and every attribute), and so is the hidden
second output (each kept row's input position), which the library op also returns.

Refused: values other than float32, a device without the op, and ``mode='training'`` (the
library op has no backward).
"""
from __future__ import annotations

from typing import Dict, List, Optional

from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.ir.pattern import Pattern, Var, op
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from ._dtypes import float32_reason

#: The attributes of ``_contrib_box_nms`` (MXNet 1.9.1's BoxNMSParam), all carried over.
ATTRS = ("overlap_thresh", "valid_thresh", "topk", "coord_start", "score_index", "id_index", "background_id",
         "force_suppress", "in_format", "out_format")
OPS = ("_contrib_box_nms", "_contrib_box_non_maximum_suppression")


class BoxNMS(Rule):
    name = "box_nms"
    family = ""
    key = "nms"
    benefit = 5
    inference_only = True
    training_reason = "fused_box_nms has no backward (MXNet's copies gradients to the kept rows); refused in mode='training'"
    description = "_contrib_box_nms → fused_box_nms (top-k per batch instead of a full sort; the same output)"

    def pattern(self) -> Pattern:
        x = Var("x")
        alts = [op(name)(x, name="nms") for name in OPS]
        return alts[0] | alts[1]

    def check(self, m: Match) -> Optional[str]:
        nms = m.node("nms")
        if m.ctx.device != "cpu":
            return "fused_box_nms has no %s implementation" % m.ctx.device
        reason = float32_reason([m["x"]], m.ctx)
        if reason:
            return reason
        unknown = sorted(k for k in nms.attrs if k not in ATTRS and not k.startswith("__"))
        if unknown:
            return "%s '%s' has attributes this rule does not know: %s" % (nms.op, nms.name, ", ".join(unknown))
        return None

    def rewrite(self, m: Match, b: Builder) -> Dict[Entry, Entry]:
        nms = m.node("nms")
        attrs = {k: nms.attrs[k] for k in ATTRS if k in nms.attrs}
        out, kept = b.op("fused_box_nms", [m["x"]], attrs=attrs, name=nms.name, num_outputs=2)
        return {Entry(nms, 0): out, Entry(nms, 1): kept}


RULES: List[Rule] = [BoxNMS()]
