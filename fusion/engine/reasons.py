"""Kinds of refusal reasons a rule's ``check`` may return, besides a plain string.

A reason is a string a user can read.  Two kinds tell the engine and the report more:

* :class:`NearMiss` — the candidate is not the thing the rule fuses at all (a ResNet
  bottleneck seen by the MobileNet block rule: its 3×3 convolution is not depthwise).
  It is listed with the near-misses (``--explain``), not as a rejection: a report of
  a model that has none of these blocks should not list every block it has.
* :class:`NeedsShapes` — the rule would decide from sizes the input shapes give and
  none were given.  The report counts these ("N more rewrites with input shapes").
  Reasons written before this class say "(pass input shapes)"; they count too.
"""
from __future__ import annotations

from typing import Any

SHAPES_HINT = "pass input shapes"


class NearMiss(str):
    """A refusal of something that only looked like a candidate (listed under ``--explain``)."""


class NeedsShapes(str):
    """A refusal that input shapes may lift: the rule needs sizes nothing else tells it."""

    def __new__(cls, text: str) -> "NeedsShapes":
        if SHAPES_HINT not in text:
            text = "%s (%s)" % (text, SHAPES_HINT)
        return super().__new__(cls, text)


def wants_shapes(reason: Any) -> bool:
    """Whether ``reason`` says the rule needs input shapes to decide."""
    return isinstance(reason, NeedsShapes) or (isinstance(reason, str) and SHAPES_HINT in reason)
