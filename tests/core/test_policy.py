"""TuningPolicy: validation and the MEGATRON_TUNING_* environment."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_tuning.core.errors import PolicyError
from megatron_tuning.core.policy import TuningPolicy

ENV = (
    "MODE",
    "SCOPE",
    "ON_MISS",
    "TABLE",
    "AGREEMENT",
    "AGREEMENT_TIMEOUT",
    "STRICT",
    "STALE_ENTRIES",
    "BLOCK_SIZES",
    "RECORD_DIR",
    "DECISION_LOG",
    "SHIPPED_TABLES",
    "CACHE",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(f"MEGATRON_TUNING_{name}", raising=False)


def test_defaults_in_code_and_from_env():
    assert TuningPolicy().mode == "deterministic"
    policy = TuningPolicy.from_env()
    assert policy.mode == "off" and policy.on_miss == "nearest" and policy.agreement == "store"
    assert policy.cache is None  # auto mode then uses the per-user default
    assert TuningPolicy.from_env(default_mode="deterministic").mode == "deterministic"


def test_every_variable_is_read(monkeypatch, tmp_path):
    values = {
        "MODE": "Chaos",
        "SCOPE": "pkg.kernels, other",
        "ON_MISS": "error",
        "TABLE": "/a.msgpack::/b.msgpack",
        "AGREEMENT": "allgather",
        "AGREEMENT_TIMEOUT": "12.5",
        "STRICT": "1",
        "STALE_ENTRIES": "miss",
        "BLOCK_SIZES": "BLOCK_SIZE_N=128, BLOCK_SIZE_M=64",
        "RECORD_DIR": str(tmp_path),
        "DECISION_LOG": "/tmp/d-{rank}.json",
        "SHIPPED_TABLES": "off",
        "CACHE": str(tmp_path / "auto.msgpack"),
    }
    for name, value in values.items():
        monkeypatch.setenv(f"MEGATRON_TUNING_{name}", value)
    policy = TuningPolicy.from_env()
    assert policy == TuningPolicy(
        mode="chaos",
        scope=("pkg.kernels", "other"),
        on_miss="error",
        tables=("/a.msgpack", "/b.msgpack"),
        agreement="allgather",
        agreement_timeout_s=12.5,
        strict=True,
        stale_entries="miss",
        block_sizes=(("BLOCK_SIZE_M", 64), ("BLOCK_SIZE_N", 128)),
        record_dir=str(tmp_path),
        decision_log="/tmp/d-{rank}.json",
        use_shipped_tables=False,
        cache=str(tmp_path / "auto.msgpack"),
    )
    assert policy.effective_stale_entries == "error"


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("MODE", "determinstic", "off|deterministic|chaos|record|tune"),
        ("ON_MISS", "fastest", "min_cost|error"),
        ("AGREEMENT", "gossip", "store|allgather|off"),
        ("STRICT", "maybe", "boolean"),
        ("AGREEMENT_TIMEOUT", "soon", "number"),
        ("AGREEMENT_TIMEOUT", "-1", "positive"),
        ("BLOCK_SIZES", "BLOCK_M=big", "NAME=INT"),
        ("BLOCK_SIZES", "64", "NAME=INT"),
        ("STALE_ENTRIES", "ignore", "use|miss|error"),
    ],
)
def test_bad_values_name_variable_value_and_allowed(monkeypatch, name, value, allowed):
    monkeypatch.setenv(f"MEGATRON_TUNING_{name}", value)
    with pytest.raises(PolicyError) as info:
        TuningPolicy.from_env()
    message = str(info.value)
    assert f"MEGATRON_TUNING_{name}" in message and value in message
    assert allowed in message


def test_empty_mode_falls_back_to_default(monkeypatch):
    monkeypatch.setenv("MEGATRON_TUNING_MODE", "")
    assert TuningPolicy.from_env().mode == "off"


def test_torch_determinism_turns_deterministic_on_unless_told_otherwise(monkeypatch):
    torch.use_deterministic_algorithms(True)
    try:
        assert TuningPolicy.from_env().mode == "deterministic"
        assert TuningPolicy.from_env(follow_torch_determinism=False).mode == "off"
        monkeypatch.setenv("MEGATRON_TUNING_MODE", "off")
        assert TuningPolicy.from_env().mode == "off"  # an explicit mode wins
    finally:
        torch.use_deterministic_algorithms(False)


def test_env_is_read_when_called_not_at_import(monkeypatch):
    monkeypatch.setenv("MEGATRON_TUNING_MODE", "chaos")
    assert TuningPolicy.from_env().mode == "chaos"
    monkeypatch.setenv("MEGATRON_TUNING_MODE", "record")
    assert TuningPolicy.from_env().mode == "record"


def test_overrides_win_over_env(monkeypatch):
    monkeypatch.setenv("MEGATRON_TUNING_MODE", "chaos")
    assert TuningPolicy.from_env(mode="deterministic").mode == "deterministic"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("mode", "fast"),
        ("on_miss", None),
        ("agreement", "all"),
        ("stale_entries", "x"),
        ("scope", "a"),
        ("scope", ("",)),
        ("block_sizes", (("BLOCK", "64"),)),
        ("block_sizes", (("BLOCK", True),)),
        ("agreement_timeout_s", 0),
        ("strict", 1),
    ],
)
def test_constructor_validates_fields(field, value):
    with pytest.raises(PolicyError) as info:
        TuningPolicy(**{field: value})
    assert field in str(info.value)


def test_policy_is_frozen_and_keyword_only():
    policy = TuningPolicy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.mode = "off"  # type: ignore[misc]
    with pytest.raises(TypeError):
        TuningPolicy("deterministic")  # type: ignore[misc]


def test_scope_matches_module_prefixes():
    policy = TuningPolicy(scope=("pkg.kernels",))
    assert policy.in_scope("pkg.kernels") and policy.in_scope("pkg.kernels.matmul")
    assert not policy.in_scope("pkg.kernels_extra") and not policy.in_scope("pkg")
    assert TuningPolicy().in_scope("anything")


def test_describe_is_one_line():
    line = TuningPolicy(scope=("a", "b"), tables=("t.msgpack",)).describe()
    assert "\n" not in line and "scope=a,b" in line and "tables=t.msgpack" in line
