"""ONNX Runtime on three ONNX files of one BERT: the original, ORT's transformers optimizer output, and ours.

    python benchmarks/bench_onnx.py [--quick] [--repeats 20] [--layers 12]

(a) the original: BERT-base (12 layers, hidden 768, 12 heads, FFN 3072, vocab 30522; random weights)
    written with ``onnx.helper`` the way torch's exporter writes it (``fusion.testing.onnx_bert``:
    int64 ids and mask, Shape-built head splits, erf GELU, opset 17), dynamic batch and sequence;
(b) ``onnxruntime.transformers.optimizer.optimize_model`` of (a) (model_type bert, opt_level 0, no
    symbolic shape inference: it needs sympy);
(c) ours: ``import_onnx`` of (a) at the benchmark's shape -> ``fuse`` -> ``export_onnx`` (target ort,
    the file's opset, int64 inputs kept), validated against MXNet in ONNX Runtime as it is written;
(d) the same of (b): ORT's optimizer output read back, fused and written again.

All three run in this process with the same session options (CPU, 2 intra-op threads unless
``OMP_NUM_THREADS`` says otherwise, ORT's default graph optimizations), interleaved round by round
on the same inputs (batch 1, the last quarter of the sequence padded out by the mask).  Printed:
median ms with p10-p90, node counts of each file, the ratios (a)/(c), (b)/(c) and (b)/(d) (> 1: ours
is faster), and the largest relative difference of (b), (c) and (d) from (a).  Sequence 128 and 512
(``--quick``: 128 only).
"""
import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fusion.native import env as _env  # noqa: E402

_env.configure_threads()

import numpy as np  # noqa: E402


def _session(path, threads):
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def _ort_optimized(src, dst, layers_heads_hidden):
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    heads, hidden = layers_heads_hidden
    opts = FusionOptions("bert")
    opts.enable_shape_inference = False
    model = optimizer.optimize_model(src, model_type="bert", num_heads=heads, hidden_size=hidden, opt_level=0,
                                     optimization_options=opts, use_gpu=False)
    model.save_model_to_file(dst)


def _ours(src, dst, shapes, opset):
    import fusion
    from fusion.onnx.importer import export_onnx, import_onnx

    t0 = time.perf_counter()
    sym, arg, aux = import_onnx(src, input_shapes=shapes)
    fused = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    check = export_onnx(fused.symbol, fused.arg_params, fused.aux_params, shapes, dst, opset=opset, target="ort",
                        input_dtypes={k: np.int64 for k in shapes})
    return time.perf_counter() - t0, check, fused


def _nodes(path):
    import collections

    import onnx
    m = onnx.load(path, load_external_data=False)
    return len(m.graph.node), collections.Counter(n.op_type for n in m.graph.node)


def _rel(a, b):
    return max(float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(x))), 1e-30)) for x, y in zip(a, b))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="sequence 128 only")
    ap.add_argument("--repeats", type=int, default=20, help="timed rounds (each runs the three files once)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    args = ap.parse_args()
    try:
        import onnx
        import onnxruntime  # noqa: F401
        from onnxruntime.transformers import optimizer  # noqa: F401
    except ImportError as e:
        print("needs onnx and onnxruntime (with onnxruntime.transformers): %s" % e)
        return
    from fusion.testing import onnx_bert

    hidden, heads, ffn, vocab, opset = 768, 12, 3072, 30522, 17
    seqs = [128] if args.quick else [128, 512]
    print("BERT-base: %d layers, hidden %d, %d heads, FFN %d, vocab %d; opset %d; ORT %s, %d thread(s); "
          "shared machine: medians of interleaved rounds" % (args.layers, hidden, heads, ffn, vocab, opset,
                                                             onnxruntime.__version__, args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        src, opt = os.path.join(tmp, "bert.onnx"), os.path.join(tmp, "bert.ort-optimized.onnx")
        onnx.save(onnx_bert(args.layers, hidden, heads, ffn, vocab, opset=opset), src)
        t0 = time.perf_counter()
        _ort_optimized(src, opt, (heads, hidden))
        t_opt = time.perf_counter() - t0
        n_a, c_a = _nodes(src)
        n_b, c_b = _nodes(opt)
        print("(a) original: %d nodes; (b) ORT optimizer: %d nodes (%.1f s): %s"
              % (n_a, n_b, t_opt, ", ".join("%s %d" % kv for kv in c_b.most_common(8))))
        for seq in seqs:
            shapes = {n: (1, seq) for n in ("input_ids", "token_type_ids", "attention_mask")}
            ours = os.path.join(tmp, "bert.ours.%d.onnx" % seq)
            t_ours, check, fused = _ours(src, ours, shapes, opset)
            n_c, c_c = _nodes(ours)
            print("seq %d: (c) ours: %d nodes (import+fuse+export+validate %.1f s; ORT vs MXNet %s): %s"
                  % (seq, n_c, t_ours, check, ", ".join("%s %d" % kv for kv in c_c.most_common(8))))
            again = os.path.join(tmp, "bert.again.%d.onnx" % seq)
            t_again, check, fused = _ours(opt, again, shapes, opset)
            n_d, c_d = _nodes(again)
            print("seq %d: (d) ours from (b): %d nodes (%.1f s; ORT vs MXNet %s): %s"
                  % (seq, n_d, t_again, check, ", ".join("%s %d" % kv for kv in c_d.most_common(8))))
            rng = np.random.default_rng(0)
            mask = np.ones((1, seq), np.int64)
            mask[:, seq * 3 // 4:] = 0
            feed = {"input_ids": rng.integers(0, vocab, (1, seq)).astype(np.int64),
                    "token_type_ids": np.zeros((1, seq), np.int64), "attention_mask": mask}
            sessions = {k: _session(p, args.threads) for k, p in (("a", src), ("b", opt), ("c", ours),
                                                                  ("d", again))}
            outs = {k: s.run(None, feed) for k, s in sessions.items()}
            for k, s in sessions.items():      # warm-up
                for _ in range(2):
                    s.run(None, feed)
            times = {k: [] for k in sessions}
            for _ in range(args.repeats):
                for k, s in sessions.items():
                    t = time.perf_counter()
                    s.run(None, feed)
                    times[k].append((time.perf_counter() - t) * 1e3)
            med = {k: float(np.median(v)) for k, v in times.items()}
            spread = {k: (float(np.percentile(v, 10)), float(np.percentile(v, 90))) for k, v in times.items()}
            for k, label, n in (("a", "original", n_a), ("b", "ORT optimizer", n_b), ("c", "ours", n_c),
                                ("d", "ours from (b)", n_d)):
                print("  (%s) %-14s %8.2f ms  (p10-p90 %.2f-%.2f)  %4d nodes" % (k, label, med[k], spread[k][0],
                                                                                spread[k][1], n))
            print("  speed-up of (c): vs (a) %.2fx, vs (b) %.2fx; of (d) vs (b) %.2fx;  nodes (c)/(d)/(b) %d/%d/%d;  "
                  "rel diff from (a): (b) %.1e, (c) %.1e, (d) %.1e"
                  % (med["a"] / med["c"], med["b"] / med["c"], med["b"] / med["d"], n_c, n_d, n_b,
                     _rel(outs["a"], outs["b"]), _rel(outs["a"], outs["c"]), _rel(outs["a"], outs["d"])))
            del sessions, fused


if __name__ == "__main__":
    main()
