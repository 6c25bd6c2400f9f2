"""The seed API: the selection rules' public names (fixed), listed here alone; they live in
``megatron_tuning.core``, and ``megatron_tuning`` re-exports this ``__all__``."""

from __future__ import annotations

from .core.chaos import chaos_choice
from .core.choice import autotune_configs, deterministic_choice, warn_if_mamba_env_ignored
from .core.fallback import cheapest, estimate_config_cost, filter_configs_by_block_sizes
from .core.identity import arch_tag, config_data, config_signature, kernel_module, kernel_name
from .core.key import tuning_key
from .core.notices import reset_warnings

__all__ = [
    "arch_tag",
    "autotune_configs",
    "chaos_choice",
    "cheapest",
    "config_data",
    "config_signature",
    "deterministic_choice",
    "estimate_config_cost",
    "filter_configs_by_block_sizes",
    "kernel_module",
    "kernel_name",
    "reset_warnings",
    "tuning_key",
    "warn_if_mamba_env_ignored",
]
