"""The README's main job (``scripts/demo.sh``, that is ``selftest --show``): the 2-rank demo must pass
deterministic and catch chaos. (How selftest judges and reports a failing run: tests/commands.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _launch import gloo_available, run_bounded

pytestmark = pytest.mark.distributed


@pytest.mark.skipif(not gloo_available(), reason="torch.distributed with gloo is not available")
def test_demo_shows_pinned_choices_then_chaos_caught(tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    command = [
        sys.executable,
        "-m",
        "megatron_tuning",
        "selftest",
        "--nproc",
        "2",
        "--show",
        "--keep",
        str(kept),
    ]
    done = run_bounded(command, tmp_path, 400, "the 2-rank demo", merge_stderr=True)
    out = done.stdout
    assert done.returncode == 0, out[-4000:]
    deterministic, chaos = out.split("== chaos")
    # The shipped interpreter table pins the demo shapes: every deterministic choice is a hit.
    assert deterministic.count("table (") == 6 and "interpreter_demo.msgpack" in deterministic
    for kernel in ("matmul_kernel", "splitk_matmul_kernel", "add_one_kernel"):
        assert kernel in deterministic
    assert (
        "deterministic PASS  all ranks agree on 6 (kernel, key) choices (verify_agreement compared 6)" in out
    )
    # Chaos: caught on both ranks, one message naming kernel, key and each rank's config.
    assert "chaos         PASS  DivergenceError on ranks [0, 1] for megatron_tuning.kernels:" in out
    assert (kept / "chaos" / "rank1.json").exists() and (kept / "deterministic" / "torchrun.log").exists()
    assert "Ranks launched different configs for kernel megatron_tuning.kernels:" in chaos
    assert "Rank(s) [0] ran" in chaos and "Rank(s) [1] ran" in chaos and "diff:" in chaos
    assert out.rstrip().endswith(
        f"selftest passed: deterministic runs agree and chaos is detected.\nresults kept in {kept}"
    )
