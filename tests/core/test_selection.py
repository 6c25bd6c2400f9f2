"""The pure selection core: names, keys, signatures, costs and choices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import triton

from megatron_tuning.core import identity
from megatron_tuning.core.chaos import chaos_choice
from megatron_tuning.core.choice import autotune_configs, deterministic_choice, warn_if_mamba_env_ignored
from megatron_tuning.core.errors import BlockSizeOverrideError, PolicyError, TableMissError
from megatron_tuning.core.fallback import (
    cheapest,
    estimate_config_cost,
    filter_configs_by_block_sizes,
    order_by_cost,
)
from megatron_tuning.core.identity import (
    arch_tag,
    config_data,
    config_signature,
    kernel_id,
    kernel_module,
    kernel_name,
    kernel_source_hash,
)
from megatron_tuning.core.key import tuning_key
from megatron_tuning.core.notices import reset_warnings
from megatron_tuning.core.policy import TuningPolicy

from .. import support_kernels as sk

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh_warnings():
    reset_warnings()
    yield
    reset_warnings()


def C(kwargs, **options):  # noqa: ANN001, ANN003, ANN201, N802
    return triton.Config(kwargs, **options)


# ------------------------------------------------------------------ identity


def test_arch_tag_is_unknown_under_the_interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        assert arch_tag() == "unknown"
    else:  # the same suite on a GPU machine
        major, minor = torch.cuda.get_device_capability()
        assert arch_tag() == f"sm{major}{minor}"


def test_arch_for_device_formats_compute_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert identity._arch_for_device(0) == "sm90"


def test_kernel_names_unwrap_heuristics_inside_and_outside():
    assert kernel_name(sk.scale_add) == "scale_add"
    assert kernel_name(sk.copy_hooked) == "copy_hooked"  # Autotuner -> Heuristics -> JIT
    assert kernel_name(sk.maybe_double) == "maybe_double"  # Heuristics -> Autotuner -> JIT
    assert kernel_module(sk.scale_add) == sk.__name__
    assert kernel_id(sk.copy_hooked) == f"{sk.__name__}:copy_hooked"


def test_source_hash_ignores_decorators_and_is_hex():
    digest = kernel_source_hash(sk.scale_add)
    assert digest is not None and len(digest) == 64
    assert digest != kernel_source_hash(sk.copy_hooked)


# ------------------------------------------------------------------ keys


def test_tuning_key_has_key_values_then_dtypes():
    x = torch.zeros(4)
    y = torch.zeros(4, dtype=torch.float16)
    key = tuning_key(sk.scale_add, (x, y, x, 4, 0.5), {})
    assert key == "n=4 | x_ptr:torch.float32, y_ptr:torch.float16, out_ptr:torch.float32"


def test_tuning_key_accepts_kwargs_and_keeps_bool_apart_from_int():
    x = torch.zeros(4)
    as_int = tuning_key(sk.maybe_double.fn, (x, x, 4), {"flag": 1})
    as_bool = tuning_key(sk.maybe_double.fn, (x, x, 4), {"flag": True})
    assert as_int.startswith("n=4, flag=1 |") and as_bool.startswith("n=4, flag=True |")
    assert as_int != as_bool


def test_tuning_key_skips_missing_key_args_and_renders_floats():
    x = torch.zeros(2)
    assert (
        tuning_key(sk.maybe_double.fn, (x, x, 2.5), {})
        == "n=2.5 | x_ptr:torch.float32, out_ptr:torch.float32"
    )


# ------------------------------------------------------------------ signatures and data


def test_signature_is_sorted_and_typed():
    a = C({"BLOCK_N": 64, "BLOCK_M": 32, "EVEN": True}, num_warps=4, num_stages=2)
    b = C({"EVEN": True, "BLOCK_M": 32, "BLOCK_N": 64}, num_warps=4, num_stages=2)
    c = C({"BLOCK_N": 64, "BLOCK_M": 32, "EVEN": 1}, num_warps=4, num_stages=2)
    assert config_signature(a) == "BLOCK_M=32, BLOCK_N=64, EVEN=True, num_warps=4, num_stages=2"
    assert config_signature(a) == config_signature(b)
    assert config_signature(a) != config_signature(c)


def test_signature_shows_non_default_fields_only():
    assert "num_ctas" not in config_signature(C({"B": 1}))
    assert config_signature(C({"B": 1}, num_ctas=2, maxnreg=128)).endswith("num_ctas=2, maxnreg=128")


def test_config_data_round_trips_through_json():
    config = C(
        {"BLOCK_M": 64, "SPLIT": False, "scale": 0.5, "name": "x"}, num_warps=8, num_stages=4, maxnreg=96
    )
    data = json.loads(json.dumps(config_data(config)))
    assert data == config_data(config)
    assert config_signature(data) == config_signature(config)


def test_config_data_has_no_hooks():
    config = C({"B": 8}, pre_hook=lambda nargs: None)
    assert "pre_hook" not in config_data(config)


# ------------------------------------------------------------------ cost


@pytest.mark.parametrize("name", ["BLOCK_M", "BLOCK_SIZE_N", "BM", "XBLOCK", "R0_BLOCK", "BLOCK_K", "RBLOCK"])
def test_block_names_count_in_cost(name):
    small = estimate_config_cost(C({name: 16}, num_warps=4, num_stages=2))
    large = estimate_config_cost(C({name: 64}, num_warps=4, num_stages=2))
    assert small < large


@pytest.mark.parametrize("name", ["GROUP_SIZE_M", "NUM_BLOCKS", "EVEN_K", "SPLIT_K"])
def test_other_names_do_not_count_in_cost(name):
    assert estimate_config_cost(C({name: 1})) == estimate_config_cost(C({name: 8}))


def test_cost_is_block_product_times_stages_then_warps():
    assert estimate_config_cost(C({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=3)) == (
        64 * 32 * 3,
        4,
        3,
    )


def test_cheapest_ties_break_by_signature_then_position():
    a = C({"BLOCK_M": 32, "GROUP": 8}, num_warps=4, num_stages=2)
    b = C({"BLOCK_M": 32, "GROUP": 1}, num_warps=4, num_stages=2)
    assert cheapest([a, b]) is b and cheapest([b, a]) is b
    twin_1, twin_2 = C({"BLOCK_M": 32}), C({"BLOCK_M": 32})
    assert cheapest([twin_1, twin_2]) is twin_1 and cheapest([twin_2, twin_1]) is twin_2
    assert order_by_cost([a, b, C({"BLOCK_M": 16})])[0].kwargs == {"BLOCK_M": 16}


def test_cheapest_of_one_and_of_none():
    only = C({"X": 1})
    assert cheapest([only]) is only
    with pytest.raises(ValueError):
        cheapest([])


# ------------------------------------------------------------------ block-size overrides


def test_filter_by_block_sizes():
    configs = [
        C({"BLOCK_M": 32, "BLOCK_N": 64}),
        C({"BLOCK_M": 64, "BLOCK_N": 64}),
        C({"BLOCK_M": 64, "BLOCK_N": 32}),
    ]
    assert filter_configs_by_block_sizes(configs) == configs
    assert filter_configs_by_block_sizes(configs, {"XBLOCK": 8}) == configs  # not this kernel's names
    assert filter_configs_by_block_sizes(configs, [("BLOCK_M", 64)]) == configs[1:]
    assert filter_configs_by_block_sizes(configs, {"BLOCK_M": 64, "BLOCK_N": 32}) == [configs[2]]
    assert filter_configs_by_block_sizes(configs, {"BLOCK_M": 128}) == []


# ------------------------------------------------------------------ deterministic_choice

X4 = torch.zeros(4)
ARGS = (X4, X4, X4, 4, 1.0)
KEY = "n=4 | x_ptr:torch.float32, y_ptr:torch.float32, out_ptr:torch.float32"


def test_choice_without_table_is_cheapest():
    assert deterministic_choice(sk.scale_add, sk.ADD_CONFIGS, ARGS, {}) is sk.ADD_CONFIGS[0]


def test_choice_prefers_table_entry_matched_to_live_object():
    table = {(kernel_id(sk.scale_add), KEY): config_data(sk.ADD_CONFIGS[2])}
    assert deterministic_choice(sk.scale_add, sk.ADD_CONFIGS, ARGS, {}, table=table) is sk.ADD_CONFIGS[2]


def test_table_entry_matching_no_candidate_is_a_miss_with_warning(notices):
    table = {(kernel_id(sk.scale_add), KEY): config_data(C({"BLOCK_SIZE": 4096}))}
    chosen = deterministic_choice(sk.scale_add, sk.ADD_CONFIGS, ARGS, {}, table=table)
    deterministic_choice(sk.scale_add, sk.ADD_CONFIGS, ARGS, {}, table=table)
    assert chosen is sk.ADD_CONFIGS[0]
    warnings = notices.matching("matches none")
    assert len(warnings) == 1 and "scale_add" in warnings[0] and "BLOCK_SIZE=4096" in warnings[0]
    # The fix is named: the configs the kernel does offer.
    assert "Re-tune the kernel" in warnings[0] and "BLOCK_SIZE=8, num_warps=2, num_stages=3" in warnings[0]
    with pytest.raises(TableMissError, match="matches no live config"):
        deterministic_choice(sk.scale_add, sk.ADD_CONFIGS, ARGS, {}, table=table, on_miss="error")


def test_choice_block_size_override():
    chosen = deterministic_choice(sk.scale_add, sk.ADD_CONFIGS, ARGS, {}, block_sizes={"BLOCK_SIZE": 64})
    assert chosen is sk.ADD_CONFIGS[3]
    with pytest.raises(BlockSizeOverrideError) as info:
        deterministic_choice(sk.scale_add, sk.ADD_CONFIGS, ARGS, {}, block_sizes={"BLOCK_SIZE": 3})
    assert "BLOCK_SIZE=3" in str(info.value) and "scale_add" in str(info.value)


def test_on_miss_error_names_kernel_and_key():
    with pytest.raises(TableMissError) as info:
        deterministic_choice(sk.scale_add, sk.ADD_CONFIGS, ARGS, {}, on_miss="error")
    assert info.value.kernel == kernel_id(sk.scale_add) and info.value.key == KEY
    assert KEY in str(info.value) and "MEGATRON_TUNING_ON_MISS" in str(info.value)


def test_on_miss_error_does_not_apply_with_one_candidate():
    assert (
        deterministic_choice(sk.scale_add, sk.ADD_CONFIGS[:1], ARGS, {}, on_miss="error") is sk.ADD_CONFIGS[0]
    )


def test_bad_on_miss_is_rejected():
    with pytest.raises(PolicyError, match="on_miss"):
        deterministic_choice(sk.scale_add, sk.ADD_CONFIGS, ARGS, {}, on_miss="fastest")


# ------------------------------------------------------------------ chaos


def test_chaos_four_ranks_pick_at_least_two_configs_reproducibly(monkeypatch):
    picks = []
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        picks.append(config_signature(chaos_choice(sk.scale_add, sk.ADD_CONFIGS, ARGS, {})))
    assert len(set(picks)) >= 2
    assert all(picks[i] != picks[i + 1] for i in range(3))
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        assert (
            config_signature(chaos_choice(sk.scale_add, list(reversed(sk.ADD_CONFIGS)), ARGS, {}))
            == picks[rank]
        )


def test_chaos_with_one_candidate_and_bad_rank(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    assert chaos_choice(sk.scale_add, sk.ADD_CONFIGS[:1], ARGS, {}) is sk.ADD_CONFIGS[0]
    monkeypatch.setenv("RANK", "three")
    with pytest.raises(PolicyError, match="RANK"):
        chaos_choice(sk.scale_add, sk.ADD_CONFIGS, ARGS, {})


# ------------------------------------------------------------------ decoration helpers


def test_autotune_configs(monkeypatch, notices):
    monkeypatch.delenv("MEGATRON_TUNING_MODE", raising=False)
    assert autotune_configs(sk.ADD_CONFIGS) == sk.ADD_CONFIGS
    monkeypatch.setenv("MEGATRON_TUNING_MODE", "deterministic")
    assert autotune_configs(sk.ADD_CONFIGS) == [sk.ADD_CONFIGS[0]]
    monkeypatch.setenv("MEGATRON_TUNING_BLOCK_SIZES", "BLOCK_SIZE=32")
    assert autotune_configs(sk.ADD_CONFIGS) == [sk.ADD_CONFIGS[2]]
    monkeypatch.setenv("MEGATRON_TUNING_BLOCK_SIZES", "BLOCK_SIZE=31")
    with pytest.raises(BlockSizeOverrideError):
        autotune_configs(sk.ADD_CONFIGS)


def test_autotune_configs_says_once_per_list_that_it_pinned_the_cheapest(monkeypatch, notices):
    monkeypatch.delenv("MEGATRON_TUNING_MODE", raising=False)
    monkeypatch.delenv("MEGATRON_TUNING_BLOCK_SIZES", raising=False)
    reset_warnings()
    autotune_configs(sk.ADD_CONFIGS)
    assert not notices.matching("autotune_configs")  # the list is returned whole: nothing to say
    monkeypatch.setenv("MEGATRON_TUNING_MODE", "deterministic")
    autotune_configs(sk.ADD_CONFIGS)
    autotune_configs(sk.ADD_CONFIGS)
    (notice,) = notices.matching("autotune_configs shrank")
    assert f"{len(sk.ADD_CONFIGS)} configs to the cheapest" in notice
    assert config_signature(sk.ADD_CONFIGS[0]) in notice and "12-14%" in notice
    assert "MEGATRON_TUNING_MODE=auto" in notice and "megatron_tuning tune" in notice
    reset_warnings()  # a new policy reports again
    autotune_configs(sk.ADD_CONFIGS)
    assert len(notices.matching("autotune_configs shrank")) == 2


def test_autotune_configs_acts_only_where_the_mode_is_set(monkeypatch, notices):
    """At decoration nothing was asked for unless MEGATRON_TUNING_MODE says so: the mode's one default
    (deterministic) is for a session, and torch's deterministic algorithms are no second default."""
    monkeypatch.delenv("MEGATRON_TUNING_MODE", raising=False)
    torch.use_deterministic_algorithms(True)
    try:
        assert autotune_configs(sk.ADD_CONFIGS) == sk.ADD_CONFIGS
    finally:
        torch.use_deterministic_algorithms(False)
    assert autotune_configs(sk.ADD_CONFIGS, policy=TuningPolicy()) == [sk.ADD_CONFIGS[0]]


