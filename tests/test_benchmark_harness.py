"""The benchmark harness's own logic (``benchmarks/harness``): what every script's numbers pass through.

The harness is imported the way a script imports it (``benchmarks/`` first on ``sys.path``), and
taken out of ``sys.modules`` again afterwards so no other test sees a top-level ``harness``.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def harness(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import harness.counters
    import harness.processes
    import harness.report
    import harness.stats

    yield SimpleNamespace(
        counters=harness.counters,
        processes=harness.processes,
        report=harness.report,
        stats=harness.stats,
    )
    for name in [n for n in sys.modules if n == "harness" or n.startswith("harness.")]:
        del sys.modules[name]


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "child.py"
    path.write_text(body)
    return str(path)


def test_child_result_reads_the_last_result_line(harness: SimpleNamespace, tmp_path: Path) -> None:
    script = _script(tmp_path, 'print("RESULT {\\"n\\": 1}")\nprint("noise")\nprint("RESULT {\\"n\\": 2}")\n')
    proc = harness.processes.start_child(script, [], {"PATH": "/usr/bin:/bin"})
    assert harness.processes.child_result(proc, timeout=60) == {"n": 2}


def test_child_without_a_result_names_its_command_exit_and_output(
    harness: SimpleNamespace, tmp_path: Path
) -> None:
    script = _script(tmp_path, 'import sys\nprint("partial")\nsys.stderr.write("boom")\nsys.exit(3)\n')
    with pytest.raises(RuntimeError, match=r"child .*child\.py exited 3 without a result:\npartial\n\nboom"):
        harness.processes.run_child(script, [], {"PATH": "/usr/bin:/bin"}, timeout=60)


def test_child_past_its_timeout_is_killed(harness: SimpleNamespace, tmp_path: Path) -> None:
    proc = harness.processes.start_child(_script(tmp_path, "import time\ntime.sleep(60)\n"), [], {})
    with pytest.raises(subprocess.TimeoutExpired):
        harness.processes.child_result(proc, timeout=0.5)
    assert proc.returncode == -signal.SIGKILL  # killed and reaped, not left running


def test_alternated_runs_forward_then_backward(harness: SimpleNamespace) -> None:
    rounds = [harness.stats.alternated(("a", "b", "c"), index) for index in range(3)]
    assert rounds == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


def test_collect_warnings_keeps_log_warnings_and_warn_calls_only(
    harness: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    logger = logging.getLogger("megatron_tuning.bench_harness_test")
    monkeypatch.setattr(logging.getLogger("megatron_tuning"), "handlers", [])
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    with warnings.catch_warnings():
        messages = harness.counters.collect_warnings()
        logger.info("an info record")
        logger.warning("a log warning")
        warnings.warn("a warn call", UserWarning, stacklevel=1)
    assert messages == ["a log warning", "a warn call"]


def test_git_commit_of_a_checkout_and_of_a_plain_folder(harness: SimpleNamespace, tmp_path: Path) -> None:
    commit = harness.report.git_commit(REPO)
    assert commit and all(c in "0123456789abcdef" for c in commit)
    assert harness.report.git_commit(tmp_path) is None


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_bare_launch_baseline_adds_one(monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    import torch

    from tests.support_kernels import add_one_bare

    x = torch.randn(301).to(getattr(torch, dtype))
    torch.testing.assert_close(add_one_bare(x), x + 1)
