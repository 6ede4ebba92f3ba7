"""Shapes a CNN block rule decides from, with or without input shapes.

With input shapes they are the graph's facts at every probe (``Context.shapes``).  Without, a
block's channels still come from its weights, and how its values relate comes from its own ops:
the match's nodes inferred at fillings of the sizes MXNet leaves unknown
(``fusion/engine/localfacts.py``).  Either way a rule asks ``shapes(entry)`` for a value's shape at every
probe or filling.  What a rule cannot decide from its ops (whether an add of two inputs
broadcasts at some sizes) it refuses without input shapes with a ``NeedsShapes`` reason, and so a
relation between values' shapes that fails at the filled-in sizes (``at_filled_sizes``: a gate
reshaped to a batch of 1 fits the user's batch only if it is 1); the report counts them.

Why two fillings suffice: the block rules accept only ops whose output sizes follow from their
inputs' by the op's own arithmetic (global pooling, 1×1 and stride-1 "same" convolutions,
reshapes that copy or split the fixed channel axis); a relation such as "the projection has the
input's plane" holds at two different sizes of at least 7 only where it holds at every size
(a strided convolution shrinks the plane at both).  A size the graph fixes without the weights
(a crop to 7 rows) counts as fixed (``facts.partial_shapes`` sees it equal at its two samples).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

from fusion.ir.graph import Entry
from fusion.engine.localfacts import match_shapes
from fusion.ir.matcher import Match
from fusion.engine.reasons import NearMiss, NeedsShapes

Shapes = Callable[[Entry], Tuple[tuple, ...]]


def block_shapes(m: Match, source: Entry, extra: Sequence[Entry] = ()) -> Tuple[Optional[Shapes], bool]:
    """(shapes, assumed): the graph's facts when ``source``'s shape is known; without input shapes,
    the match's own at filled-in sizes (``assumed``); (None, False) when neither is known."""
    ctx = m.ctx
    if ctx.shapes(source) or ctx.input_shapes:
        return ctx.shapes, False
    local = match_shapes(ctx, m.nodes, extra)
    return (local, True) if local is not None else (None, False)


def nchw_block(m: Match, source: Optional[Entry] = None, extra: Sequence[Entry] = ()
               ) -> Tuple[Optional[str], tuple, Optional[Shapes], bool]:
    """(why not, the block input's shapes, shapes, assumed): the input ``source`` (default ``x``)
    must be (N, C, H, W) with C known."""
    x = m["x"] if source is None else source
    shapes, assumed = block_shapes(m, x, extra)
    xs = shapes(x) if shapes is not None else ()
    if not xs:
        return NeedsShapes("the block's input shape is unknown"), xs, shapes, assumed
    if any(len(s) != 4 for s in xs):
        # a 1-D or 3-D network (NCW, NCDHW) only looks like the 2-D block: --explain lists it
        return NearMiss("the block's input has shape %s, not (N, C, H, W)" % (xs[0],)), xs, shapes, assumed
    return None, xs, shapes, assumed


def at_filled_sizes(reason: str, assumed: bool) -> str:
    """A shape relation that failed: with the sizes filled in (no input shapes) it may hold at the
    user's sizes (a gate reshaped to batch 1 fits a batch of 1 only), so that is for the input
    shapes to say (``NeedsShapes``); with the graph's own shapes it is the reason as it is."""
    return NeedsShapes("%s, at sizes filled in for the unknown ones" % reason) if assumed else reason


def broadcasting_add(op: str) -> bool:
    """Whether an add op broadcasts (its operands' shapes may differ), as broadcast_add does."""
    return op.startswith("broadcast_")


#: Layouts of 1-D and 3-D convolutions and poolings: their networks only look like the 2-D blocks.
OTHER_RANK_LAYOUTS = frozenset({"NCW", "NWC", "NCDHW", "NDHWC"})


def layout_reason(node) -> Optional[str]:
    """Why a block rule does not take ``node`` (a Convolution, Deconvolution or Pooling) for its layout:
    None for NCHW; a near-miss (--explain) for a 1-D or 3-D layout, a look-alike; else the reason."""
    layout = node.param("layout", None)
    if layout in (None, "NCHW"):
        return None
    text = "%s '%s' has layout %s (only NCHW)" % (node.op, node.name, layout)
    return NearMiss(text) if layout in OTHER_RANK_LAYOUTS else text


def not_2d(node) -> NearMiss:
    """A 1-D or 3-D Convolution/Deconvolution/Pooling seen by a 2-D block rule: a look-alike."""
    return NearMiss("%s '%s' is not 2-D" % (node.op, node.name))
