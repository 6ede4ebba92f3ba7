"""``mxfuse MODEL_OR_DIR... -o OUTDIR -j N``: fuse many models at once, each in its own process.

Inputs are model files (``NAME-symbol.json``, ``NAME.onnx``) and folders; a
folder contributes every ``*-symbol.json`` (with the ``NAME-XXXX.params`` of
the highest epoch beside it) and every ``*.onnx`` at its top level.  A
``NAME.shapes.json`` beside a model (``{"data": [1, 3, 224, 224]}``) gives
that model's input shapes, in place of the ``--shape`` options.  Each
model is one ``mxfuse`` run (:func:`fusion.doors.cli.main` with that model's
argv) in a worker process, writing ``OUTDIR/NAME-symbol.json`` and
``OUTDIR/NAME-0000.params``.  A model that fails — bad JSON, params that do
not fit, a verification mismatch, even a crash in native code — is reported
and the others go on.  Progress goes to stderr, a summary table to stdout;
the exit status is 1 when any model failed (2: bad usage, nothing to do).

Each worker writes into a hidden staging folder inside OUTDIR; the parent
moves a model's files into OUTDIR (publishes it) when its job has succeeded.
SIGINT (Ctrl-C), SIGTERM and SIGHUP stop the batch at once: the parent stops
publishing, terminates the workers (which ignore SIGINT themselves, so a
Ctrl-C sent to the whole process group gives no tracebacks), waits until they
are gone, removes the staging folder, and says exactly which models were
written and which were not; exit status 128 + the signal.  The staging folder
is named like publish's temporary files (``.mxfuse-PID-HOST-batch-…``): one a
killed batch left behind is removed by the next run into OUTDIR.

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
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Dict, IO, List, Optional, Sequence, Tuple

from .about import command_line as _command_line
from .batch_options import VERBOSE_HELP, add_batch_arguments

_SYMBOL_SUFFIX = "-symbol.json"
SHAPES_SUFFIX = ".shapes.json"
_EPOCH = re.compile(r"-(\d{4})\.params$")


@dataclass
class Model:
    name: str                       # names the outputs: OUTDIR/NAME-symbol.json
    path: str
    params: Optional[str] = None
    shapes: Optional[str] = None    # NAME.shapes.json beside the model: its input shapes


@dataclass
class Outcome:
    model: Model
    ok: bool
    error: str = ""
    fused: Optional[int] = None
    ops: Optional[Tuple[int, int]] = None
    seconds: float = 0.0
    log: str = ""                   # everything the job printed
    interrupted: bool = False       # not written because the batch was stopped by a signal


class Interrupted(Exception):
    """:func:`run_batch` was stopped by SIGINT/SIGTERM; ``outcomes`` as it would have returned them,
    the models it did not write marked ``interrupted`` (``ok`` only for models written before the stop)."""

    def __init__(self, signum: int, outcomes: List["Outcome"]):
        self.signum, self.outcomes = signum, outcomes
        super().__init__("interrupted by %s" % signal.Signals(signum).name)


# ---------------------------------------------------------------- finding the models

def _model_name(path: str) -> str:
    base = os.path.basename(path)
    for suffix in (_SYMBOL_SUFFIX, SHAPES_SUFFIX, ".json", ".onnx"):
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


def _shapes_file(model_path: str) -> Optional[str]:
    path = os.path.join(os.path.dirname(model_path), _model_name(model_path) + SHAPES_SUFFIX)
    return path if os.path.isfile(path) else None


def shape_options(path: str) -> List[str]:
    """``--shape`` options from a ``NAME.shapes.json`` file; ValueError (one line) when it is not one."""
    try:
        with open(path) as f:
            shapes = json.load(f)
    except OSError as e:
        raise ValueError("cannot read shapes file '%s': %s" % (path, e.strerror or e)) from None
    except ValueError as e:
        raise ValueError("shapes file '%s' is not valid JSON: %s" % (path, e)) from None
    if not isinstance(shapes, dict) or not shapes:
        raise ValueError("shapes file '%s' must hold an object of input name -> shape, "
                         'e.g. {"data": [1, 3, 224, 224]}' % path)
    options: List[str] = []
    for name, dims in shapes.items():
        if not (isinstance(dims, list) and dims and all(type(d) is int and d > 0 for d in dims)):
            raise ValueError("shapes file '%s': the shape of '%s' must be a list of positive integers, not %s"
                             % (path, name, json.dumps(dims)))
        options += ["--shape", "%s=%s" % (name, ",".join(map(str, dims)))]
    return options


def _without_shapes(options: Sequence[str]) -> List[str]:
    out: List[str] = []
    skip = False
    for opt in options:
        if skip:
            skip = False
        elif opt == "--shape":
            skip = True
        elif not opt.startswith("--shape="):
            out.append(opt)
    return out


def find_models(inputs: Sequence[str]) -> Tuple[List[Model], List[Outcome]]:
    """The models ``inputs`` name, and a failed Outcome for each input that names none."""
    found: List[Model] = []
    problems: List[Outcome] = []

    def add(path: str) -> None:
        params = _latest_params(path) if path.endswith(".json") else None
        found.append(Model(_model_name(path), path, params, _shapes_file(path)))

    for inp in inputs:
        if os.path.isdir(inp):
            entries = sorted(e for e in os.listdir(inp) if e.endswith((_SYMBOL_SUFFIX, ".onnx"))
                             and os.path.isfile(os.path.join(inp, e)))
            if not entries:
                problems.append(Outcome(Model(inp, inp), False, "no *-symbol.json or *.onnx in this folder"))
            for e in entries:
                add(os.path.join(inp, e))
        elif os.path.isfile(inp):
            if inp.endswith(SHAPES_SUFFIX):
                problems.append(Outcome(Model(_model_name(inp), inp), False, "not a model: a NAME%s file gives "
                                        "the input shapes of the model NAME beside it" % SHAPES_SUFFIX))
            elif inp.endswith((".json", ".onnx")):
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
        status = "ok" if o.ok else "interrupted" if o.interrupted else "failed"
        rows.append((o.model.name, status, "-" if o.fused is None else str(o.fused),
                     "%d -> %d" % o.ops if o.ops else "-", "%.2f" % o.seconds if o.seconds else "-", o.error))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.rjust(w) if i in (2, 4) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             + "  " + r[5] for r in rows]
    failed = sum(not o.ok and not o.interrupted for o in outcomes)
    stopped = sum(o.interrupted for o in outcomes)
    lines.append("%d model(s): %d ok, %d failed" % (len(outcomes), len(outcomes) - failed - stopped, failed)
                 + (", %d not run to the end (interrupted)" % stopped if stopped else ""))
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


class _Stop:
    """The signal that stopped the batch (None while running), and the worker pools to terminate then."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.pools: List[cf.ProcessPoolExecutor] = []

    def __call__(self, signum: int, frame) -> None:   # a signal handler: record only, the main loop acts
        if self.signum is None:
            self.signum = signum

    def kill(self, pool: cf.ProcessPoolExecutor) -> None:
        # ProcessPoolExecutor has no terminate(): its shutdown() lets workers finish their model first
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in processes:
            try:
                proc.terminate()
            except (OSError, ValueError, AttributeError):
                pass
        _reap(processes)


