"""A fused model binds and runs like the original at every input shape the original accepts,
not only at the shapes it was fused at (probe shapes in fusion/engine/facts.py, checked per rewrite)."""
import json
import math

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

import fusion
from fusion.doors import cli
from fusion.engine.facts import make_probes
from fusion.ir.graph import Graph
from fusion.check.verify import run

from conftest import random_params

S = mx.sym
RTOL = 1e-5


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-12))


def compare_at(sym, arg, aux, fused, feeds):
    for feed in feeds:
        ref = run(sym, arg, aux, feed)
        out = run(fused.symbol if hasattr(fused, "symbol") else fused[0],
                  fused.arg_params if hasattr(fused, "arg_params") else fused[1],
                  fused.aux_params if hasattr(fused, "aux_params") else fused[2], feed)
        for r, o in zip(ref, out):
            assert r.shape == o.shape
            assert rel(r, o) <= RTOL, {k: v.shape for k, v in feed.items()}


# ---------------------------------------------------------------- a BERT-style encoder in mx.sym

UNITS, HEADS, FFN, VOCAB, MAXLEN = 16, 2, 32, 50, 40


def encoder(layers=2):
    """Word + position embeddings (positions sliced to the sequence length), post-LN layers."""
    tokens, valid = S.var("tokens"), S.var("valid_length")
    word = S.Embedding(tokens, S.var("word_weight"), input_dim=VOCAB, output_dim=UNITS)       # (B, S, C)
    pos = S.slice_like(S.var("pos_weight"), S.swapaxes(word, dim1=0, dim2=1), axes=(0,))    # (S, C)
    # the broadcast operand first: at batch 1 both are (1, S, C), at batch 2 only the second is (B, S, C)
    x = S.LayerNorm(S.broadcast_add(S.expand_dims(pos, axis=0), word), S.var("emb_g"), S.var("emb_b"))
    mask = S.broadcast_lesser(S.contrib.arange_like(tokens, axis=1).reshape((1, 1, -1)),
                              valid.reshape((-1, 1, 1)))                                      # (B, 1, S)
    mask = S.repeat((1 - mask) * -1e4, repeats=HEADS, axis=0)
    for i in range(layers):
        p = "l%d_" % i

        def split(t):
            return S.reshape(S.transpose(S.reshape(t, shape=(0, 0, HEADS, -1)), axes=(0, 2, 1, 3)), shape=(-3, 0, 0))
        q, k, v = (split(S.FullyConnected(x, num_hidden=UNITS, flatten=False, name=p + n)) for n in "qkv")
        s = S.broadcast_add(S.batch_dot(q, k, transpose_b=True) / math.sqrt(UNITS // HEADS), mask)
        o = S.batch_dot(S.softmax(s, axis=-1), v)
        o = S.reshape(S.transpose(S.reshape(o, shape=(-4, -1, HEADS, 0, 0)), axes=(0, 2, 1, 3)), shape=(0, 0, -3))
        h = S.LayerNorm(S.FullyConnected(o, num_hidden=UNITS, flatten=False, name=p + "o") + x,
                        S.var(p + "ln1_g"), S.var(p + "ln1_b"))
        f = S.FullyConnected(S.LeakyReLU(S.FullyConnected(h, num_hidden=FFN, flatten=False, name=p + "f1"),
                                         act_type="gelu"), num_hidden=UNITS, flatten=False, name=p + "f2")
        x = S.LayerNorm(f + h, S.var(p + "ln2_g"), S.var(p + "ln2_b"))
    return x


def encoder_params(sym):
    arg, aux = random_params(sym, {"tokens": (1, 12), "valid_length": (1,), "pos_weight": (MAXLEN, UNITS)},
                             inputs={"tokens", "valid_length"})
    return arg, aux


def feed(batch, seq, seed=0):
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, VOCAB, (batch, seq)).astype(np.float32),
            "valid_length": rng.integers(1, seq + 1, (batch,)).astype(np.float32)}


