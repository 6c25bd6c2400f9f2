"""The library's version, in the ground layer so that every layer can stamp what it writes."""

__version__ = "0.1.0"
