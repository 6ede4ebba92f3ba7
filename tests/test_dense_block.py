"""DenseNet's dense block (patterns/dense_block.py → fused_dense_block).

The block as MXNet's model zoo (= GluonCV) writes it, checked against MXNet at the fusing shape
and at other batch and plane sizes, through oneDNN and through the op's direct loops; the
unfolded form (the 1×1 convolution's BatchNorm folded by the rule itself); DenseNet-121 end to
end; the refusals with their reasons; un-fusing; the Gluon backend.
"""
import os

import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.testing import gluon_export, zoo_model

from conftest import assert_unfuse_round_trip, fuse_and_check, ops

# the block rules as they fuse where no region takes their blocks (tests/test_region.py: regions)
pytestmark = pytest.mark.usefixtures("no_regions")


def dense_block(c0=16, layers=3, growth=8, bn_size=2, dropout=0, shape=(1, 16, 8, 8), post=False):
    """The model zoo's dense block; ``post``: then BatchNorm → relu (DenseNet's transition begins so)."""
    from mxnet.gluon import nn
    from mxnet.gluon.model_zoo.vision.densenet import _make_dense_block
    with mx.name.NameManager():
        net = _make_dense_block(layers, bn_size, growth, dropout, 1)
        if post:
            seq = nn.HybridSequential(prefix="")
            seq.add(net, nn.BatchNorm(), nn.Activation("relu"))
            net = seq
        return gluon_export(net, shape)


def text(res):
    return res.report.to_text(explain=True)


@pytest.mark.parametrize("direct", [False, True], ids=["onednn", "direct"])
@pytest.mark.parametrize("layers", [1, 4])
@pytest.mark.parametrize("growth", [8, 16], ids=["nhwc", "blocked"])     # 16: channels in blocks of 16
@pytest.mark.parametrize("post", [False, True], ids=["", "post"])
def test_block_fuses_exactly(layers, growth, post, direct, monkeypatch):
    if direct:
        monkeypatch.setenv("MXFUSION_NO_DNNL_CONV", "1")
    sym, arg, aux = dense_block(layers=layers, growth=growth, post=post)
    res = fuse_and_check(sym, {"data": (1, 16, 8, 8)}, arg, aux)
    assert ops(res) == {"fused_dense_block": 1}, text(res)
    assert res.graph.nodes[-1].attrs.get("post_act", "none") == ("act_relu" if post else "none")
    for other in ((2, 16, 8, 8), (3, 16, 11, 6), (1, 16, 1, 1)):   # every size the original accepts
        v = fusion.verify((sym, arg, aux), res, input_shapes={"data": other})
        assert v.max_rel <= 1e-4, (other, v)


def test_unfolded_block_fuses_alone():
    """Without bn_folding the rule folds the 1×1 convolution's BatchNorm itself."""
    sym, arg, aux = dense_block(layers=2)
    res = fuse_and_check(sym, {"data": (2, 16, 8, 8)}, arg, aux, rules=["dense_block"])
    assert ops(res) == {"fused_dense_block": 1}, text(res)


def test_densenet121_end_to_end():
    shape = (1, 3, 224, 224)                           # the classifier's 7×7 pooling needs 224²
    sym, arg, aux = zoo_model("densenet121", shape)
    res = fusion.fuse(sym, arg, aux, input_shapes={"data": shape})
    got = ops(res)
    assert got.get("fused_dense_block") == 4, text(res)
    # the transitions' and the last BatchNorm → relu go into the blocks before them
    assert "Concat" not in got and "BatchNorm" not in got and "fused_elemwise" not in got, got
    for s in (shape, (2, 3, 224, 224)):
        v = fusion.verify((sym, arg, aux), res, input_shapes={"data": s})
        assert v.max_rel <= 1e-4, v


def test_training_is_refused():
    sym, arg, aux = dense_block()
    res = fusion.fuse(sym, arg, aux, mode="training", input_shapes={"data": (1, 16, 8, 8)})
    assert "fused_dense_block" not in ops(res)
    assert "fused_dense_block has no backward" in text(res), text(res)


def test_gpu_is_refused():
    sym, arg, aux = dense_block()
    res = fusion.fuse(sym, arg, aux, device="gpu", input_shapes={"data": (1, 16, 8, 8)})
    assert "fused_dense_block" not in ops(res)
    assert "fused_dense_block has no gpu implementation" in text(res), text(res)


