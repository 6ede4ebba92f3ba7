"""verify where a model's outputs stop depending continuously on the values before them: cut at the
inputs of its sorts and steps (fusion/check/cuts.py) — CenterNet's peak picking
``heat * (max_pool(heat) == heat)`` and its ``topk`` — and, where a value still differs, judged
against a float64 run of the original.  Near-ties and the original's own rounding pass; a wrong
value before, at or after a cut still fails."""
import json

import mxnet as mx
import numpy as np

import fusion
from fusion.check.cuts import ROUNDING_FACTOR
from fusion.ir.names import GIVES_BACK

S = mx.sym
N = 64


def tied():
    """(1, N) values in equal pairs: which of a pair sorts first, or equals its neighbourhood's maximum,
    depends on the last bit."""
    rng = np.random.RandomState(0)
    v = np.repeat(rng.uniform(0.1, 1.0, N // 2), 2).astype(np.float32)
    return {"data": v.reshape(1, N)}


def weights(scale=1.0, nudge=0.0, table_scale=1.0, wrong=0.0):
    w = np.ones((1, N), np.float32) * scale
    w[0, 1::2] += nudge                  # the second of each pair: a rounding's worth more
    w[0, ::8] *= 1.0 - wrong             # a wrong weight: other detections, other peaks
    table = np.arange(N * 4, dtype=np.float32).reshape(N, 4) * table_scale
    return {"w": mx.nd.array(w), "table": mx.nd.array(table)}


def detector(after=None):
    """scores → topk indices → each detection's box taken from a table by its index (no row-set layout)."""
    scores = S.broadcast_mul(S.var("data"), S.var("w"), name="scores")
    idx = S.topk(scores, k=10, ret_typ="indices", name="topk")
    boxes = S.take(S.var("table"), S.reshape(idx, shape=(-1,)), name="boxes")
    return after(boxes) if after else boxes


def peaks(fused_form=False):
    """CenterNet's peak picking on a (1, 1, 8, 8) heat map: heat * (max_pool(heat) == heat)."""
    heat = S.reshape(S.broadcast_mul(S.var("data"), S.var("w")), shape=(1, 1, 8, 8), name="heat")
    pool = S.Pooling(heat, kernel=(3, 3), pad=(1, 1), stride=(1, 1), pool_type="max", name="pool")
    if fused_form:           # the library's fused op under the original's name, the step inside it
        return S.fused_elemwise(pool, heat, expr="mul(eq(x0, x1), x1)", num_args=2, name="keep")
    return S.elemwise_mul(S.broadcast_equal(pool, heat, name="eq"), heat, name="keep")


def check(original, fused, fused_params, feed=None):
    return fusion.verify(original, (fused, fused_params, {}), (weights(), {}), inputs=feed or tied())


def test_a_sort_choosing_among_ties_passes_piecewise():
    v = check(detector(), detector(), weights(nudge=1.2e-7))
    assert v.status() == "OK", v
    assert v.piecewise is not None and v.piecewise["cuts"] == ["topk"]
    assert v.piecewise["whole_max_rel"] > 1e-2                # the boxes of other detections, compared whole
    assert v.max_rel < 1e-6


def test_an_error_before_or_after_the_sort_still_fails():
    assert check(detector(), detector(), weights(wrong=0.3)).status() == "MISMATCH"
    v = check(detector(), detector(), weights(nudge=1.2e-7, table_scale=1.01))
    assert v.status() == "MISMATCH", v


def test_a_step_flipping_on_ties_passes_piecewise():
    v = check(peaks(), peaks(), weights(nudge=1.2e-7))
    assert v.status() == "OK", v
    assert v.piecewise is not None and v.piecewise["cuts"] == ["eq"]
    assert v.piecewise["whole_max_rel"] > 0.1
    assert check(peaks(), peaks(), weights(wrong=0.01)).status() == "MISMATCH"


def test_a_step_inside_a_fused_op_is_cut_at_the_fused_ops_inputs():
    v = check(peaks(), peaks(fused_form=True), weights(nudge=1.2e-7))
    assert v.status() == "OK", v
    assert v.piecewise is not None and v.piecewise["cuts"] == ["keep"]
    assert {f for _, f, _ in v.piecewise["inputs"]} == {"input 0", "input 1"}
    assert check(peaks(), peaks(fused_form=True), weights(wrong=0.01)).status() == "MISMATCH"


def test_a_step_reading_values_a_node_of_several_outputs_gives_back_is_cut_at_those_values():
    """A region gives back several of the original's values under one name (its ``__gives_back__``
    says which): the cut before the fused op reading them feeds each the original's value there."""
    heat = S.reshape(S.broadcast_mul(S.var("data"), S.var("w")), shape=(1, 1, 8, 8), name="heat_f")
    pool = S.Pooling(heat, kernel=(3, 3), pad=(1, 1), stride=(1, 1), pool_type="max", name="pool_f")
    given = json.dumps([["pool", 0], ["heat", 0]])
    both = S.split(S.concat(pool, heat, dim=1), num_outputs=2, axis=1, name="pool", attr={GIVES_BACK: given})
    fused = S.fused_elemwise(both[0], both[1], expr="mul(eq(x0, x1), x1)", num_args=2, name="keep")
    v = check(peaks(), fused, weights(nudge=1.2e-7))
    assert v.status() == "OK", v
    assert v.piecewise is not None and v.piecewise["cuts"] == ["keep"]
    assert check(peaks(), fused, weights(wrong=0.01)).status() == "MISMATCH"


# ---------------------------------------------------------------------------------------- float64

K = 2048


def ill_conditioned(split=False):
    """sigmoid(x · w + shift) with terms of ±50 summing to about 0: float32's rounding of the sum moves
    the sigmoid by more than 1e-4.  ``split``: the same sums added in another order (backwards), as a
    fused kernel may."""
    x, w = S.var("data"), S.var("w64")
    if split:
        z = S.FullyConnected(S.reverse(x, axis=1), S.reverse(w, axis=1), no_bias=True, num_hidden=8)
    else:
        z = S.FullyConnected(x, w, no_bias=True, num_hidden=8)
    return S.sigmoid(S.broadcast_add(z, S.var("shift")), name="prob")


def conditioned_inputs():
    rng = np.random.RandomState(1)
    x = rng.uniform(-1, 1, (4, K)).astype(np.float32)
    w = (rng.uniform(-50, 50, (8, K))).astype(np.float32)
    # each sum brought near 0 (in float64), where the sigmoid is steepest
    shift = -(x.astype(np.float64) @ w.T.astype(np.float64))
    return {"data": x}, {"w64": mx.nd.array(w), "shift": mx.nd.array(shift.astype(np.float32))}


def test_a_difference_within_the_originals_own_rounding_passes():
    feed, params = conditioned_inputs()
    v = fusion.verify(ill_conditioned(), (ill_conditioned(split=True), params, {}), (params, {}), inputs=feed)
    assert v.max_rel > 1e-4, v                      # compared with the original alone: above the tolerance
    assert v.status() == "OK", v
    (judged,) = v.rounding
    assert judged["kind"] == "output" and judged["original_f32"] > 0
    assert judged["fused"] <= ROUNDING_FACTOR * judged["original_f32"]
    assert any("judged against the original run in float64" in d for d in v.details())
    assert v.to_dict()["float64"][0]["value"] == "prob_output"


def test_an_error_above_the_originals_own_rounding_still_fails():
    feed, params = conditioned_inputs()
    wrong = dict(params)
    wrong["shift"] = params["shift"] + 0.05
    v = fusion.verify(ill_conditioned(), (ill_conditioned(split=True), wrong, {}), (params, {}), inputs=feed)
    assert v.status() == "MISMATCH", v
    assert "against the original run in float64" in v.failure()
    assert v.ok(rtol=1e-4) is False and v.within_rounding() is False


def test_a_value_after_a_step_the_fused_graph_does_not_hold_is_not_judged():
    """Past a step, float64 and float32 runs take other branches: the float64 result says nothing there."""
    def graph(name):
        return S.sign(S.broadcast_mul(S.var("data"), S.var("w")), name=name) * 1.0

    v = check(graph("sign"), graph("sign_elsewhere"), weights(scale=-1.0))
    assert v.status() == "MISMATCH", v
    assert v.rounding and v.rounding[0]["value"] is None and "follows sign" in v.rounding[0]["why"]
    assert any("not judged against float64" in d for d in v.details())


def test_a_model_that_matches_runs_nothing_more():
    v = check(peaks(), peaks(), weights())
    assert v.status() == "OK" and v.piecewise is None and v.rounding is None and v.max_rel == 0.0
