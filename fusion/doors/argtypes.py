"""argparse types shared by ``mxfuse`` and its batch mode: a bad value is one line at parsing, exit 2."""
from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (``--repeats 0`` would time nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("'%s' is not a whole number" % text) from None
    if value < 1:
        raise argparse.ArgumentTypeError("'%s' must be at least 1" % text)
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (a NaN tolerance would refuse every model)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("'%s' is not a number" % text) from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError("'%s' must be a finite number above 0" % text)
    return value
