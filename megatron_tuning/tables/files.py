"""Files on disk, written and read safely: atomic replace, bounded reads, named errors.

Every persisted artefact (tables, recordings, decision logs, tuning results) goes through
``write_atomic``: a crash leaves the old file or the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from ..core.errors import TableError

# Far above any real table, small enough that a corrupt or hostile file cannot make the
# loader allocate without bound.
MAX_FILE_BYTES = 512 * 1024 * 1024

# Test hook: called with the temp path after it is written and fsynced, before
# ``os.replace``, so a test can SIGKILL a writer at exactly that point.
_BEFORE_REPLACE: Callable[[str], None] | None = None


def write_atomic(path: str | os.PathLike[str], payload: bytes) -> None:
    """Temp file in the same folder, fsync, ``os.replace``, fsync the folder.

    A crash at any point leaves either the old file or the new one, never a mix. The
    temp name carries the pid and a random token so concurrent writers never collide,
    and starts with a dot and ends in ``.tmp`` so table globs (``*.msgpack``) skip it.
    """
    target = os.fspath(path)
    # A symlinked table (``current.msgpack -> v3.msgpack``) is written through, as an
    # editor would: replacing the link itself would leave the linked table unchanged.
    dest = os.path.realpath(target) if os.path.islink(target) else target
    folder = os.path.dirname(os.path.abspath(dest))
    tmp = os.path.join(folder, f".{os.path.basename(dest)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # os.open with 0o666 lets the umask decide permissions, as for any new file (mkstemp
    # would make shared tables readable by their owner only).
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
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


def read_table_bytes(name: str) -> bytes:
    try:
        size = os.path.getsize(name)
        if size > MAX_FILE_BYTES:
            raise TableError(name, f"file is {size} bytes, over the {MAX_FILE_BYTES}-byte limit")
        return Path(name).read_bytes()
    except FileNotFoundError:
        raise TableError(name, "no such file") from None
    except IsADirectoryError:
        raise TableError(name, "is a directory, expected a table file") from None
    except OSError as exc:
        raise TableError(name, f"cannot read ({exc.strerror or exc})") from None
