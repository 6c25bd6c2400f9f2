"""Layer 1, the ground: pure selection rules, the policy and its knobs, errors, the decision log.

No file I/O and no collectives. Imports nothing else from megatron_tuning.
"""

__version__ = "0.1.0"
