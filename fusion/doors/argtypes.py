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


def memory_size(text: str) -> str:
    """An argparse type: a size such as 4G or 500M (``--max-memory``), checked here, kept as written
    (the report and errors quote it)."""
    from ..engine.memory import parse_size
    from ..ir.errors import FusionError

    try:
        parse_size(text, "")
    except FusionError:
        raise argparse.ArgumentTypeError("'%s' is not a size such as 4G or 500M (K, M, G, T: powers of 1024; "
                                         "at least one byte)" % text) from None
    return text.strip()
