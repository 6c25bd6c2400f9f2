"""Layer 1, the ground: selection rules, the policy, errors, the decision log; no I/O, no collectives."""

__version__ = "0.1.0"
