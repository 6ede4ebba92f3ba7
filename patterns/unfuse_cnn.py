"""Un-fusing the CNN ops: ``fused_split_attention`` → the stock ops GluonCV's ``SplitAttentionConv``
writes (see ``patterns/split_attention.py``; a folded BatchNorm stays folded into the first layer);
``fused_grouped_conv`` → ``Convolution`` [→ ``Activation(relu)``]; ``fused_inverted_residual`` → its three convolutions
with their activations, SE and residual add as stock ops; ``fused_dense_block`` → its layers and concatenations."""
from __future__ import annotations

from fusion.ir.errors import FusionError
from fusion.ir.graph import Entry
from fusion.ir.matcher import Match
from fusion.engine.rewrite import Builder

from ._unfuse_base import UnfuseRule
from ._unfuse_ops import activation


class UnfuseSplitAttention(UnfuseRule):
    def __init__(self):
        super().__init__("fused_split_attention", 5)

    def rewrite(self, m: Match, b: Builder) -> Entry:
        f = m.node("f")
        x, w1, b1, w2, b2, _ = self.two_layer_inputs(m)
        R, A, C = int(f.param("radix", 2)), int(f.param("att_groups", 1)), int(f.attrs["num_channels"])
        name = f.name
        gap = x
        if R > 1:
            split = b.op("Reshape", [b.op("expand_dims", [x], attrs={"axis": 1}, name=name + "_expand")],
                         attrs={"shape": (0, R, C, 0, 0)}, name=name + "_split")
            gap = b.op("sum", [split], attrs={"axis": 1}, name=name + "_radix_sum")
        p = b.op("Pooling", [gap], attrs={"global_pool": True, "pool_type": "avg", "kernel": (1, 1)},
                 name=name + "_pool")
        h = b.op("Convolution", [p, w1] + ([b1] if b1 is not None else []),
                 attrs={"kernel": (1, 1), "num_filter": int(f.attrs["num_hidden"]), "no_bias": b1 is None,
                        "num_group": int(f.param("num_group1", 1))}, name=name + "_fc1")
        h = activation(b, h, f.attrs.get("act", "relu"), float(f.param("slope", 0.25)), name + "_act")
        a = b.op("Convolution", [h, w2] + ([b2] if b2 is not None else []),
                 attrs={"kernel": (1, 1), "num_filter": R * C, "no_bias": b2 is None,
                        "num_group": int(f.param("num_group2", 1))}, name=name + "_fc2")
        a = b.op("Reshape", [a], attrs={"shape": (0, A, R, -1)}, name=name + "_att_shape")
        a = b.op("SwapAxis", [a], attrs={"dim1": 1, "dim2": 2}, name=name + "_swap")
        if R > 1:
            a = b.op("softmax", [a], attrs={"axis": 1}, name=name + "_gate")
            a = b.op("Reshape", [a], attrs={"shape": (0, R, -1, 1, 1)}, name=name + "_att_view")
            return b.op("sum", [b.op("broadcast_mul", [a, split], name=name + "_mul")], attrs={"axis": 1},
                        name=name)
        a = b.op("sigmoid", [a], name=name + "_gate")
        a = b.op("Reshape", [a], attrs={"shape": (0, -1, 1, 1)}, name=name + "_att_view")
        return b.op("broadcast_mul", [a, x], name=name)


class UnfuseGroupedConv(UnfuseRule):
    def __init__(self):
        super().__init__("fused_grouped_conv", 3)

    def rewrite(self, m: Match, b: Builder) -> Entry:
        f = m.node("f")
        attrs = {k: f.attrs[k] for k in ("kernel", "stride", "pad", "dilate", "num_group", "num_filter")
                 if k in f.attrs}
        attrs["no_bias"] = bool(f.param("no_bias", False))
        y = b.op("Convolution", list(self.inputs(m)), attrs=attrs, name=f.name + "_conv")
        if f.attrs.get("act", "none") != "none":
            y = b.op("Activation", [y], attrs={"act_type": "relu"}, name=f.name)
        return y


