r"""Conv-BN family: fold an inference BatchNorm into the convolution (or dense layer) before it.

Matched subgraphs (anchor at the bottom)::

    x   W  [b]                    x   W  [b]
     \  |  /                       \  |  /
    Convolution | Deconvolution    FullyConnected
         |                              |
     BatchNorm(γ, β, μ, σ²)         BatchNorm
         |                              |
    [Activation | LeakyReLU | clip]    (dense_bn)
         |
    [add(·, residual)  →  [activation]]

Rewrite (exact in real arithmetic; computed in float64, stored in the weight's dtype)::

    s  = γ / √(σ² + ε)          (γ := 1 when fix_gamma, MXNet's default)
    W' = W · s                  scaled along the output channel
    b' = (b − μ) · s + β        (b := 0 when no_bias)

The convolution keeps its name and attributes, gets ``no_bias=False`` and the
new parameters ``<conv>_folded_weight``/``<conv>_folded_bias`` (new names:
a Gluon block takes any parameter it does not own from the dict it passed
in).  The activation / residual tail is emitted unchanged after it — the
folded convolution is what MXNet's own oneDNN backend then fuses with it.

* ``Convolution`` weights are (O, I/g, k…): output channel on axis 0.
* ``Deconvolution`` weights are (I, O/g, k…): output channel ``o = (i // (I/g))·(O/g) + j``.
* The BatchNorm must normalize the channel axis of the op's layout (axis 1 for
  NC…, the last for N…C; the last axis after FullyConnected); otherwise the
  scale does not line up with output channels and the match is rejected.
* At inference BatchNorm uses its moving statistics whatever ``use_global_stats``
  says, so folding is exact there; in training it is not, and is refused.
* On the CPU a BatchNorm after a ``Deconvolution`` without a bias is folded only where the
  CPU's cost table (``fusion/engine/cost.py``) says it pays: the fold adds a bias, which MXNet 1.9.1's
  default bind adds in a pass of its own after oneDNN's deconvolution (GluonCV's simple-pose head
  measured 0.91× with it folded).  Without a table it stays, with the reason in the report.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from fusion.ir.graph import Entry, Node
from fusion.ir.matcher import Match
from fusion.ir.pattern import Const, OneOf, Pattern, Var, op
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from ._dtypes import not_float32

ACTIVATIONS = ("relu", "sigmoid", "tanh", "softrelu")
#: How the report counts a fold MXNet's own default bind makes too (``Builder.same_as_bind``).
SAME_AS_BIND = "BatchNorm fold(s) into convolutions, which MXNet's oneDNN backend makes at bind too"
_BN_INPUTS = ("gamma", "beta", "mean", "var")


def _activation(x: Pattern, name: str) -> Pattern:
    return (op.Activation(x, act_type=OneOf(*ACTIVATIONS), name=name)
            | op.LeakyReLU(x, name=name)
            | op.clip(x, name=name))


def _batchnorm(x: Pattern) -> Pattern:
    return op.BatchNorm(x, *(Const(n) for n in _BN_INPUTS), name="bn")


def conv_bn_pattern(with_act: bool, with_add: bool, producer: str = "conv") -> Pattern:
    """Conv/Deconv → BN [→ act] [→ add(·, residual) [→ act]], or FullyConnected → BN."""
    ops = ("FullyConnected",) if producer == "dense" else ("Convolution", "Deconvolution")
    y: Pattern = _batchnorm(op(*ops)(Var("x"), Const("w"), Const("b", optional=True), name="conv"))
    if with_act and not with_add:
        return _activation(y, "act")
    if with_add:
        y = y.optional(lambda v: _activation(v, "act"))
        y = op.add(y, Var("residual"), name="add")
        y = y.optional(lambda v: _activation(v, "act2"))
    return y


def _channel_axis(conv: Node) -> Optional[int]:
    """Output-channel axis of the producer's result, as a non-negative index (None: last axis, rank unknown)."""
    if conv.op == "FullyConnected":
        return 1 if conv.param("flatten") else None
    layout = conv.param("layout") or ""
    return layout.index("C") if "C" in str(layout) else 1


