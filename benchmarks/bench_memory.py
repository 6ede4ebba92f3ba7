"""Peak memory and time of the checks: plain MXNet inference against ``mxfuse --verify --benchmark``.

    pip install gluoncv==0.10.5.post0            # not a dependency of the project
    python benchmarks/bench_memory.py [--models yolo3_mobilenet1.0_coco,mask_rcnn_resnet50_v1b_coco]
                                      [--repeats 1] [--runs 3] [--cap 16G] [--workdir DIR] [--json out.json]
                                      [--mxfuse-from CHECKOUT] [--max-memory SIZE] [--no-self-check]

Per model — the ten of ``benchmarks/cv_models.py``, GluonCV's Mask R-CNN at 384×384 and its I3D
(3-D convolutions, 32 frames of 224×224), exported the same way with random weights
(``fusion.testing.gcv_zoo``), each written once to ``--workdir`` as MODEL-symbol.json and
MODEL-0000.params — two processes are measured, each on its own:

* **plain**: MXNet loads the files, binds the model with its default bind (oneDNN subgraph backend
  on) and runs ``--runs`` inferences; its wall time per inference (the median) and its peak
  resident memory;
* **mxfuse**: ``mxfuse MODEL --verify --benchmark --repeats R`` with the self-check on (as a user
  runs it), its peak resident memory, its wall time, and the time of each stage (``--verbose``).

The peak resident memory of a process is the kernel's count for it (``getrusage(RUSAGE_CHILDREN)``
of a helper process whose only child it is).  ``--cap`` kills a process whose resident memory goes
past it (the machine is shared): the row then says so.  The table gives the ratios: mxfuse's
peak over plain inference's, and the time of ``--verify`` over one inference of both graphs (the
original and the fused model's medians from the same run's ``--benchmark``, MXNet's default bind).
``--mxfuse-from`` runs the mxfuse of another checkout (e.g. a worktree of an older commit): the
figures before a change.  The CPU (lscpu's model name) and the load average are printed: the
machines are shared.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)

#: the models beyond bench_cv.py's: name -> (name in GluonCV's model zoo, input shape)
EXTRA = {
    "mask_rcnn_resnet50_v1b_coco": ("mask_rcnn_resnet50_v1b_coco", (1, 3, 384, 384)),
    "i3d_resnet50_v1_kinetics400": ("i3d_resnet50_v1_kinetics400", (1, 3, 32, 224, 224)),
}


def models():
    sys.path.insert(0, _HERE)
    from cv_models import MODELS
    out = dict(MODELS)
    out.update(EXTRA)
    return out


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def load() -> str:
    return "%.1f %.1f %.1f" % os.getloadavg()


# ---------------------------------------------------------------- measuring one process

def _rss_kib(pid: int) -> int:
    """Resident memory of ``pid`` and its children (KiB); 0 where it is gone."""
    try:
        with open("/proc/%d/status" % pid) as f:
            total = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
    except OSError:
        return 0
    try:
        with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
            total += sum(_rss_kib(int(c)) for c in f.read().split())
    except OSError:
        pass
    return total


def measure_child(cmd, cap_kib: int, env=None) -> dict:
    """Run ``cmd`` as this process's only child: rc, wall seconds, peak resident memory (KiB, the kernel's
    count), stdout and stderr, and whether it was killed for passing ``cap_kib``."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    killed = False
    out_chunks, err_chunks = [], []
    import threading

    def pump(stream, into):
        for line in stream:
            into.append(line)

    threads = [threading.Thread(target=pump, args=(proc.stdout, out_chunks), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, err_chunks), daemon=True)]
    for th in threads:
        th.start()
    while proc.poll() is None:
        if cap_kib and _rss_kib(proc.pid) > cap_kib:
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
            break
        time.sleep(0.2)
    proc.wait()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss      # KiB on Linux
    return {"rc": proc.returncode, "wall_s": round(wall, 2), "peak_kib": peak, "killed": killed,
            "stdout": "".join(out_chunks), "stderr": "".join(err_chunks)}


def measured(cmd, cap_kib: int) -> dict:
    """``measure_child`` in a helper process of its own (RUSAGE_CHILDREN counts only its one child)."""
    helper = [sys.executable, os.path.abspath(__file__), "--measure", str(cap_kib), "--"] + list(cmd)
    out = subprocess.run(helper, capture_output=True, text=True)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise RuntimeError("the measuring helper failed: %s" % out.stderr.strip()[-2000:])


# ---------------------------------------------------------------- the two processes

