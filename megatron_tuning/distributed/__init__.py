"""Layer 4: what crosses ranks. The first-use agreement check, ``verify_agreement``, and the wire
format (fixed-size digests, store barriers) they share.

Imports ``core`` (and torch.distributed); independent of ``tuning``.
"""
