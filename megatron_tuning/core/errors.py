"""The project's exception hierarchy.

Every error the library raises on purpose derives from ``MegatronTuningError``. Each
subclass carries structured fields (so callers and tests can inspect them without
parsing text) and a message that names the thing that went wrong and the fix.
Errors are picklable: ``__reduce__`` rebuilds them from their fields, so they survive
multiprocessing and torch.distributed elastic error files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class MegatronTuningError(Exception):
    """Root of every error raised on purpose by megatron_tuning."""


class PolicyError(MegatronTuningError, ValueError):
    """A policy field or ``MEGATRON_TUNING_*`` environment variable has a bad value."""

    def __init__(self, name: str, value: object, allowed: str) -> None:
        self.name = name
        self.value = value
        self.allowed = allowed
        super().__init__(f"Unable to use {name}={value!r}: expected {allowed}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.name, self.value, self.allowed))


class UnsupportedTritonError(MegatronTuningError, RuntimeError):
    """The installed Triton lacks something the interception relies on."""


class TableMissError(MegatronTuningError, LookupError):
    """``on_miss='error'``: no usable table entry for this kernel and key."""

    def __init__(self, kernel: str, key: str, reason: str = "no table entry") -> None:
        self.kernel = kernel
        self.key = key
        self.reason = reason
        super().__init__(
            f"No tuned config for kernel {kernel} with key {key} ({reason}), and on_miss='error'. "
            "To pin it: build a table entry with `python -m megatron_tuning tune -- <your command>` "
            "(review tables with `python -m megatron_tuning show`), or set MEGATRON_TUNING_MODE=auto "
            "(tunes a missing key once per job and caches it); to launch something anyway, set "
            "MEGATRON_TUNING_ON_MISS=nearest (the entry of the nearest shape, else the cheapest "
            "config) or min_cost (the cheapest config by static cost)."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.kernel, self.key, self.reason))


class BlockSizeOverrideError(MegatronTuningError, ValueError):
    """An explicit block-size override matches none of a kernel's live configs."""

    def __init__(self, kernel: str, override: Mapping[str, object], available: Sequence[str]) -> None:
        self.kernel = kernel
        self.override = dict(override)
        self.available = list(available)
        wanted = ", ".join(f"{k}={v!r}" for k, v in sorted(self.override.items()))
        listing = "; ".join(self.available) or "(none)"
        super().__init__(
            f"Block-size override {wanted} matches no live config of kernel {kernel}. "
            f"Live configs: {listing}. Change MEGATRON_TUNING_BLOCK_SIZES (or the policy's "
            "block_sizes) to values one of these configs has."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.kernel, self.override, self.available))


class BenchmarkForbiddenError(MegatronTuningError, RuntimeError):
    """Something tried to benchmark an in-scope kernel under a policy that never measures."""

    def __init__(self, kernel: str, mode: str) -> None:
        self.kernel = kernel
        self.mode = mode
        what = (
            "mode 'auto' measures only through megatron_tuning's tuner, once per key"
            if mode == "auto"
            else f"policy mode {mode!r} never measures"
        )
        super().__init__(
            f"Refusing to benchmark kernel {kernel} with Triton's autotuner: {what}. "
            "This means a launch bypassed the deterministic choice (please report it), or "
            "code called the autotuner's benchmark directly. Use mode 'record' or 'tune' "
            "to measure."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.kernel, self.mode))


class CompiledLaunchNotPinnedError(MegatronTuningError, RuntimeError):
    """Strict mode: compiled code (torch.compile / Inductor) launched an in-scope kernel unpinned.

    Raised when Inductor is about to benchmark the config list of an in-scope user kernel, which
    means the trace-time pin was bypassed (a torch release the adapter cannot intercept, or a graph
    compiled before ``init_deterministic_tuning``).
    """

    def __init__(self, kernel: str, key: str, candidates: int, reason: str) -> None:
        self.kernel = kernel
        self.key = key
        self.candidates = int(candidates)
        self.reason = reason
        super().__init__(
            f"Compiled code is about to benchmark {self.candidates} configs of kernel {kernel} with "
            f"key {key}: the launch bypassed the pinned config ({reason}). Call "
            "torch._dynamo.reset() after init_deterministic_tuning so graphs are traced again, use "
            "a supported torch release, or unset MEGATRON_TUNING_STRICT to only warn."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.kernel, self.key, self.candidates, self.reason))


