"""fusion.verify on outputs of sorting and NMS (fusion/check/rowsets.py): rows compared as sets.

Two detections whose scores are nearly tied change places under arithmetic in another order: the
same rows, another order.  Such outputs are compared as sets of rows (and say so); a real error
(1 % of a weight) still fails; the original's own spread (MXNet's backend on vs off) is reported.
"""
import json
import os

import mxnet as mx
import numpy as np
import pytest

from fusion.check.rowsets import RowLayout, align_rows, row_layouts
from fusion.check.verify import verify

from conftest import run_mxfuse

S = mx.sym
SHAPE = (1, 3, 5, 6)            # 30 candidate boxes


def detector(top=20, head_channels=6):
    """A small detector: a 1×1 convolution gives each position (class, score, 4 box values); box_nms
    sorts them by score; the top rows are split into ids, scores and boxes, as GluonCV's SSD does."""
    with mx.name.NameManager():         # the same names on every call
        x = S.var("data")
        y = S.Convolution(x, num_filter=head_channels, kernel=(1, 1), name="head")
        y = S.reshape(S.transpose(y, axes=(0, 2, 3, 1)), shape=(0, -1, head_channels))
        y = S.contrib.box_nms(y, overlap_thresh=1.0, valid_thresh=-1, coord_start=2, score_index=1, id_index=-1)
        y = S.slice_axis(y, axis=1, begin=0, end=top)
        return S.Group([S.slice_axis(y, axis=2, begin=b, end=e) for b, e in ((0, 1), (1, 2), (2, 6))])


def near_tie(eps_sign=1.0):
    """Params where the score is channel 0 of the input plus ±1e-6 × channel 1, and an input where
    two positions have the same channel 0: their order is decided by the 1e-6 term alone."""
    w = np.zeros((6, 3, 1, 1), dtype=np.float32)
    rng = np.random.default_rng(0)
    w[[0, 2, 3, 4, 5]] = rng.standard_normal((5, 3, 1, 1))
    w[1, 0], w[1, 1] = 1.0, 1e-6 * eps_sign
    b = rng.standard_normal(6).astype(np.float32)
    b[1] = 0.0
    data = rng.standard_normal(SHAPE).astype(np.float32)
    data[0, 0] = np.arange(30, dtype=np.float32).reshape(5, 6) / 10.0
    data[0, 0, 4, 5] = data[0, 0, 4, 4]         # the two top-scoring positions tie in channel 0
    data[0, 1, 4, 4], data[0, 1, 4, 5] = 1.0, -1.0
    return {"head_weight": mx.nd.array(w), "head_bias": mx.nd.array(b)}, {"data": data}


def test_layout_followed_through_slices_to_the_nms():
    layouts = row_layouts(detector(), {}, {}, {"data": SHAPE})
    assert set(layouts) == {0, 1, 2}
    assert layouts[0] == RowLayout("_contrib_box_nms 'box_nms0'", 1, (0,))
    assert "a set of rows along axis 1, per index of axis 0 (ordered by _contrib_box_nms" in layouts[2].describe()


def test_near_tied_detections_that_swap_pass_as_sets_and_fail_by_position():
    arg, inputs = near_tie()
    swapped, _ = near_tie(-1.0)                   # the tie broken the other way: rows 0 and 1 change places
    v = verify((detector(), arg, {}), (detector(), swapped, {}), inputs=inputs)
    assert v.ok() and v.max_rel < 1e-5, v                                  # as sets: the same detections
    assert v.moved_rows == {0: 2, 1: 2, 2: 2}
    assert v.positional_max_rel > 0.1 and v.positional_per_output[2] > 0.1  # by position: two boxes swapped
    assert v.comparison(2).startswith("as a set of rows along axis 1") and v.spread == 0.0
    d = v.to_dict()
    assert [c["kind"] for c in d["comparison"]] == ["row_set"] * 3
    assert d["comparison"][2]["moved_rows"] == 2 and d["comparison"][2]["source"] == "_contrib_box_nms 'box_nms0'"
    assert d["original_spread"]["max_rel"] == 0.0
    assert "2 row(s) changed places (compared by position: max rel error" in " ".join(d["details"])


def test_planted_one_percent_error_still_fails_as_a_set():
    arg, inputs = near_tie()
    wrong = dict(arg)
    w = arg["head_weight"].asnumpy().copy()
    w[2:] *= 1.01                                                           # the boxes 1 % off
    wrong["head_weight"] = mx.nd.array(w)
    v = verify((detector(), arg, {}), (detector(), wrong, {}), inputs=inputs)
    assert not v.ok() and v.max_rel > 1e-3, v
    assert "the original's own spread, MXNet's backend on vs off: 0" in v.failure()


def test_topk_indices_compared_as_sets():
    with mx.name.NameManager():
        x = S.var("data")
        s = S.reshape(S.Convolution(x, num_filter=1, kernel=(1, 1), name="head"), shape=(0, -1))
        y = S.topk(s, k=5, ret_typ="both", axis=-1)
    w = np.zeros((1, 3, 1, 1), dtype=np.float32)
    w[0, 0], w[0, 1] = 1.0, 1e-6
    arg = {"head_weight": mx.nd.array(w), "head_bias": mx.nd.zeros(1)}
    w2 = w.copy()
    w2[0, 1] = -1e-6
    _, inputs = near_tie()
    layouts = row_layouts(y, arg, {}, {"data": SHAPE})
    assert layouts[0] == layouts[1] == RowLayout("topk 'topk0'", 1, (0,))
    v = verify((y, arg, {}), (y, {**arg, "head_weight": mx.nd.array(w2)}, {}), inputs=inputs)
    assert v.ok() and v.moved_rows[1] == 2 and v.positional_max_rel > 0.01, v


