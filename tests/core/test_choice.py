"""core.choice's one rule: table, override, single, auto's step, then the miss rules (nearest shape,
cheapest, error); and the seed function's default."""

from __future__ import annotations

import pytest
import torch
import triton

from megatron_tuning.core.choice import (
    Choice,
    InMemoryTable,
    choose,
    deterministic_choice,
    match_live,
    warn_if_mamba_env_ignored,
)
from megatron_tuning.core.errors import AmbiguousConfigError, TableMissError
from megatron_tuning.core.identity import config_data, config_signature, kernel_id
from megatron_tuning.core.key import Key, tuning_key
from megatron_tuning.core.notices import report_policy_end, reset_warnings
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.runtime.interception import lazy_benchmarker

from .. import support_kernels as sk

KERNEL = kernel_id(sk.scale_add)
CONFIGS = sk.ADD_CONFIGS  # BLOCK_SIZE 8, 16, 32, 64, 128: the cheapest is 8


def call(n: int) -> tuple[tuple, dict]:
    x = torch.zeros(n)
    return (x, x, x, n, 0.5), {}


def key(n: int):  # noqa: ANN201
    args, kwargs = call(n)
    return tuning_key(sk.scale_add, args, kwargs)


def table_with(**blocks: int) -> InMemoryTable:
    """``table_with(n1024=64)``: an entry for n=1024 launching the BLOCK_SIZE=64 config."""
    by_block = {c.kwargs["BLOCK_SIZE"]: c for c in CONFIGS}
    return InMemoryTable({(KERNEL, key(int(n[1:]))): config_data(by_block[b]) for n, b in blocks.items()})


@pytest.fixture(autouse=True)
def _fresh_notices():
    reset_warnings()
    yield
    reset_warnings()


def block(config) -> int:
    return int(config.kwargs["BLOCK_SIZE"])


def test_nearest_takes_the_nearest_shapes_entry_and_names_it():
    table = table_with(n1024=64, n8192=128)
    choice = choose(sk.scale_add, CONFIGS, key(1500), table=table, on_miss="nearest")
    assert (choice.source, block(choice.config), choice.nearest_key) == ("nearest", 64, key(1024))
    far = choose(sk.scale_add, CONFIGS, key(7000), table=table, on_miss="nearest")
    assert (far.source, block(far.config), far.nearest_key) == ("nearest", 128, key(8192))


def test_between_bracketing_entries_that_disagree_the_lower_one_is_launched_and_named():
    table = table_with(n1024=64, n2048=128)
    choice = choose(sk.scale_add, CONFIGS, key(1536), table=table, on_miss="nearest")
    assert (choice.source, block(choice.config), choice.nearest_key) == ("nearest", 64, key(1024))
    near_top = choose(sk.scale_add, CONFIGS, key(1900), table=table, on_miss="nearest")
    assert (block(near_top.config), near_top.nearest_key) == (128, key(2048))
    # A lower entry whose config is not live is no bracket: the nearest usable entry is launched.
    live = [c for c in CONFIGS if block(c) != 64]
    choice = choose(sk.scale_add, live, key(1536), table=table, on_miss="nearest")
    assert (block(choice.config), choice.nearest_key) == (128, key(2048))


def test_an_exact_entry_still_wins_over_a_neighbour():
    table = table_with(n1024=64, n1500=16)
    choice = choose(sk.scale_add, CONFIGS, key(1500), table=table, on_miss="nearest")
    assert (choice.source, block(choice.config)) == ("table", 16)


def test_nearest_skips_a_neighbour_whose_config_is_not_live_then_falls_back_to_cheapest():
    live = [c for c in CONFIGS if block(c) != 64]
    table = table_with(n1024=64, n4096=32)
    choice = choose(sk.scale_add, live, key(1500), table=table, on_miss="nearest")
    assert (choice.source, block(choice.config), choice.nearest_key) == ("nearest", 32, key(4096))
    lonely = choose(sk.scale_add, live, key(1500), table=table_with(n1024=64), on_miss="nearest")
    assert (lonely.source, block(lonely.config)) == ("cheapest", 8)


