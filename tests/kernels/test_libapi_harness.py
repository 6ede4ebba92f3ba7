"""The op library through MXNet's lib_api entry points (libapi_harness.py), without MXNet.

CPU path (runs everywhere the op library builds): NumPy arrays through the same calls
MXNet makes, against the NumPy references -- this keeps the harness itself tested.
GPU path (an NVIDIA GPU + PyTorch with CUDA + an op library built with nvcc): each op's
"gpu" registration on PyTorch CUDA tensors and PyTorch's stream, against PyTorch; skipped
with the reason otherwise.  On a GPU machine without MXNet:

    MXFUSION_MXNET_DIR=<copy of MXNet's include/ + src/lib_api.cc> \\
        python3 -m pytest --noconftest -q tests/kernels/test_libapi_harness.py
"""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_fixtures import native_module  # noqa: E402
from libapi_harness import LibError, OpLibrary  # noqa: E402
from references import ref_attention  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def oplib():
    native = native_module()
    try:
        native.build()      # and the kernels' library, where nvcc and cuBLASLt are
    except RuntimeError as e:
        pytest.skip("the op library cannot be built here: %s" % str(e).splitlines()[0])
    dnnl = native.dnnl_library()
    if dnnl:
        os.environ["MXFUSION_DNNL_LIB"] = dnnl      # the library binds oneDNN on first use
    return OpLibrary(native.library_path())


@pytest.fixture(scope="module")
def torch_cuda():
    torch = pytest.importorskip("torch", reason="the GPU path needs PyTorch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to PyTorch")
    return torch


def need_gpu(lib, op, kind="forward"):
    if "gpu" not in lib.devices(op)[kind]:
        pytest.skip("%s has no gpu %s in this op library (built without nvcc, or none written)" % (op, kind))


def rng(seed=0):
    return np.random.default_rng(seed)


# ---- registrations ---------------------------------------------------------------------------

def test_registrations_read_like_mxnet(oplib):
    ops = oplib.ops
    assert {"fused_dense", "fused_attention", "fused_add_layer_norm", "fused_elemwise", "fused_se"} <= set(ops)
    for name, reg in ops.items():
        assert reg.parse and reg.infer_type and reg.infer_shape, name
        assert "cpu" in oplib.devices(name)["forward"], name
    assert "cpu" in ops["fused_dense"].create        # stateful: a create function per device
    assert oplib.num_inouts("fused_dense", {"num_hidden": 4}) == (3, 1)
    assert oplib.infer_shape("fused_dense", {"num_hidden": 4, "flatten": False}, [(2, 3, 5), (4, 5), (4,)]) \
        == [(2, 3, 4)]
    assert oplib.infer_type("fused_add_layer_norm", {}, [0, 0, 0, 0]) == [0]


def test_errors_come_back_with_the_message(oplib):
    with pytest.raises(LibError, match="fused_dense.*weight must be 2-D"):
        oplib.infer_shape("fused_dense", {"num_hidden": 4}, [(2, 5), (4, 5, 1), (4,)])


# ---- CPU path ------------------------------------------------------------------------------------

