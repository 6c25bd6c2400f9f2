"""The numerics audit (issue 28): classes, self-non-determinism, tables carrying it, the numerics knob."""

from __future__ import annotations

import argparse
import json
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import megatron_tuning
from megatron_tuning.commands import main
from megatron_tuning.commands.audit import add_audit, run_audit
from megatron_tuning.core.decisions import decision_log
from megatron_tuning.core.errors import NumericsError
from megatron_tuning.core.identity import config_data, config_signature
from megatron_tuning.core.key import Key, tuning_key
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.runtime.interception import lazy_benchmarker
from megatron_tuning.tables.entry import Numerics
from megatron_tuning.tables.records import write_decisions
from megatron_tuning.tables.review import diff_tables
from megatron_tuning.tables.table import Entry, Table, load_table, save_table
from megatron_tuning.tables.vote import vote_tables
from megatron_tuning.tuning.audit import audit_candidates, record_numerics

JOB = textwrap.dedent("""
    import torch
    from megatron_tuning import kernels as k

    torch.manual_seed(0)
    a, b = torch.randn(64, 128), torch.randn(128, 64)
    torch.testing.assert_close(k.splitk_matmul(a, b), a @ b, rtol=1e-4, atol=1e-4)
    x = torch.arange(100, dtype=torch.float32)
    assert torch.equal(k.add_one(x), x + 1)
""")

PERTURBED: list[int] = []


def _perturb(nargs):  # noqa: ANN001, ANN202
    PERTURBED.append(1)
    nargs["x_ptr"][0] += len(PERTURBED)  # a different input at every launch: different output bits


def _descriptor_block(nargs):  # noqa: ANN001, ANN202
    nargs["desc"].block_shape = [nargs["BLOCK"]]


with lazy_benchmarker():  # Triton 3.3 without a GPU resolves its benchmarker at decoration
    from megatron_tuning import kernels

    @triton.autotune(
        configs=[triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 64}, pre_hook=_perturb)], key=["n"]
    )
    @triton.jit
    def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

    # In place through a host TensorDescriptor (TMA on a GPU), each config setting its block shape as
    # Triton's persistent-matmul tutorial does: every BLOCK gives other output bits.
    @triton.autotune(
        configs=[triton.Config({"BLOCK": b}, pre_hook=_descriptor_block) for b in (8, 16, 32, 64)], key=["n"]
    )
    @triton.jit
    def _add_block_sum(desc, n, BLOCK: tl.constexpr):
        offset = tl.program_id(0) * BLOCK
        x = desc.load([offset])
        desc.store([offset], x + tl.sum(x))


def _audit_job(tmp_path: Path, *extra: str) -> dict:
    (tmp_path / "job.py").write_text(JOB)
    out = tmp_path / "audit.json"
    parser = argparse.ArgumentParser()
    add_audit(parser)
    args = parser.parse_args(["--out", str(out), *extra, "--", str(tmp_path / "job.py")])
    assert run_audit(args) == 0
    return json.loads(out.read_text())


def test_audit_report_splitk_has_several_classes_and_add_one_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGATRON_TUNING_SCOPE", "megatron_tuning.kernels")
    report = _audit_job(tmp_path, "--runs", "2")
    assert report["runs"] == 2 and report["format"] == "megatron_tuning.audit/2"
    entries = {e["kernel"].rsplit(":", 1)[1]: e for e in report["entries"]}
    assert set(entries) == {"splitk_matmul_kernel", "add_one_kernel"}
    for e in entries.values():
        assert {"kernel", "key", "classes", "self_nondeterministic", "pinned", "pinned_class"} <= e.keys()
        assert e["pinned"] in e["classes"][e["pinned_class"]]  # classes are named by their hex id
    splitk = entries["splitk_matmul_kernel"]
    audited = [s for c in splitk["classes"].values() for s in c]
    assert len({s.split("SPLIT_K=")[1].split(",")[0] for s in audited}) >= 2  # pruning left several
    assert len(splitk["classes"]) >= 2
    assert (
        len(entries["add_one_kernel"]["classes"]) == 1
        and len(next(iter(entries["add_one_kernel"]["classes"].values()))) == 5
    )
    out = capsys.readouterr().out
    assert "splitk_matmul_kernel" in out and "2 (kernel, key) audited" in out


