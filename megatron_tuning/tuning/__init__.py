"""Layer 4: measuring: the noise-aware tuner, its statistics, the numerics audit."""
