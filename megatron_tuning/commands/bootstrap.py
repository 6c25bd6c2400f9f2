"""Arm megatron_tuning in every Python process of a job that was not edited for it.

A launcher's ``sitecustomize.py`` (first on the job's ``PYTHONPATH``) or ``enable``'s ``.pth`` loads
*this file* by path: it imports only the standard library, so processes that never import Triton
(torchrun's launcher, pip) pay nothing. At ``import triton`` a meta-path hook runs
``commands.<launcher>.activate``. A launcher's job lives as long as it holds its lifeline.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

# core.policy's names, repeated: this file imports no package module.
PREFIX, ENV_MODE = "MEGATRON_TUNING_", "MEGATRON_TUNING_MODE"
# The launchers' plumbing, set for their job's processes and read by commands/ alone: no knobs, so
# outside the knobs' prefix. ENV_LAUNCHER names the activation to run (the .pth then stands down).
PLUMBING = "_MEGATRON_TUNING_"
ENV_LAUNCHER = PLUMBING + "LAUNCHER"  # run, score, tune or audit
ENV_JOB_DIR = PLUMBING + "JOB_DIR"  # the launcher's folder: its bootstrap, and what its processes write
ENV_SCORE = PLUMBING + "SCORE"  # what `score` (or `run --score-do-bench`) asks of each process: JSON
ENV_QUIET = PLUMBING + "QUIET"  # `score -q`: a job's process prints no line of its own per result
LAUNCHERS = {"run": "launch", "score": "launch", "tune": "tune", "audit": "audit"}  # -> its commands module

_HERE = os.path.abspath(__file__)
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))

# Loads this file by path, once per process, as ``_mt_boot``.
_LOADER = """\
_mt_boot = _mt_sys.modules.get({name!r})
if _mt_boot is None:
    import importlib.util as _mt_util
    _mt_spec = _mt_util.spec_from_file_location({name!r}, {path!r})
    _mt_boot = _mt_util.module_from_spec(_mt_spec)
    _mt_sys.modules[{name!r}] = _mt_boot
    _mt_spec.loader.exec_module(_mt_boot)
""".format(name="_megatron_tuning_bootstrap", path=_HERE)

_SITECUSTOMIZE = """\
# Written by `python -m megatron_tuning {launcher}` for one job: arms megatron_tuning in each of its
# Python processes (at their `import triton`), then runs any sitecustomize this one shadows.
import sys as _mt_sys
try:
{loader}    _mt_boot.bootstrap_process(__file__)
except Exception as _mt_exc:  # never stop the user's program from starting
    print(
        f"megatron_tuning {launcher}: bootstrap failed ({{_mt_exc!r}}); this process is NOT armed",
        file=_mt_sys.stderr,
    )