def test_encoder_fused_at_batch_1_runs_at_other_batches_and_lengths():
    sym = encoder()
    arg, aux = encoder_params(sym)
    res = fusion.fuse(sym, arg, aux, input_shapes={"tokens": (1, 12), "valid_length": (1,)})
    counts = res.graph.count_ops()
    assert counts.get("fused_attention") == 2 and counts.get("fused_dense", 0) >= 6, counts
    # the embedding add: its operands are equal at batch 1 only; the broadcast one goes second
    emb = [n for n in res.graph.op_nodes() if n.op == "fused_add_layer_norm" and n.inputs[0].node.op == "Embedding"]
    assert len(emb) == 1, res.report.to_text()
    assert res.report.self_check.checked >= res.report.fused_count - res.report.self_check.sampled
    compare_at(sym, arg, aux, res, [feed(1, 12), feed(2, 7, 1), feed(4, 12, 2), feed(3, 1, 3)])


def test_probes_follow_what_the_graph_accepts():
    sym = encoder(1)
    arg, aux = encoder_params(sym)
    g = Graph.from_symbol(sym)
    shapes = {k: v.shape for k, v in {**arg, **aux}.items()}
    probes = [p for p, _ in make_probes(g, shapes, {"tokens": (1, 12), "valid_length": (1,)})]
    assert probes == [{"tokens": (1, 12), "valid_length": (1,)}, {"tokens": (2, 12), "valid_length": (2,)},
                      {"tokens": (2, 15), "valid_length": (2,)}]
    # a graph with the batch size written into a Reshape accepts no other batch size
    x = S.var("x")
    fixed = S.reshape(S.FullyConnected(x, num_hidden=4, name="fc"), shape=(1, 4))
    arg2, _ = random_params(fixed, {"x": (1, 3)})
    probes = [p for p, _ in make_probes(Graph.from_symbol(fixed), {k: v.shape for k, v in arg2.items()}, {"x": (1, 3)})]
    assert probes == [{"x": (1, 3)}]


def test_a_width_a_parameter_also_has_is_probed_when_the_graph_takes_others():
    """w's width 12 is also the projection's width, yet nothing ties w to it: a probe changes it,
    as it does when another input's free size cannot change (whether a size is probed does not
    depend on an unrelated part of the graph)."""
    x, w = S.var("x"), S.var("w")
    for seq_fixed in (False, True):
        h = S.FullyConnected(x, num_hidden=12, flatten=False, name="fc")
        if seq_fixed:
            h = S.reshape(h, shape=(0, 5, 12))
        y = S.Group([h, S.relu(w)])
        probes = [p for p, _ in make_probes(Graph.from_symbol(y), {"fc_weight": (12, 3), "fc_bias": (12,)},
                                            {"x": (2, 5, 3), "w": (2, 12)})]
        assert any(p["w"][1] != 12 for p in probes), (seq_fixed, probes)
        assert any(p["x"][1] != 5 for p in probes) is not seq_fixed, (seq_fixed, probes)


def test_mxfuse_output_binds_at_other_shapes(tmp_path, capsys):
    sym = encoder()
    arg, aux = encoder_params(sym)
    sym.save(str(tmp_path / "enc-symbol.json"))
    mx.nd.save(str(tmp_path / "enc-0000.params"), {**{"arg:" + k: v for k, v in arg.items()},
                                                    **{"aux:" + k: v for k, v in aux.items()}})
    code = cli.main([str(tmp_path / "enc-symbol.json"), "--params", str(tmp_path / "enc-0000.params"),
                     "-o", str(tmp_path / "out" / "enc"), "--shape", "tokens=1,12", "--shape", "valid_length=1"])
    assert code == 0, capsys.readouterr()
    fused = mx.model.load_checkpoint(str(tmp_path / "out" / "enc"), 0)
    compare_at(sym, arg, aux, fused, [feed(2, 6, 4), feed(5, 12, 5)])


# ---------------------------------------------------------------- GluonNLP's own BERT

