"""Your own rule, lowered onto your own operator: a Python ``CustomOp`` with forward and backward.

    python examples/custom_rule.py                      # fuse, verify, train one step through the fused op
    mxfuse model-symbol.json --params model-0000.params -o out/ --rules default,examples.custom_rule:RULES

The rule below finds ``a·tanh(b·x)`` (two scalar ops around a tanh) and replaces it
with one call of the ``scaled_tanh`` CustomOp defined here.  It is written with the
same DSL as the library's rules, imported from the public module for rule authors
(``fusion.rules``): a pattern, an optional check returning a reason, a rewrite that builds
the replacement.  Because the CustomOp has a
backward, the rule is valid in training too (``inference_only`` stays False).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402

import fusion  # noqa: E402
from fusion.rules import Rule, Var, op, scalar  # noqa: E402


class ScaledTanh(mx.operator.CustomOp):
    """y = a·tanh(b·x);  dy/dx = a·b·(1 − tanh²(b·x))."""

    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = a, b

    def forward(self, is_train, req, in_data, out_data, aux):
        self.assign(out_data[0], req[0], self.a * mx.nd.tanh(self.b * in_data[0]))

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        t = mx.nd.tanh(self.b * in_data[0])
        self.assign(in_grad[0], req[0], out_grad[0] * (self.a * self.b) * (1 - t * t))


@mx.operator.register("scaled_tanh")
class ScaledTanhProp(mx.operator.CustomOpProp):
    def __init__(self, a="1", b="1"):
        super().__init__(need_top_grad=True)
        self.a, self.b = float(a), float(b)

    def list_arguments(self):
        return ["data"]

    def list_outputs(self):
        return ["output"]

    def infer_shape(self, in_shape):
        return in_shape, [in_shape[0]], []

    def create_operator(self, ctx, shapes, dtypes):
        return ScaledTanh(self.a, self.b)


class FuseScaledTanh(Rule):
    name = "scaled_tanh"
    benefit = 200
    description = "a·tanh(b·x) → Custom(op_type='scaled_tanh')"

    def pattern(self):
        return scalar("mul", op.tanh(scalar("mul", Var("x"), name="b"), name="t"), name="a")

    def check(self, m):
        if m.node("b").attrs["scalar"] == 0:
            return "b = 0: the tanh is constant"
        return None

    def rewrite(self, m, b):
        return b.op("Custom", [m["x"]], name=m.anchor.name,
                    attrs={"op_type": "scaled_tanh", "a": m.node("a").attrs["scalar"], "b": m.node("b").attrs["scalar"]})


RULES = [FuseScaledTanh()]


def model():
    x = mx.sym.var("data")
    h = mx.sym.FullyConnected(x, num_hidden=16, name="fc1")
    h = 1.7159 * mx.sym.tanh(h * 0.6666)          # LeCun's scaled tanh
    return mx.sym.FullyConnected(h, num_hidden=4, name="fc2")


def main():
    sym = model()
    rng = np.random.default_rng(0)
    shapes = {"data": (8, 10)}
    arg_shapes, _, _ = sym.infer_shape(**shapes)
    arg = {n: mx.nd.array(rng.normal(0, 0.3, s)) for n, s in zip(sym.list_arguments(), arg_shapes) if n != "data"}

    result = fusion.fuse(sym, arg, {}, rules=RULES, mode="training")
    print(result.report)
    print("ops after:", result.graph.count_ops())
    print("verify:", fusion.verify(sym, result, (arg, {}), shapes))

    # one SGD step through both graphs: same gradients, same updated weights
    x = mx.nd.array(rng.standard_normal(shapes["data"]))
    updated = []
    for s, params in ((sym, arg), (result.symbol, result.arg_params)):
        args = {k: v.copy() for k, v in params.items()}
        args["data"] = x
        grads = {k: mx.nd.zeros(v.shape) for k, v in args.items() if k != "data"}
        exe = s.bind(mx.cpu(), args, args_grad=grads)
        exe.forward(is_train=True)
        exe.backward(mx.nd.ones(exe.outputs[0].shape))
        updated.append({k: (args[k] - 0.1 * grads[k]).asnumpy() for k in grads})
    worst = max(float(np.abs(updated[0][k] - updated[1][k]).max()) for k in updated[0])
    print("one training step through the fused CustomOp: max weight difference %.2e" % worst)
    assert worst < 1e-5
    return worst


if __name__ == "__main__":
    main()
