"""The exception hierarchy: one root; subclasses carry structured fields, name the fix, and are
rebuilt from their fields when unpickled (multiprocessing, elastic error files)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

# Exit status of a process that died of (or noticed at exit) a DivergenceError, and of a `run` job
# any of whose processes raised one; Python itself uses 1 and 2.
EXIT_DIVERGENCE = 3
# ``triton.Config`` fields that hold code run around the launch, which no signature holds (on Triton
# 3.3-3.9 only ``pre_hook``: ``post_hook`` is the autotuner's, one for all its configs).
CONFIG_HOOKS = ("pre_hook",)


class MegatronTuningError(Exception):
    """Root of every error raised on purpose. A subclass with its own ``__init__`` keeps each argument
    as the attribute of that name: ``__reduce__`` rebuilds it from them."""

    def __reduce__(self) -> Any:
        init = type(self).__init__
        if not inspect.isfunction(init):  # Exception's own: its args are the message
            return super().__reduce__()
        return type(self), tuple(getattr(self, name) for name in list(inspect.signature(init).parameters)[1:])


class PolicyError(MegatronTuningError, ValueError):
    """A policy field or ``MEGATRON_TUNING_*`` variable has a bad value."""

    def __init__(self, name: str, value: object, allowed: str) -> None:
        self.name, self.value, self.allowed = name, value, allowed
        super().__init__(f"Unable to use {name}={value!r}: expected {allowed}")


class UnsupportedTritonError(MegatronTuningError, RuntimeError):
    """The installed Triton lacks something the interception relies on."""


class TableMissError(MegatronTuningError, LookupError):
    """``on_miss='error'``: no usable table entry for this kernel and key. ``remedy`` says how to get
    one; a launcher that sets the policy itself (``score``) replaces it in its job's processes."""

    remedy: ClassVar[str] = (
        "To pin it: build a table entry with `python -m megatron_tuning tune -- <your command>`, or "
        "set MEGATRON_TUNING_MODE=auto (tunes a missing key once per job and caches it); to launch "
        "something anyway, set MEGATRON_TUNING_ON_MISS=nearest (the nearest shape's entry, else the "
        "cheapest config) or min_cost (the cheapest config by static cost)."
    )

    def __init__(self, kernel: str, key: str, reason: str = "no table entry") -> None:
        self.kernel, self.key, self.reason = kernel, key, reason
        miss = f"No tuned config for kernel {kernel} with key {key} ({reason}), and on_miss='error'."
        super().__init__(f"{miss} {self.remedy}")


class BlockSizeOverrideError(MegatronTuningError, ValueError):
    """An explicit block-size override matches none of a kernel's live configs."""

    def __init__(self, kernel: str, override: Mapping[str, object], available: Sequence[str]) -> None:
        self.kernel, self.override, self.available = kernel, dict(override), list(available)
        wanted = ", ".join(f"{k}={v!r}" for k, v in sorted(self.override.items()))
        super().__init__(
            f"Block-size override {wanted} matches no live config of kernel {kernel}. Live configs: "
            f"{'; '.join(self.available) or '(none)'}. Change MEGATRON_TUNING_BLOCK_SIZES (or the "
            "policy's block_sizes) to values one of these configs has."
        )


class AmbiguousConfigError(MegatronTuningError, ValueError):
    """Two configs of one kernel have one signature but launch differently: a table entry, a published
    decision or a chaos claim names a config by its signature, so it could launch the wrong one."""

    def __init__(self, kernel: str, signature: str, fields: Sequence[str]) -> None:
        self.kernel, self.signature, self.fields = kernel, signature, list(fields)
        if any(field in CONFIG_HOOKS for field in self.fields):
            why = (
                "a signature leaves hooks out, so a config chosen by signature (a table entry, a decision "
                "another rank published) could run without the hook the deciding rank ran, or with another. "
                "Keep one config of each signature, with the hook it needs, or give the hooked one a value "
                "of its own (a constexpr the kernel takes) so that its signature differs."
            )
        else:
            why = (
                "a value there has no text that tells it apart (a lambda, a function a factory made, an "
                "object with Python's default repr), so a config chosen by signature could launch the "
                "other. Give each such value its own name (a module-level def or class) or a __repr__ "
                "that differs between them and is the same in every process."
            )
        super().__init__(
            f"Kernel {kernel} has two configs with the signature {signature!r} that differ in "
            f"{', '.join(self.fields)}: {why}"
        )


