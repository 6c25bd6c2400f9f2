"""pinning.decide through real interpreted launches: kernel identity (two autotuners over one
function; the same code under another module name), chaos picks, and auto mode (tune once per key,
adopt what the job published, persist, never wait; its consensus as one rank sees it).

Real kernels in the interpreter; measurements are fakes (they pick a known config and count their
calls), so these tests check the decision flow, not timing. Several fake ranks share one in-memory
store (no process group); the torchrun races are in ``tests_distributed/``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
import triton

import megatron_tuning
from megatron_tuning.commands.validate import coverage_of
from megatron_tuning.core.chaos import ChaosClaim
from megatron_tuning.core.choice import Choice, InMemoryTable
from megatron_tuning.core.decisions import decision_log, get_decisions
from megatron_tuning.core.errors import ConsensusError, PolicyError, TableMissError
from megatron_tuning.core.identity import (
    arch_tag,
    base_kernel_id,
    config_data,
    config_list_digest,
    config_signature,
    kernel_id,
    kernel_source_hash,
)
from megatron_tuning.core.key import tuning_key
from megatron_tuning.core.notices import reset_warnings
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.distributed import store as kv
from megatron_tuning.distributed.agreement import unchecked_sources
from megatron_tuning.distributed.store import StoreConsensus
from megatron_tuning.runtime import interception, pinning
from megatron_tuning.runtime.interception import lazy_benchmarker
from megatron_tuning.tables.entry import Entry
from megatron_tuning.tables.records import recording_table
from megatron_tuning.tables.search import TableSet, installed_triton_version
from megatron_tuning.tables.table import Table, load_table, save_table
from megatron_tuning.tables.vote import vote_tables

from .. import support_kernels as sk
from ..support_kernels import grid

KERNEL = kernel_id(sk.scale_add)
ARCH = arch_tag()  # what the lookup uses ("unknown" in the interpreter)


@pytest.fixture(autouse=True)
def _clean_state():
    sk.BENCH_CALLS.clear()
    decision_log().clear()
    reset_warnings()
    for kernel in (sk.twin_small, sk.twin_large, sk.scale_add):
        kernel.cache.clear()
    yield
    interception.uninstall()
    decision_log().clear()


def _run_twin(kernel, n: int) -> int:  # noqa: ANN001
    x = torch.arange(n, dtype=torch.float32)
    out = torch.full((n,), float("nan"))
    kernel[grid(n)](x, out, n)
    torch.testing.assert_close(out, x * 3)
    return int(kernel.best_config.kwargs["BLOCK_SIZE"])


def _largest(autotuner, candidates, args, kwargs, kernel, key):  # noqa: ANN001, ANN202
    return candidates[-1], {"median_ms": {config_signature(c): 1.0 for c in candidates}}


def test_two_autotuners_over_one_function_get_two_decisions_two_entries_and_their_own_pins(tmp_path):
    # "Tune": each autotuner's winner is its largest config (32 for small, 128 for large).
    interception.install(TuningPolicy(mode="tune"), measure=_largest)
    assert (_run_twin(sk.twin_small, 40), _run_twin(sk.twin_large, 40)) == (32, 128)
    decisions = get_decisions()
    assert len(decisions) == 2 and decisions[0].key == decisions[1].key
    assert [d.kernel for d in decisions] == [kernel_id(sk.twin_small), kernel_id(sk.twin_large)]
    assert decisions[0].kernel != decisions[1].kernel
    table = recording_table(decisions)
    assert len(table) == 2  # one table holds both: they no longer share an ident
    path = tmp_path / "twins.msgpack"
    save_table(table, path)
    interception.uninstall()
    decision_log().clear()

    # Pinned run in the other launch order: each launches its own entry, not the other's.
    interception.install(TuningPolicy(mode="deterministic"), table=TableSet([path]))
    assert (_run_twin(sk.twin_large, 40), _run_twin(sk.twin_small, 40)) == (128, 32)
    assert [(d.kernel, d.source) for d in get_decisions()] == [
        (kernel_id(sk.twin_large), "table"),
        (kernel_id(sk.twin_small), "table"),
    ]


def test_a_plain_id_entry_for_a_function_with_two_autotuners_is_named_ambiguous_not_used(tmp_path, notices):
    key = tuning_key(sk.twin_small, (torch.zeros(40), torch.zeros(40), 40), {})
    base = base_kernel_id(sk.twin_small)
    entry = Entry(arch="unknown", kernel=base, key=key, config=config_data(sk.ADD_CONFIGS[1]))
    path = tmp_path / "old.msgpack"
    save_table(Table([entry]), path)
    interception.install(TuningPolicy(mode="deterministic", on_miss="min_cost"), table=TableSet([path]))
    assert _run_twin(sk.twin_small, 40) == 8  # the cheapest, not the ambiguous entry's 16
    assert get_decisions()[0].source == "cheapest"
    message = " ".join(notices.messages)
    assert f"entry for kernel {base}" in message and kernel_id(sk.twin_small) in message
    assert "cannot say which autotuner it was tuned for" in message and "Re-tune" in message


def test_a_plain_id_entry_that_stored_the_kernels_own_digest_is_used_by_it_alone(tmp_path, notices):
    key = tuning_key(sk.twin_small, (torch.zeros(40), torch.zeros(40), 40), {})
    base, digest = base_kernel_id(sk.twin_small), config_list_digest(sk.twin_small)
    config = config_data(sk.ADD_CONFIGS[1])
    entry = Entry(arch="unknown", kernel=base, key=key, config=config, config_list_digest=digest)
    path = tmp_path / "tuned.msgpack"
    save_table(Table([entry]), path)
    interception.install(TuningPolicy(mode="deterministic", on_miss="min_cost"), table=TableSet([path]))
    assert _run_twin(sk.twin_small, 40) == 16  # the entry's config, not the cheapest 8
    _run_twin(sk.twin_large, 40)
    assert [d.source for d in get_decisions()] == ["table", "cheapest"]  # the other list's: a miss
    assert notices.matching("cannot say which autotuner") == []


def test_a_plain_entry_of_a_one_autotuner_kernel_still_hits_with_no_warning(tmp_path, caplog, notices):
    key = tuning_key(sk.scale_add, (torch.zeros(40),) * 3 + (40, 0.5), {})
    entry = Entry(
        arch="unknown", kernel=kernel_id(sk.scale_add), key=key, config=config_data(sk.ADD_CONFIGS[3])
    )
    path = tmp_path / "plain.msgpack"
    save_table(Table([entry]), path)
    interception.install(TuningPolicy(mode="deterministic"), table=TableSet([path]))
    x = torch.randn(40)
    with caplog.at_level(logging.WARNING, logger="megatron_tuning"):
        sk.scale_add[grid(40)](x, x, torch.empty(40), 40, 0.5)
    assert sk.scale_add.best_config is sk.ADD_CONFIGS[3]
    (decision,) = get_decisions()
    assert (decision.source, decision.matched_by, decision.entry_kernel) == ("table", None, None)
    assert caplog.records == [] and notices.messages == []


# --------------------------------------------------------------------------- content matches

_KERNEL_FILE = """
import triton
import triton.language as tl

CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((8, 1), (16, 2), (32, 4), (64, 4))]


@triton.autotune(configs=CONFIGS, key=["n"])
@triton.jit
def add_two(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + AMOUNT, mask=mask)
"""


def _load(path: Path, name: str) -> ModuleType:
    """What an eval pipeline does: load a file under a name of its choosing, outside sys.modules."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with lazy_benchmarker():
        spec.loader.exec_module(module)
    assert name not in sys.modules
    return module


def _run_add_two(module: ModuleType, n: int, amount: float = 2.0) -> int:
    x = torch.arange(n, dtype=torch.float32)
    out = torch.full((n,), float("nan"))
    module.add_two[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, out, n)
    torch.testing.assert_close(out, x + amount)
    return int(module.add_two.best_config.kwargs["BLOCK"])


@pytest.fixture
def tuned_as_mykernels(tmp_path: Path) -> tuple[Path, Path]:
    """A kernel file loaded as ``mykernels``, its entry for n=40 pinning BLOCK=32 (not the cheapest 8)."""
    source = tmp_path / "kernel_file.py"
    source.write_text(textwrap.dedent(_KERNEL_FILE.replace("AMOUNT", "2.0")))
    mine = _load(source, "mykernels")
    key = tuning_key(mine.add_two, (torch.zeros(40), torch.zeros(40), 40), {})
    entry = Entry(
        arch="unknown",
        kernel=kernel_id(mine.add_two),
        key=key,
        config=config_data(mine.CONFIGS[2]),
        how="tuned",
        source_hash=kernel_source_hash(mine.add_two),
    )
    table = tmp_path / "mykernels.msgpack"
    save_table(Table([entry]), table)
    return source, table


