"""Numbered tuning sessions: ranks compare configs only within the same session number.

Every ``start_agreement`` (one per ``init_deterministic_tuning`` that checks) starts this
process's next session, and the agreement keys of session *n* live under ``e<n>``. A rank that
calls ``init_deterministic_tuning`` once more than the others is then one session ahead for the
rest of the job, and its checks meet nobody: in ``store`` mode they pass silently, in
``allgather`` mode each rank waits for the other. Each rank therefore publishes, in the job's
store and without any collective:

* its current session number (``rank/<r>``), read only when something is already wrong: an
  ``allgather`` wait that a rank has left for a later session fails at once, and a timeout names
  each missing rank's session instead of calling it missing;
* the policy each session number was started with (``e<n>/policy``, first writer wins): a rank
  whose session *n* was started with another mode, scope, miss rule or agreement mode raises
  ``SessionMismatchError`` at ``init_deterministic_tuning``, and the rank it disagrees with raises
  the same error at its next check.

``verify_agreement`` compares the session numbers themselves (it is a collective anyway), which
also catches ranks whose extra session had the same policy. Only plain text crosses ranks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..core.errors import AgreementTimeoutError, SessionMismatchError

SESSION_KIND = "session"
"""``kind`` of a session mismatch recorded in a session's divergence flag."""


def policy_summary(policy: Any) -> str:
    """The policy fields every rank's session of one number must share (tables may differ by path)."""
    scope = ",".join(getattr(policy, "scope", ()) or ()) or "all"
    blocks = ",".join(f"{k}={v}" for k, v in getattr(policy, "block_sizes", ()) or ()) or "-"
    return (
        f"mode={getattr(policy, 'mode', '?')} agreement={getattr(policy, 'agreement', '?')} "
        f"scope={scope} on_miss={getattr(policy, 'on_miss', '?')} block_sizes={blocks}"
    )


class SessionRegistry:
    """This rank's session in the job's store: published at start, consulted when checks go wrong."""

    def __init__(self, store: Any, rank: int, number: int, summary: str) -> None:
        self.store = store
        self.rank = rank
        self.number = number
        self.summary = summary

    def describe(self, number: int | None = None, summary: str | None = None) -> str:
        if number is None:
            return "no session yet"
        text = f"session #{number}"
        return f"{text} ({summary})" if summary else text

    def register(self) -> SessionMismatchError | None:
        """Publish this session; the error when another rank started this number differently."""
        self.store.set(f"rank/{self.rank}", str(self.number))
        mine = f"{self.rank}\n{self.summary}"
        first = bytes(self.store.compare_set(f"e{self.number}/policy", "", mine)).decode("utf-8", "replace")
        first_rank, _, first_summary = first.partition("\n")
        if first_summary == self.summary:
            return None
        return SessionMismatchError(
            f"the start of session #{self.number}",
            {
                int(first_rank): self.describe(self.number, first_summary),
                self.rank: self.describe(self.number, self.summary),
            },
        )

    def session_of(self, rank: int) -> int | None:
        """The session ``rank`` last started (``None``: none yet, or never published)."""
        key = f"rank/{rank}"
        if not self.store.check([key]):  # ``get`` would block on a missing key
            return None
        try:
            return int(bytes(self.store.get(key)).decode())
        except ValueError:
            return None

    def fail_if_moved_on(self, missing: Sequence[int], what: str) -> None:
        """During a wait: a missing rank already in a later session will never arrive here."""
        ahead = {r: n for r in missing if (n := self.session_of(r)) is not None and n > self.number}
        if ahead:
            raise self._mismatch(what, ahead)

    def explain_timeout(self, error: AgreementTimeoutError, what: str) -> SessionMismatchError | None:
        """A timeout whose missing ranks are in other sessions is a session mismatch, not a slow rank."""
        elsewhere = {
            r: n for r in error.missing_ranks if (n := self.session_of(r)) is not None and n != self.number
        }
        return self._mismatch(what, elsewhere) if elsewhere else None

    def _mismatch(self, what: str, others: dict[int, int]) -> SessionMismatchError:
        sessions = {r: self.describe(n) for r, n in others.items()}
        sessions[self.rank] = self.describe(self.number, self.summary)
        return SessionMismatchError(what, sessions)


def mismatch_record(error: SessionMismatchError) -> str:
    """``error`` as the plain-text record a session's divergence flag holds."""
    return json.dumps(
        {
            "kind": SESSION_KIND,
            "what": error.what,
            "sessions": {str(r): s for r, s in error.sessions.items()},
        },
        sort_keys=True,
    )


def mismatch_from_record(data: dict[str, Any]) -> SessionMismatchError:
    return SessionMismatchError(data["what"], {int(r): s for r, s in data["sessions"].items()})


def compare_session_numbers(numbers: dict[int, int], what: str) -> None:
    """Raise ``SessionMismatchError`` when ranks report different session counts (``verify``)."""
    if len(set(numbers.values())) > 1:
        raise SessionMismatchError(
            what, {rank: f"session #{n}" if n else "no checked session" for rank, n in numbers.items()}
        )
