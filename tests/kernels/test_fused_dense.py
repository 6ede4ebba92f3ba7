"""fused_dense vs NumPy (forward) and MXNet FullyConnected + activation (backward).

Tolerances (fp32): forward rtol=1e-5, atol=1e-5 (float64 reference); backward
rtol=1e-4, atol=1e-4 vs MXNet autograd.
"""
import math

import mxnet as mx
import numpy as np
import pytest
from mxnet.base import MXNetError
from kernel_fixtures import fused_ops, grads, run_python  # noqa: F401  (fused_ops builds + loads the library)
from references import np_act

FWD = dict(rtol=1e-5, atol=1e-5)
BWD = dict(rtol=1e-4, atol=1e-4)
ACTS = ["none", "relu", "act_relu", "sigmoid", "tanh", "softrelu", "leaky", "gelu_erf", "gelu_tanh"]


def mx_act(z, act, slope=0.25):
    if act == "relu":       # MXNet's relu operator; act_relu is Activation(act_type='relu')
        return mx.nd.relu(z)
    if act == "act_relu":
        return mx.nd.Activation(z, act_type="relu")
    if act in ("sigmoid", "tanh", "softrelu"):
        return mx.nd.Activation(z, act_type=act)
    if act == "leaky":
        return mx.nd.LeakyReLU(z, act_type="leaky", slope=slope)
    if act == "gelu_erf":
        return mx.nd.LeakyReLU(z, act_type="gelu")
    if act == "gelu_tanh":
        return 0.5 * z * (1 + mx.nd.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))
    return z


def rnd(*shape, seed=0):
    return np.random.RandomState(seed + len(shape)).uniform(-1, 1, shape).astype(np.float32)


@pytest.mark.parametrize("act", ACTS)
def test_forward_acts(act):
    x, w, b = rnd(37, 50), rnd(70, 50, seed=1) * 2, rnd(70, seed=2)
    z = x.astype(np.float64) @ w.T + b
    got = mx.nd.fused_dense(mx.nd.array(x), mx.nd.array(w), mx.nd.array(b), act=act).asnumpy()
    np.testing.assert_allclose(got, np_act(z, act), **FWD)


@pytest.mark.parametrize("shape,flatten", [((1, 3), True), ((2, 3, 4), True), ((2, 3, 4), False),
                                           ((300, 17), False), ((1, 1, 1, 5), False)])
def test_flatten_and_no_bias(shape, flatten):
    x = rnd(*shape)
    K = int(np.prod(shape[1:])) if flatten else shape[-1]
    w = rnd(9, K, seed=1)
    got = mx.nd.fused_dense(mx.nd.array(x), mx.nd.array(w), no_bias=True, flatten=flatten)
    want = mx.nd.FullyConnected(mx.nd.array(x), mx.nd.array(w), num_hidden=9, no_bias=True,
                                flatten=flatten)
    assert got.shape == want.shape
    np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), **FWD)


def test_heads_bhsd_output():
    B, S, K, H, D = 2, 7, 16, 3, 8
    x, w, b = rnd(B, S, K), rnd(H * D, K, seed=1), rnd(H * D, seed=2)
    got = mx.nd.fused_dense(mx.nd.array(x), mx.nd.array(w), mx.nd.array(b), flatten=False,
                            out_layout="heads_bhsd", heads=H, act="relu").asnumpy()
    z = np.maximum(x @ w.T + b, 0)
    np.testing.assert_allclose(got, z.reshape(B, S, H, D).transpose(0, 2, 1, 3), **FWD)




@pytest.mark.parametrize("act", ACTS)
def test_backward_vs_mxnet(act):
    x, w, b = rnd(2, 9, 12), rnd(20, 12, seed=1), rnd(20, seed=2)
    dy = rnd(2, 9, 20, seed=3)
    want = grads(lambda x, w, b: mx_act(mx.nd.FullyConnected(x, w, b, num_hidden=20,
                                                              flatten=False), act), [x, w, b], dy)
    got = grads(lambda x, w, b: mx.nd.fused_dense(x, w, b, act=act, flatten=False), [x, w, b], dy)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, **BWD)


def test_backward_heads_and_no_bias():
    B, S, K, H, D = 2, 5, 6, 2, 4
    x, w = rnd(B, S, K), rnd(H * D, K, seed=1)
    dy = rnd(B, H, S, D, seed=3)

    def unfused(x, w):
        y = mx.nd.FullyConnected(x, w, num_hidden=H * D, no_bias=True, flatten=False)
        return mx.nd.tanh(y).reshape((B, S, H, D)).transpose((0, 2, 1, 3))

    want = grads(unfused, [x, w], dy)
    got = grads(lambda x, w: mx.nd.fused_dense(x, w, no_bias=True, flatten=False, act="tanh",
                                                out_layout="heads_bhsd", heads=H), [x, w], dy)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, **BWD)