def test_the_same_file_under_another_module_name_hits_by_content_and_says_so(tuned_as_mykernels, caplog):
    source, table = tuned_as_mykernels
    candidate = _load(source, "candidate")
    interception.install(TuningPolicy(mode="deterministic", on_miss="min_cost"), table=TableSet([table]))
    with caplog.at_level(logging.INFO, logger="megatron_tuning"):
        assert _run_add_two(candidate, 40) == 32
    (decision,) = get_decisions()
    assert decision.kernel == "candidate:add_two" and decision.source == "table"
    assert (decision.matched_by, decision.entry_kernel) == ("content", "mykernels:add_two")
    assert decision.origin == str(table)
    assert "matched by content: tuned as mykernels:add_two" in caplog.text
    labels, rows = coverage_of([("rank0.json", get_decisions())])
    cell = rows[0].cells["0"]
    assert (labels, cell.status, cell.entry_kernel) == (["0"], "hit", "mykernels:add_two")
    assert cell.to_json()["matched_by"] == "content"
    assert load_table(table).entries()[0].kernel == "mykernels:add_two"  # nothing written back


def test_a_no_provenance_review_view_round_trip_still_pins_under_a_third_module_name(tuned_as_mykernels):
    from megatron_tuning import commands as cli

    source, table = tuned_as_mykernels
    view, committed = table.with_name("review.json"), table.with_name("committed.msgpack")
    assert cli.main(["export", str(table), str(view), "--no-provenance"]) == 0
    assert cli.main(["import", str(view), str(committed)]) == 0
    third = _load(source, "third_name")
    policy = TuningPolicy(mode="deterministic", on_miss="error")
    interception.install(policy, table=TableSet([committed]))
    assert _run_add_two(third, 40) == 32  # the source hash survived review: a content match
    (decision,) = get_decisions()
    assert (decision.matched_by, decision.entry_kernel) == ("content", "mykernels:add_two")


def test_a_different_source_under_the_same_qualname_does_not_hit(tuned_as_mykernels, tmp_path):
    _, table = tuned_as_mykernels
    edited = tmp_path / "edited_kernel_file.py"
    edited.write_text(textwrap.dedent(_KERNEL_FILE.replace("AMOUNT", "5.0")))
    candidate = _load(edited, "candidate")
    interception.install(TuningPolicy(mode="deterministic", on_miss="min_cost"), table=TableSet([table]))
    assert _run_add_two(candidate, 40, amount=5.0) == 8  # the cheapest: same qualname is not enough
    (decision,) = get_decisions()
    assert (decision.source, decision.matched_by, decision.entry_kernel) == ("cheapest", None, None)


def test_a_content_match_also_serves_the_nearest_shape_rule(tuned_as_mykernels):
    source, table = tuned_as_mykernels
    candidate = _load(source, "candidate")
    interception.install(TuningPolicy(mode="deterministic", on_miss="nearest"), table=TableSet([table]))
    assert _run_add_two(candidate, 48) == 32
    (decision,) = get_decisions()
    assert (decision.source, decision.matched_by, decision.entry_kernel) == (
        "nearest",
        "content",
        "mykernels:add_two",
    )
    assert decision.nearest_key is not None and decision.nearest_key.startswith("n=40 |")


# --------------------------------------------------------------------------- chaos


class _Claims:
    """An in-memory coordinator: the first claim per (kernel, key, arch) wins, as the store's does."""

    def __init__(self, rank: int, claims: dict[tuple[str, str, str], ChaosClaim]) -> None:
        self.rank, self.claims = rank, claims

    def claim(self, kernel: str, key: str, arch: str, signature: str) -> ChaosClaim:
        return self.claims.setdefault((kernel, key, arch), ChaosClaim(self.rank, signature))

    def recall(self, kernel: str, key: str, arch: str) -> ChaosClaim | None:
        return self.claims.get((kernel, key, arch))


def test_chaos_through_the_coordinator_records_how_each_rank_picked(monkeypatch):
    claims: dict[tuple[str, str, str], ChaosClaim] = {}
    picks = []
    # Ranks 0 and 4 pick the same config by the rank formula (4 distinct configs in twin_large).
    for rank in (0, 4):
        monkeypatch.setenv("RANK", str(rank))
        interception.install(TuningPolicy(mode="chaos"), chaos=_Claims(rank, claims))
        picks.append(_run_twin(sk.twin_large, 40))
        interception.uninstall()
    first, second = get_decisions()
    assert picks[0] != picks[1]
    assert (first.source, first.chaos, first.origin) == ("chaos", "first", "first claim")
    assert (second.source, second.chaos, second.origin) == ("chaos", "differs", "moved off rank 0's claim")


