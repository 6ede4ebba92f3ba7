"""``mxfuse``, the command: one model is a run of :mod:`fusion.doors.cli`; several models or a
folder, a batch (:mod:`fusion.doors.batch`), which runs ``cli`` once per model in a worker process.

    mxfuse MODEL-symbol.json [--params MODEL-0000.params] -o OUT_PREFIX [...]   (see fusion/doors/cli.py)
    mxfuse MODEL_OR_DIR... -o OUTDIR [-j N] [--reports]                          (see fusion/doors/batch.py)
"""
from __future__ import annotations

import sys
from typing import List, Optional

from . import cli
from .batch import is_batch, main_batch


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if is_batch(argv):          # several inputs, or a directory: one process per model
        return main_batch(argv)
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
