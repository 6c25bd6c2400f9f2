"""Files on disk, written and read safely: atomic replace, bounded reads, locks, named errors.

Every persisted artefact (tables, recordings, decision logs, tuning results) is written with
``write_atomic`` and read with ``read_regular_file``; read-modify-writes hold ``locked``:

* a crash leaves the old file or the new one, never a mix;
* only regular files are read (a device, FIFO or socket would read forever or block), and
  never more than ``MAX_FILE_BYTES``; decoding one may cost at most ``budget(size)`` bytes of
  objects (the table codec charges msgpack against it as it reads, ``check_json_budget``
  checks JSON before parsing);
* an output that exists must be a regular file (``merge /dev/null ...`` must not replace a
  device node), and the temp file is created exclusively, never through a planted symlink;
* a lock is taken on the file actually written (a symlink's target), so writers using
  different names for one table still exclude each other.
"""

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

# Far above any real table (100k entries with full provenance: 18 MB of msgpack, 61 MB as a
# JSON view), small enough that a corrupt or hostile file cannot make a loader allocate much.
MAX_FILE_BYTES = 64 * 1024 * 1024
# What decoding a file may cost: a genuine 100k-entry table needs ~7x its size, hostile files
# built to amplify (an array of empty arrays: 64 bytes per byte) are refused at this.
BUDGET_FACTOR = 16
BUDGET_SLACK = 128 * 1024 * 1024

LOCK_TIMEOUT_S = 300.0
"""How long a read-modify-write waits for another writer of the same table."""

ErrorFactory = Callable[[str, str], Exception]
"""``(path, problem) -> exception``: ``TableError`` or a factory that names another kind of file"""

# Test hook: called with the temp path after it is written and fsynced, before
# ``os.replace``, so a test can SIGKILL a writer at exactly that point.
_BEFORE_REPLACE: Callable[[str], None] | None = None

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def file_kind(mode: int) -> str:
    """What ``st_mode`` describes, in words (for errors)."""
    for test, name in (
        (stat.S_ISREG, "regular file"),
        (stat.S_ISDIR, "folder"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISFIFO, "FIFO (named pipe)"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISLNK, "symlink"),
    ):
        if test(mode):
            return name
    return "special file"


def resolve_target(path: str | os.PathLike[str]) -> str:
    """The file a write to ``path`` really replaces: symlinks (of the file or its folders) resolved."""
    return os.path.realpath(os.fspath(path))


def write_atomic(path: str | os.PathLike[str], payload: bytes, *, error: ErrorFactory = TableError) -> None:
    """Temp file in the same folder, fsync, ``os.replace``, fsync the folder.

    A crash at any point leaves either the old file or the new one, never a mix. The temp
    name carries the pid and a random token and is created with ``O_EXCL | O_NOFOLLOW``, so
    concurrent writers never collide and a symlink planted at a guessed name is never
    followed; it starts with a dot and ends in ``.tmp`` so table globs (``*.msgpack``) skip
    it. An existing ``path`` that is not a regular file (a device, FIFO or socket) is refused
    with ``error(path, problem)``; a symlinked file is written through, as an editor would.
    """
    target = os.fspath(path)
    _refuse_special_output(target, error)
    # A symlinked table (``current.msgpack -> v3.msgpack``) is written through: replacing the
    # link itself would leave the linked table unchanged.
    dest = resolve_target(target) if os.path.islink(target) else target
    folder = os.path.dirname(os.path.abspath(dest))
    tmp = os.path.join(folder, f".{os.path.basename(dest)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # os.open with 0o666 lets the umask decide permissions, as for any new file (mkstemp
    # would make shared tables readable by their owner only).
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o666)
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
        if _BEFORE_REPLACE is not None:
            _BEFORE_REPLACE(tmp)
        try:
            os.replace(tmp, dest)
        except OSError as exc:  # e.g. the target is a folder: name it, not our temp file
            raise OSError(exc.errno, f"cannot write {target}: {exc.strerror}") from exc
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(folder)


def _refuse_special_output(target: str, error: ErrorFactory) -> None:
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return  # a new file (or a dangling symlink, written through to its target)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise error(target, "cannot write here: it is a symlink loop") from None
        return  # e.g. a folder we cannot search: the write itself reports it
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a folder fails at os.replace, named
        raise error(
            target,
            f"cannot write here: it is a {file_kind(mode)}, not a regular file "
            "(outputs must be regular files or new paths)",
        )


def output_file_problem(path: str) -> str | None:
    """Why ``write_atomic(path, ...)`` would fail, checked up front (a job's outputs are written
    at its end: a typo must fail at start-up); ``None`` when it should succeed."""
    if "\0" in path:
        return "contains a NUL character"
    try:
        mode: int | None = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        return broken_link_problem(path) or f"cannot be checked ({exc.strerror or exc})"
    if mode is not None and stat.S_ISDIR(mode):
        return "is a folder; name a file in it"
    if mode is not None and not stat.S_ISREG(mode):
        return f"is a {file_kind(mode)}, not a regular file"
    dest = resolve_target(path) if os.path.islink(path) else path
    folder = os.path.dirname(os.path.abspath(dest))
    if not os.path.isdir(folder):
        return f"its folder {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"its folder {folder} is not writable"
    return None


