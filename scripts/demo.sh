#!/usr/bin/env bash
# Run the demo: a small 2-rank job that launches the reference kernels under the deterministic
# policy and prints, per kernel and shape, the chosen config and where it came from.
#
#   scripts/demo.sh            # extra arguments go to `python -m megatron_tuning.commands.demo`
#
# Creates or reuses .venv/triton39. Without a GPU the kernels run in Triton's interpreter and
# the ranks talk over gloo; the demo module itself decides what to set up and what to show.
set -euo pipefail

MT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/_venv.sh
source "$MT_ROOT/scripts/_venv.sh"
cd "$MT_ROOT"

python="$(mt_ensure_venv "${MT_DEMO_TRITON_VERSION:-3.9.0}" "$MT_VENV_EXTRAS")"
nproc="${MT_DEMO_NPROC:-2}"
if ! "$python" -c 'import torch; raise SystemExit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  # Must be set before any kernel module is imported (Triton reads it at decoration).
  export TRITON_INTERPRET=1
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

exec "$python" -m torch.distributed.run --standalone --nproc_per_node "$nproc" -m megatron_tuning.commands.demo "$@"
