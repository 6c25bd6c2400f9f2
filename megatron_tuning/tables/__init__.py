"""Layer 2: everything persisted. Table entries, the msgpack codec, safe file writes, the table
search path, record-mode recordings, merges, review, and decision-log coverage.

Imports only ``core``.
"""
