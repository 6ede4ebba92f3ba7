"""``make gpu-check``: the one prepared command for a GPU machine (PyTorch + nvcc; MXNet not needed).

Steps, each under its own time limit (all together within 8 minutes), logs in ``out/gpu-check/``
(or ``$OUT/gpu-check`` when ``OUT`` is set), one compact table at the end:

0. needs    -- what the steps need (PyTorch with a GPU, pytest, nvcc, cuBLASLt, NVRTC, MXNet's
               lib_api sources and oneDNN's headers and library -- the last two from the folder
               ``make gpu-bundle`` fills, build/gpu-bundle); anything missing is listed and fails;
1. build    -- the CUDA kernel library and the op library with its "gpu" registrations, for this
               GPU's architecture only (MXFUSION_CUDA_ARCHS; nvcc for two is twice as slow);
2. kernels  -- the GPU tests of the C interfaces (pytest -m gpu: test_cuda_kernels.py,
               test_cuda_semantics.py, test_cuda_elemwise.py) against PyTorch / float64;
3. harness  -- tests/kernels/test_libapi_harness.py: the op library through lib_api's entry points,
               the way MXNet calls it, on PyTorch CUDA tensors and stream (and NumPy on the CPU);
               tests/kernels/test_attention_backends.py: which attention backend each call gets
               on this machine, and why;
4. bert     -- benchmarks/bench_bert_layer_gpu.py: a fused float16 BERT-base encoder layer through
               the harness against PyTorch's eager layer and its SDPA layer on the same weights;
5. bench    -- benchmarks/bench_cuda.py --quick: each op against SDPA / cuBLAS / PyTorch eager and
               a device-to-device copy, side by side in one process; its cost-table entries (and any
               other step's ``*.costs.json``) are merged into ``costs-gpu.json``.

A pytest step is ok only when its tests ran and passed: every test skipped is NOT RUN, and any
skip is a failure (on the GPU machine a skip means something is missing; its reason is printed).
Exit status 0 only when every step is ok.

    python3 tools/gpu_check.py            # the check
    python3 tools/gpu_check.py --bundle   # where MXNet is installed: fill build/gpu-bundle
"""
import glob
import importlib.util
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLE = os.path.join(REPO, "build", "gpu-bundle")
CARRY_LIMIT = 64 << 20    # what a GPU session may carry with the working tree, in bytes
# seconds: each step's cap (the build's covers the cuDNN frontend's headers, minutes at -O1), and the whole
# run's (8 minutes); later steps get what is left
LIMITS = {"build": 300, "kernels": 120, "harness": 60, "bert": 45, "bench": 180}
TOTAL = 480
_START = time.time()
PYTEST = ["-m", "pytest", "--noconftest", "-q", "-rs", "-p", "no:cacheprovider"]


