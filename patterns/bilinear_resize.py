r"""MXNet's bilinear resize → ``fused_bilinear_resize``: the same results, on every core, vectorized.

Matched::

    x (N, C, H, W) float32      [like (…, OH, OW, …)]      (mode='like' only: read for its shape)
        _contrib_BilinearResize2D(mode, height, width, scale_height, scale_width, align_corners)

Rewrite: ``fused_bilinear_resize(x, [like])`` with the node's own attributes, computing what MXNet
1.9.1 computes, bit for bit (cuda_kernels/fused_bilinear_resize/README.md).  Per output element,
with the source row ``j`` (``j'``: the next one, or ``j`` itself at the last row) and the column
``k`` (``k'``) and their weights as MXNet derives them from the coordinate::

    y = h0 · (w0 · x[j, k] + w1 · x[j, k']) + h1 · (w0 · x[j', k] + w1 · x[j', k'])

    coordinate = align_corners ? (in − 1)/(out − 1) · i : max(0, in/out · (i + ½) − ½)

each product and sum rounded on its own.  MXNet 1.9.1 runs the formula element by element with
the channels innermost (a strided walk over the planes); the fused op computes each bracket once
per input row and output column and each output row as one vector loop: GluonCV's PSPNet and
DeepLab heads spend 13–14 % of their run in MXNet's loop (benchmarks/bench_resize.py).

The output's height and width follow the mode (``size``, ``odd_scale``, ``like``, ``to_even_down``,
``to_even_up``, ``to_odd_down``, ``to_odd_up``) as MXNet's shape inference computes them, int16
arithmetic included; the fused op computes them the same way at any input shape, and the check
compares that with MXNet's own inference at the given shapes.

Refused: values other than float32, an unknown input shape (or unknown ``like`` shape), data
that is not 4-D (N, C, H, W) (MXNet's op needs it), attributes MXNet fails on (``scale_height``
without ``scale_width``; ``odd_scale`` without both scales), an output MXNet infers of another
shape than the fused op would (should not happen) or with a side below 1, ``mode='training'``
(no backward), and the GPU (no CUDA kernel: the op library's capabilities say so).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from fusion.ir.graph import Entry, Node
from fusion.ir.matcher import Match
from fusion.ir.pattern import Pattern, Var, op
from fusion.engine.reasons import NeedsShapes
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from ._dtypes import float32_reason

OP = "_contrib_BilinearResize2D"
MODES = ("size", "odd_scale", "like", "to_even_down", "to_even_up", "to_odd_down", "to_odd_up")


def _int16(v: int) -> int:
    """A C++ int assigned to int16_t (two's complement wrap, as GCC does)."""
    return (v + 32768) % 65536 - 32768


def _trunc(v: np.float32) -> Optional[int]:
    """float → int as C++ truncates it; None where that is undefined (not finite, past int32)."""
    if not np.isfinite(v) or abs(float(v)) >= 2.0 ** 31:
        return None
    return int(v)


def _scale(node: Node, key: str) -> Optional[np.float32]:
    v = node.param(key, None)
    return None if v is None else np.float32(v)


def attrs_reason(node: Node) -> Optional[str]:
    """Why MXNet's shape inference fails on ``node``'s attributes whatever the input (None: it does not)."""
    mode = node.param("mode", "size")
    sh, sw = _scale(node, "scale_height"), _scale(node, "scale_width")
    if mode == "size" and sh is not None and sw is None:
        return "sets scale_height without scale_width (MXNet's shape inference fails on it)"
    if mode == "odd_scale" and (sh is None or sw is None):
        return "is in mode odd_scale without scale_height and scale_width (MXNet's shape inference fails on it)"
    return None


def output_hw(node: Node, h: int, w: int, like: Optional[tuple]) -> Tuple[Optional[Tuple[int, int]], str]:
    """(OH, OW) of ``node`` at input height ``h`` and width ``w`` as MXNet 1.9.1's
    BilinearSampleOpInferShape computes them (int16 sizes, float scales), or (None, why not)."""
    mode = node.param("mode", "size")
    sh, sw = _scale(node, "scale_height"), _scale(node, "scale_width")
    if mode == "size":
        if sh is None:      # MXNet reads scale_width only with scale_height
            return (int(node.param("height", 1)), int(node.param("width", 1))), ""
        if sw is None:
            return None, attrs_reason(node)
        oh, ow = _trunc(sh * np.float32(h)), _trunc(sw * np.float32(w))
        if oh is None or ow is None:
            return None, "has an output size past int32"
        return (_int16(oh), _int16(ow)), ""
    if mode == "odd_scale":
        if sh is None or sw is None:
            return None, attrs_reason(node)
        sizes = []
        for n, s in ((h, sh), (w, sw)):
            t = _trunc(s * np.float32(n if n % 2 == 0 else n - 1))
            if t is None:
                return None, "has an output size past int32"
            sizes.append(_int16(t) if n % 2 == 0 else _int16(_int16(t) + 1))
        return (sizes[0], sizes[1]), ""
    if mode == "like":
        return (_int16(int(like[2])), _int16(int(like[3]))), ""
    down, odd = mode.endswith("_down"), mode.startswith("to_odd")
    sizes = [n if (n % 2 == 1) == odd else (n - 1 if down else n + 1) for n in (h, w)]
    return (_int16(sizes[0]), _int16(sizes[1])), ""


class BilinearResize(Rule):
    name = "bilinear_resize"
    key = "resize"
    benefit = 10
    inference_only = True
    training_reason = "fused_bilinear_resize has no backward; refused in mode='training'"
    description = ("_contrib_BilinearResize2D (every mode, align_corners True/False) → fused_bilinear_resize: "
                   "MXNet's results bit for bit, multithreaded and vectorized")

    def pattern(self) -> Pattern:
        return op(OP)(Var("x"), Var("like", optional=True), name="resize")

    def check(self, m: Match) -> Optional[str]:
        r = m.node("resize")
        mode = r.param("mode", "size")
        if mode not in MODES:
            return "BilinearResize2D '%s' has mode %r (known: %s)" % (r.name, mode, ", ".join(MODES))
        if (mode == "like") != m.has("like"):
            return "BilinearResize2D '%s' in mode %r has %d inputs" % (r.name, mode, len(r.inputs))
        why = attrs_reason(r)           # before the shapes: MXNet's inference fails on these
        if why:
            return "BilinearResize2D '%s' %s" % (r.name, why)
        reason = float32_reason([m["x"]], m.ctx)
        if reason:
            return reason
        like = None
        if mode == "like":              # before the data's: an unknown like leaves the whole graph unknown
            like = m.ctx.shape(m["like"])
            if like is None:
                return NeedsShapes("the shape of the like input of BilinearResize2D '%s' is unknown" % r.name)
            if len(like) < 4:
                return "the like input of BilinearResize2D '%s' has shape %s, of rank below 4" % (r.name, like)
        x = m.ctx.shape(m["x"])
        if x is None:
            return NeedsShapes("the input shape of BilinearResize2D '%s' is unknown" % r.name)
        if len(x) != 4:
            return "the input of BilinearResize2D '%s' has shape %s, not 4-D (N, C, H, W)" % (r.name, x)
        hw, why = output_hw(r, x[2], x[3], like)
        if hw is None:
            return "BilinearResize2D '%s' %s" % (r.name, why)
        if min(hw) < 1:
            return "BilinearResize2D '%s' would make a %dx%d output" % (r.name, hw[0], hw[1])
        y = m.ctx.shape(Entry(r))
        if y is None:
            return NeedsShapes("the output shape of BilinearResize2D '%s' is unknown" % r.name)
        if tuple(y) != (x[0], x[1]) + hw:
            return "MXNet infers the output of BilinearResize2D '%s' as %s, the fused op would make %s" % (
                r.name, tuple(y), (x[0], x[1]) + hw)
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        r = m.node("resize")
        inputs = [m["x"]] + ([m["like"]] if m.has("like") else [])
        return b.op("fused_bilinear_resize", inputs, attrs=r.attrs.copy(), name=r.name)


RULES: List[Rule] = [BilinearResize()]
