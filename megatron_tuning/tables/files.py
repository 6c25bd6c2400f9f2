"""Files on disk, written and read safely: atomic replace (a crash leaves the old file or the new
one), bounded reads of regular files only, JSON refused unread when it could cost too much, locks on
the file really written, and errors that name the path."""

from __future__ import annotations

import codecs
import contextlib
import errno
import json
import logging
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from typing import Any

import filelock

from ..core.errors import TableError
from .entry import Invalid

logger = logging.getLogger(__name__)

# Far above any real table (100k entries with full provenance: 12 MB of msgpack, 71 MB as a
# JSON view), small enough that a corrupt or hostile file cannot make a loader allocate much.
MAX_FILE_BYTES = 64 * 1024 * 1024
# What decoding a JSON file may cost: a genuine 100k-entry table needs ~7x its size, hostile files
# built to amplify (an array of empty arrays: 64 bytes per byte) are refused at this.
BUDGET_FACTOR = 16
BUDGET_SLACK = 128 * 1024 * 1024
LOCK_TIMEOUT_S = 300.0  # how long a read-modify-write waits for another writer of the same table

ErrorFactory = Callable[[str, str], Exception]  # (path, problem) -> TableError or another kind's error

_KINDS = {
    stat.S_IFREG: "regular file",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFIFO: "FIFO (named pipe)",
    stat.S_IFSOCK: "socket",
}


def file_kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "special file")


def _real_output(path: str) -> str:
    # A symlinked table (``current.msgpack -> v3.msgpack``) is written through, as an editor
    # would: replacing the link itself would leave the linked table unchanged.
    return os.path.realpath(path) if os.path.islink(path) else path


