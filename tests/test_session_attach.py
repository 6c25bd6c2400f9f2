"""A session started before ``init_process_group`` attaches to the group once it exists (session.py).

Single process, a real gloo group of one rank: the attach happens at the first new key after the
group is up, checks the decisions made before it, and never runs on a pinned key's launch. A job
with ``WORLD_SIZE>1`` that never creates its group is told that the checks never ran.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import megatron_tuning
from megatron_tuning.distributed import agreement, store
from megatron_tuning.runtime import pinning

from . import support_kernels as sk
from .support_kernels import grid


def _launch(n: int) -> None:
    x, y = torch.randn(n), torch.randn(n)
    out = torch.empty(n)
    sk.scale_add[grid(n)](x, y, out, n, 2.0)
    torch.testing.assert_close(out, 2.0 * x + y)


@pytest.fixture(autouse=True)
def _fresh_kernels() -> Iterator[None]:
    sk.scale_add.cache.clear()
    yield
    sk.scale_add.cache.clear()


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[Any]:
    """``start()`` creates a gloo process group of one rank; it is destroyed after the test."""

    def start() -> None:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def _spy_on_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Keys the agreement checker compares, in order (the late attach's and the decision log's)."""
    checked: list[str] = []
    real = agreement.AgreementChecker.check

    def check(self: Any, decision: Any, **options: Any) -> None:
        checked.append(decision.key.split(" |")[0])
        real(self, decision, **options)

    monkeypatch.setattr(agreement.AgreementChecker, "check", check)
    return checked


