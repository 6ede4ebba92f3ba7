"""Gluon door: hybridize(backend="fusion"), optimize_for, export, training under autograd."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

import fusion
from fusion.ir.graph import Graph
from fusion.testing import randomize_batchnorm

RTOL = 1e-4


def make_cnn(seed=0):
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Conv2D(8, 3, padding=1), gluon.nn.BatchNorm(), gluon.nn.Activation("relu"),
                gluon.nn.Conv2D(8, 3, padding=1, use_bias=False), gluon.nn.BatchNorm(),
                gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(5))
    net.initialize(mx.init.Xavier())
    net(mx.nd.zeros((1, 3, 8, 8)))
    params = net.collect_params()
    arg = {name: p.data() for name, p in params.items()}
    randomize_batchnorm(arg, {}, seed)
    for name, p in params.items():
        p.set_data(arg[name])
    return net


def twin(seed=0):
    """Two identical blocks: one plain, one to be fused."""
    return make_cnn(seed), make_cnn(seed)


def rel(a, b):
    return float(np.abs(a.asnumpy() - b.asnumpy()).max() / np.abs(b.asnumpy()).max())


def fused_ops(net):
    return Graph.from_symbol(net._cached_graph[1]).count_ops()


X = mx.nd.array(np.random.default_rng(0).standard_normal((2, 3, 8, 8)))


@pytest.mark.parametrize("static_alloc", [False, True])
def test_hybridize_backend(static_alloc):
    ref, net = twin()
    ref.hybridize()
    net.hybridize(backend=fusion.BACKEND, static_alloc=static_alloc, static_shape=static_alloc)
    assert rel(net(X), ref(X)) <= RTOL
    assert "BatchNorm" not in fused_ops(net)
    assert sum(len(net.fusion_report.rules[r].fused) for r in ("conv_bn", "conv_bn_act")) == 2
    assert rel(net(X), ref(X)) <= RTOL     # second call runs the cached fused graph


def test_optimize_for_then_export_and_reload(tmp_path):
    ref, net = twin()
    net.optimize_for(X, backend="fusion")
    assert "BatchNorm" not in fused_ops(net)
    net.export(str(tmp_path / "fused"))
    sym_text = (tmp_path / "fused-symbol.json").read_text()
    assert "BatchNorm" not in sym_text and "_folded_weight" in sym_text
    loaded = gluon.SymbolBlock.imports(str(tmp_path / "fused-symbol.json"), ["data"],
                                       str(tmp_path / "fused-0000.params"))
    assert rel(loaded(X), ref(X)) <= RTOL


def test_backend_opts_pass_through():
    ref, net = twin()
    net.hybridize(backend="fusion", backend_opts={"rules": "conv_bn"})
    out = net(X)
    assert rel(out, ref(X)) <= RTOL
    assert set(r for r, rr in net.fusion_report.rules.items()) == {"conv_bn"}
    _, net2 = twin()
    net2.hybridize(backend="fusion", backend_opts={"mode": "training"})
    net2(X)
    assert "BatchNorm" in fused_ops(net2)


def test_training_under_autograd_uses_no_inference_only_rewrite():
    ref, net = twin()
    ref.hybridize()
    net.hybridize(backend="fusion")
    grads = []
    for block in (ref, net):
        with autograd.record():
            loss = block(X).sum()
        loss.backward()
        grads.append({k.split("_", 1)[1]: p.grad().asnumpy().copy() for k, p in block.collect_params().items()
                      if p.grad_req != "null"})
    assert net.fusion_report.mode == "training"
    assert "BatchNorm" in fused_ops(net) or not net._cached_graph     # no folding while training
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        np.testing.assert_allclose(grads[1][k], grads[0][k], rtol=1e-4, atol=1e-5)
    # back to inference: the block is fused again, with the (unchanged) moving statistics
    assert rel(net(X), ref(X)) <= RTOL and net.fusion_report.mode == "inference"
    assert "BatchNorm" not in fused_ops(net)


def cnn_symbol():
    """The CNN's graph and its parameters as plain dicts (params, args, aux)."""
    net = make_cnn()
    net.hybridize()
    net(X)
    sym = net._cached_graph[1]
    params = {p.name: p.data() for p in net.collect_params().values()}
    aux_names = set(sym.list_auxiliary_states())
    args = {k: v for k, v in params.items() if k not in aux_names}
    aux = {k: v for k, v in params.items() if k in aux_names}
    return sym, params, args, aux


