"""fused_add_layer_norm vs NumPy (forward) and MXNet add + LayerNorm autograd (backward).

Tolerances (fp32): forward rtol=1e-5, atol=2e-5; backward rtol=1e-4, atol=1e-4.
"""
import mxnet as mx
import numpy as np
import pytest
from mxnet.base import MXNetError
from kernel_fixtures import fused_ops  # noqa: F401  (builds + loads the library)

FWD = dict(rtol=1e-5, atol=2e-5)
BWD = dict(rtol=1e-4, atol=1e-4)


def rnd(*shape, seed=0):
    return np.random.RandomState(seed + len(shape)).uniform(-1, 1, shape).astype(np.float32)


def ref(a, b, g, be, eps):
    s = a.astype(np.float64) + b
    mu = s.mean(-1, keepdims=True)
    var = ((s - mu) ** 2).mean(-1, keepdims=True)
    return (s - mu) / np.sqrt(var + eps) * g + be, s


@pytest.mark.parametrize("ashape,bshape", [((1, 1), (1, 1)), ((4, 768), (4, 768)),
                                           ((2, 7, 33), (2, 7, 33)), ((2, 7, 33), (7, 33)),
                                           ((2, 7, 33), (1, 7, 33)), ((3, 5, 16), (16,))])
@pytest.mark.parametrize("output_sum", [False, True])
def test_forward(ashape, bshape, output_sum):
    a, b = rnd(*ashape), rnd(*bshape, seed=1)
    C = ashape[-1]
    g, be = rnd(C, seed=2), rnd(C, seed=3)
    out = mx.nd.fused_add_layer_norm(*(mx.nd.array(x) for x in (a, b, g, be)), eps=1e-5,
                                     output_sum=output_sum)
    y, s = ref(a, b, g, be, 1e-5)
    if output_sum:
        np.testing.assert_allclose(out[0].asnumpy(), y, **FWD)
        np.testing.assert_allclose(out[1].asnumpy(), s, **FWD)
    else:
        np.testing.assert_allclose(out.asnumpy(), y, **FWD)


# C = 1 with eps 1e-12: the normalized value is 0 and its gradient cancels exactly (0 in MXNet;
# rstd = 1e6 magnifies any rounding residue left in the cancellation)
@pytest.mark.parametrize("bshape,C,eps", [((3, 6, 20), 20, 1e-3), ((6, 20), 20, 1e-3), ((3, 6, 1), 1, 1e-12),
                                          ((3, 6, 2), 2, 1e-12)])
@pytest.mark.parametrize("output_sum", [False, True])
def test_backward_vs_mxnet(bshape, C, eps, output_sum):
    a, b, g, be = rnd(3, 6, C), rnd(*bshape, seed=1), rnd(C, seed=2), rnd(C, seed=3)
    dy, ds = rnd(3, 6, C, seed=4), rnd(3, 6, C, seed=5)
    xs = [mx.nd.array(x) for x in (a, b, g, be)]
    res = []
    for fused in (False, True):
        for x in xs:
            x.attach_grad()
        with mx.autograd.record():
            if fused:
                o = mx.nd.fused_add_layer_norm(*xs, eps=eps, output_sum=output_sum)
                outs = list(o) if output_sum else [o]
            else:
                s = mx.nd.broadcast_add(xs[0], xs[1])
                outs = [mx.nd.LayerNorm(s, xs[2], xs[3], eps=eps)] + ([s] if output_sum else [])
        heads = [mx.nd.array(dy)] + ([mx.nd.array(ds)] if output_sum else [])
        mx.autograd.backward(outs, heads)
        res.append([x.grad.asnumpy().copy() for x in xs])
    for got, want in zip(res[1], res[0]):
        np.testing.assert_allclose(got, want, **BWD)


@pytest.mark.parametrize("attrs,msg", [(dict(axis=1), "axis"), (dict(output_sum="2"), "output_sum"),
                                       (dict(eps="tiny"), "eps")])
