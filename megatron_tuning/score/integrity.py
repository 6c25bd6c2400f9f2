"""Correctness and integrity flags, taken in the same pass as the timing: flags, not a sandbox.

Outputs are compared with the reference's before timing and again after, on fresh values written
into the same tensors (a result cached by address then shows). Each flag names what it saw; every
one of them demotes the result (the ``score`` command exits 4).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

RTOL = ATOL = 1e-2  # the default check: loose enough for bf16 GEMMs, tight enough to catch garbage
ESCAPE_RATIO, ESCAPE_MS = 1.5, 0.5  # wall > 1.5 x event time + 0.5 ms: work ran outside the timed stream
MAX_SPEEDUP = 10.0  # a candidate more than 10x faster than its reference is suspicious
MIN_LAUNCHES = 10  # fewer timed launches than this is not a measurement

Flag = dict[str, Any]
Check = Callable[[Any, Any], Any]


def flag(name: str, message: str) -> Flag:
    return {"name": name, "message": message, "demotes": True}


def demoted_verdict(
    outcome: str,
    reason: str,
    demoted: list[str],
    *,
    margin: float,
    delta: float,
    level: float,
    cycle_outcome: str | None,
    rounds_to_decide: int | None,
) -> dict[str, Any]:
    """A record's verdict: ``outcome``, unless a flag of ``demoted`` (their names, as the reason
    lists them) demotes it to inconclusive, the outcome it had kept in ``demoted_from``."""
    demotes = bool(demoted) and outcome != "inconclusive"
    if demotes:
        reason += f"; was {outcome}, demoted by {', '.join(demoted)}"
    return {
        "outcome": "inconclusive" if demoted else outcome,
        "demoted_from": outcome if demotes else None,
        "margin": margin,
        "delta": delta,
        "level": level,
        "reason": reason,
        "cycle_outcome": cycle_outcome,
        "rounds_to_decide": rounds_to_decide,
    }


def outputs_problem(output: Any, expected: Any, check: Check | str) -> str | None:
    """Why ``output`` fails the check against ``expected``; ``None`` when it passes. ``check``:
    ``"reference"`` (close within ``RTOL``/``ATOL``, element by element) or a callable returning truthy."""
    if callable(check):
        return (
            None if check(output, expected) else f"check {getattr(check, '__name__', check)!r} returned false"
        )
    if output is None:
        return "the candidate returned None: return its output, or pass check=<callable>"
    if isinstance(output, (tuple, list)) and isinstance(expected, (tuple, list)):
        if len(output) != len(expected):
            return f"{len(output)} outputs, the reference gave {len(expected)}"
        for i, (a, b) in enumerate(zip(output, expected)):
            problem = outputs_problem(a, b, check)
            if problem:
                return f"output {i}: {problem}"
        return None
    a, b = _array(output), _array(expected)
    if a.shape != b.shape:
        return f"shape {a.shape}, the reference's is {b.shape}"
    close = np.isclose(a, b, rtol=RTOL, atol=ATOL, equal_nan=True)
    if close.all():
        return None
    worst = float(np.nanmax(np.abs(a - b)))
    return f"{int((~close).sum())} of {close.size} elements differ (largest difference {worst:.4g})"


def _array(value: Any) -> np.ndarray:
    detach = getattr(value, "detach", None)
    if detach is not None:  # a torch tensor: compare in float64 on the host
        value = detach().float().cpu().numpy()
    return np.asarray(value, dtype=np.float64)


def refill(inputs: Any, fresh: Any) -> bool:
    """Copy ``fresh`` values into the tensors of ``inputs`` in place (same addresses, new contents);
    whether any tensor was refilled."""
    pairs = zip(inputs, fresh) if isinstance(inputs, (tuple, list)) else [(inputs, fresh)]
    done = False
    for old, new in pairs:
        if hasattr(old, "copy_") and getattr(old, "shape", None) == getattr(new, "shape", None):
            old.copy_(new)
            done = True
    return done


def escape_flag(probe: tuple[float, float] | None) -> Flag | None:
    if probe is None:
        return None
    event_ms, wall_ms = probe
    if wall_ms <= ESCAPE_RATIO * event_ms + ESCAPE_MS:
        return None
    return flag(
        "work_escapes_stream",
        f"the timed stream's events saw {event_ms:.3f} ms but the device was busy {wall_ms:.3f} ms: "
        "the candidate runs work on another stream (or device) that its timing does not include",
    )


def tamper_flag(problem: str | None) -> Flag | None:
    return None if problem is None else flag("timer_patched", f"{problem}; the score reads CUDA's own")


def speedup_flag(ratio: float | None) -> Flag | None:
    if ratio is None or ratio * MAX_SPEEDUP >= 1:
        return None
    return flag(
        "implausible_speedup",
        f"the candidate takes {ratio:.3g}x the reference's time (over {MAX_SPEEDUP:g}x faster): check "
        "that it does the same work",
    )


def launches_flag(launches: int) -> Flag | None:
    if launches >= MIN_LAUNCHES:
        return None
    return flag(
        "few_launches",
        f"the budget timed {launches} launches of the candidate (fewer than {MIN_LAUNCHES}): raise budget_s",
    )


def host_clock_flag(kind: str) -> Flag | None:
    if kind != "host-clock":
        return None
    return flag(
        "host_clock", "timed with the host clock (no GPU, or the Triton interpreter): not a GPU score"
    )


def bind(fn: Callable[..., Any], inputs: Any) -> Callable[[], Any]:
    """``fn`` called on ``inputs``: a tuple or list as arguments, a dict as keywords, else one argument."""
    if inputs is None:
        return fn
    if isinstance(inputs, dict):
        return lambda: fn(**inputs)
    if isinstance(inputs, (tuple, list)):
        return lambda: fn(*inputs)
    return lambda: fn(inputs)


def _flat(inputs: Any) -> list[Any]:
    if isinstance(inputs, dict):
        return list(inputs.values())
    return list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]


def _snapshot(value: Any) -> Any:
    """A copy of an output that later launches cannot overwrite (tensors cloned)."""
    if isinstance(value, (tuple, list)):
        return type(value)(_snapshot(v) for v in value)
    return value.detach().clone() if hasattr(value, "detach") else value


def check_before(fn: Any, reference: Any, inputs: Any, check: Any) -> dict[str, Any]:
    """Run candidate and reference once on the same inputs (this compiles them) and compare."""
    output = _snapshot(bind(fn, inputs)())
    expected = _snapshot(bind(reference, inputs)()) if reference is not None else None
    if check is None:
        unchecked: str | None = "check=None"
    elif callable(check):
        unchecked = None
    elif reference is None:
        unchecked = "no reference to compare with"
    else:
        unchecked = "no outputs (both returned None)" if output is None and expected is None else None
    if unchecked:
        return {"checked": False, "before": None, "after": None, "message": unchecked}
    problem = outputs_problem(output, expected, check)
    return {"checked": True, "before": "fail" if problem else "pass", "after": None, "message": problem}


def check_after(
    fn: Any,
    reference: Any,
    make_inputs: Any,
    inputs: Any,
    check: Any,
    before: dict[str, Any],
    flags: list[Any],
) -> dict[str, Any]:
    """After timing: fresh values written into the same tensors, checked again (a candidate that
    cached its result by address now returns the old one)."""
    if not before["checked"] or make_inputs is None or not refill(_flat(inputs), _flat(make_inputs())):
        return {}
    output = _snapshot(bind(fn, inputs)())
    expected = _snapshot(bind(reference, inputs)()) if reference is not None else None
    problem = outputs_problem(output, expected, check)
    if problem and before["before"] == "pass":
        why = "right before timing, wrong on fresh values at the same addresses after it (cached by pointer?)"
        flags.append(flag("stale_output", f"{why}: {problem}"))
    message = before["message"] or (f"after timing, on fresh values: {problem}" if problem else None)
    return {"after": "fail" if problem else "pass", "message": message}
