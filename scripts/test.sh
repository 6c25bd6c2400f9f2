#!/usr/bin/env bash
# Run the whole test suite against each supported Triton release, in its own virtualenv.
#
#   scripts/test.sh                        # all tests on Triton 3.9.0 and 3.3.1
#   scripts/test.sh -k matmul -x           # extra arguments go to pytest
#   scripts/test.sh tests/test_kernels.py  # explicit paths replace the default test folders
#   MT_TRITON_VERSIONS=3.9.0 scripts/test.sh   # only one Triton release
#   MT_TEST_WORKERS=0 scripts/test.sh          # one pytest process (default: one per CPU core, at most 4)
#
# Venvs live in .venv/triton<MAJOR><MINOR> and are reused when their pins still match. Tests run
# in Triton's interpreter (TRITON_INTERPRET=1), so no GPU is needed. The script fails if any
# pytest run fails, including "no tests collected" (pytest exit code 5).
set -euo pipefail

MT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/_venv.sh
source "$MT_ROOT/scripts/_venv.sh"
cd "$MT_ROOT"

# Supported releases, newest first, space or comma separated. The first runs everything (tests/
# and tests_distributed/). The others run what depends on Triton's release: the tests of the
# modules that import Triton (core/, runtime/ with the contract and Inductor tests, tuning/, the
# kernels, the session, and the commands that reach Triton: validate, tune, the launcher's arming at
# `import triton`). They skip what never touches Triton (tables/, the in-process store and agreement
# tests of distributed/, the launcher's and the `score` command's process handling,
# `enable`, the CLI's argument handling, the layer contracts, the docs), the torchrun jobs of
# tests_distributed/ and the benchmark smoke runs, which drive the same interception again through
# subprocesses; MT_FULL_MATRIX=1 runs everything on every release. Explicit paths or pytest
# arguments apply to every release as given.
IFS=', ' read -r -a versions <<<"${MT_TRITON_VERSIONS:-3.9.0 3.3.1}"
if ((${#versions[@]} == 0)); then
  mt_log "error: MT_TRITON_VERSIONS is empty"
  exit 2
fi
# Without explicit paths pytest runs its configured testpaths (tests/ and tests_distributed/).

# pytest-xdist: one worker per core (at most 4), whole files per worker (--dist loadfile), so a
# module's expensive fixture (a torchrun job shared by its tests) runs once. Files are handed out in
# collection order (--no-loadscope-reorder), where tests/conftest.py puts the files that start jobs
# first: long files first and short ones last lets the workers finish together.
workers="${MT_TEST_WORKERS:-$(python3 -c 'import os; print(min(4, len(os.sched_getaffinity(0))))' 2>/dev/null || echo 2)}"
if ! [[ "$workers" =~ ^[0-9]+$ ]]; then
  mt_log "error: MT_TEST_WORKERS must be a whole number (0 = no worker processes), not '$workers'"
  exit 2
fi
parallel=()
((workers > 0)) && parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)

export TRITON_INTERPRET=1
# Keep the interpreter single-threaded per process: CI machines are small and tests use subprocesses.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# Every release's venv is set up at once: installs spend much of their time unpacking and compiling
# files, and on 2 cores two side by side took 46 s where one after the other took 102 s.
mkdir -p "$MT_ROOT/.venv"
declare -a setups=()
for triton in "${versions[@]}"; do
  mt_ensure_venv "$triton" "$MT_VENV_EXTRAS" >"$MT_ROOT/.venv/python-$(mt_venv_name "$triton").path" &
  setups+=($!)
done

declare -a summaries=()
status=0
linted=0
for index in "${!versions[@]}"; do
  triton="${versions[$index]}"
  if ! wait "${setups[$index]}"; then
    summaries+=("triton $triton: FAILED to set up venv")
    status=1
    continue
  fi
  python="$(cat "$MT_ROOT/.venv/python-$(mt_venv_name "$triton").path")"
  if ((linted == 0)); then
    # Linters, once, in the newest release's venv (settings in pyproject.toml): the layer contracts
    # (import-linter: an upward import fails the run), ruff's lint and format check, and mypy.
    linted=1
    bin="$(dirname "$python")"
    for check in "import contracts:$bin/lint-imports --config $MT_ROOT/pyproject.toml" \
      "ruff check:$bin/ruff check --quiet $MT_ROOT" "ruff format:$bin/ruff format --check --quiet $MT_ROOT" \
      "mypy:$bin/mypy --config-file $MT_ROOT/pyproject.toml"; do
      name="${check%%:*}"
      lint_log="$MT_ROOT/.venv/lint-${name// /-}.log"
      # shellcheck disable=SC2086  # the command line is split on purpose
      if (cd "$MT_ROOT" && ${check#*:}) >"$lint_log" 2>&1; then
        summaries+=("$name: OK    $(grep -E 'kept|Success' "$lint_log" | tail -n 1 || true)")
      else
        cat "$lint_log"
        summaries+=("$name: FAILED (see above or $lint_log)")
        status=1
      fi
    done
  fi
  log="$MT_ROOT/.venv/pytest-$(mt_venv_name "$triton").log"
  scope=("$@")
  if ((${#scope[@]} == 0 && index > 0)) && [[ "${MT_FULL_MATRIX:-0}" != 1 ]]; then
    scope=(tests)  # see "Supported releases" above
    for unaffected in tables distributed commands/test_run.py commands/test_enable.py commands/test_selftest_args.py \
      commands/test_launcher_docs.py test_cli.py test_architecture.py test_docs.py \
      test_benchmark_harness.py test_benchmarks_smoke.py test_benchmark_jobs_smoke.py test_bench_score.py \
      commands/test_score.py; do
      scope+=("--ignore=tests/$unaffected")
    done
  fi
  mt_log "triton $triton: python -m pytest ${parallel[*]} ${scope[*]}"
  start=$SECONDS
  set +e
  # tests/experimental/ is not gated (docs/development.md#experiments).
  "$python" -m pytest "${parallel[@]}" --ignore=tests/experimental "${scope[@]}" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  elapsed=$((SECONDS - start))
  # pytest's own summary line ("== 12 passed, 1 skipped in 3.21s ==", without '=' under -q).
  result="$(grep -E '(passed|failed|errors?|skipped|deselected|no tests ran).* in [0-9.]+s' "$log" \
    | tail -n 1 | sed -E 's/^=+ //; s/ =+$//' || true)"
  case $rc in
    0) summaries+=("triton $triton: OK    ${result:-passed} (${elapsed}s)") ;;
    5) summaries+=("triton $triton: FAILED no tests were collected/selected (pytest exit 5) (${elapsed}s)"); status=1 ;;
    *) summaries+=("triton $triton: FAILED pytest exit $rc: ${result:-see $log} (${elapsed}s)"); status=1 ;;
  esac
done

printf '\n'
for line in "${summaries[@]}"; do printf '%s\n' "$line"; done
exit $status