def test_init_before_the_group_attaches_at_the_next_new_key_and_checks_what_came_before(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, one_rank_group: Any
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")  # a torchrun rank, before its init_process_group
    checked = _spy_on_checks(monkeypatch)
    with caplog.at_level(logging.INFO, logger="megatron_tuning"):
        handle = megatron_tuning.init_deterministic_tuning(megatron_tuning.TuningPolicy())
    assert any("no process group yet (WORLD_SIZE=2)" in r.getMessage() for r in caplog.records)
    _launch(30)
    assert agreement.active_checker() is None and len(pinning.before_decision) == 1
    one_rank_group()
    _launch(30)  # a pinned key: no attach on the launch path
    assert agreement.active_checker() is None
    _launch(31)  # the first new key with a group: attach, then check n=30 (before) and n=31
    assert agreement.active_checker() is not None and pinning.before_decision == []
    assert checked == ["n=30", "n=31"]  # the attach checks n=30; n=31 comes through the decision log
    handle.close()
    assert agreement.active_checker() is None


@pytest.mark.parametrize("attach_at", ["verify_agreement", "close"])
def test_a_session_whose_keys_were_all_decided_before_the_group_attaches_at_a_check(
    monkeypatch: pytest.MonkeyPatch, one_rank_group: Any, attach_at: str
) -> None:
    """Before, only a new key attached: a rank that warmed up before ``init_process_group`` got only
    hits afterwards, so it never claimed its inputs nor checked its decisions, and exited 0."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    checked = _spy_on_checks(monkeypatch)
    handle = megatron_tuning.init_deterministic_tuning(megatron_tuning.TuningPolicy())
    _launch(30)  # the warm-up, before the group
    one_rank_group()
    _launch(30)  # a hit: the launch path stays as it was
    assert checked == [] and agreement.active_checker() is None
    if attach_at == "verify_agreement":
        megatron_tuning.verify_agreement()
        assert isinstance(agreement.active_checker(), agreement.AgreementChecker)
        assert pinning.before_decision == [] and agreement.before_verify == []
    handle.close()
    assert checked == ["n=30"] and agreement.before_verify == []


@pytest.mark.parametrize("attach_at", ["verify_agreement", "close"])
def test_inputs_that_differ_at_an_attach_at_a_check_raise_there_after_the_collective(
    monkeypatch: pytest.MonkeyPatch, one_rank_group: Any, attach_at: str
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    handle = megatron_tuning.init_deterministic_tuning(megatron_tuning.TuningPolicy())
    _launch(30)
    one_rank_group()
    other = megatron_tuning.TuningPolicy(block_sizes={"BLOCK_SIZE": 64})  # "another rank" claims first
    from megatron_tuning.distributed import verify

    agreement.AgreementChecker(other, session=verify._sessions + 1).compare_inputs(
        agreement.describe_inputs(other)
    )
    first, *then = (megatron_tuning.verify_agreement, handle.close)[attach_at == "close" :]
    with pytest.raises(megatron_tuning.InputMismatchError, match="policy.block_sizes: rank 0:"):
        first()
    for check in then:  # before, the close raised the error verify_agreement had raised again
        check()


def test_auto_gets_the_jobs_consensus_at_the_attach(
    monkeypatch: pytest.MonkeyPatch, one_rank_group: Any
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    policy = megatron_tuning.TuningPolicy(mode="auto", cache="off", use_shipped_tables=False)
    with megatron_tuning.init_deterministic_tuning(policy, measure=_first_config):
        assert pinning.active is not None and pinning.active.consensus is None
        one_rank_group()
        _launch(40)
        assert pinning.active is not None and pinning.active.consensus is not None
        (decision,) = [d for d in megatron_tuning.get_decisions() if d.key.startswith("n=40")]
        assert decision.source == "tuned"  # published to the job's store: this rank was first


@pytest.mark.parametrize("world", [store.AUTO_MAX_RANKS, store.AUTO_MAX_RANKS + 1])
def test_auto_past_its_rank_cap_is_refused_at_init_where_the_launcher_gives_the_size(
    monkeypatch: pytest.MonkeyPatch, world: int
) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world))  # no group yet: the attach would be too late
    policy = megatron_tuning.TuningPolicy(mode="auto", cache="off", use_shipped_tables=False)
    if world <= store.AUTO_MAX_RANKS:
        megatron_tuning.init_deterministic_tuning(policy).close()
        return
    with pytest.raises(megatron_tuning.PolicyError, match=f"deterministic in a job of {world} ranks"):
        megatron_tuning.init_deterministic_tuning(policy)
    assert pinning.active is None and pinning.before_decision == []  # nothing was started


def test_auto_past_its_rank_cap_at_the_attach_fails_every_later_key_and_check(
    monkeypatch: pytest.MonkeyPatch, one_rank_group: Any
) -> None:
    """The job's size is known only once the group exists. Before, the attach was marked done before
    the cap raised: after a caught cap error, auto ran on with no consensus and no checks."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(store, "AUTO_MAX_RANKS", 0)
    policy = megatron_tuning.TuningPolicy(mode="auto", cache="off", use_shipped_tables=False)
    handle = megatron_tuning.init_deterministic_tuning(policy, measure=_first_config)
    one_rank_group()
    raised = []
    for check in (lambda: _launch(40), lambda: _launch(41), megatron_tuning.verify_agreement):
        with pytest.raises(megatron_tuning.PolicyError, match="in a job of 1 ranks") as caught:
            check()
        raised.append(caught.value)
    assert raised[0] is raised[1] is raised[2]
    handle.close()  # its caller has it: the close does not raise it again
    assert megatron_tuning.get_decisions() == []  # nothing launched unshared


def _first_config(autotuner: Any, candidates: list[Any], *rest: Any) -> tuple[Any, dict[str, Any]]:
    return candidates[0], {"format": "fake"}


@pytest.mark.parametrize("rank", [0, 1])
def test_a_session_that_never_sees_its_group_warns_that_the_checks_never_ran(
    monkeypatch: pytest.MonkeyPatch, notices: Any, rank: int
) -> None:
    """On every rank: before, rank 1's notice was an INFO record (a job's notices are rank 0's),
    though only that rank knows that its own checks never ran."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))
    with megatron_tuning.init_deterministic_tuning(megatron_tuning.TuningPolicy()):
        _launch(30)
        _launch(31)
    (warning,) = notices.matching("never ran")
    assert f"agreement check never ran in this process (rank {rank} of WORLD_SIZE=2)" in warning
    assert "its 2 kernel decisions" in warning and "Create the process group before" in warning
    assert pinning.before_decision == []


@pytest.mark.parametrize(
    "world, launches, policy",
    [
        ("", True, megatron_tuning.TuningPolicy()),  # a single process: nothing to check
        ("2", False, megatron_tuning.TuningPolicy()),  # nothing was decided, nothing went unchecked
        ("2", True, megatron_tuning.TuningPolicy(agreement="off")),  # checks were not asked for
    ],
)
def test_no_warning_when_nothing_went_unchecked(
    monkeypatch: pytest.MonkeyPatch, notices: Any, world: str, launches: bool, policy: Any
) -> None:
    monkeypatch.setenv("WORLD_SIZE", world)
    with megatron_tuning.init_deterministic_tuning(policy):
        if launches:
            _launch(30)
    assert notices.matching("never ran") == []
    assert pinning.before_decision == []


def test_a_session_started_with_its_group_registers_no_hook(one_rank_group: Any) -> None:
    one_rank_group()
    with megatron_tuning.init_deterministic_tuning(megatron_tuning.TuningPolicy()):
        assert pinning.before_decision == [] and agreement.active_checker() is not None


def test_the_decision_log_path_takes_the_pid(tmp_path: Path) -> None:
    import os

    log = tmp_path / "d-{pid}.json"
    with megatron_tuning.init_deterministic_tuning(megatron_tuning.TuningPolicy(decision_log=str(log))):
        _launch(30)
    assert (tmp_path / f"d-{os.getpid()}.json").is_file()
