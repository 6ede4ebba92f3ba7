"""The version of mxnet-fusion, and the versions a report records (``mxfuse --version`` prints them)."""
from __future__ import annotations

import platform
from typing import Dict

__version__ = "0.1.0"


def versions() -> Dict[str, str]:
    import mxnet

    return {"mxnet_fusion": __version__, "mxnet": mxnet.__version__, "python": platform.python_version()}
