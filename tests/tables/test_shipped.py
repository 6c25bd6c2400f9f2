"""The shipped interpreter table (``configs/unknown/``) and how it is produced.

Under ``TRITON_INTERPRET=1`` ``selection.arch_tag()`` is ``unknown``, so the demo (``selftest``) on
a CPU machine searches ``configs/unknown/``. That table pins the reference kernels on its
CPU shapes to their largest tile (the fewest interpreted programs: the quickest on CPU),
so the demo shows table hits that differ from the static fallback. Nothing was measured:
the entries say ``how="hand"`` and carry the kernels' source hashes, so editing a kernel
makes them stale. Regenerate (byte-identical for unchanged kernels) with::

    TRITON_INTERPRET=1 PYTHONPATH=. python -m tests.tables.test_shipped
"""

from __future__ import annotations

import math
import os
import sys
from importlib import import_module
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from megatron_tuning.tables.entry import Entry
from megatron_tuning.tables.table import Table, load_table, save_table

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "configs" / "unknown" / "interpreter_demo.msgpack"
NOTE = "CPU-interpreter demo entry: largest tile (fewest interpreted programs); not measured"
NOTE_PRUNED = "CPU-interpreter demo entry: the config the kernel's own pruning leaves; not measured"


def _tile(config: object) -> int:
    from megatron_tuning.core.fallback import is_block_size_name

    kwargs = config.kwargs  # type: ignore[attr-defined]
    return math.prod(v for k, v in kwargs.items() if is_block_size_name(k) and type(v) is int)


def build_interpreter_table() -> Table:
    """Run the demo workload on CPU and pin each (kernel, key) it launches."""
    import torch

    from megatron_tuning.commands.validate import find_autotuners
    from megatron_tuning.core.decisions import decision_log, get_decisions
    from megatron_tuning.core.identity import config_data, config_signature, kernel_id
    from megatron_tuning.core.policy import TuningPolicy
    from megatron_tuning.runtime import interception

    decision_log().clear()
    interception.install(TuningPolicy(mode="deterministic", scope=("megatron_tuning.kernels",)))
    try:
        from megatron_tuning.commands.selftest import CPU_SHAPES, reference_workload

        with interception.lazy_benchmarker():
            autotuners = {kernel_id(a): a for a in find_autotuners(import_module("megatron_tuning.kernels"))}
        failures = reference_workload(torch.device("cpu"), CPU_SHAPES, torch.float32)
        assert not failures, failures
        decisions = [d for d in get_decisions() if d.source != "out_of_scope"]
    finally:
        interception.uninstall()
        decision_log().clear()
    table = Table(meta={"kind": "hand", "purpose": "CPU interpreter demo"})
    for d in decisions:
        autotuner = autotuners[d.kernel]
        note = NOTE
        if getattr(autotuner, "early_config_prune", None) is not None or d.source == "single":
            config, note = d.config, NOTE_PRUNED  # pruning decides the live set per shape
        else:
            best = max(autotuner.configs, key=lambda c: (_tile(c), config_signature(c)))
            config = config_data(best)
        table.add(
            Entry(
                arch=d.arch,
                kernel=d.kernel,
                key=d.key,
                config=config,
                how="hand",
                source_hash=d.source_hash,
                note=note,
            )
        )
    return table


def test_shipped_interpreter_table_is_current() -> None:
    assert SHIPPED.exists(), f"missing {SHIPPED}; regenerate it: python -m tests.tables.test_shipped"
    fresh = build_interpreter_table()
    assert {e.arch for e in fresh.entries()} == {"unknown"}
    shipped = load_table(SHIPPED)
    fresh.library_version = shipped.library_version  # a version bump alone needs no regeneration
    assert shipped.to_bytes() == fresh.to_bytes(), (
        "configs/unknown/interpreter_demo.msgpack is out of date (a reference kernel or the demo "
        "shapes changed): regenerate it with "
        "`TRITON_INTERPRET=1 PYTHONPATH=. python -m tests.tables.test_shipped`"
    )


if __name__ == "__main__":
    SHIPPED.parent.mkdir(parents=True, exist_ok=True)
    table = build_interpreter_table()
    save_table(table, SHIPPED)
    print(f"wrote {SHIPPED} ({len(table)} entries)", file=sys.stderr)
