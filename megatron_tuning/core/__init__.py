"""Layer 1, the ground: pure selection rules, the policy and its environment, errors, the decision log.

No file I/O and no collectives. Imports nothing else from megatron_tuning.
"""
