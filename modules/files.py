"""The project's files: torch and text files written atomically and read with one clear error
when unreadable, and the run's timestamped log."""
from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import re
import secrets
import shutil
import socket
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import torch

from modules import distributed
from modules.config import UserError, first_line

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
try:
    import msvcrt
except ImportError:  # POSIX
    msvcrt = None

log = logging.getLogger(__name__)


def atomic_torch_save(payload: dict, path: Path) -> None:
    """Readers see the old file or the complete new one, never a half-written one."""
    _atomic_write(Path(path), lambda f: torch.save(payload, f))


def atomic_write_text(text: str, path: Path) -> None:
    """The same guarantee for a text file (results.json), in UTF-8: a file name that is not
    UTF-8 (zips made on Windows) is written with escapes, not a UnicodeEncodeError."""
    _atomic_write(Path(path), lambda f: f.write(text.encode("utf-8", "backslashreplace")))


def atomic_save_figure(fig, path: Path, **kwargs) -> None:
    """The same guarantee for a matplotlib chart, in the format its name ends with."""
    path = Path(path)
    _atomic_write(path, lambda f: fig.savefig(f, format=path.suffix[1:] or "png", **kwargs))


def atomic_copy(source: Path, path: Path) -> None:
    """A copy of `source` at `path`, written as every file here is: whole or not at all."""
    with open(source, "rb") as src:
        _atomic_write(Path(path), lambda f: shutil.copyfileobj(src, f))


def share_file(source: Path, path: Path) -> None:
    """`path` gets `source`'s content: a hard link where the file system allows one (every
    writer here replaces a file atomically, so a later write to either path leaves the other
    as it was), else a copy written as every file here is (Google Drive's folder in Colab has
    no hard links); either appears at `path` whole."""
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.link")
    try:
        os.link(source, temp)
    except OSError:
        atomic_copy(source, path)
        return
    try:
        os.replace(temp, path)
    finally:
        # rename() between two links to one file does nothing and succeeds: `path` already
        # was `source` (a resumed run shares it again), and `temp` would stay behind.
        temp.unlink(missing_ok=True)


