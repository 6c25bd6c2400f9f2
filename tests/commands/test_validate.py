"""``validate`` and kernel identity: entries of autotuners told apart by their config lists."""

from __future__ import annotations

from pathlib import Path

from megatron_tuning.commands.validate import validate_tables
from megatron_tuning.core.identity import (
    base_kernel_id,
    config_data,
    config_list_digest,
    kernel_id,
    kernel_source_hash,
)
from megatron_tuning.core.key import Key
from megatron_tuning.tables.entry import Entry
from megatron_tuning.tables.table import Table, save_table

from .. import support_kernels as sk

KEY = Key({"n": 8}, dict.fromkeys(("x_ptr", "out_ptr"), "torch.float32"))


def _validate(tmp_path: Path, *entries: Entry) -> list[str]:
    path = tmp_path / "v.msgpack"
    save_table(Table(entries), path)
    report = validate_tables([str(path)], arch="unknown", triton_version="3.6.0", modules=[sk.__name__])
    return [p.problem for p in report.problems]


def _entry(kernel: str, config_index: int, digest: str | None = None) -> Entry:
    return Entry(
        arch="unknown",
        kernel=kernel,
        key=KEY,
        config=config_data(sk.ADD_CONFIGS[config_index]),
        source_hash=kernel_source_hash(sk.twin_small),
        config_list_digest=digest,
    )


def test_entries_under_each_autotuners_own_id_validate_clean(tmp_path):
    problems = _validate(tmp_path, _entry(kernel_id(sk.twin_small), 0), _entry(kernel_id(sk.twin_large), 4))
    assert problems == []


def test_a_config_of_the_other_autotuner_is_named(tmp_path):
    (problem,) = _validate(tmp_path, _entry(kernel_id(sk.twin_small), 4))  # BLOCK 128: only in large
    assert "none of the kernel's 3 declared configs" in problem


def test_a_plain_id_entry_over_two_autotuners_is_named_ambiguous(tmp_path):
    (problem,) = _validate(tmp_path, _entry(base_kernel_id(sk.twin_small), 1))
    assert "2 autotuners with different config lists wrap this function" in problem
    assert kernel_id(sk.twin_small) in problem and kernel_id(sk.twin_large) in problem
    assert "re-tune" in problem


def test_a_plain_id_entry_that_stored_one_autotuners_digest_is_that_ones(tmp_path):
    digest = config_list_digest(sk.twin_small)
    assert _validate(tmp_path, _entry(base_kernel_id(sk.twin_small), 1, digest)) == []
    (problem,) = _validate(tmp_path, _entry(base_kernel_id(sk.twin_small), 4, digest))
    assert "none of the kernel's 3 declared configs" in problem
