"""Zero-edit use across real torchrun ranks (gloo, CPU, Triton interpreter).

``python -m megatron_tuning run -- torchrun ... unedited_job.py``: a job that never mentions the
library, creates its process group after importing its kernels, and must still be pinned on every
rank with the agreement check on (chaos is caught) and ``auto``'s decisions shared. And the same
late attach for a job that calls ``init_deterministic_tuning`` before ``init_process_group``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _launch import REPO, WORKERS, alive, gloo_available, job_env, read_results, run_bounded

from megatron_tuning.core.decisions import Decision
from megatron_tuning.core.errors import EXIT_DIVERGENCE
from megatron_tuning.tables.records import read_decisions

NPROC = 2


@pytest.fixture(autouse=True)
def _needs_gloo() -> None:
    if not gloo_available():
        pytest.skip("torch.distributed with gloo is not available")


def _torchrun() -> list[str]:
    """The ``torchrun`` program of this interpreter's environment (else its module form)."""
    program = Path(sys.executable).parent / "torchrun"
    return [str(program)] if program.exists() else [sys.executable, "-m", "torch.distributed.run"]


def _run_unedited(
    tmp: Path,
    *options: str,
    env: tuple[str, ...] = (),
    job_args: tuple[str, ...] = (),
    command_name: str = "run",
    nproc: int = NPROC,
) -> tuple[Any, dict[int, dict[str, Any]]]:
    out = tmp / "out"
    out.mkdir()
    command = [
        *(("env", *env) if env else ()),
        sys.executable,
        "-m",
        "megatron_tuning",
        command_name,
        *options,
        "--",
        *_torchrun(),
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(WORKERS / "unedited_job.py"),
        str(out),
        *job_args,
    ]
    done = run_bounded(command, tmp, 240, "run -- torchrun unedited_job.py")
    return done, read_results(out, nproc)


def _decisions(path: Path) -> list[Decision]:
    """A rank's decisions for ``add_kernel``, read back as the library reads a decision log."""
    return [d for d in read_decisions(path) if d.kernel.endswith(":add_kernel")]


