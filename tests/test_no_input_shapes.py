"""Block rules without input shapes: channels and kernels come from the weights, how a block's values
relate from its own ops (fusion/engine/localfacts.py); what only the sizes can say is refused with that reason.

Each block is fused without ``input_shapes``, then bound at real shapes and compared with the original
(tolerance 1e-4 of the output's scale, as ``fusion.verify``).
"""
import json

import mxnet as mx
import pytest

import fusion

from conftest import ops, random_params, run_mxfuse

S = mx.sym
RTOL = 1e-4


def fused_without_shapes(sym, arg, aux, check_at, **kw):
    """Fuse with no input shapes, then compare with the original at every shape of ``check_at``."""
    res = fusion.fuse(sym, arg, aux, **kw)
    for shape in check_at:
        v = fusion.verify((sym, arg, aux), res, input_shapes={"data": shape}, spread=False)
        assert v.max_rel <= RTOL, (shape, v, res.report.to_text())
    return res


def conv(x, name, f, k=1, s=1, p=0, g=1):
    return S.Convolution(x, kernel=(k, k), stride=(s, s), pad=(p, p), num_filter=f, num_group=g, name=name)


def se_block(add="elemwise_add"):
    """A convolution, then GluonCV's SE on its output, added to the block's input."""
    x = S.var("data")
    y = S.Activation(conv(x, "c0", 16, k=3, p=1), act_type="relu")
    g = S.sigmoid(conv(S.relu(conv(S.contrib.AdaptiveAvgPooling2D(y, output_size=1), "fc1", 4)), "fc2", 16))
    z = S.broadcast_mul(y, g)
    z = S.elemwise_add(z, x) if add == "elemwise_add" else S.broadcast_add(z, x)
    return S.Activation(z, act_type="relu")


def test_squeeze_excitation_fuses_without_shapes():
    sym = se_block()
    arg, aux = random_params(sym, {"data": (1, 16, 9, 9)})
    res = fused_without_shapes(sym, arg, aux, [(1, 16, 9, 9), (3, 16, 12, 7)], rules=["squeeze_excitation"])
    assert ops(res).get("fused_se") == 1, res.report.to_text(explain=True)
    assert "more rewrite" not in res.report.to_text()


def test_a_residual_add_that_may_broadcast_needs_the_input_shapes():
    """broadcast_add may broadcast the residual over the map at some input size (a 1×1 residual, a
    map of 1×1): the fused op adds it elementwise.  Without shapes that is for the shapes to say:
    the SE fuses without the add, and the report says why the larger form was not taken."""
    sym = se_block(add="broadcast_add")
    arg, aux = random_params(sym, {"data": (1, 16, 9, 9)})
    res = fused_without_shapes(sym, arg, aux, [(1, 16, 9, 9)], rules=["squeeze_excitation"])
    assert ops(res).get("fused_se") == 1 and ops(res).get("broadcast_add") == 1, ops(res)
    near = " | ".join(res.report.rules["se_add"].near_misses.values())
    assert "may broadcast the residual at some input sizes (pass input shapes)" in near, near
    res = fusion.fuse(sym, arg, aux, rules=["squeeze_excitation"], input_shapes={"data": (1, 16, 9, 9)})
    assert ops(res).get("fused_se") == 1 and "broadcast_add" not in ops(res), ops(res)


def test_summary_counts_the_rewrites_input_shapes_would_decide():
    from test_cnn_blocks import X, se_sym        # the SE reads the data input itself: nothing fixes its rank

    sym = se_sym()
    arg, aux = random_params(sym, X)
    res = fusion.fuse(sym, arg, aux, rules=["squeeze_excitation"])
    assert "fused_se" not in ops(res)
    assert res.report.to_text().splitlines()[0].endswith(
        "; up to 1 more rewrite(s) with input shapes (--shape / input_shapes)"), res.report.to_text()
    assert res.report.to_dict()["more_with_input_shapes"] == 1
    res = fusion.fuse(sym, arg, aux, rules=["squeeze_excitation"], input_shapes=X)
    assert ops(res).get("fused_se") == 1 and "more_with_input_shapes" not in res.report.to_dict()
    assert "more rewrite" not in res.report.to_text()


