"""TuningPolicy: validation and the MEGATRON_TUNING_* environment."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import megatron_tuning
from megatron_tuning.core.errors import PolicyError
from megatron_tuning.core.policy import KNOBS, PREFIX, TuningPolicy

ENV = [name.removeprefix(PREFIX) for name in KNOBS]


def test_one_default_per_knob_in_code_and_from_env():
    """Before, mode had four: the knob's off, the dataclass's deterministic, from_env's off (or
    deterministic under torch's deterministic algorithms) and init_deterministic_tuning's."""
    in_code, from_env = TuningPolicy(), TuningPolicy.from_env()
    assert in_code == from_env and in_code.mode == "deterministic"
    for knob in KNOBS.values():
        assert getattr(in_code, knob.field) == knob.default, knob.name
    # agreement unset: store up to 64 ranks, verify above (distributed.agreement.resolve_mode)
    assert from_env.agreement is None and from_env.cache is None  # cache: the per-user default
    torch.use_deterministic_algorithms(True)
    try:
        assert TuningPolicy.from_env().mode == "deterministic"  # torch's switch is no second default
    finally:
        torch.use_deterministic_algorithms(False)


def test_what_runs_unasked_acts_only_where_the_mode_is_set(monkeypatch, notices):
    monkeypatch.setenv("MEGATRON_TUNING_TABLES", "t.msgpack")  # a typo is named either way
    assert TuningPolicy.from_env_if_asked().mode == "off"
    monkeypatch.setenv("MEGATRON_TUNING_MODE", "chaos")
    monkeypatch.setenv("MEGATRON_TUNING_SCOPE", "pkg")
    assert TuningPolicy.from_env_if_asked() == TuningPolicy(mode="chaos", scope=["pkg"])
    assert notices.matching("Did you mean MEGATRON_TUNING_TABLE?")


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
        "PRINT_DECISIONS": "yes",
        "CACHE_MAX_ENTRIES": "70",
        "TUNE_ROUNDS": "3",
        "TUNE_TIE_BAND": "0.05",
        "AUDIT_RUNS": "4",
        "NUMERICS": "Same-Class",
    }
    assert set(values) == set(ENV)
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
        print_decisions=True,
        cache_max_entries=70,
        tune_rounds=3,
        tune_tie_band=0.05,
        audit_runs=4,
        numerics="same-class",
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
    assert TuningPolicy.from_env().mode == "deterministic"


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
        for name in re.findall(
            r"(?<![\w])MEGATRON_TUNING_[A-Z0-9_]*[A-Z0-9]", path.read_text(encoding="utf-8")
        )
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


def test_the_bootstrap_repeats_the_registrys_names_and_keeps_its_plumbing_apart():
    from megatron_tuning.commands import bootstrap
    from megatron_tuning.core.policy import ENV_MODE

    assert (bootstrap.PREFIX, bootstrap.ENV_MODE) == (PREFIX, ENV_MODE)
    plumbing = {bootstrap.ENV_LAUNCHER, bootstrap.ENV_JOB_DIR, bootstrap.ENV_SCORE, bootstrap.ENV_QUIET}
    assert not any(name.startswith(PREFIX) for name in plumbing)  # no knobs: no unknown-variable notice


def test_docs_policy_md_lists_exactly_the_knobs_and_every_field():
    import re

    from megatron_tuning.core.policy import KNOBS

    text = (Path(__file__).resolve().parents[2] / "docs" / "policy.md").read_text(encoding="utf-8")
    for field in dataclasses.fields(TuningPolicy):
        assert f"`{field.name}`" in text, field.name
    # Every knob is documented, and every variable documented is a knob (the plumbing is not).
    assert set(re.findall(r"(?<![\w])MEGATRON_TUNING_[A-Z0-9_]*[A-Z0-9]", text)) == set(KNOBS)


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


def test_a_policy_built_in_code_reads_no_variable(monkeypatch, tmp_path):
    """The policy is the whole input: before, the table search path and the auto cache read
    MEGATRON_TUNING_TABLE and _CACHE beside a policy built in code."""
    from megatron_tuning.distributed.agreement import describe_inputs
    from megatron_tuning.tables.cache import cache_path, default_cache_dir, open_cache
    from megatron_tuning.tables.search import TableSet

    monkeypatch.setenv("MEGATRON_TUNING_TABLE", str(tmp_path / "missing.msgpack"))  # would fail to load
    monkeypatch.setenv("MEGATRON_TUNING_CACHE", "off")
    monkeypatch.setenv("MEGATRON_TUNING_CACHE_MAX_ENTRIES", "5")
    policy = TuningPolicy(mode="auto", use_shipped_tables=False)
    assert TableSet.from_policy(policy).files == []
    assert describe_inputs(policy)["tables"] == "(none)"
    assert cache_path(policy, "sm90") == str(default_cache_dir() / "sm90" / "auto.msgpack")
    cache = open_cache(policy.replace(cache=str(tmp_path / "auto.msgpack")), "sm90")
    assert cache is not None and cache.max_entries == TuningPolicy().cache_max_entries
    assert TuningPolicy.from_env().cache == "off" and TuningPolicy.from_env().cache_max_entries == 5


def environ_reads(source: str) -> list[str]:
    """Each read of the environment in ``source`` that is not of one named variable outside our
    prefix (``os.environ.get("RANK")`` passes): a knob's, a computed name's, or the whole of it."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            reads += [f"from os import {a.name}" for a in node.names if a.name in ("environ", "getenv")]
        if not (
            isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
        ):
            continue
        use: ast.AST = parents[node]
        if node.attr == "environ" and isinstance(use, ast.Attribute) and use.attr == "get":
            use = parents[use]
            name = use.args[0] if isinstance(use, ast.Call) and use.args else None
        elif node.attr == "environ" and isinstance(use, ast.Subscript):
            name = use.slice
        elif node.attr == "getenv" and isinstance(use, ast.Call):
            name = use.args[0] if use.args else None
        elif node.attr == "environ":
            name, use = None, node  # the whole environment: iterated, copied or passed on
        else:
            continue
        named = isinstance(name, ast.Constant) and isinstance(name.value, str)
        if not named or "MEGATRON_TUNING_" in name.value:  # type: ignore[union-attr]
            reads.append(ast.unparse(use))
    return reads


