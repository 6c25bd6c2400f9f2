"""``score [options] -- <command>``: the command in N fresh pinned processes, their ``measure``
records pooled into one JSON; ``score compare A B``; ``score noise-floor -- <command>``; and the
in-process side of ``run --score-do-bench`` (``triton.testing.do_bench`` routed through ``measure``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
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
from . import EXIT_USAGE
from .launch import add_job_argument, command_problem, job_argv, job_command, run_armed, validated_policy

EXIT_INCORRECT, EXIT_DEMOTED = 3, 4
EXAMPLES = """\
examples:
  python -m megatron_tuning score --processes 5 --table t.msgpack --out score.json -- eval.py --candidate k.py
      eval.py calls megatron_tuning.score.measure(...): 5 fresh processes, every record pooled
  python -m megatron_tuning score --do-bench -- eval.py
      an unedited harness: each triton.testing.do_bench call is scored by measure
  python -m megatron_tuning score noise-floor --processes 5 -- eval.py
      A/A: each measure call times its candidate against an independent instance of itself
  python -m megatron_tuning score compare new.json old.json --margin 0.02

Every process is pinned (deterministic, a table miss is an error). Exit status: 0 ok; 3 a
correctness check failed; 4 a clock or integrity flag demoted a result; the job's own status when
it failed; 2 for bad options. See docs/score.md.
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
    parser.add_argument("--processes", type=int, default=3, help="fresh processes to run (default 3)")
    parser.add_argument(
        "--budget-s", type=float, help="each measure call's time budget (overrides the job's)"
    )
    parser.add_argument("--target-ci", type=float, help="stop at this 95%% half-width (overrides the job's)")
    parser.add_argument("--out", default="score.json", help="the pooled JSON (default score.json)")
    parser.add_argument(
        "--do-bench", action="store_true", help="score the job's triton.testing.do_bench calls"
    )


