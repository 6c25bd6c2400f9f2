"""auto mode in one process: tune once per key, adopt what the job published, persist, never wait.

Real kernels in the interpreter; the measurement is a fake (it picks a known config and counts its
calls), so these tests check the decision flow, not timing. Cross-rank races under torchrun are in
``tests_distributed/test_auto_torchrun.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_tuning
from megatron_tuning import session
from megatron_tuning.core.choice import InMemoryTable
from megatron_tuning.core.decisions import decision_log, get_decisions
from megatron_tuning.core.errors import ConsensusError, TableMissError
from megatron_tuning.core.identity import config_data, config_signature, kernel_id, tuning_key
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.core.warn import reset_warnings
from megatron_tuning.distributed.agreement import unchecked_sources
from megatron_tuning.distributed.store import StoreConsensus
from megatron_tuning.runtime import interception, pinning
from megatron_tuning.runtime.auto import auto_choice
from megatron_tuning.tables.table import load_table

from .. import support_kernels as sk
from ..support_kernels import grid

KERNEL = kernel_id(sk.scale_add)


class FakeMeasure:
    """Picks the config with ``BLOCK_SIZE == block`` and counts how often it was asked."""

    def __init__(self, block: int = 32) -> None:
        self.block = block
        self.calls: list[str] = []

    def __call__(self, autotuner, candidates, args, kwargs, kernel, key):
        self.calls.append(key)
        chosen = next(c for c in candidates if c.kwargs["BLOCK_SIZE"] == self.block)
        return chosen, {"format": "fake", "median_ms": 1.0}


@pytest.fixture(autouse=True)
def _clean_state():
    sk.BENCH_CALLS.clear()
    decision_log().clear()
    reset_warnings()
    sk.scale_add.cache.clear()
    yield
    interception.uninstall()
    decision_log().clear()


def launch(n: int) -> None:
    x, y = torch.randn(n), torch.randn(n)
    out = torch.full((n,), float("nan"))
    sk.scale_add[grid(n)](x, y, out, n, 0.5)
    torch.testing.assert_close(out, 0.5 * x + y)


def key(n: int) -> str:
    x = torch.zeros(n)
    return tuning_key(sk.scale_add, (x, x, x, n, 0.5), {})


def ours() -> list:
    return [d for d in get_decisions() if d.kernel == KERNEL]


def test_a_miss_is_tuned_once_per_key_and_launched_without_triton_benchmarking():
    measure = FakeMeasure(block=32)
    interception.install(TuningPolicy(mode="auto"), measure=measure)
    for n in (100, 100, 257, 100):
        launch(n)
    assert measure.calls == [key(100), key(257)]
    assert [(d.source, d.signature.split(",")[0]) for d in ours()] == [("tuned", "BLOCK_SIZE=32")] * 2
    assert sk.BENCH_CALLS == []  # Triton's own benchmarking never ran


def test_a_table_entry_pins_without_measuring():
    by_block = {c.kwargs["BLOCK_SIZE"]: c for c in sk.ADD_CONFIGS}
    table = InMemoryTable({(KERNEL, key(100)): config_data(by_block[64])})
    measure = FakeMeasure(block=32)
    interception.install(TuningPolicy(mode="auto"), table=table, measure=measure)
    launch(100)
    assert measure.calls == []
    assert [d.source for d in ours()] == ["table"]


def test_without_a_way_to_measure_auto_applies_the_miss_rule():
    by_block = {c.kwargs["BLOCK_SIZE"]: c for c in sk.ADD_CONFIGS}
    table = InMemoryTable({(KERNEL, key(1024)): config_data(by_block[128])})
    interception.install(TuningPolicy(mode="auto"), table=table)  # no measure function
    launch(1000)
    (decision,) = ours()
    assert (decision.source, decision.nearest_key) == ("nearest", key(1024))
    interception.install(TuningPolicy(mode="auto", on_miss="error"))
    with pytest.raises(TableMissError):
        launch(999)


def store_pair() -> tuple[StoreConsensus, StoreConsensus]:
    store = dist.HashStore()
    return StoreConsensus(store=store, rank=0), StoreConsensus(store=store, rank=1)


def choose(consensus: StoreConsensus, measure: FakeMeasure, n: int = 100, **changes):
    x = torch.zeros(n)
    options = dict(
        kernel=KERNEL,
        arch="sm90",
        policy=TuningPolicy(mode="auto"),
        table=None,
        measure=measure,
        consensus=consensus,
    )
    options.update(changes)
    return auto_choice(sk.scale_add, list(sk.ADD_CONFIGS), key(n), ((x, x, x, n, 0.5), {}), **options)


def test_a_published_decision_is_adopted_without_measuring():
    rank0, rank1 = store_pair()
    first, second = FakeMeasure(block=64), FakeMeasure(block=16)
    choice, timings = choose(rank1, second)
    assert (choice.source, choice.config.kwargs["BLOCK_SIZE"]) == ("tuned", 16) and timings is not None
    adopted, timings = choose(rank0, first)
    assert (adopted.source, adopted.origin, adopted.config.kwargs["BLOCK_SIZE"]) == ("adopted", "rank 1", 16)
    assert first.calls == [] and timings is None
    assert adopted.config is sk.ADD_CONFIGS[1]  # the live Config object, hooks and all


def test_the_loser_of_a_race_launches_the_winners_config():
    rank0, rank1 = store_pair()

    class PublishFirst(FakeMeasure):
        """Rank 0 measures while rank 1 publishes: rank 0's lookup came back empty."""

        def __call__(self, *args):
            result = super().__call__(*args)
            choose(rank1, FakeMeasure(block=128))
            return result

    loser = PublishFirst(block=8)
    choice, timings = choose(rank0, loser)
    assert loser.calls == [key(100)] and timings is not None  # it measured, and keeps the record
    assert (choice.source, choice.origin, choice.config.kwargs["BLOCK_SIZE"]) == ("adopted", "rank 1", 128)


