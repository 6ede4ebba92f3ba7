"""Import an ONNX model into MXNet, fuse it, verify it, and time it against the unfused model and ONNX Runtime.

    python examples/onnx_model.py          # a ResNet-style CNN built here, and tests/data/torch_tiny_bert.onnx
    python examples/onnx_model.py tests/data/torch_tiny_bert.onnx \\
        --shape hidden_states=1,128,32 --shape attention_mask=1,128  # any ONNX file

Timings are medians of interleaved runs (one forward of each system per round),
all in this process with the same thread count.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fusion.native import env as _env  # noqa: E402

_env.configure_threads()   # before mxnet is imported: OMP_NUM_THREADS, MXNET_CPU_PARALLEL_SIZE

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import fusion  # noqa: E402
from fusion.check.bench import executor, time_interleaved  # noqa: E402
from fusion import Graph  # noqa: E402
from fusion.onnx.importer import import_onnx  # noqa: E402
from fusion.check.verify import random_inputs  # noqa: E402


FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data",
                       "torch_tiny_bert.onnx")


def resnet_style_onnx(channels=32, blocks=3, size=56, opset=17):
    """Stem conv + `blocks` residual blocks (Conv-BN-ReLU, Conv-BN, Add, ReLU), GAP, Flatten, Gemm."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []

    def init(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def node(op, inputs, **attrs):
        out = "%s_%d" % (op.lower(), len(nodes))
        nodes.append(helper.make_node(op, inputs, [out], name="/%s_%d" % (op, len(nodes)), **attrs))
        return out

    def conv_bn(x, cin, cout, tag, stride=1):
        w = init(tag + ".conv.weight", rng.normal(0, (2.0 / (9 * cin)) ** 0.5, (cout, cin, 3, 3)))
        y = node("Conv", [x, w], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[stride, stride])
        bn = [init(tag + ".bn." + k, v) for k, v in (("weight", rng.uniform(0.5, 1.5, cout)),
                                                    ("bias", rng.normal(0, 0.1, cout)),
                                                    ("running_mean", rng.normal(0, 0.1, cout)),
                                                    ("running_var", rng.uniform(0.5, 2, cout)))]
        return node("BatchNormalization", [y] + bn, epsilon=1e-5)

    x = node("Relu", [conv_bn("input", 3, channels, "stem", stride=2)])
    for i in range(blocks):
        y = node("Relu", [conv_bn(x, channels, channels, "block%d.a" % i)])
        x = node("Relu", [node("Add", [conv_bn(y, channels, channels, "block%d.b" % i), x])])
    x = node("Flatten", [node("GlobalAveragePool", [x])], axis=1)
    x = node("Gemm", [x, init("fc.weight", rng.normal(0, 0.1, (1000, channels))),
                      init("fc.bias", np.zeros(1000))], transB=1)
    graph = helper.make_graph(nodes, "resnet_style",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, size, size])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", 1000])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model, {"input": (1, 3, size, size)}


def parse_shapes(items):
    shapes = {}
    for item in items or []:
        name, _, dims = item.partition("=")
        shapes[name] = tuple(int(d) for d in dims.split(","))
    return shapes


def ort_step(model_or_path, feed):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = int(os.environ["OMP_NUM_THREADS"])
    # ORT's workers otherwise spin ~45 ms after each run, taking the cores from the next system timed
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    src = model_or_path if isinstance(model_or_path, str) else model_or_path.SerializeToString()
    sess = ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])
    types = {i.name: i.type for i in sess.get_inputs()}
    feed = {k: v.astype(np.int64) if types[k] == "tensor(int64)" else v for k, v in feed.items() if k in types}
    return lambda: sess.run(None, feed)


def demo(label, model, shapes, repeats):
    onnx_ops = {}
    for n in (onnx.load(model) if isinstance(model, str) else model).graph.node:
        onnx_ops[n.op_type] = onnx_ops.get(n.op_type, 0) + 1
    print("== %s: %d ONNX nodes (%s)" % (label, sum(onnx_ops.values()),
                                         ", ".join("%s %d" % kv for kv in sorted(onnx_ops.items()))))
    sym, arg, aux = import_onnx(model, input_shapes=shapes)
    result = fusion.fuse(sym, arg, aux, input_shapes=shapes)
    check = fusion.verify((sym, arg, aux), result, input_shapes=shapes)
    print(result.report.to_text().splitlines()[0])
    for r in result.report.rules.values():
        if r.fused or r.rejected:
            print("  %-22s fused %d, rejected %d" % (r.name, len(r.fused), len(r.rejected)))
    before, after = Graph.from_symbol(sym).count_ops(), result.graph.count_ops()
    print("MXNet ops imported:", ", ".join("%s %d" % kv for kv in sorted(before.items())))
    print("MXNet ops fused:   ", ", ".join("%s %d" % kv for kv in sorted(after.items())))
    print("verify (fused vs imported MXNet):", check)

    inputs = random_inputs(sym, arg, shapes)
    times = time_interleaved({
        "mxnet unfused": executor(sym, arg, aux, inputs),
        "mxnet fused": executor(result.symbol, result.arg_params, result.aux_params, inputs),
        "onnxruntime": ort_step(model, inputs),
    }, repeats=repeats, warmup=10)
    print("median latency (%s threads, %d interleaved runs):" % (os.environ["OMP_NUM_THREADS"], repeats))
    for name, t in times.items():
        print("  %-14s %8.3f ms" % (name, t * 1e3))
    fused = times["mxnet fused"]
    print("speed-up of fused MXNet: %.2fx vs unfused MXNet, %.2fx vs ONNX Runtime\n"
          % (times["mxnet unfused"] / fused, times["onnxruntime"] / fused))
    return check.ok()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="an ONNX file (default: a CNN built here and the BERT-layer fixture)")
    ap.add_argument("--shape", action="append", help="NAME=D1,D2,... for each input")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="3 timed rounds (used by the tests)")
    args = ap.parse_args()
    if args.quick:
        args.repeats = 3

    if args.model:
        runs = [(os.path.basename(args.model), args.model, parse_shapes(args.shape))]
    else:
        cnn, shapes = resnet_style_onnx()
        runs = [("ResNet-style CNN (built here, opset 17)", cnn, shapes)]
        if os.path.exists(FIXTURE):
            runs.append(("BERT layer exported by torch.onnx (tests/data)", FIXTURE,
                         {"hidden_states": (1, 128, 32), "attention_mask": (1, 128)}))
    ok = [demo(label, model, shapes, args.repeats) for label, model, shapes in runs]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