class UnfuseInvertedResidual(UnfuseRule):
    """``fused_inverted_residual`` → [Convolution 1×1 → act] → Convolution depthwise → act [→ the SE's stock ops]
    → Convolution 1×1 [→ elemwise_add(·, x)]; act: Activation(relu) or the hard-swish ops."""

    def __init__(self):
        super().__init__("fused_inverted_residual", 11)

    @staticmethod
    def _act(b: Builder, x: Entry, kind: str, name: str) -> Entry:
        from .unfuse_elemwise import ElemwiseProgram
        if kind == "hard_swish":
            return ElemwiseProgram(b, [x], name).build("mul(x0, div(clip(add(x0, 3.0), 0.0, 6.0), 6.0))")
        return b.op("Activation", [x], attrs={"act_type": "relu"}, name=name)

    def rewrite(self, m: Match, b: Builder) -> Entry:
        from .unfuse_elemwise import ElemwiseProgram
        f = m.node("f")
        ins = list(self.inputs(m))
        flag = lambda k, d: str(f.attrs.get(k, d)).lower() in ("true", "1")  # noqa: E731
        expand, se, residual = flag("expand", True), flag("se", False), flag("residual", False)
        kind, name = f.attrs.get("act", "relu"), f.name
        K, S, P = int(f.attrs.get("kernel", 3)), int(f.attrs.get("stride", 1)), int(f.attrs.get("pad", 1))
        E, O = int(f.attrs["num_expand"]), int(f.attrs["num_filter"])
        x = y = ins.pop(0)
        if expand:
            we, be = ins.pop(0), ins.pop(0)
            y = b.op("Convolution", [y, we, be], attrs={"kernel": (1, 1), "num_filter": E}, name=name + "_expand")
            y = self._act(b, y, kind, name + "_act1")
        wd, bd = ins.pop(0), ins.pop(0)
        y = b.op("Convolution", [y, wd, bd], attrs={"kernel": (K, K), "stride": (S, S), "pad": (P, P),
                                                   "num_filter": E, "num_group": E}, name=name + "_dw")
        y = self._act(b, y, kind, name + "_act2")
        if se:
            w1, b1, w2, b2 = ins.pop(0), ins.pop(0), ins.pop(0), ins.pop(0)
            p = b.op("Pooling", [y], attrs={"global_pool": True, "pool_type": "avg", "kernel": (1, 1)},
                     name=name + "_se_pool")
            if "num_hidden" not in f.attrs:
                raise FusionError("fused_inverted_residual '%s' lacks num_hidden: its SE cannot be rebuilt" % name)
            h = b.op("Convolution", [p, w1, b1], attrs={"kernel": (1, 1), "num_filter": int(f.attrs["num_hidden"])},
                     name=name + "_se_fc1")
            h = b.op("Activation", [h], attrs={"act_type": "relu"}, name=name + "_se_act")
            g = b.op("Convolution", [h, w2, b2], attrs={"kernel": (1, 1), "num_filter": E}, name=name + "_se_fc2")
            g = ElemwiseProgram(b, [g], name + "_se_gate").build("div(clip(add(x0, %r), %r, %r), %r)" % (
                float(f.attrs.get("gate_add", 3.0)), float(f.attrs.get("gate_min", 0.0)),
                float(f.attrs.get("gate_max", 6.0)), float(f.attrs.get("gate_div", 6.0))))
            y = b.op("broadcast_mul", [y, g], name=name + "_se_scale")
        wp, bp = ins.pop(0), ins.pop(0)
        y = b.op("Convolution", [y, wp, bp], attrs={"kernel": (1, 1), "num_filter": O},
                 name=name + ("_project" if residual else ""))
        if residual:
            y = b.op("elemwise_add", [y, x], name=name)
        return y


class UnfuseDenseBlock(UnfuseRule):
    """``fused_dense_block`` → per layer broadcast_mul(·, s) → broadcast_add(·, t) → Activation(relu) | relu →
    Convolution 1×1 → Activation(relu) → Convolution 3×3 pad 1 → Concat(·, ·, dim=1) [→ broadcast_mul → broadcast_add
    → Activation(relu) | relu (post_act)]."""

    def __init__(self):
        super().__init__("fused_dense_block", 1 + 6 * 64)

    def rewrite(self, m: Match, b: Builder) -> Entry:
        f = m.node("f")
        ins = list(self.inputs(m))
        L, k, B = int(f.attrs["num_layers"]), int(f.attrs["growth"]), int(f.attrs["bottleneck"])
        post = f.attrs.get("post_act", "none")
        if len(ins) != 1 + 6 * L + (2 if post != "none" else 0):
            raise FusionError("fused_dense_block '%s' has %d inputs, not 1 + 6 × %d%s" % (
                f.name, len(ins), L, "" if post == "none" else " + 2"))
        cat, name = ins[0], f.name
        for l in range(L):
            s, t, w1, b1, w2, b2 = ins[1 + 6 * l: 7 + 6 * l]
            tag = "%s_layer%d" % (name, l)
            y = b.op("broadcast_mul", [cat, s], name=tag + "_scale")
            y = b.op("broadcast_add", [y, t], name=tag + "_shift")
            if f.attrs.get("pre_act", "act_relu") == "relu":
                y = b.op("relu", [y], name=tag + "_relu1")
            else:
                y = b.op("Activation", [y], attrs={"act_type": "relu"}, name=tag + "_relu1")
            y = b.op("Convolution", [y, w1, b1], attrs={"kernel": (1, 1), "num_filter": B}, name=tag + "_conv1")
            y = b.op("Activation", [y], attrs={"act_type": "relu"}, name=tag + "_relu2")
            y = b.op("Convolution", [y, w2, b2], attrs={"kernel": (3, 3), "pad": (1, 1), "num_filter": k},
                     name=tag + "_conv2")
            last = l == L - 1 and post == "none"
            cat = b.op("Concat", [cat, y], attrs={"dim": 1, "num_args": 2}, name=name if last else tag)
        if post != "none":
            s, t = ins[1 + 6 * L:]
            y = b.op("broadcast_mul", [cat, s], name=name + "_post_scale")
            y = b.op("broadcast_add", [y, t], name=name + "_post_shift")
            if post == "relu":
                return b.op("relu", [y], name=name)
            return b.op("Activation", [y], attrs={"act_type": "relu"}, name=name)
        return cat