def _atomic_write(path: Path, write) -> None:
    if path.is_dir():
        raise UserError(f"{str(path)!r} is a directory; give a file name.")
    try:  # a parent that is a file is one line too, as a full disk is
        path.parent.mkdir(parents=True, exist_ok=True)
        # Same directory: os.replace is only atomic within one filesystem.
        fd, tmp = _create_temp(path)
    except OSError as exc:
        raise write_error(path, exc) from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        # torch.save's RuntimeError ("unexpected pos") carries the OSError it met in its
        # chain; else the free space says, looked at before the partial file frees it.
        # Ctrl-C (the notebook's Stop) in torch.save's writer arrives as such a RuntimeError
        # too: it stays an interrupt, which ends the run with the resume hint.
        interrupted = isinstance(exc, KeyboardInterrupt) or (
            isinstance(exc, RuntimeError) and _in_chain(exc, KeyboardInterrupt) is not None)
        cause = None if interrupted else _in_chain(exc, OSError)
        full = cause is None and not interrupted and isinstance(exc, RuntimeError) and \
            disk_full(path.parent)
        Path(tmp).unlink(missing_ok=True)  # the previous file, if any, is untouched
        if interrupted and not isinstance(exc, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        if cause is not None or full:
            raise write_error(path, cause or exc) from None
        raise
    _fsync_dir(path.parent)


def _in_chain(exc: BaseException | None, kind: type[BaseException]) -> BaseException | None:
    """The exception of `kind` that `exc` is or was raised from (torch.save wraps an OSError,
    or a KeyboardInterrupt, in a RuntimeError)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new empty file beside `path`, opened for writing. Created with mode 0o666 as open()
    does, so the umask (and a default ACL) decide its permissions; mkstemp's 0o600 would
    leave results unreadable to the group whatever the umask."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:  # O_EXCL: never an existing file, nor a link planted under the name
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                           | getattr(os, "O_BINARY", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary file name", str(path.parent))


def kept_file(recorded: str | os.PathLike | None, folder: Path | None) -> Path | None:
    """A file recorded by its path when it was written into `folder` (a run's checkpoints
    folder), where it is now: the output dir may have moved since (Drive mounted elsewhere, a
    relative --output-dir given from another directory), or been copied, when the file in
    the copy is this run's and the recorded one another folder's. None when it is in neither
    place."""
    if not recorded:
        return None
    path = Path(recorded)
    here = Path(folder) / path.name if folder is not None else None
    # a file of the run's folder (named by the run) in a copy of the output dir, or moved
    if here is not None and here.exists() and \
            (path.parent.name == here.parent.name or not path.exists()):
        return here
    return path if path.exists() else None


def disk_full(folder: Path) -> bool:
    """Whether the filesystem holding `folder` is (nearly) out of space. torch.save reports a
    full disk as a RuntimeError ("file write failed") without the errno, hence the check."""
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return False
    return usage.free < min(64 * 2**20, 0.01 * usage.total) or usage.free < 2**20


# The folders the user named, each with the option that names it, so that a failed write
# tells the user which option to change (a file elsewhere, such as a download cache, names none).
_NAMED_FOLDERS: dict[Path, str] = {}


def resolved(option: str, path: str | Path) -> Path:
    """Path(path), user and links resolved; a link loop on the way is one line naming
    `option`, not Python's RuntimeError."""
    try:
        return Path(path).expanduser().resolve()
    except (OSError, RuntimeError) as exc:
        raise UserError(f"cannot follow {option} {str(path)!r} ({first_line(exc)}).") from None


def name_folder(folder: Path | str, option: str) -> None:
    """Writes under `folder` are the user's `option` (--output-dir, --local-dir)."""
    _NAMED_FOLDERS[Path(folder).expanduser().resolve()] = option


def _option_for(path: Path | str | None) -> str | None:
    """The option naming the innermost registered folder that holds `path`; --output-dir
    when the failing call did not name its file."""
    if path is None:
        return "--output-dir"
    try:
        where = Path(path).expanduser().resolve()
    except (OSError, RuntimeError):
        return None
    holding = [f for f in _NAMED_FOLDERS if where == f or where.is_relative_to(f)]
    return _NAMED_FOLDERS[max(holding, key=lambda f: len(f.parts))] if holding else None


def write_error(path: Path | str | None, exc: BaseException,
                in_run: bool | None = None) -> UserError:
    """One line for a write that failed: a full disk, a read-only or forbidden folder. `path`
    None: the failing call did not name its file. in_run: whether a run failed (its hint is
    --resume); None: a run's when the file is in its --output-dir or --local-dir (else a
    library call's, save_model to a file of the user's)."""
    code = getattr(exc, "errno", None)
    where = "the output folder" if path is None else repr(str(path))
    option = _option_for(path)
    if in_run is None:
        in_run = option is not None or path is None
    then = "then rerun (with --resume to continue; what was written before stays intact)." \
        if in_run else "then try again."
    # torch.save's RuntimeError has no errno: only then is a nearly full disk the guess (a
    # read-only or forbidden folder may report no free space at all).
    forbidden = code in (errno.EACCES, errno.EPERM, errno.EROFS)
    if code in (errno.ENOSPC, errno.EDQUOT) or (
            not forbidden and path is not None and disk_full(Path(path).parent)):
        other = f" or pass {option} on another disk" if option else ""
        return UserError(f"no space left on the device holding {where}; free some "
                         f"space{other}, {then}")
    reason = getattr(exc, "strerror", None) or first_line(exc, limit=1000)
    if code in (errno.ENOTDIR, errno.EEXIST):
        return UserError(f"cannot write {where} ({reason}): a file stands where a folder of "
                         f"that path is to be; move it{f' or pass another {option}' if option else ''}"
                         f", {then}")
    if code in (errno.ENAMETOOLONG, errno.ELOOP):
        fix = "a name the file system can hold" if code == errno.ENAMETOOLONG else \
            "a path without a link loop"
        other = f"; pass {option} with {fix}," if option else f"; use {fix},"
        return UserError(f"cannot write {where} ({reason}){other} {then}")
    if code in (errno.EACCES, errno.EPERM):
        other = f" or pass another {option}" if option else ""
        return UserError(f"cannot write {where} ({reason}); fix its permissions{other}, {then}")
    if code in (errno.EMFILE, errno.ENFILE):  # the folder is fine: the process's limit is not
        return UserError(f"cannot write {where} ({reason}): the open-file limit is too low "
                         f"(ulimit -n shows it); raise it, ulimit -n 4096, {then}")
    if code == errno.EFBIG:
        other = f", or pass {option} on another file system" if option else ""
        return UserError(f"cannot write {where} ({reason}): larger than the file-size limit "
                         f"(ulimit -f) or the file system allows (FAT32: 4 GB){other}; {then}")
    other = f"; pass a writable {option}," if option else "; make its folder writable,"
    return UserError(f"cannot write {where} ({reason}){other} {then}")


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not possible on every OS/filesystem, hence best effort.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class ReadFailed(UserError):
    """A file that could not be read now (an I/O error on a network drive, no permission, no
    memory): not proof that it is damaged, so nothing should set it aside or replace it."""


# The disk or network drive failed the read or write (a Google Drive mount's hiccup): not the
# file's fault, nor proof that it is missing or damaged.
IO_FAILED = tuple(code for code in (errno.EIO, errno.ETIMEDOUT, errno.ESTALE, errno.ENOTCONN,
                                    getattr(errno, "EREMOTEIO", None)) if code is not None)


def io_failed(path: Path | str | None, exc: BaseException) -> ReadFailed | None:
    """The one line for an I/O error of the disk or drive (IO_FAILED); None for any other
    error. A caller that reads a file it may do without raises this rather than going on as
    if the file were missing: a resume would train again, or count, what it holds."""
    if getattr(exc, "errno", None) not in IO_FAILED:
        return None
    what = "a file of the run" if path is None else repr(str(path))
    return ReadFailed(f"could not read or write {what} ({exc.strerror or 'I/O error'}): the "
                      f"disk or network drive failed; check it, {RESUME}")


def read_torch_file(path: Path, what: str, remedy: str = "") -> Any:
    """torch.load without code execution (weights_only); `what` names the file in errors, and
    `remedy` says what to do with one that is not readable."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{str(path)!r} is a folder, not a {what}.")
    if not path.is_file():
        raise UserError(f"no such {what} {str(path)!r}.")
    then = f"; {remedy}" if remedy else ""
    try:
        damaged = _damaged_entry(path)
        if damaged is not None:  # torch.load reads a zip without its checksums
            raise UserError(f"{what} {str(path)!r} is damaged: {damaged} in it does not match "
                            f"its checksum (a bad copy or disk?){then}.")
        # torchvision's reference scripts save their argparse options beside the model
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, MemoryError) as exc:
        # A zip cut short within its first 64 KiB: torch's reader seeks before the file's start
        # to find the central directory, and Python's file says EINVAL; not the disk's failure.
        if not (isinstance(exc, OSError) and exc.errno not in IO_FAILED and _cut_zip(path)):
            raise ReadFailed(f"could not read {what} {str(path)!r} ({_error_name(exc)}).") \
                from None
        raise UserError(f"{what} {str(path)!r} is cut short (an incomplete copy or "
                        f"download?){then}.") from None
    except UserError:
        raise
    except Exception as exc:
        # torch's own refusal, which it also gives a file that is no pickle at all (a JPEG)
        pickled = "weights only load failed" in str(exc).lower() and _torch_magic(path)
        cut = _cut_zip(path)
        raise UserError(f"{what} {str(path)!r} is " + (
            "cut short (an incomplete copy or download?)" if cut else
            "empty" if path.stat().st_size == 0 else
            f"not a readable PyTorch file ({type(exc).__name__}" + (
                ": it holds pickled Python objects, which are not run for safety; a whole "
                "model saved with torch.save(model)? save model.state_dict() instead"
                if pickled else "") + ")") + f"{then}.") from None


def _damaged_entry(path: Path) -> str | None:
    """The first entry of a zip file (torch.save's format) whose data does not match its
    stored CRC-32, or None (also for a file that is no whole zip: torch.load says why)."""
    if not zipfile.is_zipfile(path):
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip()
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError):
        return None


ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6


def _cut_zip(path: Path) -> bool:
    """Whether the file starts as torch.save's zip does and is no whole zip."""
    return _head(path) == ZIP_MAGIC and not zipfile.is_zipfile(path)


def _head(path: Path) -> bytes:
    """The file's first 4 bytes (none where it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except OSError:
        return b""


def _torch_magic(path: Path) -> bool:
    """Whether the file starts as torch.save writes: a zip archive, or (before torch 1.6) a
    pickle's protocol mark."""
    head = _head(path)
    return head == ZIP_MAGIC or head[:1] == b"\x80"


def _error_name(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc.strerror}" if getattr(exc, "strerror", None) \
        else type(exc).__name__


class _RunLog(logging.FileHandler):
    def handleError(self, record: logging.LogRecord) -> None:
        """A full or vanished disk must not print logging's traceback on the console; the
        run's own writes say what is wrong, in one line."""


@contextlib.contextmanager
def folder_lock(folder: Path, probe: bool = False):
    """Holds folder/.lock while a run writes there: a second run into the same folder (two
    --resume of one interrupted run, say) stops with one line instead of training the same
    again beside it. Where the filesystem has no locks (some network drives), runs unguarded.
    `probe`: only the refusal (refuse_if_in_use), the lock released at once."""
    # The run is yielded to outside every except block: inside one, any error of the run
    # would carry the lock's as its context ("No locks available ... During handling").
    try:
        handle = open(Path(folder) / ".lock", "a+")
    except OSError:  # an unwritable folder is reported elsewhere
        handle = None
    if handle is None:
        yield
        return
    with handle:
        locked = _lock(handle)
        if locked is False:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise UserError(f"another run is writing to {str(folder)!r} ({holder}): wait "
                            "for it to end, or give this one another --output-dir.")
        if probe:
            if locked:
                _unlock(handle)
            yield
            return
        try:
            if locked:
                handle.truncate(0)
                handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
                handle.flush()
            # Killed writes' leftovers go either way: a lost Colab VM's are on Drive, where
            # there may be no locks (sweep_unfinished_writes takes only those older than a
            # run's write could be).
            sweep_unfinished_writes(Path(folder))
            yield
        finally:
            if locked:
                _unlock(handle)


def refuse_if_in_use(folder: Path) -> None:
    """folder_lock's refusal, before the run reads or makes its data: a second run into a
    folder in use generated the synthetic set into it (where the first had kept it on
    --local-dir) before the lock refused it. Not to be called while this process holds the
    lock: closing the probe's handle would release a POSIX lock."""
    if (Path(folder) / ".lock").exists():
        with folder_lock(folder, probe=True):
            pass


# Windows' locks are mandatory: the byte locked lies past the holder's line, which a second
# run reads to name it.
WINDOWS_LOCK_OFFSET = 2**30


def _lock(handle) -> bool | None:
    """True: this process now holds the lock of `handle`'s file; False: another process
    holds it; None: this filesystem has no locks."""
    if fcntl is not None:
        try:
            # A POSIX record lock belongs to this process: DataLoader workers forked during
            # the run do not inherit it (a flock would outlive a failed notebook cell in them).
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            return False if exc.errno in (errno.EACCES, errno.EAGAIN) else None
    if msvcrt is not None:
        os.lseek(handle.fileno(), WINDOWS_LOCK_OFFSET, os.SEEK_SET)
        try:
            msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
            return True
        except OSError as exc:
            return False if exc.errno in (errno.EACCES, errno.EDEADLOCK) else None
        finally:
            handle.seek(0)
    return None


def _unlock(handle) -> None:
    """Windows asks for its locks to be released before the file is closed (POSIX's go with
    the close)."""
    if fcntl is None and msvcrt is not None:
        os.lseek(handle.fileno(), WINDOWS_LOCK_OFFSET, os.SEEK_SET)
        with contextlib.suppress(OSError):
            msvcrt.locking(handle.fileno(), msvcrt.LK_UNLCK, 1)


# _create_temp's, share_file's; Kineto's trace (profiler.PARTIAL_TRACE)
UNFINISHED = re.compile(r"^(\..+\.[0-9a-f]{8}\.(tmp|link)|.+\.pt\.trace\.json\.tmp)$")
UNFINISHED_AFTER_S = 600.0  # no write takes this long; a younger file may be a live writer's


def sweep_unfinished_writes(folder: Path) -> None:
    """Delete the temporary files of writes a kill cut short (no except block ran), a whole
    checkpoint's size each, under `folder` while its lock is held (no run of ours writes there
    meanwhile), or where it has no locks, unguarded: only those older than a write takes. The
    generated data and anything of the user's is left alone."""
    removed, size = 0, 0
    now = time.time()
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not (Path(root) == folder and d == "data")]
        for name in files:
            if not UNFINISHED.match(name):
                continue
            path = Path(root) / name
            try:
                stat = path.lstat()
                if now - stat.st_mtime < UNFINISHED_AFTER_S:
                    continue
                path.unlink()
            except OSError:
                continue
            removed, size = removed + 1, size + stat.st_size
    if removed:
        log.info("removed %d unfinished write(s) an interrupted run left in %s (%.0f MB)",
                 removed, folder, size / 2**20)


class Said(logging.Handler):
    """The records a logger and its children log at `level` or above while this is open
    (`.records`), as well as where they go: what a run said before its run_log opened."""

    def __init__(self, logger: str, level: int = logging.WARNING):
        super().__init__(level)
        self.records: list[logging.LogRecord] = []
        self._logger = logging.getLogger(logger)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> "Said":
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)


