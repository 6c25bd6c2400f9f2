"""The numerics audit (docs/numerics.md): each live config of a (kernel, key) launches ``runs`` times
on the call's own, restored inputs; equal digests of what it wrote form a numerics class, and a config
whose own launches differ is not deterministic on its own. Empirical: these inputs, GPU, toolchain."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from ..core.errors import NumericsError, printable
from ..core.identity import arch_tag, config_signature
from ..runtime.pinning import Measure
from .tuner import benchmark_failures, make_launcher, progress_logger


class UnseenArgument(Exception):
    """An argument points at memory the audit cannot snapshot, restore or hash: its key is refused."""


class Audit(NamedTuple):
    """Output digests of each candidate of one key, one per launch, on one call's inputs."""

    outputs: list[tuple[str, ...]]
    errors: list[str | None]  # per candidate: why it could not launch (compile/resource), else None
    inputs: str  # 16 hex of the tensors no launch wrote: class ids compare only on equal inputs

    def class_id(self, i: int) -> str:
        """16 hex of the distinct outputs candidate ``i``'s launches gave: a class's one name."""
        return hashlib.sha256("\n".join(sorted(set(self.outputs[i]))).encode()).hexdigest()[:16]

    def deterministic(self, i: int) -> bool:
        return len(set(self.outputs[i])) == 1

    def report(self, candidates: Sequence[Any], pinned: Any = None) -> dict[str, Any]:
        """The JSON form: ``classes`` (class id -> signatures), self-non-deterministic configs, and
        ``pinned_class``, the class id of ``pinned``."""
        sigs = [config_signature(c) for c in candidates]
        launched = [i for i, error in enumerate(self.errors) if error is None]
        classes: dict[str, list[str]] = {}
        for i in launched:
            classes.setdefault(self.class_id(i), []).append(sigs[i])
        pinned_class = next((self.class_id(i) for i in launched if candidates[i] is pinned), None)
        return {
            "classes": classes,
            "self_nondeterministic": [sigs[i] for i in launched if not self.deterministic(i)],
            "failed": {sigs[i]: error for i, error in enumerate(self.errors) if error},
            "inputs": self.inputs,
            "pinned": None if pinned is None else config_signature(pinned),
            "pinned_class": pinned_class,
        }


def writable_tensors(names: Sequence[str], named: Mapping[str, Any]) -> dict[str, Any]:
    """Every tensor a launch can write, by argument path: tensor arguments, the ``.base`` of a
    descriptor (``TensorDescriptor``, ``triton.reinterpret``'s wrapper), and those inside tuples.
    ``UnseenArgument`` names one that points at memory through anything else (a ``.data_ptr()``)."""
    import torch

    found: dict[str, Any] = {}

    def walk(path: str, value: Any) -> None:
        base = getattr(value, "base", None)
        if isinstance(value, torch.Tensor):
            found[path] = value
        elif isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                walk(f"{path}[{i}]", item)
        elif isinstance(base, torch.Tensor):
            found[f"{path}.base"] = base
        elif hasattr(value, "data_ptr") or base is not None:
            raise UnseenArgument(
                f"argument {path} is a {type(value).__qualname__}, which points at memory the audit cannot "
                "snapshot, restore or hash (it sees torch tensors, descriptors with a tensor .base, and "
                "tuples of them); pass a torch tensor or a descriptor over one"
            )

    for name in names:
        if name in named:
            walk(name, named[name])
    return found


