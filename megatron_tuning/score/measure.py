"""``measure`` and ``noise_floor``: a pinned candidate timed in interleaved rounds against its
reference, until the interval is tight, the verdict decided, or the budget spent.

One round: the arms run blocks of launches in ABBA order, BAAB the next round (the tuner's round
loop, ``tuning.tuner.interleave``); an arm's round value is the median of its launches in the
round. The in-band clock brackets every block, NVML is read once per round. Before the first
round the candidate runs until its clock holds steady (the settle phase). docs/score.md
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..core.decisions import get_decisions
from ..tuning.tuner import interleave
from . import clocks as clk
from . import integrity, pooling, report
from .stats import FIRST_LOOK, look_level, planned_looks
from .timers import Backend, default_backend

BLOCK_MS = 2.0  # device time of one block; an arm runs two per round
MAX_LAUNCHES = 4096  # per block: bounds host time for tiny kernels
SETTLE_MIN_S, SETTLE_CAP_S, SETTLE_SHARE = 0.3, 2.0, 0.25  # settle at least / at most / at most of budget
SETTLE_WINDOW_S = 0.1  # the clock must hold steady over this much of the settle phase
MAX_ROUNDS = 1 << 16
# The escape probe times about ESCAPE_PROBE_MS of launches, at most ESCAPE_PROBE_LAUNCHES: well under
# the driver's launch queue, which once full holds the host back until the GPU catches up, so that
# the timed stream's end event is recorded late and takes in the escaped work (measured on an H100).
ESCAPE_PROBE_MS, ESCAPE_PROBE_LAUNCHES = 5.0, 64
NVML_SHARE = 0.02  # NVML is read every round, or every few when a read costs more than this of one

# One line per result, and per look on a terminal: INFO records, shown where the application (or the
# `score` job, commands/bootstrap.py) turns them on.
progress = logging.getLogger(__name__ + ".progress")


def abba(round_index: int, live: Sequence[int]) -> list[int]:
    """Block order of a round: ABBA, then BAAB, so a linear drift hits both arms alike in every
    round (and over each pair of rounds, a quadratic one); one arm: AA."""
    if len(live) == 1:
        return [live[0], live[0]]
    a, b = live if round_index % 2 == 0 else live[::-1]
    return [a, b, b, a]


class _Arm(NamedTuple):
    run: Callable[[], Any]  # what one timed call runs (the call, or a CUDA graph replay)
    calls: int  # timed calls per block
    per_call: int  # launches per timed call (a graph holds several)


def measure(
    fn: Callable[..., Any],
    *,
    reference: Callable[..., Any] | None = None,
    make_inputs: Callable[[], Any] | None = None,
    flops: float | None = None,
    bytes: float | None = None,
    l2: str | None = None,
    launch: str = "eager",
    target_ci: float = 0.01,
    budget_s: float = 10.0,
    check: Callable[[Any, Any], Any] | str | None = "reference",
    clocks: str = "auto",
    margin: float = 0.01,
    noise_floor: report.Score | float | None = None,
    name: str | None = None,
    backend: Backend | None = None,
    nvml: Any = "auto",
    inband: Any = "auto",
    clock: Callable[[], float] = time.perf_counter,
) -> report.Score:
    """Score ``fn`` (``fn(*make_inputs())``, or ``fn()``) against ``reference`` when given; see
    docs/score.md for every argument and field. ``l2``: ``cold`` (flushed before each launch;
    default in eager mode) or ``warm`` (default with ``launch="graph"``). ``target_ci``: stop once the
    95% interval's half-width (of the ratio, else of the latency) is this fraction. ``budget_s``
    bounds the settle phase and the rounds. ``check``: ``"reference"`` (outputs close to the
    reference's), a callable ``check(output, reference_output) -> bool``, or ``None``. The seams
    ``backend``, ``nvml``, ``inband`` and ``clock`` default to this machine's (``"auto"``)."""
    job = pooling.job_settings()
    budget_s = job.get("budget_s") or budget_s
    target_ci = job.get("target_ci") or target_ci
    aa = bool(job.get("noise_floor")) or (reference is fn and reference is not None)
    reference = fn if aa else reference
    l2 = l2 or ("warm" if launch == "graph" else "cold")
    _validate(target_ci=target_ci, budget_s=budget_s, l2=l2, launch=launch, clocks=clocks, margin=margin)
    backend = backend or default_backend()
    sources = backend.clock_sources() if clocks == "auto" and "auto" in (nvml, inband) else (None, None)
    nv = sources[0] if nvml == "auto" else nvml
    ib = sources[1] if inband == "auto" else inband
    nv, ib = (None, None) if clocks == "off" else (nv, ib)
    decisions_before = len(get_decisions())

    inputs = make_inputs() if make_inputs is not None else None
    fns = [fn] if reference is None else [fn, reference]
    # Each arm its own inputs: a reference is an independent instance (its own buffers), never fn's.
    arm_inputs = [inputs] + [make_inputs() if make_inputs is not None else None for _ in fns[1:]]
    calls = [integrity.bind(f, i) for f, i in zip(fns, arm_inputs)]
    correctness = integrity.check_before(fn, reference, inputs, check)  # the first calls: compile, checked
    backend.synchronize()

    if ib is not None:
        ib.mhz(ib.stamp(), ib.stamp())  # compiles the in-band clock's kernel outside the budget
    cold = l2 == "cold"
    arms = [_arm(backend, call, launch, cold, clock) for call in calls]
    started = clock()  # the budget: the settle phase and the rounds
    settle_cap = min(SETTLE_CAP_S, SETTLE_SHARE * budget_s)
    settle = _settle(lambda: _block(backend, ib, arms[0], cold), clock, settle_cap, nv, ib)
    delta = max(margin, report.aa_p95(noise_floor) or 0.0)
    run = _rounds(
        lambda i: _block(backend, ib, arms[i], cold),
        len(arms),
        nv,
        clock,
        started,
        budget_s,
        lambda analysis: _stop(analysis, target_ci, correctness),
        lambda samples, level: report.analyse(samples, delta=delta, level=level, ib=ib is not None),
        name or _name(fn),
    )
    samples, analysis = run.samples, run.analysis
    flags = _integrity(backend, calls[0], arms, samples, analysis, aa)
    if run.seconds > budget_s:  # a candidate too slow for one round in the budget: scored on one
        flags.append(_over_budget(budget_s, settle, run.seconds - settle["seconds"], len(samples["nvml"])))
    correctness.update(integrity.check_after(fn, reference, make_inputs, inputs, check, correctness, flags))
    record = report.build(
        name=name or _name(fn),
        analysis=analysis,
        samples=samples,
        settings={"l2": l2, "launch": launch, "target_ci": target_ci, "budget_s": budget_s, "margin": margin},
        rounds={
            "looks": run.looks,
            "planned_looks": run.planned,
            "stopped_by": run.stopped_by,
            "seconds": run.seconds,
        },
        timing={
            "timer": backend.kind,
            "flush_bytes": backend.flush_bytes if cold else None,
            "launches_per_block": [a.calls * a.per_call for a in arms],
            "block_ms": BLOCK_MS,
            "order": "ABBA/BAAB" if len(arms) == 2 else "AA",
            "settle": {k: v for k, v in settle.items() if k != "block_s"},
        },
        delta=delta,
        aa=aa,
        nvml=nv,
        device=backend.device(),
        correctness=correctness,
        flags=flags,
        shapes=report.shapes(inputs),
        flops=flops,
        bytes=bytes,
        decisions=get_decisions(),
        new_decisions=decisions_before,
    )
    score = report.Score(record)
    _progress(record["name"], len(run.looks), analysis, final=True, score=score)
    pooling.publish(record, job)
    return score


def noise_floor(fn: Callable[..., Any], **options: Any) -> report.Score:
    """A/A: ``fn`` against an independent instance of itself (its own inputs, the same code). The
    result's ``noise_floor.aa_p95`` is the largest difference its 95% interval cannot rule out: pass
    it (or the result) as ``measure(..., noise_floor=...)`` to widen the verdict's margin."""
    return measure(fn, reference=fn, **options)


def _validate(**values: Any) -> None:
    allowed = {"l2": ("cold", "warm"), "launch": ("eager", "graph"), "clocks": ("auto", "off")}
    for key, choices in allowed.items():
        if values[key] not in choices:
            raise ValueError(f"{key}={values[key]!r}: expected one of {', '.join(choices)}")
    if values["l2"] == "cold" and values["launch"] == "graph":
        raise ValueError(
            "l2='cold' needs an event pair around each launch, which a graph replay has not: "
            "use l2='warm' with launch='graph'"
        )
    if not 0 < values["target_ci"] < 1:
        raise ValueError(f"target_ci={values['target_ci']!r}: expected a fraction in (0, 1), e.g. 0.01")
    if not 0 < values["budget_s"] < math.inf:
        raise ValueError(f"budget_s={values['budget_s']!r}: expected a positive number of seconds")
    if not 0 <= values["margin"] < 1:
        raise ValueError(f"margin={values['margin']!r}: expected a fraction in [0, 1), e.g. 0.01")


def _name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__)