def test_a_published_config_this_rank_cannot_launch_is_an_error_naming_it():
    rank0, rank1 = store_pair()
    choose(rank1, FakeMeasure(block=128))
    live = [c for c in sk.ADD_CONFIGS if c.kwargs["BLOCK_SIZE"] != 128]
    x = torch.zeros(100)
    with pytest.raises(ConsensusError, match="rank 1 published BLOCK_SIZE=128") as caught:
        auto_choice(
            sk.scale_add,
            live,
            key(100),
            ((x, x, x, 100, 0.5), {}),
            kernel=KERNEL,
            arch="sm90",
            policy=TuningPolicy(mode="auto"),
            table=None,
            measure=FakeMeasure(),
            consensus=rank0,
        )
    assert caught.value.kernel == KERNEL and caught.value.key == key(100)


def test_lookup_never_waits_for_a_key_nobody_published():
    rank0, _ = store_pair()
    assert rank0.lookup(KERNEL, key(100), "sm90") is None  # a blocking get would hang here


def test_auto_compares_tuned_decisions_across_ranks_tune_mode_does_not():
    assert "tuned" not in unchecked_sources("auto") and "adopted" not in unchecked_sources("auto")
    assert "tuned" in unchecked_sources("tune") and "out_of_scope" in unchecked_sources("auto")


def test_a_second_run_pins_every_key_from_the_cache_with_zero_measurements(tmp_path, monkeypatch):
    cache = tmp_path / "auto.msgpack"
    monkeypatch.setenv("MEGATRON_TUNING_MODE", "auto")
    monkeypatch.setenv("MEGATRON_TUNING_CACHE", str(cache))
    measures: list[FakeMeasure] = []

    def fake_measure(policy):
        measures.append(FakeMeasure(block=64))
        return measures[-1]

    monkeypatch.setattr(session, "_make_measure", fake_measure)
    with megatron_tuning.init_deterministic_tuning() as handle:
        assert handle.policy.mode == "auto"
        launch(100)
        assert handle.persist() == 1  # at a checkpoint: the key reaches the file before close
        assert {e.key for e in load_table(cache)} == {key(100)}
        assert handle.persist() == 0
        launch(257)
    assert len(measures[0].calls) == 2  # close persisted the second key
    entries = {e.key: config_signature(e.config) for e in load_table(cache)}
    assert set(entries) == {key(100), key(257)}

    decision_log().clear()
    with megatron_tuning.init_deterministic_tuning():
        for n in (100, 257):
            launch(n)
    assert measures[1].calls == []
    assert [(d.source, d.origin) for d in ours()] == [("table", str(cache))] * 2
    assert all(d.signature.startswith("BLOCK_SIZE=64") for d in ours())


def test_a_new_key_during_cuda_graph_capture_is_never_measured(monkeypatch):
    monkeypatch.setattr(pinning, "is_capturing", lambda: True)
    measure = FakeMeasure(block=32)
    interception.install(TuningPolicy(mode="auto", on_miss="min_cost"), measure=measure)
    launch(100)
    assert measure.calls == []
    assert [d.source for d in ours()] == ["cheapest"]
