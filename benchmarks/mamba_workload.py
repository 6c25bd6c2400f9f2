"""The Mamba SSD workload of ``bench_mamba_ssd.py``: megatron-core's ops, their inputs, one step.

The prefill path of megatron-core's ``MambaMixer`` in dynamic inference (megatron-core 0.19.2,
unedited): ``causal_conv1d_varlen_fn`` then ``mamba_chunk_scan_combined_varlen`` on one packed
batch. ``import_ops`` imports ``megatron.core.ssm.ops`` (``stub``: without running
``megatron/core/__init__.py``, which imports most of megatron-core; the same files and module
names). ``build_inputs`` builds the chunk metadata the way the mixer does; ``digest`` hashes the
outputs; ``reference_error`` checks them against a sequential fp32 recurrence written here from
the SSM definition.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from typing import Any

OPS_PACKAGE = "megatron.core.ssm.ops"
SEED = 1234
GPU_SHAPE = {
    "lens": [5000, 3000, 6000, 2384],
    "nheads": 64,
    "headdim": 64,
    "dstate": 128,
    "ngroups": 1,
    "chunk": 256,
}
SMOKE_SHAPE = {"lens": [40, 24], "nheads": 4, "headdim": 16, "dstate": 16, "ngroups": 2, "chunk": 16}
SHAPE_FIELDS = ("nheads", "headdim", "dstate", "ngroups", "chunk")


def fn_id(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', getattr(fn, '__name__', '?'))}"


def import_ops(style: str) -> Any:
    """Import ``megatron.core.ssm.ops``, skipping (``stub``) or running (``plain``) megatron-core's init."""
    if style == "stub" and "megatron.core" not in sys.modules:
        import megatron  # noqa: F401  (its __init__ is a comment)

        for name in ("megatron.core", "megatron.core.ssm"):
            spec = importlib.util.find_spec(name)
            if spec is None or not spec.submodule_search_locations:
                raise ImportError(f"{name} not found: install megatron-core (see the module docstring)")
            module = importlib.util.module_from_spec(spec)  # __path__ set, __init__ NOT executed
            sys.modules[name] = module
            parent, _, child = name.rpartition(".")
            setattr(sys.modules[parent], child, module)
    ops = importlib.import_module(OPS_PACKAGE)
    from megatron.core.ssm.ops.causal_conv1d_varlen import causal_conv1d_varlen_fn
    from megatron.core.ssm.ops.ssd_combined import mamba_chunk_scan_combined_varlen

    return ops, mamba_chunk_scan_combined_varlen, causal_conv1d_varlen_fn


def ops_autotuners() -> dict[str, Any]:
    """``module:qualname`` -> Autotuner for every autotuned kernel in the ops package."""
    from triton.runtime.autotuner import Autotuner

    found: dict[str, Any] = {}
    for name, module in sorted(sys.modules.items()):
        if module is None or not (name == OPS_PACKAGE or name.startswith(OPS_PACKAGE + ".")):
            continue
        for value in vars(module).values():
            if isinstance(value, Autotuner):
                fn = value.fn
                while not inspect.isfunction(fn) and hasattr(fn, "fn"):  # JITFunction (or heuristics)
                    fn = fn.fn
                found[fn_id(fn)] = value
    return dict(sorted(found.items()))


def config_sig(config: Any) -> str:
    """``BLOCK_SIZE_M=64, ..., num_warps=4, num_stages=3`` for a triton.Config."""
    parts = [f"{k}={v}" for k, v in sorted(config.kwargs.items())]
    parts += [f"num_warps={config.num_warps}", f"num_stages={config.num_stages}"]
    return ", ".join(parts)


def _config_names(autotuner: Any) -> list[str]:
    names = sorted({k for c in autotuner.configs for k in c.kwargs})
    return names + ["num_warps", "num_stages"]


