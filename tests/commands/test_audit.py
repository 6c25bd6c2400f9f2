"""The ``audit`` command (issue 33): the mode it pins in, tables it records into, a report never lost."""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

import megatron_tuning
from megatron_tuning.commands.audit import add_audit, run_audit
from megatron_tuning.core.identity import (
    config_data,
    config_signature,
    kernel_id,
    kernel_source_hash,
)
from megatron_tuning.core.key import tuning_key
from megatron_tuning.runtime.interception import lazy_benchmarker
from megatron_tuning.tables.table import Entry, Table, load_table, save_table

with lazy_benchmarker():  # Triton 3.3 without a GPU resolves its benchmarker at decoration
    from megatron_tuning import kernels

pytestmark = pytest.mark.slow  # each test runs a job

ADD_ONE_JOB = textwrap.dedent("""
    import os, sys
    import torch
    import megatron_tuning
    from megatron_tuning import kernels as k  # the only kernels in scope: no others are benchmarked

    megatron_tuning.init_deterministic_tuning()  # a job that starts its own session (it wins)
    for n in (100, 300):
        x = torch.arange(n, dtype=torch.float32)
        assert torch.equal(k.add_one(x), x + 1)
    if os.environ.get("BREAK_OUT"):  # --out passed the check before the job; now it cannot be written
        os.mkdir(os.environ["BREAK_OUT"])
        sys.exit(7)
""")


def _audit(tmp_path: Path, job: str, *options: str) -> int:
    (tmp_path / "job.py").write_text(job)
    parser = argparse.ArgumentParser()
    add_audit(parser)
    return run_audit(parser.parse_args([*options, "--", str(tmp_path / "job.py")]))


@pytest.fixture
def scoped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MEGATRON_TUNING_SHIPPED_TABLES", "0")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the audit's work folder, if kept
    return tmp_path


@pytest.fixture
def kernels_in_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRON_TUNING_SCOPE", "megatron_tuning.kernels")


@pytest.mark.usefixtures("kernels_in_scope")
def test_audit_pins_what_an_auto_job_launches_from_its_cache_and_never_tunes(scoped, monkeypatch, capfd):
    cache = scoped / "auto.msgpack"
    monkeypatch.setenv("MEGATRON_TUNING_MODE", "auto")
    monkeypatch.setenv("MEGATRON_TUNING_CACHE", str(cache))
    last = kernels.ADD_ONE_CONFIGS[-1]  # what the tuning picks: not the cheapest (the miss rule's)

    def pick_last(autotuner, candidates, args, kwargs, kernel, key):  # noqa: ANN001, ANN202
        return candidates[-1], {"format": "fake", "median_ms": 1.0}

    with megatron_tuning.init_deterministic_tuning(measure=pick_last):
        kernels.add_one(torch.arange(100, dtype=torch.float32))
    tuned = cache.read_bytes()

    assert _audit(scoped, ADD_ONE_JOB, "--out", str(scoped / "audit.json")) == 0
    report = json.loads((scoped / "audit.json").read_text())
    by_n = {e["key"].split(" ", 1)[0]: e for e in report["entries"]}
    cached, missed = by_n["n=100"], by_n["n=300"]
    assert (cached["pinned"], cached["source"]) == (config_signature(last), "table")
    assert report["mode"] == "auto"
    assert missed["source"] == "nearest"  # the miss rule: the cached n=100 entry
    assert cache.read_bytes() == tuned  # the audit tuned nothing, persisted nothing
    captured = capfd.readouterr()
    # One progress line per key, the command's output (the job configures no logging).
    assert sum(line.startswith("audited megatron_tuning.kernels:") for line in captured.err.splitlines()) == 2
    assert "a miss: nearest" in captured.out
    assert "1 key(s) are in neither the auto cache nor a table" in captured.out
    assert "use MEGATRON_TUNING_MODE=auto" not in captured.err  # it is auto: say why it did not tune
    assert "not under `audit` (which never tunes)" in captured.err


