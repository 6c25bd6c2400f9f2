"""Layer 3: the adapters that make Triton, and torch.compile, launch the chosen config (the only
code that touches Triton's private autotuner internals and torch's handling of user kernels).

Imports ``core``; receives tables and measuring functions from the session instead of importing them.
"""
