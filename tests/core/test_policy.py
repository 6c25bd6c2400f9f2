"""TuningPolicy: validation and the MEGATRON_TUNING_* environment."""

from __future__ import annotations

import dataclasses
from pathlib import Path

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
    # agreement unset: store up to 64 ranks, verify above (distributed.agreement.resolve_mode)
    assert policy.mode == "off" and policy.on_miss == "nearest" and policy.agreement is None
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
        ("AGREEMENT", "gossip", "store|allgather|verify|off"),
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


# ------------------------------------------------------------------ one rule for every knob


def test_words_are_read_in_any_case_in_code_and_env_alike(monkeypatch):
    policy = TuningPolicy(mode=" Deterministic", on_miss="MIN_COST", agreement="Off", stale_entries="Use")
    assert (policy.mode, policy.on_miss, policy.agreement, policy.stale_entries) == (
        "deterministic",
        "min_cost",
        "off",
        "use",
    )
    monkeypatch.setenv("MEGATRON_TUNING_MODE", "Deterministic")
    assert TuningPolicy.from_env().mode == "deterministic"
    with pytest.raises(PolicyError) as info:
        TuningPolicy(mode="fast")
    assert "one of off|deterministic|chaos|record|tune|auto (any case)" in str(info.value)


def test_paths_may_be_path_objects_and_lists_any_sequence(tmp_path):
    policy = TuningPolicy(
        tables=[tmp_path / "a.msgpack", str(tmp_path / "b.msgpack")],
        scope=["pkg.kernels", "other"],
        record_dir=tmp_path,
        decision_log=tmp_path / "d-{rank}.json",
        cache=tmp_path / "auto.msgpack",
    )
    assert policy.tables == (str(tmp_path / "a.msgpack"), str(tmp_path / "b.msgpack"))
    assert policy.scope == ("pkg.kernels", "other")
    assert policy.record_dir == str(tmp_path) and policy.decision_log == str(tmp_path / "d-{rank}.json")
    assert policy.cache == str(tmp_path / "auto.msgpack")
    assert policy == TuningPolicy(
        tables=(str(tmp_path / "a.msgpack"), str(tmp_path / "b.msgpack")),
        scope=("pkg.kernels", "other"),
        record_dir=str(tmp_path),
        decision_log=str(tmp_path / "d-{rank}.json"),
        cache=str(tmp_path / "auto.msgpack"),
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("tables", "a.msgpack", "a single one goes in a list"),
        ("tables", Path("a.msgpack"), "a single one goes in a list"),
        ("tables", [b"a.msgpack"], "non-empty str or os.PathLike"),
        ("tables", [""], "non-empty str or os.PathLike"),
        ("scope", "pkg", "a single one goes in a list"),
        ("use_shipped_tables", "no", "True or False (a bool)"),
        ("strict", "yes", "True or False (a bool)"),
        ("agreement_timeout_s", True, "(not a bool)"),
        ("agreement_timeout_s", float("nan"), "positive number of seconds"),
        ("block_sizes", (("BLOCK", 64), ("BLOCK", 128)), "each name once (BLOCK is given twice)"),
        ("block_sizes", {"BLOCK-M": 64}, "identifier names"),
        ("block_sizes", "BLOCK=64", "{NAME: int} or (NAME, int) pairs"),
        ("record_dir", "", "non-empty str or os.PathLike"),
        ("cache", "", "a file path, 'off' (no cache), or None"),
    ],
)
def test_every_knob_refuses_what_the_rule_refuses_naming_field_and_rule(field, value, message):
    with pytest.raises(PolicyError) as info:
        TuningPolicy(**{field: value})
    assert field in str(info.value) and message in str(info.value)


def test_block_sizes_take_a_mapping_or_pairs_and_are_stored_as_the_env_parser_stores_them(monkeypatch):
    in_code = TuningPolicy(block_sizes={"BLOCK_SIZE_N": 128, "BLOCK_SIZE_M": 64})
    assert in_code.block_sizes == (("BLOCK_SIZE_M", 64), ("BLOCK_SIZE_N", 128))
    assert TuningPolicy(block_sizes=[["BLOCK_SIZE_N", 128], ("BLOCK_SIZE_M", 64)]) == in_code
    monkeypatch.setenv("MEGATRON_TUNING_BLOCK_SIZES", "BLOCK_SIZE_N=128,BLOCK_SIZE_M=64")
    assert TuningPolicy.from_env().block_sizes == in_code.block_sizes


@pytest.mark.parametrize("word", ["OFF", "Off", "off", "0", "false", "No", " off "])
def test_a_cache_word_is_a_setting_never_a_file_name(monkeypatch, word):
    monkeypatch.setenv("MEGATRON_TUNING_CACHE", word)
    assert TuningPolicy.from_env(mode="auto").cache == "off"
    assert TuningPolicy(cache=word).cache == "off"


def test_a_true_cache_word_is_the_default_location_and_a_dotted_path_is_a_file(monkeypatch):
    for word in ("on", "1", "TRUE"):
        monkeypatch.setenv("MEGATRON_TUNING_CACHE", word)
        assert TuningPolicy.from_env(mode="auto").cache is None
    monkeypatch.setenv("MEGATRON_TUNING_CACHE", "./off")
    assert TuningPolicy.from_env(mode="auto").cache == "./off"