def audit_candidates(
    autotuner: Any, candidates: Sequence[Any], args: Sequence[Any], kwargs: Mapping[str, Any], runs: int
) -> Audit:
    """Launch each candidate ``runs`` times on the call's arguments; digest what each launch wrote (a
    tensor whose bits differ from the first snapshot). Inputs are restored before each launch and at
    the end, so the caller's own launch sees its own inputs. Raises ``UnseenArgument`` (nothing
    launched) when an argument reaches memory it cannot restore."""
    import torch

    tensors = writable_tensors(autotuner.arg_names, {**dict(zip(autotuner.arg_names, args)), **kwargs})
    saved = {name: value.clone() for name, value in tensors.items()}

    def bits(t: Any) -> Any:
        return t.detach().reshape(-1).contiguous().view(torch.uint8)

    def digest(t: Any) -> str:
        return hashlib.sha256(memoryview(bits(t).cpu().numpy())).hexdigest()

    def observe(out: list[dict[str, str]]) -> None:  # after the kernel, before post_hook restores
        out.append({n: digest(t) for n, t in tensors.items() if not torch.equal(bits(t), bits(saved[n]))})

    failures, runs_of, errors = benchmark_failures(), [], []  # type: ignore[var-annotated]
    try:
        for config in candidates:
            launches: list[dict[str, str]] = []
            launch = make_launcher(autotuner, config, args, kwargs, lambda out=launches: observe(out))  # type: ignore[misc]
            error = None
            try:
                for _ in range(runs):
                    for name, value in tensors.items():
                        value.copy_(saved[name])
                    launch()
            except failures as exc:
                error = f"{type(exc).__name__}: {exc}"
            runs_of.append(launches)
            errors.append(error)
    finally:
        for name, value in tensors.items():
            value.copy_(saved[name])
    written = sorted({name for launches in runs_of for launch in launches for name in launch})
    before = {name: digest(saved[name]) for name in tensors}

    def combine(parts: dict[str, str], names: Sequence[str]) -> str:
        t = tensors
        text = "".join(f"{n}:{t[n].dtype}:{tuple(t[n].shape)}:{parts.get(n, before[n])}\n" for n in names)
        return hashlib.sha256(text.encode()).hexdigest()

    outputs = [tuple(combine(launch, written) for launch in launches) for launches in runs_of]
    return Audit(outputs, errors, combine({}, sorted(set(tensors) - set(written)))[:16])


def allowed(
    audit: Audit, candidates: Sequence[Any], numerics: str, hit: Any, kernel: str, key: str
) -> list[int]:
    """The candidates the ``numerics`` policy lets tuning pick; ``NumericsError`` when none does.
    ``same-class``: bit-identical to the config of ``hit``, the key's table entry (none: any config).
    ``deterministic-only``: own launches agreed."""
    sigs = [config_signature(c) for c in candidates]
    launched = [i for i, error in enumerate(audit.errors) if error is None]
    reference = None if hit is None else config_signature(hit.config)
    if numerics == "deterministic-only":
        keep, why = [i for i in launched if audit.deterministic(i)], "no config was deterministic on its own"
    elif reference is None:
        return launched
    elif reference not in sigs or sigs.index(reference) not in launched:
        keep, why = [], f"the table entry's config {reference} is not among the live configs that launched"
    else:
        keep = [i for i in launched if audit.class_id(i) == audit.class_id(sigs.index(reference))]
        why = f"none is in the class of the table entry's config {reference}"
    if not keep:
        raise NumericsError(kernel, key, numerics, why, audit.report(candidates)["classes"])
    return keep


def with_numerics(measure: Measure, numerics: str, table: Any, runs: int) -> Measure:
    """``measure`` over only the candidates ``numerics`` allows; the winner's class and determinism go
    into its timings (``numerics``), which ``tune`` records in the table."""

    def audited(autotuner: Any, candidates: list[Any], args: Any, kwargs: Any, kernel: str, key: str) -> Any:
        if not autotuner.arg_names:  # inductor._Launchers: the audit cannot see what they write
            why = "a key first reached under torch.compile is tuned over Inductor's launchers, which "
            why += "the audit cannot read; reach it once in eager code (or run `tune`) first"
            raise NumericsError(kernel, key, numerics, why, {})
        try:
            audit = audit_candidates(autotuner, candidates, args, kwargs, runs)
        except UnseenArgument as exc:
            raise NumericsError(kernel, key, numerics, str(exc), {}) from None
        hit = next(iter(table.lookup(kernel, key, arch=arch_tag())), None) if table is not None else None
        keep = allowed(audit, candidates, numerics, hit, kernel, key)
        chosen, timings = measure(autotuner, [candidates[i] for i in keep], args, kwargs, kernel, key)
        i = next(i for i, c in enumerate(candidates) if c is chosen)
        own = audit.deterministic(i)
        others = [config_signature(c) for j, c in enumerate(candidates) if audit.deterministic(j)]
        timings["numerics"] = {
            **{"policy": numerics, "class_id": audit.class_id(i), "inputs": audit.inputs},
            **{"deterministic": own, "alternatives": [] if own else others[:16]},
        }
        return chosen, timings

    return audited


