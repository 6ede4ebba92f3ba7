"""Build and load the fused-operator library (``fusion/_lib/libmxfusion_ops.so``).

The op library is compiled from ``cuda_kernels/*/*.cc`` plus MXNet's ``lib_api.cc``
and loaded with ``mx.library.load``; it registers the ``fused_*`` operators.  When
``nvcc`` is found (and ``MXFUSION_NO_CUDA=1`` is not set), ``build()`` also puts the CUDA
kernels' library beside it, ``fusion/_lib/libmxfusion_cuda.so`` (``cuda_kernels/cuda_iface.py``
builds it: a plain C interface, CUDA runtime static, cuBLASLt dynamic), and builds the op
library with its MXNet "gpu" registrations (``cuda_kernels/common/mxnet_gpu/gpu_glue.cu``,
compiled by nvcc against MXNet's ``lib_api.h``), which open the CUDA library on their
first call.  Loading the op library needs no CUDA library either way.
``capabilities()`` asks the loaded library which devices each op runs on.

A hash of the sources and flags is stored beside each library; ``load()`` refuses a
library built from other sources, naming the rebuild command ``python -m fusion.native.build``.
"""
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # fusion/ (this file: fusion/native/)
_REPO_DIR = os.path.dirname(_PKG_DIR)
KERNEL_DIR = os.path.join(_REPO_DIR, "cuda_kernels")
LIB_DIR = os.path.join(_PKG_DIR, "_lib")
CPU_LIB = "libmxfusion_ops.so"
CUDA_LIB = "libmxfusion_cuda.so"
REBUILD = "python -m fusion.native.build"

# x86-64-v3 = AVX2 + FMA (Haswell / Zen and newer); MXFUSION_MARCH overrides it.
CXXFLAGS = ["-O3", "-std=c++17", "-fPIC", "-fopenmp",
            "-march=" + os.environ.get("MXFUSION_MARCH", "x86-64-v3"), "-mtune=generic",
            "-fno-math-errno", "-fno-trapping-math", "-DNDEBUG", "-Wall", "-Wno-unused-function"]
# lib_api.cc's error entry points are renamed out of the way: the library exports its own
# (cuda_kernels/common/errors.cc), which hand each message to MXNet once.
LIB_API_FLAGS = ["-D_msgSize=mxf_lib_api_msgSize", "-D_msgGet=mxf_lib_api_msgGet"]
# lib_api.cc builds an MXTensor only for the dtypes its MXDType names; bfloat16 (mshadow's code
# 12, which MXNet hands library ops as any other dtype) is added to that switch, so that the
# fused ops can take bfloat16 weights (fuse(..., precision="bf16")).  Compiled from a copy.
LIB_API_BF16_ANCHOR = "  default:\n    dltensor.dtype.code = 0;"
LIB_API_BF16_CASE = ("  case 12:  // bfloat16 (added by mxnet-fusion's build)\n"
                     "    dltensor.dtype.code = 4;  // kDLBfloat\n"
                     "    dltensor.dtype.bits = 16;\n"
                     "    break;\n")
# MXFUSION_CUDA_ARCHS (default 80,90): the GPU architectures nvcc builds for (gpu-check: the GPU's own)
NVCCFLAGS = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-cudart", "static"] + [
    f for a in os.environ.get("MXFUSION_CUDA_ARCHS", "80,90").split(",") if a.strip()
    for f in ("-gencode", "arch=compute_%s,code=sm_%s" % (a.strip(), a.strip()))]
# The op library's MXNet "gpu" registrations: compiled by nvcc (lib_api.h types the CUDA stream
# as cudaStream_t there), linked with the op library; not part of the CUDA C-interface library.
# (one folder down, out of the kernels' */*.cu, which cuda_iface.py compiles without MXNet's headers)
GPU_GLUE = os.path.join("common", "mxnet_gpu", "gpu_glue.cu")
GPU_DEFINE = "-DMXF_WITH_CUDA=1"
# The op library exports only the entry points looked up by name (the map says which and why):
# its own copy of lib_api.cc stays its own where libmxnet.so was loaded RTLD_GLOBAL (Horovod).
EXPORTS_MAP = os.path.join("common", "exports.map")

_loaded = None


