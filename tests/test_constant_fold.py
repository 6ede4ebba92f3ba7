"""Inference clean-ups (patterns/constant_fold.py): Dropout removal, parameter-only ops precomputed."""
import mxnet as mx

import fusion

from conftest import fuse_and_check, ops, random_params

S = mx.sym


def test_dropout_removed_at_inference_kept_in_training_and_mc_dropout_kept():
    y = S.Dropout(S.relu(S.var("x")), p=0.3) * 2.0
    res = fuse_and_check(y, {"x": (2, 3)}, rules=["dropout"])
    assert "Dropout" not in ops(res)
    assert "Dropout" in ops(fusion.fuse(y, rules=["dropout"], mode="training"))
    mc = S.Dropout(S.var("x"), p=0.3, mode="always")
    res = fusion.fuse(mc, rules=["dropout"])
    assert ops(res) == {"Dropout": 1}
    assert "Monte-Carlo" in list(res.report.rules["dropout"].rejected.values())[0]


def test_weight_built_from_parameters_is_folded_then_fused():
    # GluonNLP-style: the projection weight is assembled from q/k/v weights on every call
    w = S.Concat(*[S.reshape(S.var(n), shape=(4, 2, 6)) for n in ("wq", "wk", "wv")], dim=1)
    y = S.FullyConnected(S.var("x"), weight=S.reshape(w, shape=(-1, 6)), num_hidden=24, no_bias=True,
                         flatten=False, name="qkv")
    shapes = {"x": (2, 9, 6), "wq": (8, 6), "wk": (8, 6), "wv": (8, 6)}
    arg, aux = random_params(y, shapes, inputs={"x"})
    res = fuse_and_check(y, {"x": (2, 9, 6)}, arg, aux, rules=["constant_fold", "dense_act"])
    assert ops(res) == {"fused_dense": 1}
    assert not {"wq", "wk", "wv"} & set(res.arg_params)


def test_data_dependent_ops_not_folded():
    y = S.reshape(S.var("x"), shape=(-1,)) + S.reshape(S.var("b"), shape=(-1,))
    arg = {"b": mx.nd.ones((2, 3))}
    res = fuse_and_check(y, {"x": (2, 3)}, arg, {}, rules=["inference_cleanup"])
    assert ops(res) == {"Reshape": 1, "elemwise_add": 1}      # only the parameter's reshape folded
    assert fusion.fuse(y, arg, {}, rules=["inference_cleanup"], mode="training").report.fused_count == 0


def test_oversized_result_not_materialized(monkeypatch):
    """Folding stops at MAX_BYTES per input; the report says so (the limit is lowered here
    so the test needs no gigabyte parameter)."""
    import patterns.constant_fold as cf
    monkeypatch.setattr(cf, "MAX_BYTES", 16)
    y = S.reshape(S.var("b"), shape=(-1,)) + S.var("x")
    arg = {"b": mx.nd.ones((2, 3))}
    res = fuse_and_check(y, {"x": (6,)}, arg, {}, rules=["inference_cleanup"])
    assert res.report.fused_count == 0
    reasons = res.report.rules["constant_fold"].near_misses
    assert any("24-byte parameter (limit 16)" in r for r in reasons.values()), reasons


def test_value_that_would_hold_nan_or_inf_is_not_folded():
    """rsqrt of a parameter with a negative entry: the folded parameter would hold NaN, which fuse()
    refuses in a params file — the fused model must fuse again (idempotence); the op stays."""
    y = S.rsqrt(S.var("p")) * S.var("x")
    arg = {"p": mx.nd.array([4.0, -1.0, 1.0])}
    res = fuse_and_check(y, {"x": (3,)}, arg, {}, rules=["inference_cleanup"])
    assert res.report.fused_count == 0
    assert "NaN or inf" in res.report.to_text(explain=True)
    again = fusion.fuse(res.symbol, res.arg_params, res.aux_params, input_shapes={"x": (3,)})
    assert again.report is not None
    ok = fuse_and_check(y, {"x": (3,)}, {"p": mx.nd.array([4.0, 2.0, 1.0])}, {}, rules=["inference_cleanup"])
    assert ok.report.fused_count == 1


