"""The in-band clock's kernel, compiled for sm_90 on this CPU machine (Triton's wheel carries
ptxas): the interpreter cannot run inline PTX, so this is CI's only look at the code the GPU runs.
It compiles in a child process, because ``TRITON_INTERPRET=1`` (set for the tests) makes
``@triton.jit`` build interpreted functions, which Triton cannot compile."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, sys.argv[1])
from megatron_tuning.score.inband import clock_stamp
source = ASTSource(fn=clock_stamp, signature={"out_ptr": "*i64", "max_sm": "i32"}, constexprs={})
print(triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"])
"""


def test_clock_stamp_reads_smid_then_clock64_then_globaltimer_and_stores_both_per_sm() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE, str(REPO)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    ptx = done.stdout[done.stdout.index(".entry clock_stamp") :]
    ptx = ptx[: ptx.index("\n}")]  # the kernel's code; debug sections follow
    code = [line.split("//")[0].strip() for line in ptx.splitlines()]
    reads = [m.group(1) for line in code if (m := re.fullmatch(r"mov\.u(?:32|64) %r\w+, %(\w+);", line))]
    assert reads == ["smid", "clock64", "globaltimer"]  # the cycles and the time, read back to back
    stores = [line for line in code if line.startswith(("st.global", "@%p")) and "st.global.b64" in line]
    assert len(stores) == 2  # (clock64, globaltimer) at out_ptr[2 * smid], guarded by smid < max_sm
    assert any(line.startswith("setp.") for line in code)