def test_reshapes_that_mix_rows_with_their_content_are_positional():
    with mx.name.NameManager():
        y = S.contrib.box_nms(S.var("data"), coord_start=2, score_index=1, id_index=-1)
    kept = row_layouts(S.Group([S.reshape(y, shape=(-1, 6)), S.expand_dims(y, axis=3), S.transpose(y, axes=(1, 0, 2))]),
                       {}, {}, {"data": (2, 8, 6)})
    assert kept[0] == RowLayout("_contrib_box_nms 'box_nms0'", 0, ())         # batches merged into the rows
    assert kept[1] == RowLayout("_contrib_box_nms 'box_nms0'", 1, (0,))
    assert kept[2] == RowLayout("_contrib_box_nms 'box_nms0'", 0, (1,))
    lost = row_layouts(S.Group([S.Flatten(y), S.reshape(y, shape=(2, 4, 12)), S.sum(y, axis=2),
                                S.broadcast_mul(y, S.var("w"))]), {}, {}, {"data": (2, 8, 6), "w": (1, 8, 1)})
    assert lost == {}, lost


def test_align_rows_pairs_rows_jointly_across_outputs():
    ids = np.array([[[1.0], [1.0], [2.0]]])
    scores = np.array([[[0.9], [0.9], [0.5]]])
    boxes = np.array([[[0, 0, 1, 1], [5, 5, 6, 6], [2, 2, 3, 3]]], dtype=float)
    lay = RowLayout("nms", 1, (0,))
    ref = [ids, scores, boxes]
    cand = [ids, scores, boxes[:, [1, 0, 2]]]      # same ids and scores in place; the boxes swapped
    aligned, moved = align_rows(ref, cand, {0: lay, 1: lay, 2: lay})
    assert moved == {0: 2, 1: 2, 2: 2} and np.array_equal(aligned[2], boxes)


def test_mxfuse_verify_says_how_it_compared(tmp_path, capsys):
    arg, _ = near_tie()
    sym = detector()
    sp, pp = tmp_path / "det-symbol.json", tmp_path / "det-0000.params"
    sym.save(str(sp))
    mx.nd.save(str(pp), {"arg:" + k: v for k, v in arg.items()})
    code, out, err = run_mxfuse(capsys, sp, "--params", pp, "-o", tmp_path / "o", "--shape", "data=1,3,5,6",
                                "--verify", "--report", tmp_path / "r.json")
    assert code == 0, err
    assert "verify: output 0 ('slice_axis1_output'), output 1 ('slice_axis2_output'), output 2 " \
           "('slice_axis3_output') compared as a set of rows along axis 1" in out, out
    assert "the original's own spread" in out
    report = json.loads((tmp_path / "r.json").read_text())["verify"]
    assert [c["kind"] for c in report["comparison"]] == ["row_set"] * 3


def test_mxfuse_verify_fails_a_planted_one_percent_error_on_a_detector(tmp_path, capsys, monkeypatch):
    from fusion.doors import cli

    arg, _ = near_tie()
    sp, pp = tmp_path / "det-symbol.json", tmp_path / "det-0000.params"
    detector().save(str(sp))
    mx.nd.save(str(pp), {"arg:" + k: v for k, v in arg.items()})
    real_fuse = cli.fuse

    def broken_fuse(*a, **kw):
        res = real_fuse(*a, **kw)
        res.arg_params["head_weight"] = res.arg_params["head_weight"] * 1.01
        return res

    monkeypatch.setattr(cli, "fuse", broken_fuse)
    code, out, err = run_mxfuse(capsys, sp, "--params", pp, "-o", tmp_path / "o", "--shape", "data=1,3,5,6",
                                "--verify")
    assert code == 1 and "MISMATCH" in out and "nothing written" in err, (out, err)
    assert "compared as a set of rows" in out and "the original's own spread" in err
    assert not os.path.exists(tmp_path / "o-symbol.json")


def test_real_ssd_detections_compared_as_sets(tmp_path):
    pytest.importorskip("gluoncv")
    import fusion
    from fusion.testing.gcv_zoo import gcv_zoo_model

    shape = (1, 3, 128, 128)
    sym, arg, aux = gcv_zoo_model("ssd_512_mobilenet1.0_voc", shape)
    res = fusion.fuse(sym, arg, aux, input_shapes={"data": shape}, self_check=False)
    v = verify((sym, arg, aux), res, input_shapes={"data": shape})
    assert [v.comparison(i).split(" (")[0] for i in range(3)] == [
        "as a set of rows along axis 1, per index of axis 0"] * 3, v
    assert v.ok(), v
    assert v.spread is not None
    name = next(k for k in sorted(res.arg_params) if "convpredictor" in k and k.endswith("weight"))
    wrong = dict(res.arg_params)
    wrong[name] = wrong[name] * 1.01                       # a planted 1 % error in one predictor's weights
    v = verify((sym, arg, aux), (res.symbol, wrong, res.aux_params), input_shapes={"data": shape})
    assert not v.ok(), v