class LaunchOptionError(MegatronTuningError, TypeError):
    """A call of an autotuned kernel passes a keyword one of its configs also sets (``num_warps=8``):
    stock Triton refuses it too (its tuner with a ValueError for a meta-parameter, its launch with a
    TypeError for a launch option), here with the fix. ``options``: each such keyword and the call's
    value, as text; ``signature``: the first config that sets one."""

    def __init__(self, kernel: str, options: Mapping[str, str], signature: str) -> None:
        self.kernel, self.options, self.signature = kernel, dict(options), signature
        passed = ", ".join(f"{name}={value}" for name, value in self.options.items())
        super().__init__(
            f"Kernel {kernel} was called with {passed}, which its config ({signature}) also sets: an "
            "autotuned kernel takes these from the triton.Config it launches, and stock Triton refuses "
            "this call too (ValueError for a meta-parameter, TypeError for a launch option). Put the "
            "value in the kernel's triton.Config(...) list instead (e.g. triton.Config({...}, "
            "num_warps=8)) and drop it from the call."
        )


class UnstorableConfigError(MegatronTuningError, ValueError):
    """A mode that stores or shares the configs it decides (``auto``, ``record``, ``tune``) met a
    kernel with a config value no table or job store can hold; ``problem`` names the field and what is
    wrong; ``wrong_type``: its type (a jit function), not its value (out of range), is."""

    _STORES: ClassVar[dict[str, str]] = {
        "auto": "persists each decision in its cache table and shares it with the job's ranks through "
        "the job's store",
        "record": "writes each recorded winner to a table file (its recording)",
        "tune": "writes each tuned winner to a table",
    }

    def __init__(self, kernel: str, mode: str, problem: str, wrong_type: bool = True) -> None:
        self.kernel, self.mode, self.problem, self.wrong_type = kernel, mode, problem, wrong_type
        stores = self._STORES.get(mode, "stores the configs it decides")
        super().__init__(
            f"Kernel {kernel} cannot run in mode {mode!r}, which {stores}: {problem}, so nothing "
            f"measured for this kernel could be kept. {_sentence(storable_fix(wrong_type))}, or use "
            "mode 'deterministic', where a key "
            "without a table entry launches the miss rule's config, chosen without measuring, and "
            "nothing is stored."
        )


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def storable_fix(wrong_type: bool) -> str:
    """How to make a config value storable: a value of another type moves out of the config, one out
    of range (an integer past 64 bits, NaN, a lone surrogate, num_warps=4096) changes in place."""
    if wrong_type:
        return "pass such a value to the kernel as a launch argument rather than as a config constexpr"
    return "change it in the kernel's triton.Config(...) list to a value a table can hold"


class BenchmarkForbiddenError(MegatronTuningError, RuntimeError):
    """Something tried to benchmark an in-scope kernel under a policy that never measures."""

    def __init__(self, kernel: str, mode: str) -> None:
        self.kernel, self.mode = kernel, mode
        what = f"policy mode {mode!r} never measures"
        if mode == "auto":
            what = "mode 'auto' measures only through megatron_tuning's tuner, once per key"
        super().__init__(
            f"Refusing to benchmark kernel {kernel} with Triton's autotuner: {what}. A launch bypassed "
            "the deterministic choice (please report it), or code called the autotuner's benchmark "
            "directly. Use mode 'record' or 'tune' to measure."
        )


class CompiledLaunchNotPinnedError(MegatronTuningError, RuntimeError):
    """Strict mode: compiled code (torch.compile / Inductor) is about to benchmark an in-scope kernel."""

    def __init__(self, kernel: str, key: str, candidates: int, reason: str) -> None:
        self.kernel, self.key, self.candidates, self.reason = kernel, key, int(candidates), reason
        super().__init__(
            f"Compiled code is about to benchmark {self.candidates} configs of kernel {kernel} with key "
            f"{key}: the launch bypassed the pinned config ({reason}). Call torch._dynamo.reset() after "
            "init_deterministic_tuning so graphs are traced again, use a supported torch release, or "
            "unset MEGATRON_TUNING_STRICT to only warn."
        )


class TableError(MegatronTuningError, ValueError):
    """A file the library reads or writes is missing, unreadable, corrupt or of the wrong schema."""

    def __init__(self, path: str, problem: str, what: str = "Tuning table") -> None:
        self.path, self.problem, self.what = str(path), problem, what
        super().__init__(f"{what} {self.path}: {problem}")


