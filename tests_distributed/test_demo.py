"""The README's main job: the 2-rank demo must pass deterministic and catch chaos."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _launch import gloo_available, run_bounded

pytestmark = pytest.mark.distributed


def _run_demo(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "megatron_tuning.commands.demo",
        *args,
    ]
    return run_bounded(command, tmp, 300, "the 2-rank demo")


@pytest.mark.skipif(not gloo_available(), reason="torch.distributed with gloo is not available")
def test_demo_passes_deterministic_and_catches_chaos(tmp_path: Path) -> None:
    done = _run_demo(tmp_path, "--all-ranks")
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-4000:]
    for rank in (0, 1):
        assert f"== deterministic: rank {rank}/2" in out and f"== chaos: rank {rank}/2" in out
    assert out.count("agreement check passed: 6 shared kernel/shape entries agree on all 2 ranks") == 2
    # The shipped interpreter table pins the demo shapes: every deterministic choice is a hit.
    deterministic = out.split("== chaos")[0]
    assert deterministic.count("table (") >= 6
    # Chaos: both ranks report the divergence, with the same message naming kernel, key and ranks.
    assert out.count("the agreement check fired, as it must (DivergenceError)") == 2
    messages = [
        block.split("\n  Pin this kernel")[0] for block in out.split("Ranks launched different configs")[1:]
    ]
    assert len(messages) == 2 and messages[0] == messages[1]
    assert "Rank(s) [0] ran" in messages[0] and "Rank(s) [1] ran" in messages[0]
    assert "for kernel megatron_tuning.kernels." in messages[0] and " with key " in messages[0]