def _reap(processes, grace: float = 3.0) -> None:
    """Wait until the terminated workers are gone (SIGKILL after ``grace`` seconds): a worker handles
    SIGTERM when its main thread next runs Python -- after the C call it is in (MXNet writing a large
    params file), and after the renames publish() holds signals for -- so without the wait it could
    still put a finished model into the staging folder after the batch has removed it."""
    deadline = time.monotonic() + grace
    for proc in processes:
        try:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        except (OSError, ValueError, AttributeError, AssertionError):
            pass


def _remove_staging(staging: str) -> None:
    """Remove the staging folder (the workers are gone); a second try for anything written meanwhile."""
    for _ in range(2):
        shutil.rmtree(staging, ignore_errors=True)
        if not os.path.lexists(staging):
            return


@contextlib.contextmanager
def _signals_stop(stop: _Stop):
    """SIGINT and SIGTERM set ``stop`` instead of raising (only the main thread can install handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _worker_init() -> None:
    """Workers leave SIGINT to the parent (a Ctrl-C reaches the whole process group): it terminates them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextlib.contextmanager
def _spawning():
    """Workers are spawned on submit: with SIGINT blocked, which they inherit, so that a Ctrl-C while one
    still imports MXNet (before :func:`_worker_init` runs) gives no traceback; the parent gets it on unblock."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _finished(futures, stop: _Stop):
    """The futures as they complete, until they all have or a signal came."""
    pending = set(futures)
    while pending and stop.signum is None:
        done, pending = cf.wait(pending, timeout=0.1, return_when=cf.FIRST_COMPLETED)
        for f in done:
            if stop.signum is not None:
                return
            yield f


@contextlib.contextmanager
def _pool(ctx, jobs: int, stop: _Stop):
    pool = cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_worker_init)
    stop.pools.append(pool)
    try:
        yield pool
    finally:
        stop.pools.remove(pool)
        if stop.signum is not None:
            stop.kill(pool)
        pool.shutdown(wait=True, cancel_futures=True)


def _ping() -> bool:
    return True


def _workers_start(ctx, stop: _Stop) -> bool:
    """Whether a fresh worker can start at all (import fusion and MXNet)."""
    try:
        return bool(_isolated(ctx, (), stop, _ping))
    except cf.process.BrokenProcessPool:
        return False


def _isolated(ctx, args: tuple, stop: _Stop, fn=run_job):
    """``fn(*args)`` in a process of its own; None when a signal stopped the batch first."""
    with _pool(ctx, 1, stop) as solo:
        with _spawning():
            future = solo.submit(fn, *args)
        for f in _finished([future], stop):
            return f.result()
    return None


def _in_pool(ctx, jobs: int, job, todo: Dict[int, tuple], finish, stop: _Stop) -> List[int]:
    """Run ``job(*todo[k])`` in ``jobs`` workers, ``finish(k, result)`` each; the keys a dead worker took down."""
    broken: List[int] = []
    with _pool(ctx, jobs, stop) as pool:
        with _spawning():
            futures = {pool.submit(job, *args): k for k, args in todo.items()}
        for f in _finished(futures, stop):
            try:
                result = f.result()
            except cf.process.BrokenProcessPool:
                broken.append(futures[f])
                continue
            finish(futures[f], result)
    return sorted(broken)


def _one_by_one(ctx, jobs: int, job, todo: Dict[int, tuple], finish, died, stop: _Stop) -> None:
    """Run each ``job(*todo[k])`` in a process of its own, ``jobs`` at a time; ``died(k)`` when that process dies."""
    with cf.ThreadPoolExecutor(max_workers=jobs) as threads:
        futures = {threads.submit(_isolated, ctx, args, stop, job): k for k, args in todo.items()}
        for f in _finished(futures, stop):
            try:
                result = f.result()
            except cf.process.BrokenProcessPool:
                died(futures[f])
                continue
            if result is not None:
                finish(futures[f], result)


_PUBLISHED = ("-0000.params", "-symbol.json")    # the params first: a symbol file in OUTDIR means both are there


def _publish(staging: str, outdir: str, name: str, report: bool, command_line: Optional[str]) -> None:
    if report:      # the report names OUTDIR, not the staging folder, and the command the user gave
        path = os.path.join(staging, name + "-report.json")
        try:
            with open(path) as f:
                data = json.loads(f.read().replace(json.dumps(os.path.join(staging, ""))[1:-1],
                                                   json.dumps(os.path.join(outdir, ""))[1:-1]))
            if command_line:
                data["command_line"] = command_line
            with open(path, "w") as f:
                json.dump(data, f, indent=2)
        except (OSError, ValueError):
            pass
    for suffix in _PUBLISHED + (("-report.json",) if report else ()):
        src = os.path.join(staging, name + suffix)
        if os.path.exists(src):
            os.replace(src, os.path.join(outdir, name + suffix))


def _over_an_input(model: Model, outdir: str, reports: bool) -> Optional[str]:
    inputs = {os.path.realpath(p) for p in (model.path, model.params) if p}
    for suffix in _PUBLISHED + (("-report.json",) if reports else ()):
        dest = os.path.join(outdir, model.name + suffix)
        if os.path.realpath(dest) in inputs:
            return "refusing to write '%s' over an input file; choose another -o" % dest
    return None


def run_batch(inputs: Sequence[str], outdir: str, *, jobs: Optional[int] = None, options: Sequence[str] = (),
              reports: bool = False, progress: Optional[IO[str]] = None, command_line: Optional[str] = None,
              _job=run_job) -> List[Outcome]:
    """Fuse every model ``inputs`` name into ``outdir``; ``options`` are mxfuse options for each (e.g. --verify).

    Returns an Outcome for each input that names no model, then one per model in input order.
    ``command_line`` (the batch's, as text) replaces each model's own in the reports ``reports`` keeps.
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
    stop = _Stop()

    with _signals_stop(stop), _worker_threads(jobs):
        from ..files.publish import remove_stale_temps, temp_prefix
        remove_stale_temps(outdir)      # staging folders of batches that were killed (SIGKILL) included
        # named as publish's temporary files (.mxfuse-PID-HOST-...): a later run removes it if this one is killed
        staging = tempfile.mkdtemp(prefix=temp_prefix() + "batch-", dir=outdir)

        def finish(k: int, outcome: Outcome) -> None:
            if outcome.ok:
                if stop.signum is not None:     # the batch was stopped: publish nothing more
                    return
                _publish(staging, outdir, models[k].name, reports, command_line)
            results[k] = outcome
            bar.update(outcome)

        try:
            todo = {}
            for k, m in enumerate(models):
                refusal = _over_an_input(m, outdir, reports)
                model_options = list(options)
                if m.shapes and not refusal:
                    try:
                        model_options = _without_shapes(options) + shape_options(m.shapes)
                    except ValueError as e:
                        refusal = str(e)
                if refusal:
                    finish(k, Outcome(m, False, refusal))
                    continue
                argv = [m.path] + (["--params", m.params] if m.params else []) + ["-o", os.path.join(staging, "")]
                todo[k] = (argv + model_options, os.path.join(staging, m.name + "-report.json"), reports)
            broken = _in_pool(ctx, jobs, _job, todo, lambda k, r: finish(k, _outcome(models[k], r)), stop)
            # A worker that dies (a crash in native code) takes every model in the pool down with it:
            # rerun those in a process each, so that only the model that crashed fails.
            if broken and stop.signum is None and not _workers_start(ctx, stop):
                if stop.signum is None:
                    for k in broken:
                        finish(k, Outcome(models[k], False, "worker processes cannot start: "
                                          "`python -c 'import fusion'` fails (see above)"))
            elif broken and stop.signum is None:
                _one_by_one(ctx, jobs, _job, {k: todo[k] for k in broken},
                            lambda k, r: finish(k, _outcome(models[k], r)),
                            lambda k: finish(k, Outcome(models[k], False,
                                                        "the worker process died (a crash in native code?)")),
                            stop)
        finally:
            bar.close()
            _remove_staging(staging)
    if stop.signum is not None:
        why = "not written: interrupted by %s" % signal.Signals(stop.signum).name
        for k, m in enumerate(models):
            results.setdefault(k, Outcome(m, False, why, interrupted=True))
        raise Interrupted(stop.signum, outcomes + [results[k] for k in range(len(models))])
    return outcomes + [results[k] for k in range(len(models))]


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
    from .argtypes import memory_size, positive_float, positive_int

    strict = parser_class is _Parser      # is_batch() only tells the modes apart: values are checked later
    p = parser_class(prog="mxfuse", description="Fuse many exported MXNet models, each in its own process.",
                     add_help=parser_class is _Parser)
    p.add_argument("inputs", nargs="+", metavar="MODEL_OR_DIR",
                   help="NAME-symbol.json (params: the NAME-XXXX.params of the highest epoch beside it), "
                        "NAME.onnx, or a folder of them")
    p.add_argument("-o", "--output", required=True, metavar="OUTDIR",
                   help="writes OUTDIR/NAME-symbol.json and OUTDIR/NAME-0000.params per model")
    add_batch_arguments(p, jobs_type=positive_int if strict else str)
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    # passed on to each model's mxfuse run (see mxfuse --help); keep in step with fusion/doors/cli.py
    p.add_argument("--shape", action="append", default=[], metavar="NAME=D1,D2,...")
    p.add_argument("--rules")
    p.add_argument("--mode", choices=("inference", "training"))
    p.add_argument("--verify", action="store_true")
    p.add_argument("--rtol", type=positive_float if strict else str)
    p.add_argument("--benchmark", action="store_true")
    p.add_argument("--repeats", type=positive_int if strict else str)
    p.add_argument("--precision")
    p.add_argument("--force-precision", action="store_true")
    p.add_argument("--max-memory", type=memory_size if strict else str)
    p.add_argument("--no-self-check", dest="self_check", action="store_false")
    # single-model options: known here so that is_batch() reads their values right; refused in a batch
    p.add_argument("--params", help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    p.add_argument("--html", help=argparse.SUPPRESS)
    p.add_argument("--to-onnx", help=argparse.SUPPRESS)
    p.add_argument("--onnx-target", help=argparse.SUPPRESS)
    p.add_argument("--opset", help=argparse.SUPPRESS)
    p.add_argument("--unfuse", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--explain", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def main_batch(argv: Optional[List[str]] = None, stdout: Optional[IO[str]] = None,
               stderr: Optional[IO[str]] = None, _job=run_job) -> int:
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
    for flag in ("rules", "mode", "rtol", "repeats", "precision"):
        if getattr(args, flag) is not None:
            options += ["--" + flag, str(getattr(args, flag))]
    options += [f for f in ("--verify", "--benchmark", "--unfuse", "--force-precision")
                if getattr(args, f[2:].replace("-", "_"))]
    if not args.self_check:
        options.append("--no-self-check")
    options += _memory_share(args.max_memory, args.jobs)
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        stderr.write("mxfuse: error: -o '%s' is a file; with several models it must be a folder\n" % args.output)
        return 2
    try:
        outcomes = run_batch(args.inputs, args.output, jobs=args.jobs, options=options, reports=args.reports,
                             progress=open(os.devnull, "w") if args.quiet else stderr, _job=_job,
                             command_line=_command_line(argv if argv is not None else sys.argv[1:]))
    except Interrupted as e:
        stdout.write(summary(e.outcomes) + "\n")
        stderr.write(interrupted_line(e, args.output) + "\n")
        return 128 + e.signum
    except KeyboardInterrupt:       # before the batch began: nothing was written
        stderr.write("\nmxfuse: interrupted; nothing written\n")
        return 130
    if args.verbose:
        for o in outcomes:
            if not o.ok and o.log.strip():
                stdout.write("---- %s (%s)\n%s\n" % (o.model.name, o.model.path, o.log.rstrip()))
    stdout.write(summary(outcomes) + "\n")
    return 0 if outcomes and all(o.ok for o in outcomes) else 1


def _memory_share(max_memory: Optional[str], jobs: Optional[int]) -> List[str]:
    """Each model's ``--max-memory``: the batch's budget (given, or 60 percent of the memory available
    now) shared among the models fused at once."""
    from ..engine.memory import budget

    b = budget(max_memory, door="cli")
    if b.limit is None:
        return []
    share = max(1, b.limit // max(1, jobs or os.cpu_count() or 1))
    return ["--max-memory", "%dK" % max(1, share >> 10)]


def interrupted_line(e: Interrupted, outdir: str) -> str:
    """One line naming exactly the models written before the signal and those not written."""
    written = [o.model.name for o in e.outcomes if o.ok]
    missing = [o.model.name for o in e.outcomes if not o.ok]
    return ("mxfuse: interrupted by %s: %d model(s) written to %s%s; %d not written%s"
            % (signal.Signals(e.signum).name, len(written), outdir, " (%s)" % ", ".join(written) if written else "",
               len(missing), " (%s)" % ", ".join(missing) if missing else ""))


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
