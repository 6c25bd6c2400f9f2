"""Does ``init_deterministic_tuning`` open a CUDA context before the rank picks its device? (GPU check)

    PYTHONPATH=. python benchmarks/check_init_device.py --out init_device.json

A rank may call ``init_deterministic_tuning`` before ``torch.cuda.set_device(local_rank)``; the
library must not create a context on GPU 0 then (issue 17: the arch is read by device index for
``auto``'s cache folder, and on the launching device for decisions). Each probe runs in a fresh
process and asks the driver (``cuDevicePrimaryCtxGetState``) whether device 0's primary context is
active after one step: nothing, each of the two arch reads, init in ``deterministic`` and in
``auto`` mode, and a first pinned launch (which must open it: the control that shows the probe
can see a context).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile

PROBES = {
    "nothing": "",
    "current_device": "torch.cuda.current_device()",
    "device_capability": "torch.cuda.get_device_capability(0)",
    "init_deterministic": "megatron_tuning.init_deterministic_tuning("
    "megatron_tuning.TuningPolicy(mode='deterministic', agreement='off'))",
    "init_auto": "megatron_tuning.init_deterministic_tuning("
    "megatron_tuning.TuningPolicy(mode='auto', agreement='off'))",
    "init_then_launch": "megatron_tuning.init_deterministic_tuning("
    "megatron_tuning.TuningPolicy(mode='deterministic', agreement='off'))\n"
    "from megatron_tuning import kernels as tiny\n"
    "tiny.add_one(torch.zeros(1024, device='cuda'))",
}


def primary_context_active(device: int = 0) -> bool:
    """Whether the driver reports ``device``'s primary context as active (no context is made)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    if cuda.cuInit(0) != 0:
        raise RuntimeError("cuInit failed")
    handle, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    if cuda.cuDeviceGet(ctypes.byref(handle), device) != 0:
        raise RuntimeError("cuDeviceGet failed")
    if cuda.cuDevicePrimaryCtxGetState(handle, ctypes.byref(flags), ctypes.byref(active)) != 0:
        raise RuntimeError("cuDevicePrimaryCtxGetState failed")
    return bool(active.value)


def probe(step: str) -> bool:
    code = (
        "import sys, torch, megatron_tuning\n"
        f"{step}\n"
        "sys.path.insert(0, 'benchmarks')\n"
        "from check_init_device import primary_context_active\n"
        "print(int(primary_context_active()))\n"
    )
    env = dict(os.environ, MEGATRON_TUNING_CACHE=os.path.join(tempfile.mkdtemp(), "auto.msgpack"))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"probe {step!r} failed: {done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1] == "1"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = {name: probe(step) for name, step in PROBES.items()}
    for name, active in rows.items():
        print(f"{name:24s} device 0 primary context active: {active}")
    met = not rows["init_deterministic"] and not rows["init_auto"] and rows["init_then_launch"]
    print(f"goal: init opens no context, a launch does: {'met' if met else 'MISSED'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "init_device", "probes": rows, "met": met}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
