"""Layer 3: the adapters that make Triton, and torch.compile, launch the chosen config; tables and
measuring functions are handed in by the session."""