def test_chaos_claims_under_the_id_the_agreement_check_compares(monkeypatch):
    """Rank 0 named the kernel plain, rank 1 with its digest: still one claim, so rank 1 differs."""
    claims: dict[tuple[str, str, str], ChaosClaim] = {}
    digest, arg_names, x = "0123456789ab", tuple(sk.scale_add.arg_names), torch.zeros(100)
    for rank, kernel in ((0, KERNEL), (1, f"{KERNEL}@{digest}")):
        monkeypatch.setenv("RANK", str(rank))
        installation = pinning.Installation(
            TuningPolicy(mode="chaos"), None, None, 0, chaos=_Claims(rank, claims)
        )
        state = pinning.AutotunerState(0, True, kernel, (("n", arg_names.index("n")),), arg_names)
        state.config_list_digest = digest
        args = (x, x, x, 100, 0.5)
        pinning.decide(
            sk.scale_add, state, installation, key(100), args, {}, candidates=lambda: sk.ADD_CONFIGS
        )
    assert [d.chaos for d in get_decisions()] == ["first", "differs"]


def test_chaos_with_one_distinct_config_says_it_proves_nothing():
    interception.install(TuningPolicy(mode="chaos"), chaos=_Claims(0, {}))
    x = torch.arange(40, dtype=torch.float32)
    sk.single_config_copy[grid(40)](x, torch.empty(40), 40)
    (decision,) = get_decisions()
    assert (decision.source, decision.chaos) == ("chaos", "no_other_config")
    assert decision.origin is not None and "no other distinct config" in decision.origin


def test_inside_a_cuda_graph_capture_chaos_recalls_instead_of_claiming(monkeypatch):
    class RecallOnly(_Claims):
        def claim(self, kernel: str, key: str, arch: str, signature: str) -> ChaosClaim:
            raise AssertionError("no store traffic inside a CUDA graph capture")

    key = tuning_key(sk.twin_large, (torch.zeros(40), torch.zeros(40), 40), {})
    claims = {(kernel_id(sk.twin_large), key, "unknown"): ChaosClaim(7, config_signature(sk.ADD_CONFIGS[4]))}
    monkeypatch.setattr(pinning, "is_capturing", lambda: True)
    interception.install(TuningPolicy(mode="chaos"), chaos=RecallOnly(0, claims))
    block = _run_twin(sk.twin_large, 40)
    (decision,) = get_decisions()
    assert decision.chaos == "differs" and "rank 7's claim" in (decision.origin or "")
    assert block != 128  # rank 7 claimed BLOCK_SIZE=128: this rank launches another


# --------------------------------------------------------------------------- auto


class FakeMeasure:
    """Picks the config with ``BLOCK_SIZE == block`` and counts how often it was asked."""

    def __init__(self, block: int = 32) -> None:
        self.block = block
        self.calls: list[str] = []

    def __call__(self, autotuner, candidates, args, kwargs, kernel, key):
        self.calls.append(key)
        chosen = next(c for c in candidates if c.kwargs["BLOCK_SIZE"] == self.block)
        return chosen, {"format": "fake", "median_ms": float(self.block)}


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


def choose(
    consensus: StoreConsensus,
    measure: FakeMeasure,
    n: int = 100,
    *,
    table: Any = None,
    live: Any = None,
    kernel: str = KERNEL,
    code: tuple[str | None, str | None] = (None, None),
) -> tuple[Choice, Any]:
    """``auto``'s decision for ``scale_add`` with ``n`` on the rank of ``consensus``, as a fresh
    process makes it (``pinning.decide``), and the timings it logs. ``kernel``: the id this process
    gave it; ``code``: its (config list digest, source hash), unknown by default."""
    installation = pinning.Installation(TuningPolicy(mode="auto"), table, measure, 0, consensus)
    arg_names = tuple(sk.scale_add.arg_names)
    state = pinning.AutotunerState(0, True, kernel, (("n", arg_names.index("n")),), arg_names)
    state.config_list_digest, state.source_hash = code
    x = torch.zeros(n)
    candidates = lambda: list(sk.ADD_CONFIGS if live is None else live)  # noqa: E731
    config = pinning.decide(
        sk.scale_add, state, installation, key(n), (x, x, x, n, 0.5), {}, candidates=candidates
    )
    decision = get_decisions()[-1]
    return Choice(config, decision.source, decision.origin), decision.timings


def test_a_published_decision_is_adopted_without_measuring():
    rank0, rank1 = store_pair()
    first, second = FakeMeasure(block=64), FakeMeasure(block=16)
    choice, timings = choose(rank1, second)
    assert (choice.source, choice.config.kwargs["BLOCK_SIZE"]) == ("tuned", 16) and timings is not None
    adopted, timings = choose(rank0, first)
    assert (adopted.source, adopted.origin, adopted.config.kwargs["BLOCK_SIZE"]) == ("adopted", "rank 1", 16)
    assert first.calls == [] and timings == {"format": "fake", "median_ms": 16.0}  # the publisher's
    assert adopted.config is sk.ADD_CONFIGS[1]  # the live Config object, hooks and all