class TableError(MegatronTuningError, ValueError):
    """A tuning table file is unreadable, corrupt, or of the wrong schema."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"Tuning table {self.path}: {problem}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.problem))


class DecisionLogError(MegatronTuningError, ValueError):
    """A decision-log file is missing, unreadable or not a decision log."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"Decision log {self.path}: {problem}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.problem))


class TuningResultsError(MegatronTuningError, ValueError):
    """A tuning-results file (``*.tuning.json``), or what ``report`` read from a log, is malformed."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"Tuning results {self.path}: {problem}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.problem))


class StaleEntryError(MegatronTuningError, RuntimeError):
    """Strict mode: a table entry was tuned for another kernel source or Triton version."""

    def __init__(self, kernel: str, key: str, path: str, detail: str) -> None:
        self.kernel = kernel
        self.key = key
        self.path = path
        self.detail = detail
        super().__init__(
            f"Table entry for kernel {kernel} key {key} in {path} is stale: {detail}. "
            "Re-tune this kernel, or unset MEGATRON_TUNING_STRICT to use the entry anyway."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.kernel, self.key, self.path, self.detail))


class DivergenceError(MegatronTuningError, RuntimeError):
    """Ranks chose different configs for the same (kernel, key).

    ``signatures`` maps each rank that reported to the config signature it chose.
    """

    def __init__(self, kernel: str, key: str, signatures: Mapping[int, str], detail: str = "") -> None:
        self.kernel = kernel
        self.key = key
        self.signatures = {int(r): s for r, s in signatures.items()}
        self.detail = detail
        super().__init__(_divergence_message(kernel, key, self.signatures, detail))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.kernel, self.key, self.signatures, self.detail))


class ConsensusError(MegatronTuningError, RuntimeError):
    """``auto`` mode: the decision the job published for (kernel, key) cannot be launched here."""

    def __init__(self, kernel: str, key: str, detail: str) -> None:
        self.kernel = kernel
        self.key = key
        self.detail = detail
        super().__init__(
            f"auto mode cannot launch the job's decision for kernel {kernel} with key {key}: {detail}. "
            "Every rank must offer the same candidate configs for a key; pin this kernel with a "
            "tuning table (MEGATRON_TUNING_TABLE) or make the ranks' pruning agree."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.kernel, self.key, self.detail))


class SessionMismatchError(MegatronTuningError, RuntimeError):
    """Ranks are in different tuning sessions: ``init_deterministic_tuning`` was called a different
    number of times (or with different policies) on them, so their checks would compare nothing.

    ``sessions`` maps each rank named to a description of its session (number and policy).
    """

    def __init__(self, what: str, sessions: Mapping[int, str]) -> None:
        self.what = what
        self.sessions = {int(r): s for r, s in sessions.items()}
        lines = [f"Ranks are in different tuning sessions at {what}:"]
        lines += [f"  Rank {rank} is in {text}" for rank, text in sorted(self.sessions.items())]
        lines.append(
            "  Each init_deterministic_tuning call starts the next numbered session, and ranks compare "
            "configs only within the same session number: call it the same number of times, with the "
            "same policy, on every rank."
        )
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.what, self.sessions))


class AgreementTimeoutError(MegatronTuningError, TimeoutError):
    """An agreement check waited too long for some ranks."""

    def __init__(self, what: str, missing_ranks: Sequence[int], timeout_s: float) -> None:
        self.what = what
        self.missing_ranks = sorted(int(r) for r in missing_ranks)
        self.timeout_s = float(timeout_s)
        super().__init__(
            f"Agreement check for {what} timed out after {self.timeout_s:g}s waiting for "
            f"rank(s) {self.missing_ranks}. Those ranks did not reach this kernel: use "
            "agreement mode 'store' (tolerates ranks that never launch a kernel) or give "
            "'allgather' a group whose ranks run identical kernels in identical order."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.what, self.missing_ranks, self.timeout_s))


def _divergence_message(kernel: str, key: str, signatures: Mapping[int, str], detail: str) -> str:
    groups: dict[str, list[int]] = {}
    for rank in sorted(signatures):
        groups.setdefault(signatures[rank], []).append(rank)
    lines = [f"Ranks launched different configs for kernel {kernel} with key {key}:"]
    for signature, ranks in sorted(groups.items(), key=lambda item: item[1][0]):
        lines.append(f"  Rank(s) {ranks} ran {signature}")
    if len(groups) >= 2:
        (first, _), (second, _) = sorted(groups.items(), key=lambda item: item[1][0])[:2]
        lines.append("  diff: " + _signature_diff(first, second))
    if detail:
        lines.append(f"  {detail}")
    lines.append(
        "  Pin this kernel with a tuning table (MEGATRON_TUNING_TABLE) or make every rank use "
        "the same policy and table."
    )
    return "\n".join(lines)


def _signature_diff(first: str, second: str) -> str:
    """Field-by-field difference of two ``config_signature`` strings."""
    a = dict(part.split("=", 1) for part in first.split(", ") if "=" in part)
    b = dict(part.split("=", 1) for part in second.split(", ") if "=" in part)
    changed = [
        f"{k}: {a.get(k, '-')} -> {b.get(k, '-')}"
        for k in sorted(a.keys() | b.keys())
        if a.get(k) != b.get(k)
    ]
    return "; ".join(changed) or "(signatures differ only in formatting)"


class StoreRequestError(MegatronTuningError, RuntimeError):
    """A request to the job's c10d store failed (its host died, or stayed silent past its timeout)."""

    def __init__(self, what: str, address: str, detail: str) -> None:
        self.what = what
        self.address = address
        self.detail = detail
        super().__init__(
            f"The job's store ({address}) failed during {what}: {detail}. The store lives in the "
            "rendezvous host's process (rank 0's agent under torchrun): if that host died or hung, the "
            "job cannot check its configs. Restart the job; with many ranks, agreement 'digest' sends "
            "far fewer requests (MEGATRON_TUNING_AGREEMENT=digest)."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.what, self.address, self.detail))