def test_nearest_ignores_other_dtypes_and_tables_without_neighbours():
    half = tuning_key(sk.scale_add, (torch.zeros(4, dtype=torch.float16),) * 3 + (1500, 0.5), {})
    choice = choose(sk.scale_add, CONFIGS, half, table=table_with(n1024=64), on_miss="nearest")
    assert choice.source == "cheapest"

    # A key typed by hand matches exactly, but has no parts to be a neighbour.
    by_text = InMemoryTable({(KERNEL, str(key(1024))): config_data(CONFIGS[3])})
    assert choose(sk.scale_add, CONFIGS, key(1024), table=by_text).source == "table"
    choice = choose(sk.scale_add, CONFIGS, key(1500), table=by_text, on_miss="nearest")
    assert choice.source == "cheapest"


def test_min_cost_and_error_never_look_at_neighbours():
    table = table_with(n1024=64)
    cheap = choose(sk.scale_add, CONFIGS, key(1500), table=table, on_miss="min_cost")
    assert (cheap.source, block(cheap.config)) == ("cheapest", 8)
    with pytest.raises(TableMissError, match="n=1500"):
        choose(sk.scale_add, CONFIGS, key(1500), table=table, on_miss="error")


def test_the_seed_function_keeps_min_cost_as_its_default():
    args, kwargs = call(1500)
    config = deterministic_choice(sk.scale_add, CONFIGS, args, kwargs, table=table_with(n1024=64))
    assert block(config) == 8
    nearest = deterministic_choice(
        sk.scale_add, CONFIGS, args, kwargs, table=table_with(n1024=64), on_miss="nearest"
    )
    assert block(nearest) == 64


def test_a_key_no_table_pins_goes_to_unpinned_with_why_then_to_the_miss_rule():
    reasons: list[str] = []

    def unpinned(reason: str) -> Choice | None:
        reasons.append(reason)
        return Choice(CONFIGS[2], "tuned") if len(reasons) == 1 else None

    table = table_with(n1024=64)
    assert choose(sk.scale_add, CONFIGS, key(1500), table=table, unpinned=unpinned).source == "tuned"
    with pytest.raises(TableMissError, match="no table entry"):  # unpinned said None: the miss rule
        choose(sk.scale_add, CONFIGS, key(1500), table=table, unpinned=unpinned, on_miss="error")
    assert reasons == ["no table entry", "no table entry"]
    # A table hit, an override and a single config never ask.
    assert choose(sk.scale_add, CONFIGS, key(1024), table=table, unpinned=unpinned).source == "table"
    single = choose(sk.scale_add, CONFIGS[:1], key(1500), unpinned=unpinned)
    assert single.source == "single" and config_signature(single.config) == config_signature(CONFIGS[0])
    assert len(reasons) == 2


# ------------------------------------------------------------------ notices (issue 17 items 2, 6)


def test_the_cheapest_fallback_is_said_once_per_kernel_with_its_cost_and_the_fix(notices):
    for n in (100, 200, 300):
        choice = choose(sk.scale_add, CONFIGS, key(n), on_miss="nearest")
        assert choice.source == "cheapest"
    (message,) = notices.matching("has no tuned config")
    assert message.startswith(f"megatron_tuning: kernel {KERNEL} has no tuned config for key {key(100)}")
    assert "no table configured" in message and "cheapest of its 5 configs" in message
    assert "BLOCK_SIZE=8, num_warps=2, num_stages=3" in message
    assert "12-14% of the best config" in message  # the measured cost of the rule
    assert "MEGATRON_TUNING_MODE=auto" in message and "MEGATRON_TUNING_TABLE" in message
    assert "python -m megatron_tuning tune" in message
    report_policy_end(None)  # the end of the policy counts the keys the notice could not
    (summary,) = notices.matching("keys of")
    assert "3 keys of 1 kernel(s) launched the cheapest config" in summary and f"{KERNEL} (3 keys)" in summary