@pytest.mark.usefixtures("no_regions")
def test_gluoncv_se_resnext_block_fuses_without_shapes():
    from fusion.testing.gluoncv import export, se_resnext

    with mx.name.NameManager():
        sym, arg, aux = export(se_resnext(layers=(1, 1, 1, 1), classes=10), (1, 3, 64, 64))
    with_shapes = fusion.fuse(sym, arg, aux, input_shapes={"data": (1, 3, 64, 64)}, self_check=False)
    res = fused_without_shapes(sym, arg, aux, [(1, 3, 64, 64), (2, 3, 96, 80)], self_check=False)
    assert ops(res) == ops(with_shapes), (ops(res), ops(with_shapes))


def test_split_attention_fuses_without_shapes():
    from test_split_attention import splat

    sym, arg, aux = splat()
    res = fused_without_shapes(sym, arg, aux, [(1, 16, 8, 8), (2, 16, 11, 6)], rules=["split_attention"])
    assert ops(res).get("fused_split_attention") == 1, res.report.to_text(explain=True)


def test_inverted_residual_fuses_without_shapes():
    from test_inverted_residual import CASES, unit

    for case in (CASES[0], CASES[1]):            # with SE and the residual; strided without it
        sym, arg, aux = unit(*case)
        res = fused_without_shapes(sym, arg, aux, [(1, case[0], 9, 9), (2, case[0], 12, 7)])
        assert ops(res) == {"fused_inverted_residual": 1}, res.report.to_text(explain=True)


@pytest.mark.usefixtures("no_regions")
def test_a_strided_block_whose_residual_broadcasts_only_at_some_sizes_is_refused():
    """A stride-2 block adding its input: the graph runs only where the projection is 1×1 (inputs up
    to 2×2) and the sum broadcasts.  Without input shapes nothing says what the plane is: the block
    is fused without the add, the larger form refused for want of shapes; with them, because the
    add broadcasts."""
    x = S.var("data")
    hs = lambda z: z * (S.clip(z + 3., 0, 6) / 6.)          # noqa: E731
    y = conv(hs(conv(hs(conv(x, "expand", 16)), "dw", 16, k=3, s=2, p=1, g=16)), "project", 8)
    sym = S.broadcast_add(y, x)
    arg, aux = random_params(sym, {"data": (1, 8, 2, 2)})
    res = fused_without_shapes(sym, arg, aux, [(1, 8, 2, 2)])
    assert ops(res).get("broadcast_add") == 1, ops(res)       # the block fuses without the add
    near = " | ".join(res.report.rules["inverted_residual"].near_misses.values())
    assert "the larger one was refused: the block's input shape is unknown (pass input shapes)" in near, near
    res = fusion.fuse(sym, arg, aux, input_shapes={"data": (1, 8, 2, 2)})
    assert ops(res).get("broadcast_add") == 1, ops(res)
    assert "the residual add broadcasts" in res.report.to_text(explain=True), res.report.to_text(explain=True)


def test_dense_block_fuses_without_shapes():
    from test_dense_block import dense_block

    sym, arg, aux = dense_block(layers=3, post=True)
    res = fused_without_shapes(sym, arg, aux, [(1, 16, 8, 8), (2, 16, 10, 7)])
    assert ops(res).get("fused_dense_block") == 1, res.report.to_text(explain=True)


def test_grouped_convolution_needs_no_shapes():
    from test_grouped_conv import gconv

    sym = gconv(act="Activation")
    arg, aux = random_params(sym, {"data": (1, 32, 5, 5)})
    res = fused_without_shapes(sym, arg, aux, [(1, 32, 5, 5), (2, 32, 9, 4)], rules=["grouped_convolution"])
    assert ops(res).get("fused_grouped_conv") == 1, res.report.to_text(explain=True)


