"""BERT-base encoder: fused MXNet vs MXNet (default bind, subgraph backend off) vs ONNX Runtime.

    python benchmarks/bench_bert.py [--layers 12] [--seqs 128,512] [--variants builtin,written] [--repeats 10]

A 12-layer BERT-base encoder (hidden 768, 12 heads, FFN 3072, batch 1) is built with
``mx.sym`` the classic way (FullyConnected projections, Reshape/transpose head split,
batch_dot/softmax/batch_dot, residual add + LayerNorm, GELU), with random weights:

* ``builtin``: LayerNorm and LeakyReLU(gelu) ops;
* ``written``: LayerNorm and GELU written out elementwise (mean/sub/square/…, erf form),
  as after an ONNX import or in hand-written models.

The same weights go into an ONNX model (opset 17, MatMul+Add, Reshape/Transpose,
Softmax, LayerNormalization or its decomposition, erf GELU) run by ONNX Runtime with
all graph optimizations.  Each system is timed in the same process: MXNet systems
round-robin, ONNX Runtime in its own blocks (its workers spin after a run and would
slow whatever runs next; blocks alternate and are re-warmed).  Medians are printed
with ratios.  Outputs are checked against MXNet's default bind first.
"""
import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fusion.native import env as _env  # noqa: E402

_env.configure_threads()

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402

import fusion  # noqa: E402
from fusion.check.bench import executor, time_interleaved  # noqa: E402
from fusion.check.verify import run as run_model  # noqa: E402

S = mx.sym


# ---------------------------------------------------------------- the model, in MXNet

def layer_norm(x, name, written):
    g, b = S.var(name + "_gamma"), S.var(name + "_beta")
    if not written:
        return S.LayerNorm(x, g, b, axis=-1, eps=1e-12, name=name)
    mean = S.mean(x, axis=-1, keepdims=True)
    d = S.broadcast_sub(x, mean)
    var = S.mean(S.square(d), axis=-1, keepdims=True)
    return S.broadcast_add(S.broadcast_mul(S.broadcast_div(d, S.sqrt(var + 1e-12)), g), b)


def gelu(x, written):
    if not written:
        return S.LeakyReLU(x, act_type="gelu")
    return (x * 0.5) * (S.erf(x / math.sqrt(2.0)) + 1.0)


def encoder(layers, hidden, heads, ffn, written):
    x = S.var("data")
    d = hidden // heads

    def fc(t, n, name):
        return S.FullyConnected(t, num_hidden=n, flatten=False, name=name)

    def split(t):
        return S.reshape(S.transpose(S.reshape(t, shape=(0, 0, heads, -1)), axes=(0, 2, 1, 3)), shape=(-3, 0, 0))

    for i in range(layers):
        p = "l%d_" % i
        q, k, v = (split(fc(x, hidden, p + n)) for n in ("query", "key", "value"))
        s = S.batch_dot(q, k, transpose_b=True) / math.sqrt(d)
        ctx = S.batch_dot(S.softmax(s, axis=-1), v)
        ctx = S.reshape(S.transpose(S.reshape(ctx, shape=(-4, -1, heads, 0, 0)), axes=(0, 2, 1, 3)), shape=(0, 0, -3))
        h = layer_norm(fc(ctx, hidden, p + "attn_out") + x, p + "ln1", written)
        f = fc(gelu(fc(h, ffn, p + "ffn1"), written), hidden, p + "ffn2")
        x = layer_norm(f + h, p + "ln2", written)
    return x