def test_a_table_hit_and_a_single_fallback_key_say_nothing_more(notices):
    table = table_with(n100=64)
    assert choose(sk.scale_add, CONFIGS, key(100), table=table).source == "table"
    assert notices.messages == []
    choose(sk.scale_add, CONFIGS, key(100), on_miss="min_cost")
    report_policy_end(None)
    assert len(notices.matching("has no tuned config")) == 1 and "on_miss='min_cost'" in notices.text
    assert notices.matching("keys of") == []  # one key: the kernel's notice already said it all


def test_the_nearest_fallback_names_the_neighbour_used(notices):
    table = table_with(n1024=64)
    for n in (1500, 1600):
        choice = choose(sk.scale_add, CONFIGS, key(n), table=table, on_miss="nearest")
        assert choice.source == "nearest"
    (message,) = notices.matching("nearest shape")
    assert f"kernel {KERNEL} has no table entry for key {key(1500)}" in message
    assert f"[{key(1024)}] from <memory>" in message and "MEGATRON_TUNING_MODE=auto" in message
    report_policy_end(None)
    assert "2 keys of 1 kernel(s) launched a nearest-shape entry" in notices.text


def test_a_block_size_name_no_kernel_has_is_reported_naming_the_kernels_names(notices):
    policy = TuningPolicy(block_sizes={"BLOCK_SZE": 64})
    for n in (100, 200):
        choose(sk.scale_add, CONFIGS, key(n), block_sizes=policy.block_sizes)
    report_policy_end(policy)
    (message,) = notices.matching("block-size override")
    assert "BLOCK_SZE=64" in message and "none of the 1 kernel(s)" in message
    assert "Did you mean BLOCK_SIZE?" in message and f"{KERNEL}: BLOCK_SIZE" in message


def test_a_block_size_name_some_kernel_has_is_quiet(notices):
    policy = TuningPolicy(block_sizes={"BLOCK_SIZE": 64})
    choice = choose(sk.scale_add, CONFIGS, key(100), block_sizes=policy.block_sizes)
    assert choice.source == "override"
    report_policy_end(policy)
    assert notices.matching("block-size override") == []


def test_mamba_deterministic_is_quiet_under_auto_and_names_the_reason_otherwise(monkeypatch, notices):
    monkeypatch.setenv("MAMBA_DETERMINISTIC", "1")
    assert warn_if_mamba_env_ignored(TuningPolicy(mode="auto")) is False
    assert warn_if_mamba_env_ignored(TuningPolicy(mode="deterministic")) is False
    assert notices.messages == []
    assert warn_if_mamba_env_ignored(TuningPolicy(mode="tune")) is True
    (message,) = notices.messages
    assert "mode is 'tune'" in message and "re-tunes each key" in message
    assert "MEGATRON_TUNING_MODE=deterministic" in message and "MEGATRON_TUNING_MODE=auto" in message
    assert "are not pinned" not in message


def test_on_miss_error_names_every_way_out():
    with pytest.raises(TableMissError) as info:
        choose(sk.scale_add, CONFIGS, key(100), on_miss="error")
    message = str(info.value)
    assert KERNEL in message and key(100) in message
    for way in ("MEGATRON_TUNING_MODE=auto", "python -m megatron_tuning tune", "ON_MISS=nearest", "min_cost"):
        assert way in message


def test_an_entry_matches_the_live_config_it_names_when_configs_differ_only_in_a_function():
    negate, double = sk.ACT_CONFIGS
    assert match_live(config_data(double), [negate, double]) is double
    assert match_live(config_data(negate), [double, negate]) is negate


def test_choose_takes_the_checked_digest_its_caller_has_and_checks_none_again():
    with lazy_benchmarker():  # two configs that sign alike: refused where the digest is computed
        acts = (lambda x: -x, lambda x: x)
        configs = [triton.Config({"BLOCK_SIZE": 16, "ACT": act}, num_warps=1) for act in acts]
        autotuner = triton.autotune(configs=configs, key=["n"])(sk.activate.fn)
    key = Key({"n": 8})
    with pytest.raises(AmbiguousConfigError):
        choose(autotuner, configs, key)
    assert choose(autotuner, configs, key, list_digest="0" * 12).source == "cheapest"
