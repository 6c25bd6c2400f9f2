#!/usr/bin/env bash
# Run the demo: a 2-rank torchrun job, twice. Under the deterministic policy it prints, per kernel
# and shape, the config launched and where it came from, and the agreement check passes; under
# chaos (ranks pick differently on purpose) the check must fire on every rank.
#
#   scripts/demo.sh            # extra arguments go to `python -m megatron_tuning selftest`
#
# Creates or reuses .venv/triton39. Without a GPU the kernels run in Triton's interpreter and
# the ranks talk over gloo (selftest decides). Exit 0 only if both phases behaved.
set -euo pipefail

MT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/_venv.sh
source "$MT_ROOT/scripts/_venv.sh"
cd "$MT_ROOT"

python="$(mt_ensure_venv "${MT_DEMO_TRITON_VERSION:-3.9.0}" "$MT_VENV_EXTRAS")"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$python" -m megatron_tuning selftest --nproc "${MT_DEMO_NPROC:-2}" --show "$@"