def test_packed_weight_follows_weight_updates():
    """The op caches W^T; an in-place weight update must be seen on the next forward."""
    x, w, b = rnd(4, 8), rnd(6, 8, seed=1), rnd(6, seed=2)
    s = mx.sym.fused_dense(mx.sym.var("x"), mx.sym.var("w"), mx.sym.var("b"))
    args = {"x": mx.nd.array(x), "w": mx.nd.array(w), "b": mx.nd.array(b)}
    ex = s.bind(mx.cpu(), args, grad_req="null")
    for _ in range(3):  # 1st call multiplies by W, 2nd packs W^T, 3rd reuses the packing
        np.testing.assert_allclose(ex.forward()[0].asnumpy(), x @ w.T + b, **FWD)
    args["w"][:] = 2 * w
    for _ in range(3):
        np.testing.assert_allclose(ex.forward()[0].asnumpy(), x @ (2 * w).T + b, **FWD)


@pytest.mark.parametrize("M,K,N,act,bias", [
    (33, 70, 48, "none", True), (1, 64, 96, "gelu_erf", True), (128, 96, 40, "relu", False),
    (7, 300, 17, "sigmoid", True),
])
def test_prepacked_matmul_path(M, K, N, act, bias):
    """From the second call on, the plain output goes through oneDNN's matmul with the
    weight prepacked into its blocked layout (bias added by the matmul, activation
    after): odd shapes, with and without bias, must match the first (sgemm) call."""
    x, w, b = rnd(M, K), rnd(N, K, seed=1), rnd(N, seed=2)
    xs, ws, bs = mx.sym.var("x"), mx.sym.var("w"), mx.sym.var("b")
    s = (mx.sym.fused_dense(xs, ws, bs, act=act) if bias else
         mx.sym.fused_dense(xs, ws, no_bias=True, act=act, num_hidden=N))
    args = {"x": mx.nd.array(x), "w": mx.nd.array(w)}
    if bias:
        args["b"] = mx.nd.array(b)
    ex = s.bind(mx.cpu(), args, grad_req="null")
    outs = [ex.forward()[0].asnumpy() for _ in range(4)]
    want = np_act(x.astype(np.float64) @ w.T.astype(np.float64) + (b if bias else 0), act)
    for o in outs:
        np.testing.assert_allclose(o, want, **FWD)
    np.testing.assert_allclose(outs[3], outs[0], rtol=1e-5, atol=1e-5)


def test_sgemm_path_without_dnnl_matmul():
    """MXFUSION_NO_DNNL_MATMUL=1 (or a oneDNN without the matmul API) sends every plain
    output through dnnl_sgemm: first call with W as is, later calls with W^T packed."""
    code = (
        "import numpy as np, mxnet as mx, fusion\n"
        "from references import np_act\n"
        "rs = np.random.RandomState(0)\n"
        "x, w, b = (rs.uniform(-1, 1, s).astype(np.float32) for s in [(33, 70), (48, 70), (48,)])\n"
        "for act in ['none', 'gelu_erf']:\n"
        "    ex = mx.sym.fused_dense(mx.sym.var('x'), mx.sym.var('w'), mx.sym.var('b'), act=act).bind(\n"
        "        mx.cpu(), {'x': mx.nd.array(x), 'w': mx.nd.array(w), 'b': mx.nd.array(b)})\n"
        "    want = np_act(x.astype(np.float64) @ w.T + b, act)\n"
        "    for _ in range(3):\n"
        "        np.testing.assert_allclose(ex.forward()[0].asnumpy(), want, rtol=1e-5, atol=1e-5)\n"
        "import ctypes; ctypes.CDLL(None).fflush(None)\n"  # oneDNN's verbose lines
        "print('ok')\n")
    # "0": the control, showing that the check sees matmul runs
    runs = {off: run_python(code, MXFUSION_NO_DNNL_MATMUL=off, ONEDNN_VERBOSE="1")
            for off in ("1", "0")}
    assert "exec,cpu,matmul" not in runs["1"]  # no matmul primitive ran
    assert "exec,cpu,matmul" in runs["0"]


