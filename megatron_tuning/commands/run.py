"""``python -m megatron_tuning run [policy options] -- <command>``: pin an unedited job.

The command (a script, ``-m pkg``, ``python ...`` or ``torchrun ...``) runs with the policy in
``MEGATRON_TUNING_*`` variables and the shared bootstrap (``commands/bootstrap.py``) on its
``PYTHONPATH``: every Python process of the job calls ``init_deterministic_tuning()`` right after
it imports Triton, before any kernel is decorated. A job that creates its process group later
(every torchrun script) is attached to it at its first new kernel key after that (``session``).

Each option sets one variable for the job and replaces the value the environment had; variables
no option names pass through. The whole policy is validated here, before the job starts: a bad
value is a usage error (exit 2) naming the option. Then the job's exit status is this command's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ..core import policy as policy_vars
from ..core.errors import MegatronTuningError, PolicyError
from ..core.policy import TuningPolicy
from .bootstrap import job_environment, write_bootstrap
from .launch import EXIT_USAGE, add_job_argument, command_problem, job_argv, job_command, run_job

RUN_MODES = ("deterministic", "auto", "chaos", "record", "off")
"""``tune`` is its own command: it needs a parent that pools every process's measurements."""

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
(128+N when it died of signal N); 2 for a bad option; 126/127 when the command cannot run.
Without a launcher (processes you do not start): python -m megatron_tuning enable, then set
MEGATRON_TUNING_MODE. See docs/launcher.md.
"""

# option dest -> (its flag, the variable it sets): core.policy's names, one list of knobs, not two
_OPTIONS = {
    "mode": ("--mode", policy_vars.ENV_MODE),
    "table": ("--table", policy_vars.ENV_TABLE),
    "shipped_tables": ("--no-shipped-tables", policy_vars.ENV_SHIPPED_TABLES),
    "scope": ("--scope", policy_vars.ENV_SCOPE),
    "on_miss": ("--on-miss", policy_vars.ENV_ON_MISS),
    "agreement": ("--agreement", policy_vars.ENV_AGREEMENT),
    "agreement_timeout": ("--agreement-timeout", policy_vars.ENV_AGREEMENT_TIMEOUT),
    "cache": ("--cache", policy_vars.ENV_CACHE),
    "strict": ("--strict", policy_vars.ENV_STRICT),
    "stale_entries": ("--stale-entries", policy_vars.ENV_STALE_ENTRIES),
    "block_sizes": ("--block-sizes", policy_vars.ENV_BLOCK_SIZES),
    "decision_log": ("--decision-log", policy_vars.ENV_DECISION_LOG),
    "record_dir": ("--record-dir", policy_vars.ENV_RECORD_DIR),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the ``run`` command."""
    parser.description = (
        "Run a command with every autotuned Triton kernel of each of its Python processes\n"
        "pinned, without editing it. Each option sets one MEGATRON_TUNING_* variable for the job."
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    parser.add_argument(
        "--mode",
        choices=RUN_MODES,
        default=None,
        help="deterministic (default), auto, chaos, record or off",
    )
    parser.add_argument(
        "--table",
        action="append",
        default=None,
        metavar="PATH",
        help="a table file or folder to search, earlier first (repeatable)",
    )
    parser.add_argument(
        "--no-shipped-tables",
        dest="shipped_tables",
        action="store_const",
        const="0",
        default=None,
        help="do not search the tables shipped with the package",
    )
    parser.add_argument(
        "--scope",
        action="append",
        default=None,
        metavar="MODULE",
        help="pin only kernels defined in these modules (prefixes, repeatable; default all)",
    )
    parser.add_argument(
        "--on-miss",
        choices=policy_vars.ON_MISS,
        default=None,
        help="no usable table entry: the nearest shape's entry, else the cheapest (nearest, the "
        "default); the cheapest (min_cost); or raise (error)",
    )
    parser.add_argument(
        "--agreement",
        choices=policy_vars.AGREEMENT_MODES,
        default=None,
        help="cross-rank check: store, allgather, verify or off (default: store up to 64 ranks, "
        "verify above)",
    )
    parser.add_argument(
        "--agreement-timeout", default=None, metavar="SECONDS", help="allgather wait limit (default 300)"
    )
    parser.add_argument("--cache", default=None, metavar="PATH|off", help="auto mode's cache table")
    parser.add_argument(
        "--strict",
        action="store_const",
        const="1",
        default=None,
        help="raise on stale entries and unpinned compiled launches",
    )
    parser.add_argument(
        "--stale-entries",
        choices=policy_vars.STALE_ENTRIES,
        default=None,
        help="use (default), miss or error",
    )
    parser.add_argument(
        "--block-sizes", default=None, metavar="NAME=INT,...", help="explicit block-size override"
    )
    parser.add_argument(
        "--decision-log",
        default=None,
        metavar="PATH",
        help="write each process's decisions here at exit ({rank} and {pid} are replaced)",
    )
    parser.add_argument(
        "--record-dir", default=None, metavar="DIR", help="where record mode writes one file per rank"
    )
    add_job_argument(parser, "the job, after `--`: script.py [args], -m pkg [args], python ..., torchrun ...")


def run(args: argparse.Namespace) -> int:
    """Validate the policy, run the job armed, return its exit status."""
    command = job_command(args)
    if not command:
        print(
            "run: give the command to run after `--`, e.g. "
            "`python -m megatron_tuning run -- eval.py` (see run --help)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    updates = policy_environment(args)
    try:
        policy = validated_policy(updates)
    except MegatronTuningError as exc:
        print(f"run: {_name_the_option(exc, updates)}", file=sys.stderr)
        return EXIT_USAGE
    updates[policy_vars.ENV_MODE] = policy.mode  # the default mode, spelled out for every process
    problem = command_problem(job_argv(command), os.environ)
    if problem is not None:
        print(f"run: {problem[1]}", file=sys.stderr)
        return problem[0]
    bootstrap = Path(tempfile.mkdtemp(prefix="megatron_tuning_run_")) / "bootstrap"
    try:
        write_bootstrap(bootstrap, "run")
        environment = job_environment(bootstrap, "run")
        environment.update(updates)
        return run_job(job_argv(command), environment, prog="run")
    finally:
        shutil.rmtree(bootstrap.parent, ignore_errors=True)


def policy_environment(args: argparse.Namespace) -> dict[str, str]:
    """The ``MEGATRON_TUNING_*`` values the options given set (options left out set nothing)."""
    updates: dict[str, str] = {}
    for dest, (_, variable) in _OPTIONS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if dest == "table":
            value = ":".join(value)
        elif dest == "scope":
            value = ",".join(value)
        updates[variable] = str(value)
    return updates


def validated_policy(updates: dict[str, str]) -> TuningPolicy:
    """The policy every process of the job will build, checked now (raises MegatronTuningError).

    Besides the values themselves: the tables named load, and the output paths can be written.
    """
    from ..session import check_output_paths
    from ..tables.search import TableSet

    with policy_vars.scoped_environ(updates):
        policy = TuningPolicy.from_env(default_mode="deterministic", follow_torch_determinism=False)
        if policy.mode == "tune":
            raise PolicyError(
                policy_vars.ENV_MODE,
                "tune",
                "deterministic, auto, chaos, record or off under `run`; tune with "
                "`python -m megatron_tuning tune --out TABLE -- <command>`, which pools every "
                "process's measurements into a table",
            )
        check_output_paths(policy)
        TableSet.from_policy(policy.replace(use_shipped_tables=False))  # loads them: a bad one fails now
    return policy


def _name_the_option(error: MegatronTuningError, updates: dict[str, str]) -> str:
    """The error, with the option that set the variable it names (when an option did)."""
    name = getattr(error, "name", "")
    for flag, variable in _OPTIONS.values():
        if variable in updates and variable in str(name):
            return f"{flag}: {error}"
    return str(error)


def activate() -> None:
    """In a process of the job, at its ``import triton``: start tuning with the job's policy.

    A failure stops the process (the exception propagates out of ``import triton``): the user
    asked for pinned kernels, so none may run unpinned without a word. When the job imports
    Triton inside its own ``init_deterministic_tuning`` call, nothing is armed: that call wins.
    """
    from ..session import init_deterministic_tuning, initializing

    if initializing():
        return  # Triton is imported inside the job's own init_deterministic_tuning: its call wins
    try:
        init_deterministic_tuning()
    except Exception as exc:
        print(
            f"megatron_tuning run: cannot pin this process's kernels, stopping it: {exc}",
            file=sys.stderr,
        )
        raise