def _mxnet_dir():
    env = os.environ.get("MXFUSION_MXNET_DIR")   # MXNet's include/ and src/lib_api.cc, copied
    if env:                                      # where MXNet is not installed (a GPU machine)
        if not os.path.exists(os.path.join(env, "include", "mxnet", "lib_api.h")):
            raise RuntimeError("MXFUSION_MXNET_DIR=%s holds no include/mxnet/lib_api.h" % env)
        return env
    import importlib.util
    spec = importlib.util.find_spec("mxnet")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "mxnet is not importable here; building the fused ops needs its lib_api.h/.cc. "
            "Under pip's build isolation add 'mxnet==1.9.1' to [build-system].requires "
            "in pyproject.toml, or install with `pip install --no-build-isolation .`")
    return os.path.dirname(spec.origin)


def library_path(cuda=False, lib_dir=None):
    """Absolute path of the CPU (or CUDA) library."""
    return os.path.join(lib_dir or LIB_DIR, CUDA_LIB if cuda else CPU_LIB)


def gpu_enabled():
    """Whether a build here gives the op library its "gpu" registrations: nvcc is found and
    ``MXFUSION_NO_CUDA=1`` is not set."""
    return nvcc_path() is not None and os.environ.get("MXFUSION_NO_CUDA", "") != "1"


def _sources(cuda, gpu=False):
    """(sources, headers) of the CUDA kernels (``cuda``; cuda_iface.py builds them), or of the op
    library (with its "gpu" registrations when ``gpu``)."""
    glue = os.path.join(KERNEL_DIR, GPU_GLUE)
    pats = ["*/*.cu"] if cuda else ["*/*.cc"]
    srcs = sorted(f for p in pats for f in glob.glob(os.path.join(KERNEL_DIR, p)) if f != glue)
    deps = sorted(glob.glob(os.path.join(KERNEL_DIR, "*", "*.h")) +
                  (glob.glob(os.path.join(KERNEL_DIR, "*", "*.cuh")) if cuda else []))
    if cuda:  # the CUDA library reuses the expression parser
        srcs.append(os.path.join(KERNEL_DIR, "fused_elemwise", "expr_program.cc"))
    elif gpu:
        srcs.append(glue)
    return srcs, deps


def source_hash(cuda=False, gpu=None):
    """Hash of every kernel source, header and compile flag for one library (the op library
    with its "gpu" registrations when ``gpu``; default: as a build here makes it)."""
    if cuda:    # the CUDA library is cuda_iface.py's build (one compile for it and its tests)
        iface = _cuda_iface()
        return iface._hash(iface.ARCHS)
    if gpu is None:
        gpu = gpu_enabled()
    srcs, deps = _sources(cuda, gpu)
    h = hashlib.sha256()
    h.update(" ".join(NVCCFLAGS if cuda else CXXFLAGS + LIB_API_FLAGS + [LIB_API_BF16_CASE]).encode())
    h.update(" ".join(_link_flags(gpu)).replace(KERNEL_DIR, "").encode())    # where the tree is: no matter
    with open(os.path.join(KERNEL_DIR, EXPORTS_MAP), "rb") as fh:
        h.update(fh.read())
    if gpu:
        h.update((" gpu " + " ".join(NVCCFLAGS)).encode())
    for f in srcs + deps:
        h.update(os.path.relpath(f, KERNEL_DIR).encode())
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


def _hash_file(lib):
    return lib + ".sha256"


def _is_current(lib, cuda, gpu=None):
    if not os.path.exists(lib) or not os.path.exists(_hash_file(lib)):
        return False
    if not os.path.isdir(KERNEL_DIR):  # installed package: no sources to compare with
        return True
    with open(_hash_file(lib)) as fh:
        return fh.read().strip() == source_hash(cuda, gpu)


def _run(cmd, verbose):
    if verbose:
        print(" ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise RuntimeError("build failed:\n%s\n%s" % (" ".join(cmd), r.stdout))
    if verbose and r.stdout:
        print(r.stdout)


def nvcc_path():
    return shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and
                                    "/usr/local/cuda/bin/nvcc") or None


