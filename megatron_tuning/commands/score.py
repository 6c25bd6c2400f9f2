"""``score [options] -- <command>``: the command in N fresh pinned processes, their ``measure``
records pooled into one JSON; ``score compare A B``; ``score noise-floor -- <command>``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..core import policy as knobs
from ..core.errors import MegatronTuningError, printable
from ..score import pooling
from ..score.report import line
from ..tables.files import output_file_problem, write_atomic
from . import EXIT_SIGNAL, EXIT_USAGE
from .bootstrap import ENV_QUIET, ENV_SCORE
from .job import PASSED_SIGNALS, add_job_argument, command_problem, handle_signals, job_argv, job_command, say
from .launch import run_armed, validated_policy

EXIT_INCORRECT, EXIT_DEMOTED = 3, 4
COMPARE_FORMAT = "megatron_tuning.score-compare/1"
EXAMPLES = """\
examples:
  python -m megatron_tuning tune --out t.msgpack -- eval.py --candidate k.py
  python -m megatron_tuning score --processes 5 --table t.msgpack --out score.json -- eval.py --candidate k.py
      tune the candidate's kernels once, then score: eval.py calls megatron_tuning.score.measure(...):
      5 fresh processes, every record pooled
  python -m megatron_tuning score --do-bench -- eval.py
      an unedited harness: each triton.testing.do_bench call is scored by measure
  python -m megatron_tuning score noise-floor --processes 5 -- eval.py
      A/A: each measure call times its candidate against an independent instance of itself
  python -m megatron_tuning score compare new.json old.json --margin 0.02
  python -m megatron_tuning score compare --json new.json old.json > verdict.json
      the same verdict as one JSON document (or --out FILE); schema in docs/score.md

