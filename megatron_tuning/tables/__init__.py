"""Layer 2: everything persisted: tables, their search path, the auto cache, recordings, merges."""