def test_an_adopting_rank_launches_the_published_config_when_configs_differ_only_in_a_function():
    negate, double = sk.ACT_CONFIGS
    # Rank 1's decision from a fake job store: the real one sends the config as JSON, which has no
    # form for a function.
    published = kv.Published(config_data(double), config_signature(double), 1, None)

    class Job:
        rank = 0

        def lookup(self, *args: Any, **kwargs: Any) -> kv.Published:
            return published

    installation = pinning.Installation(TuningPolicy(mode="auto"), None, None, 0, Job())  # type: ignore[arg-type]
    arg_names = tuple(sk.activate.arg_names)
    state = pinning.AutotunerState(0, True, kernel_id(sk.activate), (("n", 2),), arg_names)
    x = torch.arange(8, dtype=torch.float32)
    call = (x, x, 8)
    live = lambda: [negate, double]  # noqa: E731
    config = pinning.decide(
        sk.activate, state, installation, tuning_key(sk.activate, call, {}), call, {}, candidates=live
    )
    assert config is double  # adopted by signature: the config rank 1 launched, not the first listed
    assert get_decisions()[-1].source == "adopted"


def test_the_loser_of_a_race_launches_the_winners_config_says_so_and_keeps_its_timings(caplog):
    rank0, rank1 = store_pair()

    class PublishFirst(FakeMeasure):
        """Rank 0 measures while rank 1 publishes: rank 0's lookup came back empty."""

        def __call__(self, *args):
            result = super().__call__(*args)
            choose(rank1, FakeMeasure(block=128))
            return result

    loser = PublishFirst(block=8)
    with caplog.at_level(logging.INFO, "megatron_tuning.tuning.tuner.progress"):
        choice, timings = choose(rank0, loser)
    assert loser.calls == [key(100)]  # it measured, but caches the winner's timings, not its own
    assert timings == {"format": "fake", "median_ms": 128.0}
    assert (choice.source, choice.origin, choice.config.kwargs["BLOCK_SIZE"]) == ("adopted", "rank 1", 128)
    adopted = [r.getMessage() for r in caplog.records if r.getMessage().startswith("adopted ")]
    assert adopted == [f"adopted {config_signature(choice.config)} from rank 1 for {KERNEL} [{key(100)}]"]


def test_a_published_config_this_rank_cannot_launch_is_an_error_naming_it():
    rank0, rank1 = store_pair()
    choose(rank1, FakeMeasure(block=128))
    live = [c for c in sk.ADD_CONFIGS if c.kwargs["BLOCK_SIZE"] != 128]
    with pytest.raises(ConsensusError, match="rank 1 published BLOCK_SIZE=128") as caught:
        choose(rank0, FakeMeasure(), live=live)
    assert caught.value.kernel == KERNEL and caught.value.key == key(100)


def test_a_kernel_named_plain_on_one_rank_and_digest_on_another_shares_one_decision():
    rank0, rank1 = store_pair()
    digest = "0123456789ab"
    choose(rank0, FakeMeasure(block=64), code=(digest, None))
    measure = FakeMeasure(block=16)
    adopted, _ = choose(rank1, measure, kernel=f"{KERNEL}@{digest}", code=(digest, None))
    assert (adopted.source, block(adopted), measure.calls) == ("adopted", 64, [])
    # Another config list over the same function is another kernel: it tunes for itself.
    other, _ = choose(
        rank1, FakeMeasure(block=16), kernel=f"{KERNEL}@ba9876543210", code=("ba9876543210", None)
    )
    assert (other.source, block(other)) == ("tuned", 16)


def test_one_source_under_per_rank_module_names_shares_one_decision_by_content():
    """An eval pipeline loads one file as ``candidate_<rank>``: one kernel, tuned once per job."""
    rank0, rank1 = store_pair()
    code = ("0123456789ab", "f" * 64)
    choose(rank0, FakeMeasure(block=64), kernel="candidate_0:scale_add", code=code)
    measure = FakeMeasure(block=16)
    adopted, _ = choose(rank1, measure, kernel="candidate_1:scale_add", code=code)
    assert (adopted.source, block(adopted), measure.calls) == ("adopted", 64, [])
    # Other source under the same qualname: another kernel, tuned for itself.
    other, _ = choose(rank1, FakeMeasure(block=16), kernel="candidate_2:scale_add", code=(code[0], "e" * 64))
    assert (other.source, block(other)) == ("tuned", 16)


def test_lookup_never_waits_for_a_key_nobody_published():
    rank0, _ = store_pair()
    assert rank0.lookup(KERNEL, key(100), ARCH) is None  # a blocking get would hang here