Every process is pinned (deterministic, a table miss is an error: tune first). Exit status: 0 ok; 3 a
correctness check failed; 4 a clock or integrity flag demoted a result; the job's own status when
it failed; 1 when no process called measure(); 128+N when score was sent signal N (what was
measured is written); 2 for bad options. When nothing was measured, --out is not written (a file
already there is kept). `score compare` exits 4 when a demoting flag is raised, 2 for bad options
or files. See docs/score.md.
"""


def add_score(parser: argparse.ArgumentParser) -> None:
    parser.description = "Score a command's kernels: measure() records of N fresh pinned processes, pooled."
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    _add_options(parser)
    add_job_argument(parser, "`-- COMMAND`, `noise-floor [options] -- COMMAND`, or `compare A.json B.json`")


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--table", action="append", metavar="PATH", help="pin from this table first; repeatable"
    )
    parser.add_argument("--processes", type=int, help="fresh processes to run (default 5)")
    parser.add_argument(
        "--budget-s", type=float, help="each measure call's time budget (overrides the job's)"
    )
    parser.add_argument("--target-ci", type=float, help="stop at this 95%% half-width (overrides the job's)")
    parser.add_argument(
        "--out", help="the pooled JSON (default score.json); not written when nothing was measured"
    )
    parser.add_argument(
        "--do-bench", action="store_true", help="score the job's triton.testing.do_bench calls"
    )
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no line per process (its start, its results' lines on stderr); the pooled ones still print",
    )


def run_score(args: argparse.Namespace) -> int:
    words = list(args.job or [])
    if words[:1] == ["compare"]:
        return _compare(words[1:], args)
    noise = words[:1] == ["noise-floor"]
    if noise:
        sub = argparse.ArgumentParser(prog="megatron-tuning score noise-floor")
        _add_options(sub)
        add_job_argument(sub)
        given = {k: v for k, v in vars(args).items() if k != "job"}
        args = sub.parse_args(words[1:], namespace=argparse.Namespace(**given))
    command = job_command(args, "score", "score --processes 5 -- eval.py")
    if command is None:
        return EXIT_USAGE
    args.processes = 5 if args.processes is None else args.processes
    args.out = args.out or "score.json"
    problem = _options_problem(args)
    updates = {knobs.ENV_MODE: "deterministic", knobs.ENV_ON_MISS: "error"}
    # Resolved here, where they are checked: a harness that changes folder still finds them.
    tables = [*(args.table or []), *filter(None, os.environ.get(knobs.ENV_TABLE, "").split(":"))]
    tables = [os.path.abspath(table) for table in tables]
    if tables:
        updates[knobs.ENV_TABLE] = ":".join(tables)
    if args.quiet:
        updates[ENV_QUIET] = "1"
    try:
        validated_policy(updates)  # a table that does not load fails now, not in every process
    except MegatronTuningError as exc:
        problem = problem or str(exc)
    started = command_problem(job_argv(command), os.environ)
    if problem or started:
        print(f"score: {problem or started[1]}", file=sys.stderr)  # type: ignore[index]
        return EXIT_USAGE if problem else started[0]  # type: ignore[index]
    job = {
        "budget_s": args.budget_s,
        "target_ci": args.target_ci,
        "noise_floor": noise,
        "do_bench": args.do_bench,
    }
    return _score_job(
        job_argv(command), updates, {k: v for k, v in job.items() if v}, args.out, args.processes
    )


def _options_problem(args: argparse.Namespace) -> str | None:
    if not 1 <= args.processes <= 1000:
        return f"--processes {args.processes}: give 1 to 1000 processes"
    if args.budget_s is not None and not 0 < args.budget_s < 1e6:
        return f"--budget-s {args.budget_s}: give a positive number of seconds"
    if args.target_ci is not None and not 0 < args.target_ci < 1:
        return f"--target-ci {args.target_ci}: give a fraction in (0, 1), e.g. 0.01"
    return None


def _score_job(
    argv: Sequence[str], updates: dict[str, str], job: dict[str, Any], out: str, processes: int = 1
) -> int:
    """Run ``argv`` armed ``processes`` times in a row, each writing its records to one folder; pool
    them into ``out``."""
    problem = output_file_problem(out)
    if problem:
        say("score", f"cannot write {out}: {problem}")
        return EXIT_USAGE
    work = Path(tempfile.mkdtemp(prefix="megatron_tuning_score_"))
    codes: list[int] = []
    stop: list[int] = []  # signals sent to `score`: the series ends there, with what was measured
    restore = handle_signals(PASSED_SIGNALS, stop.append)
    try:
        for index in range(processes):
            if stop:
                break
            if processes > 1 and ENV_QUIET not in updates:
                print(f"score: process {index + 1} of {processes}: {shlex.join(argv)}", file=sys.stderr)
            environment = {**updates, ENV_SCORE: json.dumps({**job, "dir": str(work), "index": index})}
            # The job's watcher removes `work` too should `score` be killed (a harness's timeout).
            code, diverged = run_armed(
                argv, environment, "score", launcher="score", passed=stop, leftovers=[work]
            )
            codes.append(code)
            if diverged:
                print(f"score: {diverged} process(es) raised DivergenceError", file=sys.stderr)
            if codes[-1] or stop:
                why = f"score was sent {signal.Signals(stop[0]).name}" if stop else f"status {codes[-1]}"
                print(f"score: process {index + 1} ended ({why}); stopping", file=sys.stderr)
                break
        per_process = pooling.read_job(work)
    finally:
        restore()
        shutil.rmtree(work, ignore_errors=True)
    results = pooling.pool(per_process, requested=processes)
    if not results:  # nothing measured: an --out already there (an earlier series) is not replaced
        return _nothing_measured(out, codes, stop)
    report = {
        "format": pooling.RUN_FORMAT,
        "command": list(argv),
        "processes": len(codes),
        "exit_codes": codes,
        "noise_floor": bool(job.get("noise_floor")),
        "results": results,
        "per_process": per_process,
    }
    write_atomic(out, json.dumps(report, indent=1).encode())
    for result in results:
        print(printable(line(result)))
    print(f"score: {len(results)} result(s) from {len(per_process)} process(es) in {out}")
    if stop:  # as a shell reports a death by that signal: a partial series is no pass
        return EXIT_SIGNAL + stop[0]
    if codes[-1]:
        return codes[-1]
    statuses = {r["status"] for r in results}
    return EXIT_INCORRECT if "incorrect" in statuses else EXIT_DEMOTED if "demoted" in statuses else 0


def _nothing_measured(out: str, codes: list[int], stop: list[int]) -> int:
    """Say why no record came, and that ``out`` is not written; the status as when something was."""
    kept = f"{out} is left as it was" if os.path.exists(out) else f"{out} is not written"
    if stop:
        why, status = f"score was sent {signal.Signals(stop[0]).name}", EXIT_SIGNAL + stop[0]
    elif codes and codes[-1]:
        why, status = f"process {len(codes)} ended with status {codes[-1]}", codes[-1]
    else:
        why, status = "the job called measure() nowhere (an unedited harness? add --do-bench)", 1
    say("score", f"nothing was measured: {why}; {kept}")
    return status


def _compare(words: list[str], given: argparse.Namespace) -> int:
    """``score compare A B``: each result of A against B's of its name; text, or one JSON document
    (``--json`` to stdout, ``--out`` to a file: ``COMPARE_FORMAT``, docs/score.md)."""
    parser = argparse.ArgumentParser(prog="megatron-tuning score compare")
    parser.add_argument("a", help="a score JSON (the candidate)")
    parser.add_argument("b", help="a score JSON (the baseline)")
    parser.add_argument("--margin", type=float, default=0.01, help="same within this fraction (default 0.01)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    parser.add_argument("--out", default=given.out, help="write that JSON document to this file too")
    args = parser.parse_args(words)
    series = [f"--{k.replace('_', '-')}" for k in _SERIES_OPTIONS if getattr(given, k) not in (None, False)]
    problem = (
        f"{', '.join(series)}: an option of a series (score -- COMMAND), not of compare" if series else None
    )
    if not 0 <= args.margin < 1:  # NaN too
        problem = f"--margin {args.margin}: give a fraction in [0, 1), e.g. 0.01"
    if args.out and (unwritable := output_file_problem(args.out)):
        problem = f"cannot write {args.out}: {unwritable}"
    if problem:
        say("score compare", problem)
        return EXIT_USAGE
    try:
        left, right = pooling.load(args.a), pooling.load(args.b)
    except (OSError, ValueError) as exc:
        say("score compare", str(exc))
        return EXIT_USAGE
    by_name = {r["name"]: r for r in right}
    # Two single results compare whatever their names; files of several match results by name.
    single = len(left) == len(right) == 1
    pairs = (
        [(left[0], right[0])] if single else [(r, by_name[r["name"]]) for r in left if r["name"] in by_name]
    )
    names = {r["name"] for r in left}
    unmatched = {
        "a": [] if single else [r["name"] for r in left if r["name"] not in by_name],
        "b": [] if single else [r["name"] for r in right if r["name"] not in names],
    }
    if not pairs:
        say("score compare", f"no result name is in both {args.a} and {args.b}")
        return EXIT_USAGE
    comparisons = [_comparison(a, b, args.a, args.b, args.margin) for a, b in pairs]
    status = EXIT_DEMOTED if any(f["demotes"] for c in comparisons for f in c["flags"]) else 0
    for side, path in (("a", args.a), ("b", args.b)):
        if unmatched[side]:
            say("score compare", f"not compared, only in {path}: {', '.join(unmatched[side])}")
    document = {
        "format": COMPARE_FORMAT,
        "a": args.a,
        "b": args.b,
        "margin": args.margin,
        "comparisons": comparisons,
        "unmatched": unmatched,
        "exit_status": status,
    }
    if args.out:
        write_atomic(args.out, json.dumps(document, indent=1).encode())
    if args.json:
        print(json.dumps(document, indent=1))
        return status
    for c in comparisons:
        low, high = c["ci95"]
        text = f"{c['a']}: {c['ratio']:.4f} [{low:.4f}, {high:.4f}] of {c['b']}"
        print(printable(f"{text} -> {c['outcome']} ({c['reason']})"))
        for found in (f for f in c["flags"] if f["demotes"]):
            print(printable(_flag_line(found)))
    return status


def _flag_line(found: dict[str, Any]) -> str:
    """``  name (file, processes 0, 1, 2): message``; the comparison's own flags name no file."""
    where = [found["file"]] if found["file"] else []
    if found["processes"]:
        where.append("processes " + ", ".join(map(str, found["processes"])))
    return f"  {found['name']}{' (' + ', '.join(where) + ')' if where else ''}: {found['message']}"


