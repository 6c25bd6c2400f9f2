"""Layer 3: the adapters that make Triton launch the chosen config (the only code that touches
Triton's private autotuner internals).

Imports ``core``; receives tables and measuring functions from the session instead of importing them.
"""