def run_score(args: argparse.Namespace) -> int:
    words = list(args.job or [])
    if words[:1] == ["compare"]:
        return _compare(words[1:])
    noise = words[:1] == ["noise-floor"]
    if noise:
        sub = argparse.ArgumentParser(prog="megatron-tuning score noise-floor")
        _add_options(sub)
        add_job_argument(sub)
        given = {k: v for k, v in vars(args).items() if k != "job"}
        args = sub.parse_args(words[1:], namespace=argparse.Namespace(**given))
    command = job_command(args, "score", "score --processes 3 -- eval.py")
    if command is None:
        return EXIT_USAGE
    problem = _options_problem(args)
    updates = {knobs.ENV_MODE: "deterministic", knobs.ENV_ON_MISS: "error"}
    tables = [*(args.table or []), *filter(None, os.environ.get(knobs.ENV_TABLE, "").split(":"))]
    if tables:
        updates[knobs.ENV_TABLE] = ":".join(tables)
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
    return run_scored(
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


def run_scored(
    argv: Sequence[str], updates: dict[str, str], job: dict[str, Any], out: str, processes: int = 1
) -> int:
    """Run ``argv`` armed ``processes`` times in a row, each writing its records to one folder; pool
    them into ``out``. ``run --score-do-bench`` calls this with one run of the job."""
    problem = output_file_problem(out)
    if problem:
        print(f"score: cannot write {out}: {problem}", file=sys.stderr)
        return EXIT_USAGE
    work = Path(tempfile.mkdtemp(prefix="megatron_tuning_score_"))
    codes: list[int] = []
    try:
        for index in range(processes):
            if processes > 1:
                print(f"score: process {index + 1} of {processes}: {' '.join(argv)}", file=sys.stderr)
            environment = {**updates, knobs.ENV_SCORE: json.dumps({**job, "dir": str(work)})}
            codes.append(run_armed(argv, environment, "score"))
            if codes[-1]:
                print(f"score: process {index + 1} exited with status {codes[-1]}; stopping", file=sys.stderr)
                break
        per_process = pooling.read_job(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = pooling.pool(per_process)
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
    if codes[-1]:
        return codes[-1]
    if not results:
        print(
            "score: the job called measure() nowhere (an unedited harness? add --do-bench)", file=sys.stderr
        )
        return 1
    statuses = {r["status"] for r in results}
    return EXIT_INCORRECT if "incorrect" in statuses else EXIT_DEMOTED if "demoted" in statuses else 0


def _compare(words: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-tuning score compare")
    parser.add_argument("a", help="a score JSON (the candidate)")
    parser.add_argument("b", help="a score JSON (the baseline)")
    parser.add_argument("--margin", type=float, default=0.01, help="same within this fraction (default 0.01)")
    args = parser.parse_args(words)
    try:
        left, right = pooling.load(args.a), pooling.load(args.b)
    except (OSError, ValueError) as exc:
        print(f"score compare: {exc}", file=sys.stderr)
        return EXIT_USAGE
    by_name = {r["name"]: r for r in right}
    # Two single results compare whatever their names; files of several match results by name.
    single = len(left) == len(right) == 1
    pairs = (
        [(left[0], right[0])] if single else [(r, by_name[r["name"]]) for r in left if r["name"] in by_name]
    )
    if not pairs:
        print(f"score compare: no result name is in both {args.a} and {args.b}", file=sys.stderr)
        return EXIT_USAGE
    demoted = False
    for a, b in pairs:
        verdict = pooling.compare(a, b, margin=args.margin)
        demoted |= any(f["demotes"] for r in (a, b) for f in r["flags"])
        low, high = verdict["ci95"]
        text = f"{a['name']}: {verdict['ratio']:.4f} [{low:.4f}, {high:.4f}] of {b['name']}"
        print(printable(f"{text} -> {verdict['outcome']} ({verdict['reason']})"))
    return EXIT_DEMOTED if demoted else 0


def activate_score() -> None:
    """In a process of a ``score`` job (or ``run --score-do-bench``): route ``do_bench`` if asked."""
    if pooling.job_settings().get("do_bench"):
        route_do_bench()


def route_do_bench() -> None:
    """Make ``triton.testing.do_bench`` score through ``measure`` (Triton's own callers keep the
    original): the caller gets the median (or its quantiles, min, max, every round) in ms, the record
    lands in the job's score file, named by call site and call count."""
    import triton.testing as testing

    from ..score import measure

    original = testing.do_bench
    if getattr(original, "_megatron_tuning_routed", False):
        return
    calls: collections.Counter[str] = collections.Counter()

    def do_bench(
        fn: Any,
        warmup: Any = 25,
        rep: Any = 100,
        grad_to_none: Any = None,
        quantiles: Any = None,
        return_mode: str = "mean",
        **extra: Any,
    ) -> Any:
        caller = sys._getframe(1)
        if str(caller.f_globals.get("__name__", "")).startswith("triton."):  # the autotuner's own timing
            return original(fn, warmup, rep, grad_to_none, quantiles, return_mode, **extra)
        site = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
        calls[site] += 1

        def call() -> Any:
            for tensor in grad_to_none or ():
                tensor.grad = None
            return fn()

        score = measure(call, name=f"do_bench@{site}#{calls[site]}", check=None)
        kept = [
            v for v, k in zip(score.record["samples"]["candidate_ms"], score.record["samples"]["kept"]) if k
        ]
        if quantiles is not None:
            import numpy as np

            return [float(q) for q in np.quantile(kept, list(quantiles))]
        summary = {"mean": score.median_ms, "median": score.median_ms, "min": min(kept), "max": max(kept)}
        return kept if return_mode == "all" else summary[return_mode]

    do_bench._megatron_tuning_routed = True  # type: ignore[attr-defined]
    testing.do_bench = do_bench
    print(
        "megatron_tuning: triton.testing.do_bench is scored by megatron_tuning.score.measure", file=sys.stderr
    )
