"""Progress of one ``mxfuse`` run on stderr: each stage (fusing, verifying, benchmarking) named with its
elapsed seconds, so that a minute spent on a BERT is not a minute of silence.

On a terminal the current stage is one line redrawn in place every second and each finished stage
stays as a line; with ``--verbose`` (on a pipe, a log) one line when a stage starts and one when it
ends.  Otherwise — a pipe without ``--verbose``, ``--quiet``, a batch worker — nothing at all.

    with progress.session(verbose=args.verbose, quiet=args.quiet):
        with progress.stage("fusing"):
            ...
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import IO, Any, Iterator, List, Mapping, Optional


class Stages:
    """Writes the stages of one run to ``stream`` (see the module's docstring for when and how)."""

    def __init__(self, stream: IO[str], tty: bool, interval: float = 1.0):
        self.stream, self.tty, self.interval = stream, tty, interval
        self.start = time.perf_counter()
        self._lock = threading.Lock()
        self._current: Optional[str] = None
        self._since = 0.0
        self._width = 0
        self._wake = threading.Event()
        self._ticker: Optional[threading.Thread] = None

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):      # a closed or broken stderr costs the run nothing
            pass

    def _redraw(self) -> None:
        with self._lock:
            if self._current is None:
                return
            line = "mxfuse: %s... %.0f s" % (self._current, time.perf_counter() - self._since)
            self._write("\r" + line.ljust(self._width))
            self._width = len(line)

    def _tick(self) -> None:
        while not self._wake.wait(self.interval):
            self._redraw()

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self._current, self._since = name, time.perf_counter()
        if self.tty:
            self._redraw()
            self._wake.clear()
            self._ticker = threading.Thread(target=self._tick, name="mxfuse-progress", daemon=True)
            self._ticker.start()
        else:
            self._write("mxfuse: %s...\n" % name)
        ok = False
        try:
            yield
            ok = True
        finally:
            if self._ticker is not None:
                self._wake.set()
                self._ticker.join()
                self._ticker = None
            now = time.perf_counter()
            line = "mxfuse: %s %s in %.1f s (%.1f s in all%s)" % (
                name, "done" if ok else "stopped", now - self._since, now - self.start, _peak_memory())
            with self._lock:
                self._current = None
                self._write(("\r" + line.ljust(self._width) if self.tty else line) + "\n")
                self._width = 0


def _peak_memory() -> str:
    """"; peak memory so far 1.2 GiB": the process's peak resident memory (VmHWM), where the system says."""
    from ..engine.memory import fmt_bytes

    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return ""
    return "; peak memory so far %s" % fmt_bytes(kib * 1024)


_active: List[Stages] = []


def message(line: str, stream: Optional[IO[str]] = None) -> None:
    """Write ``line`` to stderr (or ``stream``) so that a stage line being redrawn on a terminal stays whole."""
    stages = _active[-1] if _active else None
    if stages is None or not stages.tty or (stream is not None and stream is not stages.stream):
        print(line, file=stream if stream is not None else sys.stderr)
        return
    with stages._lock:
        stages._write("\r" + line.ljust(stages._width) + "\n")
        stages._width = 0
    stages._redraw()


def _is_tty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


@contextlib.contextmanager
def session(verbose: bool = False, quiet: bool = False, stream: Optional[IO[str]] = None) -> Iterator[None]:
    """Show the stages run inside this block: on a terminal, or anywhere with ``verbose``; never when ``quiet``."""
    stream = stream if stream is not None else sys.stderr
    tty = _is_tty(stream)
    if quiet or not (tty or verbose):
        yield
        return
    _active.append(Stages(stream, tty))
    try:
        yield
    finally:
        _active.pop()


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """One stage of the run (a no-op outside a :func:`session` that shows progress)."""
    if not _active:
        yield
        return
    with _active[-1].stage(name):
        yield


def benchmark_warnings(b: Mapping[str, Any], stream: Optional[IO[str]] = None) -> None:
    """Each benchmark warning as one ``mxfuse: warning:`` line on stderr."""
    for w in b.get("warnings", ()):
        message("mxfuse: warning: " + w, stream)