def test_gluonnlp_bert_fused_at_batch_1_runs_at_batch_2_sequence_6(tmp_path, capsys):
    nlp = pytest.importorskip("gluonnlp")
    from gluonnlp.model import bert

    mx.random.seed(0)
    enc = bert.BERTEncoder(num_layers=2, units=32, hidden_size=64, max_length=64, num_heads=4, dropout=0.1)
    model = bert.BERTModel(enc, vocab_size=100, token_type_vocab_size=2, units=32, embed_size=32,
                           use_pooler=True, use_decoder=False, use_classifier=False)
    model.initialize(mx.init.Normal(0.2))
    model.hybridize()
    model(mx.nd.zeros((1, 12)), mx.nd.zeros((1, 12)), mx.nd.array([12]))
    model.export(str(tmp_path / "bert"))
    code = cli.main([str(tmp_path / "bert-symbol.json"), "--params", str(tmp_path / "bert-0000.params"),
                     "-o", str(tmp_path / "out" / "bert"), "--shape", "data0=1,12", "--shape", "data1=1,12",
                     "--shape", "data2=1"])
    assert code == 0, capsys.readouterr()
    sym, arg, aux = mx.model.load_checkpoint(str(tmp_path / "bert"), 0)
    fused = mx.model.load_checkpoint(str(tmp_path / "out" / "bert"), 0)
    assert "fused_attention" in fused[0].tojson()
    rng = np.random.default_rng(0)
    feeds = [{"data0": rng.integers(0, 100, (b, s)).astype(np.float32), "data1": rng.integers(0, 2, (b, s)).astype(np.float32),
              "data2": rng.integers(1, s + 1, (b,)).astype(np.float32)} for b, s in ((1, 12), (2, 6), (3, 17))]
    compare_at(sym, arg, aux, fused, feeds)
    assert nlp is not None


# ---------------------------------------------------------------- Gluon: first call at batch 1

class _Block(gluon.HybridBlock):
    def __init__(self, units=16, heads=2, **kw):
        super().__init__(**kw)
        self.units, self.heads = units, heads
        with self.name_scope():
            self.pos = self.params.get("pos", shape=(32, units))
            self.qkv = gluon.nn.Dense(3 * units, flatten=False, in_units=units)
            self.out = gluon.nn.Dense(units, flatten=False, in_units=units)
            self.ffn1 = gluon.nn.Dense(2 * units, flatten=False, in_units=units, activation="relu")
            self.ffn2 = gluon.nn.Dense(units, flatten=False, in_units=2 * units)
            self.ln0 = gluon.nn.LayerNorm(in_channels=units)
            self.ln1 = gluon.nn.LayerNorm(in_channels=units)
            self.ln2 = gluon.nn.LayerNorm(in_channels=units)

    def hybrid_forward(self, F, x, pos):
        p = F.slice_like(pos, F.swapaxes(x, dim1=0, dim2=1), axes=(0,))
        x = self.ln0(F.broadcast_add(x, F.expand_dims(p, axis=0)))

        def split(t):
            return F.reshape(F.transpose(F.reshape(t, shape=(0, 0, self.heads, -1)), axes=(0, 2, 1, 3)),
                             shape=(-3, 0, 0))
        q, k, v = (split(t) for t in F.split(self.qkv(x), num_outputs=3, axis=-1))
        o = F.batch_dot(F.softmax(F.batch_dot(q, k, transpose_b=True) * 0.25, axis=-1), v)
        o = F.reshape(F.transpose(F.reshape(o, shape=(-4, -1, self.heads, 0, 0)), axes=(0, 2, 1, 3)), shape=(0, 0, -3))
        h = self.ln1(self.out(o) + x)
        return self.ln2(self.ffn2(self.ffn1(h)) + h)


def test_gluon_first_call_batch_1_then_batch_4_other_length():
    def make():
        mx.random.seed(7)
        net = _Block()
        net.initialize(mx.init.Normal(0.3))
        return net
    ref, net = make(), make()
    ref.hybridize()
    net.hybridize(backend="fusion")
    rng = np.random.default_rng(0)
    for shape in ((1, 10, 16), (4, 7, 16), (2, 10, 16), (3, 1, 16)):
        x = mx.nd.array(rng.standard_normal(shape))
        assert rel(ref(x).asnumpy(), net(x).asnumpy()) <= RTOL, shape
    ops = Graph.from_symbol(net._cached_graph[1]).count_ops()
    assert ops.get("fused_attention") == 1 and ops.get("fused_dense", 0) >= 3, ops


