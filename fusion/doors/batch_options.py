"""The options of batch mode, which the single-model ``mxfuse`` knows too: listed in its ``--help``
and refused with one model (``batch_only_flags``)."""
from __future__ import annotations

import argparse
from typing import Optional

from .argtypes import positive_int


BATCH_HELP = ("Several models, or a folder of them, are fused each in its own process: -o names a folder "
              "(OUTDIR/NAME-symbol.json, OUTDIR/NAME-0000.params), a failing model does not stop the others, and a "
              "summary table ends the run. A model's params are the NAME-XXXX.params of the highest epoch beside it; "
              'a NAME.shapes.json beside it ({"data": [1, 3, 224, 224]}) gives its input shapes in place of --shape. '
              "--params, --report, --html, --to-onnx and --explain are for one model. Ctrl-C stops the batch at once "
              "and names the models written.")


VERBOSE_HELP = ("progress on stderr, each stage with its elapsed seconds (shown anyway when stderr is a terminal); "
                "in batch mode, also the whole output of each failed model")


def add_batch_arguments(p: argparse.ArgumentParser, jobs_type=None) -> None:
    """The options of batch mode (also listed in the single-model ``mxfuse --help``)."""
    if jobs_type is None:
        jobs_type = positive_int
    g = p.add_argument_group("batch mode (several models or a folder)", BATCH_HELP)
    g.add_argument("-j", "--jobs", type=jobs_type, metavar="N", help="models fused at once (default: the number of cores)")
    g.add_argument("--reports", action="store_true", help="also write OUTDIR/NAME-report.json per model")


def batch_only_flags(args: argparse.Namespace) -> Optional[str]:
    """The one-line refusal of batch options given with a single model (None when there are none)."""
    given = [flag for flag, dest in (("-j", "jobs"), ("--reports", "reports"))
             if getattr(args, dest, None) not in (None, False)]
    if not given:
        return None
    return "%s: only for several models or a folder (batch mode)" % ", ".join(given)