def test_dropout_is_refused():
    sym, arg, aux = dense_block(layers=2, dropout=0.2)
    res = fuse_and_check(sym, {"data": (1, 16, 8, 8)}, arg, aux, rules=["dense_block"])
    assert "fused_dense_block" not in ops(res)
    assert "Dropout" in text(res) and "follows the layer" in text(res), text(res)
    # the default rules first drop Dropout at inference (the identity there): then the block fuses
    res = fuse_and_check(sym, {"data": (1, 16, 8, 8)}, arg, aux)
    assert ops(res) == {"fused_dense_block": 1}, text(res)


def test_intermediate_concatenation_read_outside_ends_the_run():
    sym, arg, aux = dense_block(layers=4)
    inner = [n for n in sym.get_internals().list_outputs() if "concat" in n]
    assert len(inner) == 4
    mid = sym.get_internals()[inner[1]]                  # after the second layer
    both = mx.sym.Group([sym, mx.sym.Pooling(mid, kernel=(2, 2), pool_type="avg", stride=(2, 2))])
    res = fuse_and_check(both, {"data": (1, 16, 8, 8)}, arg, aux)
    assert ops(res) == {"fused_dense_block": 2, "Pooling": 1}, text(res)
    nodes = [n for n in res.graph.nodes if n.op == "fused_dense_block"]
    assert sorted(int(n.attrs["num_layers"]) for n in nodes) == [2, 2]


def layer(x, c, k=8, b=16, dim=1, name="l"):
    def bn(v, n):
        return mx.sym.BatchNorm(v, fix_gamma=False, name=n)
    a = mx.sym.Activation(bn(x, name + "_bn1"), act_type="relu")
    h = mx.sym.Convolution(a, kernel=(1, 1), num_filter=b, no_bias=True, name=name + "_c1")
    h = mx.sym.Activation(bn(h, name + "_bn2"), act_type="relu")
    new = mx.sym.Convolution(h, kernel=(3, 3), pad=(1, 1), num_filter=k, no_bias=True, name=name + "_c2")
    return mx.sym.Concat(x, new, dim=dim, name=name + "_cat")


def test_concat_along_another_axis_is_refused():
    x = mx.sym.var("data")
    res = fuse_and_check(layer(x, 8, dim=2), {"data": (1, 8, 6, 6)})
    assert "fused_dense_block" not in ops(res)
    assert "joins axis 2, not the channel axis 1" in text(res), text(res)


def test_strided_or_unpadded_convolution_is_refused():
    x = mx.sym.var("data")
    a = mx.sym.Activation(mx.sym.BatchNorm(x, fix_gamma=False, name="bn1"), act_type="relu")
    h = mx.sym.Activation(mx.sym.Convolution(a, kernel=(1, 1), num_filter=16, name="c1"), act_type="relu")
    new = mx.sym.Convolution(h, kernel=(3, 3), pad=(0, 0), num_filter=8, name="c2")
    new = mx.sym.Pad(new, mode="constant", pad_width=(0, 0, 0, 0, 1, 1, 1, 1))
    res = fuse_and_check(mx.sym.Concat(x, new, dim=1), {"data": (1, 8, 6, 6)})
    assert "fused_dense_block" not in ops(res)


def test_batchnorm_reading_another_value_is_refused():
    x = mx.sym.var("data")
    y = mx.sym.var("other")
    a = mx.sym.Activation(mx.sym.BatchNorm(y, fix_gamma=False, name="bn1"), act_type="relu")
    h = mx.sym.Activation(mx.sym.Convolution(a, kernel=(1, 1), num_filter=16, name="c1"), act_type="relu")
    new = mx.sym.Convolution(h, kernel=(3, 3), pad=(1, 1), num_filter=8, name="c2")
    res = fuse_and_check(mx.sym.Concat(x, new, dim=1), {"data": (1, 8, 6, 6), "other": (1, 8, 6, 6)})
    assert "fused_dense_block" not in ops(res)
    assert "not the input 'data' of Concat" in text(res), text(res)


@pytest.mark.parametrize("layers,post", [(1, False), (3, False), (2, True)])
def test_unfuse_round_trip(layers, post):
    sym, arg, aux = dense_block(layers=layers, post=post)
    shapes = {"data": (1, 16, 8, 8)}
    res = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    assert ops(res) == {"fused_dense_block": 1}
    assert_unfuse_round_trip(sym, arg, aux, res, shapes, "fused_dense_block", rtol=1e-4)