def test_a_config_whose_pre_hook_perturbs_its_input_is_self_nondeterministic():
    x, y = torch.arange(100, dtype=torch.float32), torch.zeros(100)
    grid = {"grid": lambda meta: (triton.cdiv(100, meta["BLOCK"]),), "warmup": False}
    audit = audit_candidates(_copy, _copy.configs, (x, y, 100), grid, 3)
    report = audit.report(_copy.configs)
    assert report["self_nondeterministic"] == ["BLOCK=64, num_warps=4, num_stages=3"]
    assert len(report["classes"]) == 2
    assert torch.equal(x, torch.arange(100, dtype=torch.float32)) and torch.equal(y, torch.zeros(100))


def _splitk_setup() -> tuple[tuple, dict, list]:
    torch.manual_seed(0)
    a, b, c = torch.randn(64, 128), torch.randn(128, 64), torch.zeros(64, 64)
    call = (a, b, c, 64, 64, 128, *a.stride(), *b.stride(), *c.stride())
    named = dict(zip(kernels.splitk_matmul_kernel.arg_names, call))
    kernels.splitk_matmul_kernel.nargs = named  # prune_configs reads it, as in Triton's run
    live = kernels.splitk_matmul_kernel.prune_configs({})
    return call, {"grid": kernels.splitk_grid(64, 64), "warmup": False}, live


def test_same_class_tuning_keeps_the_output_bits_across_a_retune(tmp_path, monkeypatch):
    call, grid, live = _splitk_setup()
    audit = audit_candidates(kernels.splitk_matmul_kernel, live, call, grid, 2)
    first, last = audit.class_id(0), audit.class_id(len(live) - 1)
    assert first != last  # a re-tune picking the last config would change the bits
    key = None

    def last_wins(autotuner, candidates, args, kwargs, kernel, k):  # noqa: ANN001, ANN202
        nonlocal key
        key = k
        return candidates[-1], {}

    def run(numerics: str, tables: tuple[str, ...] = ()) -> torch.Tensor:
        a, b = call[0], call[1]
        policy = TuningPolicy(mode="tune", numerics=numerics, tables=tables, use_shipped_tables=False)
        with megatron_tuning.init_deterministic_tuning(policy, measure=last_wins):
            return kernels.splitk_matmul(a, b)

    free = run("any")
    table = tmp_path / "t.msgpack"
    kernel = "megatron_tuning.kernels:splitk_matmul_kernel"
    save_table(Table([Entry(arch="unknown", kernel=kernel, key=key, config=config_data(live[0]))]), table)
    kept = run("same-class", (str(table),))
    decision = decision_log().decisions()[-1]
    assert decision.signature == config_signature(live[0])  # the only member of its class here
    assert decision.timings["numerics"]["class_id"] == first
    assert not torch.equal(free, kept)
    with pytest.raises(NumericsError, match=f"(?s)splitk_matmul_kernel.*same-class.*class {first}"):
        save_table(
            Table(
                [
                    Entry(
                        arch="unknown",
                        kernel=kernel,
                        key=key,
                        config={"kwargs": {"BLOCK_M": 1}, "num_warps": 4, "num_stages": 3},
                    )
                ]
            ),
            table,
        )
        run("same-class", (str(table),))


N1 = Key({"n": 1})