def test_plain_symbol_optimize_for_updates_param_dicts():
    # MXNet's convention (its MKLDNN partitioner): new params are added, none removed — the same
    # dicts still bind the original symbol (they used to lose every parameter folded away)
    sym, params, args, aux = cnn_symbol()
    before_args, before_aux = dict(args), dict(aux)
    fused = sym.optimize_for("fusion", args, aux)
    assert set(fused.list_arguments()) - {"data"} <= set(args)
    assert set(args) > set(before_args) and all(args[k] is v for k, v in before_args.items())
    assert aux == before_aux
    v = fusion.verify((sym, args, aux), (fused, {k: args[k] for k in fused.list_arguments() if k in args},
                                         {k: aux[k] for k in fused.list_auxiliary_states()}), None, {"data": X.shape})
    assert v.max_rel <= RTOL
    with pytest.raises(ValueError, match="unknown option"):
        sym.optimize_for("fusion", dict(args), {}, colour="blue")


def test_other_backends_unchanged():
    sym, _, args, aux = cnn_symbol()
    part = sym.optimize_for("MKLDNN", args, aux, shape_dict={"data": X.shape})
    assert any(op.startswith("_sg_mkldnn") for op in Graph.from_symbol(part).count_ops())
    ref, net2 = twin()
    net2.hybridize(backend="MKLDNN")
    assert rel(net2(X), ref(X)) <= RTOL


