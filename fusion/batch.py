"""``mxfuse MODEL_OR_DIR... -o OUTDIR -j N``: fuse many models at once, each in its own process.

Inputs are model files (``NAME-symbol.json``, ``NAME.onnx``) and folders; a
folder contributes every ``*-symbol.json`` (with the ``NAME-XXXX.params`` of
the highest epoch beside it) and every ``*.onnx`` at its top level.  Each
model is one ``mxfuse`` run (:func:`fusion.cli.main` with that model's
argv) in a worker process, writing ``OUTDIR/NAME-symbol.json`` and
``OUTDIR/NAME-0000.params``.  A model that fails — bad JSON, params that do
not fit, a verification mismatch, even a crash in native code — is reported
and the others go on.  Progress goes to stderr, a summary table to stdout;
the exit status is 1 when any model failed (2: bad usage, nothing to do).

Workers are started with ``spawn``: MXNet is not fork-safe once its engine
threads run.  Each worker imports MXNet itself, with ``OMP_NUM_THREADS`` set
to its share of the cores so that N workers do not each start a team of all.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import io
import json
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Dict, IO, List, Optional, Sequence, Tuple

_SYMBOL_SUFFIX = "-symbol.json"
_EPOCH = re.compile(r"-(\d{4})\.params$")


@dataclass
class Model:
    name: str                       # names the outputs: OUTDIR/NAME-symbol.json
    path: str
    params: Optional[str] = None


@dataclass
class Outcome:
    model: Model
    ok: bool
    error: str = ""
    fused: Optional[int] = None
    ops: Optional[Tuple[int, int]] = None
    seconds: float = 0.0
    log: str = ""                   # everything the job printed


# ---------------------------------------------------------------- finding the models

def _model_name(path: str) -> str:
    base = os.path.basename(path)
    for suffix in (_SYMBOL_SUFFIX, ".json", ".onnx"):
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def _latest_params(symbol_path: str) -> Optional[str]:
    """``NAME-XXXX.params`` beside ``NAME-symbol.json`` with the highest epoch XXXX, if any."""
    folder, name = os.path.dirname(symbol_path) or ".", _model_name(symbol_path)
    best = None
    for entry in os.listdir(folder):
        m = _EPOCH.search(entry)
        if m and entry[: m.start()] == name and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), entry)
    return os.path.join(folder, best[1]) if best else None


def find_models(inputs: Sequence[str]) -> Tuple[List[Model], List[Outcome]]:
    """The models ``inputs`` name, and a failed Outcome for each input that names none."""
    found: List[Model] = []
    problems: List[Outcome] = []

    def add(path: str) -> None:
        params = _latest_params(path) if path.endswith(".json") else None
        found.append(Model(_model_name(path), path, params))

    for inp in inputs:
        if os.path.isdir(inp):
            entries = sorted(e for e in os.listdir(inp) if e.endswith((_SYMBOL_SUFFIX, ".onnx"))
                             and os.path.isfile(os.path.join(inp, e)))
            if not entries:
                problems.append(Outcome(Model(inp, inp), False, "no *-symbol.json or *.onnx in this folder"))
            for e in entries:
                add(os.path.join(inp, e))
        elif os.path.isfile(inp):
            if inp.endswith((".json", ".onnx")):
                add(inp)
            else:
                problems.append(Outcome(Model(_model_name(inp), inp), False,
                                        "not a model: expected NAME-symbol.json or NAME.onnx"))
        else:
            problems.append(Outcome(Model(_model_name(inp), inp), False, "no such file or folder"))
    models: List[Model] = []
    by_name: Dict[str, Model] = {}
    for m in found:
        first = by_name.get(m.name)
        if first is None:
            by_name[m.name] = m
            models.append(m)
        elif os.path.realpath(first.path) != os.path.realpath(m.path):   # the same file twice is harmless
            problems.append(Outcome(m, False, "same name as '%s': the outputs would collide" % first.path))
    return models, problems


# ---------------------------------------------------------------- one model, in a worker

@contextlib.contextmanager
def _captured_fds():
    """Route file descriptors 1 and 2 to a temporary file (MXNet's C++ logging writes there directly)."""
    with tempfile.TemporaryFile() as tmp:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(tmp.fileno(), 1)
        os.dup2(tmp.fileno(), 2)
        text: List[str] = []
        try:
            yield text
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            tmp.seek(0)
            text.append(tmp.read().decode("utf-8", "replace"))


def run_job(argv: List[str], report_path: str, keep_report: bool) -> dict:
    """One ``mxfuse`` run (runs in a worker process): exit code, what it printed, its report figures."""
    from . import cli    # imports MXNet here, in the worker, with the thread settings it inherited

    out = io.StringIO()
    start = time.perf_counter()
    with _captured_fds() as native, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = cli.main(argv + ["--report", report_path])
        except SystemExit as e:           # argparse
            code = e.code if isinstance(e.code, int) else 2
        except Exception as e:            # a bug, not a bad model: keep the traceback, report one line
            traceback.print_exc(file=out)
            print("mxfuse: error: %s: %s" % (type(e).__name__, (str(e).strip().splitlines() or [""])[0]), file=out)
            code = 3
    seconds = time.perf_counter() - start
    report = None
    try:
        with open(report_path) as f:
            report = json.load(f)
        if not keep_report:
            os.unlink(report_path)
    except (OSError, ValueError):
        pass
    return {"code": code, "log": out.getvalue() + "".join(native), "seconds": seconds,
            "fused": report.get("fused") if report else None,
            "ops": (report["ops_before"], report["ops_after"]) if report else None}


def _error_line(log: str) -> str:
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("mxfuse: error: ")]
    if errors:
        return errors[-1][len("mxfuse: error: "):].replace(" (see mxfuse --help)", "")
    return lines[-1] if lines else "failed without a message"


