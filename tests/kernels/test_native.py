"""fusion.native.library: the build/load contract (clear errors for a missing or stale library)."""
import os
import re
import shutil

import pytest
from kernel_fixtures import fused_ops  # noqa: F401  (builds + loads the library)


def test_load_is_idempotent(fused_ops):
    assert fused_ops.load() == fused_ops.load() == fused_ops.library_path()


def test_library_is_current(fused_ops):
    with open(fused_ops.library_path() + ".sha256") as fh:
        assert fh.read().strip() == fused_ops.source_hash()


def test_missing_and_stale_library_errors(fused_ops, tmp_path, monkeypatch):
    built = fused_ops.library_path()
    monkeypatch.setattr(fused_ops, "_loaded", None)
    monkeypatch.setattr(fused_ops, "LIB_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="missing.*python -m fusion.native.build"):
        fused_ops.load()
    lib = os.path.join(str(tmp_path), fused_ops.CPU_LIB)
    shutil.copy(built, lib)
    with open(lib + ".sha256", "w") as fh:
        fh.write("0" * 64 + "\n")
    with pytest.raises(RuntimeError, match="stale.*python -m fusion.native.build"):
        fused_ops.load()


def needed_libraries(path):
    """The DT_NEEDED entries of a shared library (what the dynamic loader must find to load it)."""
    import subprocess
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def test_op_library_does_not_need_cuda(fused_ops):
    """Built with or without nvcc, loading the op library needs no CUDA library: the CUDA
    runtime is linked statically and opens the driver on first use, and the kernels'
    library is opened by the first GPU call."""
    needed = needed_libraries(fused_ops.library_path())
    assert not [n for n in needed if "cuda" in n or "cublas" in n or "nvrtc" in n], needed


def test_each_failure_reports_its_own_message_once(fused_ops):
    """An op's error reaches MXNet once: the 50th failed shape inference raises the same
    message as the first (lib_api.cc's own store repeats every earlier message, so errors
    grow and a process that tries many shapes grows without bound)."""
    import mxnet as mx

    sym = mx.sym.fused_attention(mx.sym.var("x"), mx.sym.var("mask"), scale=0.5, layout="interleaved",
                                 heads=2, mask_kind="additive")
    messages = []
    for _ in range(50):
        with pytest.raises(mx.base.MXNetError) as info:
            sym.infer_shape(x=(6, 2, 24), mask=(4, 6, 7))
        # MXNet stamps each error with the time ("[22:32:25]"): 50 tries may straddle a second
        messages.append(re.sub(r"\[\d\d:\d\d:\d\d\] ", "", str(info.value)))
    assert messages[0].count("fused_attention:") == 1, messages[0]
    assert len(set(messages)) == 1, (messages[0], messages[-1])


def test_op_library_opens_onednn_itself(fused_ops):
    """oneDNN 3.x is opened at run time (RTLD_LOCAL), never linked: MXNet carries oneDNN 2.x
    with the same symbol names."""
    needed = needed_libraries(fused_ops.library_path())
    assert not [n for n in needed if "dnnl" in n or "mkldnn" in n], needed


def test_onednn_headers_match_the_library(fused_ops):
    """The headers the op library is compiled against are those of the oneDNN release it opens."""
    import ctypes
    import re

    with open(os.path.join(fused_ops._dnnl_include(), "oneapi", "dnnl", "dnnl_version.h")) as fh:
        text = fh.read()
    header = tuple(int(re.search(r"#define DNNL_VERSION_%s (\d+)" % k, text).group(1))
                   for k in ("MAJOR", "MINOR", "PATCH"))

    class Version(ctypes.Structure):
        _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                    ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint), ("gpu_runtime", ctypes.c_uint)]

    lib = ctypes.CDLL(fused_ops.dnnl_library(), mode=os.RTLD_LOCAL)
    lib.dnnl_version.restype = ctypes.POINTER(Version)
    v = lib.dnnl_version().contents
    assert (v.major, v.minor, v.patch) == header


def test_missing_onednn_headers_say_what_to_install(fused_ops, tmp_path, monkeypatch):
    monkeypatch.setenv("MXFUSION_DNNL_INCLUDE", str(tmp_path))
    monkeypatch.setattr(fused_ops.sys, "prefix", str(tmp_path))
    monkeypatch.setattr(fused_ops.sys, "base_prefix", str(tmp_path))
    monkeypatch.setattr(fused_ops.sysconfig, "get_paths", lambda: {"data": str(tmp_path)})
    monkeypatch.setattr(fused_ops.sys, "path", [str(tmp_path / "lib" / "python3" / "site-packages")])
    with pytest.raises(RuntimeError, match="onednn-devel-cpu-gomp==2023.2.0"):
        fused_ops._dnnl_include()