"""

PTH_NAME = "megatron_tuning_enable.pth"
PTH_MARKER = "# megatron_tuning environment switch"


def job_environment(folder: Path, launcher: str) -> dict[str, str]:
    """The environment of a job in ``folder``: ``folder/bootstrap``, made now, holds only our
    ``sitecustomize.py`` and goes first on ``PYTHONPATH``, ahead of the standard library, so it must
    be new and private (mode 0700); the launcher and ``folder`` named."""
    from megatron_tuning.tables.files import write_atomic

    bootstrap = folder / "bootstrap"
    bootstrap.mkdir(mode=0o700)  # FileExistsError for a folder someone else could have filled
    loader = "".join(f"    {line}\n" for line in _LOADER.splitlines())
    text = _SITECUSTOMIZE.format(launcher=launcher, loader=loader)
    write_atomic(bootstrap / "sitecustomize.py", text.encode("utf-8"))
    env = dict(os.environ)
    paths = [str(bootstrap), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    if not is_site_dir(PACKAGE_PARENT):
        # A source checkout, after the user's entries (its `tests` must not shadow theirs). An
        # installed copy is on the path already; site-packages on PYTHONPATH would shadow the stdlib.
        paths.append(PACKAGE_PARENT)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.update({ENV_LAUNCHER: launcher, ENV_JOB_DIR: str(folder)})
    return env


def pth_text(pth_path: str) -> str:
    """The ``.pth`` ``enable`` writes: a marker comment, then one line Python executes (one scan of
    the environment's names when no ``MEGATRON_TUNING_*`` variable is set)."""
    code = (
        "try:\n" + "".join(f" {line}\n" for line in _LOADER.splitlines()) + " _mt_boot.arm_environment()\n"
        "except Exception as _mt_exc:\n"
        " print('megatron_tuning: the environment switch %s failed (%r); this process is NOT armed. "
        "Remove it with: python -m megatron_tuning disable'"
        f" % ({pth_path!r}, _mt_exc), file=_mt_sys.stderr)\n"
    )
    line = f"import os, sys as _mt_sys; any(n.startswith({PREFIX!r}) for n in os.environ) and exec({code!r})"
    return (
        f"{PTH_MARKER}, written by `python -m megatron_tuning enable`; remove it with "
        "`python -m megatron_tuning disable`.\n"
        f"{line}\n"
    )


def is_site_dir(path: str) -> bool:
    """Whether ``path`` is one of this interpreter's site-packages folders."""
    import site
    import sysconfig

    candidates = set(site.getsitepackages()) | {site.getusersitepackages()}
    candidates |= {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    return os.path.realpath(path) in {os.path.realpath(c) for c in candidates if c}


def hold_lifeline(lifeline: Path) -> int:
    """Lock the file ``lifeline`` exclusively and return the fd: every process of the job that called
    ``stop_with_launcher(lifeline)`` dies once it is closed, by the launcher or by the kernel when the
    launcher dies (SIGKILL included). A lock, not a pid: torchrun's workers live in sessions of their
    own, and a killed launcher runs no code."""
    fd = os.open(lifeline, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def stop_with_launcher(lifeline: str) -> None:
    """Kill this process once its launcher lets go of ``lifeline`` (a shared lock is granted only
    then). SIGKILL, so no exit handler runs: nothing reaches a cache after the launcher is gone. A
    process leading its own process group (a torchrun worker: a session of its own) kills that group,
    so what it started dies with it, as the launcher's watcher kills the job's group."""

    def watch() -> None:
        with contextlib.suppress(OSError):  # no file: the launcher has ended and removed it
            fcntl.flock(os.open(lifeline, os.O_RDONLY), fcntl.LOCK_SH)
        if os.getpgrp() == os.getpid():  # its own group, made for it: only what it started is there
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="megatron_tuning launcher watch", daemon=True).start()


def bootstrap_process(sitecustomize_file: str) -> None:
    """Run from a launcher's ``sitecustomize``: tie this process (and its forks) to the launcher, arm
    it, then chain any other sitecustomize."""
    lifeline = os.path.abspath(sitecustomize_file)
    stop_with_launcher(lifeline)
    os.register_at_fork(after_in_child=functools.partial(stop_with_launcher, lifeline))
    _chain_sitecustomize(os.path.dirname(lifeline))
    if os.environ.get(ENV_JOB_DIR):  # the session marks there, at exit, the DivergenceErrors raised
        mark = functools.partial(_mark_divergences, os.environ[ENV_JOB_DIR])
        sys.meta_path.insert(0, _AfterImport("megatron_tuning.session", lambda m: m.exit_hooks.append(mark)))
    launcher = os.environ.get(ENV_LAUNCHER, "run")
    arm(launcher if launcher in LAUNCHERS else "run")
    if job := os.environ.get(ENV_SCORE):  # a `score` job: measure() joins it where the job imports the kit
        sys.meta_path.insert(0, _AfterImport("megatron_tuning.score", functools.partial(_join_score, job)))


def _join_score(job: str, score: Any) -> None:
    """A ``score`` job's process: take part in the job, and print each result's line to stderr (unless
    ``score -q``)."""
    score.pooling.join_job(job, ENV_SCORE)
    if not os.environ.get(ENV_QUIET):
        print_progress("megatron_tuning.score.measure.progress")


def print_progress(name: str) -> None:
    """In a command's job process: the INFO lines of logger ``name`` (the command's output, a line
    per key tuned or result scored) go to stderr, and nowhere else; the job's own logging is left
    alone."""
    import logging

    progress = logging.getLogger(name)
    progress.addHandler(logging.StreamHandler())  # stderr
    progress.setLevel(logging.INFO)
    progress.propagate = False


def arm_environment() -> None:
    """Run from the ``.pth``: arm this process unless a launcher's bootstrap does, or the mode is off
    (with the mode unset, arming only names a misspelt variable: ``launch.activate``)."""
    if not os.environ.get(ENV_LAUNCHER) and os.environ.get(ENV_MODE, "").strip().lower() != "off":
        arm("enable")


def arm(launcher: str) -> None:
    """Activate ``launcher`` once Triton is imported (now, if it already is)."""

    def activate() -> None:
        module = _package_module(f"commands.{LAUNCHERS.get(launcher, 'launch')}")
        module.activate(launcher) if module.__name__.endswith(".launch") else module.activate()

    if "triton" in sys.modules:
        activate()
    elif not any(isinstance(f, _AfterImport) and f.name == "triton" for f in sys.meta_path):
        # Importing Triton (and torch) in every Python process of the job, the torchrun launcher
        # included, would be slow and pointless: wait until the process imports Triton itself.
        finder = _AfterImport("triton", lambda triton: activate())
        sys.meta_path.insert(0, finder)
        if launcher in ("run", "score", "enable"):
            atexit.register(_join_at_exit, finder)


def _join_at_exit(finder: _AfterImport) -> None:
    """At the exit of a rank that never imported Triton: the job's check at close (``verify`` mode)
    needs every rank of the group, so this one joins it, with an empty log (``session.close_at_exit``)."""
    dist = sys.modules.get("torch.distributed")
    if finder in sys.meta_path and dist is not None and dist.is_available() and dist.is_initialized():
        _package_module("session").close_at_exit(join=True)


def _mark_divergences(folder: str) -> None:
    """Mark in ``folder`` how many DivergenceErrors this process raised, handled ones too (`run` makes
    them the job's status)."""
    raised = _package_module("core.errors").DivergenceError.raised
    if raised:  # a vanished folder raises: close_at_exit goes on, and the exit status still tells
        write = _package_module("tables.files").write_atomic
        write(os.path.join(folder, f"divergence-{os.getpid()}"), b"%d" % raised)


def _package_module(name: str) -> Any:
    """``megatron_tuning.<name>``, imported from the copy this file belongs to where the process
    cannot import the package by name (an uninstalled checkout, armed through the .pth)."""
    import importlib
    import importlib.util

    if "megatron_tuning" not in sys.modules and importlib.util.find_spec("megatron_tuning") is None:
        sys.path.insert(0, PACKAGE_PARENT)
        try:
            importlib.import_module("megatron_tuning")
        finally:
            sys.path.remove(PACKAGE_PARENT)
    return importlib.import_module(f"megatron_tuning.{name}")


class _AfterImport:
    """A meta-path finder that runs ``callback(module)`` once module ``name`` has finished importing; an
    exception from ``callback`` propagates out of the ``import`` (``run`` stops an unpinned process)."""

    def __init__(self, name: str, callback: Callable[[Any], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, callback = spec.loader, self.callback

        class _Loader:
            def __getattr__(self, attr: str) -> Any:  # everything else: the real loader
                return getattr(loader, attr)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                callback(module)

        spec.loader = _Loader()  # type: ignore[assignment]
        return spec


def _chain_sitecustomize(own_dir: str) -> None:
    """Import the sitecustomize ours shadows (a venv's or distro's), as if ours were not there."""
    import importlib

    saved = sys.path[:]
    ours = sys.modules.pop("sitecustomize", None)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != own_dir]
        importlib.import_module("sitecustomize")
    except Exception as exc:  # a broken sitecustomize is reported, as site.py does, and must not keep us off
        if not (isinstance(exc, ImportError) and exc.name == "sitecustomize"):  # absent: nothing to chain
            message = f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}"
            print(message, file=sys.stderr)
    finally:
        sys.path[:] = saved
        if ours is not None:
            sys.modules["sitecustomize"] = ours
