"""fused_elemwise's generated kernels (NVRTC) on a GPU, through the C interface.

Forward semantics on special values: test_cuda_semantics.py (generated kernels and interpreter).
Here: the generated forward and backward against float64 PyTorch on the same (rounded) inputs, in
float32 / float16 / bfloat16 storage and mixes of them, broadcast patterns (a row, a channel, a
single element, leading axes), element counts with a tail past the last vector, unaligned
pointers (scalar steps), req add, empty outputs; the disk cache (a second process reads the
kernel the first wrote); the status naming NVRTC.  A GPU machine without NVRTC fails here (the
backward needs it): on a GPU nothing is skipped for it.
Tolerances: max |got - want| <= tol * (1 + max |want|), tol 1e-4 (fp32), 5e-3 (fp16), 4e-2 (bf16).
Needs an NVIDIA GPU, PyTorch with CUDA and nvcc; imports no MXNet.
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "..", "cuda_kernels"))
import cuda_iface as ci  # noqa: E402

pytestmark = pytest.mark.gpu
TOL = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 4e-2}


@pytest.fixture(scope="module")
def cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU available")
    lib = ci.load()
    return lib, torch, ci.Workspace(torch)


# ---- the expression language in float64 PyTorch (well-behaved inputs: the special values are
# the host tests' and test_cuda_semantics.py's) ------------------------------------------------------

def torch_fns(torch):
    F = torch.nn.functional
    return {
        "neg": lambda a: -a, "abs": torch.abs, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt,
        "rsqrt": torch.rsqrt, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu,
        "erf": torch.erf, "square": torch.square, "log1p": torch.log1p, "expm1": torch.expm1,
        "softrelu": F.softplus, "softsign": lambda a: a / (1 + a.abs()), "gelu": F.gelu,
        "log_sigmoid": F.logsigmoid, "mish": F.mish, "add": torch.add, "sub": torch.sub, "mul": torch.mul,
        "div": torch.div, "pow": torch.pow, "max": torch.maximum, "min": torch.minimum,
        "gt": lambda a, b: (a > b).double(), "lt": lambda a, b: (a < b).double(),
        "leaky": lambda a, s: torch.where(a > 0, a, a * s), "where": lambda c, a, b: torch.where(c != 0, a, b),
        "clip": lambda a, lo, hi: torch.where(a > hi, hi, torch.where(a < lo, lo, a)),
    }


def evaluate(torch, expr, xs):
    fns = torch_fns(torch)
    pos = [0]

    def parse():
        m = re.compile(r"\s*(x(\d+)|[-+]?[0-9.]+(?:e[-+]?\d+)?|[a-z_0-9]+)\s*").match(expr, pos[0])
        pos[0] = m.end()
        if m.group(2) is not None:
            return xs[int(m.group(2))]
        tok = m.group(1)
        if tok[0].isdigit() or tok[0] in "+-.":
            return torch.tensor(float(tok), dtype=torch.float64, device=xs[0].device)
        assert expr[pos[0]] == "("
        pos[0] += 1
        args = []
        while True:
            args.append(parse())
            c = expr[pos[0]]
            pos[0] += 1
            while pos[0] < len(expr) and expr[pos[0]] == " ":
                pos[0] += 1
            if c == ")":
                return fns[tok](*args)

    return parse()


def close(got, want, dtype, what):
    got, want = got.double().cpu().numpy(), want.double().cpu().numpy()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = np.abs(got - want).max(initial=0)
    scale = 1 + np.abs(want).max(initial=0)
    assert err <= TOL[dtype] * scale, "%s: max abs error %g > %g" % (what, err, TOL[dtype] * scale)


CASES = [  # expr, input shapes
    ("mul(x0, sigmoid(add(x1, 3.0)))", [(37, 300), (300,)]),
    ("add(mul(x0, x1), x2)", [(4, 16, 8, 8), (16, 1, 1), (16, 1, 1)]),
    ("where(gt(x0, x1), gelu(x2), mish(x0))", [(1000,), (1,), (1000,)]),
    ("mul(sigmoid(add(mul(x0, 1.5), 0.5)), tanh(sub(x0, 0.25)))", [(4097,)]),
    ("div(exp(x0), add(square(x1), 1.0))", [(3, 5, 7), (3, 1, 7)]),
    ("clip(relu(x0), x1, 1.5)", [(64, 33), (1, 33)]),
    ("mul(x0, x0)", [(2, 3, 1, 5)]),
]
DTYPES = ["float32", "float16", "bfloat16"]


def inputs(torch, shapes, dtypes, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [(torch.rand(s, generator=g, dtype=torch.float64) * 4 - 2).to(getattr(torch, d)).cuda()
            for s, d in zip(shapes, dtypes)]


def test_status_names_nvrtc(cuda):
    lib, _, _ = cuda
    status = lib.mxf_elemwise_jit_status().decode()
    assert status.startswith("nvrtc: NVRTC "), status


@pytest.mark.parametrize("dtype", DTYPES + ["mixed"])
@pytest.mark.parametrize("expr,shapes", CASES)
def test_forward_and_backward(cuda, dtype, expr, shapes):
    lib, torch, ws = cuda
    n = len(shapes)
    dts = [["float16", "float32", "bfloat16"][k % 3] for k in range(n)] if dtype == "mixed" else [dtype] * n
    out_dt = "float32" if dtype == "mixed" else dtype
    xs = inputs(torch, shapes, dts)
    out = torch.empty(torch.broadcast_shapes(*shapes), dtype=getattr(torch, out_dt), device="cuda")
    rc, err = ci.elemwise_ex(lib, expr, xs, out)
    assert rc == 0, err
    x64 = [x.double().requires_grad_() for x in xs]
    want = evaluate(torch, expr, x64)
    close(out, want, "bfloat16" if "bfloat16" in dts + [out_dt] else out_dt, expr + " forward")
    dy = inputs(torch, [tuple(out.shape)], [out_dt], seed=1)[0]
    grads = [torch.empty_like(x) for x in xs]
    rc, err = ci.elemwise_backward(lib, ws, expr, dy, xs, grads)
    assert rc == 0, err
    want_g = torch.autograd.grad(want, x64, dy.double(), allow_unused=True)
    for k, (g, w) in enumerate(zip(grads, want_g)):
        w = torch.zeros_like(x64[k]) if w is None else w
        close(g, w, "bfloat16" if "bfloat16" in dts + [out_dt] else dts[k], "%s d/dx%d" % (expr, k))


def test_backward_req_add_and_null(cuda):
    lib, torch, ws = cuda
    expr, shapes = CASES[0]
    xs = inputs(torch, shapes, ["float32"] * 2)
    dy = inputs(torch, [(37, 300)], ["float32"], seed=2)[0]
    base = [torch.ones_like(x) for x in xs]
    grads = [b.clone() for b in base]
    rc, err = ci.elemwise_backward(lib, ws, expr, dy, xs, grads, reqs=[ci.REQ_ADD, ci.REQ_NULL])
    assert rc == 0, err
    x64 = [x.double().requires_grad_() for x in xs]
    want = torch.autograd.grad(evaluate(torch, expr, x64), x64, dy.double())
    close(grads[0], base[0].double() + want[0], "float32", "req add")
    assert torch.equal(grads[1], base[1])  # req null: untouched


def test_unaligned_inputs_and_tails(cuda):
    lib, torch, ws = cuda
    for dtype in ("float16", "float32"):
        buf = inputs(torch, [(4099,)], [dtype])[0]
        x = buf[1:4098]          # one element off 16-byte alignment, 4097 elements
        out = torch.empty((4097,), dtype=x.dtype, device="cuda")
        rc, err = ci.elemwise_ex(lib, "tanh(mul(x0, 2.0))", [x], out)
        assert rc == 0, err
        close(out, torch.tanh(x.double() * 2), dtype, "unaligned " + dtype)


def test_empty_output_zeroes_a_broadcast_gradient(cuda):
    lib, torch, ws = cuda
    x0 = torch.empty((0, 8), device="cuda")
    x1 = torch.ones((8,), device="cuda")
    out = torch.empty((0, 8), device="cuda")
    assert ci.elemwise_ex(lib, "mul(x0, x1)", [x0, x1], out)[0] == 0
    g = [torch.empty_like(x0), torch.full_like(x1, 7.0)]
    rc, err = ci.elemwise_backward(lib, ws, "mul(x0, x1)", out, [x0, x1], g)
    assert rc == 0, err
    assert torch.equal(g[1], torch.zeros_like(x1))


def test_interpreter_fallback_gives_the_same_forward(cuda):
    lib, torch, _ = cuda
    expr, shapes = CASES[2]
    xs = inputs(torch, shapes, ["float32"] * 3)
    a, b = (torch.empty(1000, device="cuda") for _ in range(2))
    assert ci.elemwise_ex(lib, expr, xs, a)[0] == 0
    before = lib.mxf_elemwise_set_jit(0)
    try:
        assert ci.elemwise_ex(lib, expr, xs, b)[0] == 0
        rc, err = ci.elemwise_backward(lib, ci.Workspace(torch), expr, a, xs, [torch.empty_like(x) for x in xs])
        assert rc == ci.ERR_UNSUPPORTED and "no GPU backward without NVRTC" in err
    finally:
        lib.mxf_elemwise_set_jit(before)
    close(a, b.double(), "float32", "generated vs interpreter")


def test_kernels_are_cached_on_disk(cuda, tmp_path):
    code = r"""
import sys, torch
sys.path.insert(0, %r)
import cuda_iface as ci
lib = ci.load()
x = torch.linspace(-3, 3, 1 << 12, device="cuda")
out = torch.empty_like(x)
rc, err = ci.elemwise_ex(lib, "mul(tanh(x0), 1.2345678)", [x], out)
assert rc == 0, err
print(float((out - torch.tanh(x) * 1.2345678).abs().max()))
""" % os.path.join(_HERE, "..", "..", "cuda_kernels")
    env = dict(os.environ, MXFUSION_NVRTC_CACHE_DIR=str(tmp_path))

    def run():
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert float(r.stdout.split()[-1]) < 1e-5
    run()
    files = sorted(p for p in os.listdir(tmp_path) if p.endswith(".cubin") or p.endswith(".ptx"))
    assert len(files) == 1, files
    mtime = os.path.getmtime(tmp_path / files[0])
    run()
    assert sorted(p for p in os.listdir(tmp_path) if not p.endswith(".tmp")) == files
    assert os.path.getmtime(tmp_path / files[0]) == mtime      # read, not written again
