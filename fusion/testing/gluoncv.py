"""GluonCV's CNN blocks written as GluonCV writes them (the same ops in the same order), for
tests and benchmarks without GluonCV installed: SE-ResNeXt (``resnext.py``), SE-ResNet V1/V2
(``se_resnet.py``), MobileNetV3 (``mobilenetv3.py`` with ``nn/block.py``'s HardSigmoid /
HardSwish), ResNeSt (``resnest.py`` with ``nn/splat.py``'s SplitAttentionConv; DropBlock left out,
an identity at inference).  DenseNet is MXNet's model-zoo ``densenet121``, which GluonCV's equals.

``gluoncv_model(name)`` gives (symbol, arg_params, aux_params) with random weights and
randomized BatchNorm statistics, like ``fusion.testing.zoo_model``; widths and depths are
parameters so tests can build small ones.
"""
from __future__ import annotations

import math
from typing import Sequence, Tuple

import numpy as np


def _nn():
    from mxnet.gluon import nn
    return nn


def _blocks():
    """The block classes (defined on first use: mxnet is imported lazily)."""
    from mxnet.gluon import HybridBlock
    nn = _nn()

    class HardSigmoid(HybridBlock):
        def hybrid_forward(self, F, x):
            return F.clip(x + 3., 0, 6, name="relu6") / 6.

    class HardSwish(HybridBlock):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.act = HardSigmoid()

        def hybrid_forward(self, F, x):
            return x * self.act(x)

    def activation(kind):
        return {"relu": lambda: nn.Activation("relu"), "hard_swish": HardSwish,
                "hard_sigmoid": HardSigmoid}[kind]()

    class ResNeXtBlock(HybridBlock):
        """resnext.py's Block (use_se=True: 1×1 conv SE, broadcast_mul, relu(x + residual))."""

        def __init__(self, channels, cardinality, bottleneck_width, stride, downsample=False, use_se=True, **kw):
            super().__init__(**kw)
            D = int(math.floor(channels * (bottleneck_width / 64)))
            group_width = cardinality * D
            self.body = nn.HybridSequential(prefix="")
            self.body.add(nn.Conv2D(group_width, kernel_size=1, use_bias=False))
            self.body.add(nn.BatchNorm())
            self.body.add(nn.Activation("relu"))
            self.body.add(nn.Conv2D(group_width, kernel_size=3, strides=stride, padding=1,
                                    groups=cardinality, use_bias=False))
            self.body.add(nn.BatchNorm())
            self.body.add(nn.Activation("relu"))
            self.body.add(nn.Conv2D(channels * 4, kernel_size=1, use_bias=False))
            self.body.add(nn.BatchNorm())
            if use_se:
                self.se = nn.HybridSequential(prefix="")
                self.se.add(nn.Conv2D(channels // 4, kernel_size=1, padding=0))
                self.se.add(nn.Activation("relu"))
                self.se.add(nn.Conv2D(channels * 4, kernel_size=1, padding=0))
                self.se.add(nn.Activation("sigmoid"))
            else:
                self.se = None
            if downsample:
                self.downsample = nn.HybridSequential(prefix="")
                self.downsample.add(nn.Conv2D(channels * 4, kernel_size=1, strides=stride, use_bias=False))
                self.downsample.add(nn.BatchNorm())
            else:
                self.downsample = None

        def hybrid_forward(self, F, x):
            residual = x
            x = self.body(x)
            if self.se:
                w = F.contrib.AdaptiveAvgPooling2D(x, output_size=1)
                w = self.se(w)
                x = F.broadcast_mul(x, w)
            if self.downsample:
                residual = self.downsample(residual)
            return F.Activation(x + residual, act_type="relu")

    class SEBottleneck(HybridBlock):
        """se_resnet.py's SE_BottleneckV1 (v2=False) / SE_BottleneckV2 (v2=True): Dense SE, expand_dims twice."""

        def __init__(self, channels, stride, downsample=False, v2=False, **kw):
            super().__init__(**kw)
            self.v2 = v2
            if v2:
                self.bn1 = nn.BatchNorm()
                self.conv1 = nn.Conv2D(channels // 4, kernel_size=1, use_bias=False)
                self.bn2 = nn.BatchNorm()
                self.conv2 = nn.Conv2D(channels // 4, 3, stride, 1, use_bias=False)
                self.bn3 = nn.BatchNorm()
                self.conv3 = nn.Conv2D(channels, kernel_size=1, use_bias=False)
            else:
                self.body = nn.HybridSequential(prefix="")
                self.body.add(nn.Conv2D(channels // 4, kernel_size=1, strides=stride))
                self.body.add(nn.BatchNorm())
                self.body.add(nn.Activation("relu"))
                self.body.add(nn.Conv2D(channels // 4, 3, 1, 1, use_bias=False))
                self.body.add(nn.BatchNorm())
                self.body.add(nn.Activation("relu"))
                self.body.add(nn.Conv2D(channels, kernel_size=1, strides=1))
                self.body.add(nn.BatchNorm())
            self.se = nn.HybridSequential(prefix="")
            self.se.add(nn.Dense(channels // 16, use_bias=False))
            self.se.add(nn.Activation("relu"))
            self.se.add(nn.Dense(channels, use_bias=False))
            self.se.add(nn.Activation("sigmoid"))
            if downsample and not v2:
                self.downsample = nn.HybridSequential(prefix="")
                self.downsample.add(nn.Conv2D(channels, 1, stride, use_bias=False))
                self.downsample.add(nn.BatchNorm())
            else:
                self.downsample = nn.Conv2D(channels, 1, stride, use_bias=False) if downsample else None

        def hybrid_forward(self, F, x):
            residual = x
            if self.v2:
                x = F.Activation(self.bn1(x), act_type="relu")
                if self.downsample:
                    residual = self.downsample(x)
                x = self.conv1(x)
                x = self.conv2(F.Activation(self.bn2(x), act_type="relu"))
                x = self.conv3(F.Activation(self.bn3(x), act_type="relu"))
            else:
                x = self.body(x)
            w = F.contrib.AdaptiveAvgPooling2D(x, output_size=1)
            w = self.se(w)
            x = F.broadcast_mul(x, w.expand_dims(axis=2).expand_dims(axis=2))
            if self.v2:
                return x + residual
            if self.downsample:
                residual = self.downsample(residual)
            return F.Activation(x + residual, act_type="relu")

    def make_divisible(x, divisible_by=8):
        return int(np.ceil(x * 1. / divisible_by) * divisible_by)

    class SE(HybridBlock):
        """mobilenetv3.py's _SE: global pool, 1×1 convs, relu, hard-sigmoid, broadcast_mul."""

        def __init__(self, num_out, ratio=4, **kw):
            super().__init__(**kw)
            num_mid = make_divisible(num_out // ratio)
            self.pool = nn.GlobalAvgPool2D()
            self.conv1 = nn.Conv2D(channels=num_mid, kernel_size=1, use_bias=True)
            self.act1 = activation("relu")
            self.conv2 = nn.Conv2D(channels=num_out, kernel_size=1, use_bias=True)
            self.act2 = activation("hard_sigmoid")

        def hybrid_forward(self, F, x):
            out = self.act2(self.conv2(self.act1(self.conv1(self.pool(x)))))
            return F.broadcast_mul(x, out)

    class Unit(HybridBlock):
        def __init__(self, num_out, kernel_size=1, strides=1, pad=0, num_groups=1, use_act=True,
                     act_type="relu", **kw):
            super().__init__(**kw)
            self.conv = nn.Conv2D(num_out, kernel_size, strides, pad, groups=num_groups, use_bias=False)
            self.bn = nn.BatchNorm()
            self.act = activation(act_type) if use_act else None

        def hybrid_forward(self, F, x):
            out = self.bn(self.conv(x))
            return self.act(out) if self.act is not None else out

    class ResUnit(HybridBlock):
        def __init__(self, num_in, num_mid, num_out, kernel_size, act_type="relu", use_se=False, strides=1, **kw):
            super().__init__(**kw)
            self.expand = Unit(num_mid, act_type=act_type) if num_out != num_mid else None
            self.conv1 = Unit(num_mid, kernel_size, strides, (kernel_size - 1) // 2, num_mid, act_type=act_type)
            self.se = SE(num_mid) if use_se else None
            self.conv2 = Unit(num_out, use_act=False)
            self.short_cut = num_in == num_out and strides == 1

        def hybrid_forward(self, F, x):
            out = self.expand(x) if self.expand is not None else x
            out = self.conv1(out)
            if self.se is not None:
                out = self.se(out)
            out = self.conv2(out)
            return x + out if self.short_cut else out

    class SplitAttentionConv(HybridBlock):
        """splat.py's SplitAttentionConv: grouped conv of radix × channels, BN, relu, radix sum, pool,
        two grouped 1×1 convs (BN and relu between), r-softmax (sigmoid at radix 1), weighted sum."""

        def __init__(self, channels, kernel_size, strides=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1,
                     radix=2, in_channels=None, r=2, **kw):
            super().__init__()
            inter_channels = max(in_channels * radix // 2 // r, 32)
            self.radix, self.cardinality, self.channels = radix, groups, channels
            self.conv = nn.Conv2D(channels * radix, kernel_size, strides, padding, dilation, groups=groups * radix,
                                  in_channels=in_channels, **kw)
            self.bn = nn.BatchNorm(in_channels=channels * radix)
            self.relu = nn.Activation("relu")
            self.fc1 = nn.Conv2D(inter_channels, 1, in_channels=channels, groups=self.cardinality)
            self.bn1 = nn.BatchNorm(in_channels=inter_channels)
            self.relu1 = nn.Activation("relu")
            self.fc2 = nn.Conv2D(channels * radix, 1, in_channels=inter_channels, groups=self.cardinality)

        def hybrid_forward(self, F, x):
            x = self.relu(self.bn(self.conv(x)))
            if self.radix > 1:
                splited = F.reshape(x.expand_dims(1), (0, self.radix, self.channels, 0, 0))
                gap = F.sum(splited, axis=1)
            else:
                gap = x
            gap = F.contrib.AdaptiveAvgPooling2D(gap, 1)
            atten = self.relu1(self.bn1(self.fc1(gap)))
            atten = self.fc2(atten).reshape((0, self.cardinality, self.radix, -1)).swapaxes(1, 2)
            if self.radix > 1:
                atten = F.softmax(atten, axis=1).reshape((0, self.radix, -1, 1, 1))
                return F.sum(F.broadcast_mul(atten, splited), axis=1)
            atten = F.sigmoid(atten).reshape((0, -1, 1, 1))
            return F.broadcast_mul(atten, x)

    class ResNeStBottleneck(HybridBlock):
        """resnest.py's Bottleneck with use_splat=True (avd: 3×3 average pool after the split attention)."""

        def __init__(self, channels, cardinality=1, bottleneck_width=64, strides=1, downsample=None, radix=2,
                     avd=False, avd_first=False, in_channels=None, **kw):
            super().__init__(**kw)
            group_width = int(channels * (bottleneck_width / 64.)) * cardinality
            self.avd = avd and strides > 1
            self.avd_first = avd_first
            self.conv1 = nn.Conv2D(group_width, kernel_size=1, use_bias=False, in_channels=in_channels)
            self.bn1 = nn.BatchNorm(in_channels=group_width)
            self.relu1 = nn.Activation("relu")
            self.conv2 = SplitAttentionConv(group_width, 3, strides=1 if self.avd else strides, padding=1,
                                            groups=cardinality, use_bias=False, in_channels=group_width,
                                            radix=radix)
            self.conv3 = nn.Conv2D(channels * 4, kernel_size=1, use_bias=False, in_channels=group_width)
            self.bn3 = nn.BatchNorm(in_channels=channels * 4)
            if self.avd:
                self.avd_layer = nn.AvgPool2D(3, strides, padding=1)
            self.relu3 = nn.Activation("relu")
            self.downsample = downsample

        def hybrid_forward(self, F, x):
            residual = x
            out = self.relu1(self.bn1(self.conv1(x)))
            if self.avd and self.avd_first:
                out = self.avd_layer(out)
            out = self.conv2(out)
            if self.avd and not self.avd_first:
                out = self.avd_layer(out)
            out = self.bn3(self.conv3(out))
            if self.downsample is not None:
                residual = self.downsample(x)
            return self.relu3(out + residual)

    return dict(ResNeXtBlock=ResNeXtBlock, SEBottleneck=SEBottleneck, ResUnit=ResUnit, HardSwish=HardSwish,
                ResNeStBottleneck=ResNeStBottleneck, SplitAttentionConv=SplitAttentionConv,
                make_divisible=make_divisible)


# MobileNetV3-Large (mobilenetv3.py): kernel, expansion, out, SE, activation, stride
MOBILENETV3_LARGE = [
    (3, 16, 16, False, "relu", 1), (3, 64, 24, False, "relu", 2), (3, 72, 24, False, "relu", 1),
    (5, 72, 40, True, "relu", 2), (5, 120, 40, True, "relu", 1), (5, 120, 40, True, "relu", 1),
    (3, 240, 80, False, "hard_swish", 2), (3, 200, 80, False, "hard_swish", 1),
    (3, 184, 80, False, "hard_swish", 1), (3, 184, 80, False, "hard_swish", 1),
    (3, 480, 112, True, "hard_swish", 1), (3, 672, 112, True, "hard_swish", 1),
    (5, 672, 160, True, "hard_swish", 2), (5, 960, 160, True, "hard_swish", 1),
    (5, 960, 160, True, "hard_swish", 1),
]


def se_resnext(layers: Sequence[int] = (3, 4, 6, 3), cardinality: int = 32, bottleneck_width: int = 4,
               channels: int = 64, classes: int = 1000):
    """resnext.py's ResNext with use_se=True (SE-ResNeXt50 32x4d by default)."""
    nn = _nn()
    B = _blocks()
    net = nn.HybridSequential(prefix="")
    with net.name_scope():
        net.add(nn.Conv2D(channels, 7, 2, 3, use_bias=False), nn.BatchNorm(), nn.Activation("relu"),
                nn.MaxPool2D(3, 2, 1))
        for i, n in enumerate(layers):
            stage = nn.HybridSequential(prefix="stage%d_" % (i + 1))
            with stage.name_scope():
                for k in range(n):
                    stage.add(B["ResNeXtBlock"](channels, cardinality, bottleneck_width,
                                                (1 if i == 0 else 2) if k == 0 else 1, downsample=k == 0, prefix=""))
            net.add(stage)
            channels *= 2
        net.add(nn.GlobalAvgPool2D(), nn.Dense(classes))
    return net


def se_resnet(layers: Sequence[int] = (3, 4, 6, 3), channels: Sequence[int] = (64, 256, 512, 1024, 2048),
              v2: bool = False, classes: int = 1000):
    """se_resnet.py's SE_ResNetV1 / V2 with bottleneck blocks (SE-ResNet50 by default)."""
    nn = _nn()
    B = _blocks()
    net = nn.HybridSequential(prefix="")
    with net.name_scope():
        if v2:
            net.add(nn.BatchNorm(scale=False, center=False))
        net.add(nn.Conv2D(channels[0], 7, 2, 3, use_bias=False), nn.BatchNorm(), nn.Activation("relu"),
                nn.MaxPool2D(3, 2, 1))
        for i, n in enumerate(layers):
            stage = nn.HybridSequential(prefix="stage%d_" % (i + 1))
            with stage.name_scope():
                for k in range(n):
                    stage.add(B["SEBottleneck"](channels[i + 1], (1 if i == 0 else 2) if k == 0 else 1,
                                                downsample=k == 0 and channels[i + 1] != channels[i], v2=v2,
                                                prefix=""))
            net.add(stage)
        if v2:
            net.add(nn.BatchNorm(), nn.Activation("relu"))
        net.add(nn.GlobalAvgPool2D(), nn.Dense(classes))
    return net


def mobilenetv3(cfg=MOBILENETV3_LARGE, multiplier: float = 1.0, cls_ch_squeeze: int = 960,
                cls_ch_expand: int = 1280, classes: int = 1000):
    """mobilenetv3.py's _MobileNetV3 (MobileNetV3-Large by default; final dropout left out, an identity
    at inference)."""
    nn = _nn()
    B = _blocks()
    md = B["make_divisible"]
    net = nn.HybridSequential(prefix="")
    with net.name_scope():
        inplanes = md(multiplier * 16)
        net.add(nn.Conv2D(inplanes, 3, 2, 1, use_bias=False), nn.BatchNorm(), B["HardSwish"]())
        for k, exp, out, se, act, s in cfg:
            out = md(multiplier * out)
            net.add(B["ResUnit"](inplanes, md(multiplier * exp), out, k, act, se, s))
            inplanes = out
        net.add(nn.Conv2D(md(multiplier * cls_ch_squeeze), 1, use_bias=False), nn.BatchNorm(), B["HardSwish"](),
                nn.GlobalAvgPool2D(), nn.Conv2D(cls_ch_expand, 1, use_bias=False), B["HardSwish"](),
                nn.Conv2D(classes, 1), nn.Flatten())
    return net


def resnest(layers: Sequence[int] = (3, 4, 6, 3), radix: int = 2, cardinality: int = 1,
            bottleneck_width: int = 64, stem_width: int = 32, avd_first: bool = False, classes: int = 1000):
    """resnest.py's ResNeSt with deep stem, avg_down, avd and split attention (ResNeSt-50 by default;
    ``radix`` 1/2/4 and ``cardinality`` as its variants write them)."""
    nn = _nn()
    B = _blocks()
    net = nn.HybridSequential(prefix="")
    with net.name_scope():
        stem = nn.HybridSequential(prefix="conv1")
        stem.add(nn.Conv2D(stem_width, 3, 2, 1, use_bias=False, in_channels=3), nn.BatchNorm(),
                 nn.Activation("relu"), nn.Conv2D(stem_width, 3, 1, 1, use_bias=False), nn.BatchNorm(),
                 nn.Activation("relu"), nn.Conv2D(stem_width * 2, 3, 1, 1, use_bias=False))
        net.add(stem, nn.BatchNorm(), nn.Activation("relu"), nn.MaxPool2D(3, 2, 1))
        inplanes = stem_width * 2
        for i, n in enumerate(layers):
            planes, strides = 64 * 2 ** i, 1 if i == 0 else 2
            downsample = None
            if strides != 1 or inplanes != planes * 4:
                downsample = nn.HybridSequential(prefix="down%d_" % (i + 1))
                with downsample.name_scope():
                    downsample.add(nn.AvgPool2D(strides, strides, ceil_mode=True, count_include_pad=False),
                                   nn.Conv2D(planes * 4, 1, 1, use_bias=False, in_channels=inplanes),
                                   nn.BatchNorm())
            stage = nn.HybridSequential(prefix="layers%d_" % (i + 1))
            with stage.name_scope():
                for k in range(n):
                    stage.add(B["ResNeStBottleneck"](planes, cardinality, bottleneck_width, strides if k == 0 else 1,
                                                     downsample if k == 0 else None, radix, avd=True,
                                                     avd_first=avd_first, in_channels=inplanes))
                    inplanes = planes * 4
            net.add(stage)
        net.add(nn.GlobalAvgPool2D(), nn.Flatten(), nn.Dense(classes))
    return net


MODELS = {
    "resnest50": lambda: resnest(),
    "se_resnext50_32x4d": lambda: se_resnext(),
    "se_resnet50_v1": lambda: se_resnet(),
    "mobilenetv3_large": lambda: mobilenetv3(),
}


def export(net, input_shape: Tuple[int, ...], seed: int = 0):
    """(symbol, arg_params, aux_params) of a Gluon block: random weights, randomized BatchNorm statistics."""
    import mxnet as mx

    from . import gluon_export

    mx.random.seed(seed)
    sym, arg, aux = gluon_export(net, input_shape, seed)
    rng = np.random.default_rng(seed + 1)
    for name in sorted(arg):        # biases too (Gluon starts them at zero)
        if name.endswith("_bias"):
            arg[name] = mx.nd.array(rng.normal(0.0, 0.2, arg[name].shape))
    return sym, arg, aux


def gluoncv_model(name: str, input_shape: Tuple[int, ...] = (1, 3, 224, 224), seed: int = 0):
    """(symbol, arg_params, aux_params) of GluonCV network ``name`` (see ``MODELS``)."""
    if name not in MODELS:
        raise KeyError("unknown network %r (known: %s)" % (name, ", ".join(sorted(MODELS))))
    import mxnet as mx
    with mx.name.NameManager():
        return export(MODELS[name](), input_shape, seed)