def test_mamba_env_warning_once(monkeypatch, notices):
    monkeypatch.setenv("MAMBA_DETERMINISTIC", "1")
    off = TuningPolicy(mode="off")
    assert warn_if_mamba_env_ignored(off) is True
    assert warn_if_mamba_env_ignored(off) is False
    assert warn_if_mamba_env_ignored(TuningPolicy(mode="deterministic")) is False
    assert len(notices.matching("MAMBA_DETERMINISTIC")) == 1
    reset_warnings()
    assert warn_if_mamba_env_ignored(off) is True
    monkeypatch.setenv("MAMBA_DETERMINISTIC", "0")
    reset_warnings()
    assert warn_if_mamba_env_ignored(off) is False


# ------------------------------------------------------------------ across processes

_PROBE = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from tests import support_kernels as sk
    from types import SimpleNamespace
    from megatron_tuning.core import chaos, choice, fallback, identity
    s = SimpleNamespace(**{**vars(identity), **vars(fallback), **vars(choice), **vars(chaos)})
    x, h = torch.zeros(3), torch.zeros(3, dtype=torch.float16)
    args = (x, h, x, 3, 0.25)
    out = {"key": s.tuning_key(sk.scale_add, args, {}), "id": s.kernel_id(sk.copy_hooked),
           "hash": s.kernel_source_hash(sk.scale_add),
           "twins": [s.kernel_id(sk.twin_small), s.kernel_id(sk.twin_large)],
           "sigs": [s.config_signature(c) for c in sk.ADD_CONFIGS + sk.ACT_CONFIGS],
           "cheapest": s.config_signature(s.deterministic_choice(sk.scale_add, sk.ADD_CONFIGS, args, {})),
           "order": [s.config_signature(c) for c in s.order_by_cost(list(reversed(sk.ADD_CONFIGS)))],
           "chaos": []}
    for rank in range(4):
        os.environ["RANK"] = str(rank)
        out["chaos"].append(s.config_signature(s.chaos_choice(sk.scale_add, sk.ADD_CONFIGS, args, {})))
    print(json.dumps(out))
    """
)


def test_results_identical_across_fresh_processes():
    outputs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(REPO))
        done = subprocess.run(
            [sys.executable, "-c", _PROBE],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        outputs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert outputs[0] == outputs[1]
    assert len(set(outputs[0]["chaos"])) >= 2
    assert len(set(outputs[0]["sigs"])) == len(sk.ADD_CONFIGS + sk.ACT_CONFIGS)  # a function by its name
    small, large = outputs[0]["twins"]  # the config-list digest is the same in every process
    assert small != large and small.startswith(f"{sk.__name__}:twin_body@")