def write_atomic(path: str | os.PathLike[str], payload: bytes, *, error: ErrorFactory = TableError) -> None:
    """Temp file (``O_EXCL | O_NOFOLLOW``) in the same folder, fsync, ``os.replace``, fsync the folder."""
    target = os.fspath(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = stat.S_IFREG  # a new file (or a dangling symlink, written through to its target)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise error(target, "cannot write here: it is a symlink loop") from None
        mode = stat.S_IFREG  # e.g. a folder we cannot search: the write itself reports it
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise error(
            target,
            f"cannot write here: it is a {file_kind(mode)}, not a regular file "
            "(outputs must be regular files or new paths)",
        )
    dest = _real_output(target)
    folder = os.path.dirname(os.path.abspath(dest))
    tmp = os.path.join(folder, f".{os.path.basename(dest)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        # 0o666 lets the umask decide, as for any new file (mkstemp would make it owner-only).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:  # name the file the caller asked for, not our temp name
        raise OSError(exc.errno, f"cannot write {target}: {exc.strerror}") from exc
    try:
        # Replacing a file keeps its permissions (a private table must not become readable).
        with contextlib.suppress(FileNotFoundError):
            os.fchmod(fd, stat.S_IMODE(os.stat(dest).st_mode))
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.replace(tmp, dest)
        except OSError as exc:  # e.g. the target is a folder: name it, not our temp file
            raise OSError(exc.errno, f"cannot write {target}: {exc.strerror}") from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # makes the rename durable; not every filesystem allows it
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def output_file_problem(path: str) -> str | None:
    """Why ``write_atomic(path, ...)`` would fail, checked up front (a job's outputs are written
    at its end: a typo must fail at start-up); ``None`` when it should succeed."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = stat.S_IFREG
    except OSError as exc:
        return broken_link_problem(path) or f"cannot be checked ({exc.strerror or exc})"
    if stat.S_ISDIR(mode):
        return "is a folder; name a file in it"
    if not stat.S_ISREG(mode):
        return f"is a {file_kind(mode)}, not a regular file"
    folder = os.path.dirname(os.path.abspath(_real_output(path)))
    if not os.path.isdir(folder):
        return f"its folder {folder} does not exist"
    return None if os.access(folder, os.W_OK | os.X_OK) else f"its folder {folder} is not writable"


def output_folder_problem(path: str) -> str | None:
    """Why files could not be written into folder ``path`` (created if missing); ``None`` if they can."""
    current = os.path.abspath(path)
    while not os.path.exists(current) and os.path.dirname(current) != current:
        current = os.path.dirname(current)  # the nearest existing ancestor decides whether mkdir works
    if not os.path.isdir(current):
        kind = file_kind(os.stat(current).st_mode) if os.path.lexists(current) else "missing path"
        return f"{current} is a {kind}, not a folder"
    return None if os.access(current, os.W_OK | os.X_OK) else f"{current} is not writable"


def read_regular_file(
    path: str | os.PathLike[str], *, error: ErrorFactory = TableError, max_bytes: int | None = None
) -> bytes:
    """The bytes of the regular file at ``path``, at most ``max_bytes`` (default ``MAX_FILE_BYTES``);
    anything else (missing, a folder, a FIFO or device: checked before anything could block, a file
    over the limit) raises ``error(path, problem)``."""
    name = os.fspath(path)
    limit = MAX_FILE_BYTES if max_bytes is None else max_bytes
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise error(name, broken_link_problem(name) or f"cannot read ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise error(name, "is a directory, expected a table file")
        if not stat.S_ISREG(info.st_mode):
            raise error(
                name, f"is a {file_kind(info.st_mode)}, not a regular file: only regular files are read"
            )
        if info.st_size > limit:
            raise error(name, f"file is {info.st_size} bytes, over the {limit}-byte limit")
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(limit + 1)  # a hard bound even if the file grows while it is read
        if len(data) > limit:
            raise error(name, f"file grew past the {limit}-byte limit while it was read")
        return data
    except OSError as exc:
        raise error(name, f"cannot read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def broken_link_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be opened (a symlink loop, a dangling symlink, a missing file), else ``None``."""
    name = os.fspath(path)
    try:
        os.stat(name)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symlink loop (too many levels of symbolic links)"
        if exc.errno == errno.ENOENT and os.path.islink(name):
            return f"is a broken symlink (its target {os.readlink(name)!r} does not exist)"
        return "no such file" if exc.errno == errno.ENOENT else None
    return None


def json_text(data: str | bytes) -> str:
    """The text of a JSON file: strict UTF-8, no byte-order mark."""
    if isinstance(data, str):
        return data
    if data.startswith(codecs.BOM_UTF8):
        raise Invalid("starts with a byte-order mark: JSON files here are UTF-8 without one")
    if b"\x00" in data:  # valid UTF-8, but what UTF-16/32 text looks like: name the real problem
        raise Invalid("not UTF-8 (it holds NUL bytes: UTF-16 or UTF-32?); JSON files here are UTF-8")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Invalid(f"not UTF-8 (byte {exc.start}: {exc.reason}); JSON files here are UTF-8") from None


def load_json(data: str | bytes, *, per_object: int = 0, **options: Any) -> Any:
    """A JSON file's document (``Invalid`` says what is wrong), refused unread where decoding could
    need more than ``BUDGET_FACTOR`` times its size (plus ``BUDGET_SLACK``): every value but the first
    follows a ``,`` or ``:`` and every container opens with a bracket."""
    size, text = len(data), json_text(data)
    if not text.strip():
        raise Invalid("empty file")
    containers = text.count("[") + text.count("{")
    values = text.count(",") + text.count(":") + 1
    estimate = 2 * size + (80 + per_object) * containers + 96 * values  # a value: up to a ~90-byte str
    if estimate > BUDGET_FACTOR * size + BUDGET_SLACK:
        raise Invalid(
            f"decoding would need about {estimate / 2**20:.0f} MiB of memory for a {size}-byte file "
            f"(limit: {BUDGET_FACTOR}x the file size + {BUDGET_SLACK // 2**20} MiB), so it is refused "
            "unread, as a hostile file would be; split a genuine table this large into several files"
        )
    try:
        return json.loads(text, **options)
    except Invalid:
        raise
    except (ValueError, RecursionError) as exc:  # json's errors are ValueErrors
        raise Invalid(f"not valid JSON ({type(exc).__name__}: {exc})") from None


@contextlib.contextmanager
def locked(
    path: str | os.PathLike[str],
    *,
    timeout_s: float = LOCK_TIMEOUT_S,
    wait_level: int = logging.WARNING,
) -> Iterator[None]:
    """Hold ``<resolved path>.lock`` (a symlink and its target share it)."""
    name, lock_path = os.fspath(path), os.path.realpath(path) + ".lock"
    lock = filelock.FileLock(lock_path)
    try:
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            message = "waiting up to %gs for %s (held by %s) before writing %s"
            logger.log(wait_level, message, timeout_s, lock_path, describe_holders(lock_path), name)
            lock.acquire(timeout=timeout_s)
    except filelock.Timeout:
        raise TableError(
            name,
            f"timed out after {timeout_s:g}s waiting for the lock {lock_path}, held by "
            f"{describe_holders(lock_path)}: another process (tune, merge or a record-mode run) is "
            "writing this table; let it finish or stop it, then retry",
        ) from None
    except OSError:  # filelock (>= 3.20.1, CVE-2025-68146) refuses a symlinked lock file: say so
        if not os.path.islink(lock_path):
            raise  # an unwritable folder and the like
        raise TableError(
            name,
            f"the lock file {lock_path} is a symbolic link to {os.readlink(lock_path)!r}: refusing to "
            "lock through it (taking the lock would truncate the file it leads to). Remove it and retry",
        ) from None
    try:
        yield
    finally:
        lock.release()


def describe_holders(lock_path: str) -> str:
    """``pid 123`` (from ``/proc/locks``, Linux) or ``another process`` when it cannot be told."""
    try:
        st = os.stat(lock_path)
        with open("/proc/locks", encoding="ascii", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return "another process"
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    # "1: FLOCK  ADVISORY  WRITE 14765 fe:00:2148082 0 EOF" (blocked waiters have "->")
    rows = [line.split() for line in lines]
    pids = {int(f[4]) for f in rows if len(f) >= 6 and f[1] == "FLOCK" and f[5] == wanted and f[4].isdigit()}
    return ", ".join(f"pid {pid}" for pid in sorted(pids)) or "another process"
