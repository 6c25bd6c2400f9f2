#!/usr/bin/env bash
# Run the GPU benchmarks in one call, inside a time budget, writing everything under $OUT.
#
#   OUT=/some/dir bash benchmarks/run_gpu.sh [STAGE ...]
#
# Stages, in the order given (default: tables quality first_launch overhead):
#   tables           tune the reference kernels -> configs/<arch>/*.msgpack (+ copies in $OUT/configs), validate
#   quality          pinned vs best candidate throughput (uses configs/sm90/matmul.msgpack)
#   first_launch     time to first launch, table hit vs stock autotune, warm and cold compile cache
#   overhead         launches/s: pinned vs Triton's hit path vs bare @triton.jit (+ the host-only CPU mode)
#   tuner_judge      does the tuner rank sub-20 us matmuls as an independent do_bench judge does?
#   nearest          held-out shapes: the nearest-shape rule (and the single nearest entry) vs the best
#   reproducibility  >= 10 fresh processes, stock vs pinned (uses configs/sm90/matmul.msgpack)
#   retune           >= 5 fresh processes: the tuner's choice vs Triton's
#   record           record -> merge -> pin end to end (4 recording processes, then a pinned one)
#   auto             auto mode run 1 / run 2 vs stock (2 processes sharing a store), then the nearest stage
#   mamba            megatron-core's Mamba SSD kernels: stock, MAMBA_DETERMINISTIC, ours, auto run 1/2
#                    (needs megatron-core importable: see benchmarks/bench_mamba_ssd.py)
#   compile          torch.compile: eager vs compiled, stock vs pinned, 3 fresh processes per kind
#   smoke            every script's --smoke (CPU interpreter) path: a plumbing check, no numbers
#
# Issue 18's GPU check, one call of ~5 minutes on one H200:
#   OUT=/some/dir PYTHONPATH=. MT_BUDGET_S=530 bash benchmarks/run_gpu.sh overhead tuner_judge nearest
#
# Budget: MT_BUDGET_S seconds for the whole call (default 480); a stage that would start with less
# than its usual time left is skipped and says so. MT_REPRO_PROCESSES (default 10) and
# MT_RETUNE_PROCESSES (default 5) size the multi-process stages. Each stage writes $OUT/<stage>.json
# and $OUT/<stage>.log; $OUT/summary.txt collects the printed tables.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/benchmarks/out}"
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
BUDGET="${MT_BUDGET_S:-480}"
START=$SECONDS
PY="${PYTHON:-python}"
stages=("$@")
((${#stages[@]})) || stages=(tables quality first_launch overhead)

# Typical H200 seconds per stage; a stage is skipped when less than this is left.
declare -A NEED=([tables]=120 [quality]=60 [first_launch]=150 [overhead]=60 [tuner_judge]=150 [nearest]=180 [reproducibility]=280 [retune]=120 [record]=120 [smoke]=120 [auto]=300 [mamba]=200 [compile]=240)

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%SZ')"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null || echo "nvidia-smi: n/a"
  "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'
  git -C "$ROOT" rev-parse HEAD 2>/dev/null || true
} >"$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

run_stage() {
  local stage="$1"; shift
  local left=$((BUDGET - (SECONDS - START)))
  if ((left < ${NEED[$stage]:-60})); then
    echo "== $stage: SKIPPED (${left}s left of ${BUDGET}s, needs ~${NEED[$stage]:-60}s)" | tee -a "$OUT/summary.txt"
    return 0
  fi
  echo "== $stage (budget left ${left}s): $*" | tee -a "$OUT/summary.txt"
  local t0=$SECONDS
  timeout --kill-after=10 "$left" "$@" >"$OUT/$stage.log" 2>&1
  local rc=$?
  # The printed table is the tail of the log: keep it in the summary.
  grep -v '^process \|^repeat \|^+ \|^tune: running' "$OUT/$stage.log" | tail -n 30 >>"$OUT/summary.txt"
  echo "== $stage: exit $rc after $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  tail -n 25 "$OUT/$stage.log"
}

for stage in "${stages[@]}"; do
  case "$stage" in
    tables)
      run_stage tables "$PY" benchmarks/make_sm90_tables.py --results-dir "$OUT/tuning_results" --plot "$OUT/plots"
      mkdir -p "$OUT/configs" && cp -r "$ROOT"/configs/sm* "$OUT/configs/" 2>/dev/null || true ;;
    quality) run_stage quality "$PY" benchmarks/bench_quality.py --out "$OUT/quality.json" ;;
    first_launch) run_stage first_launch "$PY" benchmarks/bench_first_launch.py --out "$OUT/first_launch.json" ;;
    overhead)
      run_stage overhead bash -c "set -e; $PY benchmarks/bench_launch_overhead.py --out $OUT/overhead.json
        $PY benchmarks/bench_launch_overhead.py --cpu --out $OUT/overhead_cpu.json" ;;
    tuner_judge) run_stage tuner_judge "$PY" benchmarks/bench_tuner_judge.py --out "$OUT/tuner_judge.json" ;;
    nearest) run_stage nearest "$PY" benchmarks/bench_nearest.py --out "$OUT/nearest.json" ;;
    reproducibility)
      run_stage reproducibility "$PY" benchmarks/bench_reproducibility.py --processes "${MT_REPRO_PROCESSES:-10}" \
        --out "$OUT/reproducibility.json" ;;
    retune)
      run_stage retune "$PY" benchmarks/bench_retune.py --processes "${MT_RETUNE_PROCESSES:-5}" \
        --plot "$OUT/plots/retune" --out "$OUT/retune.json" ;;
    record) run_stage record "$PY" benchmarks/record_merge_e2e.py --out "$OUT/record.json" ;;
    auto)  # auto mode, then the nearest-shape fallback (one script each since issue 18)
      run_stage auto bash -c "set -e; $PY benchmarks/bench_auto.py --out $OUT/auto.json
        $PY benchmarks/bench_nearest.py --out $OUT/nearest.json" ;;
    mamba)
      run_stage mamba "$PY" benchmarks/bench_mamba_ssd.py --driver --processes "${MT_MAMBA_PROCESSES:-3}" \
        --budget-s "${MT_MAMBA_BUDGET_S:-240}" --work-dir "${TMPDIR:-/tmp}/mt_mamba_bench" \
        --out "$OUT/mamba_runs.jsonl" --summary-out "$OUT/mamba_summary.json" ;;
    compile) run_stage compile "$PY" benchmarks/bench_compile.py --out "$OUT/compile.json" ;;
    smoke)
      run_stage smoke bash -c "set -e; for s in bench_quality bench_launch_overhead bench_tuner_judge bench_nearest bench_first_launch bench_retune bench_reproducibility record_merge_e2e bench_compile; do
        $PY benchmarks/\$s.py --smoke --out $OUT/smoke/\$s.json; done
        $PY benchmarks/make_sm90_tables.py --smoke --out-dir $OUT/smoke/tables" ;;
    *) echo "unknown stage $stage (see the header of $0)" | tee -a "$OUT/summary.txt" ;;
  esac
done
echo "== done in $((SECONDS - START))s; results in $OUT" | tee -a "$OUT/summary.txt"
