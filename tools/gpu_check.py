"""``make gpu-check``: the one prepared command for a GPU machine (PyTorch + nvcc; MXNet not needed).

Steps, each under its own time limit (all together within 8 minutes), logs in ``out/gpu-check/``
(or ``$OUT/gpu-check`` when ``OUT`` is set), a compact summary at the end:

1. build   -- the CUDA kernel library (nvcc, sm_80 + sm_90) and, when MXNet's lib_api sources
              are at hand (an MXNet install, ``MXFUSION_MXNET_DIR``, or ``build/mxnet_lib_api``
              made here by ``make gpu-bundle``), the op library with its "gpu" registrations;
2. kernels -- tests/kernels/test_cuda_kernels.py (+ test_cuda_semantics.py): the C interfaces vs PyTorch;
3. harness -- tests/kernels/test_libapi_harness.py: the op library through lib_api's entry points,
              the way MXNet calls it, on PyTorch CUDA tensors and stream;
4. bench   -- benchmarks/bench_cuda.py --quick: side by side with PyTorch in one process.

Exit status 0 only when every step passed.
"""
import importlib.util
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLE = os.path.join(REPO, "build", "mxnet_lib_api")
# seconds: each step's cap, and the whole run's (8 minutes); the benchmark gets what is left
LIMITS = {"build": 200, "kernels": 100, "harness": 45, "bench": 240}
TOTAL = 480
_START = time.time()


def native():
    spec = importlib.util.spec_from_file_location("mxfusion_native_gpu_check",
                                                  os.path.join(REPO, "fusion", "native", "library.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(name, cmd, logdir, env):
    log = os.path.join(logdir, name + ".log")
    t0 = time.time()
    limit = max(10, min(LIMITS[name], TOTAL - (t0 - _START)))
    try:
        with open(log, "w") as fh:
            p = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=limit)
        code = p.returncode
    except subprocess.TimeoutExpired:
        code = "timeout %ds" % limit
    secs = time.time() - t0
    with open(log) as fh:
        text = fh.read()
    return code, secs, text


def pytest_line(text):
    lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    return lines[-1].strip("= ") if lines else "(no pytest summary)"


def bundle():
    """Copy MXNet's lib_api.h and lib_api.cc (what the op library compiles against) into
    build/mxnet_lib_api, for a GPU machine where MXNet is not installed."""
    import shutil
    src = native()._mxnet_dir()
    for rel in (os.path.join("include", "mxnet", "lib_api.h"), os.path.join("src", "lib_api.cc")):
        os.makedirs(os.path.dirname(os.path.join(BUNDLE, rel)), exist_ok=True)
        shutil.copy(os.path.join(src, rel), os.path.join(BUNDLE, rel))
    print("MXNet's lib_api sources copied to", BUNDLE)
    return bundle_cudnn()


def bundle_cudnn():
    """Copy the cuDNN frontend's headers (and cuDNN's, for a machine whose cuDNN wheel lacks them)
    into build/cudnn_bundle, where cuda_iface.cudnn_dirs() finds them on the GPU machine."""
    import shutil
    sys.path.insert(0, os.path.join(REPO, "cuda_kernels"))
    import cuda_iface
    d = cuda_iface.cudnn_dirs()
    if not d:
        print("cuDNN frontend / cuDNN headers not found here (pip install nvidia-cudnn-frontend nvidia-cudnn-cu13):"
              " the GPU build will not have the cuDNN attention path")
        return 0
    for src, dst in ((d["frontend"], os.path.join(cuda_iface.CUDNN_BUNDLE, "frontend", "include")),
                     (d["include"], os.path.join(cuda_iface.CUDNN_BUNDLE, "cudnn", "include"))):
        if os.path.realpath(src).startswith(os.path.realpath(cuda_iface.CUDNN_BUNDLE)):
            continue  # already the bundle
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    print("cuDNN frontend and cuDNN headers copied to", cuda_iface.CUDNN_BUNDLE)
    return 0


def main():
    if sys.argv[1:] == ["--bundle"]:
        return bundle()
    logdir = os.path.join(os.environ.get("OUT") or os.path.join(REPO, "out"), "gpu-check")
    os.makedirs(logdir, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("MXFUSION_BUILD_JOBS", str(os.cpu_count() or 2))
    if "MXFUSION_MXNET_DIR" not in env and importlib.util.find_spec("mxnet") is None and os.path.isdir(BUNDLE):
        env["MXFUSION_MXNET_DIR"] = BUNDLE
    py = sys.executable
    rows = []
    build_code = ("import sys, importlib.util; spec = importlib.util.spec_from_file_location('n', %r); "
                  "n = importlib.util.module_from_spec(spec); spec.loader.exec_module(n)\n"
                  "print('built', n.build(verbose=True, cuda=True, cpu=False))\n"
                  "try:\n    print('built', n.build(verbose=True, cuda=True, gpu=True))\n"
                  "except RuntimeError as e:\n    print('op library not built:', str(e).splitlines()[0])\n"
                  % os.path.join(REPO, "fusion", "native", "library.py"))
    code, secs, text = run("build", [py, "-c", build_code], logdir, env)
    note = next((ln for ln in text.splitlines() if ln.startswith("op library not built")), "CUDA + op library")
    rows.append(("build", code, secs, note))
    tests = [t for t in ("tests/kernels/test_cuda_kernels.py", "tests/kernels/test_cuda_semantics.py",
                         "tests/kernels/test_attention_backends.py")
             if os.path.exists(os.path.join(REPO, t))]
    code, secs, text = run("kernels", [py, "-m", "pytest", "--noconftest", "-q", "-rs", "-p", "no:cacheprovider"]
                           + tests, logdir, env)
    rows.append(("kernels", code, secs, pytest_line(text)))
    code, secs, text = run("harness", [py, "-m", "pytest", "--noconftest", "-q", "-rs", "-p", "no:cacheprovider",
                                       "tests/kernels/test_libapi_harness.py"], logdir, env)
    rows.append(("harness", code, secs, pytest_line(text)))
    code, secs, text = run("bench", [py, "benchmarks/bench_cuda.py", "--quick"], logdir, env)
    rows.append(("bench", code, secs, "table below" if code == 0 else (text.strip().splitlines() or [""])[-1]))
    print("\n== gpu-check summary (logs in %s) ==" % logdir)
    for name, c, s, what in rows:
        print("%-8s %-8s %6.1fs  %s" % (name, "ok" if c == 0 else "FAIL(%s)" % c, s, what))
    if rows[-1][1] == 0:
        print("\n" + "\n".join(text.strip().splitlines()[-40:]))
    skipped = [ln for ln in open(os.path.join(logdir, "harness.log")).read().splitlines() if "SKIPPED" in ln]
    if skipped:
        print("\nharness skips:\n" + "\n".join(skipped[:10]))
    return 0 if all(r[1] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