def _arm(
    backend: Backend, call: Callable[[], Any], launch: str, cold: bool, clock: Callable[[], float]
) -> _Arm:
    """Size an arm's blocks: three launches estimate the wall cost of one (flush included when cold),
    after one untimed block: a first block pays for loading the timer's own kernels (the spin, the
    flush), which sized a 0.2 ms GEMM's blocks at one launch, its GPU idle between them (H100)."""
    backend.time_block(call, 1, cold)
    started = clock()
    backend.time_block(call, 3, cold)
    per_launch_s = max((clock() - started) / 3, 1e-7)
    launches = max(1, min(MAX_LAUNCHES, math.ceil(BLOCK_MS * 1e-3 / per_launch_s)))
    run, per_call = backend.prepare(call, launch, launches)
    return _Arm(run, 1 if per_call > 1 else launches, per_call)


def _block(backend: Backend, ib: Any, arm: _Arm, cold: bool) -> tuple[list[float], float | None]:
    """One block of an arm: ms per launch, and the in-band clock around it."""
    start = ib.stamp() if ib is not None else None
    times = backend.time_block(arm.run, arm.calls, cold and arm.per_call == 1)
    end = ib.stamp() if ib is not None else None
    return [t / arm.per_call for t in times], (ib.mhz(start, end) if ib is not None else None)