def _outcome(model: Model, r: dict) -> Outcome:
    ok = r["code"] == 0
    return Outcome(model, ok, "" if ok else _error_line(r["log"]), r["fused"], r["ops"], r["seconds"], r["log"])


# ---------------------------------------------------------------- progress and summary

class Progress:
    """A bar redrawn in place on a terminal; one line per finished model otherwise (logs, CI)."""

    def __init__(self, total: int, stream: IO[str]):
        self.total, self.stream, self.done, self.failed = total, stream, 0, 0
        try:
            self.tty = stream.isatty()
        except (AttributeError, ValueError):
            self.tty = False
        self.width = 0
        if self.tty and total:
            self._draw("")

    def _draw(self, last: str) -> None:
        filled = int(24 * self.done / self.total) if self.total else 24
        line = "[%s%s] %d/%d models, %d failed%s" % ("#" * filled, "." * (24 - filled), self.done, self.total,
                                                       self.failed, "  " + last if last else "")
        line = line[: max(20, shutil.get_terminal_size().columns - 1)]
        self.stream.write("\r" + line.ljust(self.width))
        self.width = len(line)
        self.stream.flush()

    def update(self, o: Outcome) -> None:
        self.done += 1
        self.failed += not o.ok
        what = "%s: %s (%.1f s)" % (o.model.name, "ok" if o.ok else "FAILED", o.seconds)
        if self.tty:
            self._draw(what)
        else:
            self.stream.write("[%d/%d] %s%s\n" % (self.done, self.total, what, "" if o.ok else ": " + o.error))
            self.stream.flush()

    def close(self) -> None:
        if self.tty and self.total:
            self.stream.write("\n")
            self.stream.flush()


def summary(outcomes: Sequence[Outcome]) -> str:
    rows = [("model", "status", "fused", "ops before->after", "seconds", "error")]
    for o in outcomes:
        rows.append((o.model.name, "ok" if o.ok else "failed", "-" if o.fused is None else str(o.fused),
                     "%d -> %d" % o.ops if o.ops else "-", "%.2f" % o.seconds if o.seconds else "-", o.error))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.rjust(w) if i in (2, 4) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             + "  " + r[5] for r in rows]
    failed = sum(not o.ok for o in outcomes)
    lines.append("%d model(s): %d ok, %d failed" % (len(outcomes), len(outcomes) - failed, failed))
    return "\n".join(ln.rstrip() for ln in lines)


# ---------------------------------------------------------------- the batch

@contextlib.contextmanager
def _worker_threads(jobs: int):
    """Workers inherit the environment when spawned: give each its share of the cores (unless the user chose)."""
    if "OMP_NUM_THREADS" in os.environ:
        yield
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // jobs))
    try:
        yield
    finally:
        del os.environ["OMP_NUM_THREADS"]


def _ping() -> bool:
    return True


def _workers_start(ctx) -> bool:
    """Whether a fresh worker can start at all (import fusion and MXNet)."""
    try:
        return _isolated(ctx, (), _ping)
    except cf.process.BrokenProcessPool:
        return False