@pytest.mark.usefixtures("kernels_in_scope")
def test_audit_names_an_exported_mode_it_cannot_pin_in_instead_of_overriding_it(scoped, monkeypatch, capfd):
    monkeypatch.setenv("MEGATRON_TUNING_MODE", "chaos")
    assert _audit(scoped, ADD_ONE_JOB, "--out", str(scoped / "audit.json")) == 2
    err = capfd.readouterr().err
    assert "MEGATRON_TUNING_MODE=chaos" in err and "--mode" in err
    assert not (scoped / "audit.json").exists()  # no job ran
    monkeypatch.setenv("MEGATRON_TUNING_MODE", "auto")
    assert _audit(scoped, ADD_ONE_JOB, "--mode", "deterministic", "--out", str(scoped / "audit.json")) == 0
    assert "--mode deterministic overrides MEGATRON_TUNING_MODE=auto" in capfd.readouterr().err
    assert json.loads((scoped / "audit.json").read_text())["mode"] == "deterministic"


KERNEL_FILE = """
import triton
import triton.language as tl

CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((8, 1), (16, 2), (32, 4), (64, 4))]


@triton.autotune(configs=CONFIGS, key=["n"])
@triton.jit
def add_two(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 2.0, mask=mask)
"""

CANDIDATE_JOB = """
import importlib.util, sys, uuid
import torch, triton

name = f"candidate_{uuid.uuid4().hex}"  # an eval pipeline's per-run module name
spec = importlib.util.spec_from_file_location(name, sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
x = torch.arange(40, dtype=torch.float32)
out = torch.empty(40)
module.add_two[lambda meta: (triton.cdiv(40, meta["BLOCK"]),)](x, out, 40)
assert torch.equal(out, x + 2)
"""


def test_audit_table_records_into_the_entry_a_per_run_module_name_pinned_from_by_content(scoped, capfd):
    source = scoped / "kernel_file.py"
    source.write_text(KERNEL_FILE)
    spec = importlib.util.spec_from_file_location("mykernels", source)
    assert spec is not None and spec.loader is not None
    mine = importlib.util.module_from_spec(spec)
    with lazy_benchmarker():
        spec.loader.exec_module(mine)
    x = torch.zeros(40)
    key, kernel = tuning_key(mine.add_two, (x, x, 40), {}), kernel_id(mine.add_two)
    entry = Entry(
        **{"arch": "unknown", "kernel": kernel, "key": key, "config": config_data(mine.CONFIGS[2])},
        **{"how": "tuned", "source_hash": kernel_source_hash(mine.add_two)},
    )
    table = scoped / "tuned.msgpack"
    save_table(Table([entry]), table)
    (scoped / "job.py").write_text(CANDIDATE_JOB)
    parser = argparse.ArgumentParser()
    add_audit(parser)
    out = str(scoped / "audit.json")
    args = parser.parse_args(["--table", str(table), "--out", out, "--", str(scoped / "job.py"), str(source)])
    assert run_audit(args) == 0
    assert f"numerics recorded in 1 entries of {table}" in capfd.readouterr().out
    (found,) = json.loads(Path(out).read_text())["entries"]
    assert found["kernel"].startswith("candidate_") and found["entry_kernel"] == "mykernels:add_two"
    numerics = load_table(table).get("unknown", kernel, key).numerics
    assert numerics is not None and numerics.class_id == found["pinned_class"] and numerics.deterministic


@pytest.mark.usefixtures("kernels_in_scope")
def test_a_report_out_cannot_take_after_the_job_is_written_next_to_the_results_and_named(
    scoped, monkeypatch, capfd
):
    out = scoped / "audit.json"
    monkeypatch.setenv("BREAK_OUT", str(out))
    assert _audit(scoped, ADD_ONE_JOB, "--out", str(out)) == 7  # the job's own status
    err = capfd.readouterr().err
    assert f"cannot write --out {out}" in err and "the job exited with status 7" in err
    kept = err.split("); report in ", 1)[1].split()[0].rstrip(";")
    report = json.loads(Path(kept).read_text())
    assert report["exit_status"] == 7 and len(report["entries"]) == 2  # what it audited before it died
    assert Path(kept).parent.parent == scoped  # the audit's own work folder, kept
