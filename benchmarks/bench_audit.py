"""The numerics audit (issue 28) on the project's split-K GEMM and a plain GEMM, checked by a re-run.

    # on a GPU: audit, then an independent re-run in a second process, then compare the classes
    python3 benchmarks/bench_audit.py --out results/audit.json
    # also megatron-core's Mamba SSD kernels (skipped, saying why, when megatron-core is missing)
    PYTHONPATH=.:/tmp/site python3 benchmarks/bench_audit.py --third-party mamba --out results/audit.json
    # the Mamba SSD suite alone
    PYTHONPATH=.:/tmp/site python3 benchmarks/bench_audit.py --third-party mamba --no-gemm --out m.json
    # CPU check of every code path (Triton interpreter, tiny fp32 shapes; numbers meaningless)
    python3 benchmarks/bench_audit.py --smoke --out /tmp/audit_smoke.json

Each pass is one ``python -m megatron_tuning audit --runs K`` of a generated job (a fresh process,
its own Triton cache dir), pinned with no table (the miss rule). The result holds, per
(kernel, key): the configs, the numerics classes and the self-non-deterministic configs of both
passes, whether the two passes agree, and the audit's seconds per key.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# split-K: the perf model keeps SPLIT_K=2 configs only at the first two shapes, a SPLIT_K=4 one too at
# the last two (two fp32 partials added to zero commute exactly; four need not).
GPU_SHAPES = {
    "splitk": [(512, 512, 8192), (256, 1024, 16384), (64, 64, 16384), (128, 128, 65536)],
    "matmul": [(4096, 4096, 4096)],
}
SMOKE_SHAPES = {"splitk": [(64, 64, 128)], "matmul": [(32, 32, 32)]}

GEMM_JOB = textwrap.dedent("""
    import torch
    from megatron_tuning import kernels as k

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    for name, shapes in {shapes!r}.items():
        for m, n, kk in shapes:
            a = torch.randn(m, kk, device=device, dtype=dtype)
            b = torch.randn(kk, n, device=device, dtype=dtype)
            (k.splitk_matmul if name == "splitk" else k.matmul)(a, b)
    if device == "cuda":
        torch.cuda.synchronize()
""")

MAMBA_JOB = textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, {bench!r})
    import mamba_workload as w

    smoke = {smoke!r}
    ops, ssd, conv = w.import_ops("stub")
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    inp = w.build_inputs(w.SMOKE_SHAPE if smoke else w.GPU_SHAPE, device, dtype, w.SEED)
    step, _ = w.make_step(inp, ssd, conv, with_conv=not smoke)
    step()
""")


def audit_pass(job: Path, scope: str, runs: int, out: Path, smoke: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_TUNING_")}
    env.update(MEGATRON_TUNING_SCOPE=scope, MEGATRON_TUNING_SHIPPED_TABLES="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), env.get("PYTHONPATH"))))
    env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_audit_triton_")  # nothing shared
    if smoke:
        env["TRITON_INTERPRET"] = "1"
    argv = [sys.executable, "-m", "megatron_tuning", "audit", "--runs", str(runs), "--out", str(out)]
    done = subprocess.run([*argv, "--", str(job)], env=env, capture_output=True, text=True, timeout=3600)
    print(done.stdout, end="")
    if done.returncode != 0:
        raise SystemExit(f"audit pass failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def compare(first: dict, second: dict) -> list[dict]:
    """Per (kernel, key): both passes' classes, self-non-deterministic configs and seconds."""
    again = {(e["kernel"], e["key"]): e for e in second["entries"]}
    rows = []
    for e in first["entries"]:
        f = again.get((e["kernel"], e["key"]), {})
        members = [sorted(map(sorted, x.get("classes", {}).values())) for x in (e, f)]  # class id -> configs
        rows.append(
            {
                "kernel": e["kernel"],
                "key": e["key"],
                "configs": sum(map(len, e.get("classes", {}).values())),
                "classes": [e.get("classes"), f.get("classes")],
                "self_nondeterministic": [e.get("self_nondeterministic"), f.get("self_nondeterministic")],
                "pinned": e.get("pinned"),
                "classes_agree": members[0] == members[1],
                "nondeterministic_agree": set(e.get("self_nondeterministic", []))
                == set(f.get("self_nondeterministic", [])),
                "seconds": [e.get("seconds"), f.get("seconds")],
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON results")
    parser.add_argument("--runs", type=int, default=3, help="launches per config (default 3)")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    parser.add_argument("--third-party", choices=("mamba",), help="also audit megatron-core's Mamba SSD")
    parser.add_argument("--no-gemm", action="store_true", help="skip the GEMM suite (with --third-party)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_audit_"))
    jobs = {
        "gemm": (
            GEMM_JOB.format(shapes=SMOKE_SHAPES if args.smoke else GPU_SHAPES),
            "megatron_tuning.kernels",
        )
    }
    if args.no_gemm:
        del jobs["gemm"]
    result: dict = {"runs": args.runs, "smoke": args.smoke, "suites": {}}
    if args.third_party == "mamba":
        try:
            sys.path.insert(0, str(REPO / "benchmarks"))
            import mamba_workload

            mamba_workload.import_ops("stub")
            jobs["mamba"] = (
                MAMBA_JOB.format(bench=str(REPO / "benchmarks"), smoke=args.smoke),
                "megatron.core",
            )
        except ImportError as exc:
            print(f"bench_audit: --third-party mamba skipped: cannot import megatron-core SSD ops ({exc})")
            result["suites"]["mamba"] = {"skipped": str(exc)}
    for name, (text, scope) in jobs.items():
        job = work / f"{name}_job.py"
        job.write_text(text)
        passes = [audit_pass(job, scope, args.runs, work / f"{name}_{i}.json", args.smoke) for i in (1, 2)]
        rows = compare(*passes)
        result["suites"][name] = {"rows": rows, "agree": all(r["classes_agree"] for r in rows)}
        for r in rows:
            print(
                f"{name}: {r['kernel'].rsplit(':', 1)[-1]} [{r['key'][:40]}] {r['configs']} configs, "
                f"{len(r['classes'][0] or [])} classes, {len(r['self_nondeterministic'][0] or [])} nondet, "
                f"re-run agrees: {r['classes_agree']}, {r['seconds'][0]} s"
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