def test_auto_compares_tuned_decisions_across_ranks_tune_mode_does_not():
    assert "tuned" not in unchecked_sources("auto") and "adopted" not in unchecked_sources("auto")
    assert "tuned" in unchecked_sources("tune") and "out_of_scope" in unchecked_sources("auto")


def test_a_second_run_pins_every_key_from_the_cache_with_zero_measurements(tmp_path, monkeypatch):
    cache = tmp_path / "auto.msgpack"
    monkeypatch.setenv("MEGATRON_TUNING_MODE", "auto")
    monkeypatch.setenv("MEGATRON_TUNING_CACHE", str(cache))
    measures = [FakeMeasure(block=64), FakeMeasure(block=64)]  # one per run
    with megatron_tuning.init_deterministic_tuning(measure=measures[0]) as handle:
        assert handle.policy.mode == "auto"
        launch(100)
        assert {e.key for e in load_table(cache)} == {key(100)}  # persisted once tuned (kill-safe)
        assert handle.persist() == 0  # so a checkpoint's persist has nothing to add
        launch(257)
    assert len(measures[0].calls) == 2
    entries = {e.key: config_signature(e.config) for e in load_table(cache)}
    assert set(entries) == {key(100), key(257)}

    decision_log().clear()
    with megatron_tuning.init_deterministic_tuning(measure=measures[1]):
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


# ----------------------------------------------- auto: a config list that changed (issue 33 item 4)


