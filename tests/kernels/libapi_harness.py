"""Drive the op library (libmxfusion_ops.so) through MXNet's lib_api C entry points, without MXNet.

MXNet 1.9.1's ``MXLoadLib`` opens an extension library, checks ``_opVersion``, calls
``initialize(MXNET_VERSION)``, reads each op's registration with ``_opRegSize``/``_opRegGet``
(name, forward/backward functions per device, stateful create functions per device, attribute
parser, type and shape inference) and later runs an op through ``_opCallFCompute`` (or
``_opCreateOpState`` + ``_opCallFStatefulCompute``), handing over tensors as raw pointers +
shapes + dtype codes + device names, its allocators as C callbacks and, on a GPU, its CUDA
stream.  This module makes the same calls through ctypes, so the library's MXNet glue -- the
exact code MXNet would run -- is exercised where MXNet is not installed (a GPU machine with
only PyTorch and nvcc: MXNet 1.9.1 has no wheel for its CUDA).

Tensors are NumPy arrays (device "cpu") or PyTorch tensors (device "gpu", on PyTorch's current
CUDA stream, which is the stream handed to the op).  Errors the library reports come back as
:class:`LibError` with its messages (``_msgSize``/``_msgGet``), like MXNet's MXNetError.
"""
import ctypes as C
import os

import numpy as np

MX_LIBRARY_VERSION = 11          # lib_api.h of MXNet 1.9.1
MXNET_VERSION = 10901            # what MXNet 1.9.1 passes to initialize()
# mshadow type codes (lib_api's MXDType; 12 is bfloat16)
DTYPES = {"float32": 0, "float64": 1, "float16": 2, "uint8": 3, "int32": 4, "int8": 5, "int64": 6,
          "bfloat16": 12}
CODES = {v: k for k, v in DTYPES.items()}

P = C.c_void_p
CHARPP = C.POINTER(C.c_char_p)
XPU_MALLOC = C.CFUNCTYPE(P, P, C.c_int)
SPARSE_MALLOC = C.CFUNCTYPE(None, P, C.c_int, C.c_int, C.c_int, C.POINTER(P), C.POINTER(P), C.POINTER(P))


class LibError(RuntimeError):
    """A call into the library returned failure; the message holds what the library reported."""


class _Reg:
    def __init__(self, name):
        self.name = name
        self.forward, self.backward, self.create = {}, {}, {}
        self.parse = self.infer_type = self.infer_shape = None


def _array_info(t):
    """(pointer, shape, dtype code, device) of a NumPy array or a PyTorch tensor."""
    if isinstance(t, np.ndarray):
        if not t.flags.c_contiguous:
            raise ValueError("arrays handed to the library must be C-contiguous")
        return t.ctypes.data, tuple(t.shape), DTYPES[t.dtype.name], "cpu", 0
    if not t.is_contiguous():
        raise ValueError("tensors handed to the library must be contiguous")
    name = str(t.dtype).replace("torch.", "")
    dev = "gpu" if t.is_cuda else "cpu"
    return t.data_ptr(), tuple(t.shape), DTYPES[name], dev, (t.device.index or 0) if t.is_cuda else 0


