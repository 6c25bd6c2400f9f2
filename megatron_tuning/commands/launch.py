"""Pinning jobs you do not edit: ``run [policy options] -- <command>`` sets the policy as
``MEGATRON_TUNING_*`` variables (validated first) and runs the job armed (``job.py``); ``enable`` /
``disable`` write or remove a ``.pth`` that arms every process setting ``MEGATRON_TUNING_MODE``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import uuid
import warnings
from pathlib import Path
from typing import Any

from ..core import policy as knobs
from ..core.errors import EXIT_DIVERGENCE, MegatronTuningError, PolicyError, TableMissError
from ..core.notices import TuningWarning, warn_once
from ..tables.files import output_file_problem, output_folder_problem, write_atomic
from . import EXIT_USAGE
from .bootstrap import ENV_SCORE, PTH_MARKER, PTH_NAME, is_site_dir, pth_text
from .job import add_job_argument, job_argv, job_command, run_armed, say

RUN_MODES = ("deterministic", "auto", "chaos", "record", "off")  # `tune` pools in its own command

# option -> (the knob it sets, add_argument keywords; the help is the knob's own doc unless given)
_OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "--mode": (
        knobs.ENV_MODE,
        {"choices": RUN_MODES, "help": f"default {knobs.default(knobs.ENV_MODE)} unless the variable is set"},
    ),
    # Resolved where they are checked: a job that changes folder still finds them.
    "--table": (
        knobs.ENV_TABLE,
        {"action": "append", "type": os.path.abspath, "metavar": "PATH", "help": "a table file or folder"},
    ),
    "--no-shipped-tables": (
        knobs.ENV_SHIPPED_TABLES,
        {"action": "store_const", "const": "0", "help": "do not search the tables shipped with the package"},
    ),
    "--scope": (knobs.ENV_SCOPE, {"action": "append", "metavar": "MODULE"}),
    "--on-miss": (knobs.ENV_ON_MISS, {"choices": knobs.ON_MISS}),
    "--agreement": (knobs.ENV_AGREEMENT, {"choices": knobs.AGREEMENT_MODES}),
    "--agreement-timeout": (knobs.ENV_AGREEMENT_TIMEOUT, {"metavar": "SECONDS"}),
    "--cache": (knobs.ENV_CACHE, {"metavar": "PATH|off"}),
    "--strict": (knobs.ENV_STRICT, {"action": "store_const", "const": "1"}),
    "--stale-entries": (knobs.ENV_STALE_ENTRIES, {"choices": knobs.STALE_ENTRIES}),
    "--block-sizes": (knobs.ENV_BLOCK_SIZES, {"metavar": "NAME=INT,..."}),
    "--decision-log": (
        knobs.ENV_DECISION_LOG,
        {"metavar": "PATH", "help": "write each process's decisions here at exit ({rank}, {pid} replaced)"},
    ),
    "--record-dir": (knobs.ENV_RECORD_DIR, {"metavar": "DIR"}),
}
EXAMPLES = """\
examples:
  python -m megatron_tuning run -- eval.py --candidate k.py
      pin every autotuned kernel of eval.py: table entries, else the deterministic fallback
  python -m megatron_tuning run --table tables/sm90.msgpack --on-miss error -- -m my_pkg.bench
  python -m megatron_tuning run --mode auto -- torchrun --nproc_per_node 8 train.py
      tune each new shape once per job, share it across ranks, pin it from then on
  python -m megatron_tuning run --mode chaos -- torchrun --nproc_per_node 2 train.py
      the positive control: the agreement check must raise DivergenceError
  python -m megatron_tuning run --decision-log 'decisions-{rank}.json' -- train.py
      then: python -m megatron_tuning coverage decisions-*.json

