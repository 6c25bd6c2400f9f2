"""The miss rules of core.choice: nearest shape, cheapest, error; and the seed function's default."""

from __future__ import annotations

import pytest
import torch

from megatron_tuning.core.choice import (
    InMemoryTable,
    Miss,
    choose_deterministically,
    choose_on_miss,
    deterministic_choice,
    pin_without_fallback,
)
from megatron_tuning.core.errors import TableMissError
from megatron_tuning.core.identity import config_data, config_signature, kernel_id, tuning_key

from .. import support_kernels as sk

KERNEL = kernel_id(sk.scale_add)
CONFIGS = sk.ADD_CONFIGS  # BLOCK_SIZE 8, 16, 32, 64, 128: the cheapest is 8


def call(n: int) -> tuple[tuple, dict]:
    x = torch.zeros(n)
    return (x, x, x, n, 0.5), {}


def key(n: int) -> str:
    args, kwargs = call(n)
    return tuning_key(sk.scale_add, args, kwargs)


def table_with(**blocks: int) -> InMemoryTable:
    """``table_with(n1024=64)``: an entry for n=1024 launching the BLOCK_SIZE=64 config."""
    by_block = {c.kwargs["BLOCK_SIZE"]: c for c in CONFIGS}
    return InMemoryTable({(KERNEL, key(int(n[1:]))): config_data(by_block[b]) for n, b in blocks.items()})


def block(config) -> int:
    return int(config.kwargs["BLOCK_SIZE"])


def test_nearest_takes_the_nearest_shapes_entry_and_names_it():
    table = table_with(n1024=64, n8192=128)
    choice = choose_deterministically(sk.scale_add, CONFIGS, key(1500), table=table, on_miss="nearest")
    assert (choice.source, block(choice.config), choice.nearest_key) == ("nearest", 64, key(1024))
    far = choose_deterministically(sk.scale_add, CONFIGS, key(7000), table=table, on_miss="nearest")
    assert (far.source, block(far.config), far.nearest_key) == ("nearest", 128, key(8192))


def test_an_exact_entry_still_wins_over_a_neighbour():
    table = table_with(n1024=64, n1500=16)
    choice = choose_deterministically(sk.scale_add, CONFIGS, key(1500), table=table, on_miss="nearest")
    assert (choice.source, block(choice.config)) == ("table", 16)


def test_nearest_skips_a_neighbour_whose_config_is_not_live_then_falls_back_to_cheapest():
    live = [c for c in CONFIGS if block(c) != 64]
    table = table_with(n1024=64, n4096=32)
    choice = choose_deterministically(sk.scale_add, live, key(1500), table=table, on_miss="nearest")
    assert (choice.source, block(choice.config), choice.nearest_key) == ("nearest", 32, key(4096))
    lonely = choose_deterministically(
        sk.scale_add, live, key(1500), table=table_with(n1024=64), on_miss="nearest"
    )
    assert (lonely.source, block(lonely.config)) == ("cheapest", 8)


def test_nearest_ignores_other_dtypes_and_tables_without_neighbours():
    half = tuning_key(sk.scale_add, (torch.zeros(4, dtype=torch.float16),) * 3 + (1500, 0.5), {})
    choice = choose_deterministically(
        sk.scale_add, CONFIGS, half, table=table_with(n1024=64), on_miss="nearest"
    )
    assert choice.source == "cheapest"

    class LookupOnly:  # a user table without neighbours(): nearest has nothing to offer
        def lookup(self, kernel, key, *, arch, source_hash=None):
            return None

    choice = choose_deterministically(sk.scale_add, CONFIGS, key(1500), table=LookupOnly(), on_miss="nearest")
    assert choice.source == "cheapest"


def test_min_cost_and_error_never_look_at_neighbours():
    table = table_with(n1024=64)
    cheap = choose_deterministically(sk.scale_add, CONFIGS, key(1500), table=table, on_miss="min_cost")
    assert (cheap.source, block(cheap.config)) == ("cheapest", 8)
    with pytest.raises(TableMissError, match="n=1500"):
        choose_deterministically(sk.scale_add, CONFIGS, key(1500), table=table, on_miss="error")


def test_the_seed_function_keeps_min_cost_as_its_default():
    args, kwargs = call(1500)
    config = deterministic_choice(sk.scale_add, CONFIGS, args, kwargs, table=table_with(n1024=64))
    assert block(config) == 8
    nearest = deterministic_choice(
        sk.scale_add, CONFIGS, args, kwargs, table=table_with(n1024=64), on_miss="nearest"
    )
    assert block(nearest) == 64


def test_pin_without_fallback_reports_a_miss_and_choose_on_miss_explains_it():
    miss = pin_without_fallback(sk.scale_add, CONFIGS, key(1500), table=table_with(n1024=64))
    assert miss == Miss("no table entry")
    with pytest.raises(TableMissError, match="no table entry"):
        choose_on_miss(sk.scale_add, CONFIGS, key(1500), miss, on_miss="error")
    single = pin_without_fallback(sk.scale_add, CONFIGS[:1], key(1500))
    assert single.source == "single" and config_signature(single.config) == config_signature(CONFIGS[0])
