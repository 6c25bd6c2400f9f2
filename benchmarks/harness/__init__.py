"""The shared benchmark harness, one concern per module; scripts use it through ``common``.

* ``cli``: the ``--smoke``/``--out`` arguments, the device check, the parent-or-child ``main``.
* ``processes``: fresh child processes and their one ``RESULT {json}`` line.
* ``report``: the environment header, JSON and JSONL files, printed tables.
* ``stats``: medians, spreads, quantiles and rotated orders of a sample.
* ``timing``: timing a call or one config of an autotuned kernel, GPU or host clock.
* ``counters``: counting Triton's benchmarks and launches, collecting warnings.
* ``matmul``: the reference GEMM shapes, operands and pinned tables.
"""