Everything after `--` is the job, exactly as you would type it. The exit status is the job's
(128+N when it died of signal N); 3 when a process raised DivergenceError; 2 for a bad option;
126/127 when the command cannot run. Prove the check on your job: selftest -- <command>.
Without a launcher (processes you do not start): python -m megatron_tuning enable, then set
MEGATRON_TUNING_MODE. See docs/launcher.md.
"""


def add_run(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run a command with every autotuned Triton kernel of each of its Python processes\n"
        "pinned, without editing it. Each option sets one MEGATRON_TUNING_* variable for the job."
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    for flag, (variable, options) in _OPTIONS.items():
        help = options.get("help", knobs.KNOBS[variable].doc)
        more = "; repeatable" if options.get("action") == "append" else ""
        if variable in os.environ:  # what the job gets without the option: help tells the truth here
            more += f"; your environment sets {os.environ[variable]!r}".replace("%", "%%")
        parser.add_argument(flag, dest=variable, **{**options, "help": f"{help} [{variable}{more}]"})
    parser.add_argument(
        "--score-do-bench",
        nargs="?",
        const="score.json",
        metavar="OUT",
        help="score each triton.testing.do_bench call of the job with measure; records in OUT (score.json)",
    )
    add_job_argument(parser)


def run_run(args: argparse.Namespace) -> int:
    """Validate the policy, run the job armed, return its exit status."""
    command = job_command(args, "run", "run -- eval.py")
    if command is None:
        return EXIT_USAGE
    updates = {}  # the MEGATRON_TUNING_* values the options given set
    for variable, _ in _OPTIONS.values():
        value = getattr(args, variable)
        if value is not None:
            joiner = ":" if variable == knobs.ENV_TABLE else ","
            updates[variable] = joiner.join(value) if isinstance(value, list) else str(value)
    try:
        policy = validated_policy(updates)
    except MegatronTuningError as exc:
        name = str(getattr(exc, "name", ""))
        flag = next((f for f, (v, _) in _OPTIONS.items() if v in updates and v in name), None)
        say("run", f"{flag + ': ' if flag else ''}{exc}")
        return EXIT_USAGE
    updates[knobs.ENV_MODE] = policy.mode  # the default mode, spelled out for every process
    if args.score_do_bench:  # every process scores its do_bench calls into this one file (docs/score.md)
        problem = _score_out_problem(args.score_do_bench)
        if problem:
            say("run", f"--score-do-bench {args.score_do_bench}: {problem}")
            return EXIT_USAGE
        out = {"do_bench": True, "out": os.path.abspath(args.score_do_bench), "run": uuid.uuid4().hex}
        updates[ENV_SCORE] = json.dumps(out)
    code, caught = run_armed(job_argv(command), updates, "run")
    if caught:
        message = f"{caught} process(es) of the job raised DivergenceError: ranks launched different"
        print(f"run: {message} configs (exit status {EXIT_DIVERGENCE})", file=sys.stderr)
    return EXIT_DIVERGENCE if caught else code


def _score_out_problem(path: str) -> str | None:
    """Why the job's processes could not write their scores to ``path``: checked before the job, as
    each process would otherwise fail inside its first ``do_bench`` call."""
    problem = output_file_problem(path)
    if problem or not os.path.exists(path):
        return problem
    from ..score import pooling

    try:  # an earlier score file is replaced; anything else is not ours to overwrite
        pooling.load(path)
    except (OSError, ValueError) as exc:
        return f"holds something other than scores ({exc}); name another file"
    return None


def validated_policy(updates: dict[str, str]) -> knobs.TuningPolicy:
    """The policy every process of the job will build, checked now (raises MegatronTuningError):
    its values, the tables it names (they load) and its output paths (they can be written)."""
    from ..session import check_output_paths
    from ..tables.search import TableSet

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TuningWarning)  # the job's rank 0 gives them, once per job
        policy = knobs.TuningPolicy.from_env({**os.environ, **updates})
    if policy.mode == "tune":
        tune = "`python -m megatron_tuning tune --out TABLE -- <command>`, which pools every process's"
        allowed = f"deterministic, auto, chaos, record or off under `run`; tune with {tune} measurements"
        raise PolicyError(knobs.ENV_MODE, "tune", f"{allowed} into a table")
    check_output_paths(policy)
    TableSet.from_policy(policy.replace(use_shipped_tables=False))  # loads them: a bad one fails now
    return policy


SCORE_MISS_REMEDY = (
    "`score` pins every kernel from a table and makes a miss an error (its own mode and miss rule: "
    "MEGATRON_TUNING_MODE and MEGATRON_TUNING_ON_MISS do not apply), so that nothing is timed in a "
    "config no table holds. Tune the candidate first, on the GPU it is scored on: `python -m "
    "megatron_tuning tune --out T.msgpack -- <the same command>`, then `python -m megatron_tuning score "
    '--table T.msgpack -- <the same command>` (docs/score.md, "Tune, then score").'
)


def activate(launcher: str = "run") -> None:
    """At ``import triton`` in a ``run`` job's or ``enable``d process: start tuning with the job's policy.

    A failure stops the process (exit 2 for a bad setting): the user asked for pinned kernels, so none
    may run unpinned without a word. The job's own ``init_deterministic_tuning`` call, if running, wins.
    """
    from triton.backends import backends

    from .. import session

    if session.initializing():
        return
    if launcher == "score":  # score sets the mode and the miss rule: the usual advice cannot work
        TableMissError.remedy = SCORE_MISS_REMEDY
    try:
        if launcher == "enable" and knobs.TuningPolicy.from_env_if_asked().mode == "off":
            return  # the mode is unset: nothing asked (a misspelt variable was named)
        session.init_deterministic_tuning()
        if ENV_SCORE in os.environ:  # a `score` job, or run --score-do-bench
            from ..score import dobench

            dobench.activate(os.environ[ENV_SCORE], ENV_SCORE)
    except Exception as exc:
        message = f"cannot pin this process's kernels, stopping it: {exc}"
        print(f"megatron_tuning {launcher}: {message}", file=sys.stderr)
        if isinstance(exc, MegatronTuningError):
            raise SystemExit(EXIT_USAGE) from None
        raise
    try:
        interpret = os.environ.get("TRITON_INTERPRET", "").strip().lower() in knobs.TRUE_WORDS
        driver = interpret or any(backend.driver.is_active() for backend in backends.values())
    except Exception:  # noqa: BLE001 - a backend that cannot tell: let Triton say what is wrong
        driver = True
    if not driver:
        warn_once(
            ("no-gpu-driver",),
            "Triton finds no GPU driver here, so launching a kernel fails with '0 active drivers'. "
            "To run Triton kernels on the CPU, in Triton's interpreter, set TRITON_INTERPRET=1.",
        )


def add_enable(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "enable writes megatron_tuning_enable.pth into site-packages; disable removes it. In between, a "
        "process of this environment is armed when MEGATRON_TUNING_MODE is set. See docs/launcher.md."
    )
    default = sysconfig.get_path("purelib")
    parser.add_argument("--site-dir", metavar="DIR", help=f"the site-packages folder (default: {default})")


add_disable = add_enable


def run_enable(args: argparse.Namespace) -> int:
    """``enable`` and ``disable`` (``args.command`` tells which)."""
    enable = args.command == "enable"
    folder = Path(os.path.abspath(args.site_dir or sysconfig.get_path("purelib")))
    path = folder / PTH_NAME
    try:
        current: str | None = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        current = None
    except (OSError, UnicodeDecodeError):
        current = ""  # something of our name that we cannot read: not ours
    if current is None and not enable:
        print(f"megatron_tuning is not enabled in {folder}: no {PTH_NAME} (nothing to do)")
        return 0
    problem = None
    if not folder.is_dir():
        problem = f"{folder} is not a folder (give an existing site-packages folder with --site-dir)"
    elif reason := output_folder_problem(str(folder)):
        problem = (
            f"cannot write {folder} ({reason}). The switch lives in the environment's site-packages: "
            "run this with write access to that environment (e.g. from a virtualenv you own), or give a "
            "folder you can write with --site-dir; to arm single commands instead: "
            "python -m megatron_tuning run -- <command>"
        )
    elif current is not None and not current.startswith(PTH_MARKER):
        problem = f"{path} {'exists and ' if enable else ''}was not written by megatron_tuning; left alone"
    if problem:
        print(f"{args.command}: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if not enable:
        path.unlink()
        print(f"removed {path}: MEGATRON_TUNING_MODE no longer arms processes of this environment")
        return 0
    text = pth_text(str(path))
    if current == text:
        print(f"megatron_tuning is already enabled: {path} (unchanged)")
    else:
        write_atomic(path, text.encode("utf-8"))
        print(f"{'updated' if current is not None else 'wrote'} {path}")
    flag = f" --site-dir {args.site_dir}" if args.site_dir else ""
    print(
        "Every Python process of this environment now pins Triton autotuning when "
        "MEGATRON_TUNING_MODE is set, e.g.\n  MEGATRON_TUNING_MODE=deterministic python eval.py\n"
        "(other MEGATRON_TUNING_* variables set the "
        f"rest of the policy). Undo: python -m megatron_tuning disable{flag}"
    )
    if not is_site_dir(str(folder)):
        note = "is not one of this interpreter's site-packages folders; Python reads .pth files only from"
        print(f"note: {folder} {note} those (and from folders passed to site.addsitedir)")
    return 0


run_disable = run_enable
