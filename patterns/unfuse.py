r"""Un-fusing: every ``fused_*`` op back into stock MXNet ops (``fusion.unfuse``, ``mxfuse --unfuse``).

A fused model then loads where mxnet-fusion is not installed.  Parameter
transforms stay applied (folded convolutions remain folded); parameters keep
their names, so the fused model's params file goes with the un-fused symbol.

=========================  ==========================================================
fused op                   stock ops
=========================  ==========================================================
fused_dense                FullyConnected [→ Activation | LeakyReLU | tanh-GELU ops]
fused_add_layer_norm       broadcast_add → LayerNorm (the sum is the 2nd output)
fused_se                   [hard-swish ops] → Pooling(global avg) → Convolution 1×1 | FullyConnected → act
                           → Convolution 1×1 | FullyConnected → gate ops [→ Reshape] → broadcast_mul
                           [→ elemwise_add → relu]
fused_split_attention      [expand_dims → Reshape → sum] → Pooling(global avg) → Convolution 1×1 → act
                           → Convolution 1×1 → Reshape → SwapAxis → softmax | sigmoid → Reshape
                           → broadcast_mul [→ sum]
fused_grouped_conv         Convolution [→ Activation(relu)]
fused_deconv               Deconvolution [→ Activation(relu)]
fused_inverted_residual               [Convolution 1×1 → act] → Convolution depthwise → act [→ the SE's stock ops]
                           → Convolution 1×1 [→ elemwise_add]   (act: Activation(relu) | hard-swish ops)
fused_dense_block          per layer: broadcast_mul → broadcast_add → Activation(relu) → Convolution 1×1
                           → Activation(relu) → Convolution 3×3 → Concat(dim=1)
fused_concat_scale_act     Concat(dim=1) → broadcast_mul(scale) → broadcast_add(shift) [→ Activation(relu) | relu]
fused_box_nms              _contrib_box_nms (the same attributes)
fused_max_pool             Pooling(pool_type='max', the same kernel, stride, pad, convention)
fused_roi_align            _contrib_ROIAlign (the same attributes)
fused_bilinear_resize      _contrib_BilinearResize2D (the same attributes and inputs)
fused_elemwise             the program's ops (broadcast_*, scalar ops, where on broadcast_like'd operands)
fused_region               its program's ops: Convolution, Pooling, Concat, BatchNorm, elemwise_add, broadcast_mul,
                           Activation / LeakyReLU / clip / hard_sigmoid / scalar ops (patterns/unfuse_region.py)
fused_attention            head split (Reshape/transpose/slice_axis) → batch_dot(q, k, transpose_b) ·scale
                           [+ mask | where] → softmax [use_length] → batch_dot(·, v) → head merge
=========================  ==========================================================
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.engine.rewrite import Builder
from fusion.engine.rule import Rule

from ._unfuse_base import UnfuseRule
from ._unfuse_ops import activation, is_bf16_value
from .unfuse_elemwise import ElemwiseProgram, UnfuseElemwise
from .unfuse_attention import UnfuseAttention
from .unfuse_cnn import UnfuseDeconv, UnfuseDenseBlock, UnfuseGroupedConv, UnfuseInvertedResidual, UnfuseSplitAttention
from .unfuse_region import UnfuseRegion


# ---------------------------------------------------------------- fused_dense

def _is_bf16_weight(m: Match, w: Entry) -> bool:
    from fusion.precision.policy import BF16_CODE, is_bf16
    if m.ctx.dtype(w) == "bfloat16":
        return True
    value = m.ctx.value(w)
    if value is not None:
        return is_bf16(value.dtype)
    return w.node.is_variable and str(w.node.attrs.get("__dtype__")) == str(BF16_CODE)


class UnfuseDense(UnfuseRule):
    def __init__(self):
        super().__init__("fused_dense", 3)

    def rewrite(self, m: Match, b: Builder) -> Entry:
        f = m.node("f")
        ins = self.inputs(m)
        no_bias = bool(f.param("no_bias", False))
        attrs = {"num_hidden": int(f.attrs["num_hidden"]), "flatten": bool(f.param("flatten", True)),
                 "no_bias": no_bias}
        if is_bf16_value(m, ins[0]):   # data held in bfloat16 (widened exactly)
            ins = [b.op("amp_cast", [ins[0]], attrs={"dtype": "float32"}, name=f.name + "_data_fp32")] + ins[1:]
        if _is_bf16_weight(m, ins[1]):   # precision="bf16": FullyConnected takes it widened back to float32
            ins = [ins[0], b.op("amp_cast", [ins[1]], attrs={"dtype": "float32"}, name=f.name + "_weight_fp32")] + ins[2:]
        if str(f.attrs.raw("out_dtype", "float32")) == "bfloat16":
            # written rounded to bfloat16 for readers that round it anyway: so do the stock ops
            y = activation(b, b.op("FullyConnected", ins[:2] if no_bias else ins[:3], attrs=attrs,
                                    name=f.name + "_fc"), f.attrs.get("act", "none"),
                            float(f.param("slope", 0.25)), f.name + "_act")
            return b.op("amp_cast", [y], attrs={"dtype": "bfloat16"}, name=f.name)
        fc = b.op("FullyConnected", ins[:2] if no_bias else ins[:3], attrs=attrs, name=f.name + "_fc")
        return activation(b, fc, f.attrs.get("act", "none"), float(f.param("slope", 0.25)), f.name)


# ---------------------------------------------------------------- fused_add_layer_norm

class UnfuseAddLayerNorm(UnfuseRule):
    def __init__(self):
        super().__init__("fused_add_layer_norm", 4)

    def rewrite(self, m: Match, b: Builder):
        f = m.node("f")
        a, bb, g, be = self.inputs(m)
        s = b.op("broadcast_add", [a, bb], name=f.name + "_sum")
        y = b.op("LayerNorm", [s, g, be], attrs={"axis": -1, "eps": float(f.param("eps", 1e-5))}, name=f.name)
        outs = {Entry(f, 0): y}
        if f.param("output_sum", False):
            outs[Entry(f, 1)] = s
        if f.param("bf16_copy", False):          # y rounded to bfloat16 (precision.BF16_COPIES)
            outs[Entry(f, len(outs))] = b.op("amp_cast", [y], attrs={"dtype": "bfloat16"}, name=f.name + "_bf16")
        return outs if len(outs) > 1 else y


# ---------------------------------------------------------------- fused_se

class UnfuseSE(UnfuseRule):
    def __init__(self):
        super().__init__("fused_se", 6)

    @staticmethod
    def _layer(b: Builder, f, k: int, x: Entry, w: Entry, bias, units: int) -> Entry:
        ins = [x, w] + ([bias] if bias is not None else [])
        name = "%s_fc%d" % (f.name, k)
        if f.attrs.get("fc%d" % k) == "dense":
            return b.op("FullyConnected", ins, attrs={"num_hidden": units, "no_bias": bias is None}, name=name)
        return b.op("Convolution", ins, attrs={"kernel": (1, 1), "num_filter": units, "no_bias": bias is None},
                    name=name)

    def rewrite(self, m: Match, b: Builder) -> Entry:
        f = m.node("f")
        x, w1, b1, w2, b2, rest = self.two_layer_inputs(m)
        residual = rest.pop(0) if f.param("residual", False) else None
        if f.attrs.get("in_act", "none") == "hard_swish":
            x = ElemwiseProgram(b, [x], f.name + "_hswish").build("mul(x0, div(clip(add(x0, 3.0), 0.0, 6.0), 6.0))")
        p = b.op("Pooling", [x], attrs={"global_pool": True, "pool_type": "avg", "kernel": (1, 1)},
                 name=f.name + "_pool")
        h = self._layer(b, f, 1, p, w1, b1, int(f.attrs["num_hidden"]))
        h = activation(b, h, f.attrs.get("act", "relu"), float(f.param("slope", 0.25)), f.name + "_act")
        g = self._layer(b, f, 2, h, w2, b2, int(f.attrs["num_channels"]))
        gate = f.attrs.get("gate", "sigmoid")
        if gate == "sigmoid" and f.attrs.get("gate_op") == "sigmoid":
            g = b.op("sigmoid", [g], name=f.name + "_gate")
        elif gate == "sigmoid":
            g = b.op("Activation", [g], attrs={"act_type": "sigmoid"}, name=f.name + "_gate")
        elif gate == "hard_sigmoid":
            g = b.op("hard_sigmoid", [g], attrs={"alpha": float(f.param("alpha", 0.2)),
                                                 "beta": float(f.param("beta", 0.5))}, name=f.name + "_gate")
        else:
            g = ElemwiseProgram(b, [g], f.name + "_gate").build("div(clip(add(x0, %r), %r, %r), %r)" % (
                float(f.param("gate_add", 3.0)), float(f.param("gate_min", 0.0)), float(f.param("gate_max", 6.0)),
                float(f.param("gate_div", 6.0))))
        if f.attrs.get("fc2") == "dense":
            g = b.op("Reshape", [g], attrs={"shape": (0, 0, 1, 1)}, name=f.name + "_gate_shape")
        y = b.op("broadcast_mul", [x, g], name=f.name + "_scale")
        if residual is not None:
            y = b.op("elemwise_add", [y, residual], name=f.name + "_add")
            y = activation(b, y, f.attrs.get("out_act", "none"), 0.0, f.name)
        return y


# ---------------------------------------------------------------- fused_concat_scale_act

class UnfuseConcatScaleAct(UnfuseRule):
    def __init__(self):
        super().__init__("fused_concat_scale_act", 130)

    def rewrite(self, m: Match, b: Builder) -> Entry:
        f = m.node("f")
        ins = self.inputs(m)
        pieces, s, t = ins[:-2], ins[-2], ins[-1]
        cat = b.op("Concat", pieces, attrs={"dim": 1, "num_args": len(pieces)}, name=f.name + "_concat")
        y = b.op("broadcast_mul", [cat, s], name=f.name + "_scale")
        y = b.op("broadcast_add", [y, t], name=f.name + "_shift")
        return activation(b, y, f.attrs.get("act", "none"), 0.0, f.name)


# ------------------------------------- fused_box_nms, fused_max_pool, fused_roi_align, fused_bilinear_resize

class UnfuseToStock(UnfuseRule):
    """A library op that is one stock MXNet op run faster: that op with the same inputs and the
    attributes named in ``keep`` (all of them: None), plus ``extra``; ``num_outputs`` outputs."""

    def __init__(self, op_name: str, stock: str, arity: int, keep: Optional[Tuple[str, ...]] = None,
                 extra: Optional[Dict[str, Any]] = None, num_outputs: int = 1):
        super().__init__(op_name, arity)
        self.stock, self.keep, self.extra, self.num_outputs = stock, keep, dict(extra or {}), num_outputs

    def rewrite(self, m: Match, b: Builder):
        f = m.node("f")
        attrs = f.attrs.copy() if self.keep is None else {k: f.attrs[k] for k in self.keep if k in f.attrs}
        attrs.update(self.extra)
        out = b.op(self.stock, self.inputs(m), attrs=attrs, name=f.name, num_outputs=self.num_outputs)
        if self.num_outputs == 1:
            return out
        return {Entry(f, i): e for i, e in enumerate(out)}


def _stock_ops() -> List[Rule]:
    from . import box_nms, roi_align
    return [UnfuseToStock("fused_box_nms", "_contrib_box_nms", 1, box_nms.ATTRS, num_outputs=2),
            UnfuseToStock("fused_max_pool", "Pooling", 1, ("kernel", "stride", "pad", "pooling_convention"),
                          {"pool_type": "max"}),
            UnfuseToStock("fused_roi_align", "_contrib_ROIAlign", 2, roi_align.ATTRS),
            # the op takes _contrib_BilinearResize2D's own attributes and inputs (data [, like])
            UnfuseToStock("fused_bilinear_resize", "_contrib_BilinearResize2D", 2)]


RULES: List[Rule] = [UnfuseDense(), UnfuseAddLayerNorm(), UnfuseSE(), UnfuseSplitAttention(), UnfuseGroupedConv(), UnfuseDeconv(), UnfuseInvertedResidual(), UnfuseDenseBlock(),
                     UnfuseConcatScaleAct(), *_stock_ops(), UnfuseElemwise(), UnfuseAttention(), UnfuseRegion()]


class _OnlyNodes(Rule):
    """``rule`` restricted to the fused nodes named in ``names`` (the others are kept)."""

    def __init__(self, rule: Rule, names: set):
        self._rule, self._names = rule, names
        self.name, self.family, self.benefit = rule.name, rule.family, rule.benefit
        self.description = rule.description
        self.inference_only = rule.inference_only

    def __getattr__(self, key):
        return getattr(self._rule, key)

    def pattern(self):
        return self._rule.pattern()

    def check(self, m: Match):
        if m.anchor.name not in self._names:        # the fused node (every un-fusing rule is anchored at it)
            return "kept fused (not selected)"
        return self._rule.check(m)

    def outside_use_ok(self, m: Match, entry: Entry, user) -> bool:
        return self._rule.outside_use_ok(m, entry, user)

    def rewrite(self, m: Match, b: Builder):
        return self._rule.rewrite(m, b)


def only_nodes(rule: Rule, names: set) -> Rule:
    """``rule`` applied only to the fused nodes named in ``names``."""
    return _OnlyNodes(rule, names)