class _SelfAttention(gluon.HybridBlock):
    def __init__(self, units=32, heads=4, **kw):
        super().__init__(**kw)
        self.units, self.heads = units, heads
        with self.name_scope():
            self.qkv = gluon.nn.Dense(3 * units, flatten=False, in_units=units)
            self.out = gluon.nn.Dense(units, flatten=False, in_units=units)
            self.norm = gluon.nn.LayerNorm(in_channels=units)

    def hybrid_forward(self, F, x, mask):
        def split(t):
            return F.reshape(F.transpose(F.reshape(t, shape=(0, 0, self.heads, -1)), axes=(0, 2, 1, 3)),
                             shape=(-3, 0, 0))
        q, k, v = (split(t) for t in F.split(self.qkv(x), num_outputs=3, axis=-1))
        s = F.broadcast_add(F.batch_dot(q, k, transpose_b=True) * (self.units // self.heads) ** -0.5, mask)
        o = F.batch_dot(F.softmax(s, axis=-1), v)
        o = F.reshape(F.transpose(F.reshape(o, shape=(-4, -1, self.heads, 0, 0)), axes=(0, 2, 1, 3)), shape=(0, 0, -3))
        return self.norm(self.out(o) + x)


def test_gluon_attention_block_fuses_and_trains():
    def make():
        mx.random.seed(3)
        net = _SelfAttention()
        net.initialize(mx.init.Xavier())
        return net
    ref, net = make(), make()
    ref.hybridize()
    net.hybridize(backend="fusion")
    rng = np.random.default_rng(0)
    x = mx.nd.array(rng.standard_normal((2, 6, 32)))
    mask = mx.nd.array(np.where(rng.uniform(size=(8, 1, 6)) > 0.2, 0, -1e4))
    assert rel(net(x, mask), ref(x, mask)) <= RTOL
    ops = fused_ops(net)
    assert ops.get("fused_attention") == 1 and "batch_dot" not in ops, ops
    # a training step through the fused graph gives the unfused gradients
    grads = []
    for block in (ref, net):
        with autograd.record():
            loss = (block(x, mask) ** 2).sum()
        loss.backward()
        grads.append([p.grad().asnumpy().copy() for p in block.collect_params().values()])
    assert net.fusion_report.mode == "training"
    for a, b in zip(*grads):
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-5)


def test_unexpected_failure_runs_the_block_unfused(monkeypatch):
    import fusion.api

    def broken(*a, **kw):
        raise RuntimeError("simulated")

    monkeypatch.setattr(fusion.api, "_fuse", broken)     # what fuse() and the backend run
    ref, net = twin()
    ref.hybridize()
    net.hybridize(backend="fusion")
    with pytest.warns(RuntimeWarning, match="runs unfused"):
        out = net(X)
    assert rel(out, ref(X)) <= RTOL


def _gluoncv_twin(build, seed=0):
    """Two blocks with the same values: the second's parameters copied from the first's in order
    (their names differ: Gluon numbers blocks per process)."""
    nets = []
    for _ in range(2):
        mx.random.seed(seed)
        net = build()
        net.initialize(mx.init.Xavier())
        net(mx.nd.zeros((1, 3, 32, 32)))
        nets.append(net)
    arg = {name: p.data() for name, p in nets[0].collect_params().items()}
    randomize_batchnorm(arg, {}, seed)
    for (name, p), q in zip(nets[0].collect_params().items(), nets[1].collect_params().values()):
        p.set_data(arg[name])
        q.set_data(arg[name].copy())
    return nets


@pytest.mark.parametrize("model", ["se_resnext", "resnest"])
@pytest.mark.usefixtures("no_regions")
def test_inference_only_ops_in_a_trainable_block(model):
    """A hybridized block builds the gradient graph of its whole graph even for inference, and its
    parameters want gradients: ops fused for inference only (fused_se, fused_split_attention) must
    not make MXNet refuse the block; training such a fused graph fails with a message that says why."""
    from fusion.testing import gluoncv as gcv
    build = {"se_resnext": lambda: gcv.se_resnext(layers=(1, 1), cardinality=4, bottleneck_width=4, classes=10),
             "resnest": lambda: gcv.resnest(layers=(1, 1), radix=2, bottleneck_width=16, stem_width=8,
                                            classes=10)}[model]
    ref, net = _gluoncv_twin(build)
    assert all(p.grad_req == "write" for p in net.collect_params().values() if p.name.endswith("weight"))
    x = mx.nd.array(np.random.default_rng(1).standard_normal((2, 3, 32, 32)))
    ref.hybridize()
    net.hybridize(backend="fusion")
    assert rel(net(x), ref(x)) <= RTOL
    op = {"se_resnext": "fused_se", "resnest": "fused_split_attention"}[model]
    assert fused_ops(net).get(op, 0) >= 1
    x2 = mx.nd.array(np.random.default_rng(2).standard_normal((3, 3, 32, 32)))
    assert rel(net(x2), ref(x2)) <= RTOL          # another batch size, same block
    # fused for inference on purpose, then trained: a clear error, not a wrong gradient
    forced = _gluoncv_twin(build)[1]
    forced.hybridize(backend="fusion", mode="inference")
    with autograd.record():
        loss = forced(x).sum()
    with pytest.raises(mx.base.MXNetError, match="fused for inference.*mode='training'"):
        loss.backward()
        mx.nd.waitall()


def test_ops_fused_for_inference_only_report_no_backward():
    from fusion.native import library as _native
    caps = _native.capabilities()
    for op in ("fused_se", "fused_split_attention", "fused_grouped_conv", "fused_concat_scale_act",
               "fused_inverted_residual", "fused_dense_block", "fused_deconv", "fused_box_nms", "fused_max_pool",
               "fused_roi_align", "fused_bilinear_resize"):
        assert caps[op]["backward"] == frozenset(), op
    assert "cpu" in caps["fused_dense"]["backward"]