def _entry(config: dict, class_id: str, deterministic: bool = True, alternatives: tuple = ()) -> Entry:
    config = config if "kwargs" in config else {"kwargs": config, "num_warps": 4, "num_stages": 3}
    numerics = Numerics(class_id, "0" * 16, deterministic, alternatives)
    return Entry(arch="sm90", kernel="m:k", key=N1, config=config, how="tuned", numerics=numerics)


def test_tables_carry_numerics_diff_flags_a_class_change_and_merge_keeps_it(tmp_path, capsys):
    a, b, c = _entry({"B": 1}, "a" * 16), _entry({"B": 2}, "a" * 16), _entry({"B": 3}, "b" * 16, False)
    t = tmp_path / "a.msgpack"
    save_table(Table([c]), t)
    assert load_table(t).get("sm90", "m:k", N1).numerics == c.numerics  # msgpack round trip
    assert diff_tables(Table([a]), Table([b]))["changed"][0]["numerics"] == "same numerics class"
    assert diff_tables(Table([a]), Table([c]))["changed"][0]["numerics"] == "changes numerics"
    save_table(Table([a]), tmp_path / "b.msgpack")
    assert main(["diff", str(tmp_path / "b.msgpack"), str(t)]) == 1
    assert "CHANGES NUMERICS" in capsys.readouterr().out
    assert main(["show", str(t)]) == 0
    assert f"numerics class {'b' * 16}, NOT deterministic on its own" in capsys.readouterr().out
    merged = vote_tables([("x", Table([c])), ("y", Table([c._replace(numerics=None)]))]).table
    assert merged.get("sm90", "m:k", N1).numerics.deterministic is False


def test_pinning_a_nondeterministic_entry_notices_once_and_coverage_counts_it(tmp_path, capsys):
    entry = _entry(config_data(kernels.ADD_ONE_CONFIGS[0]), "c" * 16, False, ("BLOCK=128, num_warps=2",))
    entry = entry._replace(arch="unknown", kernel="megatron_tuning.kernels:add_one_kernel")
    table = Table()
    for n in (100, 200):
        x = torch.zeros(n)
        key = tuning_key(kernels.add_one_kernel, (x, x, n), {})
        table.add(Entry(**{**entry._asdict(), "key": key}))
    save_table(table, tmp_path / "t.msgpack")
    policy = TuningPolicy(mode="deterministic", tables=(str(tmp_path / "t.msgpack"),))
    with warnings.catch_warnings(record=True) as caught, megatron_tuning.init_deterministic_tuning(policy):
        warnings.simplefilter("always")
        for n in (100, 200):
            kernels.add_one(torch.zeros(n))
    notices = [str(w.message) for w in caught if "non-deterministic on its own" in str(w.message)]
    assert len(notices) == 1 and "BLOCK=128, num_warps=2" in notices[0]
    write_decisions(tmp_path / "log.json", decision_log().decisions())
    assert main(["coverage", str(tmp_path / "log.json")]) == 0
    assert "2 pinned config(s) the audit found non-deterministic on their own" in capsys.readouterr().out


def test_audit_table_records_the_pinned_configs_numerics(tmp_path):
    _, _, live = _splitk_setup()
    sigs = [config_signature(c) for c in live]
    found = {"arch": "sm90", "kernel": "m:k", "key": N1, "inputs": "1" * 16, "pinned": sigs[1]}
    found.update(classes={"2" * 16: sigs[:2], "3" * 16: sigs[2:]}, pinned_class="2" * 16)
    found.update(self_nondeterministic=[sigs[1]])
    table = tmp_path / "t.msgpack"
    save_table(Table([Entry(arch="sm90", kernel="m:k", key=N1, config=config_data(live[1]))]), table)
    assert record_numerics(str(table), [found]) == 1
    numerics = load_table(table).get("sm90", "m:k", N1).numerics
    assert numerics == Numerics("2" * 16, "1" * 16, False, (sigs[0], *sigs[2:]))


