"""Unequal ``init_deterministic_tuning`` calls across real torchrun ranks (gloo, CPU).

Every session start is numbered per process and ranks compare only within one number. The
session's inputs (the policy among them) are compared at its start, so another policy under one
number fails at init; a rank that called init once more than the others is named by
``verify_agreement``, which compares the session counts. Each scenario of
``workers/agreement_worker.py`` runs in its own store namespace (one job, ~5 s of start-up).
"""

from __future__ import annotations

from typing import Any

import pytest
from _launch import WORKERS, gloo_available, read_results, run_torchrun

SCENARIOS = [
    "session_extra_other_policy",
    "session_extra_same_policy",
    "session_extra_allgather",
    "session_lagging_allgather",
    "session_equal_store",
    "session_reinit_verify",
    "verify_extra_call",
    "session_extra_store_close",
    "inputs_agreement_off",
]
NPROC = 2
SESSION_TIMEOUT_S = 4.0  # session_extra_allgather's agreement timeout (worker's SESSION_TIMEOUT_S)

Rows = list[dict[str, Any]]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, dict[str, Any]]]:
    if not gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    tmp = tmp_path_factory.mktemp("sessions")
    args = ["--out", str(tmp), "--scenarios", ",".join(SCENARIOS), "--backend", "gloo"]
    done = run_torchrun(NPROC, WORKERS / "agreement_worker.py", args, tmp, timeout_s=180)
    results = read_results(tmp, NPROC)
    assert done.returncode == 0 and len(results) == NPROC, done.stdout[-3000:] + done.stderr[-3000:]
    return results


def _rows(job: dict[int, dict[str, dict[str, Any]]], name: str) -> Rows:
    rows = [job[rank][name] for rank in range(NPROC)]
    for row in rows:
        assert "traceback" not in row, row["traceback"]
    return rows


def test_another_policy_in_the_same_session_number_fails_at_init(job):
    rank0, rank1 = _rows(job, "session_extra_other_policy")
    assert rank1["error"] == "InputMismatchError" and rank1["mismatch_ranks"] == [0, 1]
    message = rank1["message"]
    assert "at tuning session #1" in message
    assert "policy.mode: rank 0: deterministic; rank 1: chaos" in message
    assert "the same number of times" in message
    # Rank 0 went on to its session #2, where nobody meets it: verify_agreement names the counts.
    for row in (rank0, rank1):
        assert row["verify_error"] == "InputMismatchError"
        assert "tuning sessions started: rank 0: 2; rank 1: 1" in row["verify_message"]


def test_an_extra_init_with_the_same_policy_is_named_by_verify(job):
    rows = _rows(job, "session_extra_same_policy")
    messages = {row["verify_message"] for row in rows}
    # First use cannot tell it from a slow rank. The store session's check at close does not raise
    # verify's error again: the caller had it (before, the close raised it a second time).
    assert [row["error"] for row in rows] == [None, None], rows
    assert len(messages) == 1  # every rank raises the same error
    message = messages.pop()
    assert "verify_agreement call" in message
    assert "tuning sessions started: rank 0: 2; rank 1: 1" in message


def test_allgather_in_unequal_sessions_names_the_other_rank_within_its_timeout(job):
    rank0, rank1 = _rows(job, "session_extra_allgather")
    for row, other in ((rank0, 1), (rank1, 0)):
        assert row["error"] == "AgreementTimeoutError", row
        assert row["missing_ranks"] == [other]
        assert SESSION_TIMEOUT_S <= row["elapsed_s"] < SESSION_TIMEOUT_S + 5


@pytest.mark.parametrize("name", ["session_lagging_allgather", "session_equal_store"])
def test_equal_calls_raise_nothing_even_when_a_rank_is_late(job, name):
    rows = _rows(job, name)
    assert [row["error"] for row in rows] == [None, None], rows
    assert [row.get("verify_error") for row in rows] == [None, None], rows


def test_an_extra_init_in_verify_mode_fails_every_rank_and_never_says_ok(job):
    """Before: rank 0's re-init ran a check at close that met rank 1's verify_agreement, which
    returned "ok" while the ranks ran BLOCK=16 and 32; the job then stalled at close."""
    rows = _rows(job, "session_reinit_verify")
    messages = {row.get("verify_message") for row in rows}
    assert [row.get("verify_error") for row in rows] == ["InputMismatchError"] * NPROC, rows
    assert len(messages) == 1 and "tuning sessions started: rank 0: 2; rank 1: 1" in messages.pop()
    # The check at close raises the same error at once: the pairing is broken for good.
    assert [row["error"] for row in rows] == ["InputMismatchError"] * NPROC, rows
    assert all(row["close_s"] < 1.0 for row in rows), rows


def test_an_extra_verify_call_meeting_the_check_at_close_fails_both_ranks(job):
    """Before: rank 0's second verify_agreement met rank 1's check at close and both passed; rank
    0's own check at close then waited out its timeout."""
    rank0, rank1 = _rows(job, "verify_extra_call")
    assert rank0["verify_error"] == "InputMismatchError" and rank1["error"] == "InputMismatchError"
    assert rank0["verify_message"] == rank1["message"]
    assert "verify_agreement calls: rank 0: #2; rank 1: the check at close" in rank1["message"]
    assert "the same number of times" in rank1["message"]
    assert rank0["close_s"] < 1.0 and rank0["error"] == "InputMismatchError"


def test_an_extra_init_in_store_mode_fails_every_rank_at_close(job):
    """Before: rank 0's keys were claimed in session #2 and rank 1's in #1, so the store check
    compared nothing, store mode has no verify_agreement call of its own, and both ranks passed."""
    rows = _rows(job, "session_extra_store_close")
    assert [row["error"] for row in rows] == ["InputMismatchError"] * NPROC, rows
    messages = {row["message"] for row in rows}
    assert len(messages) == 1 and "tuning sessions started: rank 0: 2; rank 1: 1" in messages.pop()


def test_a_rank_whose_own_policy_turns_checks_off_fails_the_job(job):
    """Before: a rank with agreement off claimed nothing, so it and the others compared with nobody."""
    rows = _rows(job, "inputs_agreement_off")
    assert [row["error"] for row in rows] == ["InputMismatchError"] * NPROC, rows
    assert rows[0]["message"] == rows[1]["message"]  # rank 0 at its start, rank 1 at its close
    assert "policy.agreement: rank 0: store; rank 1: off" in rows[0]["message"]
    assert "policy.block_sizes: rank 0: -; rank 1: BLOCK_M=64" in rows[0]["message"]
