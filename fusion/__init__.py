"""mxnet-fusion: operator fusion for Apache MXNet 1.9 models.

    import fusion
    result = fusion.fuse(sym, arg_params, aux_params)      # -> FusionResult
    print(result.report)
    fusion.verify((sym, arg_params, aux_params), result, input_shapes={"data": (1, 3, 224, 224)})

    net.hybridize(backend="fusion")                        # Gluon: fused on the first call

Importing ``fusion`` sets ``OMP_NUM_THREADS`` (to the core count) and
``MXNET_CPU_PARALLEL_SIZE`` when they are unset and mxnet is not imported
yet: MXNet 1.9.1 otherwise runs on half the cores and slows down 1.3–4×
after the first large NumPy conversion; and ``MXNET_CPU_TEMP_COPY`` to 1: MXNet
otherwise keeps up to four copies of its largest temporary workspace once
executors are bound one after another (see ``fusion/native/env.py``).
"""
from .native import env as _env

_env.configure_memory()
_env.configure_threads()

from .api import FusionResult, fuse, unfuse  # noqa: E402
from .doors.backend import BACKEND, install as _install_backend  # noqa: E402
from .ir.errors import FusionError, GraphError, ParamsError, VerificationError  # noqa: E402
from .ir.graph import Entry, Graph, Node  # noqa: E402
from .engine.report import FusionReport  # noqa: E402
from .engine.rule import Rule  # noqa: E402
from .rules import install_deprecated_paths as _install_deprecated_paths  # noqa: E402
from .doors.serving import load_library, load_model  # noqa: E402
from .check.verify import VerifyResult, verify  # noqa: E402
from .version import __version__  # noqa: E402

_install_backend()
_install_deprecated_paths()      # rule modules written against fusion.pattern & co. keep loading

from .precision.policy import guard_amp as _guard_amp  # noqa: E402

_guard_amp()


def _load_native_ops() -> None:
    import os
    import sys

    from .native import library as _native

    if sys.argv[:1] == ["-m"] and "fusion.native.build" in getattr(sys, "orig_argv", ["fusion.native.build"]):
        return                     # `python -m fusion.native.build` is what makes the library

    try:
        if os.environ.get("MXFUSION_AUTOBUILD") == "1":   # developers and the test suite: rebuild when stale
            try:
                _native.load()
                return
            except RuntimeError:
                _native.build(cuda=False)
        _native.load()
    except RuntimeError as e:     # missing/stale library or no oneDNN: say how to fix it, in one line
        raise ImportError("mxnet-fusion: %s" % e) from None


_load_native_ops()

__all__ = ["fuse", "unfuse", "load_model", "load_library", "FusionResult", "verify", "VerifyResult", "Graph", "Node", "Entry", "Rule", "BACKEND",
           "FusionReport", "FusionError", "GraphError", "ParamsError", "VerificationError"]
