"""What an input means to the ops that read it, and random values drawn in that meaning.

The per-rewrite self-check (``selfcheck``) and the whole-model check (``fusion.check.verify``)
feed graphs random inputs.  Drawn N(0, 1) everywhere, most would mean nothing to the ops that read
them: a softmax length, an ``Embedding`` index, a ``where`` condition or a mask.  ``input_domain``
reads the domain from the value's readers (looking through ops that pass a value on unchanged in
kind: ``PASS_THROUGH``), ``draw`` draws in it.  A domain is ``("rois", batch, image height, image
width)`` (RoI Align's boxes: a valid batch index, corners in the image), ``("bool",)``, ``("int", lo, hi)``
(both included) or None (any real value).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from ..ir.graph import Node
from ..precision.policy import is_bf16, to_bf16

# Inputs read only for their shape: (op, input slot).
SHAPE_ONLY = frozenset({("_contrib_arange_like", 0), ("ones_like", 0), ("zeros_like", 0), ("shape_array", 0),
                        ("size_array", 0), ("broadcast_like", 1), ("reshape_like", 1), ("slice_like", 1)})
# Ops that pass a value through unchanged in kind (a mask stays a mask, a length a length; trunc and fix
# leave integers as they are: an ONNX Cast to an integer type is imported as trunc).
PASS_THROUGH = frozenset({"Reshape", "reshape", "expand_dims", "squeeze", "Cast", "cast", "amp_cast", "_copy",
                          "trunc", "fix",
                          "identity", "repeat", "tile", "broadcast_to", "broadcast_like", "broadcast_axis",
                          "transpose", "SwapAxis", "slice_axis", "slice", "reshape_like", "Flatten", "flatten"})


def softmax_length_bound(node: Node, shape_of) -> Optional[int]:
    s = shape_of(node.inputs[0])
    return None if s is None else s[node.param("axis", -1)]


def attention_keys(node: Node, shape_of) -> Optional[int]:
    layout = node.param("layout", "plain")
    src = {"plain": (1, -2), "bshd": (1, 1), "packed_qkv": (0, 1), "interleaved": (0, 0),
           "interleaved_encdec": (1, 0)}.get(layout)
    if src is None:
        return None
    s = shape_of(node.inputs[src[0]])
    return None if s is None else s[src[1]]


# comparisons of a value with positions: the value is a length (GluonNLP's masks: j < valid_length)
COMPARISONS = frozenset({"broadcast_lesser", "broadcast_greater", "broadcast_lesser_equal",
                         "broadcast_greater_equal"})


def positions_count(entry, shape_of, depth: int = 0) -> Optional[int]:
    """n where ``entry`` is positions 0 … n−1 (``_contrib_arange_like`` over one axis, through
    pass-through ops), else None."""
    node = entry.node
    if node.op == "_contrib_arange_like":
        s = shape_of(node.inputs[0])
        axis = node.param("axis", None)
        if s is None or axis is None or not -len(s) <= axis < len(s):
            return None
        return int(s[axis])
    if node.op in PASS_THROUGH and node.inputs and depth < 6:
        return positions_count(node.inputs[0], shape_of, depth + 1)
    return None


def slot_domain(node: Node, slot: int, shape_of) -> Optional[Tuple]:
    """How ``node`` reads its input ``slot``: ("bool",), ("int", lo, hi) or None (any real value)."""
    op = node.op
    if op in COMPARISONS and len(node.inputs) == 2:
        n = positions_count(node.inputs[1 - slot], shape_of)
        if n is not None:
            return ("int", 0, n)
    if op == "where" and slot == 0:
        return ("bool",)
    if op in ("softmax", "log_softmax", "masked_softmax") and slot == 1 and node.param("use_length", False):
        n = softmax_length_bound(node, shape_of)
        return None if n is None else ("int", 0, n)
    if op in ("SequenceMask", "SequenceLast", "SequenceReverse") and slot == 1:
        s = shape_of(node.inputs[0])
        return None if s is None else ("int", 1, s[node.param("axis", 0)])
    if op == "Embedding" and slot == 0:
        return ("int", 0, int(node.param("input_dim")) - 1)
    if op == "one_hot" and slot == 0:
        return ("int", 0, int(node.param("depth")) - 1)
    if op in ("take", "pick", "batch_take") and slot == 1:
        s = shape_of(node.inputs[0])
        axis = node.param("axis", 0 if op == "take" else -1)
        return None if s is None or axis is None else ("int", 0, s[axis] - 1)
    if op == "fused_attention" and slot >= 1:
        kind = node.param("mask_kind", "none")
        data = {"plain": 3, "bshd": 3, "packed_qkv": 1, "interleaved": 1,
                "interleaved_encdec": 2}.get(node.param("layout", "plain"), 3)
        if slot == data and kind == "boolean":
            return ("bool",)
        if slot == data and kind == "valid_length":
            n = attention_keys(node, shape_of)
            return None if n is None else ("int", 0, n)
    if op == "fused_elemwise" and "where(x%d," % slot in node.attrs.raw("expr", "").replace(" ", ""):
        return ("bool",)
    if op in ("_contrib_ROIAlign", "fused_roi_align") and slot == 1:
        s = shape_of(node.inputs[0])
        scale = float(node.param("spatial_scale", 1.0) or 1.0)
        return None if s is None or len(s) != 4 else ("rois", s[0], s[2] / scale, s[3] / scale)
    return None


def input_domain(entry_users: List[Tuple[Node, int]], users_of, shape_of, depth: int = 0,
                 domain=None, max_depth: int = 6) -> Optional[Tuple]:
    """The domain the first reader that has one reads the value in, looking through pass-through
    ops; ``domain(node, slot, shape_of)``: another rule tried before ``slot_domain``."""
    for node, slot in entry_users:
        d = (domain and domain(node, slot, shape_of)) or slot_domain(node, slot, shape_of)
        if d is not None:
            return d
        if node.op in PASS_THROUGH and (node.op, slot) not in SHAPE_ONLY and slot == 0 and depth < max_depth:
            d = input_domain(users_of(node), users_of, shape_of, depth + 1, domain, max_depth)
            if d is not None:
                return d
    return None


def draw(rng: np.random.Generator, shape: tuple, dtype, domain: Optional[Tuple]) -> np.ndarray:
    """Random values of ``shape`` in ``domain`` (None: any real), of ``dtype`` (a NumPy dtype, type or
    name; MXNet's bfloat16, named 'bfloat16' or spelled ``policy.BF16``: drawn as float32 and
    rounded to it, as NumPy can neither name it nor cast to it)."""
    if is_bf16(dtype):      # an AMP-converted graph's bfloat16 values
        return to_bf16(draw(rng, shape, "float32", domain))
    dtype = np.dtype(dtype)
    if domain is not None and domain[0] == "rois" and len(shape) == 2 and shape[1] == 5:
        # RoI Align's boxes: [batch index, x1, y1, x2, y2] of the data's batch, in the image the
        # feature map covers (a negative or too large index leaves MXNet's output undefined)
        _, n, h, w = domain
        x = rng.uniform(-0.1 * w, w, (shape[0], 2))
        y = rng.uniform(-0.1 * h, h, (shape[0], 2))
        boxes = np.stack([x.min(1), y.min(1), x.max(1), y.max(1)], 1)
        return np.concatenate([rng.integers(0, max(1, int(n)), (shape[0], 1)), boxes], 1).astype(dtype)
    if domain is not None and domain[0] == "bool":
        return rng.integers(0, 2, shape).astype(dtype)
    if domain is not None and domain[0] == "int":
        lo, hi = domain[1], max(domain[1], domain[2])
        return rng.integers(lo, hi + 1, shape).astype(dtype)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 4, shape).astype(dtype)
    if dtype == np.float32:
        return rng.standard_normal(shape, dtype=np.float32)
    return rng.standard_normal(shape).astype(dtype)
