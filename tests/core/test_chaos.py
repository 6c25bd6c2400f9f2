"""Chaos picks as pure functions: the rank formula, and the coordinated pick over a matrix of layouts.

The matrix covers world sizes 2-8 and 16, the whole world, consecutive groups, strided groups
(pipeline stage = rank % S for S = 2..8), 2-6 distinct configs with and without duplicates, and
several arrival orders per group. "Caught" needs two ranks of a group to launch different
configs; the coordinated rule guarantees more: every rank after the first differs from the first
(the store check compares each rank with the first claim). The same matrix run with the rank
formula alone finds blind groups, so it can fail.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator, Sequence

import pytest
import triton

from megatron_tuning.core.chaos import (
    ChaosClaim,
    chaos_choice,
    chaos_index,
    choose_chaos,
)
from megatron_tuning.core.identity import config_signature

from .. import support_kernels as sk

KERNEL = "pkg.kernels:matmul"
KEYS = [f"M={m} | a:torch.float16" for m in (6, 1000)]


class Claims:
    """In-memory ``ChaosCoordinator`` for one rank: the first claim per ident wins (like compare_set)."""

    def __init__(self, rank: int, claims: dict[tuple[str, str, str], ChaosClaim]) -> None:
        self.rank, self.claims = rank, claims

    def claim(self, kernel: str, key: str, arch: str, signature: str) -> ChaosClaim:
        return self.claims.setdefault((kernel, key, arch), ChaosClaim(self.rank, signature))

    def recall(self, kernel: str, key: str, arch: str) -> ChaosClaim | None:
        return self.claims.get((kernel, key, arch))


def configs(distinct: int, duplicates: str) -> list[triton.Config]:
    base = [triton.Config({"BLOCK": 16 << i}, num_warps=4) for i in range(distinct)]
    if duplicates == "none":
        return base
    if duplicates == "all_twice":
        return [c for c in base for _ in range(2)]
    # torchao int8_mm: 27 configs, 25 distinct -- a few duplicates sitting next to the original.
    return base[:1] * 2 + base[1:2] * 2 + base[2:]


def layouts(world: int) -> Iterator[tuple[str, list[list[int]]]]:
    ranks = list(range(world))
    yield "world", [ranks]
    for size in (2, 3, 4):
        if size < world:
            yield f"consecutive{size}", [ranks[i : i + size] for i in range(0, world, size)]
    for stages in range(2, 9):
        if stages < world:
            yield f"stage=rank%{stages}", [[r for r in ranks if r % stages == s] for s in range(stages)]


def arrival_orders(group: Sequence[int], seed: int) -> list[list[int]]:
    shuffled = list(group)
    random.Random(seed).shuffle(shuffled)
    return [list(group), list(reversed(group)), shuffled]


def picks_for(
    group: Sequence[int], order: Sequence[int], candidates: list[triton.Config], key: str, coordinated: bool
) -> dict[int, str]:
    claims: dict[tuple[str, str, str], ChaosClaim] = {}
    picked = {}
    for rank in order:
        coordinator = Claims(rank, claims) if coordinated else None
        choice = choose_chaos(KERNEL, key, candidates, rank=rank, coordinator=coordinator)
        assert choice.source == "chaos"
        picked[rank] = config_signature(choice.config)
    return picked


MATRIX = [
    (world, distinct, duplicates)
    for world in (2, 3, 4, 5, 6, 7, 8, 16)
    for distinct in (2, 3, 4, 5, 6)
    for duplicates in ("none", "all_twice", "int8_mm_like")
]


@pytest.mark.parametrize(("world", "distinct", "duplicates"), MATRIX)
def test_every_rank_after_the_first_differs_from_it_in_every_layout(
    world: int, distinct: int, duplicates: str
):
    candidates = configs(distinct, duplicates)
    checked = 0
    for name, groups in layouts(world):
        for index, group in enumerate(groups):
            if len(group) < 2:
                continue
            for key in KEYS:
                for order in arrival_orders(group, seed=zlib.crc32(f"{world}/{name}/{index}".encode())):
                    picked = picks_for(group, order, candidates, key, coordinated=True)
                    first = picked[order[0]]
                    same = [r for r in order[1:] if picked[r] == first]
                    assert same == [], (name, group, order, key, picked)
                    checked += 1
    assert checked > 0


def test_the_rank_formula_alone_is_blind_in_strided_layouts():
    """The control: what chaos did before. 8 ranks, stage = rank % 4, 4 configs: ranks 0 and 4 agree."""
    candidates = configs(4, "none")
    blind = [
        (name, tuple(group))
        for name, groups in layouts(8)
        for group in groups
        if len(set(picks_for(group, group, candidates, KEYS[0], coordinated=False).values())) == 1
    ]
    assert ("stage=rank%4", (0, 4)) in blind
    coordinated = picks_for([0, 4], [0, 4], candidates, KEYS[0], coordinated=True)
    assert len(set(coordinated.values())) == 2


@pytest.mark.parametrize("duplicates", ["none", "all_twice", "int8_mm_like"])
def test_the_rank_formula_picks_distinct_configs_for_ranks_closer_than_their_count(duplicates: str):
    for distinct in (2, 3, 5, 25):
        candidates = configs(distinct, duplicates)
        for m in range(12):  # several keys: the old pick over the raw list landed on a duplicate pair
            key = f"M={m} | a:torch.int8"
            picked = [picks_for([r], [r], candidates, key, coordinated=False)[r] for r in range(distinct)]
            assert len(set(picked)) == distinct, (distinct, key, picked)


def test_one_distinct_config_says_no_other_config_and_never_asks_the_store():
    class Refuse:
        def claim(self, *args: object) -> ChaosClaim:
            raise AssertionError("a single distinct config needs no claim")

    twice = [sk.ADD_CONFIGS[0], triton.Config(dict(sk.ADD_CONFIGS[0].kwargs), num_warps=2)]
    choice = choose_chaos(KERNEL, KEYS[0], twice, rank=3, coordinator=Refuse())
    assert (choice.source, choice.chaos) == ("chaos", "no_other_config")
    assert choice.origin == "no other distinct config (1 distinct of 2 live)"


def test_outcomes_name_the_first_claim():
    claims: dict[tuple[str, str, str], ChaosClaim] = {}
    candidates = configs(3, "none")
    key = next(
        k
        for k in (f"n={i}" for i in range(100))
        if chaos_index(KERNEL, k, 0, 3) == chaos_index(KERNEL, k, 3, 3)
    )
    first = choose_chaos(KERNEL, key, candidates, rank=0, coordinator=Claims(0, claims))
    again = choose_chaos(KERNEL, key, candidates, rank=0, coordinator=Claims(0, claims))
    moved = choose_chaos(KERNEL, key, candidates, rank=3, coordinator=Claims(3, claims))
    other = choose_chaos(KERNEL, key, candidates, rank=1, coordinator=Claims(1, claims))
    assert (first.chaos, first.origin) == ("first", "first claim")
    assert again.config is first.config  # a second autotuner of this id asking again: the same pick
    assert (moved.chaos, moved.origin) == ("differs", "moved off rank 0's claim")
    assert (other.chaos, other.origin) == ("differs", "differs from rank 0's claim")
    assert config_signature(moved.config) != config_signature(first.config)
    solo = choose_chaos(KERNEL, key, candidates, rank=0)
    assert (solo.chaos, solo.origin) == ("rank_formula", "rank formula")


def test_seed_api_keeps_its_promise_with_duplicates(monkeypatch: pytest.MonkeyPatch):
    doubled = [c for c in sk.ADD_CONFIGS for _ in range(2)]
    picks = []
    for rank in range(len(sk.ADD_CONFIGS)):
        monkeypatch.setenv("RANK", str(rank))
        picks.append(config_signature(chaos_choice(sk.scale_add, doubled, (None,) * 3 + (64, 1.0), {})))
    assert len(set(picks)) == len(sk.ADD_CONFIGS)  # consecutive ranks, and all ranks < 5 apart, differ


def test_offline_picks_recall_the_last_claim_and_never_claim():
    claims: dict[tuple[str, str, str], ChaosClaim] = {}
    candidates = configs(4, "none")
    online = {
        r: choose_chaos(KERNEL, KEYS[0], candidates, rank=r, coordinator=Claims(r, claims)) for r in (0, 4)
    }

    class RecallOnly(Claims):
        def claim(self, *args: object) -> ChaosClaim:
            raise AssertionError("no store traffic inside a CUDA graph capture")

    for rank in (0, 4):  # a new session re-deciding inside a capture launches what it did before
        offline = choose_chaos(
            KERNEL, KEYS[0], candidates, rank=rank, coordinator=RecallOnly(rank, claims), offline=True
        )
        assert offline.config is online[rank].config and offline.chaos == online[rank].chaos
    fresh = choose_chaos(KERNEL, KEYS[1], candidates, rank=4, coordinator=RecallOnly(4, claims), offline=True)
    assert (fresh.chaos, fresh.origin) == (
        "rank_formula",
        "rank formula (CUDA graph capture: no store traffic)",
    )
