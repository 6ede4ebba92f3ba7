"""The elementwise section of bench_cuda.py: fused_elemwise on the GPU through its C interface.

Each case runs the generated kernel (NVRTC; the first call compiles it, outside the timing), the
interpreter (mxf_elemwise_set_jit(0)), PyTorch's separate eager ops and, for the one-input chain, a
device-to-device copy of the same bytes (the bandwidth ceiling: one read, one write).  Backward:
the generated backward kernel vs PyTorch autograd over the eager ops (torch.autograd.grad on a
kept graph, the saved tensors already there, as MXNet's unfused backward has them).
Targets: the 6-op chain >= 80 % of the copy's bandwidth (copy / fused >= 0.8); every case at least
as fast as PyTorch's ops (ratio >= 1).
"""
import re

import cuda_iface as ci

CHAIN = "mul(sigmoid(add(mul(x0, 1.5), 0.5)), tanh(sub(x0, 0.25)))"


def _ops(expr):
    return len(re.findall(r"[a-z_]+\(", expr))


def _cases(torch):
    M64 = 64 << 20  # elements
    sig = torch.sigmoid
    return [  # name, expr, input shapes (None: by dtype, 256 MiB), eager function, kind
        ("6-op chain 256 MiB", CHAIN, None, lambda x: sig(x * 1.5 + 0.5) * torch.tanh(x - 0.25), "chain"),
        ("x0*sigmoid(x1+3) 64Mi", "mul(x0, sigmoid(add(x1, 3.0)))", [(M64,), (M64,)],
         lambda a, b: a * sig(b + 3), "binary"),
        ("relu(x0+x1) 64Mi", "relu(add(x0, x1))", [(M64,), (M64,)], lambda a, b: torch.relu(a + b), "binary"),
        ("relu(x0+bias) 65536x1024 + (1024,)", "relu(add(x0, x1))", [(65536, 1024), (1024,)],
         lambda a, b: torch.relu(a + b), "broadcast row"),
        ("x0*s+t NCHW 64x256x64x64, (256,1,1)", "add(mul(x0, x1), x2)", [(64, 256, 64, 64), (256, 1, 1), (256, 1, 1)],
         lambda a, b, c: a * b + c, "broadcast channel"),
    ]


def _shapes(shapes, dtype, torch):
    if shapes is None:  # 256 MiB of output
        return [((256 << 20) // (4 if dtype == torch.float32 else 2),)]
    return shapes


def bench_elemwise(lib, torch, ws, reps, row, cost, timed, check):
    print("fused_elemwise: %s" % lib.mxf_elemwise_jit_status().decode().replace("\n", "; "), flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        dname = str(dtype)[6:]
        for name, expr, shapes, eager, kind in _cases(torch):
            shp = _shapes(shapes, dtype, torch)
            xs = [torch.randn(s, device="cuda", dtype=dtype, generator=g) for s in shp]
            out_shape = torch.broadcast_shapes(*shp)
            out = torch.empty(out_shape, device="cuda", dtype=dtype)
            out_i = torch.empty_like(out)

            def fused(o=out):
                check(lib, ci.elemwise_ex(lib, expr, xs, o)[0], "elemwise")

            def interp():
                lib.mxf_elemwise_set_jit(0)
                try:
                    check(lib, ci.elemwise_ex(lib, expr, xs, out_i)[0], "elemwise (interpreter)")
                finally:
                    lib.mxf_elemwise_set_jit(1)

            rc, err = ci.elemwise_ex(lib, expr, xs, out)   # compiles the kernel
            if rc != 0:
                raise RuntimeError("fused_elemwise %s: %s" % (expr, err or ci.error(lib, rc)))
            ref = lambda: eager(*xs)  # noqa: E731
            fns = [fused, ref, interp]
            dst = None
            if kind == "chain":
                dst = torch.empty_like(xs[0])
                fns.append(lambda: dst.copy_(xs[0]))
            t = timed(torch, fns, reps)
            fused()
            interp()
            want = ref()
            diff = (out.float() - want.float()).abs().max().item()
            idiff = (out_i.float() - want.float()).abs().max().item()
            nbytes = sum(x.numel() for x in xs) * xs[0].element_size() + out.numel() * out.element_size()
            note = "%.0f GB/s; interpreter %.3f ms (%.2fx); max|diff| %.1e (interp. %.1e)" % (
                nbytes / t[0] / 1e6, t[2], t[2] / t[0], diff, idiff)
            row("elemwise fwd", "%s %s" % (name, dname), t[0], t[1], "PyTorch ops", 1.0, note)
            if kind == "chain":
                row("elemwise fwd", "%s %s vs copy" % (name, dname), t[0], t[3], "d2d copy", 1.25,
                    "%.0f%% of the copy's bandwidth (target 80%%)" % (100 * t[3] / t[0]))
            case = {"expr": expr, "shapes": [list(s) for s in shp], "elements": out.numel(), "ops": _ops(expr),
                    "kind": kind}
            cost("fused_elemwise", dname, "forward", case, t[0], t[1], "PyTorch eager ops")
            if kind != "binary" or "sigmoid" in expr:  # backward: all but relu(x0+x1) of full-size inputs
                _backward(lib, torch, ws, reps, row, cost, timed, check, name, expr, xs, eager, dname, case)
            del xs, out, out_i, dst
            torch.cuda.empty_cache()


def _backward(lib, torch, ws, reps, row, cost, timed, check, name, expr, xs, eager, dname, case):
    xr = [x.detach().clone().requires_grad_() for x in xs]
    y = eager(*xr)
    dy = torch.randn_like(y)
    grads = [torch.empty_like(x) for x in xs]

    def fused():
        check(lib, ci.elemwise_backward(lib, ws, expr, dy, xs, grads)[0], "elemwise backward")

    rc, err = ci.elemwise_backward(lib, ws, expr, dy, xs, grads)
    if rc != 0:
        raise RuntimeError("fused_elemwise backward %s: %s" % (expr, err or ci.error(lib, rc)))
    ref = lambda: torch.autograd.grad(y, xr, dy, retain_graph=True)  # noqa: E731
    t = timed(torch, [fused, ref], reps)
    fused()
    want = ref()
    diff = max(((a.float() - b.float()).abs().max() / (1 + b.float().abs().max())).item()
               for a, b in zip(grads, want))
    row("elemwise bwd", "%s %s" % (name, dname), t[0], t[1], "PyTorch autograd", 1.0,
        "max rel. diff %.1e" % diff)
    cost("fused_elemwise", dname, "backward", case, t[0], t[1], "PyTorch eager ops (autograd)")