def test_where_condition_misread_at_a_probe_is_not_a_probe(tmp_path):
    """MXNet 1.9.1's where infers any condition of its operands' rank and reads cond[i // ratio]
    (a division by zero when the condition is the larger): a probe shape that leaves the
    condition behind is not taken, and fuse never runs MXNet there (a fresh process: a crash
    would take the test run with it)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys, json
        sys.path.insert(0, %r)
        import mxnet as mx, numpy as np, fusion
        from fusion.engine.facts import make_probes
        from fusion.ir.graph import Graph
        S = mx.sym
        x = S.reshape(S.var("x"), shape=(-3, 0, 0))
        y = S.relu(S.where(S.var("c"), x * 2, x))
        shapes = {"x": (2, 2, 5, 7), "c": (4, 5, 7)}
        probes = [p for p, _ in make_probes(Graph.from_symbol(y), {}, shapes)]
        res = fusion.fuse(y, input_shapes=shapes)
        feed = {"x": np.random.rand(*shapes["x"]).astype("float32"),
                "c": (np.random.rand(*shapes["c"]) > 0.5).astype("float32")}
        a = fusion.verify(y, res, ({}, {}), shapes)
        print(json.dumps({"probes": [{k: list(v) for k, v in p.items()} for p in probes],
                          "err": a.max_rel}))
    """ % __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = __import__("json").loads(p.stdout.strip().splitlines()[-1])
    for probe in out["probes"]:
        assert probe["c"][0] == probe["x"][0] * probe["x"][1], probe
    assert out["err"] <= 1e-6


def test_sizes_equal_by_coincidence_are_set_apart():
    """a (2, 1, 8) + r (2, 1, 8): equal at the user's shapes, but MXNet also takes a (3, 9, 8) with
    r (3, 1, 8), where r broadcasts over a middle axis, not the residual form the rule fuses.
    A probe grows a's 1 alone, so the rule sees it and refuses; the graph runs as given."""
    a, r = S.var("a"), S.var("r")
    y = S.LayerNorm(S.broadcast_add(a, r), S.var("g"), S.var("b"))
    shapes = {"a": (2, 1, 8), "r": (2, 1, 8)}
    params = {"g": (8,), "b": (8,)}
    probes = [p for p, _ in make_probes(Graph.from_symbol(y), params, shapes)]
    assert any(p["a"][1] != p["r"][1] for p in probes), probes
    arg = {"g": mx.nd.array(np.linspace(0.5, 1.5, 8), dtype="float32"), "b": mx.nd.zeros((8,))}
    res = fusion.fuse(y, arg, {}, input_shapes=shapes)
    assert "fused_add_layer_norm" not in res.graph.count_ops()
    assert "broadcasts other than over the leading axes" in res.report.to_text(explain=True)
    rng = np.random.default_rng(0)
    compare_at(y, arg, {}, res, [{"a": rng.standard_normal((3, 9, 8)).astype(np.float32),
                                  "r": rng.standard_normal((3, 1, 8)).astype(np.float32)}])


def test_lengths_per_batch_and_head_follow_the_batch_probe():
    """Lengths of shape (B·H, Sq) beside q of shape (B, Sq, H·D): the batch probe grows both
    (B → B + 1, B·H → (B + 1)·H), so a decision that holds at batch 1 only is seen."""
    def heads(v):
        return S.reshape(S.transpose(S.reshape(v, shape=(0, 0, 2, -1)), axes=(0, 2, 1, 3)), shape=(-3, 0, 0))
    q, k, v = S.var("q"), S.var("k"), S.var("v")
    s = S.softmax(S.batch_dot(heads(q), heads(k), transpose_b=True), S.var("len", dtype="int32"),
                  use_length=True)
    o = S.batch_dot(s, heads(v))
    # merges (B·H) as (H, B): the inverse of the split at batch 1 only
    y = S.reshape(S.transpose(S.reshape(o, shape=(-4, 2, -1, 0, 0)), axes=(1, 2, 0, 3)), shape=(0, 0, -3))
    shapes = {"q": (1, 5, 8), "k": (1, 5, 8), "v": (1, 5, 8), "len": (2, 5)}
    probes = [p for p, _ in make_probes(Graph.from_symbol(y), {}, shapes)]
    assert {"q": (2, 5, 8), "k": (2, 5, 8), "v": (2, 5, 8), "len": (4, 5)}.items() <= probes[1].items(), probes
    res = fusion.fuse(y, input_shapes=shapes, input_dtypes={"len": "int32"})
    rng = np.random.default_rng(1)
    feed = {n: rng.standard_normal(sh).astype(np.float32) for n, sh in
            {"q": (3, 4, 8), "k": (3, 4, 8), "v": (3, 4, 8)}.items()}
    feed["len"] = rng.integers(1, 5, (6, 4)).astype(np.int32)
    compare_at(y, {}, {}, res, [feed])