class StaleEntryError(MegatronTuningError, RuntimeError):
    """Strict mode: a table entry was tuned for another kernel source or Triton version."""

    def __init__(self, kernel: str, key: str, path: str, detail: str) -> None:
        self.kernel, self.key, self.path, self.detail = kernel, key, path, detail
        super().__init__(
            f"Table entry for kernel {kernel} key {key} in {path} is stale: {detail}. "
            "Re-tune this kernel, or unset MEGATRON_TUNING_STRICT to use the entry anyway."
        )


class NumericsError(MegatronTuningError, RuntimeError):
    """No live config qualifies under ``numerics``; ``classes``: class id -> signatures."""

    def __init__(
        self, kernel: str, key: str, numerics: str, reason: str, classes: Mapping[str, Sequence[str]]
    ) -> None:
        self.kernel, self.key, self.numerics, self.reason = kernel, key, numerics, reason
        self.classes = {name: list(members) for name, members in classes.items()}
        listing = "".join(f"\n  class {name}: " + "; ".join(c) for name, c in self.classes.items())
        super().__init__(
            f"No live config of kernel {kernel} key {key} qualifies under numerics={numerics!r}: {reason}. "
            f"Numerics classes on this call's inputs:{listing or ' (none launched)'}\nSet "
            "MEGATRON_TUNING_NUMERICS=any to allow a change of output bits (docs/numerics.md)."
        )


CONFIG_LIST_KEY = "(config list)"
"""The key a kernel's config list is compared under across ranks, its "signature" the list's digest
and its configs' signatures (``distributed.store.config_list_row``)."""
FIX_A_CONFIG_LIST = (
    "Make this kernel's config list the same on every rank: build it from fixed values, never from the "
    "node's device (shared memory, SM count, a MIG slice), environment variables or package versions."
)


class DivergenceError(MegatronTuningError, RuntimeError):
    """Ranks launched different configs for the same (kernel, key); ``signatures``: rank -> config.
    ``planted``: chaos mode made them differ on purpose. With ``key`` ``CONFIG_LIST_KEY``, ranks offer
    different config lists for the kernel (never planted), ``signatures``: rank -> its list."""

    raised: ClassVar[int] = 0  # how many this process built (each is raised): tells a launcher it fired

    def __init__(
        self, kernel: str, key: str, signatures: Mapping[int, str], detail: str = "", planted: bool = False
    ) -> None:
        listing = key == CONFIG_LIST_KEY
        self.kernel, self.key, self.detail, self.planted = kernel, key, detail, bool(planted) and not listing
        self.signatures = {int(r): s for r, s in signatures.items()}
        DivergenceError.raised += 1
        groups: dict[str, list[int]] = {}
        for rank in sorted(self.signatures):
            groups.setdefault(self.signatures[rank], []).append(rank)
        ordered = sorted(groups.items(), key=lambda item: item[1][0])
        if listing:
            lines = [
                f"Ranks offer different config lists for kernel {kernel}, so any of its keys can differ:"
            ]
            lines += [f"  Rank(s) {ranks} offer {signature}" for signature, ranks in ordered]
        else:
            lines = [f"Ranks launched different configs for kernel {kernel} with key {key}:"]
            lines += [f"  Rank(s) {ranks} ran {signature}" for signature, ranks in ordered]
        if len(ordered) >= 2:
            diff = _list_diff if listing else _signature_diff
            lines.append("  diff: " + diff(ordered[0], ordered[1]))
        if detail:
            lines.append(f"  {detail}")
        if listing:
            lines.append(f"  {FIX_A_CONFIG_LIST}")
        elif self.planted:
            lines.append(
                "  Planted by chaos mode (ranks pick different configs on purpose): the check works and "
                "nothing needs fixing."
            )
        else:
            lines.append(
                "  Pin this kernel with a tuning table (MEGATRON_TUNING_TABLE) or make every rank use the "
                "same policy and table."
            )
        super().__init__("\n".join(lines))


class ConsensusError(MegatronTuningError, RuntimeError):
    """``auto`` mode: the job's decision for (kernel, key) cannot be launched here."""

    def __init__(self, kernel: str, key: str, detail: str) -> None:
        self.kernel, self.key, self.detail = kernel, key, detail
        super().__init__(
            f"auto mode cannot launch the job's decision for kernel {kernel} with key {key}: {detail}. "
            "Every rank must offer the same candidate configs for a key; pin this kernel with a tuning "
            "table (MEGATRON_TUNING_TABLE) or make the ranks' pruning agree."
        )


