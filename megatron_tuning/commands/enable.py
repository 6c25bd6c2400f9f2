"""``python -m megatron_tuning enable`` / ``disable``: the environment switch, for processes you
do not launch yourself (an evaluation service, a notebook kernel, a pipeline's workers).

``enable`` writes one ``.pth`` file into this interpreter's site-packages (or ``--site-dir``).
Python runs it at the start of every process of that environment. With ``MEGATRON_TUNING_MODE``
unset it does nothing but read that one variable; with it set (``MEGATRON_TUNING_MODE=deterministic
python eval.py``) it arms the process as ``run`` does: at the process's ``import triton``, never
earlier, so no process imports torch or Triton because of it. ``disable`` removes the file.

Both are idempotent and print what they did. A folder that cannot be written, or a file of our
name that we did not write, is refused with a message (exit 2), never overwritten.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
from pathlib import Path

from ..tables.files import output_folder_problem, write_atomic
from .bootstrap import PTH_MARKER, PTH_NAME, is_site_dir, pth_text
from .launch import EXIT_USAGE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``enable`` and ``disable``."""
    parser.epilog = (
        "enable writes megatron_tuning_enable.pth into site-packages; disable removes it. In between, "
        "a process of this environment is armed when MEGATRON_TUNING_MODE is set. See docs/launcher.md."
    )
    parser.add_argument(
        "--site-dir",
        default=None,
        metavar="DIR",
        help=f"the site-packages folder to use (default: this interpreter's, {default_site_dir()})",
    )


def default_site_dir() -> str:
    """This interpreter's site-packages (a virtualenv's own when run from one)."""
    return sysconfig.get_path("purelib")


def run_enable(args: argparse.Namespace) -> int:
    folder = _site_dir(args)
    problem = _folder_problem(folder)
    if problem:
        print(f"enable: {problem}", file=sys.stderr)
        return EXIT_USAGE
    path = folder / PTH_NAME
    text = pth_text(str(path))
    current = _read(path)
    if current is not None and not current.startswith(PTH_MARKER):
        print(f"enable: {path} exists and was not written by megatron_tuning; left alone", file=sys.stderr)
        return EXIT_USAGE
    if current == text:
        print(f"megatron_tuning is already enabled: {path} (unchanged)")
    else:
        write_atomic(path, text.encode("utf-8"))
        print(f"{'updated' if current is not None else 'wrote'} {path}")
    print(
        "Every Python process of this environment now pins Triton autotuning when MEGATRON_TUNING_MODE "
        "is set, e.g.\n  MEGATRON_TUNING_MODE=deterministic python eval.py\n"
        "(other MEGATRON_TUNING_* variables set the rest of the policy). Undo: python -m megatron_tuning "
        "disable" + _site_dir_flag(args)
    )
    if not is_site_dir(str(folder)):
        print(
            f"note: {folder} is not one of this interpreter's site-packages folders; Python reads .pth "
            "files only from those (and from folders passed to site.addsitedir)"
        )
    return 0


def run_disable(args: argparse.Namespace) -> int:
    folder = _site_dir(args)
    path = folder / PTH_NAME
    current = _read(path)
    if current is None:
        print(f"megatron_tuning is not enabled in {folder}: no {PTH_NAME} (nothing to do)")
        return 0
    if not current.startswith(PTH_MARKER):
        print(f"disable: {path} was not written by megatron_tuning; left alone", file=sys.stderr)
        return EXIT_USAGE
    problem = _folder_problem(folder)
    if problem:
        print(f"disable: {problem}", file=sys.stderr)
        return EXIT_USAGE
    path.unlink()
    print(f"removed {path}: MEGATRON_TUNING_MODE no longer arms processes of this environment")
    return 0


def _site_dir(args: argparse.Namespace) -> Path:
    return Path(os.path.abspath(args.site_dir or default_site_dir()))


def _site_dir_flag(args: argparse.Namespace) -> str:
    return f" --site-dir {args.site_dir}" if args.site_dir else ""


def _folder_problem(folder: Path) -> str | None:
    if not folder.is_dir():
        return f"{folder} is not a folder (give an existing site-packages folder with --site-dir)"
    problem = output_folder_problem(str(folder))
    if problem:
        return (
            f"cannot write {folder} ({problem}). The switch lives in the environment's "
            "site-packages: run this with write access to that environment (e.g. from a "
            "virtualenv you own), or give a folder you can write with --site-dir; "
            f"to arm single commands instead: python -m megatron_tuning run -- <command>"
        )
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return ""  # something of our name that we cannot read: not ours
