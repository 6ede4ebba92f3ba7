"""The grammar, one module per rule family (see each module's docstring for its productions).

``FAMILIES`` maps a family name to (build function, weight in a mixed run).  A build
function takes a :class:`~tools.fuzz.case.Builder` and returns the graph's outputs.
"""
from . import (attention, blocks, conv, dense, dense_block, dense_concat, detection, elemwise, inverted_residual, norm,
               params, resize, se, split_attention)

FAMILIES = {
    "conv": (conv.build, 3),
    "dense": (dense.build, 3),
    "attention": (attention.build, 7),
    "norm": (norm.build, 3),
    "elemwise": (elemwise.build, 4),
    "params": (params.build, 2),
    "blocks": (blocks.build, 3),
    "se": (se.build, 3),
    "dense_concat": (dense_concat.build, 2),
    "split_attention": (split_attention.build, 2),
    "inverted_residual": (inverted_residual.build, 2),
    "dense_block": (dense_block.build, 4),
    "detection": (detection.build, 2),
    "resize": (resize.build, 2),
}
