"""A model that does not run at the input shapes given — a reshape to a fixed shape of another size,
which MXNet 1.9.1 infers without comparing sizes and then runs reading past its input (GluonCV's
SiamRPN at another search size than its cross-correlation's fixed 24×24 needs) — is refused with one
line naming the reshape and both sizes, by fuse() and by mxfuse (exit 2, nothing written)."""
import os

import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.doors import cli

S = mx.sym


def model():
    """conv 3×3 (no padding) → reshape to a fixed (1, 4, 6, 6): right only for an 8×8 input."""
    y = S.Convolution(S.var("data"), S.var("w"), no_bias=True, kernel=(3, 3), num_filter=4, name="conv")
    return S.reshape(S.relu(y), shape=(1, 4, 6, 6), name="fixed") * 2.0


def params():
    return {"w": mx.nd.array(np.random.RandomState(0).randn(4, 3, 3, 3).astype(np.float32))}


def test_the_size_the_reshape_was_written_for_fuses():
    r = fusion.fuse(model(), params(), {}, input_shapes={"data": (1, 3, 8, 8)})
    assert fusion.verify(model(), r, (params(), {}), input_shapes={"data": (1, 3, 8, 8)}).ok()


def test_another_size_is_refused_with_the_reshape_named():
    with pytest.raises(fusion.FusionError) as e:
        fusion.fuse(model(), params(), {}, input_shapes={"data": (1, 3, 10, 10)})
    msg = str(e.value)
    assert "\n" not in msg and "does not run at input shapes data=1,3,10,10" in msg
    assert "Reshape 'fixed' makes (1, 4, 6, 6) of (1, 4, 8, 8) (144 values of 256" in msg


def test_without_input_shapes_nothing_is_refused():
    assert fusion.fuse(model(), params(), {}).report is not None


def test_mxfuse_says_it_in_one_line_and_writes_nothing(tmp_path, capsys):
    sym, prm = tmp_path / "m-symbol.json", tmp_path / "m-0000.params"
    model().save(str(sym))
    mx.nd.save(str(prm), {"arg:w": params()["w"]})
    out = tmp_path / "out" / "fused"
    code = cli.main([str(sym), "--params", str(prm), "--shape", "data=1,3,10,10", "-o", str(out)])
    _, err = capsys.readouterr()
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Reshape 'fixed' makes (1, 4, 6, 6) of (1, 4, 8, 8)" in lines[0], err
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")