def test_run_pins_every_rank_of_an_unedited_torchrun_job_with_notices_once_per_job_or_rank(
    tmp_path: Path,
) -> None:
    log = tmp_path / "d-{rank}.json"
    done, results = _run_unedited(
        tmp_path, "--no-shipped-tables", "--decision-log", str(log), env=("MEGATRON_TUNING_TABLES=x",)
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [results[r]["error"] for r in range(NPROC)] == [None] * NPROC
    per_rank = [_decisions(tmp_path / f"d-{rank}.json") for rank in range(NPROC)]
    assert all(len(d) == 3 and {x.source for x in d} == {"cheapest"} for d in per_rank)
    assert [(d.key, d.signature) for d in per_rank[0]] == [(d.key, d.signature) for d in per_rank[1]]
    assert [d.rank for d in per_rank[1]] == [1, 1, 1]
    # At the user's frame, never the launcher's: a notice of the job's settings once per job (rank
    # 0's), one of what a rank launched (another rank may launch other kernels) by each rank.
    notices = [line for line in done.stderr.splitlines() if "TuningWarning: megatron_tuning:" in line]
    kernels, job = str(REPO / "tests" / "support_kernels.py"), str(WORKERS / "unedited_job.py")
    assert sorted(line.split(": TuningWarning")[0].rsplit(":", 1)[0] for line in notices) == sorted(
        [kernels]  # the typo'd variable: the job's `import triton`
        + [kernels] * NPROC  # the cheapest-config fallback: the launch
        + [job] * NPROC  # the count at exit: no frame of the job runs, so its program
    ), notices
    assert sum("MEGATRON_TUNING_TABLES" in line for line in notices) == 1, notices


def test_a_divergence_the_check_at_close_finds_fails_the_job(tmp_path: Path) -> None:
    """verify checks at close (atexit here): before, the divergence was only logged and run exited 0.
    The last of 3 ranks never imports Triton: it joins the check with an empty log (before, it never
    did, so the others' check timed out, said it did not run, and the job exited 0)."""
    done, results = _run_unedited(
        tmp_path,
        "--mode",
        "chaos",
        "--agreement",
        "verify",
        "--agreement-timeout",
        "10",  # what the check at close would wait for the missing rank
        job_args=("--keep-group", "--last-rank-without-triton"),
        nproc=3,
    )
    assert [results[r]["error"] for r in range(3)] == [None] * 3  # nothing seen while it ran
    assert done.returncode == EXIT_DIVERGENCE, done.stdout[-3000:] + done.stderr[-3000:]
    assert "did not run" not in done.stderr
    assert "exitcode  : 3" in done.stderr  # each rank's own status, as torchrun reports it


def test_selftest_of_a_job_chaos_can_catch_passes(tmp_path: Path) -> None:
    """Its chaos run is ``run --mode chaos``: the agreement check is on in an unedited job."""
    logs = tmp_path / "logs"
    done, results = _run_unedited(tmp_path, "--keep", str(logs), command_name="selftest")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "selftest passed" in done.stdout and f"Each run's full output: {logs}" in done.stdout
    assert "chaos         PASS  2 process(es) raised DivergenceError" in done.stdout
    # A summary, not the ranks' tracebacks (a passing CI log looked failed): those are in the log.
    assert "Traceback" not in done.stdout + done.stderr and len(done.stdout.splitlines()) <= 5, done.stdout
    assert {path.name for path in logs.iterdir()} == {"deterministic.log", "chaos.log"}
    # The chaos run wrote last: one message, naming the kernel and each rank's config.
    assert [results[r]["error"] for r in range(NPROC)] == ["DivergenceError"] * NPROC, results
    message = results[0]["message"]
    assert (
        "tests.support_kernels:add_kernel" in message
        and "Rank(s) [0]" in message
        and "Rank(s) [1]" in message
    )
    assert "Planted by chaos mode" in message


def test_selftest_of_a_job_chaos_cannot_reach_fails_and_says_why(tmp_path: Path) -> None:
    done, _ = _run_unedited(tmp_path, command_name="selftest", job_args=("--own-sizes",))  # no shared key
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "chaos         FAIL  chaos could not fire" in done.stdout and "selftest FAILED" in done.stdout


def test_auto_shares_one_decision_per_key_in_an_unedited_torchrun_job(tmp_path: Path) -> None:
    log = tmp_path / "d-{rank}.json"
    cache = tmp_path / "cache.msgpack"
    done, results = _run_unedited(
        tmp_path, "--mode", "auto", "--cache", str(cache), "--no-shipped-tables", "--decision-log", str(log)
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [results[r]["error"] for r in range(NPROC)] == [None] * NPROC
    per_rank = [_decisions(tmp_path / f"d-{rank}.json") for rank in range(NPROC)]
    for key in {d.key for d in per_rank[0]}:
        rows = sorted(
            (d for decisions in per_rank for d in decisions if d.key == key), key=lambda d: d.source
        )
        assert [d.source for d in rows] == ["adopted", "tuned"], rows
        assert len({d.signature for d in rows}) == 1
        # The adopting rank caches the publisher's timings, and its decision names the publisher
        # (its "adopted ..." progress line is logging's: the job configures none, so none is shown).
        assert rows[0].timings == rows[1].timings and rows[1].timings and rows[1].timings["candidates"]
        assert rows[0].origin == f"rank {rows[1].rank}"
        assert "adopted " not in done.stderr


def test_auto_in_a_pipeline_never_waits_for_a_rank_that_waits_for_it(tmp_path: Path) -> None:
    """Under the launcher a session starts at a rank's first launch, and rank 0 (a later pipeline
    stage) waits in a receive for the last rank's kernels: the last rank must tune and publish
    without waiting for rank 0, which then adopts its decisions."""
    log = tmp_path / "d-{rank}.json"
    done, results = _run_unedited(
        tmp_path,
        "--mode",
        "auto",
        "--cache",
        str(tmp_path / "cache.msgpack"),
        "--no-shipped-tables",
        "--decision-log",
        str(log),
        job_args=("--pipeline",),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [results[r]["error"] for r in range(NPROC)] == [None] * NPROC, results
    per_rank = [_decisions(tmp_path / f"d-{rank}.json") for rank in range(NPROC)]
    assert [len(d) for d in per_rank] == [3] * NPROC
    for key in {d.key for d in per_rank[0]}:
        rows = [d for decisions in per_rank for d in decisions if d.key == key]
        assert len({d.signature for d in rows}) == 1, rows
        # The last rank tuned alone; rank 0 found its answer published when it could launch.
        assert sorted(d.source for d in rows) == ["adopted", "tuned"], rows


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal and /proc: Linux")
def test_a_harness_that_kills_run_stops_every_rank_and_every_cache_write(tmp_path: Path) -> None:
    """An eval pipeline's ``subprocess.run(..., timeout=)`` SIGKILLs only the launcher. torchrun and
    its workers (in sessions of their own) must be gone 2 s later, and nothing may reach the ``auto``
    cache after the kill. Before, the orphaned ranks kept tuning and writing the cache."""
    out, cache = tmp_path / "out", tmp_path / "cache.msgpack"
    out.mkdir()
    command = [sys.executable, "-m", "megatron_tuning", "run", "--mode", "auto", "--cache", str(cache)]
    command += ["--", *_torchrun(), "--standalone", f"--nproc_per_node={NPROC}"]
    command += [str(WORKERS / "unedited_job.py"), str(out), "--until-killed"]
    with open(tmp_path / "log", "wb") as log:
        env = {**job_env(tmp_path), "TMPDIR": str(tmp_path)}  # a killed `run` leaves its folder there
        launcher = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=log, stderr=log)
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        ready = [out / f"pids{rank}" for rank in range(NPROC)]
        while not (cache.exists() and all(p.exists() for p in ready)) and launcher.poll() is None:
            assert time.monotonic() < deadline, "the job never started tuning"
            time.sleep(0.1)
        assert launcher.poll() is None, (tmp_path / "log").read_text()[-3000:]
        pids = {int(pid) for path in ready for pid in path.read_text().split()}  # the ranks and torchrun
        assert len(pids) == NPROC + 1 and all(map(alive, pids))
        launcher.kill()  # what subprocess.run does at its timeout
        launcher.wait()
        written = cache.stat()
        deadline = time.monotonic() + 2.0
        while any(map(alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(filter(alive, pids)) == [], "processes of the job outlived the launcher"
        time.sleep(0.5)
        assert (cache.stat().st_mtime_ns, cache.stat().st_ino) == (written.st_mtime_ns, written.st_ino)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in filter(alive, pids):
            os.kill(pid, signal.SIGKILL)


# -- init_deterministic_tuning before init_process_group ---------------------------------------


def _late(tmp: Path, mode: str, timeout_s: float = 240) -> dict[int, dict[str, Any]]:
    out = tmp / mode
    out.mkdir()
    command = [
        *_torchrun(),
        "--standalone",
        f"--nproc_per_node={NPROC}",
        str(WORKERS / "late_attach_worker.py"),
        "--out",
        str(out),
        "--mode",
        mode,
    ]
    done = run_bounded(command, tmp, timeout_s, f"late_attach_worker.py {mode}")
    results = read_results(out, NPROC)
    assert done.returncode == 0 and len(results) == NPROC, done.stdout[-3000:] + done.stderr[-3000:]
    return results


def test_init_before_the_group_still_catches_chaos(tmp_path: Path) -> None:
    results = _late(tmp_path, "chaos")
    assert "DivergenceError" in {results[r]["error"] for r in range(NPROC)}, results
    # Every rank raises it once: at a launch, or (one that claimed first and never checked again) at
    # close. Before, the close raised it again on a rank whose caller had caught it at a launch.
    for r in range(NPROC):
        raised = [results[r]["error"], (results[r]["close"] or {}).get("error")]
        assert sorted(raised, key=str) == ["DivergenceError", None], (r, results[r])


def test_init_before_the_group_still_shares_auto_decisions(tmp_path: Path) -> None:
    results = _late(tmp_path, "auto")
    assert [results[r]["error"] for r in range(NPROC)] == [None] * NPROC, results
    assert [results[r]["close"] for r in range(NPROC)] == [None] * NPROC, results
    for n in (101, 102, 103):
        rows = [d for r in range(NPROC) for d in results[r]["decisions"] if d["key"].startswith(f"n={n} ")]
        assert sorted(d["source"] for d in rows) == ["adopted", "tuned"], rows  # before: tuned, tuned
        assert len({d["signature"] for d in rows}) == 1


# A failed attach: its rank's later keys and checks raise the same error, within the worker's
# agreement timeout (5 s); before, the attach was marked done first, so the rank ran on unchecked.
FAILED_ATTACH_S = 5.0


@pytest.fixture(scope="module")
def failed_job(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return _late(tmp_path_factory.mktemp("failed_attach"), "failed", timeout_s=90)


def test_a_failed_late_attach_fails_that_ranks_later_keys_and_checks_and_hangs_no_rank(
    failed_job: dict[int, dict[str, Any]],
) -> None:
    results = failed_job
    failed = results[1]["attach"]  # rank 1's policy differs: its attach compares the inputs second
    assert results[0]["attach"] is None
    assert failed["error"] == "InputMismatchError", failed
    assert "policy.block_sizes: rank 0: -; rank 1: BLOCK=64" in failed["message"], failed
    # Before: rank 1's next key ran unchecked, and its verify_agreement died of a gloo timeout.
    assert results[1]["next_key"] == failed and results[1]["verify"] == failed, results[1]
    assert results[0]["next_key"] == failed and results[0]["verify"] == failed, results[0]  # the store flag
    assert all(results[r]["verify_s"] < FAILED_ATTACH_S for r in range(NPROC)), results


def test_auto_past_its_rank_cap_is_refused_at_init_where_torchrun_gives_the_size(
    failed_job: dict[int, dict[str, Any]],
) -> None:
    """Before, only at the attach (and after a caught one, auto ran on unshared and unchecked; that
    path is tests/test_session_attach.py's)."""
    for row in failed_job.values():
        refused = row["auto_init"]
        assert refused["error"] == "PolicyError" and "in a job of 2 ranks" in refused["message"], row
        assert "up to 1 ranks" in refused["message"], row
