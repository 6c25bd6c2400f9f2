"""Layer 6: what the CLI's commands and the demo do (tune a job, report, validate, selftest, demo).

May import every layer below, including ``session``; the CLI (argument parsing) sits above.
"""
