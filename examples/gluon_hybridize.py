"""Door 3 — Gluon: ``net.hybridize(backend="fusion")`` on a CNN and on an attention block.

    python examples/gluon_hybridize.py [--quick]
"""
import math
import time

from _common import QUICK, repeats  # first: thread settings before mxnet loads

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import gluon  # noqa: E402
from mxnet.gluon.model_zoo import vision

import fusion  # noqa: F401  (registers the "fusion" backend)
from fusion.testing import randomize_batchnorm


class SelfAttention(gluon.HybridBlock):
    """Multi-head self-attention written the classic way: projections, head split, batch_dot, softmax."""

    def __init__(self, units, heads, **kw):
        super().__init__(**kw)
        self.units, self.heads = units, heads
        with self.name_scope():
            self.qkv = gluon.nn.Dense(3 * units, flatten=False, in_units=units)
            self.out = gluon.nn.Dense(units, flatten=False, in_units=units)
            self.norm = gluon.nn.LayerNorm(in_channels=units)

    def hybrid_forward(self, F, x):
        def split(t):
            return F.reshape(F.transpose(F.reshape(t, shape=(0, 0, self.heads, -1)), axes=(0, 2, 1, 3)),
                             shape=(-3, 0, 0))
        q, k, v = (split(t) for t in F.split(self.qkv(x), num_outputs=3, axis=-1))
        s = F.batch_dot(q, k, transpose_b=True) / math.sqrt(self.units // self.heads)
        o = F.batch_dot(F.softmax(s, axis=-1), v)
        o = F.reshape(F.transpose(F.reshape(o, shape=(-4, -1, self.heads, 0, 0)), axes=(0, 2, 1, 3)), shape=(0, 0, -3))
        return self.norm(self.out(o) + x)


def compare(make, x, name):
    ref, net = make(), make()
    ref.hybridize(static_alloc=True)
    net.hybridize(backend="fusion", static_alloc=True)
    a, b = ref(x), net(x)
    err = float(np.abs(a.asnumpy() - b.asnumpy()).max() / np.abs(a.asnumpy()).max())
    print("%s: %s" % (name, net.fusion_report.to_text().splitlines()[0]))
    times = {"fused": [], "plain": []}
    for _ in range(repeats(20)):
        for key, block in (("fused", net), ("plain", ref)):
            t = time.perf_counter()
            block(x).wait_to_read()
            times[key].append(time.perf_counter() - t)
    f, p = (float(np.median(times[k])) * 1e3 for k in ("fused", "plain"))
    print("  max rel error %.1e; median %.2f ms fused vs %.2f ms hybridized (%.2fx)" % (err, f, p, p / f))
    assert err < 1e-4


def cnn():
    mx.random.seed(0)
    net = vision.resnet18_v1()
    net.initialize(mx.init.Xavier())
    net(mx.nd.zeros((1, 3, 64, 64)))
    params = {k: p.data() for k, p in net.collect_params().items()}
    randomize_batchnorm(params, {}, 0)
    for k, p in net.collect_params().items():
        p.set_data(params[k])
    return net


def attention():
    mx.random.seed(0)
    net = SelfAttention(256, 8)
    net.initialize(mx.init.Xavier())
    return net


compare(cnn, mx.nd.array(np.random.default_rng(0).standard_normal((1, 3, 64 if QUICK else 224, 64 if QUICK else 224))),
        "resnet18_v1")
compare(attention, mx.nd.array(np.random.default_rng(1).standard_normal((1, 64 if QUICK else 256, 256))),
        "self-attention block")