class OpLibrary:
    """The op library as MXNet sees it: ``ops`` maps each op name to its registration."""

    def __init__(self, path):
        self.path = os.path.abspath(path)
        self.lib = C.CDLL(self.path)
        lib = self.lib
        lib._opVersion.restype = C.c_int
        if lib._opVersion() != MX_LIBRARY_VERSION:
            raise LibError("library lib_api version %d, MXNet 1.9.1 expects %d"
                           % (lib._opVersion(), MX_LIBRARY_VERSION))
        lib.initialize.restype = C.c_int
        if lib.initialize(C.c_int(MXNET_VERSION)) != 1:
            raise LibError("initialize(%d) failed: %s" % (MXNET_VERSION, self._messages()))
        self._keep = []          # buffers allocated for the op being run (its workspace)
        self.ops = self._registrations()

    # ---- registrations -----------------------------------------------------------------------
    def _registrations(self):
        lib = self.lib
        n = lib._opRegSize()
        ops = {}
        for i in range(n):
            name = C.c_char_p()
            is_sg = C.c_int()
            fctx, bctx, cctx = CHARPP(), CHARPP(), CHARPP()
            ffp, bfp, cfp = C.POINTER(P)(), C.POINTER(P)(), C.POINTER(P)()
            fcnt, bcnt, ccnt = C.c_int(), C.c_int(), C.c_int()
            parse, itype, istype, ishape, mutate = P(), P(), P(), P(), P()
            lib._opRegGet(C.c_int(i), C.byref(name), C.byref(is_sg), C.byref(fctx), C.byref(ffp),
                          C.byref(fcnt), C.byref(bctx), C.byref(bfp), C.byref(bcnt), C.byref(cctx),
                          C.byref(cfp), C.byref(ccnt), C.byref(parse), C.byref(itype), C.byref(istype),
                          C.byref(ishape), C.byref(mutate))
            reg = _Reg(name.value.decode())
            for ctxs, fps, cnt, store in ((fctx, ffp, fcnt, reg.forward), (bctx, bfp, bcnt, reg.backward),
                                          (cctx, cfp, ccnt, reg.create)):
                for k in range(cnt.value):
                    store[ctxs[k].decode()] = fps[k]
            reg.parse, reg.infer_type, reg.infer_shape = parse.value, itype.value, ishape.value
            ops[reg.name] = reg
        return ops

    def devices(self, op):
        """{"forward": devices, "backward": devices} as registered: a stateful op's forward devices are
        its create devices, and its backward (a method of the state) is not listed here."""
        r = self.ops[op]
        return {"forward": set(r.forward) | set(r.create), "backward": set(r.backward)}

    # ---- errors ------------------------------------------------------------------------------
    def _messages(self):
        lib = self.lib
        out = []
        for i in range(lib._msgSize()):
            msg = C.c_char_p()
            lib._msgGet(C.c_int(i), C.byref(msg))
            out.append(msg.value.decode(errors="replace"))
        return "; ".join(out)

    def _check(self, ok, what):
        if ok != 1:
            raise LibError("%s: %s" % (what, self._messages()))

    @staticmethod
    def _attrs(attrs):
        keys = [str(k).encode() for k in attrs]
        vals = [str(v).encode() for v in attrs.values()]
        return (C.c_char_p * max(1, len(keys)))(*keys), (C.c_char_p * max(1, len(vals)))(*vals), len(keys)

    # ---- attribute parsing and inference --------------------------------------------------------
    def num_inouts(self, op, attrs):
        keys, vals, n = self._attrs(attrs)
        nin, nout = C.c_int(-1), C.c_int(-1)
        self._check(self.lib._opCallParseAttrs(P(self.ops[op].parse), keys, vals, n, C.byref(nin), C.byref(nout)),
                    op + " parse attributes")
        return nin.value, nout.value

    def infer_shape(self, op, attrs, in_shapes):
        _, nout = self.num_inouts(op, attrs)
        keys, vals, n = self._attrs(attrs)
        arrs = [(C.c_uint * max(1, len(s)))(*s) for s in in_shapes]
        inshapes = (C.POINTER(C.c_uint) * len(arrs))(*[C.cast(a, C.POINTER(C.c_uint)) for a in arrs])
        indims = (C.c_int * len(arrs))(*[len(s) for s in in_shapes])
        mod_in, mod_dims = C.POINTER(C.POINTER(C.c_uint))(), C.POINTER(C.c_int)()
        outs, outdims = C.POINTER(C.POINTER(C.c_uint))(), C.POINTER(C.c_int)()
        self._check(self.lib._opCallInferShape(P(self.ops[op].infer_shape), keys, vals, n, inshapes, indims,
                                               len(arrs), C.byref(mod_in), C.byref(mod_dims), C.byref(outs),
                                               C.byref(outdims), nout), op + " infer shape")
        shapes = [tuple(outs[i][j] for j in range(outdims[i])) for i in range(nout)]
        free = self.lib._opCallFree
        free.argtypes = [P]
        for i in range(len(arrs)):
            free(C.cast(mod_in[i], P))
        free(C.cast(mod_in, P))
        free(C.cast(mod_dims, P))
        for i in range(nout):
            free(C.cast(outs[i], P))
        free(C.cast(outs, P))
        free(C.cast(outdims, P))
        return shapes

    def infer_type(self, op, attrs, in_types):
        _, nout = self.num_inouts(op, attrs)
        keys, vals, n = self._attrs(attrs)
        intypes = (C.c_int * len(in_types))(*in_types)
        outtypes = (C.c_int * max(1, nout))()
        self._check(self.lib._opCallInferType(P(self.ops[op].infer_type), keys, vals, n, intypes, len(in_types),
                                              outtypes, nout), op + " infer type")
        return list(outtypes)[:nout]

    # ---- running an op -------------------------------------------------------------------------
    def _allocators(self, device_module):
        keep = self._keep

        def cpu_alloc(_, size):
            buf = np.empty(max(1, size), np.uint8)
            keep.append(buf)
            return buf.ctypes.data

        def gpu_alloc(_, size):
            import torch
            buf = torch.empty(max(1, size), dtype=torch.uint8, device="cuda")
            keep.append(buf)
            return buf.data_ptr()

        def sparse_alloc(*_):
            raise RuntimeError("no sparse outputs here")

        cbs = (XPU_MALLOC(cpu_alloc), XPU_MALLOC(gpu_alloc), SPARSE_MALLOC(sparse_alloc))
        keep.extend(cbs)
        return cbs

    def _tensor_args(self, arrays):
        infos = [_array_info(a) for a in arrays]
        n = len(infos)
        shapes = [(C.c_int64 * max(1, len(i[1])))(*i[1]) for i in infos]
        self._keep.extend(shapes)
        return dict(
            shapes=(C.POINTER(C.c_int64) * max(1, n))(*[C.cast(s, C.POINTER(C.c_int64)) for s in shapes]),
            dims=(C.c_int * max(1, n))(*[len(i[1]) for i in infos]),
            data=(P * max(1, n))(*[i[0] for i in infos]),
            types=(C.c_int * max(1, n))(*[i[2] for i in infos]),
            ids=(C.c_size_t * max(1, n))(*([0] * n)),
            dev_type=(C.c_char_p * max(1, n))(*[i[3].encode() for i in infos]),
            dev_id=(C.c_int * max(1, n))(*[i[4] for i in infos]),
            stypes=(C.c_int * max(1, n))(*([0] * n)),
            nulls=(P * max(1, n))(),
            zeros=(C.c_int64 * max(1, n))(),
            n=n, devices={i[3] for i in infos})

    def _common(self, ins, outs, stream):
        cpu_malloc, gpu_malloc, sparse_malloc = self._allocators(None)
        i, o = self._tensor_args(ins), self._tensor_args(outs)
        head = [i["shapes"], i["dims"], i["data"], i["types"], i["ids"], i["dev_type"], i["dev_id"], i["n"],
                o["shapes"], o["dims"], o["data"], o["types"], o["ids"], o["dev_type"], o["dev_id"], o["n"],
                cpu_malloc, None, gpu_malloc, None, P(stream or 0), sparse_malloc, None,
                i["stypes"], o["stypes"], i["nulls"], o["nulls"], i["nulls"], o["nulls"],
                i["zeros"], o["zeros"], i["zeros"], o["zeros"], None, None]
        return head, (i["devices"] | o["devices"])

    def compute(self, op, attrs, inputs, outputs, device, backward=False, stream=None, check_devices=True):
        """Run ``op``'s forward (or backward: inputs are [output grads, forward inputs, forward outputs],
        outputs the input grads) on ``device`` ("cpu"/"gpu") into ``outputs``, as MXNet's FComputeEx would.
        ``stream``: the CUDA stream handle (an int) for "gpu".  ``check_devices=False`` hands the
        device's function tensors of another device (to test that the library refuses them)."""
        reg = self.ops[op]
        self._keep.clear()
        head, devices = self._common(inputs, outputs, stream)
        if check_devices and devices != {device}:
            raise ValueError("every tensor must be on %s, got %s" % (device, sorted(devices)))
        if device in reg.create:
            return self._stateful(op, attrs, inputs, device, head, backward)
        fns = reg.backward if backward else reg.forward
        if device not in fns:
            raise LibError("%s has no %s %s registered" % (op, device, "backward" if backward else "forward"))
        keys, vals, n = self._attrs(attrs)
        self._check(self.lib._opCallFCompute(P(fns[device]), keys, vals, n, *head),
                    "%s %s (%s)" % (op, "backward" if backward else "forward", device))

    def _stateful(self, op, attrs, inputs, device, head, backward):
        keys, vals, n = self._attrs(attrs)
        shapes = [_array_info(a)[1] for a in inputs]
        types = [_array_info(a)[2] for a in inputs]
        if backward:   # the state is made from the forward inputs: [grads..., inputs..., outputs...]
            nin, nout = self.num_inouts(op, attrs)
            shapes, types = shapes[nout:nout + nin], types[nout:nout + nin]
        arrs = [(C.c_uint * max(1, len(s)))(*s) for s in shapes]
        inshapes = (C.POINTER(C.c_uint) * max(1, len(arrs)))(*[C.cast(a, C.POINTER(C.c_uint)) for a in arrs])
        indims = (C.c_int * max(1, len(arrs)))(*[len(s) for s in shapes])
        intypes = (C.c_int * max(1, len(types)))(*types)
        state = P()
        self._check(self.lib._opCallCreateOpState(P(self.ops[op].create[device]), keys, vals, n,
                                                  device.encode(), 0, inshapes, indims, len(arrs), intypes,
                                                  C.byref(state)), op + " create state (%s)" % device)
        try:
            self._check(self.lib._opCallFStatefulCompute(0 if backward else 1, state, *head),
                        "%s %s (%s)" % (op, "backward" if backward else "forward", device))
        finally:
            self.lib._opCallDestroyOpState.argtypes = [P]
            self.lib._opCallDestroyOpState(state)

    def prepare(self, op, attrs, inputs, outputs, device, stream=None):
        """A callable running ``op``'s forward into ``outputs`` with every argument built once, as an
        executor reuses them (for timing the op, not this module's Python): a stateful op's state
        is created here; scratch memory is one buffer per call site, kept and grown."""
        reg = self.ops[op]
        keep = []
        scratch = {}

        def gpu_alloc(_, size):
            buf = scratch.get("gpu")
            if buf is None or buf.numel() < size:
                import torch
                buf = scratch["gpu"] = torch.empty(max(1, size), dtype=torch.uint8, device="cuda")
            return buf.data_ptr()

        def cpu_alloc(_, size):
            buf = scratch.get("cpu")
            if buf is None or buf.size < size:
                buf = scratch["cpu"] = np.empty(max(1, size), np.uint8)
            return buf.ctypes.data

        def sparse_alloc(*_):
            raise RuntimeError("no sparse outputs here")

        cbs = (XPU_MALLOC(cpu_alloc), XPU_MALLOC(gpu_alloc), SPARSE_MALLOC(sparse_alloc))
        saved, self._keep = self._keep, keep
        try:
            i, o = self._tensor_args(inputs), self._tensor_args(outputs)
        finally:
            self._keep = saved
        head = [i["shapes"], i["dims"], i["data"], i["types"], i["ids"], i["dev_type"], i["dev_id"], i["n"],
                o["shapes"], o["dims"], o["data"], o["types"], o["ids"], o["dev_type"], o["dev_id"], o["n"],
                cbs[0], None, cbs[1], None, P(stream or 0), cbs[2], None,
                i["stypes"], o["stypes"], i["nulls"], o["nulls"], i["nulls"], o["nulls"],
                i["zeros"], o["zeros"], i["zeros"], o["zeros"], None, None]
        keep += [cbs, inputs, outputs, head]
        keys, vals, n = self._attrs(attrs)
        keep += [keys, vals]
        what = "%s forward (%s)" % (op, device)
        if device in reg.create:
            shapes = [_array_info(a)[1] for a in inputs]
            arrs = [(C.c_uint * max(1, len(s)))(*s) for s in shapes]
            inshapes = (C.POINTER(C.c_uint) * max(1, len(arrs)))(*[C.cast(a, C.POINTER(C.c_uint)) for a in arrs])
            indims = (C.c_int * max(1, len(arrs)))(*[len(s) for s in shapes])
            intypes = (C.c_int * max(1, len(inputs)))(*[_array_info(a)[2] for a in inputs])
            state = P()
            self._check(self.lib._opCallCreateOpState(P(reg.create[device]), keys, vals, n, device.encode(), 0,
                                                      inshapes, indims, len(arrs), intypes, C.byref(state)),
                        op + " create state (%s)" % device)
            keep += [arrs, inshapes, indims, intypes, state]
            call = self.lib._opCallFStatefulCompute
            return lambda: self._check(call(1, state, *head), what)
        fn = P(reg.forward[device])
        call = self.lib._opCallFCompute
        return lambda: self._check(call(fn, keys, vals, n, *head), what)

    def forward(self, op, attrs, inputs, device="cpu", stream=None, empty=None):
        """Outputs of ``op`` on ``inputs``, allocated as the library's shape/type inference says
        (``empty(shape, dtype_name)`` makes them; default NumPy / torch on the inputs' device)."""
        shapes = self.infer_shape(op, attrs, [_array_info(a)[1] for a in inputs])
        types = self.infer_type(op, attrs, [_array_info(a)[2] for a in inputs])
        empty = empty or _empty_like(inputs[0])
        outs = [empty(s, CODES[t]) for s, t in zip(shapes, types)]
        self.compute(op, attrs, inputs, outs, device, stream=stream)
        return outs

    def backward(self, op, attrs, grads, inputs, outputs, device="cpu", stream=None, empty=None):
        """Gradients of ``op``'s inputs, given the output gradients, the inputs and the outputs."""
        empty = empty or _empty_like(inputs[0])
        gin = [empty(_array_info(a)[1], CODES[_array_info(a)[2]]) for a in inputs]
        self.compute(op, attrs, list(grads) + list(inputs) + list(outputs), gin, device, backward=True,
                     stream=stream)
        return gin


def _empty_like(example):
    if isinstance(example, np.ndarray):
        return lambda shape, dtype: np.zeros(shape, dtype)
    import torch
    return lambda shape, dtype: torch.zeros(shape, dtype=getattr(torch, dtype), device=example.device)