def native():
    spec = importlib.util.spec_from_file_location("mxfusion_native_gpu_check",
                                                  os.path.join(REPO, "fusion", "native", "library.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cuda_iface():
    sys.path.insert(0, os.path.join(REPO, "cuda_kernels"))
    import cuda_iface as ci
    return ci


# ---- the bundle: what the GPU machine lacks ------------------------------------------------------

def bundle_parts():
    """[(source, destination under build/gpu-bundle, compressed)]: MXNet's lib_api sources (the op
    library compiles against them), oneDNN's headers (its CPU code includes them) and library
    (xz-compressed, fastest preset: 52 MiB as it is, 9 MiB packed; the harness's CPU tests run on it),
    and the hook below."""
    n = native()
    mx = n._mxnet_dir()
    inc = n._dnnl_include()
    parts = [(os.path.join(mx, "include", "mxnet", "lib_api.h"), "mxnet/include/mxnet/lib_api.h", False),
             (os.path.join(mx, "src", "lib_api.cc"), "mxnet/src/lib_api.cc", False)]
    for f in sorted(glob.glob(os.path.join(inc, "oneapi", "dnnl", "*.h*"))):
        parts.append((f, "dnnl/include/oneapi/dnnl/" + os.path.basename(f), False))
    lib = n.dnnl_library()
    if lib:
        parts.append((lib, "dnnl/lib/libdnnl.so.3", True))
    return parts + extra_bundle_parts()


def extra_bundle_parts():
    """The cuDNN frontend's headers (and cuDNN's own, for a machine whose cuDNN wheel lacks them):
    fused_attention's cuDNN path compiles against them; cuda_iface.cudnn_dirs() finds them under
    build/gpu-bundle/cudnn on the GPU machine.  None where they are not installed here (pip install
    nvidia-cudnn-frontend nvidia-cudnn-cu13): the GPU build then lacks the cuDNN attention path."""
    ci = cuda_iface()
    d = ci.cudnn_dirs()
    if not d:
        print("note: cuDNN frontend / cuDNN headers not found here: the GPU build will not have the cuDNN "
              "attention path")
        return []
    parts = []
    for src, dst in ((d["frontend"], "cudnn/frontend/include"), (d["include"], "cudnn/cudnn/include")):
        if os.path.realpath(src).startswith(os.path.realpath(BUNDLE)):
            continue   # already the bundle
        for f in sorted(glob.glob(os.path.join(src, "**", "*"), recursive=True)):
            if os.path.isfile(f) and not f.endswith((".py", ".pyc")):
                parts.append((f, os.path.join(dst, os.path.relpath(f, src)), False))
    return parts


def bundle():
    """Copy what the GPU machine lacks into build/gpu-bundle (git-ignored) and print the path to
    carry and its size."""
    shutil.rmtree(BUNDLE, ignore_errors=True)
    for src, dst, packed in bundle_parts():
        out = os.path.join(BUNDLE, dst + (".xz" if packed else ""))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        if packed:
            with open(src, "rb") as fi, lzma.open(out, "wb", preset=0) as fo:
                shutil.copyfileobj(fi, fo, 1 << 20)
        else:
            shutil.copy(src, out)
    size = sum(os.path.getsize(f) for f in glob.glob(os.path.join(BUNDLE, "**"), recursive=True)
               if os.path.isfile(f))
    rel = os.path.relpath(BUNDLE, REPO)
    print("carry: %s (%.1f MiB%s)" % (rel, size / 2 ** 20, "" if size < CARRY_LIMIT else
                                       ", OVER the 64 MiB a GPU session may carry"))
    return 0 if size < CARRY_LIMIT else 1


def unpack_bundle():
    """Decompress the bundle's packed files beside themselves (once)."""
    for packed in glob.glob(os.path.join(BUNDLE, "**", "*.xz"), recursive=True):
        out = packed[:-3]
        if not os.path.exists(out):
            with lzma.open(packed, "rb") as fi, open(out + ".tmp", "wb") as fo:
                shutil.copyfileobj(fi, fo, 1 << 20)
            os.replace(out + ".tmp", out)


# ---- running steps -----------------------------------------------------------------------------------

def run(name, cmd, logdir, env):
    log = os.path.join(logdir, name + ".log")
    t0 = time.time()
    limit = max(10, min(LIMITS[name], TOTAL - (t0 - _START)))
    try:
        with open(log, "w") as fh:
            fh.write("$ %s\n" % " ".join(cmd))
            fh.flush()
            p = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=limit)
        code = p.returncode
    except subprocess.TimeoutExpired:
        code = "timeout %ds" % limit
    with open(log) as fh:
        text = fh.read()
    return code, time.time() - t0, text


def pytest_counts(text):
    counts = {}
    lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)", ln)]
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)",
                              lines[-1] if lines else ""):
        counts[what.rstrip("s") if what.startswith("error") else what] = int(n)
    return counts, (lines[-1].strip("= ") if lines else "(no pytest summary)")


def pytest_status(code, text):
    """(status, what): ok only when tests ran and passed with none skipped."""
    counts, line = pytest_counts(text)
    if isinstance(code, str):   # timed out: whatever ran, the step did not finish
        return "FAIL", "%s (%s)" % (code, line)
    skips = [ln.strip() for ln in text.splitlines() if ln.startswith("SKIPPED")]
    ran = counts.get("passed", 0) + counts.get("failed", 0) + counts.get("error", 0)
    if ran == 0:
        return "NOT RUN", line + ("; " + skips[0] if skips else "")
    if code != 0:
        return "FAIL", line
    if skips:
        return "FAIL", line + " (a skip here means something is missing, see below)"
    return "ok", line