@pytest.mark.parametrize("name", ENV)
def test_an_empty_variable_means_unset(monkeypatch, name):
    unset = TuningPolicy.from_env()
    for empty in ("", "  "):
        monkeypatch.setenv(f"MEGATRON_TUNING_{name}", empty)
        assert TuningPolicy.from_env() == unset


def test_an_empty_shipped_tables_variable_keeps_the_shipped_tables_on(monkeypatch):
    monkeypatch.setenv("MEGATRON_TUNING_SHIPPED_TABLES", "")
    assert TuningPolicy.from_env().use_shipped_tables is True
    monkeypatch.setenv("MEGATRON_TUNING_SHIPPED_TABLES", "Off")
    assert TuningPolicy.from_env().use_shipped_tables is False


def test_a_misspelt_variable_gets_one_notice_naming_the_closest(monkeypatch, notices):
    monkeypatch.setenv("MEGATRON_TUNING_TABLES", "/t.msgpack")
    TuningPolicy.from_env()
    TuningPolicy.from_env()
    (message,) = notices.messages
    assert message.startswith("megatron_tuning: MEGATRON_TUNING_TABLES is set but is not a megatron_tuning")
    assert "it is ignored" in message and "Did you mean MEGATRON_TUNING_TABLE?" in message


def test_known_variables_say_nothing(monkeypatch, notices):
    for name in ENV:
        monkeypatch.setenv(f"MEGATRON_TUNING_{name}", "")
    monkeypatch.setenv("MEGATRON_TUNING_TUNE_ROUNDS", "3")
    TuningPolicy.from_env()
    assert notices.messages == []


def test_every_variable_the_package_names_is_a_declared_knob():
    import re

    import megatron_tuning
    from megatron_tuning.core.policy import KNOBS

    root = Path(megatron_tuning.__file__).parent
    written = {
        name
        for path in root.rglob("*.py")
        for name in re.findall(r"MEGATRON_TUNING_[A-Z0-9_]*[A-Z0-9]", path.read_text(encoding="utf-8"))
    }
    assert written - set(KNOBS) == set()


def test_each_knob_is_declared_once_in_the_registry_and_nowhere_else():
    import re

    import megatron_tuning

    root = Path(megatron_tuning.__file__).parent
    declared = re.findall(r'_knob\(\s*"([A-Z0-9_]+)"', (root / "core" / "policy.py").read_text())
    assert len(declared) == len(set(declared))
    for path in root.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        # Only the registry may declare a name as a constant; bootstrap.py repeats two (it must
        # import nothing of the package) and a test below holds them equal to the registry's.
        constants = re.findall(r'^(\w+) = "MEGATRON_TUNING_', text, re.MULTILINE)
        if path.name not in ("bootstrap.py", "policy.py"):
            assert constants == [], (path, constants)


def test_the_bootstrap_repeats_the_registrys_names():
    from megatron_tuning.commands import bootstrap
    from megatron_tuning.core.policy import ENV_LAUNCHER, ENV_MODE

    assert (bootstrap.ENV_MODE, bootstrap.ENV_LAUNCHER) == (ENV_MODE, ENV_LAUNCHER)


def test_docs_policy_md_lists_exactly_the_knobs_and_every_field():
    import re

    from megatron_tuning.core.policy import KNOBS

    text = (Path(__file__).resolve().parents[2] / "docs" / "policy.md").read_text(encoding="utf-8")
    for field in dataclasses.fields(TuningPolicy):
        assert f"`{field.name}`" in text, field.name
    assert set(re.findall(r"`(MEGATRON_TUNING_[A-Z0-9_]*[A-Z0-9])`", text)) == set(KNOBS)


def test_the_removed_digest_mode_names_its_replacement(monkeypatch):
    monkeypatch.setenv("MEGATRON_TUNING_AGREEMENT", "digest")
    for build in (TuningPolicy.from_env, lambda: TuningPolicy(agreement="Digest")):
        with pytest.raises(PolicyError) as raised:
            build()
        assert "'digest' was removed" in str(raised.value) and "'verify'" in str(raised.value)


def test_a_variable_close_to_nothing_lists_the_known_ones(monkeypatch, notices):
    monkeypatch.setenv("MEGATRON_TUNING_XYZZY", "1")
    TuningPolicy.from_env()
    (message,) = notices.messages
    assert (
        "MEGATRON_TUNING_XYZZY is set" in message and "Known variables: MEGATRON_TUNING_AGREEMENT" in message
    )


@pytest.mark.parametrize(
    ("word", "expected"), [("OFF", None), ("0", None), ("1", "default"), (" ", "default")]
)
def test_a_policy_built_in_code_reads_the_cache_variable_by_the_same_rule(
    monkeypatch, tmp_path, word, expected
):
    from megatron_tuning.tables.cache import cache_path, default_cache_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEGATRON_TUNING_CACHE", word)
    path = cache_path(TuningPolicy(mode="auto"), "sm90")  # no cache in code: the variable decides
    assert path == (None if expected is None else str(default_cache_dir() / "sm90" / "auto.msgpack"))
    assert list(tmp_path.iterdir()) == []
