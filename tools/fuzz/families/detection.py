"""box_nms, max_pool: a detection head's rows → non-maximum suppression; heatmap peaks by max pooling.

Grammar::

    graph   := rows → nms [→ tail] | peaks | roi
    roi     := features (n, C, H, W) (an input | Convolution 1×1 of it) → ROIAlign(·, rois (R, 5) valid boxes,
               pooled_size, spatial_scale, sample_ratio, aligned | near: position_sensitive (refused))
               [→ Flatten → relu]
    peaks   := h = heat(x (B, C, H, W)) → p = Pooling(h, max, kernel k×k', stride, pad < kernel, valid | full)
               → [broadcast_mul(broadcast_equal(p, h), h)]                           (CenterNet's decoder)
    heat    := sigmoid(x) | x (an input) | relu(x) · 2 | a library op's output (a dense layer + relu, reshaped)
             | near: Convolution 1×1 (oneDNN's layout: refused), Activation(sigmoid) (refused), avg pooling (refused)
    rows    := x (B, N, W)                                              (the rows as data: W = 6 | 7 | 5)
             | decoded(x)  ids = floor(|x₀|·k), score = sigmoid(x₁), xy = x₂₃·s, wh = exp(x₄₅)
                           → concat(ids, score, xy, xy + wh | wh, dim=2)  (SSD / YOLO decoders; corner | center)
             | head(x)     FullyConnected(x (B, F)) → Reshape(0, N, 6) → decoded
    nms     := _contrib_box_nms(overlap_thresh, valid_thresh, topk = -1 | 0 | small | ≥ N, id_index = 0 | -1,
                                background_id, force_suppress, in_format, out_format)
               column layouts: [id, score, box] | [score, box] (coord_start 1, score_index 0) | [box, id, x, score]
             | near: the rows cast to float16 first                        (refused: float32 only)
    tail    := none | slice_axis(·, axis=-2, 0, k) | + 1 | the hidden second output also an output (rare)
"""
from __future__ import annotations

import json

from .pieces import S


def _decoded(b, x, n_cls: int, fmt: str):
    d = b.d
    col = lambda i: S.slice_axis(x, axis=2, begin=i, end=i + 1)  # noqa: E731
    ids = S.floor(S.abs(col(0)) * n_cls)
    score = S.sigmoid(col(1))
    scale = d.choice([4.0, 1.0, 16.0], label="box scale")
    xy = S.slice_axis(x, axis=2, begin=2, end=4) * scale
    wh = S.exp(S.slice_axis(x, axis=2, begin=4, end=6))
    return S.concat(ids, score, xy, xy + wh if fmt == "corner" else wh, dim=2)


def _peaks(b):
    d = b.d
    b.dim("B", [1, 2])
    c = d.choice([2, 3, 5], label="heat channels")
    b.dim("H", [6, 9, 4, 13])
    b.dim("W", [7, 8, 5, 16])
    x = b.input("data", ("B", c, "H", "W"), kind=d.choice(["normal", "unit"], label="values"))
    heat = d.choice(["sigmoid", "input", "relu", "library", "conv", "activation"], [4, 2, 1, 1, 1, 1], label="heat")
    if heat == "sigmoid":
        h = S.sigmoid(x)
    elif heat == "relu":
        h = S.relu(x) * 2
    elif heat == "library":
        hw = b.fixed("H") * b.fixed("W")
        flat = S.reshape(x, shape=(0, -1))
        fc = S.FullyConnected(flat, b.param("heat_weight", (c * hw, c * hw), kind="weight"),
                              b.param("heat_bias", (c * hw,)), num_hidden=c * hw, name=b.name("heat_fc"))
        h = S.reshape(S.relu(fc), shape=(0, c, b.dims["H"], b.dims["W"]))
    elif heat == "conv":
        h = S.Convolution(x, b.param("heat_weight", (c, c, 1, 1), kind="weight"), kernel=(1, 1), num_filter=c,
                          no_bias=True, name=b.name("heat_conv"))
    elif heat == "activation":
        h = S.Activation(x, act_type="sigmoid")
    else:
        h = x
    k = (d.choice([3, 2, 1, 5], label="kernel h"), d.choice([3, 2, 1, 4], label="kernel w"))
    s = (d.choice([1, 2, 3], label="stride h"), d.choice([1, 2], label="stride w"))
    pad = (d.int(0, k[0] - 1, label="pad h"), d.int(0, k[1] - 1, label="pad w"))
    kind = d.choice(["max", "avg"], [9, 1], label="pool type")
    p = S.Pooling(h, kernel=k, stride=s, pad=pad, pool_type=kind,
                  pooling_convention=d.choice(["valid", "full"], label="convention"), name=b.name("pool"))
    if d.maybe(0.6, label="keep peaks") and s == (1, 1) and all(2 * q == kk - 1 for q, kk in zip(pad, k)):
        return [S.broadcast_mul(S.broadcast_equal(p, h), h)]
    return [p]