class Largest:
    """Tunes to the largest BLOCK, reporting every candidate it timed as the tuner does."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, autotuner, candidates, args, kwargs, kernel, key):
        self.calls.append(kernel)
        timed = {config_signature(c): [float(c.kwargs["BLOCK"])] * 3 for c in candidates}
        return max(candidates, key=lambda c: c.kwargs["BLOCK"]), {"candidates": timed}


def _auto_run(monkeypatch, tmp_path: Path, name: str, blocks: tuple[int, ...], measure: Largest):
    """One run of a job that loads the kernel file as ``name`` offering BLOCK in ``blocks``:
    (source, matched_by, BLOCK) of its decision for n=40."""
    source = tmp_path / f"{name}_{'_'.join(map(str, blocks))}.py"
    configs = ", ".join(f"({b}, 4)" for b in blocks)
    source.write_text(
        textwrap.dedent(_KERNEL_FILE.replace("AMOUNT", "2.0")).replace(_BLOCKS, f"({configs},)")
    )
    module = _load(source, name)
    monkeypatch.setenv("MEGATRON_TUNING_MODE", "auto")
    monkeypatch.setenv("MEGATRON_TUNING_CACHE", str(tmp_path / "auto.msgpack"))
    decision_log().clear()
    with megatron_tuning.init_deterministic_tuning(measure=measure):
        block = _run_add_two(module, 40)
    (decision,) = [d for d in get_decisions() if d.kernel == f"{name}:add_two"]
    return decision.source, decision.matched_by, block


_BLOCKS = "((8, 1), (16, 2), (32, 4), (64, 4))"


def test_a_cache_entry_whose_config_an_edited_list_dropped_is_replaced_and_persisted(
    tmp_path, monkeypatch, caplog
):
    measure = Largest()
    assert _auto_run(monkeypatch, tmp_path, "mykernels", (8, 16, 32), measure) == ("tuned", None, 32)
    # The decorator's list is edited (the source hash starts at `def`: unchanged). Before the fix the
    # entry for 32 stayed forever: every run re-tuned and persisted nothing.
    with caplog.at_level(logging.INFO, logger="megatron_tuning.tables.cache"):
        assert _auto_run(monkeypatch, tmp_path, "mykernels", (64, 128), measure) == ("tuned", None, 128)
    (entry,) = load_table(tmp_path / "auto.msgpack")
    assert entry.kernel == "mykernels:add_two" and entry.config["kwargs"] == {"BLOCK": 128}
    (replaced,) = [r.getMessage() for r in caplog.records if "no longer offers" in r.getMessage()]
    assert (
        "replaced 1 entry" in replaced and "cache BLOCK=32" in replaced and "re-tuned BLOCK=128" in replaced
    )
    assert _auto_run(monkeypatch, tmp_path, "mykernels", (64, 128), measure) == ("table", None, 128)
    assert len(measure.calls) == 2  # the third run measured nothing


def test_one_source_with_two_config_lists_under_two_module_names_is_two_kernels(tmp_path, monkeypatch):
    measure = Largest()
    a, b = ("cand_a", (8, 16, 32)), ("cand_b", (16, 32, 64))
    assert _auto_run(monkeypatch, tmp_path, *a, measure) == ("tuned", None, 32)
    recordings = [("a", recording_table(get_decisions()))]
    # Before the fix cand_b launched cand_a's entry by content (32 is among its configs too).
    assert _auto_run(monkeypatch, tmp_path, *b, measure) == ("tuned", None, 64)
    recordings.append(("b", recording_table(get_decisions())))
    assert _auto_run(monkeypatch, tmp_path, *b, measure) == ("table", None, 64)
    assert _auto_run(monkeypatch, tmp_path, *a, measure) == ("table", None, 32)
    cached = {e.kernel: e.config["kwargs"]["BLOCK"] for e in load_table(tmp_path / "auto.msgpack")}
    assert cached == {"cand_a:add_two": 32, "cand_b:add_two": 64}
    # Merge keeps them apart too: one entry each, no disagreement to vote away.
    merged = vote_tables(recordings)
    assert {e.kernel: e.config["kwargs"]["BLOCK"] for e in merged.table} == cached
    assert merged.disagreements == []


# ------------------------------------------------------------- auto: the consensus as one rank sees it


class Counting:
    def __init__(self, store: Any) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            self.calls += 1
            return method(*args)

        return counted


def ranks(count: int, store: Any = None) -> list[StoreConsensus]:
    store = store if store is not None else dist.HashStore()
    return [StoreConsensus(store=store, rank=r, world=count) for r in range(count)]


def _store_key(kernel: str, key: str, arch: str) -> str:
    return "d/" + kv.identity_digest(kernel, key, arch).hex()


def block(choice: Any) -> int:
    return int(choice.config.kwargs["BLOCK_SIZE"])


def test_a_lookup_is_one_request_and_adopting_costs_one_per_key() -> None:
    first, second = ranks(2)
    choose(first, FakeMeasure(block=64))
    counting = second._store = Counting(second._store)
    choice, _ = choose(second, FakeMeasure(block=16))
    assert (choice.source, block(choice)) == ("adopted", 64)
    assert counting.calls == 1


def test_a_foreign_record_naming_this_rank_with_another_config_is_adopted_not_taken_for_ours() -> None:
    rank0, rank1 = ranks(2)
    config = config_data(next(c for c in sk.ADD_CONFIGS if c.kwargs["BLOCK_SIZE"] == 64))
    record = {"config": config, "signature": config_signature(config), "rank": 1}
    rank1._store.set(_store_key(KERNEL, key(100), ARCH), json.dumps(record))

    # Rank 1's lookup sees the record: it must launch 64 (what the store says), like rank 0 will.
    choice, _ = choose(rank1, FakeMeasure(block=16))
    assert (choice.source, block(choice)) == ("adopted", 64)
    assert "names this rank" in str(choice.origin)
    other, _ = choose(rank0, FakeMeasure(block=16))
    assert block(other) == 64


def test_publish_compares_the_published_signature_not_the_rank() -> None:
    """A foreign record naming this rank appears while it measures: it is adopted, not taken for ours."""
    (rank0,) = ranks(1)
    config = config_data(next(c for c in sk.ADD_CONFIGS if c.kwargs["BLOCK_SIZE"] == 64))
    foreign = json.dumps({"config": config, "signature": config_signature(config), "rank": 0})

    class ForeignWriter(FakeMeasure):
        def __call__(self, *args: Any) -> Any:
            rank0._store.set(_store_key(KERNEL, key(100), ARCH), foreign)
            return super().__call__(*args)

    choice, timings = choose(rank0, ForeignWriter(block=16))
    assert timings is None  # it measured, then adopted a record without timings: nothing to cache
    assert (choice.source, block(choice)) == ("adopted", 64)


@pytest.mark.parametrize(
    "raw, shown",
    [
        (b"\xff\xfe", "not the library's JSON"),
        ('{"config": {}, "signature": "s", "rank": Infinity}', "Infinity"),
        ("[" * 5000 + "]" * 5000, "not the library's JSON"),
        ('{"config": {}, "signature": "s", "rank": 1.9}', "1.9"),
        ('{"config": {}, "signature": "s", "rank": true}', "True"),
        ('{"config": {}, "signature": "s", "rank": -7}', "-7"),
        ('{"config": {}, "signature": "s", "rank": 99}', "99"),
        ('{"config": [], "signature": "s", "rank": 0}', "config"),
        ('"just text"', "not a JSON object"),
    ],
)
def test_garbage_under_a_decision_key_is_a_consensus_error_naming_kernel_key_and_value(
    raw: Any, shown: str
) -> None:
    rank0, _ = ranks(2)
    rank0._store.set(_store_key(KERNEL, key(100), ARCH), raw)
    with pytest.raises(ConsensusError) as caught:
        choose(rank0, FakeMeasure())
    assert caught.value.kernel == KERNEL and caught.value.key == key(100)
    assert shown in str(caught.value)


def cache_table(blocks: dict[int, int]) -> Table:
    """A cache holding, for each n, the config with BLOCK_SIZE=blocks[n]."""
    entries = []
    for n, size in blocks.items():
        config = next(c for c in sk.ADD_CONFIGS if c.kwargs["BLOCK_SIZE"] == size)
        entries.append(
            Entry(
                arch=ARCH,
                kernel=KERNEL,
                key=key(n),
                config=config_data(config),
                how="tuned",
                source_hash=kernel_source_hash(sk.scale_add),
                triton_version=installed_triton_version(),
            )
        )
    return Table(entries, meta={"kind": "auto-cache"})


def cached(tmp_path: Any, rank: int, blocks: dict[int, int]) -> TableSet:
    """The search path that reads rank ``rank``'s cache file, holding ``blocks``."""
    return TableSet([], cache=(str(tmp_path / f"cache{rank}.msgpack"), cache_table(blocks)))