class AutoStoreError(MegatronTuningError, RuntimeError):
    """``auto`` mode: a store that ranks of the job host for its decisions cannot be used."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(
            f"auto mode: {detail}. Large jobs keep auto's decisions in stores that some ranks host "
            "(MEGATRON_TUNING_AUTO_STORES, docs/agreement.md); every rank must reach each host's port. "
            "Set MEGATRON_TUNING_AUTO_STORE_HOST to an address the other nodes can reach, or "
            "MEGATRON_TUNING_AUTO_STORES=off to keep every decision in the job's store."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.detail,))


class StoreRecordError(MegatronTuningError, RuntimeError):
    """A record under one of the library's store keys is not what the library writes there."""

    def __init__(self, what: str, problem: str) -> None:
        self.what = what
        self.problem = problem
        super().__init__(
            f"{what}: the job's store holds {problem}. Something other than this megatron_tuning "
            "version wrote under the library's keys (another version on some ranks, or foreign code); "
            "run every rank with the same install."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.what, self.problem))


class InputMismatchError(MegatronTuningError, RuntimeError):
    """Ranks of one arch started a tuning session with different inputs (policy, tables, versions).

    Every deterministic choice is a pure function of these inputs, so ranks that differ here would
    launch different configs; ``differences`` maps each input that differs to each rank's value.
    """

    def __init__(
        self, session: str, ranks: Sequence[int], differences: Mapping[str, Mapping[int, str]]
    ) -> None:
        self.session = session
        self.ranks = [int(r) for r in ranks]
        self.differences = {k: {int(r): str(v) for r, v in d.items()} for k, d in differences.items()}
        lines = [f"Ranks {self.ranks} started {session} with different inputs:"]
        for name, by_rank in sorted(self.differences.items()):
            listing = "; ".join(f"rank {r}: {v}" for r, v in sorted(by_rank.items()))
            lines.append(f"  {name}: {listing}")
        lines.append(
            "  Choices are a pure function of policy, tables and versions, so these ranks would launch "
            "different configs. Give every rank the same MEGATRON_TUNING_* settings, table files and "
            "installs (compare with `python -m megatron_tuning show TABLE`)."
        )
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.session, self.ranks, self.differences))
