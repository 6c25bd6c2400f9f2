"""A job for the ``score`` command's tests: one ``measure`` call on the fake GPU (tests/score/fakes.py),
or (``dobench``) an unedited harness calling ``triton.testing.do_bench``."""

import os
import sys

import torch

mode = sys.argv[1]
if mode == "dobench":
    import triton.testing

    ms = triton.testing.do_bench(lambda: sum(range(20_000)), warmup=10, rep=100)
    print(f"do_bench gave {ms:.6f}")
    sys.exit(0)

from megatron_tuning.score import measure  # noqa: E402
from tests.score.fakes import FakeDevice, seams  # noqa: E402

device = FakeDevice(seed=os.getpid() % 1000)


def twice(x: torch.Tensor) -> torch.Tensor:
    device.kernel(0.5)()
    return x * 2


def thrice(x: torch.Tensor) -> torch.Tensor:
    device.kernel(0.5)()
    return x * 3


def reference(x: torch.Tensor) -> torch.Tensor:
    device.kernel(0.55)()
    return x * 2


tamper = {"tamper": "torch.cuda.Event.elapsed_time is not torch's"} if mode == "demoted" else {}
candidate = thrice if mode == "incorrect" else twice
measure(
    candidate,
    reference=reference,
    make_inputs=lambda: torch.ones(16),
    name="twice",
    **seams(device, **tamper),
)
