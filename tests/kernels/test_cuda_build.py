"""Compile check of the CUDA kernels (no GPU needed): every cuda_kernels/*/*.cu compiles with nvcc
for sm_80 and sm_90 without warnings (ptxas register spills included, for the tensor-core
attention kernels), links into one library with the CUDA runtime static and cuBLASLt dynamic,
and that library loads and answers its argument checks on a machine without a GPU.

Skipped only when nvcc is absent.  Without cuBLAS headers (the nvidia-cublas wheel) the dense
entry points compile as stubs that answer MXF_ERR_UNSUPPORTED, which this test reports.
"""
import ctypes
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "cuda_kernels"))
import cuda_iface as ci  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if ci.nvcc_path() is None:
        pytest.skip("nvcc not found")
    out = tmp_path_factory.mktemp("cuda_build")
    cmds = ci.compile_commands(str(out), extra=["-Xptxas", "-warn-spills"])
    jobs = int(os.environ.get("MXFUSION_BUILD_JOBS", "2"))

    def run(c):
        r = subprocess.run(c[2], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return c[0], r.returncode, r.stdout

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
        results = list(ex.map(run, cmds))
    lib = os.path.join(str(out), ci.LIB_NAME)
    link = None
    if all(rc == 0 for _, rc, _ in results):
        link = subprocess.run([ci.nvcc_path()] + ci.NVCCFLAGS + ci.gencode() + ["-shared", "-o", lib] +
                              [c[1] for c in cmds] + ci.cublas_flags()[1],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return results, link, lib


def test_every_source_compiles_for_sm80_and_sm90(built):
    results, link, _ = built
    failed = [(os.path.basename(s), text) for s, rc, text in results if rc != 0]
    assert not failed, failed
    assert link is not None and link.returncode == 0, link.stdout if link else ""


def test_no_compiler_warnings(built):
    results, _, _ = built
    bad = []
    for s, _, text in results:
        for line in text.splitlines():
            if "warning" not in line.lower():
                continue
            # ptxas spill warnings name the function; the flash forward kernels must not spill
            if "spill" in line.lower() and "mma" not in line:
                continue
            bad.append("%s: %s" % (os.path.basename(s), line))
    assert not bad, "\n".join(bad)


def test_library_loads_without_a_gpu_and_checks_arguments(built):
    _, link, lib_path = built
    if link is None or link.returncode != 0:
        pytest.skip("library did not link")
    lib = ctypes.CDLL(lib_path)
    lib.mxf_cuda_error_string.restype = ctypes.c_char_p
    assert [lib.mxf_dtype_size(c) for c in (0, 1, 2, 3)] == [4, 2, 2, 0]
    assert b"invalid" in lib.mxf_cuda_error_string(-1)
    # argument checks answer before any CUDA call
    args = ci.AttnArgs(dtype=9, B=1, H=1, Sq=1, Sk=1, D=8, Dv=8)
    assert lib.mxf_attention_forward(ctypes.byref(args), None, ctypes.c_size_t(0), None) == ci.ERR_BAD_ARGS
    err = ctypes.create_string_buffer(256)
    assert lib.mxf_elemwise_forward(0, b"foo(x0)", 1, None, None, None, None, err, 256, None) == ci.ERR_BAD_ARGS
    assert b"foo" in err.value


def test_dense_is_built_on_cublaslt(built):
    _, link, lib_path = built
    if ci.cublas_dirs() is None:
        pytest.skip("cuBLASLt headers not found (pip install nvidia-cublas): fused_dense compiled as stubs")
    lib = ctypes.CDLL(lib_path)
    lib.mxf_cublaslt_version.restype = ctypes.c_size_t
    assert lib.mxf_cublaslt_version() >= 130000  # CUDA 13's cuBLASLt, loaded through the rpath
    needed = subprocess.run(["readelf", "-d", lib_path], stdout=subprocess.PIPE, text=True).stdout
    assert re.search(r"NEEDED.*libcublasLt\.so\.\d+", needed), needed
    assert "libcudart" not in needed  # the CUDA runtime is static


def test_cudnn_attention_path_is_built(built):
    """fused_attention's cuDNN path compiles (frontend in dynamic-loading mode, sm_80 + sm_90 build)
    and links without libcudnn: the library loads here, no GPU or cuDNN needed."""
    _, link, lib_path = built
    if ci.cudnn_dirs() is None:
        pytest.skip("cuDNN frontend / cuDNN headers not found (pip install nvidia-cudnn-frontend "
                    "nvidia-cudnn-cu13): fused_attention compiled without its cuDNN path")
    cmd = [c for c in ci.compile_commands("/tmp") if c[0].endswith("attention_cudnn_graph.cpp")][0][2]
    assert "-DMXF_WITH_CUDNN=1" in cmd and "-DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING" in cmd
    needed = subprocess.run(["readelf", "-d", lib_path], stdout=subprocess.PIPE, text=True).stdout
    assert "libcudnn" not in needed, needed
    lib = ctypes.CDLL(lib_path)
    why = ctypes.create_string_buffer(512)
    args = ci.AttnArgs(dtype=ci.F16, B=1, H=1, Sq=8, Sk=8, D=64, Dv=64, q=256, k=512, v=768, o=1024,
                       q_rs=64, k_rs=64, v_rs=64, o_rs=64, q_hs=512, k_hs=512, v_hs=512, o_hs=512,
                       q_bs=512, k_bs=512, v_bs=512, o_bs=512, scale=0.125)
    rc = lib.mxf_attention_backend(ctypes.byref(args), 0, why, ctypes.c_size_t(512))
    assert rc in (1, 2), rc  # own here (no GPU), cudnn where a GPU and cuDNN are
    assert b"this build has no cuDNN frontend" not in why.value, why.value

