"""Unequal ``init_deterministic_tuning`` calls across real torchrun ranks (gloo, CPU).

Every session start is numbered per process and ranks compare only within one number, so a
rank that calls init once more than the others used to compare nothing: in ``store`` mode chaos
passed silently, in ``allgather`` mode each rank named the *other* as missing. Each scenario of
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
    assert rank1["error"] == "SessionMismatchError" and rank1["session_ranks"] == [0, 1]
    message = rank1["message"]
    assert "the start of session #1" in message
    assert "Rank 0 is in session #1 (mode=deterministic" in message
    assert "Rank 1 is in session #1 (mode=chaos" in message
    assert "call it the same number of times" in message
    # Rank 0 went on to its session #2, where nobody meets it: verify_agreement names the counts.
    for row in (rank0, rank1):
        assert row["verify_error"] == "SessionMismatchError"
        assert "Rank 0 is in session #2" in row["verify_message"]
        assert "Rank 1 is in session #1" in row["verify_message"]


def test_an_extra_init_with_the_same_policy_is_named_by_verify(job):
    rows = _rows(job, "session_extra_same_policy")
    assert [row["error"] for row in rows] == [None, None]  # first use cannot tell it from a slow rank
    messages = {row["verify_message"] for row in rows}
    assert len(messages) == 1  # every rank raises the same error
    message = messages.pop()
    assert "verify_agreement call" in message
    assert "Rank 0 is in session #2" in message and "Rank 1 is in session #1" in message


def test_allgather_names_the_session_mismatch_not_a_missing_rank(job):
    rank0, rank1 = _rows(job, "session_extra_allgather")
    for row in (rank0, rank1):
        assert row["error"] == "SessionMismatchError", row
        assert row["session_ranks"] == [0, 1]
        assert "Rank 0 is in session #2" in row["message"] and "Rank 1 is in session #1" in row["message"]
    # Rank 1 is behind: rank 0 has left session #1 for good, so rank 1 fails within about a second.
    assert rank1["elapsed_s"] < SESSION_TIMEOUT_S - 1
    # Rank 0 cannot tell a slow rank from one that never comes: it waits for its timeout.
    assert SESSION_TIMEOUT_S <= rank0["elapsed_s"] < SESSION_TIMEOUT_S + 5


@pytest.mark.parametrize("name", ["session_lagging_allgather", "session_equal_store"])
def test_equal_calls_raise_nothing_even_when_a_rank_is_late(job, name):
    rows = _rows(job, name)
    assert [row["error"] for row in rows] == [None, None], rows
    assert [row.get("verify_error") for row in rows] == [None, None], rows
