r"""``pad_into_conv``: a zero ``Pad`` read by a ``Convolution`` becomes the convolution's own padding.

Xception (GluonCV's ``fixed_padding``), TensorFlow- and PyTorch-exported graphs and ONNX imports
write "same" padding as an explicit ``Pad`` before a convolution that pads nothing::

    y = Convolution(Pad(x, mode='constant', constant_value=0, pad_width=(0,0, 0,0, t,b, l,r)), W [, b],
                    pad=(p, q))
      →
    y = Convolution(x, W [, b], pad=(p + t, q + l))                      (t == b, l == r)

Exact: a convolution pads its input with zeros on both sides of each spatial axis before
applying the kernel, whatever its stride, dilation or groups; the explicit zeros are the same
zeros (in value and gradient: the rule holds in training).  The padded tensor is no longer
materialized, and, where MXNet keeps the convolutions in oneDNN's blocked layouts, no op between
two convolutions has to take that layout back to NCHW; a region (``patterns/region.py``), which does not
take ``Pad``, is no longer cut at each one (Xception: 64 regions of 2-3 convolutions → one).

Decided from the attributes: ``mode='constant'`` with ``constant_value`` 0, nothing padded on
the batch and channel axes, the same amount before and after on each spatial axis (MXNet's
``Convolution`` pads symmetrically: a ``Pad`` of (0, 1), which a stride-2 "same" convolution of
an even input writes, stays), a convolution of as many spatial axes as the ``Pad`` pads (2-D
NCHW, 3-D NCDHW) in the NC… layout, and the ``Pad``'s value read by the convolution as its data
only (another reader keeps the ``Pad``: then the rule does not apply).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.ir.pattern import Pattern, Var, op
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

#: The layouts of a convolution whose spatial axes follow the batch and channel axes.
_NC_LAYOUTS = (None, "", "NCW", "NCHW", "NCDHW")


def _ints(v) -> Tuple[int, ...]:
    return tuple(int(i) for i in (v or ()))


def spatial_padding(pad_width: Tuple[int, ...]) -> Optional[Tuple[int, ...]]:
    """The per-axis amount of a ``Pad``'s ``pad_width`` over axes 2… where it pads nothing on
    the batch and channel axes and the same before and after on each spatial axis; else None."""
    if len(pad_width) < 6 or len(pad_width) % 2 or any(pad_width[:4]):
        return None
    pairs = [(pad_width[i], pad_width[i + 1]) for i in range(4, len(pad_width), 2)]
    if any(a != b or a < 0 for a, b in pairs):
        return None
    return tuple(a for a, _ in pairs)


class PadIntoConv(Rule):
    name = "pad_into_conv"
    benefit = 195       # first among the clean-ups' peers: the rules after it see plain convolutions
    key = "pad"
    description = "Pad(constant 0, symmetric) → Convolution: the padding becomes the convolution's own"

    def pattern(self) -> Pattern:
        return op.Convolution(op.Pad(Var("x"), name="pad"), Var("w"), Var("b", optional=True), name="conv")

    def check(self, m: Match) -> Optional[str]:
        pad, conv = m.node("pad"), m.node("conv")
        mode = str(pad.param("mode", "constant"))
        if mode != "constant":
            return "Pad '%s' pads in mode '%s', not with a constant" % (pad.name, mode)
        value = float(pad.param("constant_value", 0.0))
        if value != 0.0:
            return "Pad '%s' pads with %g, not 0 (a convolution pads with zeros)" % (pad.name, value)
        width = _ints(pad.param("pad_width", ()))
        if len(width) >= 4 and any(width[:4]):
            return "Pad '%s' pads the batch or channel axis (pad_width %s)" % (pad.name, width)
        amounts = spatial_padding(width)
        if amounts is None:
            return ("Pad '%s' pads its spatial axes unevenly (pad_width %s): MXNet's Convolution pads the "
                    "same amount on both sides" % (pad.name, width))
        kernel = _ints(conv.param("kernel"))
        if len(kernel) != len(amounts):
            return "Pad '%s' pads %d spatial axes, Convolution '%s' convolves %d" % (
                pad.name, len(amounts), conv.name, len(kernel))
        layout = conv.param("layout", None)
        if layout not in _NC_LAYOUTS:
            return "Convolution '%s' has layout %s, not channels first" % (conv.name, layout)
        return None

    def rewrite(self, m: Match, b: Builder) -> Entry:
        pad, conv = m.node("pad"), m.node("conv")
        amounts = spatial_padding(_ints(pad.param("pad_width")))
        own = _ints(conv.param("pad")) or (0,) * len(amounts)
        attrs = dict(conv.attrs)
        attrs["pad"] = tuple(p + a for p, a in zip(own, amounts))
        inputs = [m["x"], m["w"]] + ([m["b"]] if m.has("b") else [])
        return b.op("Convolution", inputs, attrs=attrs, name=conv.name)


RULES: List[Rule] = [PadIntoConv()]