def test_numerics_refuses_what_it_cannot_audit_instead_of_picking_unrestricted():
    """Inductor's launchers (a key first reached under torch.compile) expose no arguments to hash:
    ``same-class`` must fail loudly there, not see one class and let any config through."""
    from megatron_tuning.runtime.inductor import _Launchers
    from megatron_tuning.tuning.audit import with_numerics

    def unrestricted(autotuner, candidates, args, kwargs, kernel, key):
        raise AssertionError("measured without the numerics restriction")

    audited = with_numerics(unrestricted, "same-class", None, 3)
    launchers = object.__new__(_Launchers)  # what inductor hands the measure
    with pytest.raises(NumericsError, match="torch.compile"):
        audited(launchers, list(kernels.ADD_ONE_CONFIGS), (), {}, "k:add_one", "n=8")


def _descriptor_call() -> tuple[torch.Tensor, tuple, dict]:
    tensor_descriptor = pytest.importorskip(
        "triton.tools.tensor_descriptor", reason="this Triton has no host TensorDescriptor (added after 3.3)"
    )
    x = torch.arange(64, dtype=torch.float32) / 64
    grid = {"grid": lambda meta: (triton.cdiv(64, meta["BLOCK"]),), "warmup": False}
    return x, (tensor_descriptor.TensorDescriptor.from_tensor(x, [8]), 64), grid


def test_the_audit_sees_what_a_launch_writes_through_a_tensor_descriptor():
    """A descriptor argument's ``.base`` is written: it is restored and hashed like a tensor argument,
    so 4 configs with 4 output bit patterns are 4 classes, ``same-class`` keeps only the entry's own
    config, and the inputs come back unchanged."""
    from megatron_tuning.core.choice import TableHit
    from megatron_tuning.tuning.audit import allowed

    x, call, grid = _descriptor_call()
    before, configs = x.clone(), _add_block_sum.configs
    audit = audit_candidates(_add_block_sum, configs, call, grid, 2)
    report = audit.report(configs)
    assert len(report["classes"]) == 4 and report["self_nondeterministic"] == [] and not report["failed"]
    hit = TableHit(config_data(configs[1]), "t.msgpack", Key({"n": 64}))
    assert allowed(audit, configs, "same-class", hit, "m:_add_block_sum", "n=64") == [1]
    assert torch.equal(x, before)


def test_an_in_place_descriptor_kernel_keeps_its_result_under_the_audit_hook(monkeypatch):
    from megatron_tuning.runtime import interception, pinning
    from megatron_tuning.tuning.audit import make_audit_hook

    def launch(audited: bool) -> tuple[torch.Tensor, list[dict]]:
        x, call, grid = _descriptor_call()
        found: list[dict] = []
        monkeypatch.setattr(pinning, "after_decision", [make_audit_hook(found.append, 2)] if audited else [])
        interception.install(TuningPolicy(mode="deterministic", use_shipped_tables=False))
        try:
            _add_block_sum[grid["grid"]](*call)
        finally:
            interception.uninstall()
        return x, found

    direct, _ = launch(audited=False)
    audited, (entry,) = launch(audited=True)
    assert torch.equal(audited, direct)  # the audit's 8 launches left no trace in the job's result
    assert len(entry["classes"]) == 4 and entry["pinned_class"] in entry["classes"]


class _RawPointer:
    """Memory Triton would take as a pointer (it has ``data_ptr``) that is no torch tensor."""

    dtype = torch.float32

    def data_ptr(self) -> int:
        return 0


