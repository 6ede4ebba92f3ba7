"""mxnet-fusion: operator fusion for Apache MXNet 1.9 models.

    import fusion
    result = fusion.fuse(sym, arg_params, aux_params)      # -> FusionResult
    print(result.report)
    fusion.verify((sym, arg_params, aux_params), result, {"data": (1, 3, 224, 224)})
"""
from .api import FusionResult, fuse
from .errors import FusionError, GraphError, ParamsError, VerificationError
from .graph import Entry, Graph, Node
from .report import FusionReport
from .rule import Rule
from .verify import VerifyResult, verify

__all__ = ["fuse", "FusionResult", "verify", "VerifyResult", "Graph", "Node", "Entry", "Rule",
           "FusionReport", "FusionError", "GraphError", "ParamsError", "VerificationError"]
__version__ = "0.1.0"
