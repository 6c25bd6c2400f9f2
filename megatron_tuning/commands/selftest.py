"""``python -m megatron_tuning selftest``: prove on this machine that the agreement check works.

Launches a small torchrun job twice (gloo; CPU and the Triton interpreter when there is no GPU):

1. ``deterministic`` — every rank must pick the same configs: the check must stay quiet.
2. ``chaos`` — every rank picks a different config on purpose: the check must fire, with a
   ``DivergenceError`` naming the kernel, the key and the ranks.

Exit 0 only when both behave: "no error" alone cannot tell a working detector from a blind one.
The job launches the reference kernel ``megatron_tuning.kernels.tiny`` on a few sizes, ends with
``verify_agreement()``, and each rank writes a JSON result the parent reads (no log scraping).
Also runnable as ``python -m megatron_tuning.selftest``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, TextIO

from ..core.decisions import CHAOS_NO_OTHER_CONFIG
from ..tables.files import write_atomic

KERNEL_MODULE = "megatron_tuning.kernels.tiny"
SIZES = (64, 200, 1000)


MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: longer is a typo (and overflows a timedelta later)


def _ranks(text: str) -> int:
    """``--nproc``: an integer of at least 2 (agreement needs two ranks to compare)."""
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
    """``--timeout``: a finite number of seconds, above 0 and at most a week."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, not {text!r}") from None
    if not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds above 0 and at most {MAX_TIMEOUT_S:g}, not {text!r}"
        )
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the ``selftest`` command (bad values are usage errors: exit 2, before any job)."""
    parser.add_argument("--nproc", type=_ranks, default=2, help="ranks per run (>= 2; default 2)")
    parser.add_argument(
        "--timeout", type=_seconds, default=180.0, help="seconds allowed for each torchrun job (default 180)"
    )
    parser.add_argument(
        "--agreement",
        choices=("store", "allgather", "verify", "off"),
        default="store",
        help="agreement mode under test (default store; 'off' shows the chaos run "
        "going unnoticed, so the selftest fails)",
    )
    parser.add_argument(
        "--interpret", action="store_true", help="use the Triton interpreter even when a GPU is present"
    )
    parser.add_argument(
        "--keep", metavar="DIR", default=None, help="write per-rank results and torchrun output under DIR"
    )
    parser.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--_mode", default="deterministic", help=argparse.SUPPRESS)
    parser.add_argument("--_out", default="", help=argparse.SUPPRESS)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run both jobs and print a report; 0 when deterministic passed and chaos was detected."""
    if getattr(args, "_worker", False):
        return _worker(args)
    out = out if out is not None else sys.stdout
    if args.nproc < 2:
        print("selftest: --nproc must be at least 2 (agreement needs two ranks to compare)", file=out)
        return 2
    interpret = args.interpret or not _cuda_available()
    root = args.keep or tempfile.mkdtemp(prefix="megatron_tuning_selftest_")
    passed: bool | None = None  # None: interrupted before a verdict
    try:
        print(
            f"megatron_tuning selftest: {args.nproc} ranks, agreement={args.agreement}, "
            f"{'Triton interpreter on CPU' if interpret else 'GPU'}, gloo",
            file=out,
        )
        verdicts = []
        for mode in ("deterministic", "chaos"):
            outcome = _launch(args, mode, os.path.join(root, mode), interpret)
            ok, summary = _judge(mode, outcome, args.nproc)
            verdicts.append(ok)
            print(f"  {mode:<13} {'PASS' if ok else 'FAIL'}  {summary}", file=out)
            if not ok and outcome.get("output"):
                print("    torchrun output (tail):", file=out)
                for line in outcome["output"].splitlines()[-25:]:
                    print(f"      {line}", file=out)
        passed = all(verdicts)
        print(
            "selftest "
            + ("passed: deterministic runs agree and chaos is detected." if passed else "FAILED."),
            file=out,
        )
        if args.keep or not passed:
            print(f"results kept in {root}", file=out)
        return 0 if passed else 1
    finally:
        # A temp root goes unless a finished run failed: then its logs are what the user needs.
        if not args.keep and passed is not False:
            shutil.rmtree(root, ignore_errors=True)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _launch(args: argparse.Namespace, mode: str, folder: str, interpret: bool) -> dict[str, Any]:
    os.makedirs(folder, exist_ok=True)
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1" if interpret else env.get("TRITON_INTERPRET", "0")
    env.setdefault("OMP_NUM_THREADS", "1")
    # The job must import this very copy of the package, installed or not.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    for name in list(env):  # a user's own MEGATRON_TUNING_* settings must not change the test
        if name.startswith("MEGATRON_TUNING_"):
            del env[name]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        "-m",
        "megatron_tuning.commands.selftest",
        "--_worker",
        f"--_mode={mode}",
        f"--_out={folder}",
        f"--agreement={args.agreement}",
        f"--timeout={args.timeout}",
    ]
    start = time.monotonic()
    # A session of its own, so a timeout kills torchrun and its ranks, not only the launcher.
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    ) as process:
        returncode: int | None
        try:
            output, _ = process.communicate(timeout=args.timeout)
            returncode = process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            returncode = None
    # --keep DIR is the user's folder: the tables' safe writer, never through a planted link.
    write_atomic(os.path.join(folder, "torchrun.log"), output.encode("utf-8"))
    ranks = {}
    for rank in range(args.nproc):
        path = os.path.join(folder, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as handle:
                ranks[rank] = json.load(handle)
    return {"returncode": returncode, "output": output, "ranks": ranks, "seconds": time.monotonic() - start}


def _judge(mode: str, outcome: dict[str, Any], nproc: int) -> tuple[bool, str]:
    """Whether a job behaved as its mode requires, and one line saying why."""
    took = f"({outcome['seconds']:.1f}s)"
    if outcome["returncode"] is None:
        return False, f"torchrun did not finish within the timeout {took}"
    ranks = outcome["ranks"]
    errors = {r: res for r, res in ranks.items() if res.get("error")}
    unexpected = {r: res for r, res in errors.items() if res["error"] != "DivergenceError"}
    if unexpected:
        rank, res = next(iter(sorted(unexpected.items())))
        return False, f"rank {rank} failed with {res['error']}: {res['message'].splitlines()[0]} {took}"
    if len(ranks) != nproc:
        return False, f"only ranks {sorted(ranks)} reported (torchrun exit {outcome['returncode']}) {took}"
    if mode == "deterministic":
        if errors:
            rank, res = next(iter(sorted(errors.items())))
            return False, f"false alarm on ranks {sorted(errors)}: {res['message'].splitlines()[0]} {took}"
        pinned = min(
            sum(1 for d in res.get("decisions", []) if d[3] != "out_of_scope") for res in ranks.values()
        )
        if pinned == 0:
            return False, f"no launch went through the interception, nothing was checked {took}"
        shared = min(res.get("shared", 0) for res in ranks.values())
        return True, (
            f"all ranks agree on {pinned} (kernel, key) choices "
            f"(verify_agreement compared {shared}), no alarm {took}"
        )
    # A key with one distinct config cannot differ between ranks: it proves nothing either way.
    chaos_rows = [d for res in ranks.values() for d in res.get("decisions", []) if d[3] == "chaos"]
    provable = {(d[0], d[1]) for d in chaos_rows if len(d) < 5 or d[4] != CHAOS_NO_OTHER_CONFIG}
    if not errors:
        if not provable:
            return False, (
                f"inconclusive: no chaos key had two distinct configs, so the ranks could not "
                f"differ and this run proves nothing about the check {took}"
            )
        return False, (
            f"chaos ranks launched different configs and nothing noticed: the agreement check is blind {took}"
        )
    messages = {res["message"] for res in errors.values()}
    first = next(iter(sorted(errors.items())))[1]
    named = first.get("signature_ranks", [])
    if len(messages) != 1:
        return False, f"ranks raised different messages for the same divergence {took}"
    return True, (
        f"DivergenceError on ranks {sorted(errors)} for {first['kernel']} key {first['key']}, "
        f"naming ranks {named}; {len(provable)} chaos key(s) could differ {took}"
    )


def _worker(args: argparse.Namespace) -> int:
    """One rank of the selftest job (started by torchrun); always leaves a result file."""
    import logging
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    logging.basicConfig(
        level=logging.WARNING,
        format=f"[rank{os.environ.get('RANK', '?')}] %(levelname)s %(name)s: %(message)s",
    )
    dist.init_process_group("gloo", timeout=timedelta(seconds=max(args.timeout, 10.0)))
    rank = dist.get_rank()
    result: dict[str, Any] = {"rank": rank, "mode": args._mode, "error": None}
    try:
        _exercise(args, rank, result)
    except Exception as error:  # a broken install: report it by name instead of a bare exit code
        _keep_error(result, error)
        result["traceback"] = traceback.format_exc()
        _write_result(args._out, rank, result)
        return 1  # torchrun then stops the other ranks
    _write_result(args._out, rank, result)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _exercise(args: argparse.Namespace, rank: int, result: dict[str, Any]) -> None:
    """Launch the tiny kernel on a few sizes under the policy, then verify_agreement."""
    import torch
    import torch.distributed as dist

    from ..core.decisions import decision_log
    from ..core.errors import MegatronTuningError
    from ..core.policy import TuningPolicy
    from ..distributed import verify
    from ..session import init_deterministic_tuning

    policy = TuningPolicy(
        mode=args._mode,
        scope=(KERNEL_MODULE,),
        agreement=args.agreement,
        agreement_timeout_s=max(args.timeout / 3, 5.0),
        use_shipped_tables=False,
    )
    handle = init_deterministic_tuning(policy)
    if args.agreement != "off" and verify.active_checker() is None:
        raise RuntimeError("init_deterministic_tuning started no agreement check")
    from ..kernels import tiny  # decorated only now: interpreter flag and interception are in place

    on_gpu = os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    try:
        for n in SIZES:
            if result["error"] is None:
                try:
                    x = torch.arange(n, dtype=torch.float32, device=device)
                    if not torch.equal(tiny.add_one(x), x + 1):
                        raise AssertionError(f"add_one computed a wrong result for n={n}")
                except (MegatronTuningError, AssertionError) as error:
                    _keep_error(result, error)
            dist.barrier()  # the same number of collectives on every rank, error or not
        try:
            # Every rank calls it (a collective); it also catches a rank whose own checks passed.
            result["shared"] = verify.verify_agreement() if args.agreement != "off" else 0
        except MegatronTuningError as error:
            if result["error"] is None:
                _keep_error(result, error)
    finally:
        handle.close()
    result["decisions"] = [
        [d.kernel, d.key, d.signature, d.source, d.chaos] for d in decision_log().decisions()
    ]


def _write_result(folder: str, rank: int, result: dict[str, Any]) -> None:
    write_atomic(os.path.join(folder, f"rank{rank}.json"), json.dumps(result, indent=1).encode("utf-8"))


def _keep_error(result: dict[str, Any], error: BaseException) -> None:
    result["error"] = type(error).__name__
    result["message"] = str(error)
    result["kernel"] = getattr(error, "kernel", "")
    result["key"] = getattr(error, "key", "")
    result["signature_ranks"] = sorted(getattr(error, "signatures", {}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_tuning.selftest", description=(__doc__ or "").splitlines()[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
