"""Publishing output files all at once, or not at all.

:func:`publish` writes every file of one run (the model's symbol and params,
the reports, an ONNX export) to a temporary file beside its target, and only
when all of them are written renames them into place, one after the other,
with SIGINT/SIGTERM/SIGHUP held back so that no signal lands between two
renames (the handlers take note and act after).  A failure before that
removes the temporary files; a rename that fails puts back what the earlier
renames replaced.  Other mxfuse runs publishing to the same prefix wait for
an exclusive lock (``fcntl.flock`` on ``FOLDER/.NAME.mxfuse.lock``), so a
symbol file and a params file always come from the same run.

Temporary files are named ``.mxfuse-PID-HOST-XXXXXXXX.EXT``: a later run into
the same folder removes those whose writer is dead (a SIGKILL leaves them
behind, and the ONNX exporter's ``..mxfuse-PID-HOST-*.tmp`` beside them) —
only ones of this host, whose process is gone or was started after the file
was last written (its PID reused).

:func:`check_outputs` says, before any work is done, what cannot be written:
an output that is also an input or another output, a folder, a path under a
file or a dangling symbolic link, a folder that cannot be written in.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from ..ir.errors import FusionError

TEMP_PREFIX = ".mxfuse-"          # every temporary file of an atomic write starts with it
LOCK_SUFFIX = ".mxfuse.lock"
_HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

Writer = Callable[[str], None]    # writes a file's whole content to the path it is given

# What a prompt exit (prompt_exit) must know of the files being written: this process's temporary
# files that exist now, and whether renames into place are under way (never cut short).
_LIVE_TEMPS: set = set()
_RENAMING = threading.Event()


def _host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:6]


def temp_prefix() -> str:
    """The start of this process's temporary file names: ``.mxfuse-PID-HOST-``."""
    return "%s%d-%s-" % (TEMP_PREFIX, os.getpid(), _host_tag())


# ---------------------------------------------------------------- checks before any work

def check_outputs(outputs: Sequence[Tuple[str, str]], inputs: Iterable[Optional[str]] = ()) -> None:
    """Raise FusionError when one of ``outputs`` ((what, path) pairs) cannot be written."""
    protected = {os.path.realpath(p) for p in inputs if p}
    seen: Dict[str, str] = {}
    for what, path in outputs:
        if not path or not path.strip():
            raise FusionError("%s names no file" % what)
        real = os.path.realpath(path)
        if real in protected:
            raise FusionError("refusing to write '%s' over an input file; choose another %s"
                              % (path, "-o" if what.startswith("the model") else what))
        if real in seen:
            raise FusionError("%s '%s' is also %s: choose another" % (what, path, seen[real]))
        seen[real] = what
        if os.path.isdir(path):
            raise FusionError("cannot write %s '%s': it is a folder" % (what, path))
        _check_folder(what, path)


def _check_folder(what: str, path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):            # created when the files are written
        if os.path.islink(folder):
            raise FusionError("cannot write %s '%s': '%s' is a symbolic link to nothing" % (what, path, folder))
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise FusionError("cannot write %s '%s': '%s' is a file, not a folder" % (what, path, folder))
    if not os.access(folder, os.W_OK | os.X_OK):
        reason = "read-only file system" if _read_only(folder) else "permission denied"
        raise FusionError("cannot write %s '%s': cannot create files in '%s' (%s)" % (what, path, folder, reason))


def _read_only(folder: str) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


# ---------------------------------------------------------------- stale temporary files

def remove_stale_temps(folder: str) -> List[str]:
    """Remove the temporary files in ``folder`` that a dead mxfuse process of this host left; their names."""
    tag = _host_tag()
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        if not name.startswith((TEMP_PREFIX, "." + TEMP_PREFIX)):
            continue
        # ".<temp name>.XXXX.tmp": a temporary file of the ONNX exporter, writing our temporary file
        own = name[1:] if name.startswith("." + TEMP_PREFIX) else name
        pid, _, rest = own[len(TEMP_PREFIX):].partition("-")
        if not pid.isdigit() or not rest.startswith(tag + "-") or int(pid) == os.getpid():
            continue
        path = os.path.join(folder, name)
        if _writer_alive(int(pid), path):
            continue
        try:
            if os.path.isdir(path) and not os.path.islink(path):    # a batch's staging folder
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(name)
        except OSError:
            pass
    return removed