def test_cpu_add_layer_norm_forward_backward(oplib):
    r = rng(1)
    a, b = r.standard_normal((6, 16)).astype(np.float32), r.standard_normal((16,)).astype(np.float32)
    g, be = r.uniform(0.5, 1.5, 16).astype(np.float32), r.standard_normal(16).astype(np.float32)
    attrs = {"eps": 1e-5}
    (y,) = oplib.forward("fused_add_layer_norm", attrs, [a, b, g, be])
    s = (a + b).astype(np.float64)
    xh = (s - s.mean(-1, keepdims=True)) / np.sqrt(s.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, xh * g + be, **TOL)
    dy = r.standard_normal(y.shape).astype(np.float32)
    da, db, dg, dbe = oplib.backward("fused_add_layer_norm", attrs, [dy], [a, b, g, be], [y])
    np.testing.assert_allclose(dbe, dy.sum(0), **TOL)
    np.testing.assert_allclose(dg, (dy * xh).sum(0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(db, da.sum(0), rtol=1e-4, atol=1e-4)


def test_cpu_elemwise_forward_backward(oplib):
    r = rng(2)
    x, y = r.standard_normal((4, 8)).astype(np.float32), r.standard_normal((8,)).astype(np.float32)
    attrs = {"expr": "mul(tanh(x0), add(x1, 1.0))", "num_args": 2}
    (out,) = oplib.forward("fused_elemwise", attrs, [x, y])
    np.testing.assert_allclose(out, np.tanh(x) * (y + 1), **TOL)
    dout = np.ones_like(out)
    dx, dyv = oplib.backward("fused_elemwise", attrs, [dout], [x, y], [out])
    np.testing.assert_allclose(dx, (1 - np.tanh(x) ** 2) * (y + 1), **TOL)
    np.testing.assert_allclose(dyv, np.tanh(x).sum(0), **TOL)


def test_cpu_attention_forward(oplib):
    r = rng(3)
    q, k, v = (r.standard_normal((4, 5, 8)).astype(np.float32) for _ in range(3))
    attrs = {"scale": 0.35, "layout": "plain", "causal": True}
    (o,) = oplib.forward("fused_attention", attrs, [q, k, v])
    np.testing.assert_allclose(o, ref_attention(q, k, v, 0.35, causal=True), **TOL)


def test_cpu_dense_stateful_forward_backward(oplib):
    if not native_module().dnnl_library():
        pytest.skip("oneDNN (libdnnl.so.3) not found: the CPU fused_dense needs it")
    r = rng(4)
    x, w, b = (r.standard_normal(s).astype(np.float32) for s in ((6, 5), (4, 5), (4,)))
    attrs = {"num_hidden": 4, "act": "tanh"}
    (y,) = oplib.forward("fused_dense", attrs, [x, w, b])
    np.testing.assert_allclose(y, np.tanh(x @ w.T + b), **TOL)
    dy = r.standard_normal(y.shape).astype(np.float32)
    dx, dw, db = oplib.backward("fused_dense", attrs, [dy], [x, w, b], [y])
    dz = dy * (1 - y.astype(np.float64) ** 2)
    np.testing.assert_allclose(dx, dz @ w, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dw, dz.T @ x, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(db, dz.sum(0), rtol=1e-4, atol=1e-4)


def test_tensors_on_another_device_are_refused(oplib):
    a = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="every tensor must be on gpu"):
        oplib.compute("fused_add_layer_norm", {}, [a, a[0], a[0], a[0]], [a], "gpu")


@pytest.mark.parametrize("op,attrs,shapes", [
    ("fused_add_layer_norm", {}, [(2, 4), (4,), (4,), (4,)]),
    ("fused_elemwise", {"expr": "exp(x0)"}, [(2, 4)]),
    ("fused_attention", {"scale": 0.5}, [(2, 3, 4)] * 3),
    ("fused_dense", {"num_hidden": 3}, [(2, 4), (3, 4), (3,)]),    # stateful: its gpu state
])
def test_gpu_functions_refuse_host_tensors(oplib, op, attrs, shapes):
    """The "gpu" functions run here up to their checks (no CUDA call is reached): arrays in host
    memory are refused with the op's name, through lib_api's error path."""
    need_gpu(oplib, op)
    ins = [np.zeros(s, np.float32) for s in shapes]
    outs = [np.zeros(s, np.float32) for s in oplib.infer_shape(op, attrs, shapes)]
    with pytest.raises(LibError, match=r"%s \(gpu\).*input 0 is on cpu, not on the GPU" % op):
        oplib.compute(op, attrs, ins, outs, "gpu", check_devices=False)


# ---- GPU path ----------------------------------------------------------------------------------

def _stream(torch):
    return torch.cuda.current_stream().cuda_stream


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["none", "relu", "gelu_erf"])
def test_gpu_dense(oplib, torch_cuda, act):
    torch = torch_cuda
    need_gpu(oplib, "fused_dense")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 96, device="cuda", generator=g)
    w = torch.randn(48, 96, device="cuda", generator=g)
    b = torch.randn(48, device="cuda", generator=g)
    (y,) = oplib.forward("fused_dense", {"num_hidden": 48, "act": act}, [x, w, b], device="gpu",
                         stream=_stream(torch))
    z = torch.addmm(b, x, w.t())
    ref = {"none": z, "relu": torch.relu(z), "gelu_erf": torch.nn.functional.gelu(z)}[act]
    torch.cuda.synchronize()
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_attention(oplib, torch_cuda, causal):
    torch = torch_cuda
    need_gpu(oplib, "fused_attention")
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(6, 128, 64, device="cuda", generator=g) for _ in range(3))
    (o,) = oplib.forward("fused_attention", {"scale": 0.125, "layout": "plain", "causal": causal},
                         [q, k, v], device="gpu", stream=_stream(torch))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.125)
    torch.cuda.synchronize()
    torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_attention_valid_length(oplib, torch_cuda):
    torch = torch_cuda
    need_gpu(oplib, "fused_attention")
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(4, 16, 32, device="cuda", generator=g) for _ in range(3))
    lengths = torch.tensor([16., 7., 1., 0.], device="cuda")
    (o,) = oplib.forward("fused_attention", {"scale": 0.2, "layout": "plain", "mask_kind": "valid_length"},
                         [q, k, v, lengths], device="gpu", stream=_stream(torch))
    torch.cuda.synchronize()
    ref = ref_attention(*(t.cpu().numpy() for t in (q, k, v)), 0.2, mask=lengths.cpu().numpy(),
                        mask_kind="valid_length")
    np.testing.assert_allclose(o.cpu().numpy(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_add_layer_norm(oplib, torch_cuda):
    torch = torch_cuda
    need_gpu(oplib, "fused_add_layer_norm")
    g = torch.Generator(device="cuda").manual_seed(3)
    a, b = torch.randn(256, 768, device="cuda", generator=g), torch.randn(768, device="cuda", generator=g)
    gamma, beta = torch.rand(768, device="cuda", generator=g) + 0.5, torch.randn(768, device="cuda", generator=g)
    y, s = oplib.forward("fused_add_layer_norm", {"eps": 1e-5, "output_sum": True}, [a, b, gamma, beta],
                         device="gpu", stream=_stream(torch))
    ref = torch.nn.functional.layer_norm(a + b, (768,), gamma, beta, 1e-5)
    torch.cuda.synchronize()
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, a + b)


@pytest.mark.gpu
def test_gpu_elemwise(oplib, torch_cuda):
    torch = torch_cuda
    need_gpu(oplib, "fused_elemwise")
    g = torch.Generator(device="cuda").manual_seed(4)
    x, y = torch.randn(32, 1000, device="cuda", generator=g), torch.randn(1000, device="cuda", generator=g)
    (out,) = oplib.forward("fused_elemwise", {"expr": "mul(tanh(x0), add(x1, 1.0))", "num_args": 2}, [x, y],
                           device="gpu", stream=_stream(torch))
    torch.cuda.synchronize()
    torch.testing.assert_close(out, torch.tanh(x) * (y + 1), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_backward_where_registered(oplib, torch_cuda):
    torch = torch_cuda
    need_gpu(oplib, "fused_add_layer_norm", "backward")
    g = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(64, 256, device="cuda", generator=g, requires_grad=True)
    b = torch.randn(256, device="cuda", generator=g, requires_grad=True)
    gamma = (torch.rand(256, device="cuda", generator=g) + 0.5).requires_grad_()
    beta = torch.randn(256, device="cuda", generator=g, requires_grad=True)
    ref = torch.nn.functional.layer_norm(a + b, (256,), gamma, beta, 1e-5)
    dy = torch.randn_like(ref)
    ref.backward(dy)
    ins = [t.detach() for t in (a, b, gamma, beta)]
    got = oplib.backward("fused_add_layer_norm", {"eps": 1e-5}, [dy], ins, [ref.detach()], device="gpu",
                         stream=_stream(torch))
    torch.cuda.synchronize()
    for g_, t in zip(got, (a, b, gamma, beta)):
        torch.testing.assert_close(g_, t.grad, rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
def test_gpu_dense_backward(oplib, torch_cuda):
    torch = torch_cuda
    need_gpu(oplib, "fused_dense")
    g = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(64, 96, device="cuda", generator=g, requires_grad=True)
    w = torch.randn(48, 96, device="cuda", generator=g, requires_grad=True)
    b = torch.randn(48, device="cuda", generator=g, requires_grad=True)
    y = torch.nn.functional.gelu(torch.addmm(b, x, w.t()))
    dy = torch.randn_like(y)
    y.backward(dy)
    attrs = {"num_hidden": 48, "act": "gelu_erf"}
    ins = [t.detach() for t in (x, w, b)]
    got = oplib.backward("fused_dense", attrs, [dy], ins, [y.detach()], device="gpu", stream=_stream(torch))
    torch.cuda.synchronize()
    for g_, t in zip(got, (x, w, b)):
        torch.testing.assert_close(g_, t.grad, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_attention_backward(oplib, torch_cuda, causal):
    torch = torch_cuda
    need_gpu(oplib, "fused_attention", "backward")
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(4, 96, 64, device="cuda", generator=g, requires_grad=True) for _ in range(3))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.125)
    do = torch.randn_like(o)
    o.backward(do)
    attrs = {"scale": 0.125, "layout": "plain", "causal": causal}
    ins = [t.detach() for t in (q, k, v)]
    got = oplib.backward("fused_attention", attrs, [do], ins, [o.detach()], device="gpu", stream=_stream(torch))
    torch.cuda.synchronize()
    for g_, t in zip(got, (q, k, v)):
        torch.testing.assert_close(g_, t.grad, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gpu_elemwise_backward(oplib, torch_cuda, dtype):
    """The generated (NVRTC) backward through lib_api: a row-broadcast input's gradient summed."""
    torch = torch_cuda
    need_gpu(oplib, "fused_elemwise", "backward")
    g = torch.Generator(device="cuda").manual_seed(8)
    dt = getattr(torch, dtype)
    x = torch.randn(64, 300, device="cuda", generator=g).to(dt).requires_grad_()
    b = torch.randn(300, device="cuda", generator=g).to(dt).requires_grad_()
    ref = x.float() * torch.sigmoid(b.float() + 3)
    dy = torch.randn_like(ref).to(dt)
    ref.backward(dy.float())
    attrs = {"expr": "mul(x0, sigmoid(add(x1, 3.0)))", "num_args": 2}
    (y,) = oplib.forward("fused_elemwise", attrs, [x.detach(), b.detach()], device="gpu", stream=_stream(torch))
    gx, gb = oplib.backward("fused_elemwise", attrs, [dy], [x.detach(), b.detach()], [y], device="gpu",
                            stream=_stream(torch))
    torch.cuda.synchronize()
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == "float32" else dict(rtol=5e-3, atol=5e-2)
    torch.testing.assert_close(y.float(), ref.detach(), **tol)
    torch.testing.assert_close(gx.float(), x.grad.float(), **tol)
    torch.testing.assert_close(gb.float(), b.grad.float(), **tol)


@pytest.mark.gpu
def test_gpu_amp_float16_dtypes(oplib, torch_cuda):
    """The dtypes of MXNet's AMP float16 graphs through the "gpu" functions: a float16 fused_dense;
    LayerNorm of a float16 projection plus a float32 residual with float32 gamma/beta and output
    (computed in float32: the glue widens); attention on float16 q/k/v with a float32 output."""
    torch = torch_cuda
    F = torch.nn.functional
    g = torch.Generator(device="cuda").manual_seed(9)
    h = lambda *s: torch.randn(*s, device="cuda", generator=g).half()  # noqa: E731
    x, w, b = h(4, 16, 64), h(96, 64) * 0.125, h(96)
    (y,) = oplib.forward("fused_dense", {"num_hidden": 96, "flatten": False}, [x, w, b], device="gpu",
                         stream=_stream(torch))
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float(), b.float()), rtol=5e-3, atol=5e-3)
    a, res = h(4, 16, 64), torch.randn(4, 16, 64, device="cuda", generator=g)
    gam, bet = torch.rand(64, device="cuda", generator=g) + 0.5, torch.randn(64, device="cuda", generator=g)
    (ln,) = oplib.forward("fused_add_layer_norm", {"out_dtype": "float32"}, [a, res, gam, bet], device="gpu",
                          stream=_stream(torch))
    assert ln.dtype == torch.float32
    torch.testing.assert_close(ln, F.layer_norm(a.float() + res, (64,), gam, bet, 1e-5), rtol=1e-4, atol=1e-4)
    q, k, v = h(8, 32, 64), h(8, 32, 64), h(8, 32, 64)
    (o,) = oplib.forward("fused_attention", {"scale": 0.125, "layout": "plain", "out_dtype": "float32"},
                         [q, k, v], device="gpu", stream=_stream(torch))
    assert o.dtype == torch.float32
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.125)
    torch.cuda.synchronize()
    torch.testing.assert_close(o, ref, rtol=5e-3, atol=5e-3)


def test_float16_type_inference_through_lib_api(oplib):
    f16, f32 = 2, 0
    assert oplib.infer_type("fused_dense", {"num_hidden": 4}, [f16, f16, f16]) == [f16]
    assert oplib.infer_type("fused_add_layer_norm", {"out_dtype": "float32"}, [f16, f32, f32, f32]) == [f32]
    assert oplib.infer_type("fused_attention", {"scale": 0.5}, [f16, f16, f16]) == [f16]
    assert oplib.infer_type("fused_elemwise", {"expr": "add(x0, x1)"}, [f16, f32]) == [f32]
    with pytest.raises(LibError, match="input 0 \\(data\\) must be float32"):
        oplib.infer_type("fused_dense", {"num_hidden": 4}, [f16, f32, f32])
