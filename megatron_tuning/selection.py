"""The public names of the selection rules, which live in ``megatron_tuning.core``."""

from __future__ import annotations

from .core.chaos import chaos_choice
from .core.choice import autotune_configs, deterministic_choice
from .core.errors import reset_warnings
from .core.fallback import cheapest, estimate_config_cost, filter_configs_by_block_sizes
from .core.identity import arch_tag, config_data, config_signature, kernel_module, kernel_name
from .core.key import tuning_key
from .core.notices import warn_if_mamba_env_ignored

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
