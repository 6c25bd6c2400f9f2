"""``selftest``: prove on this machine that pinning agrees across ranks and that the check is not blind.

A small torchrun job (gloo) runs twice: ``deterministic`` must agree and match torch with no alarm;
``chaos`` must raise one ``DivergenceError`` on every rank ("no error" alone cannot tell a working
detector from a blind one). ``selftest -- <command>`` runs the user's job instead (``_your_job``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.decisions import CHAOS_NO_OTHER_CONFIG
from ..core.policy import AGREEMENT_MODES, ENV_MODE, MAX_AGREEMENT_TIMEOUT_S, PREFIX
from ..tables.files import write_atomic
from . import EXIT_USAGE, job
from .bootstrap import PACKAGE_PARENT, PLUMBING, hold_lifeline, stop_with_launcher
from .job import EXIT_TIMEOUT, add_job_argument, handle_signals, job_argv, job_command, preexec, run_armed

KERNEL_MODULE = "megatron_tuning.kernels"
CPU_SHAPES = ((37, 29, 45), (64, 48, 40))  # interpreted launches cost ~0.2 s: small, odd shapes
GPU_SHAPES = ((4096, 4096, 4096), (8192, 1024, 4096), (1, 4096, 4096))


def _ranks(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer number of ranks, not {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"must be at least 2 (agreement needs two ranks to compare), not {value}"
        )
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, not {text!r}") from None
    if not math.isfinite(value) or not 0 < value <= MAX_AGREEMENT_TIMEOUT_S:
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds above 0 and at most {MAX_AGREEMENT_TIMEOUT_S:g}, not {text!r}"
        )
    return value


def add_selftest(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=_ranks, default=2, help="ranks per run (>= 2; default 2)")
    parser.add_argument(
        "--timeout", type=_seconds, default=240.0, help="seconds allowed for each job run (default 240)"
    )
    help = "agreement mode under test (default store; 'off' shows chaos unnoticed: the selftest fails)"
    parser.add_argument("--agreement", choices=AGREEMENT_MODES, default="store", help=help)
    parser.add_argument("--interpret", action="store_true", help="use the Triton interpreter even with a GPU")
    parser.add_argument(
        "--show", action="store_true", help="print each phase's launches, per kernel and shape"
    )
    parser.add_argument("--keep", metavar="DIR", help="write per-rank results and job output under DIR")
    add_job_argument(parser, "your own job after `--` (as for `run`): run deterministic, then chaos")


Launch = Callable[[argparse.Namespace, str, str, bool], dict[str, Any]]  # (args, mode, folder, interpret)


def run_selftest(args: argparse.Namespace, *, launch: Launch | None = None) -> int:
    """Run both jobs and print a report; 0 when deterministic passed and chaos was detected.
    ``launch`` runs one job and returns its outcome (default: torchrun over this package's workers)."""
    if args.job:
        command = job_command(args, "selftest", "selftest -- torchrun --nproc_per_node 2 train.py")
        return EXIT_USAGE if command is None else _your_job(command, args.timeout, args.keep)
    import torch

    interpret = args.interpret or not torch.cuda.is_available()
    root = args.keep or tempfile.mkdtemp(prefix="megatron_tuning_selftest_")
    # A watcher removes a temp root if this process is killed (SIGKILL included), as `run` does.
    with job.job_group(False, [] if args.keep else [Path(root)]):
        passed: bool | None = None  # None: interrupted before a verdict
        try:
            where = "Triton interpreter on CPU" if interpret else "GPU"
            print(
                f"megatron_tuning selftest: {args.nproc} ranks, agreement={args.agreement}, {where}, gloo",
                flush=True,
            )
            verdicts = []
            for mode in ("deterministic", "chaos"):
                outcome = (launch or _launch)(args, mode, os.path.join(root, mode), interpret)
                ok, summary = _judge(mode, outcome, args.nproc)
                verdicts.append(ok)
                print(f"  {mode:<13} {'PASS' if ok else 'FAIL'}  {summary} ({outcome['seconds']:.1f}s)")
                if args.show:
                    _show(mode, outcome)
                if not ok and outcome.get("output"):
                    _print_tail("torchrun output", outcome["output"])
            passed = all(verdicts)
            verdict = "passed: deterministic runs agree and chaos is detected." if passed else "FAILED."
            print(f"selftest {verdict}")
            if args.keep or not passed:
                print(f"results kept in {root}")
            return 0 if passed else 1
        finally:
            # A temp root goes unless a finished run failed: then its logs are what the user needs.
            if not args.keep and passed is not False:
                shutil.rmtree(root, ignore_errors=True)


def _your_job(command: list[str], timeout: float, keep: str | None) -> int:
    """The user's job under ``run``'s launcher, deterministic then chaos, each within ``timeout``: 0
    only when the first exits 0 and in the second some process raised a ``DivergenceError``. The
    job's output goes to a log per run (its ranks' tracebacks would make a passing CI log look failed)."""
    problem = job.command_problem(job_argv(command), os.environ)
    if problem is not None:  # as `run` says it, with its status (127, 126)
        job.say("selftest", problem[1])
        return problem[0]
    logs = Path(keep or tempfile.mkdtemp(prefix="megatron_tuning_selftest_"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"megatron_tuning selftest: your job, deterministic then chaos: {shlex.join(command)}", flush=True)
    for mode in ("deterministic", "chaos"):
        start, log = time.monotonic(), logs / f"{mode}.log"
        with open(log, "wb") as output:
            code, caught = run_armed(
                job_argv(command), {ENV_MODE: mode}, "selftest", timeout=timeout, output=output
            )
        ok, summary = _judge_your_job(mode, code, caught)
        print(f"  {mode:<13} {'PASS' if ok else 'FAIL'}  {summary} ({time.monotonic() - start:.1f}s)")
        if not ok:
            if said := log.read_text(encoding="utf-8", errors="replace"):
                _print_tail(f"{mode} run's output", said)
            print(f"selftest FAILED. Each run's full output: {logs}")
            return 1
    print("selftest passed: the deterministic run agreed and chaos was detected in your job.")
    print(f"Each run's full output: {logs}")
    return 0


def _judge_your_job(mode: str, code: int, caught: int) -> tuple[bool, str]:
    """Whether a run of the user's job behaved as its mode requires, and one line saying why."""
    raised = f"{caught} process(es) raised DivergenceError"
    if mode == "deterministic":
        if caught:
            return False, f"{raised}: ranks launched different configs; this run must agree"
        return code == 0, "exited 0, no divergence" if code == 0 else f"exited {code}; it must exit 0 first"
    if caught:
        return True, f"{raised} (exit status {code}): the check fired"
    if code == EXIT_TIMEOUT:
        return False, "stopped at the timeout (--timeout) before any process raised DivergenceError"
    return False, (
        f"chaos could not fire: no process raised DivergenceError (exit status {code}, which is not proof). "
        "Chaos plants a difference only in an in-scope autotuned kernel with two or more configs, launched "
        "with one key on two or more ranks, with the agreement check on: this job has no such launch, so "
        "nothing proves the check works for it."
    )


def _exit_by(number: int) -> None:
    raise SystemExit(128 + number)  # cleanup runs, as for Ctrl-C


def _print_tail(title: str, text: str, lines: int = 25) -> None:
    print(f"    {title} (tail):")
    for line in text.splitlines()[-lines:]:
        print(f"      {line}")


def _launch(args: argparse.Namespace, mode: str, folder: str, interpret: bool) -> dict[str, Any]:
    os.makedirs(folder, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith((PREFIX, PLUMBING))}  # not the user's
    env["TRITON_INTERPRET"] = "1" if interpret else env.get("TRITON_INTERPRET", "0")
    env.setdefault("OMP_NUM_THREADS", "1")
    # The job must import this very copy of the package, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_PARENT, env.get("PYTHONPATH", "")) if p)
    lifeline = Path(folder, "lifeline")
    lifeline.touch()
    worker = {"mode": mode, "out": folder, "agreement": args.agreement, "timeout": args.timeout}
    worker["lifeline"] = str(lifeline)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    command = [*argv, "-m", __name__, json.dumps(worker)]
    start = time.monotonic()
    # Tied to this process, as `run`'s jobs are: torchrun by the parent-death signal, its ranks (in
    # sessions of their own) by the lifeline; a session of its own, so a timeout or a signal to this
    # process kills torchrun and its ranks with it.
    held = hold_lifeline(lifeline)
    stopped = handle_signals((signal.SIGTERM, signal.SIGHUP), _exit_by)
    with subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=preexec(None),
    ) as process:
        returncode: int | None
        try:
            output, _ = process.communicate(timeout=args.timeout)
            returncode = process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            returncode = None
        except BaseException:  # Ctrl-C, SIGTERM (``_exit_by``): the job goes with this process
            os.killpg(process.pid, signal.SIGKILL)
            raise
        finally:
            os.close(held)
            stopped()
    write_atomic(os.path.join(folder, "torchrun.log"), output.encode("utf-8"))  # never through a planted link
    files = {r: Path(folder, f"rank{r}.json") for r in range(args.nproc)}
    ranks = {r: json.loads(path.read_text(encoding="utf-8")) for r, path in files.items() if path.exists()}
    return {"returncode": returncode, "output": output, "ranks": ranks, "seconds": time.monotonic() - start}


def _judge(mode: str, outcome: dict[str, Any], nproc: int) -> tuple[bool, str]:
    """Whether a job behaved as its mode requires, and one line saying why (the caller adds the time)."""
    if outcome["returncode"] is None:
        return False, "torchrun did not finish within the timeout"
    ranks = outcome["ranks"]
    errors = {r: res for r, res in ranks.items() if res.get("error")}
    unexpected = {r: res for r, res in errors.items() if res["error"] != "DivergenceError"}
    if unexpected:
        rank, res = min(unexpected.items())
        return False, f"rank {rank} failed with {res['error']}: {res['message'].splitlines()[0]}"
    if len(ranks) != nproc:
        return False, f"only ranks {sorted(ranks)} reported (torchrun exit {outcome['returncode']})"
    if mode == "deterministic":
        if errors:
            rank, res = min(errors.items())
            return False, f"false alarm on ranks {sorted(errors)}: {res['message'].splitlines()[0]}"
        pinned = min(sum(d[3] != "out_of_scope" for d in res.get("decisions", [])) for res in ranks.values())
        if pinned == 0:
            return False, "no launch went through the interception, nothing was checked"
        shared = min(res.get("shared", 0) for res in ranks.values())
        compared = f"(verify_agreement compared {shared})"
        return True, f"all ranks agree on {pinned} (kernel, key) choices {compared}, no alarm"
    # A key with one distinct config cannot differ between ranks: it proves nothing either way.
    chaos = [d for res in ranks.values() for d in res.get("decisions", []) if d[3] == "chaos"]
    provable = {(d[0], d[1]) for d in chaos if len(d) < 5 or d[4] != CHAOS_NO_OTHER_CONFIG}
    if not errors:
        if not provable:
            why = "no chaos key had two distinct configs, so the ranks could not differ"
            return False, f"inconclusive: {why} and this run proves nothing about the check"
        blind = "chaos ranks launched different configs and nothing noticed: the agreement check is blind"
        return False, blind
    if len({res["message"] for res in errors.values()}) != 1:
        return False, "ranks raised different messages for the same divergence"
    first = errors[min(errors)]
    return True, (
        f"DivergenceError on ranks {sorted(errors)} for {first['kernel']} key {first['key']}, naming "
        f"ranks {first.get('signature_ranks', [])}; at least {len(provable)} chaos key(s) could differ "
        f"(those reached before the error stopped the run)"
    )


def _show(mode: str, outcome: dict[str, Any]) -> None:
    """Rank 0's decisions as a table (kernel, key, config, source), then the error it raised."""
    result = outcome["ranks"].get(0, {})
    rows = [("kernel", "key", "config", "source")]
    rows += [
        (d[0].split(":")[-1], d[1], d[2], d[3] + (f" ({d[5]})" if len(d) > 5 and d[5] else ""))
        for d in result.get("decisions", [])
        if d[3] != "out_of_scope"
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    print(f"    == {mode}: rank 0's launches")
    for row in rows:
        print("    " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    if result.get("message"):
        print("    " + result["message"].replace("\n", "\n    "))


def _worker(argv: list[str]) -> int:  # argv: the parent's settings, one JSON object
    """One rank of the selftest job (started by torchrun); it always leaves a result file."""
    import logging
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    args = argparse.Namespace(**json.loads(argv[0]))
    stop_with_launcher(args.lifeline)
    rank_tag = f"[rank{os.environ.get('RANK', '?')}]"
    logging.basicConfig(level=logging.WARNING, format=f"{rank_tag} %(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo", timeout=timedelta(seconds=max(args.timeout, 10.0)))
    rank = dist.get_rank()
    result: dict[str, Any] = {"rank": rank, "mode": args.mode, "error": None}
    try:
        _exercise(args, result)
    except Exception as error:  # a broken install: reported by name, not as a bare exit code
        _keep_error(result, error)
        result["traceback"] = traceback.format_exc()
    write_atomic(os.path.join(args.out, f"rank{rank}.json"), json.dumps(result, indent=1).encode("utf-8"))
    if "traceback" in result:
        return 1  # torchrun then stops the other ranks
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _exercise(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Launch every reference kernel on every shape under the policy, then verify_agreement."""
    import torch
    import torch.distributed as dist

    from ..core.decisions import decision_log
    from ..core.errors import MegatronTuningError
    from ..core.policy import TuningPolicy
    from ..distributed.agreement import active_checker, verify_agreement
    from ..session import init_deterministic_tuning

    timeout = max(args.timeout / 3, 5.0)
    policy = TuningPolicy(
        mode=args.mode, scope=(KERNEL_MODULE,), agreement=args.agreement, agreement_timeout_s=timeout
    )
    on_gpu = os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available()
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count()) if on_gpu else "cpu"
    shapes, dtype = (GPU_SHAPES, torch.bfloat16) if on_gpu else (CPU_SHAPES, torch.float32)
    with init_deterministic_tuning(policy):
        if args.agreement != "off" and active_checker() is None:
            raise RuntimeError("init_deterministic_tuning started no agreement check")
        try:
            if failures := reference_workload(device, shapes, dtype):
                raise AssertionError("wrong results: " + "; ".join(failures))
        except (MegatronTuningError, AssertionError) as error:
            _keep_error(result, error)
        try:  # every rank calls it (a collective); it also catches a rank whose own checks passed
            result["shared"] = verify_agreement() if args.agreement != "off" else 0
        except MegatronTuningError as error:
            if result["error"] is None:
                _keep_error(result, error)
    result["decisions"] = [
        [d.kernel, d.key, d.signature, d.source, d.chaos, d.origin] for d in decision_log().decisions()
    ]


def reference_workload(device: Any, shapes: Any, dtype: Any) -> list[str]:
    """Launch every reference kernel on every shape (the same inputs on every rank); return the
    launches whose result differs from torch's. Imports (so decorates) the kernels: call it after
    ``init_deterministic_tuning`` and with ``TRITON_INTERPRET`` set as the job needs."""
    import torch

    from .. import kernels

    generator = torch.Generator().manual_seed(0)
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    failures = []
    for m, n, k in shapes:
        a, b = (torch.randn(shape, generator=generator).to(device, dtype) for shape in ((m, k), (k, n)))
        x = torch.randn(m * n, generator=generator).to(device, dtype)
        for name, got, want, tolerance in (
            ("matmul", kernels.matmul(a, b), a.float() @ b.float(), tol * max(1.0, k**0.5)),
            ("splitk_matmul", kernels.splitk_matmul(a, b), a.float() @ b.float(), tol * max(1.0, k**0.5)),
            ("add_one", kernels.add_one(x), x.float() + 1, tol),
        ):
            if not torch.allclose(got.float().cpu(), want.float().cpu(), atol=tolerance, rtol=tolerance):
                failures.append(
                    f"{name} {m}x{n}x{k}: max abs error {(got.float() - want.float()).abs().max().item():.3g}"
                )
    return failures


def _keep_error(result: dict[str, Any], error: BaseException) -> None:
    result["error"], result["message"] = type(error).__name__, str(error)
    result["kernel"], result["key"] = getattr(error, "kernel", ""), getattr(error, "key", "")
    result["signature_ranks"] = sorted(getattr(error, "signatures", {}))


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