def launched_sig(autotuner: Any, kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{n}={kwargs.get(n, '?')}" for n in _config_names(autotuner))


def launch_key_text(autotuner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    bound = {**dict(zip(autotuner.arg_names, args)), **kwargs}
    return ", ".join(f"{k}={bound.get(k, '?')}" for k in autotuner.keys)


def build_inputs(shape: dict[str, Any], device: str, dtype: Any, seed: int) -> dict[str, Any]:
    """Packed varlen prefill inputs, chunk metadata built the way ``MambaMixer`` builds it."""
    import torch

    lens, nheads, headdim = shape["lens"], shape["nheads"], shape["headdim"]
    dstate, ngroups, chunk = shape["dstate"], shape["ngroups"], shape["chunk"]
    total = sum(lens)
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> Any:
        return (torch.randn(*size, generator=gen) * scale).to(device=device, dtype=dtype)

    # Chunks start at each sequence's start; the last chunk of a sequence may be short.
    bounds, last, seq_idx, cu = [0], [], [], [0]
    start = 0
    for i, n in enumerate(lens):
        end = start + n
        pos = start + chunk
        while pos < end:
            bounds.append(pos)
            seq_idx.append(i)
            pos += chunk
        bounds.append(end)
        seq_idx.append(i)
        last.append(len(bounds) - 2)
        cu.append(end)
        start = end
    i32 = {"device": device, "dtype": torch.int32}
    dt_init = torch.empty(nheads).uniform_(0.001, 0.1, generator=gen)
    conv_dim = nheads * headdim + 2 * ngroups * dstate
    return {
        "x": randn(total, nheads, headdim),
        "dt": randn(total, nheads, scale=0.5),
        "A": (-torch.empty(nheads).uniform_(1.0, 16.0, generator=gen)).to(device),
        "B": randn(total, ngroups, dstate),
        "C": randn(total, ngroups, dstate),
        "D": torch.randn(nheads, generator=gen).to(device),
        "dt_bias": torch.log(torch.expm1(dt_init)).to(device),  # softplus(dt_bias) = dt_init
        "cu_chunk_seqlens": torch.tensor(bounds, **i32),
        "last_chunk_indices": torch.tensor(last, **i32),
        "seq_idx": torch.tensor(seq_idx, **i32),
        "cu_seqlens": torch.tensor(cu, **i32),
        # Per-token request id and request start, precomputed as the mixer does (no host sync).
        "conv_seq_idx": torch.tensor([i for i, n in enumerate(lens) for _ in range(n)], **i32),
        "conv_seq_start": torch.tensor([cu[i] for i, n in enumerate(lens) for _ in range(n)], **i32),
        "xBC": randn(total, conv_dim),
        "conv_weight": randn(conv_dim, 4, scale=0.5).contiguous(),
        "conv_bias": randn(conv_dim, scale=0.1),
        "chunk": chunk,
    }


def make_step(inp: dict[str, Any], ssd: Any, conv: Any, with_conv: bool) -> tuple[Any, dict[str, Any]]:
    import torch

    buffers = {"out": torch.empty_like(inp["x"])}

    def step() -> None:
        if with_conv:
            buffers["conv_out"] = conv(
                inp["xBC"],
                inp["conv_weight"],
                inp["conv_bias"],
                inp["cu_seqlens"],
                precomputed_seq_idx=inp["conv_seq_idx"],
                precomputed_seq_start=inp["conv_seq_start"],
            )
        buffers["states"] = ssd(
            x=inp["x"],
            dt=inp["dt"],
            A=inp["A"],
            B=inp["B"],
            C=inp["C"],
            chunk_size=inp["chunk"],
            cu_chunk_seqlens=inp["cu_chunk_seqlens"],
            last_chunk_indices=inp["last_chunk_indices"],
            seq_idx=inp["seq_idx"],
            out=buffers["out"],
            D=inp["D"],
            dt_bias=inp["dt_bias"],
            dt_softplus=True,
        )

    return step, buffers


def digest(buffers: dict[str, Any]) -> dict[str, str]:
    """sha256 of each output's bytes, and of all of them together."""
    import torch

    hashes: dict[str, str] = {}
    total = hashlib.sha256()
    for name in ("out", "states", "conv_out"):
        tensor = buffers.get(name)
        if tensor is None:
            continue
        data = tensor.detach().contiguous().cpu().reshape(-1).view(dtype=torch.uint8).numpy().tobytes()
        hashes[name] = hashlib.sha256(data).hexdigest()[:16]
        total.update(name.encode() + data)
    hashes["all"] = total.hexdigest()[:16]
    return hashes


def reference_error(inp: dict[str, Any], out: Any, ntokens: int) -> dict[str, float]:
    """Max |kernel - reference| over the first ``ntokens`` tokens of sequence 0.

    Reference: the SSM recurrence in fp32, one token at a time:
    ``dt = softplus(dt_raw + dt_bias)``, ``h = exp(dt*A) h + dt * x B^T``, ``y = h C + D x``.
    """
    import torch
    import torch.nn.functional as F

    n = min(ntokens, int(inp["cu_seqlens"][1]))
    if n <= 0:
        return {}
    x, B, C = (inp[k][:n].float() for k in ("x", "B", "C"))
    dt = F.softplus(inp["dt"][:n].float() + inp["dt_bias"].float())
    A, D = inp["A"].float(), inp["D"].float()
    nheads, headdim = x.shape[1], x.shape[2]
    group = torch.arange(nheads, device=x.device) // (nheads // B.shape[1])
    h = torch.zeros(nheads, headdim, B.shape[2], device=x.device)
    ref = torch.empty_like(x)
    for t in range(n):
        h = (
            torch.exp(dt[t] * A)[:, None, None] * h
            + (dt[t][:, None] * x[t])[:, :, None] * B[t, group][:, None, :]
        )
        ref[t] = (h * C[t, group][:, None, :]).sum(-1) + D[:, None] * x[t]
    err = (out[:n].float() - ref).abs().max().item()
    scale = ref.abs().max().item()
    return {
        "tokens": n,
        "max_abs_err": err,
        "max_abs_ref": scale,
        "rel_err": err / scale if scale else float("nan"),
    }


def kernel_inventory(import_style: str) -> list[list[Any]]:
    """Every autotuned kernel: configs, key, pruning, hooks, megatron's deterministic pick, our cheapest."""
    import_ops(import_style)
    from megatron.core.ssm.ops import determinism

    try:
        from megatron_tuning import cheapest as ours_cheapest
    except ImportError:
        ours_cheapest = None
    rows = []
    for kernel, a in ops_autotuners().items():
        hooks = [n for n in ("reset_to_zero", "restore_value") if getattr(a, n, None)]
        prune = bool(getattr(a, "early_config_prune", None) or getattr(a, "perf_model", None))
        theirs = config_sig(min(a.configs, key=determinism._estimate_config_cost))
        ours = config_sig(ours_cheapest(a.configs)) if ours_cheapest else "(megatron_tuning.cheapest n/a)"
        rows.append(
            [
                kernel,
                len(a.configs),
                ",".join(a.keys),
                "prune" if prune else "-",
                ",".join(hooks) or "-",
                theirs,
                ours if ours != theirs else "same",
            ]
        )
    return rows