def test_gluon_backend():
    from mxnet.gluon.model_zoo.vision.densenet import _make_dense_block
    nets = []
    for _ in range(2):
        mx.random.seed(0)
        net = _make_dense_block(3, 2, 8, 0, 1)
        net.initialize(mx.init.Xavier())
        net(mx.nd.zeros((1, 16, 8, 8)))
        nets.append(net)
    rng = np.random.default_rng(0)
    for p, q in zip(nets[0].collect_params().values(), nets[1].collect_params().values()):
        v = mx.nd.array(rng.uniform(0.5, 1.5, p.shape) if p.name.endswith(("var", "gamma"))
                        else rng.uniform(-0.2, 0.2, p.shape) if p.name.endswith(("mean", "beta")) else p.data())
        p.set_data(v)
        q.set_data(v.copy())
    ref, net = nets
    ref.hybridize()
    net.hybridize(backend=fusion.BACKEND, mode="inference")
    for shape in ((2, 16, 8, 8), (1, 16, 5, 7)):
        x = mx.nd.array(rng.standard_normal(shape))
        a, b = net(x).asnumpy(), ref(x).asnumpy()
        assert np.abs(a - b).max() / np.abs(b).max() <= 1e-4, shape
    from fusion.ir.graph import Graph
    assert Graph.from_symbol(net._cached_graph[1]).count_ops().get("fused_dense_block") == 1


# ---------------------------------------------------------------- pool_before_pointwise_conv
def transition(pool_type="avg", pad=0, kernel=1, convention="valid", bias=True):
    x = mx.sym.var("data")
    y = mx.sym.Convolution(x, kernel=(kernel, kernel), pad=((kernel - 1) // 2,) * 2, num_filter=6, no_bias=not bias,
                           name="conv")
    return mx.sym.Pooling(y, kernel=(2, 2), stride=(2, 2), pad=(pad, pad), pool_type=pool_type,
                          pooling_convention=convention, name="pool")


@pytest.mark.parametrize("bias", [False, True])
def test_transition_pools_first(bias):
    res = fuse_and_check(transition(bias=bias), {"data": (2, 8, 8, 6)}, rules=["pool_before_pointwise_conv"])
    g = res.graph
    order = [n.op for n in g.nodes if not n.is_variable]
    assert order == ["Pooling", "Convolution"], order
    for other in ((1, 8, 7, 5), (3, 8, 2, 2)):
        sym = transition(bias=bias)
        v = fusion.verify((sym, res.arg_params, res.aux_params), res, input_shapes={"data": other})
        assert v.max_rel <= 1e-4, (other, v)


@pytest.mark.parametrize("kw,reason", [
    ({"pool_type": "max"}, "max pooling, not avg"),
    ({"pad": 1}, "pads (a padded window averages the bias"),
    ({"kernel": 3}, "not 1×1"),
    ({"convention": "full"}, "the full convention"),
])
def test_transition_refusals(kw, reason):
    res = fuse_and_check(transition(**kw), {"data": (1, 8, 8, 6)}, rules=["pool_before_pointwise_conv"])
    assert [n.op for n in res.graph.nodes if not n.is_variable] == ["Convolution", "Pooling"]
    assert reason in text(res), text(res)


def test_no_reference_convolutions():
    """oneDNN falls back to its reference code (orders of magnitude slower) where no optimised kernel
    takes the layouts asked for on this CPU -- the 16-channel blocked layout on a CPU without AVX-512
    (measured: DenseNet-121 0.09x MXNet there). The block then runs NHWC; no "ref:" convolution runs,
    whatever the CPU, and the result is the same."""
    import subprocess
    import sys
    code = (
        "import mxnet as mx, numpy as np, fusion, sys\n"
        "sys.path.insert(0, %r)\n"
        "from test_dense_block import dense_block\n"
        "sym, arg, aux = dense_block(c0=32, layers=2, growth=16, bn_size=2, shape=(1, 32, 12, 12))\n"
        "res = fusion.fuse(sym, arg, aux, input_shapes={'data': (1, 32, 12, 12)}, rules=['default', '-region'])\n"
        "assert 'fused_dense_block' in res.symbol.tojson()\n"
        "v = fusion.verify((sym, arg, aux), res, input_shapes={'data': (2, 32, 12, 12)})\n"
        "assert v.max_rel <= 1e-4, v\n"
        "import ctypes; ctypes.CDLL(None).fflush(None)\n"
        "print('ok')\n" % os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, ONEDNN_VERBOSE="1"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "exec,cpu,convolution," in out        # the control: the check sees the block's convolutions
    assert "exec,cpu,convolution,ref:" not in out, [ln for ln in out.splitlines() if "ref:" in ln][:3]
