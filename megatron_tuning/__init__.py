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

from . import selection
from .core import __version__
from .core.decisions import Decision, get_decisions
from .core.errors import (
    AgreementTimeoutError,
    AmbiguousConfigError,
    BenchmarkForbiddenError,
    BlockSizeOverrideError,
    CompiledLaunchNotPinnedError,
    ConsensusError,
    DivergenceError,
    InputMismatchError,
    LaunchOptionError,
    MegatronTuningError,
    PolicyError,
    StaleEntryError,
    StoreError,
    TableError,
    TableMissError,
    UnstorableConfigError,
    UnsupportedTritonError,
)
from .core.notices import TuningWarning
from .core.policy import TuningPolicy
from .runtime.interception import lazy_benchmarker
from .selection import *  # noqa: F403  (the seed API: selection.__all__)
from .session import TuningHandle, init_deterministic_tuning
from .tables.records import write_decisions


def verify_agreement(group: Any = None, *, timeout_s: float | None = None) -> int:
    """Compare all ranks' decisions at a step boundary (collective); see ``distributed.agreement``."""
    from .distributed.agreement import verify_agreement as _verify

    return _verify(group, timeout_s=timeout_s)


# A library's logging: the application decides where records go (notices use warnings instead).
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [  # and the seed API, listed once in selection.py
    "AgreementTimeoutError",
    "AmbiguousConfigError",
    "BenchmarkForbiddenError",
    "BlockSizeOverrideError",
    "ConsensusError",
    "CompiledLaunchNotPinnedError",
    "Decision",
    "DivergenceError",
    "InputMismatchError",
    "LaunchOptionError",
    "MegatronTuningError",
    "PolicyError",
    "StaleEntryError",
    "StoreError",
    "TableError",
    "TableMissError",
    "TuningHandle",
    "TuningPolicy",
    "TuningWarning",
    "UnstorableConfigError",
    "UnsupportedTritonError",
    "__version__",
    "get_decisions",
    "init_deterministic_tuning",
    "lazy_benchmarker",
    "verify_agreement",
    "write_decisions",
    *selection.__all__,
]