def _settle(
    block: Callable[[], Any], clock: Callable[[], float], cap_s: float, nv: Any, ib: Any
) -> dict[str, Any]:
    """Run the candidate until its clock (in-band, else NVML's, else its times) has held steady over
    ``SETTLE_WINDOW_S`` after at least ``SETTLE_MIN_S``, or ``cap_s`` passed."""
    source = "inband" if ib is not None else "nvml" if nv is not None else "time"
    started = clock()
    seen: list[tuple[float, float]] = []
    while True:
        times, mhz = block()
        if source == "nvml":
            mhz = nv.sample().get("sm_mhz")
        now = clock() - started
        seen.append((now, float(mhz) if mhz is not None else float(statistics.median(times))))
        steady = now >= SETTLE_MIN_S and clk.settled([v for t, v in seen if t >= now - SETTLE_WINDOW_S])
        if steady or now >= cap_s:
            break
    return {
        "seconds": now,
        "blocks": len(seen),
        "steady": steady,
        "signal": source,
        "before": seen[0][1],
        "after": seen[-1][1],
        "block_s": now / len(seen),
    }


def _add_round(
    samples: dict[str, Any], taken: list[Any], arms: int, reading: dict[str, Any], last_arm: int
) -> None:
    for i in range(arms):
        blocks = [value for arm, value in taken if arm == i]
        samples["values"][i].append(float(np.median([t for times, _ in blocks for t in times])))
        clocks = [mhz for _, mhz in blocks if mhz is not None]
        samples["mhz"][i].append(float(np.mean(clocks)) if clocks else None)
    samples["nvml"].append({**reading, "arm": last_arm})  # an instant reading: the last block's arm


class _Run(NamedTuple):
    samples: dict[str, Any]
    analysis: dict[str, Any]
    looks: list[int]
    planned: int
    stopped_by: str
    seconds: float