def _rank(conv: Node) -> Optional[int]:
    if conv.op == "FullyConnected":
        return 2 if conv.param("flatten") else None
    return len(conv.param("kernel")) + 2


class ConvBN(Rule):
    family = "conv_bn_act"
    key = "bn"
    inference_only = True
    training_reason = ("BatchNorm folding uses the moving statistics, which training updates; "
                       "refused in mode='training'")

    def __init__(self, name: str, benefit: int, with_act: bool = False, with_add: bool = False,
                 producer: str = "conv"):
        self.name, self.benefit = name, benefit
        self.with_act, self.with_add, self.producer = with_act, with_add, producer
        what = "FullyConnected" if producer == "dense" else "Convolution/Deconvolution"
        tail = (" → activation" if with_act else "") + (" [→ act] → residual add [→ act]" if with_add else "")
        self.description = "fold BatchNorm into the %s before it%s" % (what, tail)

    def pattern(self) -> Pattern:
        return conv_bn_pattern(self.with_act, self.with_add, self.producer)

    # -- check -----------------------------------------------------------------
    def check(self, m: Match) -> Optional[str]:
        conv, bn = m.node("conv"), m.node("bn")
        reason = self._axis_reason(conv, bn)
        if reason:
            return reason
        if conv.op == "Deconvolution" and conv.param("layout") not in (None, "NCW", "NCHW", "NCDHW"):
            return "Deconvolution layout %s is not supported for folding (only NC…)" % conv.param("layout")
        for e in (m["w"], Entry(conv)):
            if not_float32(e, m.ctx):   # e.g. an AMP graph's bfloat16 convolution
                return ("'%s' is not float32: BatchNorm folding writes float32 weights" % e.node.name)
        if not m.ctx.has_params:
            return "BatchNorm folding needs the parameter values (no arg_params/aux_params were given)"
        for name in ("w",) + (("b",) if m.has("b") else ()) + _BN_INPUTS:
            if name == "gamma" and bn.param("fix_gamma"):
                continue
            if m.value(name) is None:
                return ("BatchNorm folding needs the value of '%s', which is not among the given params"
                        % m.node(name).name)
        var = m.value("var")
        if not np.all(np.isfinite(var)):
            return "moving variance '%s' contains NaN or inf" % m.node("var").name
        if np.any(var + bn.param("eps") <= 0):
            return "moving variance '%s' + eps is not positive" % m.node("var").name
        channels = self._out_channels(conv, m.value("w"))
        for name in _BN_INPUTS:
            v = m.value(name)
            if v is not None and v.size != channels:
                return ("'%s' has %d entries but %s '%s' has %d output channels"
                        % (m.node(name).name, v.size, conv.op, conv.name, channels))
        return self._deconv_bias_cost_reason(m)

    @staticmethod
    def _deconv_bias_cost_reason(m: Match) -> Optional[str]:
        """Why a BatchNorm stays after a Deconvolution without a bias on the CPU (None: fold it).

        Folding gives the Deconvolution a bias, and MXNet 1.9.1's default bind runs a
        Deconvolution's bias outside oneDNN's kernel (a separate pass over the output), while
        the BatchNorm it replaces runs in oneDNN's layout: measured slower (GluonCV's simple-pose
        head, 0.91x).  Decided by this CPU's cost table (``fusion/engine/cost.py``)."""
        conv = m.node("conv")
        if conv.op != "Deconvolution" or m.has("b") and not conv.param("no_bias") or m.ctx.device != "cpu":
            return None
        from fusion.engine import cost

        case = {"conv": "Deconvolution", "adds_slow_path": True,
                "act": m.node("act").attrs.get("act_type", m.node("act").op) if m.has("act") else "none"}
        out = m.ctx.shape(Entry(conv))
        if out is not None and len(out) >= 3:
            case["c_out"], case["out_pixels"] = int(out[1]), int(np.prod(out[2:]))
        decision = cost.decide("bn_folding", "float32", "forward", case, kind="cpu")
        if decision.fuse:
            return None
        return ("BatchNorm '%s' stays after Deconvolution '%s': folding would give it a bias, which MXNet's "
                "default bind adds outside oneDNN's kernel; %s" % (m.node("bn").name, conv.name, decision.reason))

    @staticmethod
    def _axis_reason(conv: Node, bn: Node) -> Optional[str]:
        axis, rank, channel = bn.param("axis"), _rank(conv), _channel_axis(conv)
        if channel is None:   # FullyConnected(flatten=False): channel is the last axis, rank unknown
            return None if axis == -1 else (
                "BatchNorm axis=%d after FullyConnected(flatten=False): only axis=-1 is the output-feature axis"
                % axis)
        if axis == channel or (rank is not None and axis == channel - rank):
            return None
        return ("BatchNorm axis=%d is not the channel axis (%d) of %s '%s'; folding needs per-output-channel scaling"
                % (axis, channel, conv.op, conv.name))

    @staticmethod
    def _out_channels(conv: Node, w: np.ndarray) -> int:
        if conv.op == "Deconvolution":
            return w.shape[1] * conv.param("num_group")
        return w.shape[0]

    # -- rewrite ---------------------------------------------------------------
    def rewrite(self, m: Match, b: Builder) -> Entry:
        conv, bn = m.node("conv"), m.node("bn")
        w = m.value("w").astype(np.float64)
        channels = self._out_channels(conv, w)
        gamma = np.ones(channels) if bn.param("fix_gamma") else m.value("gamma").astype(np.float64).ravel()
        scale = gamma / np.sqrt(m.value("var").astype(np.float64).ravel() + bn.param("eps"))
        bias = m.value("b").astype(np.float64).ravel() if m.has("b") else np.zeros(channels)
        new_bias = (bias - m.value("mean").astype(np.float64).ravel()) * scale + m.value("beta").astype(np.float64).ravel()
        if conv.op == "Deconvolution":
            g = conv.param("num_group")
            shaped = w.reshape((g, w.shape[0] // g) + w.shape[1:])
            new_w = (shaped * scale.reshape((g, 1, w.shape[1]) + (1,) * (w.ndim - 2))).reshape(w.shape)
        else:
            new_w = w * scale.reshape((-1,) + (1,) * (w.ndim - 1))
        dtype = m.value("w").dtype
        attrs = conv.attrs.copy()
        attrs["no_bias"] = False
        y = b.op(conv.op, [m["x"], b.param(conv.name + "_folded_weight", new_w.astype(dtype)),
                           b.param(conv.name + "_folded_bias", new_bias.astype(dtype))],
                 attrs=attrs, name=conv.name)
        if conv.op == "Convolution" and m.ctx.device == "cpu" and len(conv.param("kernel")) == 2 \
                and conv.param("layout") in (None, "NCHW"):
            # MXNet's oneDNN subgraph backend folds BatchNorm into a 2-D convolution at bind itself
            # (conv → BN [→ act] [→ sum]); not a Deconvolution's, a FullyConnected's, nor on the GPU
            b.same_as_bind = SAME_AS_BIND
        return self._emit_tail(m, b, y, bn)

    @staticmethod
    def _emit_tail(m: Match, b: Builder, y: Entry, bn: Node) -> Entry:
        """Re-emit the matched activation/residual tail unchanged on top of the folded op."""
        prev = Entry(bn)
        for name in ("act", "add", "act2"):
            if not m.has(name):
                continue
            node = m.node(name)
            inputs = [y if e == prev else e for e in node.inputs]
            prev, y = Entry(node), b.op(node.op, inputs, attrs=node.attrs, name=node.name)
        return y


RULES: List[Rule] = [
    ConvBN("conv_bn_add_act", 40, with_add=True),
    ConvBN("conv_bn_act", 30, with_act=True),
    ConvBN("conv_bn", 20),
    ConvBN("dense_bn", 85, producer="dense"),     # before dense_act turns the FullyConnected into fused_dense
]
