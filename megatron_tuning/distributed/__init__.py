"""Layer 4: what crosses ranks: the job's store, the agreement checks, ``verify_agreement``."""