_SERIES_OPTIONS = ("table", "processes", "budget_s", "target_ci", "do_bench", "quiet")
_PROCESS = re.compile(r"process (\d+): ")


def _comparison(
    a: dict[str, Any], b: dict[str, Any], file_a: str, file_b: str, margin: float
) -> dict[str, Any]:
    """``pooling.compare``'s verdict, its flags each naming the file it came from (null: the comparison's
    own) and, once per flag, the processes of a pooled result that raised it."""
    verdict = pooling.compare(a, b, margin=margin)
    own = verdict["flags"][len(a["flags"]) + len(b["flags"]) :]  # after both results' own, in order
    flags: dict[tuple[Any, ...], dict[str, Any]] = {}
    for file, found in [*((file_a, f) for f in a["flags"]), *((file_b, f) for f in b["flags"])]:
        match = _PROCESS.match(found["message"])
        message = found["message"][match.end() :] if match else found["message"]
        entry = flags.setdefault(
            (file, found["name"], message, found["demotes"]),
            {
                "name": found["name"],
                "message": message,
                "demotes": found["demotes"],
                "file": file,
                "processes": None,
            },
        )
        if match:
            entry["processes"] = [*(entry["processes"] or []), int(match.group(1))]
    own_flags = [{**f, "file": None, "processes": None} for f in own]
    return {**verdict, "flags": [*flags.values(), *own_flags]}
