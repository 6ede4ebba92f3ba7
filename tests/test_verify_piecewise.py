"""verify cuts a detection model at its NMS inputs where the whole comparison fails (fusion/check/cuts.py):
NMS choosing among near-ties passes, a wrong value before or after the NMS still fails."""
import mxnet as mx
import numpy as np

import fusion

S = mx.sym
N = 40


def head(after=None):
    """rows (1, N, 6) → scores reweighted by a parameter w (N, 1) → NMS → the first 8 rows [→ after]."""
    rows = S.var("data")
    score = S.broadcast_mul(S.slice_axis(rows, axis=2, begin=1, end=2), S.var("w"))
    rows = S.concat(S.slice_axis(rows, axis=2, begin=0, end=1), score,
                    S.slice_axis(rows, axis=2, begin=2, end=6), dim=2)
    nms = S.contrib.box_nms(rows, overlap_thresh=0.5, topk=30, id_index=0, force_suppress=True, name="nms")
    out = S.slice_axis(nms, axis=1, begin=0, end=8)
    return after(out) if after else out


def tied_rows():
    """Pairs of heavily overlapping boxes (row 2k and 2k+1, shifted by 0.2) with equal scores:
    which one NMS keeps depends on the last bit of the score."""
    rng = np.random.RandomState(0)
    x = np.zeros((1, N, 6), np.float32)
    for k in range(N // 2):
        s = rng.uniform(0.2, 1.0)
        xy = rng.uniform(0, 50, 2)
        for j in range(2):
            x[0, 2 * k + j] = [0, s, *(xy + 0.2 * j), *(xy + 0.2 * j + 4)]
    return x


def params(scale=1.0, nudge=0.0):
    w = np.ones((1, N, 1), np.float32) * scale
    w[0, 1::2, 0] += nudge            # the second box of each pair: a rounding's worth more
    return {"w": mx.nd.array(w)}


def check(fused_sym, fused_arg):
    feed = {"data": tied_rows()}
    return fusion.verify(head(), (fused_sym, fused_arg, {}), (params(), {}), inputs=feed)


def test_nms_choosing_among_ties_passes_piecewise():
    v = check(head(), params(nudge=1.2e-7))
    assert v.status() == "OK", v
    assert v.piecewise is not None and v.piecewise["cuts"] == ["nms"]
    assert v.piecewise["whole_max_rel"] > 1e-3                # the whole comparison alone fails
    assert v.max_rel < 1e-6 and any("compared piecewise at the inputs of 'nms'" in d for d in v.details())
    assert v.to_dict()["piecewise"]["inputs"][0]["cut"] == "nms"


def test_an_error_before_the_nms_still_fails():
    v = check(head(), params(scale=1.01))
    assert v.status() == "MISMATCH", v


def test_an_error_after_the_nms_still_fails():
    v = check(head(after=lambda y: y * 1.01), params(nudge=1.2e-7))
    assert v.status() == "MISMATCH", v


def test_a_model_that_matches_is_not_cut():
    v = check(head(), params())
    assert v.status() == "OK" and v.piecewise is None and v.max_rel == 0.0


def test_an_error_of_the_scores_is_not_hidden_by_large_boxes():
    """Each field of an NMS input is compared on its own scale: box coordinates in the thousands (a random-
    weight detector's) would make a 1 % error of the scores (at most 1) look like 1e-6 of the whole row."""
    def big_boxes(after=None):
        rows = S.var("data")
        rows = S.concat(S.slice_axis(rows, axis=2, begin=0, end=2), S.slice_axis(rows, axis=2, begin=2, end=6) * 1e4,
                        dim=2)
        score = S.broadcast_mul(S.slice_axis(rows, axis=2, begin=1, end=2), S.var("w"))
        rows = S.concat(S.slice_axis(rows, axis=2, begin=0, end=1), score,
                        S.slice_axis(rows, axis=2, begin=2, end=6), dim=2)
        nms = S.contrib.box_nms(rows, overlap_thresh=0.5, topk=30, id_index=0, force_suppress=True, name="nms")
        return S.slice_axis(nms, axis=1, begin=0, end=8)

    feed = {"data": tied_rows()}
    ok = fusion.verify(big_boxes(), (big_boxes(), params(nudge=1.2e-7), {}), (params(), {}), inputs=feed)
    assert ok.status() == "OK" and ok.piecewise is not None, ok
    assert {f for _, f, _ in ok.piecewise["inputs"]} == {"scores", "boxes", "class ids"}
    wrong = params(nudge=1.2e-7)
    wrong["w"] = wrong["w"] * 1.01
    v = fusion.verify(big_boxes(), (big_boxes(), wrong, {}), (params(), {}), inputs=feed)
    assert v.status() == "MISMATCH", v