class AgreementTimeoutError(MegatronTuningError, TimeoutError):
    """A cross-rank check waited too long for some ranks; ``missing_ranks`` names them."""

    def __init__(self, what: str, missing_ranks: Sequence[int], timeout_s: float) -> None:
        self.what, self.missing_ranks = what, sorted(int(r) for r in missing_ranks)
        self.timeout_s = float(timeout_s)
        super().__init__(
            f"Agreement check for {what} timed out after {self.timeout_s:g}s waiting for rank(s) "
            f"{self.missing_ranks}. Those ranks did not reach it: every rank of the group must call "
            "verify_agreement() (or, with agreement 'allgather', launch the same kernels in the same "
            "order); use agreement 'store' when ranks launch different kernels."
        )


class InputMismatchError(MegatronTuningError, RuntimeError):
    """Ranks of one job started with different inputs; ``differences``: input -> rank -> value."""

    def __init__(
        self, where: str, ranks: Sequence[int], differences: Mapping[str, Mapping[int, str]]
    ) -> None:
        self.where, self.ranks = where, [int(r) for r in ranks]
        self.differences = {k: {int(r): str(v) for r, v in d.items()} for k, d in differences.items()}
        lines = [f"Ranks {self.ranks} differ in what their choices depend on, at {where}:"]
        for name, by_rank in sorted(self.differences.items()):
            lines.append(f"  {name}: " + "; ".join(f"rank {r}: {v}" for r, v in sorted(by_rank.items())))
        lines.append(
            "  Give every rank the same MEGATRON_TUNING_* settings, table files and installs, and call "
            "init_deterministic_tuning and verify_agreement the same number of times on each (compare "
            "tables with `python -m megatron_tuning show TABLE`)."
        )
        if "arch" in self.differences:  # no setting makes two GPU archs launch one config
            lines.append(
                "  Tables hold one entry per GPU arch and no check compares ranks of two archs: run one "
                "GPU arch per job, or set MEGATRON_TUNING_AGREEMENT=off (agreement='off') for a "
                "mixed-arch job: each rank then launches its own arch's entries, and no key is compared."
            )
        super().__init__("\n".join(lines))


class StoreError(MegatronTuningError, RuntimeError):
    """A request to the job's c10d store failed, or a record there is not one the library writes."""

    def __init__(self, what: str, problem: str) -> None:
        self.what, self.problem = what, problem
        super().__init__(
            f"{what}: {problem}. The store lives in the rendezvous host's process (rank 0's agent under "
            "torchrun): if it died or hung, restart the job; if a record is foreign, run every rank "
            "with the same megatron_tuning install."
        )


def _signature_diff(first: tuple[str, list[int]], second: tuple[str, list[int]]) -> str:
    """Field-by-field difference of two ``config_signature`` strings."""
    a = dict(part.split("=", 1) for part in first[0].split(", ") if "=" in part)
    b = dict(part.split("=", 1) for part in second[0].split(", ") if "=" in part)
    changed = [
        f"{k}: {a.get(k, '-')} -> {b.get(k, '-')}"
        for k in sorted(a.keys() | b.keys())
        if a.get(k) != b.get(k)
    ]
    return "; ".join(changed) or "(signatures differ only in formatting)"


def _list_diff(first: tuple[str, list[int]], second: tuple[str, list[int]]) -> str:
    """The configs only one of two listings (``<digest>: <signature>; ...``) offers."""
    texts = (first[0], second[0])
    if any(text.endswith("[truncated]") or ": " not in text for text in texts):
        return "their digests differ"  # a listing cut short (verify's rows) or unknown
    a, b = (set(text.partition(": ")[2].split("; ")) for text in texts)
    if a == b:
        return "the same configs; their digests differ in what the function closes over"
    return " | ".join(
        f"only rank(s) {ranks}: {'; '.join(sorted(mine - theirs)) or '(none)'}"
        for mine, theirs, ranks in ((a, b, first[1]), (b, a, second[1]))
    )


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped: a raw ``\\r``, ANSI sequence or bidi
    override in a file others wrote could rewrite what a reviewer sees."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(ord(c)) for c in text)


def _escape(code: int) -> str:
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
