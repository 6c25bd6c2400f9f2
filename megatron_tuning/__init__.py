"""megatron_tuning: deterministic, reproducible Triton autotuning for distributed jobs.

Start it once per process, after ``torch.distributed.init_process_group`` (if any)::

    import megatron_tuning
    handle = megatron_tuning.init_deterministic_tuning()   # policy from MEGATRON_TUNING_* env
    ...
    handle.close()   # or use ``with`` — restores Triton's autotuner
"""

from __future__ import annotations

import logging
from typing import Any

from .core import __version__
from .core.decisions import Decision, get_decisions
from .core.errors import (
    AgreementTimeoutError,
    BenchmarkForbiddenError,
    BlockSizeOverrideError,
    CompiledLaunchNotPinnedError,
    ConsensusError,
    DivergenceError,
    InputMismatchError,
    MegatronTuningError,
    PolicyError,
    StaleEntryError,
    StoreError,
    TableError,
    TableMissError,
    TuningWarning,
    UnsupportedTritonError,
    install_default_handler,
)
from .core.policy import TuningPolicy
from .runtime.interception import lazy_benchmarker
from .selection import (
    arch_tag,
    autotune_configs,
    chaos_choice,
    cheapest,
    config_data,
    config_signature,
    deterministic_choice,
    estimate_config_cost,
    filter_configs_by_block_sizes,
    kernel_module,
    kernel_name,
    reset_warnings,
    tuning_key,
    warn_if_mamba_env_ignored,
)
from .session import TuningHandle, init_deterministic_tuning
from .tables.records import write_decisions


def verify_agreement(group: Any = None, *, timeout_s: float | None = None) -> int:
    """Compare all ranks' decisions at a step boundary (collective); see ``distributed.agreement``."""
    from .distributed.agreement import verify_agreement as _verify

    return _verify(group, timeout_s=timeout_s)


# Not a NullHandler: records reach stderr until the application configures logging (core.errors).
install_default_handler(logging.getLogger(__name__))

__all__ = [
    "AgreementTimeoutError",
    "BenchmarkForbiddenError",
    "BlockSizeOverrideError",
    "ConsensusError",
    "CompiledLaunchNotPinnedError",
    "Decision",
    "DivergenceError",
    "InputMismatchError",
    "MegatronTuningError",
    "PolicyError",
    "StaleEntryError",
    "StoreError",
    "TableError",
    "TableMissError",
    "TuningHandle",
    "TuningPolicy",
    "TuningWarning",
    "UnsupportedTritonError",
    "__version__",
    "arch_tag",
    "autotune_configs",
    "chaos_choice",
    "cheapest",
    "config_data",
    "config_signature",
    "deterministic_choice",
    "estimate_config_cost",
    "filter_configs_by_block_sizes",
    "get_decisions",
    "init_deterministic_tuning",
    "kernel_module",
    "kernel_name",
    "lazy_benchmarker",
    "reset_warnings",
    "tuning_key",
    "verify_agreement",
    "warn_if_mamba_env_ignored",
    "write_decisions",
]