def _isolated(ctx, args: tuple, fn=run_job):
    with cf.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as solo:
        return solo.submit(fn, *args).result()


def _in_pool(ctx, jobs: int, job, todo: Dict[int, tuple], finish) -> List[int]:
    """Run ``job(*todo[k])`` in ``jobs`` workers, ``finish(k, result)`` each; the keys a dead worker took down."""
    broken: List[int] = []
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = {pool.submit(job, *args): k for k, args in todo.items()}
        try:
            for f in cf.as_completed(futures):
                try:
                    finish(futures[f], f.result())
                except cf.process.BrokenProcessPool:
                    broken.append(futures[f])
        except KeyboardInterrupt:
            pool.shutdown(wait=False, cancel_futures=True)   # start no further model
            raise
    return sorted(broken)


def _one_by_one(ctx, jobs: int, job, todo: Dict[int, tuple], finish, died) -> None:
    """Run each ``job(*todo[k])`` in a process of its own, ``jobs`` at a time; ``died(k)`` when that process dies."""
    with cf.ThreadPoolExecutor(max_workers=jobs) as threads:
        futures = {threads.submit(_isolated, ctx, args, job): k for k, args in todo.items()}
        for f in cf.as_completed(futures):
            try:
                finish(futures[f], f.result())
            except cf.process.BrokenProcessPool:
                died(futures[f])


def run_batch(inputs: Sequence[str], outdir: str, *, jobs: Optional[int] = None, options: Sequence[str] = (),
              reports: bool = False, progress: Optional[IO[str]] = None, _job=run_job) -> List[Outcome]:
    """Fuse every model ``inputs`` name into ``outdir``; ``options`` are mxfuse options for each (e.g. --verify).

    Returns an Outcome for each input that names no model, then one per model in input order.
    (``_job`` replaces :func:`run_job` in tests; it must be importable in a fresh process.)
    """
    if any(opt in ("-o", "--output", "--params", "--report") or opt.startswith(("--output=", "--params=", "--report="))
           for opt in options):
        raise ValueError("options may not set -o, --params or --report: they are chosen per model")
    models, outcomes = find_models(inputs)
    os.makedirs(outdir, exist_ok=True)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(models) or 1))
    bar = Progress(len(models), progress if progress is not None else sys.stderr)
    ctx = multiprocessing.get_context("spawn")
    results: Dict[int, Outcome] = {}
    temps_before = set(_orphan_temps(outdir))

    def finish(k: int, outcome: Outcome) -> None:
        results[k] = outcome
        bar.update(outcome)

    with tempfile.TemporaryDirectory(prefix="mxfuse-batch-") as scratch, _worker_threads(jobs):
        todo = {}
        for k, m in enumerate(models):
            argv = [m.path] + (["--params", m.params] if m.params else []) + ["-o", os.path.join(outdir, "")]
            todo[k] = (argv + list(options), os.path.join(outdir if reports else scratch, m.name + "-report.json"),
                       reports)
        broken: List[int] = []
        try:
            broken = _in_pool(ctx, jobs, _job, todo, lambda k, r: finish(k, _outcome(models[k], r)))
            # A worker that dies (a crash in native code) takes every model in the pool down with it:
            # rerun those in a process each, so that only the model that crashed fails.
            if broken and not _workers_start(ctx):
                for k in broken:
                    finish(k, Outcome(models[k], False, "worker processes cannot start: "
                                      "`python -c 'import fusion'` fails (see above)"))
            elif broken:
                _one_by_one(ctx, jobs, _job, {k: todo[k] for k in broken},
                            lambda k, r: finish(k, _outcome(models[k], r)),
                            lambda k: finish(k, Outcome(models[k], False,
                                                        "the worker process died (a crash in native code?)")))
        finally:
            bar.close()
            if broken:  # a killed worker may have been writing: its temp files stay behind
                for t in set(_orphan_temps(outdir)) - temps_before:
                    try:
                        os.unlink(t)
                    except OSError:
                        pass
    return outcomes + [results[k] for k in range(len(models))]


def _orphan_temps(outdir: str) -> List[str]:
    """The temporary files of mxfuse's atomic writes (modelio) in ``outdir``."""
    from .modelio import TEMP_PREFIX
    try:
        return [os.path.join(outdir, n) for n in os.listdir(outdir) if n.startswith(TEMP_PREFIX)]
    except OSError:
        return []


