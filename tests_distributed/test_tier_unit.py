"""The node tier: one request to the job's store per node for what every rank of the node asks alike."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from megatron_tuning.core.errors import PolicyError
from megatron_tuning.distributed import tier
from megatron_tuning.distributed.tier import NodeTier, node_folder, tier_wanted


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tier.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(
        tier.os, "access", lambda path, mode: False if path == "/dev/shm" else os.access(path, mode)
    )
    made = node_folder("job-1")
    assert made is not None and made.parent == tmp_path
    return made


def test_eight_ranks_of_a_node_make_one_request_and_all_get_its_answer(folder: Path) -> None:
    calls: list[int] = []
    lock = threading.Lock()

    def ask() -> bytes:
        with lock:
            calls.append(1)
        time.sleep(0.05)  # the request in flight while the others arrive
        return b"the winner"

    ranks = [NodeTier(folder, rank=r, owner=r == 0) for r in range(8)]
    answers: list[bytes] = []
    threads = [threading.Thread(target=lambda t=t: answers.append(t.once("publish/k", ask))) for t in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1] and answers == [b"the winner"] * 8
    assert sum(t.global_requests for t in ranks) == 1


def test_an_answer_is_final_however_late_a_node_mate_asks(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No expiry and no rounds: the request count does not depend on wall time (an empty answer too)."""
    first, late = NodeTier(folder, rank=0), NodeTier(folder, rank=1)
    assert first.once("publish/k", lambda: b"") == b""
    later = time.time() + 3600.0
    monkeypatch.setattr(tier.time, "time", lambda: later)
    assert late.once("publish/k", lambda: b"asked again") == b""
    assert (first.global_requests, late.global_requests) == (1, 0)


def test_peek_reads_a_node_mates_answer_and_never_asks_or_waits(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tier, "WAIT_S", 3600.0)  # a peek that waited on the claim below would hang
    first, late = NodeTier(folder, rank=0), NodeTier(folder, rank=1)
    assert late.peek("publish/k") is None
    stem = folder / __import__("hashlib").sha256(b"publish/k").hexdigest()[:40]
    stem.with_suffix(".claim").touch()  # a node-mate is making the request right now
    assert late.peek("publish/k") is None
    stem.with_suffix(".claim").unlink()
    assert first.once("publish/k", lambda: b"the winner") == b"the winner"
    assert late.peek("publish/k") == b"the winner"
    assert late.peek("publish/other") is None
    assert late.global_requests == 0


def test_peek_in_a_folder_that_went_away_is_nothing(folder: Path) -> None:
    member, owner = NodeTier(folder, rank=1), NodeTier(folder, rank=0, owner=True)
    owner.once("publish/k", lambda: b"the winner")
    owner.close()
    assert member.peek("publish/k") is None


def test_a_claim_left_without_an_answer_is_bypassed_after_the_wait(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tier, "WAIT_S", 0.05)
    dead, alive = NodeTier(folder, rank=0), NodeTier(folder, rank=1)
    stem = folder / __import__("hashlib").sha256(b"publish/k").hexdigest()[:40]
    stem.with_suffix(".claim").touch()  # a node-mate claimed it and died
    assert alive.once("publish/k", lambda: b"asked myself") == b"asked myself"
    del dead


def test_a_claim_left_without_an_answer_gives_the_fallback_where_the_caller_has_one(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """auto's lookups: a node-mate that never answered means "go on as a miss", not one more request."""
    monkeypatch.setattr(tier, "WAIT_S", 0.05)
    alive = NodeTier(folder, rank=1)
    stem = folder / __import__("hashlib").sha256(b"lookup/k").hexdigest()[:40]
    stem.with_suffix(".claim").touch()
    assert alive.once("lookup/k", lambda: b"asked myself", fallback=b"") == b""
    assert alive.global_requests == 0


def test_a_folder_that_went_away_means_going_direct(folder: Path) -> None:
    member, owner = NodeTier(folder, rank=1), NodeTier(folder, rank=0, owner=True)
    owner.close()
    assert not folder.exists()
    assert member.once("lookup/k", lambda: b"direct") == b"direct"


def test_another_users_or_a_planted_folder_is_never_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tier.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(
        tier.os, "access", lambda path, mode: False if path == "/dev/shm" else os.access(path, mode)
    )
    made = node_folder("job-2")
    assert made is not None
    made.rmdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    made.symlink_to(target)
    assert node_folder("job-2") is None
    made.unlink()
    made.mkdir(mode=0o755)
    os.chmod(made, 0o755)
    assert node_folder("job-2") is None  # readable by others: not private


@pytest.mark.parametrize(
    ("value", "world", "local", "wanted"),
    [
        (None, 1024, 8, True),
        (None, 64, 8, False),
        (None, 1024, 1, False),
        ("off", 1024, 8, False),
        ("node", 8, 2, True),
    ],
)
def test_tier_is_on_for_large_worlds_or_when_asked(
    monkeypatch: pytest.MonkeyPatch, value: str | None, world: int, local: int, wanted: bool
) -> None:
    if value is not None:
        monkeypatch.setenv(tier.ENV_TIER, value)
    assert tier_wanted(world, local) is wanted


def test_asking_for_the_tier_with_one_rank_per_node_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tier.ENV_TIER, "node")
    with pytest.raises(PolicyError, match="LOCAL_WORLD_SIZE"):
        tier_wanted(64, 1)
    monkeypatch.setenv(tier.ENV_TIER, "nodes")
    with pytest.raises(PolicyError, match="node|off"):
        tier_wanted(64, 8)