def output_folder_problem(path: str) -> str | None:
    """Why files could not be written into folder ``path`` (created if missing); ``None`` if they can."""
    if "\0" in path:
        return "contains a NUL character"
    current = os.path.abspath(path)
    while not os.path.exists(current):  # the nearest existing ancestor decides whether mkdir works
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    if not os.path.isdir(current):
        kind = file_kind(os.stat(current).st_mode) if os.path.lexists(current) else "missing path"
        return f"{current} is a {kind}, not a folder"
    if not os.access(current, os.W_OK | os.X_OK):
        return f"{current} is not writable"
    return None


def _fsync_dir(folder: str) -> None:
    # Makes the rename itself durable; not every platform/filesystem allows it.
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def read_regular_file(
    path: str | os.PathLike[str], *, error: ErrorFactory = TableError, max_bytes: int | None = None
) -> bytes:
    """The bytes of the regular file at ``path``, at most ``max_bytes`` (default ``MAX_FILE_BYTES``).

    Anything else raises ``error(path, problem)``: a missing file, a folder, a device, FIFO or
    socket (their size says 0 and a read would never end, or block), a symlink loop, a file
    over the limit. The FIFO check happens before anything could block: the file is opened
    non-blocking and checked with ``fstat`` on the open descriptor.
    """
    name = os.fspath(path)
    limit = MAX_FILE_BYTES if max_bytes is None else max_bytes
    try:
        fd = os.open(name, os.O_RDONLY | _NONBLOCK | _CLOEXEC)
    except OSError as exc:
        raise error(name, broken_link_problem(name) or f"cannot read ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        mode, size = info.st_mode, info.st_size
        if stat.S_ISDIR(mode):
            raise error(name, "is a directory, expected a table file")
        if not stat.S_ISREG(mode):
            raise error(name, f"is a {file_kind(mode)}, not a regular file: only regular files are read")
        if size > limit:
            raise error(name, f"file is {size} bytes, over the {limit}-byte limit")
        chunks, total = [], 0
        while total <= limit:  # a hard bound even if the file grows while it is read
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise error(name, f"file grew past the {limit}-byte limit while it was read")
        return b"".join(chunks)
    except OSError as exc:
        raise error(name, f"cannot read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def broken_link_problem(path: str | os.PathLike[str]) -> str | None:
    """What is wrong with ``path`` when it cannot be opened: a symlink loop, a dangling symlink, or
    a missing file; ``None`` when it can be reached."""
    name = os.fspath(path)
    try:
        os.stat(name)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symlink loop (too many levels of symbolic links)"
        if exc.errno == errno.ENOENT:
            if os.path.islink(name):
                return f"is a broken symlink (its target {os.readlink(name)!r} does not exist)"
            return "no such file"
        return None
    return None


def read_table_bytes(name: str) -> bytes:
    """A table file's bytes (``read_regular_file`` with ``TableError``)."""
    return read_regular_file(name, error=TableError)


def budget(size: int) -> int:
    """Bytes of decoded objects a file of ``size`` bytes may cost."""
    return BUDGET_FACTOR * size + BUDGET_SLACK


def over_budget(estimate: int, size: int) -> Invalid:
    return Invalid(
        f"decoding would need about {estimate / 2**20:.0f} MiB of memory for a {size}-byte file "
        f"(limit: {BUDGET_FACTOR}x the file size + {BUDGET_SLACK // 2**20} MiB), so it is refused "
        "unread, as a hostile file would be; split a genuine table this large into several files"
    )


def json_text(data: str | bytes) -> str:
    """The text of a JSON file: strict UTF-8, no byte-order mark (JSON files here are UTF-8)."""
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


def check_json_budget(text: str, *, per_object: int = 0, size: int | None = None) -> None:
    """Refuse JSON whose decoded form could need more than ``budget`` bytes, before parsing it.

    Every value but the first follows a ``,`` or ``:``, and every list or object opens with a
    bracket, so those counts bound what ``json.loads`` builds (they over-count inside strings,
    which only makes the bound safer). ``per_object`` adds what the caller builds per container
    (e.g. a table entry); ``size`` is the file's size in bytes (default: the text's length).
    """
    size = len(text) if size is None else size
    containers = text.count("[") + text.count("{")
    values = text.count(",") + text.count(":") + 1
    estimate = 2 * size + (80 + per_object) * containers + 96 * values  # a value: up to a ~90-byte str
    if estimate > budget(size):
        raise over_budget(estimate, size)


def read_json_file(path: str | os.PathLike[str], *, error: ErrorFactory, what: str) -> Any:
    """Parse the JSON file at ``path`` (a bounded ``read_regular_file``, strict UTF-8, a memory
    budget checked before parsing); any problem raises ``error(path, problem)``.

    ``what`` names the expected document in errors, e.g. ``"decision log"``.
    """
    name = os.fspath(path)
    data = read_regular_file(name, error=error)
    try:
        text = json_text(data)
        check_json_budget(text, size=len(data))
        return json.loads(text)
    except Invalid as exc:
        raise error(name, f"not a readable {what}: {exc}") from None
    except (ValueError, RecursionError) as exc:  # json errors are ValueErrors
        raise error(name, f"not a readable {what} ({type(exc).__name__}: {exc})") from None


@contextlib.contextmanager
def locked(
    path: str | os.PathLike[str],
    *,
    timeout_s: float = LOCK_TIMEOUT_S,
    error: ErrorFactory = TableError,
    wait_level: int = logging.WARNING,
) -> Iterator[str]:
    """Hold ``<resolved path>.lock`` for a read-modify-write of ``path``; yields the resolved path.

    The lock belongs to the file that is really written: ``current.msgpack -> v3.msgpack`` and
    ``v3.msgpack`` share one lock. A writer that has to wait logs who holds the lock (at
    ``wait_level``: the auto cache, where waiting for a peer is routine, logs it at INFO); after
    ``timeout_s`` it raises ``error(path, ...)`` naming the lock file and its holder.
    """
    real = resolve_target(path)
    lock_path = real + ".lock"
    check_lock_file(lock_path, os.fspath(path), error)
    lock = filelock.FileLock(lock_path)
    try:
        _acquire(lock, 0, lock_path, os.fspath(path), error)
    except filelock.Timeout:
        logger.log(
            wait_level,
            "waiting up to %gs for %s (held by %s) before writing %s",
            timeout_s,
            lock_path,
            describe_holders(lock_path),
            os.fspath(path),
        )
        try:
            _acquire(lock, timeout_s, lock_path, os.fspath(path), error)
        except filelock.Timeout:
            raise error(
                os.fspath(path),
                f"timed out after {timeout_s:g}s waiting for the lock {lock_path}, held by "
                f"{describe_holders(lock_path)}: another process (tune, merge or a record-mode "
                "run) is writing this table; let it finish or stop it, then retry",
            ) from None
    try:
        yield real
    finally:
        lock.release()


def check_lock_file(lock_path: str, path: str, error: ErrorFactory = TableError) -> None:
    """Create ``lock_path`` if needed, refusing a symlink, a hard link or anything not a regular file.

    ``filelock`` opens the lock with ``O_TRUNC``: before 3.20.1 (CVE-2025-68146) it followed a
    planted ``<table>.lock`` symlink and truncated the target (seen: 9 B -> 0 B, exit 0). Opening
    it here first with ``O_NOFOLLOW`` (and without ``O_TRUNC``) makes any filelock release safe
    against a lock path planted before the run; a file with other hard links would be truncated
    through them the same way, so it is refused too.
    """
    flags = os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC | _NONBLOCK
    try:
        try:
            fd = os.open(lock_path, flags, 0o644)
        except FileNotFoundError:  # a folder still to be made: filelock creates it too
            os.makedirs(os.path.dirname(lock_path) or ".", exist_ok=True)
            fd = os.open(lock_path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(lock_path):
            try:
                target = repr(os.readlink(lock_path))
            except OSError:  # replaced again meanwhile
                target = "another file"
            raise error(path, _planted(lock_path, f"is a symbolic link to {target}")) from None
        raise  # an unwritable folder and the like: the OSError filelock itself would raise
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode):
        what = f"is a {file_kind(st.st_mode)}, not a regular file"
        raise error(path, _planted(lock_path, what, "a lock must be an ordinary empty file"))
    if st.st_nlink > 1:
        raise error(path, _planted(lock_path, f"has {st.st_nlink} hard links (another name for one file)"))


def _planted(
    lock_path: str, what: str, why: str = "taking the lock would truncate the file it leads to"
) -> str:
    return f"the lock file {lock_path} {what}: refusing to lock through it ({why}). Remove it and retry"


def _acquire(lock: Any, timeout_s: float, lock_path: str, path: str, error: ErrorFactory) -> None:
    try:
        lock.acquire(timeout=timeout_s)
    except filelock.Timeout:
        raise
    except OSError as exc:  # e.g. ELOOP from filelock >= 3.20.1: a symlink planted since our check
        raise error(path, _planted(lock_path, f"cannot be opened ({exc.strerror or exc})")) from None


def describe_holders(lock_path: str) -> str:
    """``pid 123`` (from ``/proc/locks``, Linux) or ``another process`` when it cannot be told."""
    pids = lock_holders(lock_path)
    return ", ".join(f"pid {pid}" for pid in pids) if pids else "another process"


def lock_holders(lock_path: str) -> list[int]:
    """Pids holding an ``flock`` on ``lock_path``, read from ``/proc/locks``; ``[]`` when unknown."""
    try:
        st = os.stat(lock_path)
        with open("/proc/locks", encoding="ascii", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 14765 fe:00:2148082 0 EOF" (blocked waiters have "->")
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == wanted and fields[4].isdigit():
            pids.append(int(fields[4]))
    return sorted(set(pids))