EXPORT = r'''
import sys, mxnet as mx
sys.path.insert(0, %(repo)r)
from fusion.testing.gcv_zoo import gcv_zoo_model
sym, arg, aux = gcv_zoo_model(%(zoo)r, %(shape)r, 0, bn_by_nodes=True)
sym.save(%(prefix)r + "-symbol.json")
mx.nd.save(%(prefix)r + "-0000.params", {**{"arg:" + k: v for k, v in arg.items()}, **{"aux:" + k: v for k, v in aux.items()}})
'''

PLAIN = r'''
import json, statistics, sys, time
sys.path.insert(0, %(repo)r)
from fusion.native.env import configure_threads
configure_threads()
import mxnet as mx, numpy as np
sym = mx.sym.load(%(prefix)r + "-symbol.json")
params = mx.nd.load(%(prefix)r + "-0000.params")
arg = {k[4:]: v for k, v in params.items() if k.startswith("arg:")}
aux = {k[4:]: v for k, v in params.items() if k.startswith("aux:")}
x = mx.nd.array(np.random.default_rng(0).standard_normal(%(shape)r).astype(np.float32))
exe = sym.bind(mx.cpu(), {**arg, "data": x}, aux_states=aux, grad_req="null")
times = []
for _ in range(%(runs)d):
    t = time.perf_counter()
    for o in exe.forward(is_train=False):
        o.wait_to_read()
    times.append(time.perf_counter() - t)
print(json.dumps({"first_s": times[0], "median_s": statistics.median(times[1:] or times)}))
'''


def export(name: str, zoo: str, shape, workdir: str) -> str:
    prefix = os.path.join(workdir, name)
    if not os.path.exists(prefix + "-0000.params"):
        code = EXPORT % {"repo": _REPO, "zoo": zoo, "shape": tuple(shape), "prefix": prefix}
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return prefix


def plain(prefix: str, shape, runs: int, cap_kib: int) -> dict:
    code = PLAIN % {"repo": _REPO, "prefix": prefix, "shape": tuple(shape), "runs": runs}
    m = measured([sys.executable, "-c", code], cap_kib)
    if m["rc"] == 0:
        m.update(json.loads(m["stdout"].strip().splitlines()[-1]))
    return m


_STAGE = re.compile(r"mxfuse: (fusing|verifying|benchmarking) done in ([0-9.]+) s")
_PEAK = re.compile(r"mxfuse: (fusing|verifying|benchmarking) done in .*; peak memory so far ([0-9.]+ [KMG]iB)\)")


def mxfuse(prefix: str, shape, repeats: int, cap_kib: int, checkout: str, outdir: str, extra) -> dict:
    report = os.path.join(outdir, os.path.basename(prefix) + "-report.json")
    cmd = [sys.executable, "-m", "fusion.doors.mxfuse", prefix + "-symbol.json", "--params", prefix + "-0000.params",
           "-o", os.path.join(outdir, "") , "--shape", "data=" + ",".join(map(str, shape)), "--verify",
           "--benchmark", "--repeats", str(repeats), "--verbose", "--report", report] + list(extra)
    env = dict(os.environ, PYTHONPATH=checkout + os.pathsep + os.environ.get("PYTHONPATH", ""))
    m = _measured_env(cmd, cap_kib, env, checkout)
    m["stages"] = {stage: float(s) for stage, s in _STAGE.findall(m["stderr"])}
    m["peaks"] = dict(_PEAK.findall(m["stderr"]))      # the process's peak so far, at the end of each stage
    m["error"] = next((line for line in m["stderr"].splitlines() if line.startswith("mxfuse: error")), None)
    if m["rc"] == 0 and os.path.exists(report):
        with open(report) as f:
            r = json.load(f)
        bench = (r.get("benchmark") or {}).get("median_ms") or {}
        m["original_ms"], m["fused_ms"] = bench.get("original"), bench.get("fused")
        m["verify_status"] = (r.get("verify") or {}).get("status")
        m["memory"] = r.get("memory")
        m["notes"] = [n for n in r.get("notes", []) if "memory budget" in n or "self-check:" in n]
    return m


def _measured_env(cmd, cap_kib, env, cwd) -> dict:
    helper = [sys.executable, os.path.abspath(__file__), "--measure", str(cap_kib), "--"] + list(cmd)
    out = subprocess.run(helper, capture_output=True, text=True, env=env, cwd=cwd)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise RuntimeError("the measuring helper failed: %s" % out.stderr.strip()[-2000:])