def _writer_alive(pid: int, path: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:           # EPERM: someone else's live process
        pass
    started = _process_start_time(pid)
    try:
        written = os.lstat(path).st_mtime
    except OSError:
        return True
    # a process started after the file was last written is not its writer: the PID was reused
    return started is None or started <= written + 1.0


def _process_start_time(pid: int) -> Optional[float]:
    """When process ``pid`` started (seconds since the epoch), from /proc; None when unknown."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            boot = next(float(ln.split()[1]) for ln in f if ln.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


# ---------------------------------------------------------------- locks

def lock_path(path: str) -> str:
    """The lock file of an output: ``FOLDER/.NAME.mxfuse.lock`` (NAME: the prefix of a model file)."""
    folder, base = os.path.split(os.path.abspath(path))
    for suffix in ("-symbol.json", "-0000.params"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return os.path.join(folder, "." + base + LOCK_SUFFIX)


@contextlib.contextmanager
def _locked(paths: Iterable[str]) -> Iterator[None]:
    """Hold an exclusive flock on each lock file (taken in sorted order: no deadlock between runs)."""
    held: List[Tuple[str, int]] = []
    try:
        for path in sorted(set(paths)):
            held.append((path, _lock(path)))
        yield
    finally:
        for path, fd in reversed(held):
            # Removing the file while holding the lock is safe: a run that opened it before waits,
            # then sees that the path no longer names the file it locked, and opens the path anew.
            try:
                os.unlink(path)
            except OSError:
                pass
            os.close(fd)


def _lock(path: str) -> int:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            mine = os.fstat(fd)
            now = os.stat(path)
        except FileNotFoundError:      # removed by the run that held it: lock the new one
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            raise
        if (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino):
            return fd
        os.close(fd)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP back while files are renamed; one that arrived is acted on after.

    Python runs signal handlers in the main thread whichever thread the signal reached
    (MXNet's and OpenMP's threads do not block them), so the handlers are swapped for one
    that only takes note, rather than the signals blocked.
    """
    caught: List[int] = []
    previous: Dict[int, object] = {}
    _RENAMING.set()
    try:
        for sig in _HELD:
            handler = signal.getsignal(sig)
            if handler is not None:          # None: installed outside Python, left alone
                previous[sig] = signal.signal(sig, lambda signum, frame: caught.append(signum))
    except ValueError:                       # not the main thread: handlers cannot be changed here
        pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _RENAMING.clear()
        if caught:
            handler = previous[caught[0]]
            if callable(handler):
                handler(caught[0], None)     # e.g. raises KeyboardInterrupt now
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), caught[0])


# ---------------------------------------------------------------- publishing

