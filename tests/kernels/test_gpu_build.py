"""The op library's GPU build (compile only: no GPU is needed).

Where nvcc exists the op library is built with its MXNet "gpu" registrations (gpu_glue.cu,
compiled by nvcc for sm_80 and sm_90 against MXNet's lib_api.h); it must still load in
MXNet's CPU-only wheel, on a machine without a GPU driver, and need no CUDA library to load.
``MXFUSION_NO_CUDA=1`` (or no nvcc) gives the CPU-only library of before.  Skipped with the
reason where nvcc is absent.
"""
import ctypes
import glob
import json
import os

import pytest

from kernel_fixtures import fused_ops, run_python  # noqa: F401  (builds + loads the library)
from test_native import needed_libraries

def _nvcc():
    from kernel_fixtures import native_module
    return native_module().nvcc_path()


pytestmark = pytest.mark.skipif(_nvcc() is None, reason="nvcc not found: the GPU build is not compiled here")

GPU_OPS = {"fused_dense", "fused_attention", "fused_add_layer_norm", "fused_elemwise"}


def _gpu_ops(caps):
    return {op for op, c in caps.items() if "gpu" in c["forward"]}


def test_built_for_sm80_and_sm90(fused_ops):
    flags = " ".join(fused_ops.NVCCFLAGS)
    assert "arch=compute_80,code=sm_80" in flags and "arch=compute_90,code=sm_90" in flags
    assert "-cudart static" in flags


def test_gpu_registrations_load_in_the_cpu_wheel(fused_ops):
    if os.environ.get("MXFUSION_NO_CUDA") == "1":
        pytest.skip("MXFUSION_NO_CUDA=1: this run builds the CPU-only library")
    assert fused_ops.built_with_gpu()
    caps = fused_ops.capabilities()
    assert _gpu_ops(caps) == GPU_OPS
    assert not [n for n in needed_libraries(fused_ops.library_path()) if "cuda" in n or "cublas" in n]
    # loaded by MXNet (the fixture did) and running on the CPU as before
    import mxnet as mx
    import numpy as np
    a = mx.nd.array(np.arange(8, dtype=np.float32).reshape(2, 4))
    y = mx.nd.fused_add_layer_norm(a, a, mx.nd.ones(4), mx.nd.zeros(4))
    assert y.shape == (2, 4) and np.isfinite(y.asnumpy()).all()


def test_no_gpu_driver_needed_to_load(fused_ops):
    """This machine's loader finds no libcuda: the load above proves the library does not
    open the driver until a GPU call (the CUDA runtime is static and lazy)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pass
    else:
        pytest.skip("a CUDA driver is installed here: loading proves nothing about its absence")
    assert fused_ops.built_with_gpu() in (True, False)     # the library is loaded and answering


def test_kernel_library_is_opened_lazily(fused_ops):
    """The op library opens the CUDA kernels' library on its first GPU call, not at load."""
    if not fused_ops.built_with_gpu():
        pytest.skip("the op library has no gpu registrations in this run")
    lib = ctypes.CDLL(fused_ops.library_path())
    assert lib.mxf_built_with_cuda() == 1
    beside = fused_ops.library_path(cuda=True)
    assert not [p for p in glob.glob("/proc/%d/maps" % os.getpid())
                if beside in open(p).read()], "the kernel library was opened at load"


def test_no_cuda_switch_builds_the_cpu_only_library(fused_ops, tmp_path):
    """MXFUSION_NO_CUDA=1: the library of a machine without nvcc (no gpu registrations),
    built beside (not over) the one this run uses, and loaded by MXNet in a fresh process."""
    code = r"""
import ctypes, importlib.util, json, os, sys
# fusion/native/library.py alone: importing the package would load (and rebuild) this run's library
spec = importlib.util.spec_from_file_location("native_alone", os.path.join(%r, "fusion", "native", "library.py"))
_native = importlib.util.module_from_spec(spec)
spec.loader.exec_module(_native)
lib_dir = sys.argv[1]
_native.build(cuda=False, lib_dir=lib_dir)
path = _native.library_path(lib_dir=lib_dir)
import mxnet as mx
mx.library.load(path, verbose=False)
lib = ctypes.CDLL(path)
lib.mxf_capabilities.restype = ctypes.c_char_p
print("CAPS", lib.mxf_built_with_cuda(), lib.mxf_capabilities().decode())
""" % os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = run_python(code, str(tmp_path), MXFUSION_NO_CUDA="1")
    line = [ln for ln in out.splitlines() if ln.startswith("CAPS ")][0]
    flag, caps = line.split(" ", 2)[1:]
    assert flag == "0"
    assert _gpu_ops({k: {kk: set(vv) for kk, vv in v.items()} for k, v in json.loads(caps).items()}) == set()
    assert fused_ops.source_hash(gpu=False) != fused_ops.source_hash(gpu=True)
