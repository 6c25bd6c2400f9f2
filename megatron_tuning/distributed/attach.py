"""A session started before ``init_process_group`` joins the group once it exists (docs/agreement.md).

It attaches at the first of: its first new (kernel, key) (``pinning.before_decision``), a
``verify_agreement()`` call (``agreement.before_verify``), its close. Attaching claims the session's
inputs, starts its checks (and ``auto``'s shared decisions) and checks the decisions made before.
A launch of a key already pinned never attaches: that is the generated fast path, which has no hook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from typing import Any

from ..core.decisions import get_decisions
from ..core.identity import current_rank, group_exists
from ..core.notices import warn_once
from ..core.policy import TuningPolicy
from ..runtime import pinning
from . import agreement
from .inputs import compares_keys, describe_inputs

logger = logging.getLogger(__name__)


class LateAttach:
    """Attaches one session (``policy``, ``table``) to ``group`` once the process group exists. If that
    fails, ``agreement`` is a ``FailedAgreement``: each later new key and check raises the same error,
    so the rank never runs on unchecked or, in ``auto``, unshared."""

    def __init__(self, policy: TuningPolicy, table: Any, group: Any, world_size: int) -> None:
        self.policy, self.table, self.group, self.world_size = policy, table, group, world_size
        self.first_decision = len(get_decisions())  # the log is per process: ours start here
        self.agreement: agreement.Agreement | None = None  # the session's checks once attached
        self.attached = False
        self.error: Exception | None = None
        self._lock = threading.Lock()
        if world_size > 1:
            logger.info(
                "megatron_tuning: no process group yet (WORLD_SIZE=%d): the %s start at the first new "
                "kernel key launched after init_process_group, at verify_agreement() or at close",
                world_size,
                _what_attaches(policy),
            )
        pinning.before_decision.append(self)
        agreement.before_verify.append(self.attach_now)

    def __call__(self, installation: pinning.Installation) -> pinning.Installation:
        """At a new key: attach, checking the earlier decisions now (a divergence raises here)."""
        if self.attached or not group_exists():
            return installation
        with self._lock:
            if self.error is not None:
                raise self.error
            return installation if self.attached else self._attach(installation, defer=False)

    def attach_now(self) -> None:
        """At ``verify_agreement`` and at close: attach if the group exists. The earlier decisions wait
        for that check's flush, and a failed attach for its ``FailedAgreement``: both raise after the
        check's collective, so no other rank waits for this one."""
        if self.attached or self.error is not None or not group_exists():
            return
        with self._lock:
            if not self.attached and self.error is None:
                with contextlib.suppress(Exception):  # kept in self.agreement, raised at the check
                    self._attach(pinning.active, defer=True)

    def finish(self) -> None:
        """At close: attach if the group exists; else say, on this rank, which checks never ran."""
        self.attach_now()
        self._unregister()
        done = self.attached or self.error is not None  # a failed attach raises at its checks
        if done or self.world_size <= 1 or not _expects_checks(self.policy):
            return
        unchecked = [d for d in get_decisions()[self.first_decision :] if d.source != "out_of_scope"]
        if unchecked:
            warn_once(
                ("late_attach_never", os.getpid()),
                "megatron_tuning: the %s never ran in this process (rank %d of WORLD_SIZE=%d): no "
                "process group existed at any of its %d kernel decisions, nor at its close. Create the "
                "process group before the first launch of an autotuned kernel, or call "
                "megatron_tuning.verify_agreement() on every rank once it exists.",
                _what_attaches(self.policy),
                current_rank(),
                self.world_size,
                len(unchecked),
                rank_local=True,  # only this rank knows: another rank's group may have come in time
            )

    def _attach(self, installation: Any, *, defer: bool) -> Any:
        policy, attached = self.policy, installation
        try:
            if policy.mode == "auto" and installation is not None:  # it started without the job's consensus
                from .store import start_consensus

                attached = dataclasses.replace(installation, consensus=start_consensus())
            inputs = describe_inputs(policy, self.table)
            checker = agreement.start_agreement(policy, self.group, inputs=inputs)
        except Exception as error:
            self.error = error
            self.agreement = agreement.FailedAgreement(error, policy, self.group)
            if not defer:  # at a new key: raised to the launch's caller now
                self.agreement.note(error)
            raise
        self.agreement, self.attached = checker, True
        self._unregister()
        if attached is not installation:
            pinning.set_active(attached, replacing=installation)  # before a check below can raise
        earlier = get_decisions()[self.first_decision :]
        logger.info(
            "megatron_tuning: attached to the process group (rank %d); checking %d earlier decision(s)",
            current_rank(),
            len(earlier),
        )
        for decision in earlier:
            if checker is not None:  # ``None`` only where the group was destroyed meanwhile
                checker.check(decision, defer=defer)
        return attached

    def _unregister(self) -> None:
        with contextlib.suppress(ValueError):
            pinning.before_decision.remove(self)
        with contextlib.suppress(ValueError):
            agreement.before_verify.remove(self.attach_now)


def _expects_checks(policy: TuningPolicy) -> bool:
    """Whether the policy asked for something beyond the inputs check: per-key checks or ``auto``."""
    return policy.mode == "auto" or compares_keys(policy)


def _what_attaches(policy: TuningPolicy) -> str:
    checks = "agreement check" if policy.agreement != "off" else ""
    shared = "auto mode's shared decisions" if policy.mode == "auto" else ""
    return " and ".join(p for p in (checks, shared) if p) or "cross-rank checks"