def test_concat_batchnorm_relu_fuses_without_shapes():
    x = S.var("data")
    y = S.Activation(conv(x, "c0", 4, k=3, p=1), act_type="relu")
    c = S.Concat(y, conv(y, "c1", 4, k=3, p=1), dim=1)
    sym = S.Activation(S.BatchNorm(c, fix_gamma=False, name="bn"), act_type="relu")
    arg, aux = random_params(sym, {"data": (1, 3, 8, 8)})
    res = fused_without_shapes(sym, arg, aux, [(1, 3, 8, 8), (2, 3, 5, 9)], rules=["concat_bn_act"])
    assert ops(res).get("fused_concat_scale_act") == 1, res.report.to_text(explain=True)


def test_mxfuse_report_counts_what_input_shapes_would_add(tmp_path, capsys, tmp_model):
    from test_cnn_blocks import X, se_sym

    sym = se_sym()
    arg, aux = random_params(sym, X)
    sp, pp = tmp_model(sym, arg, aux)
    code, out, err = run_mxfuse(capsys, sp, "--params", pp, "-o", tmp_path / "o", "--report", tmp_path / "r.json")
    assert code == 0, err
    assert "more rewrite(s) with input shapes" in out.splitlines()[0], out
    assert json.loads((tmp_path / "r.json").read_text())["more_with_input_shapes"] >= 1


def test_a_stride_one_block_adding_with_broadcast_add_fuses_at_every_size():
    """A stride-1, "same"-padded block keeps the plane at every size, so its broadcast_add adds equal
    shapes wherever the graph runs: decided from the convolutions, no input shapes needed.  Checked
    down to a 1x1 plane and at other batch sizes."""
    x = S.var("data")
    hs = lambda z: z * (S.clip(z + 3., 0, 6) / 6.)          # noqa: E731
    y = conv(hs(conv(hs(conv(x, "expand", 24, k=1)), "dw", 24, k=3, p=1, g=24)), "project", 8)
    sym = S.Activation(S.broadcast_add(y, S.Activation(x, act_type="relu")), act_type="relu")
    arg, aux = random_params(sym, {"data": (1, 8, 9, 9)})
    res = fused_without_shapes(sym, arg, aux, [(1, 8, 9, 9), (3, 8, 12, 7), (2, 8, 1, 1)])
    assert ops(res).get("fused_inverted_residual") == 1, res.report.to_text(explain=True)


def test_se_whose_gate_reshape_names_the_batch_needs_the_input_shapes():
    """A gate reshaped to (1, C, 1, 1) runs at batch 1 only: without input shapes the block's ops do
    not run at the filled-in sizes, so nothing says what the gate is; refused for want of shapes
    (counted in the summary), fused with them."""
    x = S.var("data")
    y = S.Activation(conv(x, "c0", 16, k=3, p=1), act_type="relu")
    h = S.relu(S.FullyConnected(S.contrib.AdaptiveAvgPooling2D(y, output_size=1), num_hidden=4, name="fc1"))
    g = S.reshape(S.sigmoid(S.FullyConnected(h, num_hidden=16, name="fc2")), shape=(1, 16, 1, 1))
    sym = S.broadcast_mul(y, g)
    arg, aux = random_params(sym, {"data": (1, 3, 9, 9)})
    res = fused_without_shapes(sym, arg, aux, [(1, 3, 9, 9), (1, 3, 5, 12)], rules=["squeeze_excitation"])
    assert "fused_se" not in ops(res), ops(res)
    assert "(pass input shapes)" in " | ".join(res.report.rules["se"].rejected.values()), res.report.to_text(True)
    assert res.report.to_dict()["more_with_input_shapes"] >= 1
    res = fusion.fuse(sym, arg, aux, rules=["squeeze_excitation"], input_shapes={"data": (1, 3, 9, 9)})
    assert ops(res).get("fused_se") == 1, res.report.to_text(explain=True)


def test_dense_block_fused_without_shapes_is_right_down_to_a_one_pixel_plane():
    from test_dense_block import dense_block

    sym, arg, aux = dense_block(layers=2, post=False)
    res = fused_without_shapes(sym, arg, aux, [(2, 16, 1, 1), (1, 16, 3, 17)])
    assert ops(res).get("fused_dense_block") == 1, res.report.to_text(explain=True)