def test_only_the_policy_and_the_launchers_read_the_knobs():
    """``TuningPolicy.from_env`` reads every ``MEGATRON_TUNING_*`` variable; commands/ sets them for
    its jobs (and reads its own plumbing). Before, tables/search.py, distributed/agreement.py,
    tables/cache.py, core/decisions.py, tuning/ and session.py read knobs beside the policy."""
    root = Path(megatron_tuning.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        if where != "core/policy.py" and not where.startswith("commands/"):
            found[where] = environ_reads(path.read_text(encoding="utf-8"))
    assert {where: reads for where, reads in found.items() if reads} == {}
    assert "session.py" in found and "tables/search.py" in found  # the scan saw the package


def test_the_environment_scan_fires_on_each_kind_of_read():
    planted = """
import os
from os import environ
a = os.environ.get("MEGATRON_TUNING_TABLE")
b = os.environ["MEGATRON_TUNING_CACHE"]
c = os.getenv(NAME)
d = dict(os.environ)
"""
    assert sorted(environ_reads(planted)) == [
        "from os import environ",
        "os.environ",  # dict(os.environ): the whole of it
        "os.environ.get('MEGATRON_TUNING_TABLE')",
        "os.environ['MEGATRON_TUNING_CACHE']",
        "os.getenv(NAME)",
    ]
    assert environ_reads("import os\nrank = os.environ.get('RANK', '0')\n") == []