@contextlib.contextmanager
def run_log(path: Path, preamble: list[str | logging.LogRecord] = ()):
    """While it is open, every log line also goes to `path` with its wall-clock time (appended:
    a resumed run continues the same file), so the log says where a run's time went.
    `preamble`: lines said before the file could be opened (the data's), or the records
    logged then (said), written first, to the file only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = _RunLog(path, encoding="utf-8", errors="backslashreplace", delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for line in preamble:
        handler.handle(line if isinstance(line, logging.LogRecord) else logging.LogRecord(
            "modules.dataset", logging.INFO, __file__, 0, line, None, None))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield path
    except BaseException as exc:  # said on the console after the log closes: here too
        handler.handle(logging.LogRecord("pipeline", logging.ERROR, __file__, 0,
                                         ended_by(exc), None, None))
        raise
    finally:
        root.removeHandler(handler)
        handler.close()


# A folder or disk the run cannot write to: the user's to fix, not a bug.
# ENOTDIR, EEXIST: a file where a folder of the output is to be made.
# ENAMETOOLONG, ELOOP: a path the system cannot hold or follow.
UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT,
              errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP)


# A limit of the machine or its container that a run met, by a piece of the error's text
# (torch's, the DataLoader's, Python's: raised in a worker too), and what to change.
RESUME = "then rerun with --resume to continue (what was written before stays intact)."
THREADS = ("the system refused the run a new thread (a limit on processes and threads, ulimit "
           f"-u): raise it, or pass --num-workers 0; {RESUME}")
MACHINE_LIMITS = (
    ("unable to allocate shared memory", "the DataLoader workers ran out of shared memory "
     "(/dev/shm is full: a Docker container has 64 MB unless --shm-size gives it more); pass "
     f"--num-workers 0, or give /dev/shm more space; {RESUME}"),
    ("Too many open files", "the open-file limit is too low for this run (ulimit -n shows it): "
     f"raise it, ulimit -n 4096, or pass --num-workers 0; {RESUME}"),
    ("can't allocate memory", "out of memory: the process could not allocate a buffer, under "
     "the machine's memory or a limit on the process (ulimit -v, a container's); lower "
     f"--batch-size or --image-size, or free or allow more memory; {RESUME}"),
    ("can't start new thread", THREADS),  # Python's
    ("Thread creation failed", THREADS),  # libgomp's
)


def compile_failure(message: str) -> str:
    """torch.compile's failure as said, a full disk with where its kernels go: TMPDIR, not the
    output folder a user would look at."""
    if "No space left" not in message:
        return message
    where = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or tempfile.gettempdir()
    return f"{message}; it writes its kernels under {where} (TORCHINDUCTOR_CACHE_DIR or TMPDIR)"


def user_error(exc: BaseException) -> str | None:
    """The one line for a mistake of the user's (a UserError, a folder the run cannot write)
    or a limit of the machine the run met (MACHINE_LIMITS); None for anything else, a bug that
    keeps its traceback."""
    if isinstance(exc, UserError):
        return worker_free(str(exc), exc)
    if (failed := io_failed(getattr(exc, "filename", None), exc)) is not None:
        return str(failed)
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM) and \
            exc.filename is not None and os.path.isfile(exc.filename) and \
            not os.access(exc.filename, os.R_OK):
        # a read refused (a results.json a Docker run left root's), not a write
        return (f"cannot read {str(exc.filename)!r} ({exc.strerror}): fix its permissions "
                f"(a file another user made?), {RESUME}")
    if isinstance(exc, OSError) and exc.errno in UNWRITABLE:
        return str(write_error(exc.filename, exc, in_run=True))
    if isinstance(exc, (OSError, RuntimeError, MemoryError)):
        text = str(exc)
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            text = "Too many open files"
        return next((line for piece, line in MACHINE_LIMITS if piece in text), None)
    return None


def worker_free(message: str, exc: BaseException) -> str:
    """A UserError raised in a DataLoader worker comes back with the worker's traceback in its
    message ("Caught UserError in DataLoader worker process 0. Original Traceback ..."): its
    own line is the last."""
    if not (message.startswith("Caught ") and "Original Traceback" in message):
        return message
    last = message.rstrip().splitlines()[-1]
    for cls in type(exc).__mro__:
        for name in (f"{cls.__module__}.{cls.__qualname__}: ", f"{cls.__qualname__}: "):
            if last.startswith(name):
                return last[len(name):]
    return last


def ended_by(exc: BaseException) -> str:
    """run.log's last line for a session an exception ended: a reader of the log (or of a
    resumed run's, appended) tells an interrupt from a refusal from a crash."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (Ctrl-C or Stop): --resume continues the run from its checkpoints"
    said = user_error(exc)  # the console's line
    if said is not None:
        return f"stopped: {said}"
    if isinstance(exc, RuntimeError) and distributed.peer_left(exc):
        return "stopped: another process of this run stopped (its own log says why)"
    return f"stopped by an error ({type(exc).__name__}: {first_line(exc)}); the console has " \
        "its traceback"