# ---------------------------------------------------------------- command line

class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:   # one line, like every other error of mxfuse (main_batch prints it)
        raise _UsageError("mxfuse: error: %s (see mxfuse --help)\n" % message)


class _QuietParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise ValueError(message)


def build_parser(parser_class: type = _Parser) -> argparse.ArgumentParser:
    from .argtypes import positive_float, positive_int

    strict = parser_class is _Parser      # is_batch() only tells the modes apart: values are checked later
    p = parser_class(prog="mxfuse", description="Fuse many exported MXNet models, each in its own process.",
                     add_help=parser_class is _Parser)
    p.add_argument("inputs", nargs="+", metavar="MODEL_OR_DIR",
                   help="NAME-symbol.json (params: the NAME-XXXX.params of the highest epoch beside it), "
                        "NAME.onnx, or a folder of them")
    p.add_argument("-o", "--output", required=True, metavar="OUTDIR",
                   help="writes OUTDIR/NAME-symbol.json and OUTDIR/NAME-0000.params per model")
    p.add_argument("-j", "--jobs", type=positive_int if strict else str, help="models fused at once (default: the number of cores)")
    p.add_argument("--reports", action="store_true", help="also write OUTDIR/NAME-report.json per model")
    p.add_argument("--verbose", action="store_true", help="print the whole output of each failed model")
    # passed on to each model's mxfuse run (see mxfuse --help); keep in step with fusion/cli.py
    p.add_argument("--shape", action="append", default=[], metavar="NAME=D1,D2,...")
    p.add_argument("--rules")
    p.add_argument("--mode", choices=("inference", "training"))
    p.add_argument("--verify", action="store_true")
    p.add_argument("--rtol", type=positive_float if strict else str)
    p.add_argument("--benchmark", action="store_true")
    p.add_argument("--repeats", type=positive_int if strict else str)
    # single-model options: known here so that is_batch() reads their values right; refused in a batch
    p.add_argument("--params", help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    p.add_argument("--html", help=argparse.SUPPRESS)
    p.add_argument("--to-onnx", help=argparse.SUPPRESS)
    p.add_argument("--unfuse", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--explain", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def main_batch(argv: Optional[List[str]] = None, stdout: Optional[IO[str]] = None,
               stderr: Optional[IO[str]] = None) -> int:
    """``mxfuse MODEL_OR_DIR... -o OUTDIR [-j N]``: 0 when every model was fused, 1 when any failed, 2 bad usage."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    try:
        args = build_parser().parse_intermixed_args(argv)
    except _UsageError as e:
        stderr.write(str(e))
        return 2
    if args.params or args.report or args.html or args.to_onnx:
        stderr.write("mxfuse: error: --params, --report, --html and --to-onnx name one model's files; with several "
                     "models the params are found beside each model, and --reports writes OUTDIR/NAME-report.json\n")
        return 2
    options: List[str] = []
    for s in args.shape:
        options += ["--shape", s]
    for flag in ("rules", "mode", "rtol", "repeats"):
        if getattr(args, flag) is not None:
            options += ["--" + flag, str(getattr(args, flag))]
    options += [f for f in ("--verify", "--benchmark", "--unfuse") if getattr(args, f[2:])]
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        stderr.write("mxfuse: error: -o '%s' is a file; with several models it must be a folder\n" % args.output)
        return 2
    try:
        outcomes = run_batch(args.inputs, args.output, jobs=args.jobs, options=options, reports=args.reports,
                             progress=open(os.devnull, "w") if args.quiet else stderr)
    except KeyboardInterrupt:
        stderr.write("\nmxfuse: interrupted; models not finished were not written\n")
        return 130
    if args.verbose:
        for o in outcomes:
            if not o.ok and o.log.strip():
                stdout.write("---- %s (%s)\n%s\n" % (o.model.name, o.model.path, o.log.rstrip()))
    stdout.write(summary(outcomes) + "\n")
    return 0 if outcomes and all(o.ok for o in outcomes) else 1


def is_batch(argv: Sequence[str]) -> bool:
    """True when an mxfuse command line names several models or a folder: a job for :func:`main_batch`."""
    argv = list(argv)
    if "-h" in argv or "--help" in argv:
        return False
    try:
        args, _ = build_parser(_QuietParser).parse_known_intermixed_args(argv)
    except ValueError:
        return False
    return len(args.inputs) > 1 or any(os.path.isdir(p) for p in args.inputs)
