"""Reference Triton kernels used by the demo, the tests and the benchmarks.

Nothing is imported here on purpose: importing a kernel module decorates its kernels, and
decoration must happen after the caller has set ``TRITON_INTERPRET`` (read at decoration) and,
on Triton 3.2/3.3 without a GPU, after ``megatron_tuning.interception.install`` (stock
``Autotuner.__init__`` resolves a GPU benchmarker eagerly there). Import the module you need:

- ``megatron_tuning.kernels.matmul``  -- autotuned GEMM over 16+ H100/H200-style configs.
- ``megatron_tuning.kernels.splitk``  -- split-K GEMM: ``reset_to_zero``, ``Config.pre_hook``,
  ``prune_configs_by`` (early prune, perf model + top_k) and ``triton.heuristics`` inside the
  autotuner.
- ``megatron_tuning.kernels.tiny``    -- add-one on a vector, autotuned and bare ``@triton.jit``
  twins, for launch-overhead measurements.
"""

KERNEL_MODULES = (
    "megatron_tuning.kernels.matmul",
    "megatron_tuning.kernels.splitk",
    "megatron_tuning.kernels.tiny",
)
"""Import paths of every reference kernel module, for tools that want all of them."""