def _umask_mode() -> int:
    """The mode a plain open() would give a new file (mkstemp's temporaries are 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError):
        return e.strerror or str(e)
    text = str(e).strip()
    if "Write incomplete" in text:       # MXNet's nd.save says no more (errno is lost in its C++)
        return "the write was cut short (no space left on the device, or a file size limit)"
    for line in text.splitlines():       # MXNet's errors: the line that says what failed
        if "Check failed" in line or "Error" in line:
            return line.strip()
    return text.splitlines()[-1].strip() if text else type(e).__name__


def publish(files: Sequence[Tuple[str, str, Writer]], inputs: Iterable[Optional[str]] = (),
            published: Optional[List[str]] = None) -> None:
    """Write ``files`` ((what, path, writer) triples) all at once or not at all.

    Raises FusionError (one line) when a file cannot be written; then none of them was
    changed and no temporary file is left.  ``published`` gets the paths once they are all
    in place, before a signal held back meanwhile can interrupt (a caller interrupted
    then knows that the files were written).
    """
    inputs = list(inputs)
    check_outputs([(what, path) for what, path, _ in files], inputs)
    made: List[str] = []
    temps: List[str] = []
    try:
        for _, path, _ in files:
            _make_folders(os.path.dirname(os.path.abspath(path)), made)
        for folder in {os.path.dirname(os.path.abspath(p)) for _, p, _ in files}:
            remove_stale_temps(folder)
        staged: List[Tuple[str, str, str]] = []
        for what, path, write in files:
            folder, base = os.path.split(os.path.abspath(path))
            ext = os.path.splitext(base)[1]
            try:
                fd, tmp = tempfile.mkstemp(prefix=temp_prefix(), suffix=ext, dir=folder)
                os.close(fd)
            except OSError as e:
                raise FusionError("cannot write %s '%s': %s" % (what, path, _describe(e))) from None
            temps.append(tmp)
            _LIVE_TEMPS.add(tmp)
            try:
                write(tmp)
                _sync(tmp)
                os.chmod(tmp, _umask_mode())
            except Exception as e:        # OSError (disk full, file too large), MXNetError from nd.save
                if not (isinstance(e, OSError) or type(e).__name__ == "MXNetError"):
                    raise
                raise FusionError("cannot write %s '%s': %s" % (what, path, _describe(e))) from None
            staged.append((what, tmp, path))
        with _locked(lock_path(p) for _, p, _ in files):
            with _signals_held():
                _rename_all(staged)
                _LIVE_TEMPS.difference_update(temps)
                temps.clear()
                made.clear()
                if published is not None:
                    published.extend(p for _, p, _ in files)
    finally:
        for tmp in temps:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            _LIVE_TEMPS.discard(tmp)
        for folder in reversed(made):       # folders made for files that were not written
            try:
                os.rmdir(folder)
            except OSError:
                pass


def _make_folders(folder: str, made: List[str]) -> None:
    missing = []
    while not os.path.isdir(folder):
        missing.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    for f in reversed(missing):
        try:
            os.mkdir(f)
        except FileExistsError:
            if not os.path.isdir(f):
                raise FusionError("cannot create folder '%s': a file has that name" % f) from None
            continue
        except OSError as e:
            raise FusionError("cannot create folder '%s': %s" % (f, _describe(e))) from None
        made.append(f)


def _sync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename_all(staged: Sequence[Tuple[str, str, str]]) -> None:
    """Rename each temporary file onto its target; on a failure put back what was replaced."""
    done: List[Tuple[str, Optional[str]]] = []       # (target, backup of what it replaced)
    try:
        for what, tmp, path in staged:
            backup = None
            if os.path.lexists(path):
                folder = os.path.dirname(os.path.abspath(path))
                backup = os.path.join(folder, temp_prefix() + "old-" + os.path.basename(tmp)[len(temp_prefix()):])
                try:
                    os.link(path, backup, follow_symlinks=False)
                except OSError:
                    backup = None          # no hard links here: the old file cannot be put back
            try:
                os.replace(tmp, path)
            except OSError as e:
                if backup:
                    _unlink(backup)
                raise FusionError("cannot write %s '%s': %s" % (what, path, _describe(e))) from None
            done.append((path, backup))
    except BaseException:
        for path, backup in reversed(done):
            try:
                if backup:
                    os.replace(backup, path)
                else:
                    os.unlink(path)
            except OSError:
                pass
        raise
    finally:
        for _, backup in done:
            if backup:
                _unlink(backup)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# ---------------------------------------------------------------- ending promptly on a signal

def track_temp(path: str, live: bool = True) -> None:
    """Count ``path`` (a temporary file of this run made outside :func:`publish`, e.g. an ONNX export
    staged beside its target) among those a prompt exit removes; ``live=False`` once it is gone."""
    if live:
        _LIVE_TEMPS.add(path)
    else:
        _LIVE_TEMPS.discard(path)


@contextlib.contextmanager
def prompt_exit(grace: float, last_words: Callable[[int], str]) -> Iterator[None]:
    """End the process within ``grace`` seconds of SIGINT/SIGTERM/SIGHUP, whatever the main thread does.

    Python runs a signal handler only when the main thread comes back to the interpreter; inside one
    long native call (MXNet running a large graph) that can take many seconds.  CPython's own C handler
    writes the signal's number to the wakeup fd at once, so a thread waiting on it learns of the signal
    then: it gives the main thread ``grace`` seconds to unwind (the handlers raise, the caller cleans up
    and leaves this block), and past that removes this run's temporary files, prints
    ``last_words(signum)`` on stderr and ends the process with status 128 + signum.  Renames into place
    (``publish``) are never cut short: the thread waits for them.  Only in the main thread (elsewhere, and
    where the wakeup fd is taken, a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(r)
        os.close(w)
        yield
        return
    left = threading.Event()

    def watch() -> None:
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if not data or left.is_set():
                return
            signum = data[0]
            if signum not in _HELD:
                continue
            deadline = time.monotonic() + grace
            while not left.wait(0.02):
                if _RENAMING.is_set():        # files going into place: let them all
                    deadline = time.monotonic() + grace
                    continue
                if time.monotonic() >= deadline:
                    for tmp in list(_LIVE_TEMPS):
                        try:
                            os.unlink(tmp)
                        except OSError:
                            pass
                    try:
                        sys.stderr.write(last_words(signum) + "\n")
                        sys.stderr.flush()
                    finally:
                        os._exit(128 + signum)
            return

    watcher = threading.Thread(target=watch, name="mxfuse-prompt-exit", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        left.set()
        signal.set_wakeup_fd(previous)
        os.close(w)              # wakes the watcher (end of file) if it still waits
        watcher.join(timeout=1.0)
        os.close(r)