def random_weights(sym, seq, hidden, seed=0):
    rng = np.random.default_rng(seed)
    known = {n: (hidden,) for n in sym.list_arguments() if n.endswith("_gamma") or n.endswith("_beta")}
    shapes, _, _ = sym.infer_shape(data=(1, seq, hidden), **known)
    params = {}
    for name, shape in zip(sym.list_arguments(), shapes):
        if name == "data":
            continue
        if name.endswith("_gamma"):
            params[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name.endswith("_beta") or name.endswith("_bias"):
            params[name] = (0.02 * rng.standard_normal(shape)).astype(np.float32)
        else:
            params[name] = (0.02 * rng.standard_normal(shape)).astype(np.float32)
    return params


# ---------------------------------------------------------------- the same model, in ONNX

def onnx_model(params, layers, hidden, heads, ffn, seq, written):
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits = [], []
    d = hidden // heads

    def const(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    counter = [0]

    def node(op, inputs, **attrs):
        counter[0] += 1
        out = "%s_%d" % (op.lower(), counter[0])
        nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def dense(t, name):
        w = const(name + "_w", params[name + "_weight"].T.copy())
        return node("Add", [node("MatMul", [t, w]), const(name + "_b", params[name + "_bias"])])

    def ln(t, name):
        g, b = const(name + "_g", params[name + "_gamma"]), const(name + "_be", params[name + "_beta"])
        if not written:
            return node("LayerNormalization", [t, g, b], axis=-1, epsilon=1e-12)
        mean = node("ReduceMean", [t], axes=[-1], keepdims=1)
        dd = node("Sub", [t, mean])
        var = node("ReduceMean", [node("Mul", [dd, dd])], axes=[-1], keepdims=1)
        norm = node("Div", [dd, node("Sqrt", [node("Add", [var, const(name + "_eps", np.float32(1e-12))])])])
        return node("Add", [node("Mul", [norm, g]), b])

    def act(t, name):
        e = node("Erf", [node("Div", [t, const(name + "_sqrt2", np.float32(math.sqrt(2.0)))])])
        return node("Mul", [node("Mul", [t, const(name + "_half", np.float32(0.5))]),
                            node("Add", [e, const(name + "_one", np.float32(1.0))])])

    heads_shape = const("heads_shape", np.array([0, 0, heads, d], np.int64))
    merge_shape = const("merge_shape", np.array([0, 0, hidden], np.int64))
    x = "data"
    for i in range(layers):
        p = "l%d_" % i
        q, k, v = (node("Transpose", [node("Reshape", [dense(x, p + n), heads_shape])], perm=[0, 2, 1, 3])
                   for n in ("query", "key", "value"))
        s = node("Div", [node("MatMul", [q, node("Transpose", [k], perm=[0, 1, 3, 2])]),
                         const(p + "scale", np.float32(math.sqrt(d)))])
        c = node("MatMul", [node("Softmax", [s], axis=-1), v])
        c = node("Reshape", [node("Transpose", [c], perm=[0, 2, 1, 3]), merge_shape])
        h = ln(node("Add", [dense(c, p + "attn_out"), x]), p + "ln1")
        f = dense(act(dense(h, p + "ffn1"), p), p + "ffn2")
        x = ln(node("Add", [f, h]), p + "ln2")
    graph = helper.make_graph(nodes, "bert", [helper.make_tensor_value_info("data", TensorProto.FLOAT, [1, seq, hidden])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, seq, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def ort_session(model_bytes, threads):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


def time_ort(sess, feed, repeats):
    sess.run(None, feed)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - t)
    return times


# ---------------------------------------------------------------- one configuration

def run(seq, variant, args):
    hidden, heads, ffn = 768, 12, 3072
    written = variant == "written"
    sym = encoder(args.layers, hidden, heads, ffn, written)
    weights = random_weights(sym, seq, hidden)
    arg = {k: mx.nd.array(v) for k, v in weights.items()}
    x = np.random.default_rng(1).standard_normal((1, seq, hidden)).astype(np.float32)
    t0 = time.perf_counter()
    result = fusion.fuse(sym, arg, {}, input_shapes={"data": x.shape})
    fuse_s = time.perf_counter() - t0
    inputs = {"data": x}
    systems = {
        "fused": executor(result.symbol, result.arg_params, result.aux_params, inputs),
        "mxnet_default": executor(sym, arg, {}, inputs),
        "mxnet_subgraph_off": executor(sym, arg, {}, inputs, subgraph=False),
    }
    ref = run_model(sym, arg, {}, inputs, subgraph=True)[0]
    out = run_model(result.symbol, result.arg_params, {}, inputs, subgraph=True)[0]
    rel = float(np.abs(out - ref).max() / np.abs(ref).max())
    ort_rel = None
    if not args.no_ort:
        sess = ort_session(onnx_model(weights, args.layers, hidden, heads, ffn, seq, written), args.threads)
        ort_out = sess.run(None, {"data": x})[0]
        ort_rel = float(np.abs(ort_out - ref).max() / np.abs(ref).max())
    mx_samples = {k: [] for k in systems}
    ort_samples = []
    for block in range(args.blocks):
        if not args.no_ort:
            ort_samples += time_ort(sess, {"data": x}, args.repeats)
            time.sleep(0.1)                      # let ONNX Runtime's workers stop spinning
        med = time_interleaved(systems, repeats=args.repeats, warmup=1)
        for k, v in med.items():
            mx_samples[k].append(v)
    ms = {k: 1e3 * statistics.median(v) for k, v in mx_samples.items()}
    if ort_samples:
        ms["onnxruntime"] = 1e3 * statistics.median(ort_samples)
    return ms, rel, ort_rel, result, fuse_s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seqs", default="128,512")
    ap.add_argument("--variants", default="builtin,written")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per block and system")
    ap.add_argument("--blocks", type=int, default=3, help="alternating ORT / MXNet blocks")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--no-ort", action="store_true")
    args = ap.parse_args()
    print("mxnet %s, OMP_NUM_THREADS=%s, %d layers, batch 1, hidden 768, 12 heads"
          % (mx.__version__, os.environ.get("OMP_NUM_THREADS"), args.layers))
    header = ("%-8s %4s | %9s %9s %9s %9s | %9s %9s %9s | %8s %8s %6s"
              % ("variant", "seq", "fused", "mx-def", "mx-off", "ORT", "vs def", "vs off", "vs ORT",
                 "rel err", "ORT err", "fuse s"))
    print(header)
    print("-" * len(header))
    for variant in args.variants.split(","):
        for seq in (int(s) for s in args.seqs.split(",")):
            ms, rel, ort_rel, result, fuse_s = run(seq, variant, args)
            ort = ms.get("onnxruntime")
            print("%-8s %4d | %9.1f %9.1f %9.1f %9s | %8.2fx %8.2fx %9s | %8.1e %8s %6.2f" % (
                variant, seq, ms["fused"], ms["mxnet_default"], ms["mxnet_subgraph_off"],
                "%.1f" % ort if ort else "-", ms["mxnet_default"] / ms["fused"], ms["mxnet_subgraph_off"] / ms["fused"],
                "%.2fx" % (ort / ms["fused"]) if ort else "-", rel, "%.1e" % ort_rel if ort_rel is not None else "-",
                fuse_s), flush=True)
            if args.layers and variant == args.variants.split(",")[0] and seq == int(args.seqs.split(",")[0]):
                counts = result.graph.count_ops()
                print("         fused graph: %s" % ", ".join("%s×%d" % kv for kv in sorted(counts.items())))
    print("ratios: time of the baseline / time of the fused model (higher is better); medians of %d×%d runs"
          % (args.blocks, args.repeats))


if __name__ == "__main__":
    main()