def test_a_cache_hit_in_a_job_is_proposed_with_one_request_and_the_others_adopt_it(tmp_path: Any) -> None:
    table = cached(tmp_path, 0, {100: 64})
    r0, r1 = ranks(2)
    counting = r0._store = Counting(r0._store)
    hit, timings = choose(r0, FakeMeasure(block=16), table=table)
    assert (hit.source, block(hit), timings, counting.calls) == ("table", 64, None, 1)
    measure = FakeMeasure(block=16)  # rank 1's cache is empty: it adopts the proposal, measures nothing
    follower, _ = choose(r1, measure)
    assert (follower.source, block(follower), measure.calls) == ("adopted", 64, [])


@pytest.mark.parametrize("second_has", ["empty", "other config", "tuned first"])
def test_ranks_with_different_caches_launch_one_config_per_key(tmp_path: Any, second_has: str) -> None:
    table0 = cached(tmp_path, 0, {100: 64})
    table1 = cached(tmp_path, 1, {100: 16} if second_has == "other config" else {})
    r0, r1 = ranks(2)
    if second_has == "tuned first":  # rank 1 (no cache entry) tunes and publishes before rank 0 proposes
        first = choose(r1, FakeMeasure(block=128), table=table1)[0]
        second = choose(r0, FakeMeasure(block=8), table=table0)[0]
        assert (second.source, second.origin) == ("adopted", "rank 1")
    else:
        first = choose(r0, FakeMeasure(block=8), table=table0)[0]
        second = choose(r1, FakeMeasure(block=8), table=table1)[0]
    assert block(first) == block(second)


def test_an_explicit_table_hit_is_an_input_every_rank_shares_and_is_not_proposed(tmp_path: Any) -> None:
    explicit = tmp_path / "explicit.msgpack"
    save_table(cache_table({100: 64}), explicit)
    (r0,) = ranks(1)
    counting = r0._store = Counting(r0._store)
    choice, _ = choose(r0, FakeMeasure(block=16), table=TableSet([explicit]))
    assert (choice.source, block(choice), counting.calls) == ("table", 64, 0)


def test_a_cache_entry_never_shadows_a_shipped_one_so_no_rank_asks_the_job(tmp_path: Any) -> None:
    """Shipped tables are compared inputs: a node whose cache holds the key launches the shipped
    entry too, with no request, as a node without it does."""
    (tmp_path / "shipped" / ARCH).mkdir(parents=True)
    save_table(cache_table({100: 64}), tmp_path / "shipped" / ARCH / "ref.msgpack")
    cache = (str(tmp_path / "cache0.msgpack"), cache_table({100: 16}))
    table = TableSet([], shipped_dir=tmp_path / "shipped", cache=cache)
    (r0,) = ranks(1)
    counting = r0._store = Counting(r0._store)
    choice, _ = choose(r0, FakeMeasure(block=8), table=table)
    assert (choice.source, block(choice), counting.calls) == ("table", 64, 0)
    assert str(choice.origin).endswith("ref.msgpack")


def test_auto_refuses_a_job_above_its_cap_naming_the_flow(monkeypatch: Any) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: kv.AUTO_MAX_RANKS + 1)
    with pytest.raises(PolicyError) as raised:
        kv.start_consensus()
    message = str(raised.value)
    for part in (
        "megatron_tuning tune",
        "show",
        "MEGATRON_TUNING_MODE=deterministic",
        str(kv.AUTO_MAX_RANKS),
    ):
        assert part in message