def test_prepacked_matmul_many_batch_sizes():
    """One op state serving many row counts (a hybridized block fed different batch
    sizes): each size gets its own primitive, up to a limit, then dnnl_sgemm."""
    class Net(mx.gluon.HybridBlock):
        def __init__(self, **kw):
            super().__init__(**kw)
            with self.name_scope():
                self.w = self.params.get("w", shape=(24, 16), init=mx.init.Uniform(0.5))
                self.b = self.params.get("b", shape=(24,), init=mx.init.Uniform(0.5))

        def hybrid_forward(self, F, x, w, b):
            return F.fused_dense(x, w, b, act="tanh")

    net = Net()
    net.initialize()
    net.hybridize(static_alloc=True)
    w, b = net.w.data().asnumpy(), net.b.data().asnumpy()
    for rep in range(3):
        for m in range(1, 14):
            x = rnd(m, 16, seed=m)
            np.testing.assert_allclose(net(mx.nd.array(x)).asnumpy(), np.tanh(x @ w.T + b), **FWD)


def test_packed_weight_with_head_split_output():
    B, S, K, H, D = 2, 3, 8, 2, 4
    x, w = rnd(B, S, K), rnd(H * D, K, seed=1)
    s = mx.sym.fused_dense(mx.sym.var("x"), mx.sym.var("w"), no_bias=True, flatten=False,
                           out_layout="heads_bhsd", heads=H)
    ex = s.bind(mx.cpu(), {"x": mx.nd.array(x), "w": mx.nd.array(w)}, grad_req="null")
    want = (x @ w.T).reshape(B, S, H, D).transpose(0, 2, 1, 3)
    for _ in range(3):
        np.testing.assert_allclose(ex.forward()[0].asnumpy(), want, **FWD)


@pytest.mark.parametrize("attrs,msg", [
    (dict(act="swish"), "act"),
    (dict(flatten="yes"), "flatten"),
    (dict(num_hidden=7), "num_hidden"),
    (dict(out_layout="heads_bhsd", flatten=False), "heads"),
    (dict(out_layout="bshd"), "out_layout"),
])
def test_invalid_attributes(attrs, msg):
    x, w, b = mx.nd.ones((2, 4)), mx.nd.ones((6, 4)), mx.nd.ones((6,))
    with pytest.raises(MXNetError, match=msg):
        mx.nd.fused_dense(x, w, b, **attrs).wait_to_read()


def test_shape_mismatch_is_reported():
    with pytest.raises(MXNetError, match="K=5"):
        mx.nd.fused_dense(mx.nd.ones((2, 5)), mx.nd.ones((6, 4)), mx.nd.ones((6,))).wait_to_read()


def test_cached_op_sees_weight_updates_and_trains():
    """Through a hybridized block (CachedOp keeps the op state): the packed weight must
    follow optimizer updates, and gradients must match FullyConnected's."""
    class Net(mx.gluon.HybridBlock):
        def __init__(self, fused, **kw):
            super().__init__(**kw)
            self.fused = fused
            with self.name_scope():
                self.w = self.params.get("w", shape=(6, 8), init=mx.init.Constant(0.1))
                self.b = self.params.get("b", shape=(6,), init=mx.init.Zero())

        def hybrid_forward(self, F, x, w, b):
            if self.fused:
                return F.fused_dense(x, w, b, act="tanh")
            return F.tanh(F.FullyConnected(x, w, b, num_hidden=6))

    x = mx.nd.array(rnd(4, 8))
    outs = []
    for fused in (True, False):
        net = Net(fused)
        net.initialize()
        net.hybridize()
        tr = mx.gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.5})
        hist = []
        for _ in range(3):
            with mx.autograd.record():
                y = net(x)
                loss = ((y - 0.9) ** 2).sum()
            loss.backward()
            tr.step(1)
            hist.append(y.asnumpy())
        outs.append(hist)
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, **BWD)
    assert not np.allclose(outs[0][0], outs[0][2])  # the weights did change


def test_symbol_json_roundtrip():
    s = mx.sym.fused_dense(mx.sym.var("x"), mx.sym.var("w"), no_bias=True, act="leaky",
                           slope=0.1, flatten=False)
    s2 = mx.sym.load_json(s.tojson())
    x, w = rnd(2, 3, 5), rnd(4, 5, seed=1)
    out = s2.bind(mx.cpu(), {"x": mx.nd.array(x), "w": mx.nd.array(w)}).forward()[0].asnumpy()
    np.testing.assert_allclose(out, np_act(x.astype(np.float64) @ w.T, "leaky", 0.1), **FWD)
