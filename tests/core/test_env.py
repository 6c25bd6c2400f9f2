"""Odd environment values: refused at once, naming the variable, never read as something else.

``int()``/``float()`` accept more than a setting should (``"١"`` is 1, ``"nan"``, ``"inf"``,
``"1e400"`` is inf, ``"1_0"`` is 10); a value that cannot name a module pins nothing; a repeated
name silently keeps its last value. Each used to pass and fail later, or never.
"""

from __future__ import annotations

import pytest

from megatron_tuning.core.errors import PolicyError
from megatron_tuning.core.identity import current_rank
from megatron_tuning.core.policy import (
    ENV_CACHE_MAX_ENTRIES,
    ENV_TUNE_TIE_BAND,
    MAX_AGREEMENT_TIMEOUT_S,
    TuningPolicy,
)

TIMEOUT = "MEGATRON_TUNING_AGREEMENT_TIMEOUT"
BLOCKS = "MEGATRON_TUNING_BLOCK_SIZES"
SCOPE = "MEGATRON_TUNING_SCOPE"


@pytest.mark.parametrize(
    "value", ["nan", "NaN", "inf", "-inf", "1e400", "1_0", "١٢", "0x10", "12s", "0", "-5"]
)
def test_agreement_timeout_must_be_a_finite_positive_decimal(monkeypatch, value):
    monkeypatch.setenv(TIMEOUT, value)
    with pytest.raises(PolicyError, match=TIMEOUT) as info:
        TuningPolicy.from_env()
    assert info.value.name == TIMEOUT and info.value.value == value


def test_agreement_timeout_has_an_upper_bound_and_accepts_plain_decimals(monkeypatch):
    for good, expected in (("12.5", 12.5), ("1e2", 100.0), (" 30 ", 30.0), (".5", 0.5)):
        monkeypatch.setenv(TIMEOUT, good)
        assert TuningPolicy.from_env().agreement_timeout_s == expected
    monkeypatch.setenv(TIMEOUT, str(MAX_AGREEMENT_TIMEOUT_S * 2))
    with pytest.raises(PolicyError, match=TIMEOUT):
        TuningPolicy.from_env()
    for bad in (float("nan"), float("inf"), 1e300, 0, -1):
        with pytest.raises(PolicyError, match="agreement_timeout_s"):
            TuningPolicy(agreement_timeout_s=bad)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("A=١", "NAME=INT"),  # Arabic-Indic digit one: int() reads it as 1
        ("A=1_000", "NAME=INT"),
        ("A=1.0", "NAME=INT"),
        ("A=1,A=2", "A is given twice"),
        ("A=1, B=2, A=1", "A is given twice"),
        ("my-name=4", "NAME=INT"),
    ],
)
def test_block_sizes_take_ascii_integers_and_each_name_once(monkeypatch, value, problem):
    monkeypatch.setenv(BLOCKS, value)
    with pytest.raises(PolicyError, match=BLOCKS) as info:
        TuningPolicy.from_env()
    assert problem in str(info.value)


def test_block_sizes_still_parse_plain_values(monkeypatch):
    monkeypatch.setenv(BLOCKS, "BLOCK_N=128, BLOCK_M=-64,GROUP=+8")
    assert TuningPolicy.from_env().block_sizes == (("BLOCK_M", -64), ("BLOCK_N", 128), ("GROUP", 8))


@pytest.mark.parametrize(
    "value", ["my-pkg.kernels", "a b", "\U0001f680", "pkg..kernels", ".pkg", "pkg.", "1pkg"]
)
def test_scope_must_name_modules(monkeypatch, value):
    monkeypatch.setenv(SCOPE, f"good.pkg,{value}")
    with pytest.raises(PolicyError, match=SCOPE) as info:
        TuningPolicy.from_env()
    assert repr(value) in str(info.value) and "pin nothing" in str(info.value)
    with pytest.raises(PolicyError, match="scope"):
        TuningPolicy(scope=("good", value))


def test_scope_accepts_module_prefixes(monkeypatch):
    monkeypatch.setenv(SCOPE, "my_pkg.kernels, other,_private.x")
    assert TuningPolicy.from_env().scope == ("my_pkg.kernels", "other", "_private.x")


@pytest.mark.parametrize("value", ["١", "1_0", "-1", "1.0", "x"])
def test_rank_variable_is_an_ascii_integer(monkeypatch, value):
    monkeypatch.setenv("RANK", value)
    with pytest.raises(PolicyError, match="RANK"):
        current_rank()


def test_nul_in_policy_paths_is_refused_at_construction():
    for field in ("decision_log", "record_dir"):
        with pytest.raises(PolicyError, match=field):
            TuningPolicy(**{field: "out\0.json"})
    with pytest.raises(PolicyError, match="tables"):
        TuningPolicy(tables=("a\0.msgpack",))


def test_numeric_knobs_bound_and_name_in_the_environment_and_in_code_alike(monkeypatch):
    monkeypatch.setenv(ENV_CACHE_MAX_ENTRIES, "70")
    assert TuningPolicy.from_env().cache_max_entries == 70
    for bad in ("0", "1000001", "1e3", "1_000", "١"):
        monkeypatch.setenv(ENV_CACHE_MAX_ENTRIES, bad)
        with pytest.raises(PolicyError, match="from 1 to 1e\\+06") as raised:
            TuningPolicy.from_env()
        assert raised.value.name == ENV_CACHE_MAX_ENTRIES
    monkeypatch.delenv(ENV_CACHE_MAX_ENTRIES)
    for bad in ("1", "1e309", "nan", "-0.1"):
        monkeypatch.setenv(ENV_TUNE_TIE_BAND, bad)
        with pytest.raises(PolicyError, match=ENV_TUNE_TIE_BAND):
            TuningPolicy.from_env()
    monkeypatch.setenv(ENV_TUNE_TIE_BAND, " .05 ")
    assert TuningPolicy.from_env().tune_tie_band == 0.05
    for field, bad in (
        ("cache_max_entries", 0),
        ("tune_rounds", 1.0),
        ("audit_runs", True),
        ("tune_tie_band", 1),
    ):
        with pytest.raises(PolicyError, match=field):
            TuningPolicy(**{field: bad})
    with pytest.raises(PolicyError, match="a number, not text"):
        TuningPolicy(tune_rounds="7")