def test_an_argument_the_audit_cannot_restore_is_refused_by_name_never_one_class():
    from megatron_tuning.core.choice import Choice
    from megatron_tuning.tuning.audit import make_audit_hook, with_numerics

    y = torch.zeros(100)
    call = (
        (_RawPointer(), y, 100),
        {"grid": lambda meta: (triton.cdiv(100, meta["BLOCK"]),), "warmup": False},
    )
    found: list[dict] = []
    make_audit_hook(found.append, 2)(
        _copy, _copy.configs, call, "m:_copy", "n=100", Choice(_copy.configs[0], "cheapest")
    )
    (entry,) = found
    assert "classes" not in entry and "argument x_ptr is a _RawPointer" in entry["not_audited"]

    def unrestricted(*args):  # noqa: ANN002, ANN202
        raise AssertionError("measured without the numerics restriction")

    with pytest.raises(NumericsError, match="(?s)m:_copy.*argument x_ptr is a _RawPointer"):
        with_numerics(unrestricted, "same-class", None, 3)(
            _copy, list(_copy.configs), *call, "m:_copy", "n=100"
        )
    assert torch.equal(y, torch.zeros(100))  # nothing launched


def _nondeterministic_table(tmp_path: Path, deterministic: bool = False) -> Path:
    entry = _entry(
        config_data(kernels.ADD_ONE_CONFIGS[0]), "c" * 16, deterministic, ("BLOCK=128, num_warps=2",)
    )
    key = tuning_key(kernels.add_one_kernel, (torch.zeros(100), torch.zeros(100), 100), {})
    entry = entry._replace(arch="unknown", kernel="megatron_tuning.kernels:add_one_kernel", key=key)
    save_table(Table([entry]), tmp_path / "t.msgpack")
    return tmp_path / "t.msgpack"


def test_deterministic_only_refuses_to_pin_an_entry_the_audit_found_nondeterministic(tmp_path):
    table = _nondeterministic_table(tmp_path)
    policy = TuningPolicy(mode="deterministic", numerics="deterministic-only", tables=(str(table),))
    with megatron_tuning.init_deterministic_tuning(policy), pytest.raises(NumericsError) as caught:
        kernels.add_one(torch.zeros(100))
    message = str(caught.value)
    assert "add_one_kernel" in message and "n=100" in message and str(table) in message
    assert config_signature(kernels.ADD_ONE_CONFIGS[0]) in message and "BLOCK=128, num_warps=2" in message
    assert "deterministic-only" in message and decision_log().decisions() == []  # nothing was pinned


def test_deterministic_only_pins_an_entry_the_audit_found_deterministic(tmp_path):
    table = _nondeterministic_table(tmp_path, deterministic=True)
    policy = TuningPolicy(mode="deterministic", numerics="deterministic-only", tables=(str(table),))
    with warnings.catch_warnings(), megatron_tuning.init_deterministic_tuning(policy):
        warnings.simplefilter("error")
        assert torch.equal(kernels.add_one(torch.zeros(100)), torch.ones(100))
    assert decision_log().decisions()[-1].source == "table"


def test_one_name_for_a_class_the_hex_id_in_the_report_the_audit_table_and_show(tmp_path, capsys):
    from megatron_tuning.tuning.audit import audit_table

    x, y = torch.arange(100, dtype=torch.float32), torch.zeros(100)
    grid = {"grid": lambda meta: (triton.cdiv(100, meta["BLOCK"]),), "warmup": False}
    pinned = _copy.configs[0]
    report = audit_candidates(_copy, _copy.configs, (x, y, 100), grid, 3).report(_copy.configs, pinned)
    name = report["pinned_class"]
    assert len(name) == 16 and report["classes"][name] == [config_signature(pinned)]
    found = {**report, "kernel": "m:k", "key": N1, "arch": "sm90"}
    row = audit_table([found]).splitlines()[1]
    assert f"(class {name})" in row and "class 1" not in row
    save_table(
        Table([Entry(arch="sm90", kernel="m:k", key=N1, config=config_data(pinned))]),
        tmp_path / "t.msgpack",
    )
    assert record_numerics(str(tmp_path / "t.msgpack"), [found]) == 1
    assert main(["show", str(tmp_path / "t.msgpack")]) == 0
    assert f"numerics class {name}, deterministic" in capsys.readouterr().out