def needs(env):
    """What is missing for the steps: [text]."""
    missing = []
    for mod in ("torch", "pytest", "numpy"):
        if importlib.util.find_spec(mod) is None:
            missing.append("Python module %s (pip install %s)" % (mod, mod))
    if importlib.util.find_spec("torch") is not None:
        r = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
        if r.stdout.strip() != "True":
            missing.append("a CUDA GPU visible to PyTorch")
    ci = cuda_iface()
    if ci.nvcc_path() is None:
        missing.append("nvcc (the CUDA toolkit)")
    if ci.cublas_dirs() is None:
        missing.append("cuBLASLt headers and library (pip install nvidia-cublas)")
    if ci.nvrtc_library() is None:
        missing.append("NVRTC (pip install nvidia-cuda-nvrtc): fused_elemwise's generated kernels")
    if "MXFUSION_MXNET_DIR" not in env and importlib.util.find_spec("mxnet") is None:
        missing.append("MXNet's lib_api sources: run `make gpu-bundle` where MXNet is installed and carry "
                       "build/gpu-bundle")
    if not env.get("MXFUSION_DNNL_INCLUDE") and importlib.util.find_spec("mxnet") is None:
        missing.append("oneDNN's headers (build/gpu-bundle/dnnl/include, from `make gpu-bundle`)")
    if not env.get("MXFUSION_DNNL_LIB") and importlib.util.find_spec("mxnet") is None:
        missing.append("oneDNN's library (build/gpu-bundle/dnnl/lib, from `make gpu-bundle`)")
    return missing