def _roi_align(b):
    d = b.d
    import numpy as np
    n = d.choice([1, 2], label="images")
    b.dim("C", [3, 8, 64, 70])
    h, w = d.choice([6, 9, 1, 13], label="map h"), d.choice([7, 8, 1, 11], label="map w")
    x = b.input("data", (n, "C", h, w), kind=d.choice(["normal", "unit"], label="values"))
    if d.maybe(0.4, label="features from a convolution"):
        c = b.fixed("C")
        x = S.Convolution(x, b.param("feat_weight", (c, c, 1, 1), kind="weight"), kernel=(1, 1), num_filter=c,
                          no_bias=True, name=b.name("feat"))
    scale = d.choice([0.25, 1.0, 0.0625, 0.5], label="spatial scale")
    r = d.choice([5, 1, 12], label="rois")
    rng = np.random.RandomState(d.seed("roi values"))
    xy = np.stack([rng.uniform(-2, w / scale, r), rng.uniform(-2, h / scale, r)], 1)
    wh = rng.uniform(0, 12 / scale, (r, 2)) * rng.choice([1.0, 0.01], (r, 1))
    aligned = d.maybe(0.3, label="aligned")
    if aligned:
        wh = np.maximum(wh, 0.5)
    rois = np.concatenate([rng.randint(0, n, (r, 1)), xy, xy + wh], 1)
    pooled = (d.choice([2, 3, 1, 7], label="pooled h"), d.choice([2, 3, 1, 5], label="pooled w"))
    # position-sensitive: the channels must split into pooled h x pooled w groups
    sensitive = d.maybe(0.08, label="position sensitive") and b.dims["C"] % (pooled[0] * pooled[1]) == 0
    if sensitive:
        b.fixed("C")
    y = S.contrib.ROIAlign(x, b.param("rois", (r, 5), value=rois), name=b.name("roi"), pooled_size=pooled,
                           spatial_scale=scale, sample_ratio=d.choice([2, -1, 1, 3], label="sample ratio"),
                           aligned=aligned, position_sensitive=sensitive)
    if d.maybe(0.3, label="head"):
        y = S.relu(S.Flatten(y))
    return [y]


def build(b):
    d = b.d
    kind = d.choice(["nms", "peaks", "roi"], [5, 3, 3], label="graph")
    if kind == "peaks":
        return _peaks(b)
    if kind == "roi":
        return _roi_align(b)
    b.dim("B", [1, 2, 3])
    n = b.size([12, 30, 5, 1, 64], [600, 2000], label="boxes")
    fmt = d.choice(["corner", "center"], label="in_format")
    source = d.choice(["data", "decoded", "head"], [3, 3, 1], label="rows")
    layout = "id_score_box"
    if source == "data":
        layout = d.choice(["id_score_box", "score_box", "box_id_x_score"], [4, 2, 1], label="layout")
        width = {"id_score_box": d.choice([6, 7], label="width"), "score_box": 5, "box_id_x_score": 7}[layout]
        x = b.input("data", ("B", n, width), kind=d.choice(["unit", "pos", "normal"], label="values"))
    elif source == "decoded":
        x = _decoded(b, b.input("data", ("B", n, 6)), d.choice([3, 1, 20], label="classes"), fmt)
    else:
        f = d.choice([4, 8], label="features")
        h = S.FullyConnected(b.input("data", ("B", f)), b.param("head_weight", (6 * n, f), kind="weight"),
                             b.param("head_bias", (6 * n,)), num_hidden=6 * n, name=b.name("head"))
        x = _decoded(b, S.reshape(h, shape=(0, n, 6)), d.choice([3, 1, 20], label="classes"), fmt)
    cols = {"id_score_box": dict(coord_start=2, score_index=1, id_index=0),
            "score_box": dict(coord_start=1, score_index=0, id_index=-1),
            "box_id_x_score": dict(coord_start=0, score_index=6, id_index=4)}[layout]
    if cols["id_index"] >= 0 and d.maybe(0.25, label="no class"):
        cols["id_index"] = -1
    attrs = dict(cols,
                 overlap_thresh=d.choice([0.5, 0.45, 0.3, 0.7, 0.0, 1.0], label="overlap"),
                 valid_thresh=d.choice([0.0, 0.01, 0.5, -1.0], label="valid"),
                 topk=d.choice([-1, 400, 3, 0, n + 5, 1], label="topk"),
                 force_suppress=d.maybe(0.4, label="force"),
                 in_format=fmt, out_format=d.choice([fmt, "corner", "center"], label="out_format"))
    if cols["id_index"] >= 0 and d.maybe(0.3, label="background"):
        attrs["background_id"] = d.choice([0, 1, -1], label="background id")
    if d.maybe(0.06, label="float16 rows"):
        x = S.cast(x, dtype="float16")
        b.flag("no_train")      # MXNet 1.9.1 itself aborts (SIGABRT) training a float16 box_nms at a second shape
    name = b.name("nms")
    y = S.contrib.box_nms(x, name=name, **attrs)
    tail = d.choice(["none", "slice", "add", "hidden"], [3, 3, 1, 1], label="tail")
    if tail == "slice":
        y = S.slice_axis(y, axis=-2, begin=0, end=min(n, d.choice([1, 5, 10], label="kept rows")))
    elif tail == "add":
        y = y + 1
    elif tail == "hidden":
        js = json.loads(S.Group([y]).tojson())
        node = [i for i, nd in enumerate(js["nodes"]) if nd["name"] == name][0]
        js["heads"].append([node, 1, 0])
        return [S.load_json(json.dumps(js))]
    return [y]
