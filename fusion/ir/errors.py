"""Errors raised by mxnet-fusion.  Every message names the problem in one line."""


class FusionError(Exception):
    """Base class of all errors raised by mxnet-fusion."""


class GraphError(FusionError):
    """The Symbol JSON is malformed: unreadable, structurally invalid, or uses an unknown op."""


class ParamsError(FusionError):
    """Parameters do not fit the graph: unknown names, wrong shapes, NaN, negative variance."""


class VerificationError(FusionError):
    """The fused model's outputs differ from the original's beyond tolerance."""
