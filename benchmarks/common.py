"""The shared benchmark harness, as the scripts use it: ``import common``, then ``common.<name>``.

Every benchmark is one script that is both the parent (spawns fresh processes, aggregates,
writes JSON, prints a table) and the child (``--child ...``: does one process's measurement
and prints one ``RESULT {json}`` line). ``--smoke`` runs the same code paths on CPU in the
Triton interpreter with tiny shapes and a host-clock "benchmarker", so a script is exercised
end to end before any GPU minute is spent; smoke numbers mean nothing.

The code lives in ``harness/``, one concern per module (see its ``__init__``); this module is
its one front door, so a script's imports do not follow the harness's inner layout.
"""

from __future__ import annotations

from harness.cli import (
    add_common_arguments,
    require_device,
    run_parent_or_child,
    script_parser,
    use_cpu_interpreter,
)
from harness.counters import (
    LaunchCounters,
    collect_log_warnings,
    collect_warnings,
    count_triton_benchmarks,
)
from harness.matmul import (
    MATMUL_SHAPES,
    SMOKE_MATMUL_SHAPES,
    default_matmul_table,
    install_pinned,
    matmul_operands,
    shape_name,
    tflops,
)
from harness.processes import REPO, RESULT_MARK, child_env, child_result, emit, run_child, start_child
from harness.report import append_jsonl, dash, environment, git_commit, print_table, write_json, write_results
from harness.stats import alternated, median_or_none, quantiles, rotated, spread
from harness.timing import (
    allow_stock_autotune_on_cpu,
    cpu_do_bench,
    launch_config,
    synchronize,
    time_configs_interleaved,
    time_ms,
)

__all__ = [
    "MATMUL_SHAPES",
    "REPO",
    "RESULT_MARK",
    "SMOKE_MATMUL_SHAPES",
    "LaunchCounters",
    "add_common_arguments",
    "allow_stock_autotune_on_cpu",
    "alternated",
    "append_jsonl",
    "child_env",
    "child_result",
    "collect_log_warnings",
    "collect_warnings",
    "count_triton_benchmarks",
    "cpu_do_bench",
    "dash",
    "default_matmul_table",
    "emit",
    "environment",
    "git_commit",
    "install_pinned",
    "launch_config",
    "matmul_operands",
    "median_or_none",
    "print_table",
    "quantiles",
    "require_device",
    "rotated",
    "run_child",
    "run_parent_or_child",
    "script_parser",
    "shape_name",
    "spread",
    "start_child",
    "synchronize",
    "tflops",
    "time_configs_interleaved",
    "time_ms",
    "use_cpu_interpreter",
    "write_json",
    "write_results",
]