def parse_cap(text: str) -> int:
    m = re.match(r"^\s*(\d+(?:\.\d*)?)\s*([kmgt]?)", text.lower())
    if not m:
        raise argparse.ArgumentTypeError("%r is not a size such as 16G" % text)
    return int(float(m.group(1)) * (1 << (10 * " kmgt".index(m.group(2) or " "))) / 1024)


def gib(kib) -> str:
    return "%.2f GiB" % (kib / 1024 / 1024)


def row(name: str, shape, p: dict, f: dict) -> str:
    shape_s = "x".join(map(str, shape))
    if p["rc"] != 0:
        return "| %s | %s | plain inference failed (%s) | | | | | | |" % (
            name, shape_s, "killed at the cap" if p["killed"] else "rc %s" % p["rc"])
    one = p["median_s"]
    left = "| %s | %s | %s | %.2f s |" % (name, shape_s, gib(p["peak_kib"]), one)
    if f["rc"] != 0:
        why = "killed at the cap (%s) after %.0f s" % (gib(f["peak_kib"]), f["wall_s"]) if f["killed"] else \
            (f.get("error") or "rc %s" % f["rc"])
        return left + " %s | | | | |" % why.replace("|", "/")
    st = f["stages"]
    both = ((f.get("original_ms") or 0) + (f.get("fused_ms") or 0)) / 1e3
    ratio = st.get("verifying", 0) / both if both else float("nan")
    peaks = f.get("peaks") or {}
    where = "; so far after %s" % ", ".join("%s %s" % (k, peaks[k]) for k in ("fusing", "verifying", "benchmarking")
                                             if k in peaks) if peaks else ""
    return left + " %s (%.1f×%s) | %.1f s | %.1f s (%.1f× one inference of both) | %.1f s | %.0f s |" % (
        gib(f["peak_kib"]), f["peak_kib"] / max(1, p["peak_kib"]), where, st.get("fusing", float("nan")),
        st.get("verifying", float("nan")), ratio, st.get("benchmarking", float("nan")), f["wall_s"])


HEADER = ("| model | input | plain peak | one inference (plain) | mxfuse --verify --benchmark peak (× plain) | "
          "fuse (self-check on) | --verify | --benchmark | mxfuse wall |\n|---|---|---|---|---|---|---|---|---|")


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--measure":
        cap = int(sys.argv[2])
        print(json.dumps(measure_child(sys.argv[4:], cap)))
        return 0
    known = models()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(known), help="comma-separated (default: all twelve)")
    ap.add_argument("--repeats", type=int, default=1, help="timed rounds of mxfuse --benchmark (default 1)")
    ap.add_argument("--runs", type=int, default=3, help="inferences of the plain process (default 3; the median "
                                                        "of all but the first)")
    ap.add_argument("--cap", type=parse_cap, default=parse_cap("16G"), help="kill a process past this resident "
                                                                            "memory (default 16G)")
    ap.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "mxf-bench-memory"))
    ap.add_argument("--mxfuse-from", default=_REPO, help="the checkout whose mxfuse runs (default: this one)")
    ap.add_argument("--max-memory", help="passed to mxfuse")
    ap.add_argument("--no-self-check", action="store_true", help="passed to mxfuse")
    ap.add_argument("--json", help="write every figure as JSON")
    args = ap.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in known]
    if unknown:
        ap.error("unknown model(s) %s; known: %s" % (", ".join(unknown), ", ".join(known)))
    os.makedirs(args.workdir, exist_ok=True)
    extra = (["--max-memory", args.max_memory] if args.max_memory else []) + \
        (["--no-self-check"] if args.no_self_check else [])
    print("CPU: %s; mxfuse from %s; load average %s" % (cpu_model(), args.mxfuse_from, load()))
    print(HEADER)
    results = []
    for name in names:
        zoo, shape = known[name]
        prefix = export(name, zoo, shape, args.workdir)
        p = plain(prefix, shape, args.runs, args.cap)
        outdir = os.path.join(args.workdir, "out-%d" % os.getpid())
        f = mxfuse(prefix, shape, args.repeats, args.cap, os.path.abspath(args.mxfuse_from), outdir, extra)
        print(row(name, shape, p, f) + "  <!-- load %s -->" % load())
        for n in f.get("notes") or []:
            print("|  | note: %s | | | | | | | |" % n.replace("|", "/"))
        sys.stdout.flush()
        results.append({"model": name, "shape": list(shape), "plain": {k: v for k, v in p.items() if k not in (
            "stdout", "stderr")}, "mxfuse": {k: v for k, v in f.items() if k not in ("stdout", "stderr")}})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cpu": cpu_model(), "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