def test_reshape_round_trip_removed_in_inference_and_training_others_kept_unreported():
    """Reshapes that give back their input's shape at every probe are the identity (GluonNLP splits
    the attention probabilities into heads and merges them back); any other reshape stays, and
    its refusal is not news (the report lists none)."""
    import numpy as np

    x = S.var("x")
    rt = S.reshape(S.reshape(S.relu(x), shape=(-1, 1, 0, 0), reverse=True), shape=(-1, 0, 0), reverse=True)
    kept = S.reshape(S.relu(x, name="r2"), shape=(0, -1))
    y = S.Group([S.batch_dot(rt, x) * 2.0, kept, S.squeeze(S.expand_dims(x, axis=1), axis=1) + 1.0])
    res = fuse_and_check(y, {"x": (4, 3, 3)}, {}, {}, rules=["reshape_identity"])
    rr = res.report.rules["reshape_identity"]
    assert len(rr.fused) == 2 and not rr.rejected, (rr.fused, rr.rejected)
    assert any("gives (4, 9) from (4, 3, 3): not the same shape" in r for r in rr.near_misses.values()), \
        rr.near_misses                                      # the kept reshape: for --explain only
    assert "rejected reshape_identity" not in res.report.to_text()
    assert "near-misses of reshape_identity" in res.report.to_text(explain=True)
    assert ops(res).get("Reshape") == 1 and "expand_dims" not in ops(res)
    # training: the same, gradients unchanged
    tr = fusion.fuse(y, {}, {}, mode="training", rules=["reshape_identity"], input_shapes={"x": (4, 3, 3)})
    assert len(tr.report.rules["reshape_identity"].fused) == 2
    xv = mx.nd.array(np.random.default_rng(0).standard_normal((4, 3, 3)))
    got = []
    for s in (y, tr.symbol):
        g = mx.nd.zeros((4, 3, 3))
        e = s.bind(mx.cpu(), {"x": xv}, args_grad={"x": g})
        outs = e.forward(is_train=True)
        e.backward([mx.nd.ones(o.shape) for o in outs])
        got.append([o.asnumpy() for o in outs] + [g.asnumpy()])
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)


def test_reshape_that_only_matches_at_the_given_shape_is_kept():
    """(B, S) → (S, B) by Reshape is a round trip only where B == S: the probes (another batch
    size) tell it apart, and without input shapes nothing is removed."""
    y = S.reshape(S.reshape(S.var("x"), shape=(3, 3)), shape=(0, 0)) * 1.0
    res = fuse_and_check(y, {"x": (3, 3)}, {}, {}, rules=["reshape_identity"])
    assert res.report.rules["reshape_identity"].fused          # (3, 3) -> (3, 3): the same shape, always
    z = S.reshape(S.transpose(S.reshape(S.var("x"), shape=(-1,))), shape=(0,)) * 1.0
    rz = fusion.fuse(z, rules=["reshape_identity"]).report
    assert not rz.fused_count
    assert any("unknown (pass input shapes)" in r for r in rz.rules["reshape_identity"].near_misses.values())
    w = S.reshape(S.var("x"), shape=(0, -1, 2)) * 1.0          # (B, 2S) -> (B, S, 2): another shape
    rw = fuse_and_check(w, {"x": (2, 4)}, {}, {}, rules=["reshape_identity"]).report
    assert not rw.fused_count
    assert any("gives (2, 2, 2) from (2, 4)" in r for r in rw.rules["reshape_identity"].near_misses.values())


def test_reshape_round_trip_that_names_a_size_is_kept():
    """(2, 3) → (3, -1) → (2, -1) gives (2, 3) back, but at batch 4 (4, 3) → (3, 4) → (2, 6): the
    graph's probes cannot show that (batch 3 does not run), the chain run alone does."""
    y = S.reshape(S.reshape(S.var("x"), shape=(3, -1)), shape=(2, -1)) * 1.0
    res = fuse_and_check(y, {"x": (2, 3)}, {}, {}, rules=["reshape_identity"])
    assert not res.report.fused_count
    reasons = res.report.rules["reshape_identity"].near_misses.values()
    assert any("not the same shape at every size" in r for r in reasons), reasons
