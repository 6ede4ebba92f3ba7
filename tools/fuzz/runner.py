"""Running many cases: worker processes, crash and timeout handling, aggregation, reproducers.

Each case runs in a worker process (spawned, so MXNet starts clean), which reports the
stage it is in before each step; a worker that dies (a segfault or abort inside MXNet or
a fused op) or runs past the timeout is replaced, and the case is reported with its seed
and the stage it died in — a crash while running the *original* graph is MXNet's and is
counted apart.  Cases are numbered from the run seed, and the family of each follows from
its own seed, so a run is the same whatever the number of jobs.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import re
import sys
import time
import traceback
from collections import Counter, defaultdict
from multiprocessing.connection import wait

from .oracle import signature
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CRASH_IS_MXNETS = ("original", "original.second", "training.original", "subgraph.original")
# the check a crash in each stage belongs to
STAGE_CHECK = {"fuse": "inference", "fused": "inference", "fused.second": "second", "unfuse": "unfuse",
               "unfuse.run": "unfuse", "unfuse.second": "unfuse", "idempotence": "idempotence",
               "training.fuse": "training", "training.fused": "training", "subgraph.fused": "subgraph",
               "generate": "inference"}


def case_seed(run_seed: int, i: int) -> int:
    return run_seed * 1_000_003 + i


# ---------------------------------------------------------------------------- the worker
def _worker(conn, out_dir: Optional[str], threads: int) -> None:
    sys.path.insert(0, ROOT)
    # before mxnet is imported: more OpenMP threads than cores per worker makes MXNet crawl
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("MXNET_CPU_PARALLEL_SIZE", "2000000000")
    os.environ.setdefault("MXNET_SUBGRAPH_VERBOSE", "0")
    import warnings

    warnings.filterwarnings("ignore")
    sys.stdout = open(os.devnull, "w")       # MXNet prints the arguments of every failed shape inference
    import fusion  # noqa: F401  (loads the fused-op library)
    from tools.fuzz import repro
    from tools.fuzz.case import Invalid
    from tools.fuzz.generator import generate
    from tools.fuzz.oracle import Oracle
    from tools.fuzz.shrink import shrink

    while True:
        try:
            task = conn.recv()
        except EOFError:
            break
        if task is None:
            break
        kind, seed, family = task["kind"], task["seed"], task["family"]
        try:
            conn.send(("stage", "generate"))
            try:
                case = generate(seed, family)
            except Invalid as e:
                conn.send(("done", {"gen_invalid": str(e)}))
                continue
            if kind == "case":
                out = Oracle(case, stage=lambda s: conn.send(("stage", s)), only=task.get("checks")).run()
                files = {}
                if out_dir and out.findings:
                    done = set()
                    for f in out.findings:
                        if f.group in done:
                            continue
                        done.add(f.group)
                        path = os.path.join(out_dir, "%s-%s-%d.py" % (f.group, family, seed))
                        repro.write(case, f, path)
                        files[f.check] = path
                d = dataclasses.asdict(out)
                d["ops"] = case.op_count()
                d["files"] = files
                conn.send(("done", d))
            else:          # shrink
                from tools.fuzz.oracle import signature

                if task["check"].endswith("worker_crash"):       # every try in a subprocess
                    from tools.fuzz.oracle import Finding
                    from tools.fuzz.shrink import same_crash

                    first = Finding(task["check"], task["detail"])
                    pred = same_crash(first)
                    if pred(case) is None:
                        conn.send(("done", {"shrunk": None, "reason": "did not crash again"}))
                        continue
                    found = [first]
                else:
                    pred = None
                    out = Oracle(case, only=[task["check"].split(".")[0]]).run()
                    found = [f for f in out.findings if f.check == task["check"]]
                    found.sort(key=lambda f: signature(f.check, f.detail) != task.get("_sig"))
                if not found:
                    conn.send(("done", {"shrunk": None, "reason": "did not fail again (flaky?)"}))
                    continue
                small, f, attempts = shrink(case, found[0], max_attempts=task["attempts"], max_seconds=task["seconds"],
                                            pred=pred)
                path = task["path"]
                repro.write(small, f, path, shrunk_from=case.op_count())
                conn.send(("done", {"shrunk": path, "ops": small.op_count(), "from": case.op_count(),
                                    "attempts": attempts, "detail": f.detail}))
        except Exception as e:     # a bug of the fuzzer itself: reported, the worker goes on
            conn.send(("done", {"harness_error": "%s: %s\n%s" % (type(e).__name__, e, traceback.format_exc()[-1500:])}))
    conn.close()


class _Slot:
    def __init__(self, ctx, out_dir, threads):
        self.ctx, self.out_dir, self.threads = ctx, out_dir, threads
        self.start()

    def start(self):
        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker, args=(child, self.out_dir, self.threads), daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent
        self.task: Optional[Dict] = None
        self.stage = ""
        self.t0 = 0.0
        self.history: List[int] = []        # seeds this worker ran (a crash may come from an earlier case)

    def give(self, task: Dict) -> None:
        self.task, self.stage, self.t0 = task, "queued", time.time()
        self.history.append(task["seed"])
        self.conn.send(task)

    def kill(self) -> None:
        try:
            self.proc.kill()
        except Exception:
            pass
        self.proc.join(5)

    def close(self) -> None:
        try:
            self.conn.send(None)
        except Exception:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


def default_threads(jobs: int) -> int:
    """OpenMP threads per worker: 1.

    The graphs are tiny, and on shared cores MXNet's OpenMP teams wait for each other:
    2 threads per process measured 10-14x slower than 1 on this project's 2-core machines.
    (``--threads 2`` covers the fused ops' multi-threaded paths, slowly.)
    """
    return 1


def run_tasks(tasks: Sequence[Dict], jobs: int, timeout: float, out_dir: Optional[str] = None,
              time_limit: Optional[float] = None, progress=None, threads: int = 0) -> List[Tuple[Dict, Dict]]:
    """Run ``tasks`` on ``jobs`` workers: [(task, result)], in task order (tasks not started: left out)."""
    ctx = mp.get_context("spawn")
    threads = threads or default_threads(jobs)
    slots = [_Slot(ctx, out_dir, threads) for _ in range(max(1, min(jobs, len(tasks))))]
    pending = list(enumerate(tasks))[::-1]
    results: Dict[int, Tuple[Dict, Dict]] = {}
    t_start = time.time()
    try:
        while pending or any(s.task for s in slots):
            for s in slots:
                if s.task is None and pending and not (time_limit and time.time() - t_start > time_limit):
                    i, t = pending.pop()
                    s.give(dict(t, _index=i))
            busy = [s for s in slots if s.task]
            if not busy:
                break
            ready = wait([s.conn for s in busy] + [s.proc.sentinel for s in busy], timeout=1.0)
            now = time.time()
            for s in busy:
                result = None
                if s.conn in ready:
                    try:
                        while s.conn.poll():
                            kind, payload = s.conn.recv()
                            if kind == "stage":
                                s.stage = payload
                            else:
                                result = payload
                                break
                    except (EOFError, OSError):
                        result = {"crash": s.stage, "exitcode": s.proc.exitcode}
                if result is None and not s.proc.is_alive():
                    s.proc.join(1)
                    result = {"crash": s.stage, "exitcode": s.proc.exitcode}
                if result is None and now - s.t0 > s.task.get("timeout", timeout):
                    s.kill()
                    result = {"timeout": s.stage, "seconds": now - s.t0}
                if result is None:
                    continue
                task = s.task
                if "crash" in result and not task.get("_retry"):
                    # run it again alone in a fresh worker: a heap corrupted by an earlier case can
                    # bring a worker down later, in another case
                    earlier = s.history[-6:-1]
                    s.kill()
                    s.start()
                    pending.append((task["_index"], dict(task, _retry=True, _first_crash=result["crash"],
                                                          _earlier=earlier)))
                    continue
                if task.get("_retry") and "crash" not in result:
                    result = dict(result, crash_alone_passes=task["_first_crash"], earlier=task["_earlier"])
                results[task["_index"]] = (task, result)
                if progress:
                    progress(task, result)
                if "crash" in result or "timeout" in result:
                    s.kill()
                    s.start()
                else:
                    s.task = None
    finally:
        for s in slots:
            if s.task:
                s.kill()
            else:
                s.close()
    return [results[i] for i in sorted(results)]


# ---------------------------------------------------------------------------- a whole run
@dataclasses.dataclass
class Summary:
    graphs: int = 0
    gen_invalid: int = 0
    invalid: int = 0
    valid: int = 0
    failing: int = 0
    seconds: float = 0.0
    ops_total: int = 0
    findings: Counter = dataclasses.field(default_factory=Counter)          # check -> cases
    by_family: Dict[str, Counter] = dataclasses.field(default_factory=lambda: defaultdict(Counter))
    family_graphs: Counter = dataclasses.field(default_factory=Counter)
    family_failing: Counter = dataclasses.field(default_factory=Counter)
    fired: Counter = dataclasses.field(default_factory=Counter)
    rejected: Counter = dataclasses.field(default_factory=Counter)
    fired_training: Counter = dataclasses.field(default_factory=Counter)
    counters: Counter = dataclasses.field(default_factory=Counter)
    classes: Dict[str, List[Dict]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    invalid_reasons: Counter = dataclasses.field(default_factory=Counter)
    harness_errors: List[str] = dataclasses.field(default_factory=list)


def fuzz(n: int, seed: int = 0, families: Optional[Sequence[str]] = None, jobs: int = 2,
         timeout: float = 120.0, out_dir: Optional[str] = None, time_limit: Optional[float] = None,
         shrink_per_class: int = 1, shrink_seconds: float = 90.0, progress=None, threads: int = 0,
         checks: Optional[Sequence[str]] = None) -> Summary:
    """Generate and check ``n`` graphs; write reproducers to ``out_dir`` (shrunk: the first
    ``shrink_per_class`` of each failure class).  ``checks``: a subset of the oracle's CHECKS
    (default: all)."""
    from .families import FAMILIES
    from .generator import family_for

    families = list(families or FAMILIES)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError("unknown families %s (known: %s)" % (unknown, ", ".join(FAMILIES)))
    from .oracle import CHECKS
    unknown = [k for k in checks or () if k not in CHECKS]
    if unknown:
        raise ValueError("unknown checks %s (known: %s)" % (unknown, ", ".join(CHECKS)))
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    tasks = []
    for i in range(n):
        s = case_seed(seed, i)
        tasks.append({"kind": "case", "seed": s, "family": family_for(s, families),
                      "checks": list(checks) if checks else None})
    t0 = time.time()
    results = run_tasks(tasks, jobs, timeout, out_dir, time_limit, progress, threads)
    summary = Summary()
    for task, r in results:
        _account(summary, task, r, out_dir)
    if out_dir and shrink_per_class > 0:
        _shrink_classes(summary, jobs, out_dir, shrink_per_class, shrink_seconds, time_limit, t0, threads)
    summary.seconds = time.time() - t0
    return summary


def _account(sm: Summary, task: Dict, r: Dict, out_dir: Optional[str]) -> None:
    fam, seed = task["family"], task["seed"]
    sm.graphs += 1
    sm.family_graphs[fam] += 1
    if "gen_invalid" in r:
        sm.gen_invalid += 1
        sm.invalid_reasons["generator: " + re.sub(r"\d+", "#", r["gen_invalid"])[:100]] += 1
        return
    if "harness_error" in r:
        sm.harness_errors.append("seed %d (%s): %s" % (seed, fam, r["harness_error"]))
        return
    findings: List[Tuple[str, str]] = []
    if "crash_alone_passes" in r:
        # the worker died in this case after earlier ones, but the case alone runs: memory corrupted before
        check = "%s.worker_crash_after_earlier" % STAGE_CHECK.get(r["crash_alone_passes"], "inference")
        findings_extra = [(check, "worker died in stage '%s' after seeds %s (this case alone passes its checks): "
                                  "memory corrupted by an earlier graph" % (r["crash_alone_passes"], r["earlier"]))]
    else:
        findings_extra = []
    if "crash" in r or "timeout" in r:
        stage = r.get("crash", r.get("timeout"))
        what = "worker_crash" if "crash" in r else "timeout"
        if what == "worker_crash" and stage in CRASH_IS_MXNETS:
            sm.counters["mxnet_crash_on_original"] += 1
            return
        check = "%s.%s" % (STAGE_CHECK.get(stage, "inference"), what)
        detail = ("worker died (exit code %s) in stage '%s'" % (r.get("exitcode"), stage) if what == "worker_crash"
                  else "no result after %.0f s, in stage '%s'" % (r["seconds"], stage))
        findings.append((check, detail))
        sm.valid += 1
        if out_dir:
            r["files"] = {check: _write_crash_repro(seed, fam, check, detail, out_dir)}
    else:
        if not r["valid"]:
            sm.invalid += 1
            sm.invalid_reasons[re.sub(r"\d+", "#", r["invalid_reason"])[:120]] += 1
            return
        sm.valid += 1
        sm.ops_total += r.get("ops", 0)
        findings = [(f["check"], f["detail"]) for f in r["findings"]] + findings_extra
        for k, v in r["fired"].items():
            sm.fired[k] += v
        for k, v in r["rejected"].items():
            sm.rejected[k] += v
        for k, v in r["fired_training"].items():
            sm.fired_training[k] += v
        for k, v in r["counters"].items():
            sm.counters[k] += v
    if not findings:
        return
    sm.failing += 1
    sm.family_failing[fam] += 1
    for check in sorted({c for c, _ in findings}):
        sm.findings[check] += 1
        sm.by_family[check][fam] += 1
    for check, detail in findings:
        fired = r.get("fired_training" if check.startswith("training") else "fired") or {}
        sm.classes[signature(check, detail)].append(
            {"seed": seed, "family": fam, "check": check, "detail": detail, "rules": tuple(sorted(fired)),
             "file": r.get("files", {}).get(check) or _group_file(r.get("files", {}), check)})


def _group_file(files: Dict[str, str], check: str) -> Optional[str]:
    g = check.split(".")[0]
    return next((p for c, p in files.items() if c.split(".")[0] == g), None)


def _write_crash_repro(seed: int, family: str, check: str, detail: str, out_dir: str) -> Optional[str]:
    """Reproducer of a crash, written here (the worker is gone)."""
    try:
        sys.path.insert(0, ROOT)
        from fusion.native import env as _env

        _env.configure_threads()
        from . import repro
        from .generator import generate
        from .oracle import Finding

        case = generate(seed, family)
        path = os.path.join(out_dir, "%s-%s-%d.py" % (check.replace(".", "-"), family, seed))
        repro.write(case, Finding(check, detail), path)
        return path
    except Exception:
        return None


def _shrink_classes(sm: Summary, jobs: int, out_dir: str, per_class: int, seconds: float,
                    time_limit: Optional[float], t0: float, threads: int = 0) -> None:
    tasks = []
    for sig, items in sm.classes.items():
        for it in items[:per_class]:
            if it["check"].endswith((".timeout", "worker_crash_after_earlier")):
                continue
            crash = it["check"].endswith(".worker_crash")       # a subprocess per try: slower
            budget = seconds * 3 if crash else seconds
            tasks.append({"kind": "shrink", "seed": it["seed"], "family": it["family"], "check": it["check"],
                          "detail": it["detail"], "attempts": 120 if crash else 250, "seconds": budget,
                          "timeout": budget + 180, "_sig": sig,
                          "path": os.path.join(out_dir, "min-%s-%s-%d.py" % (it["check"].replace(".", "-"),
                                                                             it["family"], it["seed"]))})
    left = None if not time_limit else max(30.0, time_limit - (time.time() - t0))
    for task, r in run_tasks(tasks, jobs, seconds + 120, out_dir, left, threads=threads):
        if r.get("shrunk"):
            for it in sm.classes[task["_sig"]]:
                if it["seed"] == task["seed"] and it["check"] == task["check"]:
                    it["min_file"], it["min_ops"], it["from_ops"] = r["shrunk"], r["ops"], r["from"]


# ---------------------------------------------------------------------------- the table
def format_summary(sm: Summary, rules: Sequence[str] = ()) -> str:
    fams = sorted(sm.family_graphs)
    L = []
    valid_pct = 100.0 * sm.valid / max(1, sm.graphs)
    L.append("graphs %d   valid %d (%.1f%%)   MXNet refuses the original %d   generator gave up %d   "
             "failing graphs %d   mean ops %.1f   %.0f s"
             % (sm.graphs, sm.valid, valid_pct, sm.invalid, sm.gen_invalid, sm.failing,
                sm.ops_total / max(1, sm.valid), sm.seconds))
    L.append("")
    w = max([len(c) for c in sm.findings] + [24])
    L.append("%-*s %6s   %s" % (w, "failing graphs by check", "total", "  ".join("%9s" % f[:9] for f in fams)))
    L.append("%-*s %6s   %s" % (w, "(graphs per family)", "", "  ".join("%9d" % sm.family_graphs[f] for f in fams)))
    for check in sorted(sm.findings):
        L.append("%-*s %6d   %s" % (w, check, sm.findings[check],
                                    "  ".join("%9s" % (sm.by_family[check][f] or ".") for f in fams)))
    L.append("%-*s %6d   %s" % (w, "any", sm.failing, "  ".join("%9d" % sm.family_failing[f] for f in fams)))
    L.append("")
    names = list(rules) or sorted(set(sm.fired) | set(sm.rejected))
    names += sorted(n for n in set(sm.fired) | set(sm.rejected) if n not in names)
    L.append("%-30s %8s %9s %10s" % ("rule", "fired", "rejected", "fired(tr)"))
    for n in names:
        L.append("%-30s %8d %9d %10d" % (n, sm.fired[n], sm.rejected[n], sm.fired_training[n]))
    L.append("")
    if sm.counters:
        L.append("not findings: " + ", ".join("%s %d" % kv for kv in sorted(sm.counters.items())))
    if sm.invalid_reasons:
        L.append("why MXNet refused originals / the generator gave up (top 5):")
        for r, c in sm.invalid_reasons.most_common(5):
            L.append("  %4d  %s" % (c, r))
    if sm.harness_errors:
        L.append("FUZZER ERRORS (%d):" % len(sm.harness_errors))
        L.extend("  " + e.splitlines()[0] for e in sm.harness_errors[:5])
    if sm.classes:
        L.append("")
        L.append("failure classes (%d):" % len(sm.classes))
        for sig, items in sorted(sm.classes.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            fams_c = Counter(it["family"] for it in items)
            rules_c = Counter(it.get("rules", ()) for it in items)
            best = next((it for it in items if it.get("min_file")), items[0])
            where = best.get("min_file") or best.get("file") or "seed %d" % best["seed"]
            size = " (%d ops, from %d)" % (best["min_ops"], best["from_ops"]) if best.get("min_file") else ""
            L.append("  %4d  %s" % (len(items), sig))
            L.append("        families %s; rules fired %s; %s%s" % (
                dict(fams_c), "+".join(rules_c.most_common(1)[0][0]) or "none", where, size))
    return "\n".join(L)
