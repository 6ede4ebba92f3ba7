"""Parameters in and out of fuse(): checked like the CLI checks them, returned as the caller's kind and
context, never sharing memory with the caller's arrays; models that need no input shapes fuse without them."""
import os

import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion import cli
from fusion.errors import ParamsError

from conftest import random_params

S = mx.sym


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def save(folder, name, sym, arg, aux):
    sym.save(str(folder / (name + "-symbol.json")))
    mx.nd.save(str(folder / (name + "-0000.params")), {**{"arg:" + k: v for k, v in arg.items()},
                                                        **{"aux:" + k: v for k, v in aux.items()}})
    return folder / (name + "-symbol.json"), folder / (name + "-0000.params")


# ---------------------------------------------------------------- no --shape: nothing blamed on the params

def causal_lm():
    """Token embedding, a causal mask from arange_like of the input, softmax, a projection."""
    tok = S.var("data")
    h = S.Embedding(tok, input_dim=20, output_dim=8, name="emb")                     # (B, L, 8)
    s = S.batch_dot(h, h, transpose_b=True)                                          # (B, L, L)
    steps = S.contrib.arange_like(tok, axis=1)
    causal = S.broadcast_lesser_equal(S.reshape(steps, shape=(1, -1)), S.reshape(steps, shape=(-1, 1)))
    s = S.broadcast_add(s, S.expand_dims((1 - causal) * -1e9, axis=0))
    o = S.batch_dot(S.softmax(s, axis=-1), h)
    return S.FullyConnected(o, num_hidden=20, flatten=False, name="head")


def test_causal_lm_without_shape(tmp_path, capsys):
    # was: exit 2 "parameter shapes do not fit the graph: ... arange_like0 ... cannot handle param.axis 1"
    sym = causal_lm()
    arg, aux = random_params(sym, {"data": (2, 6)})
    sp, pp = save(tmp_path, "lm", sym, arg, aux)
    code, out, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "out")
    assert code == 0, err
    s1, a1, x1 = mx.model.load_checkpoint(str(tmp_path / "out"), 0)
    v = fusion.verify((sym, arg, aux), (s1, a1, x1), input_shapes={"data": (2, 6)})
    assert v.ok(), v


def test_bert_without_shape(tmp_path, capsys):
    pytest.importorskip("gluonnlp")
    from fusion.testing import gluonnlp_bert

    sym, arg, aux, shapes = gluonnlp_bert(seq=16)
    sp, pp = save(tmp_path, "bert", sym, arg, aux)
    code, out, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "out")
    assert code == 0, err
    assert "attention" in out
    s1, a1, x1 = mx.model.load_checkpoint(str(tmp_path / "out"), 0)
    v = fusion.verify((sym, arg, aux), (s1, a1, x1), input_shapes={"data0": (2, 24), "data1": (2, 24), "data2": (2,)})
    assert v.ok(), v


def test_wrong_params_still_blamed_without_shape(tmp_path, capsys):
    sym = causal_lm()
    arg, aux = random_params(sym, {"data": (2, 6)})
    sp, pp = save(tmp_path, "lm", sym, dict(arg, emb_weight=mx.nd.ones((21, 8))), aux)
    code, _, err = run_cli(capsys, sp, "--params", pp, "-o", tmp_path / "out")
    assert code == 2 and "'emb_weight' has shape (21, 8) but Embedding 'emb' (input_dim=20, output_dim=8) needs (20, 8)" in err
    assert len(err.strip().splitlines()) == 1 and not os.path.exists(str(tmp_path / "out") + "-symbol.json")
