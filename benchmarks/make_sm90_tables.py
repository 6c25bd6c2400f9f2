"""Produce the shipped tables: tune every reference kernel on its shape set, one table per module.

    PYTHONPATH=. python benchmarks/make_sm90_tables.py [--rounds 10] [--plot DIR] [--results-dir DIR]
    PYTHONPATH=. python benchmarks/make_sm90_tables.py --smoke --out-dir /tmp/tables   # CPU check

For each of ``matmul``, ``splitk`` and ``tiny`` it runs, as a user would,

    python -m megatron_tuning tune --out configs/<arch>/<module>.msgpack -- \
        benchmarks/reference_workload.py --kernels <module>

(old entries are dropped first, so a table holds exactly one tuning run), then
``python -m megatron_tuning validate`` on the new tables with the kernel modules imported.
The per-candidate statistics (``*.tuning.json``) go to ``--results-dir``, not next to the tables.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODULES = ("matmul", "splitk", "tiny")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="CPU check in the Triton interpreter")
    parser.add_argument("--out-dir", default=None, help="where the tables go (default configs/<arch>)")
    parser.add_argument(
        "--results-dir", default=None, help="per-candidate statistics (default <out-dir>/../results)"
    )
    parser.add_argument("--plot", default=None, help="draw one PNG per (kernel, key) under DIR/<module>")
    parser.add_argument("--rounds", type=int, default=None, help="tuner rounds (default 10; smoke 2)")
    parser.add_argument("--modules", nargs="+", choices=MODULES, default=list(MODULES))
    args = parser.parse_args()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env["MEGATRON_TUNING_SCOPE"] = "megatron_tuning.kernels"
    env.pop("MEGATRON_TUNING_TABLE", None)
    if args.smoke:
        env["TRITON_INTERPRET"] = "1"
        if args.out_dir is None:
            parser.error("--smoke needs --out-dir (smoke entries must never land in configs/)")
    else:
        import torch

        if not torch.cuda.is_available():
            print(
                "make_sm90_tables tunes on a CUDA GPU and none is visible; use --smoke to check it on CPU.",
                file=sys.stderr,
            )
            return 2
        major, minor = torch.cuda.get_device_capability(0)
        if args.out_dir is None:
            args.out_dir = str(REPO / "configs" / f"sm{major}{minor}")
    out_dir = Path(args.out_dir)
    results_dir = Path(args.results_dir) if args.results_dir else out_dir.parent / "tuning_results"
    out_dir.mkdir(parents=True, exist_ok=True)
    rounds = args.rounds or (2 if args.smoke else 10)
    tables = []
    for module in args.modules:
        table = out_dir / f"{module}.msgpack"
        table.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "megatron_tuning",
            "tune",
            "--out",
            str(table),
            "--results",
            str(results_dir / f"{module}.tuning.json"),
            "--rounds",
            str(rounds),
        ]
        if args.plot:
            cmd += ["--plot", str(Path(args.plot) / module)]
        cmd += ["--", str(HERE / "reference_workload.py"), "--kernels", module] + (
            ["--smoke"] if args.smoke else []
        )
        print("+", " ".join(cmd), flush=True)
        if subprocess.run(cmd, env=env, check=False).returncode:
            print(f"tuning {module} failed", file=sys.stderr)
            return 1
        tables.append(str(table))
    validate = [sys.executable, "-m", "megatron_tuning", "validate", *tables]
    for module in args.modules:
        validate += ["--import", f"megatron_tuning.kernels.{module}"]
    print("+", " ".join(validate), flush=True)
    return subprocess.run(validate, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