def gpu_arch():
    r = subprocess.run([sys.executable, "-c", "import torch; print('%d%d' % torch.cuda.get_device_capability())"],
                       capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def merge_costs(logdir):
    """Every step's cost-table entries (``*.costs.json``) into one costs-gpu.json."""
    merged = None
    for f in sorted(glob.glob(os.path.join(logdir, "*.costs.json"))):
        with open(f) as fh:
            part = json.load(fh)
        if merged is None:
            merged = {k: v for k, v in part.items() if k != "entries"}
            merged["command"] = "make gpu-check"
            merged["entries"] = []
        merged["entries"] += part.get("entries", [])
    if merged is not None:
        with open(os.path.join(logdir, "costs-gpu.json"), "w") as fh:
            json.dump(merged, fh, indent=1)
    return merged


def table(logdir):
    """The benchmark rows of both GPU issues: [(group, op, case, fused, base, base name, ratio, target, ok)]."""
    rows = []
    for name in ("bench", "bert"):
        path = os.path.join(logdir, name + ".json")
        if not os.path.exists(path):
            continue
        with open(path) as fh:
            data = json.load(fh)
        for section, rs in data.get("sections", {}).items():
            group = "attention" if section.startswith("attention") else "graphs"
            for r in rs:
                rows.append((group, r["op"], r["case"], r["fused_ms"], r["baseline_ms"], r["baseline"],
                             r["ratio"], r["ok"]))
    return rows


def main():
    if sys.argv[1:] == ["--bundle"]:
        return bundle()
    logdir = os.path.join(os.environ.get("OUT") or os.path.join(REPO, "out"), "gpu-check")
    os.makedirs(logdir, exist_ok=True)
    for old in glob.glob(os.path.join(logdir, "*.json")):
        os.remove(old)
    env = dict(os.environ)
    env.setdefault("MXFUSION_BUILD_JOBS", str(os.cpu_count() or 2))
    env.setdefault("MXFUSION_NVRTC_CACHE_DIR", os.path.join(logdir, "nvrtc-cache"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(REPO, "tests", "kernels"),
                                                    env.get("PYTHONPATH")) if p)
    if os.path.isdir(BUNDLE):
        unpack_bundle()
        if "MXFUSION_MXNET_DIR" not in env and importlib.util.find_spec("mxnet") is None:
            env["MXFUSION_MXNET_DIR"] = os.path.join(BUNDLE, "mxnet")
        if os.path.isdir(os.path.join(BUNDLE, "dnnl", "include")):
            env.setdefault("MXFUSION_DNNL_INCLUDE", os.path.join(BUNDLE, "dnnl", "include"))
        if os.path.exists(os.path.join(BUNDLE, "dnnl", "lib", "libdnnl.so.3")):
            env.setdefault("MXFUSION_DNNL_LIB", os.path.join(BUNDLE, "dnnl", "lib", "libdnnl.so.3"))
    ci = cuda_iface()
    if ci.nvrtc_library():
        env.setdefault("MXFUSION_NVRTC_LIB", ci.nvrtc_library())
    arch = gpu_arch()
    if arch:
        env.setdefault("MXFUSION_CUDA_ARCHS", arch)
    py = sys.executable
    steps = []  # (name, status, seconds, what)
    missing = needs(env)
    steps.append(("needs", "FAIL" if missing else "ok", time.time() - _START,
                  "missing: " + "; ".join(missing) if missing else "all found (a GPU of sm_%s)" % arch))
    build_code = ("import importlib.util; spec = importlib.util.spec_from_file_location('n', %r); "
                  "n = importlib.util.module_from_spec(spec); spec.loader.exec_module(n)\n"
                  "print('built', n.build(verbose=True, cuda=True, cpu=False))\n"
                  "print('built', n.build(verbose=True, cuda=True, gpu=True))\n"
                  % os.path.join(REPO, "fusion", "native", "library.py"))
    code, secs, text = run("build", [py, "-c", build_code], logdir, env)
    tail = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or [""]
    archs = "sm_" + arch if arch else "sm_80 + sm_90 (no GPU seen)"
    steps.append(("build", "ok" if code == 0 else "FAIL", secs,
                  "kernels + op library for %s" % archs if code == 0 else "%s: %s" % (code, tail[0][:200])))
    kernel_tests = [t for t in ("tests/kernels/test_cuda_kernels.py", "tests/kernels/test_cuda_semantics.py",
                                "tests/kernels/test_cuda_elemwise.py") if os.path.exists(os.path.join(REPO, t))]
    skips = {}
    for name, cmd in (("kernels", [py] + PYTEST + ["-m", "gpu"] + kernel_tests),
                      ("harness", [py] + PYTEST + ["tests/kernels/test_libapi_harness.py",
                                                 "tests/kernels/test_attention_backends.py"])):
        code, secs, text = run(name, cmd, logdir, env)
        status, what = pytest_status(code, text)
        steps.append((name, status, secs, what))
        skips[name] = [ln.strip() for ln in text.splitlines() if ln.startswith("SKIPPED")]
    for name, cmd in (("bert", [py, "benchmarks/bench_bert_layer_gpu.py", "--json", os.path.join(logdir, "bert.json")]),
                      ("bench", [py, "benchmarks/bench_cuda.py", "--quick", "--json", os.path.join(logdir, "bench.json"),
                                 "--costs", os.path.join(logdir, "bench.costs.json")])):
        code, secs, text = run(name, cmd, logdir, env)
        last = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or [""]
        ran = os.path.exists(os.path.join(logdir, name + ".json"))
        steps.append((name, "ok" if code == 0 and ran else ("NOT RUN" if code == 0 else "FAIL"), secs,
                      "rows below" if code == 0 and ran else "%s: %s" % (code, last[0][:200])))
    costs = merge_costs(logdir)
    rows = table(logdir)
    print("\n== gpu-check summary (logs in %s) ==" % logdir)
    for name, status, secs, what in steps:
        print("%-8s %-8s %6.1fs  %s" % (name, status, secs, what))
    for name, lines in skips.items():
        if lines:
            print("\n%s skips (each one fails the step):\n  %s" % (name, "\n  ".join(lines[:12])))
    if rows:
        print("\n| issue | op | case | fused ms | baseline ms | ratio | target holds |")
        print("|---|---|---|---|---|---|---|")
        for g, op, case, f, b, bn, ratio, ok in rows:
            print("| %s | %s | %s | %.3f | %.3f (%s) | %.2f | %s |" % (
                g, op, case, f, b, bn, ratio, "-" if ok is None else ("yes" if ok else "NO")))
        held = [r for r in rows if r[7] is not None]
        print("\ntargets held: %d of %d" % (sum(1 for r in held if r[7]), len(held)))
    if costs:
        print("cost table: %d entries in %s" % (len(costs["entries"]), os.path.join(logdir, "costs-gpu.json")))
    return 0 if all(s[1] == "ok" for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