def make_audit_hook(record: Callable[[dict[str, Any]], None], runs: int) -> Callable[..., None]:
    """A ``pinning.after_decision`` hook for ``audit`` jobs: audit each new key before its first
    launch (inputs restored, so the job's results are its pinned config's) and ``record`` it, with the
    table entry it pinned from (``entry_kernel``: a content match's). A key first met where nothing may
    launch (compiled code, graph capture), or whose arguments it cannot see, is recorded as not audited."""

    def hook(autotuner: Any, candidates: list[Any], call: Any, kernel: str, key: str, choice: Any) -> None:
        started = time.perf_counter()
        entry: dict[str, Any] = {"kernel": kernel, "key": key, "source": choice.source, "runs": runs}
        entry.update(entry_kernel=choice.entry_kernel or kernel, pinned=config_signature(choice.config))
        try:
            if call is None:
                raise UnseenArgument("reached in compiled code or graph capture, where nothing may launch")
            audit = audit_candidates(autotuner, candidates, call[0], call[1], runs)
            entry.update(audit.report(candidates, choice.config))
        except UnseenArgument as exc:
            entry["not_audited"] = str(exc)
        entry["seconds"] = round(time.perf_counter() - started, 3)
        progress_logger.info(
            "audited %s [%s] in %.1fs: %d configs, %d classes, %d self-non-deterministic; pinned %s",
            *(kernel, key, entry["seconds"], len(candidates), len(entry.get("classes", ()))),
            *(len(entry.get("self_nondeterministic", ())), entry["pinned"]),
        )
        record(entry)

    return hook


def audit_table(entries: Sequence[Mapping[str, Any]], mode: str = "deterministic") -> str:
    """One row per audited key: configs, classes, self-non-deterministic, the pinned config's class id
    (and how it was pinned when by a miss rule); then why any key was not audited."""
    lines = [f"{'kernel':<28} {'key':<36} {'rank':>4} {'configs':>7} {'classes':>7} {'nondet':>6}  pinned"]
    unseen, missed = [], 0
    for e in entries:
        classes, nondet = e.get("classes", {}), e.get("self_nondeterministic", [])
        mark = "not audited" if "not_audited" in e else f"class {e.get('pinned_class')}"
        mark += ", NOT DETERMINISTIC ON ITS OWN" if e.get("pinned") in nondet else ""
        if e.get("source") in ("cheapest", "nearest"):
            mark, missed = f"{mark}, a miss: {e['source']}", missed + 1
        lines.append(
            f"{e['kernel'].rsplit(':', 1)[-1][:28]:<28} {e['key'][:36]:<36} {e.get('rank', 0):>4} "
            f"{sum(map(len, classes.values())) + len(e.get('failed', {})):>7} {len(classes):>7} "
            f"{len(nondet):>6}  {e.get('pinned')} ({mark})"
        )
        if "not_audited" in e:
            unseen.append(f"not audited: {e['kernel']} [{e['key']}]: {e['not_audited']}")
    if mode == "auto" and missed:
        unseen.append(
            f"{missed} key(s) are in neither the auto cache nor a table: an auto job tunes them, and audit "
            "never tunes, so their pinned config is the miss rule's. Run the job in auto mode, then audit."
        )
    return "\n".join(map(printable, lines + unseen))


def record_numerics(path: str, entries: Sequence[Mapping[str, Any]]) -> int:
    """Write each audited key's finding into ``path``'s entry it pinned from (a content match's too),
    when its config is the one the audit pinned; several processes' findings combine (not
    deterministic if any saw it). Returns the count."""
    from ..tables.entry import Numerics, entry_with
    from ..tables.table import update_table

    found: dict[tuple[str, str, str], tuple[str, Numerics]] = {}
    for e in entries:
        if e.get("pinned_class") is None:
            continue
        nondet = e["self_nondeterministic"]
        others = tuple(s for c in e["classes"].values() for s in c if s not in nondet)[:16]
        own = e["pinned"] not in nondet
        numerics = Numerics(e["pinned_class"], e["inputs"], own, () if own else others)
        ident = (e["arch"], e.get("entry_kernel") or e["kernel"], e["key"])
        before = found.setdefault(ident, (e["pinned"], numerics))[1]
        if before.deterministic and not own:
            found[ident] = (e["pinned"], numerics)
    updated = []

    def mutate(table: Any) -> None:
        for ident, (pinned, numerics) in found.items():
            entry = table.get(*ident)
            if entry is not None and config_signature(entry.config) == pinned:
                table.add(entry_with(entry, numerics=numerics))
                updated.append(ident)

    update_table(path, mutate)
    return len(updated)