def test_probe_sizes_never_shrink(tmp_path):
    """MXNet 1.9.1's Reshape infers a -1 of a size that does not divide as 0 and a later -1 then
    divides by zero (a crash in shape inference): probes only grow sizes, which keeps every -1 at
    least as large as at the user's shapes (a fresh process: a crash would end the test run)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import sys; sys.path.insert(0, %r)\n"
            "import mxnet as mx, fusion\n"
            "from fusion.engine.facts import make_probes\n"
            "from fusion.ir.graph import Graph\n"
            "S = mx.sym\n"
            "h = S.reshape(S.transpose(S.reshape(S.var('v'), shape=(0, 0, 4, -1)), axes=(0, 2, 1, 3)), shape=(-3, 0, 0))\n"
            "y = S.reshape(S.SwapAxis(S.reshape(h, reverse=True, shape=(-1, 4, 0, 0)), dim1=1, dim2=2), shape=(0, 0, -1))\n"
            "probes = [p for p, _ in make_probes(Graph.from_symbol(y), {}, {'v': (2, 5, 4)})]\n"
            "assert len(probes) > 1 and all(a >= b for p in probes for a, b in zip(p['v'], (2, 5, 4))), probes\n"
            "fusion.fuse(y, input_shapes={'v': (2, 5, 4)})\n"
            "print('ok')\n" % root)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-2000:]


def test_library_op_never_gets_an_unknown_shape_from_inference():
    """MXNet 1.9.1's wrapper around a library op's shape function overruns a buffer (SIGSEGV) when an
    input's shape is unknown, and a where of branches of two shapes leaves its output unknown
    without an error.  Facts of a graph holding library ops are inferred in stages, each library
    op only once its inputs are known: here no facts, and no crash (a probe of unfuse met this)."""
    from fusion.engine.facts import infer
    from fusion.ir.graph import Graph

    c, x, y, b = (mx.sym.var(n) for n in "cxyb")
    sym = mx.sym.fused_elemwise(mx.sym.softsign(mx.sym.where(c, x / 3, y)), b, expr="ge(exp(x0), x1)",
                                num_args=2)
    graph = Graph.from_symbol(sym)
    assert infer(graph, {"c": (2,), "x": (9,), "y": (2,), "b": (2,)}) == ({}, {})
    shapes, _ = infer(graph, {"c": (2,), "x": (2,), "y": (2,), "b": (2,)}, {"c": "float32", "x": "float32",
                                                                       "y": "float32", "b": "float32"})
    assert shapes[graph.heads[0]] == (2,)
    plain = fusion.unfuse(sym, {"c": (2,), "x": (2,), "y": (2,), "b": (2,)})
    assert not any(n["op"].startswith("fused_") for n in json.loads(plain.tojson())["nodes"])


def test_residual_broadcast_no_probe_reaches():
    """a (1, 3, 1) + r (1, 1, 1), with c (1, 3) tying a's axis 1 to the batch at any batch above 1:
    no probe can change the batch alone, and at the shapes (2, 2, 1) / (2, 1, 1) / (2, 2) r
    broadcasts over a's axis 1 but not its batch.  The op broadcasts as broadcast_add does, so the
    graph fused at the first shapes runs at the second (fuzz 2900009704442)."""
    a, r, c = S.var("a"), S.var("r"), S.var("c")
    s = S.broadcast_add(a, r)
    y = S.Group([S.broadcast_div(s, c), S.LayerNorm(s, S.var("g"), S.var("b"))])
    arg = {"g": mx.nd.array([1.34]), "b": mx.nd.array([-1.13])}
    res = fusion.fuse(y, arg, {}, input_shapes={"a": (1, 3, 1), "r": (1, 1, 1), "c": (1, 3)})
    assert res.graph.count_ops().get("fused_add_layer_norm") == 1
    rng = np.random.default_rng(0)
    compare_at(y, arg, {}, res, [{k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
                                 for shapes in ({"a": (1, 3, 1), "r": (1, 1, 1), "c": (1, 3)},
                                                {"a": (2, 2, 1), "r": (2, 1, 1), "c": (2, 2)})])