def _build_one(cuda, lib_dir, verbose, jobs, gpu=False):
    lib = library_path(cuda, lib_dir)
    if _is_current(lib, cuda, gpu):
        return lib
    os.makedirs(lib_dir, exist_ok=True)
    # several processes (parallel test runs) may build at once: one builds, the rest wait
    import fcntl
    with open(lib + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _is_current(lib, cuda, gpu):
                return lib
            return _compile(cuda, lib, verbose, jobs, gpu)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _cuda_iface():
    """cuda_kernels/cuda_iface.py: the CUDA kernels' own build (nvcc, cuBLASLt flags) and ctypes mirror."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("mxfusion_cuda_iface", os.path.join(KERNEL_DIR, "cuda_iface.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _copy_cuda_library(lib, jobs):
    """The CUDA library as cuda_iface.build() makes it (cached in build/), copied beside the op library."""
    iface = _cuda_iface()
    built = iface.build(jobs=jobs)
    tmp = "%s.%d.tmp" % (lib, os.getpid())
    shutil.copy2(built, tmp)
    with open(tmp + ".sha256", "w") as fh:
        fh.write(iface._hash(iface.ARCHS) + "\n")
    os.replace(tmp, lib)
    os.replace(tmp + ".sha256", _hash_file(lib))
    return lib


def _compile(cuda, lib, verbose, jobs, gpu=False):
    if cuda:
        return _copy_cuda_library(lib, jobs)
    mxdir = _mxnet_dir()
    inc = (["-I" + os.path.join(mxdir, "include"), "-I" + _dnnl_include(), "-I" + KERNEL_DIR,
            "-I" + os.path.join(KERNEL_DIR, "common")])
    srcs, _ = _sources(False, gpu)
    objdir = os.path.join(_REPO_DIR, "build", "mxfusion_" + ("gpu" if gpu else "cpu"))
    tmp = "%s.%d.tmp" % (lib, os.getpid())
    digest = source_hash(False, gpu)  # of the sources as they were when the compile started
    os.makedirs(objdir, exist_ok=True)
    srcs = srcs + [_lib_api_source(mxdir, objdir)]
    cmds, objs = [], []
    for s in srcs:
        o = os.path.join(objdir, os.path.basename(os.path.dirname(s)) + "_" + os.path.basename(s) + ".o")
        if s.endswith(".cu"):   # the "gpu" registrations: nvcc, host code against lib_api.h
            cmds.append([nvcc_path()] + NVCCFLAGS + [GPU_DEFINE] + inc + _curand_include(objdir)
                        + ["-x", "cu", "-c", s, "-o", o])
        else:
            cmds.append(["g++"] + CXXFLAGS + (LIB_API_FLAGS if s.endswith("lib_api.cc") else [])
                        + ([GPU_DEFINE] if gpu else []) + inc + ["-c", s, "-o", o])
        objs.append(o)
    if gpu:   # nvcc links the CUDA runtime statically (it opens libcuda itself, on first use)
        link = [nvcc_path()] + NVCCFLAGS + ["-shared", "-Xcompiler", "-fopenmp", "-o", tmp] + objs + [
            "-lgomp", "-ldl"] + _link_flags(gpu)
    else:
        link = ["g++", "-shared", "-fopenmp", "-o", tmp] + objs + ["-ldl"] + _link_flags(gpu)
    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
            list(ex.map(lambda c: _run(c, verbose), cmds))
        _run(link, verbose)
    except RuntimeError as e:
        if gpu:     # nvcc is there but the GPU part does not build: the CPU-only library still can
            raise RuntimeError("%s\n(MXFUSION_NO_CUDA=1 builds the op library without its GPU registrations)"
                               % e) from None
        raise
    with open(tmp + ".sha256", "w") as fh:
        fh.write(digest + "\n")
    os.replace(tmp, lib)  # atomic: a process loading the library never sees half a file
    os.replace(tmp + ".sha256", _hash_file(lib))
    return lib


def _link_flags(nvcc=False):
    """Linker flags of the op library: export only what EXPORTS_MAP names (everything else, its copy
    of lib_api.cc included, is bound inside the library at link time), and -Bsymbolic so that the
    exported entry points, which libmxnet.so also exports, bind to our own too where called from
    inside.  (Compiled code is unchanged; nvcc passes them through to the host linker.)"""
    flags = ["--version-script=" + os.path.join(KERNEL_DIR, EXPORTS_MAP), "-Bsymbolic"]
    return [x for f in flags for x in ("-Xlinker", f)] if nvcc else ["-Wl," + f for f in flags]


# Under nvcc lib_api.h includes <curand_kernel.h> for one typedef (the type of the GPU random
# states it hands ops; the glue uses none).  CUDA toolkits without cuRAND (a minimal install)
# get a header declaring just that type, incomplete, which is all lib_api.h needs of it.
CURAND_DECL = ("// Written by mxnet-fusion's build: no cuRAND headers were found.  lib_api.h needs\n"
               "// only this type's name (a pointer to it); nothing here creates or reads one.\n"
               "#pragma once\n"
               "struct curandStatePhilox4_32_10;\n"
               "typedef struct curandStatePhilox4_32_10 curandStatePhilox4_32_10_t;\n")


def _curand_include(objdir):
    """-I flags that make <curand_kernel.h> resolvable: none when the CUDA toolkit or an
    nvidia-curand wheel has it, else a folder with CURAND_DECL."""
    nvcc = nvcc_path()
    roots = [os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include")] if nvcc else []
    roots.append("/usr/local/cuda/include")
    if any(os.path.exists(os.path.join(r, "curand_kernel.h")) for r in roots):
        return []
    for site in sys.path:
        for sub in ("nvidia/curand/include", "nvidia/cu13/include", "nvidia/cu12/include"):
            if os.path.exists(os.path.join(site, sub, "curand_kernel.h")):
                return ["-I" + os.path.join(site, sub)]
    stub = os.path.join(objdir, "curand_decl")
    os.makedirs(stub, exist_ok=True)
    with open(os.path.join(stub, "curand_kernel.h"), "w") as fh:
        fh.write(CURAND_DECL)
    return ["-I" + stub]


def _dnnl_include():
    """The include/ folder holding oneDNN 3.x's own C headers (<oneapi/dnnl/dnnl.h>), from the
    onednn-devel-cpu-gomp wheel that matches the onednn-cpu-gomp library the fused ops open.
    (MXNet's wheel carries oneDNN 2.x headers under include/mkldnn/, for its own build.)"""
    env = os.environ.get("MXFUSION_DNNL_INCLUDE")
    roots = [env] if env else []
    roots += [os.path.join(r, "include") for r in (sys.prefix, sys.base_prefix, sysconfig.get_paths()["data"])]
    # a wheel's data files land in <prefix>/include for the <prefix>/lib/pythonX.Y/site-packages it
    # was installed into: also a build environment's (pip's isolated builds add theirs to sys.path)
    roots += [os.path.normpath(os.path.join(p, "..", "..", "..", "include"))
              for p in sys.path if p.endswith("site-packages")]
    for r in roots:
        if os.path.exists(os.path.join(r, "oneapi", "dnnl", "dnnl.h")):
            return r
    raise RuntimeError("oneDNN's headers (oneapi/dnnl/dnnl.h) not found: `pip install "
                       "onednn-devel-cpu-gomp==2023.2.0` or set MXFUSION_DNNL_INCLUDE")


def _lib_api_source(mxdir, objdir):
    """MXNet's lib_api.cc with bfloat16 added to the dtypes it builds MXTensors for (a copy in
    ``objdir``); the file itself when its switch is not where 1.9.1 has it."""
    src = os.path.join(mxdir, "src", "lib_api.cc")
    with open(src) as fh:
        text = fh.read()
    if LIB_API_BF16_ANCHOR not in text or "case 12:" in text:
        return src
    out = os.path.join(objdir, "lib_api.cc")
    with open(out + ".tmp", "w") as fh:
        fh.write(text.replace(LIB_API_BF16_ANCHOR, LIB_API_BF16_CASE + LIB_API_BF16_ANCHOR, 1))
    os.replace(out + ".tmp", out)
    return out


def build(verbose=False, cuda=None, lib_dir=None, jobs=None, cpu=True, gpu=None):
    """Compile the op library (and the CUDA one when nvcc and cuBLASLt exist, or cuda=True).

    Skips a library whose stored source hash is current.  Returns the paths built.
    ``cpu=False`` builds only the CUDA library, which needs no MXNet (GPU machines
    without an MXNet install).  ``gpu`` (default: nvcc found and ``MXFUSION_NO_CUDA=1``
    not set) gives the op library its MXNet "gpu" registrations.
    """
    lib_dir = lib_dir or LIB_DIR
    jobs = jobs or int(os.environ.get("MXFUSION_BUILD_JOBS", "2"))
    if gpu is None:
        gpu = gpu_enabled()
    out = [_build_one(False, lib_dir, verbose, jobs, gpu)] if cpu else []
    if cuda is None:    # the kernels need cuBLASLt too (the nvidia-cublas wheel); the op library does not
        cuda = gpu_enabled() and _cuda_iface().cublas_dirs() is not None
    if cuda:
        out.append(_build_one(True, lib_dir, verbose, jobs))
    return out


def dnnl_library():
    """Path of libdnnl.so.3 from the onednn-cpu-gomp wheel, or None."""
    env = os.environ.get("MXFUSION_DNNL_LIB")
    if env and os.path.exists(env):
        return env
    roots = [sys.prefix, sys.base_prefix, sysconfig.get_paths()["data"],
             os.path.join(os.path.dirname(sysconfig.get_paths()["purelib"]), "..", "..")]
    for r in roots:
        for name in ("libdnnl.so.3", "libdnnl.so"):
            p = os.path.abspath(os.path.join(r, "lib", name))
            if os.path.exists(p):
                return p
    return None


def load():
    """Load the CPU library into MXNet (idempotent).  Returns its path.

    Raises RuntimeError when the library is missing, stale, or oneDNN is absent.
    """
    global _loaded
    if _loaded:
        return _loaded
    lib = library_path()
    if not os.path.exists(lib):
        raise RuntimeError("mxnet-fusion operator library %s is missing; build it with `%s`"
                           % (lib, REBUILD))
    if not _is_current(lib, False):
        raise RuntimeError("mxnet-fusion operator library %s is stale (sources changed); "
                           "rebuild it with `%s`" % (lib, REBUILD))
    dnnl = dnnl_library()
    if dnnl is None:
        raise RuntimeError("oneDNN (libdnnl.so.3) not found: `pip install "
                           "onednn-cpu-gomp==2023.2.0` or set MXFUSION_DNNL_LIB")
    os.environ["MXFUSION_DNNL_LIB"] = dnnl
    import mxnet as mx
    mx.library.load(os.path.abspath(lib), verbose=False)
    _loaded = lib
    return lib


_capabilities = None


def capabilities():
    """Op name -> {"forward": set of devices, "backward": set of devices}, as the loaded op
    library registered them (its ``mxf_capabilities()``; loads the library if needed)."""
    global _capabilities
    if _capabilities is None:
        import ctypes
        import json
        lib = ctypes.CDLL(load())     # the handle MXNet's dlopen holds: same file, same library
        fn = lib.mxf_capabilities
        fn.restype = ctypes.c_char_p
        _capabilities = {op: {k: frozenset(v) for k, v in kinds.items()}
                         for op, kinds in json.loads(fn().decode()).items()}
    return _capabilities


def region_status():
    """None where ``fused_region`` can run here (oneDNN 3.x's API is bound and its CPU engine made),
    else why not, in one line: the library's ``mxf_region_status()`` (loads the library if needed).
    Cheap; a rule asks it before it emits the op."""
    import ctypes
    fn = ctypes.CDLL(load()).mxf_region_status
    fn.restype = ctypes.c_char_p
    why = fn().decode()
    return why or None


def built_with_gpu():
    """Whether the loaded op library has its "gpu" registrations (built where nvcc was)."""
    import ctypes
    return bool(ctypes.CDLL(load()).mxf_built_with_cuda())


def load_cuda():
    """ctypes handle on the CUDA C-interface library (for tests/benchmarks)."""
    import ctypes
    lib = library_path(cuda=True)
    if not os.path.exists(lib):
        raise RuntimeError("CUDA library %s is missing; build it with `%s` on a machine "
                           "with nvcc" % (lib, REBUILD))
    if not _is_current(lib, True):
        raise RuntimeError("CUDA library %s is stale; rebuild it with `%s`" % (lib, REBUILD))
    return ctypes.CDLL(lib)