def _rounds(
    block: Callable[[int], Any],
    arms: int,
    nv: Any,
    clock: Callable[[], float],
    started: float,
    budget_s: float,
    stop: Callable[[dict[str, Any]], str | None],
    analyse: Callable[[dict[str, Any], float], dict[str, Any]],
    name: str,
) -> _Run:
    """Interleaved rounds until a look says stop or the next round would pass the budget. The looks
    come at 8, 16, 32, ... rounds; how many the budget holds (known after the first round) splits alpha."""
    samples: dict[str, Any] = {
        "values": [[] for _ in range(arms)],
        "mhz": [[] for _ in range(arms)],
        "nvml": [],
    }
    looks: list[int] = []
    planned, analysis, stopped_by = 1, None, "budget"
    last, longest, stride = clock(), 0.0, 1
    errors: list[str | None] = [None] * arms
    for index, taken in interleave(block, errors, itertools.count(), order=abba):
        asked = clock()
        reading = dict(nv.sample()) if nv is not None and index % stride == 0 else {}
        _add_round(samples, taken, arms, reading, abba(index, list(range(arms)))[-1])
        now = clock()
        if index == 0 and nv is not None:  # NVML reads cost at most 2% of the rounds' time
            stride = max(1, math.ceil((now - asked) / (NVML_SHARE * max(asked - last, 1e-9))))
        longest, last = max(longest, now - last), now
        count = len(samples["nvml"])
        if count == 1:
            planned = planned_looks(count + int((budget_s - (now - started)) / max(longest, 1e-9)))
        if count == FIRST_LOOK << len(looks):
            looks.append(count)
            analysis = analyse(samples, look_level(planned))
            _progress(name, count, analysis, final=False)
            reason = stop(analysis)
            if reason:
                stopped_by = reason
                break
        if count >= MAX_ROUNDS:
            stopped_by = "max_rounds"
            break
        if now - started + 1.5 * longest > budget_s:
            break
    seconds = clock() - started
    count = len(samples["nvml"])
    if not looks or looks[-1] != count:  # a last look at whatever the budget left
        looks.append(count)
        analysis = analyse(samples, look_level(planned))
    assert analysis is not None
    return _Run(samples, analysis, looks, planned, stopped_by, seconds)


def _over_budget(budget_s: float, settle: dict[str, Any], rounds_s: float, rounds: int) -> dict[str, Any]:
    """Past the budget by a round (the first always runs; a later one can run long): the flag says
    by how much and what budget holds a verdict's rounds (``few_rounds``, which demotes, comes with it)."""
    settle_s = settle["seconds"]
    # The loop runs another round while the time spent and 1.5 rounds fit in the budget: FIRST_LOOK
    # rounds need the settle phase and FIRST_LOOK + 0.5 rounds. A settle phase cut off at its cap
    # runs to the larger cap a larger budget gives it, min(SETTLE_CAP_S, SETTLE_SHARE * budget),
    # and past it by up to a block.
    needed = (FIRST_LOOK + 0.5) * rounds_s / rounds
    if settle["steady"]:
        needed += settle_s
    else:
        needed += settle["block_s"]
        needed = min(needed / (1 - SETTLE_SHARE), needed + SETTLE_CAP_S)
    return {
        "name": "over_budget",
        "message": f"settling the clock took {settle_s:.3g} s and {rounds} round(s) {rounds_s:.3g} s, past "
        f"budget_s={budget_s:g}: scored on those; {FIRST_LOOK} rounds need budget_s of about "
        f"{_round_up(needed)}",
        "demotes": False,
    }


def _round_up(seconds: float) -> str:
    """``seconds`` to two significant digits, rounded up: a budget that falls short by rounding is no help."""
    step = 10.0 ** (math.floor(math.log10(seconds)) - 1)
    return f"{math.ceil(round(seconds / step, 6)) * step:.3g}"


def _stop(analysis: dict[str, Any], target_ci: float, correctness: dict[str, Any]) -> str | None:
    if correctness.get("before") == "fail":
        return "incorrect"  # no point spending the budget on a wrong answer
    verdict = analysis.get("verdict")
    if verdict is not None and verdict["outcome"] != "inconclusive":
        return "verdict"
    primary = analysis["ratio"] or analysis["latency"]
    return "target_ci" if primary["half_width"] <= target_ci else None


def _integrity(
    backend: Backend, call: Any, arms: list[_Arm], samples: dict[str, Any], analysis: Any, aa: bool
) -> list[dict[str, Any]]:
    launched = len(samples["values"][0]) * 2 * arms[0].calls * arms[0].per_call
    median = analysis["latency"]["median"] if analysis else None
    probe_launches = max(1, min(ESCAPE_PROBE_LAUNCHES, int(ESCAPE_PROBE_MS / median))) if median else 1
    ratio = analysis["ratio"]["median"] if analysis and analysis["ratio"] and not aa else None
    found = [
        integrity.host_clock_flag(backend.kind),
        integrity.launches_flag(launched),
        integrity.tamper_flag(backend.tamper()),
        integrity.escape_flag(backend.probe_escape(call, probe_launches)),
        integrity.speedup_flag(ratio),
    ]
    return [f for f in found if f is not None]


def _progress(
    name: str, rounds: int, analysis: Any, *, final: bool, score: report.Score | None = None
) -> None:
    if final and score is not None:
        progress.info("%s", score.line())
    elif analysis is not None and sys.stderr.isatty():
        progress.info("%s: look at %d rounds: %s", name, rounds, report.look_line(analysis))