def test_invalid_attributes(attrs, msg):
    x = mx.nd.ones((2, 4))
    with pytest.raises(MXNetError, match=msg):
        mx.nd.fused_add_layer_norm(x, x, mx.nd.ones(4), mx.nd.ones(4), **attrs).wait_to_read()


def test_bad_broadcast_is_reported():
    with pytest.raises(MXNetError, match="do not broadcast together"):
        mx.nd.fused_add_layer_norm(mx.nd.ones((2, 4)), mx.nd.ones((3, 4)), mx.nd.ones(4),
                                   mx.nd.ones(4)).wait_to_read()


@pytest.mark.parametrize("ashape,bshape", [
    ((2, 2, 1), (2, 1, 1)),        # both broadcast: a over nothing, b over axis 1 (and C = 1)
    ((1, 3, 5), (2, 1, 5)),        # each operand broadcast along another axis
    ((7, 33), (2, 1, 33)),         # b of higher rank than a
    ((2, 3, 1), (2, 3, 6)),        # a's last axis broadcast along the row
    ((1, 1, 6), (4, 3, 6)),        # a the broadcast one
    ((3, 1, 6), (1, 4, 1))])       # both, the last axis too
@pytest.mark.parametrize("output_sum", [False, True])
def test_numpy_broadcasting_as_broadcast_add(ashape, bshape, output_sum):
    """a and b broadcast as broadcast_add does, whichever is the larger and on any axis: forward and
    every gradient equal MXNet's broadcast_add -> LayerNorm (the rule relies on it at any shape)."""
    a, b = rnd(*ashape), rnd(*bshape, seed=1)
    C = np.broadcast_shapes(ashape, bshape)[-1]
    g, be = rnd(C, seed=2), rnd(C, seed=3)
    names = ["a", "b", "g", "be"]
    va = [mx.sym.var(n) for n in names]
    fused = mx.sym.fused_add_layer_norm(*va, eps=1e-5, output_sum=output_sum)
    s = mx.sym.broadcast_add(va[0], va[1])
    plain = mx.sym.LayerNorm(s, va[2], va[3], eps=1e-5, axis=-1)
    plain = mx.sym.Group([plain, s]) if output_sum else plain
    results = []
    for sym in (fused, plain):
        args = {n: mx.nd.array(v) for n, v in zip(names, (a, b, g, be))}
        grads = {n: mx.nd.zeros(v.shape) for n, v in args.items()}
        exe = sym.bind(mx.cpu(), args, args_grad=grads)
        outs = exe.forward(is_train=True)
        heads = [mx.nd.array(rnd(*o.shape, seed=5 + i)) for i, o in enumerate(outs)]
        exe.backward(heads)
        results.append(([o.asnumpy() for o in outs], {n: v.asnumpy() for n, v in grads.items()}))
    (fo, fg), (po, pg) = results
    for x, y in zip(fo, po):
        assert x.shape == y.shape
        np.testing.assert_allclose(x, y, **FWD)
    for n in names:
        assert fg[n].shape == pg[n].shape
        np.testing.assert_allclose(fg[n], pg[n], **BWD)


def test_symbol_json_roundtrip_two_outputs():
    names = ["a", "b", "g", "be"]
    s = mx.sym.fused_add_layer_norm(*[mx.sym.var(n) for n in names], output_sum=True, eps=1e-6)
    s2 = mx.sym.load_json(s.tojson())
    assert len(s2.list_outputs()) == 2
    vals = [rnd(2, 8), rnd(2, 8, seed=1), rnd(8, seed=2), rnd(8, seed=3)]
    outs = s2.bind(mx.cpu(), dict(zip(names, map(mx.nd.array, vals)))).forward()
    y, s_ = ref(*vals, 1e-6)
    np.testing.assert_allclose(outs[0].asnumpy(), y, **FWD)
    np.testing.assert_allclose(outs[1].asnumpy(), s_, **FWD)
