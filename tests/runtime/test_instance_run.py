"""The compiled instance ``run`` (``launches.compile_run``, ``pinning.arm``): the pinned hit path in
one frame, and every way it could launch a stale config.

Each test watches the config a launch really hands the kernel (``fn.run`` wrapped to record its
``BLOCK_SIZE``) and, where it matters, which path each launch took (``_paths``: the compiled
instance ``run``, the class-level ``run``, or the one falling back to the other), so a fast path
that launched an old record, or that was silently never taken, shows. Real kernels in the
interpreter; no mocks of Triton's autotuner.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from megatron_tuning.core.decisions import decision_log, get_decisions
from megatron_tuning.core.identity import config_data, kernel_id
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.runtime import inductor, interception, pinning
from megatron_tuning.runtime.launches import FAST_RUN_ATTR
from megatron_tuning.runtime.triton_compat import autotuner_class

from .. import support_kernels as sk
from ..support_kernels import grid

F32 = "torch.float32"
KEY_40 = f"n=40 | x_ptr:{F32}, y_ptr:{F32}, out_ptr:{F32}"
BY_BLOCK = {c.kwargs["BLOCK_SIZE"]: c for c in sk.ADD_CONFIGS}


def _policy(**changes: Any) -> TuningPolicy:
    changes.setdefault("on_miss", "min_cost")  # a key without an entry gets the cheapest config (8)
    return TuningPolicy(mode="deterministic", agreement="off", use_shipped_tables=False, **changes)


def _table(*entries: tuple[str, int]) -> dict[tuple[str, str], Any]:
    return {(kernel_id(sk.scale_add), key): config_data(BY_BLOCK[block]) for key, block in entries}


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The BLOCK_SIZE of every launch that reaches ``scale_add``'s or ``copy_hooked``'s ``fn.run``."""
    blocks = sk.record_block_sizes(monkeypatch, (sk.scale_add.fn, sk.copy_hooked.fn.fn))
    for kernel in (sk.scale_add, sk.copy_hooked):
        kernel.cache.clear()
    decision_log().clear()
    yield blocks
    interception.uninstall()


def _scale_add(n: int = 40, kernel: Any = sk.scale_add) -> None:
    x, y, out = torch.randn(n), torch.randn(n), torch.full((n,), float("nan"))
    kernel[grid(n)](x, y, out, n, 0.5)
    torch.testing.assert_close(out, 0.5 * x + y)


def _paths(launch: Callable[[], Any]) -> list[str]:
    """Which ``run`` each launch in ``launch()`` entered: "instance" (compiled) or "class" (ours)."""
    class_code = autotuner_class().__dict__["run"].__code__
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code.co_name == "run" and code.co_filename.startswith("<megatron_tuning launch "):
            seen.append("instance")
        elif code is class_code:
            seen.append("class")

    sys.setprofile(profile)
    try:
        launch()
    finally:
        sys.setprofile(None)
    return seen


def _serving(kernel: Any = sk.scale_add) -> Any:
    return pinning.serving(kernel.__dict__.get("run"))


# --------------------------------------------------------------------------- the path is taken


def test_the_first_pinned_launch_arms_the_instance_run_and_later_launches_take_it(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    assert _paths(_scale_add) == ["class"]  # the first launch decides, then arms
    assert _serving() is pinning.active
    assert _paths(_scale_add) == ["instance"]
    assert _paths(lambda: _scale_add(12)) == ["instance", "class"]  # a new key: decided by the class path
    assert _paths(lambda: _scale_add(12)) == ["instance"]  # ... and then served by the instance run
    assert launched == [64, 64, 8, 8] and len(get_decisions()) == 2


def test_calls_of_another_shape_fall_back_to_the_class_path_and_launch_the_same_record(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    x, y, out = torch.randn(40), torch.randn(40), torch.empty(40)
    assert _paths(lambda: sk.scale_add[grid(40)](x, y, out, n=40, alpha=0.5)) == ["instance", "class"]
    assert _paths(lambda: sk.scale_add[grid(40)](x, y, out, 40, alpha=0.5)) == ["instance", "class"]
    assert _paths(lambda: sk.scale_add.run(x, y, out, 40, 0.5, grid=grid(40), warmup=False)) == ["instance"]
    # No grid, or a launch option Triton's JIT takes: not the shape it serves.
    assert _paths(lambda: sk.scale_add.run(x, y, out, 40, 0.5, grid=grid(40), warmup=False, debug=False)) == [
        "instance",
        "class",
    ]
    errors = []
    for run in (sk.scale_add.run, functools.partial(autotuner_class().run, sk.scale_add)):
        with pytest.raises(Exception) as raised:  # the JIT's own error (TypeError on 3.9, KeyError on 3.3)
            run(x, y, out, 40, 0.5, warmup=False)
        errors.append((type(raised.value), str(raised.value)))
    assert errors[0] == errors[1] and "grid" in errors[0][1]
    assert launched == [64] * 7 and len(get_decisions()) == 1


def test_an_argument_without_the_dtype_the_first_call_had_falls_back(launched, monkeypatch):
    blocks: list[int] = []
    monkeypatch.setattr(sk.scale_add.fn, "run", lambda *a, **kw: blocks.append(kw["BLOCK_SIZE"]))
    table = _table((KEY_40, 64), (f"n=40 | x_ptr:{F32}, out_ptr:{F32}", 128))
    interception.install(_policy(), table=table)
    x, out = torch.randn(40), torch.empty(40)
    sk.scale_add[grid(40)](x, x, out, 40, 1.0)  # armed with y_ptr a tensor
    # y_ptr an int now (the kernel body does not run): the compiled key reads .dtype there, so
    # the class path finds this call its own key.
    assert _paths(lambda: sk.scale_add[grid(40)](x, 0, out, 40, 1.0)) == ["instance", "class"]
    assert _paths(lambda: sk.scale_add[grid(40)](x, 0, out, 40, 1.0)) == ["instance", "class"]
    assert _paths(lambda: sk.scale_add[grid(40)](x, x, out, 40, 1.0)) == ["instance"]
    assert blocks == [64, 128, 128, 64] and len(get_decisions()) == 2


def test_true_one_and_one_point_zero_keep_their_own_records_on_the_instance_run(launched, monkeypatch):
    blocks = _record_only(monkeypatch)
    key = f"n={{}} | x_ptr:{F32}, y_ptr:{F32}, out_ptr:{F32}"
    interception.install(
        _policy(), table=_table((key.format(1), 8), (key.format(True), 16), (key.format(1.0), 32))
    )
    x = torch.empty(1)
    paths = []
    for n in (1, True, 1.0, 1, True, 1.0, True):
        paths += _paths(lambda n=n: sk.scale_add[grid(1)](x, x, x, n, 0.5))
    assert blocks == [8, 16, 32, 8, 16, 32, 16] and len(get_decisions()) == 3
    assert paths[-4:] == ["instance"] * 4  # armed at n=1: every later repeat takes the instance run


@pytest.mark.parametrize(
    "policy",
    [
        TuningPolicy(mode="off", use_shipped_tables=False),
        TuningPolicy(mode="deterministic", agreement="off", scope=("some_other_package",)),
    ],
    ids=["mode-off", "out-of-scope"],
)
def test_off_and_out_of_scope_kernels_are_never_armed(launched, policy):
    interception.install(policy)
    for _ in range(2):
        _scale_add()
    assert "run" not in sk.scale_add.__dict__


def test_record_mode_is_never_armed(launched):
    interception.install(TuningPolicy(mode="record", agreement="off", use_shipped_tables=False))
    for _ in range(2):
        _scale_add()
    assert "run" not in sk.scale_add.__dict__
    assert [d.source for d in get_decisions()] == ["recorded"]


# --------------------------------------------------------------------------- it never goes stale


def test_a_new_table_or_policy_takes_the_instance_run_away_at_once(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    first = _serving()
    interception.install(_policy(), table=_table((KEY_40, 128)))  # same policy, another table
    assert "run" not in sk.scale_add.__dict__
    _scale_add()
    assert _serving() is pinning.active and _serving() is not first
    assert _paths(_scale_add) == ["instance"]
    interception.install(_policy(block_sizes=(("BLOCK_SIZE", 32),)))
    _scale_add()
    _scale_add()
    assert launched == [64, 128, 128, 32, 32]


def test_an_instance_run_put_back_after_its_installation_ended_launches_nothing_stale(launched):
    # What pytest's monkeypatch.undo, or any saved-and-restored attribute, would do.
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    stale = sk.scale_add.__dict__["run"]
    interception.install(_policy(), table=_table((KEY_40, 128)))
    sk.scale_add.__dict__["run"] = stale
    assert _paths(_scale_add) == ["instance", "class"]  # it checks the active installation itself
    assert _serving() is pinning.active  # ... and the class path armed the current one over it
    interception.uninstall()
    sk.scale_add.__dict__["run"] = stale
    try:
        _scale_add()  # stock Triton's run, through the fallback: it benchmarks, as stock does
    finally:
        sk.scale_add.__dict__.pop("run", None)
    assert launched == [64, 128, 8]


def test_uninstall_takes_the_instance_run_away(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    assert "run" in sk.scale_add.__dict__
    interception.uninstall()
    assert "run" not in sk.scale_add.__dict__ and "run" not in sk.copy_hooked.__dict__
    _scale_add()  # stock Triton: benchmarks every config (counting do_bench), launches the first
    assert launched == [64, 8]


def test_a_late_attach_that_replaces_the_installation_re_arms_for_the_new_one(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    before = pinning.active
    assert before is not None
    replaced = dataclasses.replace(before)  # what session._LateAttach returns: same decisions
    hook_calls: list[int] = []

    def attach(installation: pinning.Installation) -> pinning.Installation:
        hook_calls.append(1)
        return replaced

    pinning.before_decision.append(attach)
    try:
        _scale_add(12)  # a new key: the hook runs inside the decision and replaces the installation
    finally:
        pinning.before_decision.remove(attach)
    assert hook_calls == [1] and pinning.active is replaced and "run" not in sk.scale_add.__dict__
    assert _paths(_scale_add) == ["class"]  # the class path checks the record against the replacement
    assert _serving() is replaced  # ... and arms again, for it
    assert _paths(_scale_add) == ["instance"]
    assert launched == [64, 8, 64, 64] and len(get_decisions()) == 2  # a pinned key keeps its decision


def test_a_replacement_with_other_decisions_is_launched_not_the_old_instance_run(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    before = pinning.active
    assert before is not None
    other = dataclasses.replace(
        before, table=interception.as_config_table(_table((KEY_40, 128))), generation=before.generation + 1000
    )
    pinning.before_decision.append(lambda installation: other)
    try:
        _scale_add(12)
    finally:
        pinning.before_decision.clear()
    assert pinning.active is other
    _scale_add()  # decided again under the replacement: its table's config
    assert launched == [64, 8, 128]


def test_an_installation_that_changes_while_a_launch_is_being_armed_is_never_armed_for(launched, monkeypatch):
    compile_run = interception.compile_run

    def compile_then_reinstall(*args: Any, **kwargs: Any) -> Any:
        run = compile_run(*args, **kwargs)
        monkeypatch.setattr(interception, "compile_run", compile_run)
        interception.install(_policy(), table=_table((KEY_40, 128)))  # another thread, in effect
        return run

    interception.install(_policy(), table=_table((KEY_40, 64)))
    monkeypatch.setattr(interception, "compile_run", compile_then_reinstall)
    _scale_add()  # decided and launched under the first installation, armed for nothing
    assert "run" not in sk.scale_add.__dict__
    _scale_add()
    assert launched == [64, 128]


def test_a_copy_the_compiled_path_marks_as_pinned_launches_its_own_config(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    twin = copy.copy(sk.scale_add)  # a shallow copy carries the state and the instance run along
    assert "run" in twin.__dict__ and pinning.STATE_ATTR in twin.__dict__
    twin.configs = [BY_BLOCK[32]]
    inductor._mark_nested_copy(twin)  # how runtime/inductor.py marks a one-config copy it launches
    assert "run" not in twin.__dict__ and pinning.STATE_ATTR not in twin.__dict__
    _scale_add(kernel=twin)
    _scale_add(kernel=twin)
    _scale_add()  # the original keeps its own instance run
    assert _serving() is pinning.active
    assert launched == [64, 32, 32, 64]


def test_a_one_config_copy_for_compiled_code_carries_no_instance_run(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    one = inductor._one_config_copy(sk.scale_add, BY_BLOCK[16])
    assert "run" not in one.__dict__ and one.__dict__[pinning.PINNED_ATTR] is BY_BLOCK[16]
    for _ in range(2):
        _scale_add(kernel=one)
    assert "run" not in one.__dict__ and launched == [64, 16, 16]


def test_torch_dynamo_reset_keeps_the_pin_and_a_new_installation_replaces_it(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    torch._dynamo.reset()
    assert _paths(_scale_add) == ["instance"]
    interception.install(_policy(), table=_table((KEY_40, 128)))
    torch._dynamo.reset()
    _scale_add()
    _scale_add()
    assert launched == [64, 64, 128, 128]


# --------------------------------------------------------------------------- what every launch still does


def test_every_instance_run_launch_runs_the_pre_hook_with_the_same_arguments_as_the_class_path(launched):
    seen: list[dict[str, Any]] = []
    originals = [c.pre_hook for c in sk.copy_hooked.configs]
    for config in sk.copy_hooked.configs:
        config.pre_hook = lambda nargs, _seen=seen: _seen.append(dict(nargs))
    try:
        interception.install(_policy())
        x = torch.randn(64)
        paths = []
        for _ in range(3):
            out = torch.empty(64)
            paths += _paths(lambda out=out: sk.copy_hooked[grid(64)](x, out, 64))
            torch.testing.assert_close(out, x)
    finally:
        for config, hook in zip(sk.copy_hooked.configs, originals):
            config.pre_hook = hook
    assert paths == ["class", "instance", "instance"]
    assert [list(s) for s in seen[1:]] == [list(seen[0])] * 2  # the same names, in the same order
    assert all(s["x_ptr"] is x and s["n"] == 64 and s["BLOCK_SIZE"] == 32 for s in seen)
    assert sk.copy_hooked.best_config.pre_hook is not None


def test_fn_run_and_best_config_are_read_and_set_at_every_launch(launched, monkeypatch):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    _scale_add(12)
    assert sk.scale_add.best_config is BY_BLOCK[8]
    replaced: list[int] = []
    real = sk.scale_add.fn.run
    monkeypatch.setattr(
        sk.scale_add.fn, "run", lambda *a, **kw: replaced.append(kw["BLOCK_SIZE"]) or real(*a, **kw)
    )
    _scale_add()
    assert replaced == [64] and sk.scale_add.best_config is BY_BLOCK[64]


def test_an_instance_run_of_the_users_own_is_never_replaced_or_removed(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    calls: list[int] = []
    cls_run = autotuner_class().run

    def users_run(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return cls_run(sk.scale_add, *args, **kwargs)

    sk.scale_add.run = users_run
    try:
        for _ in range(2):
            _scale_add()
        assert sk.scale_add.__dict__["run"] is users_run
        interception.install(_policy(), table=_table((KEY_40, 128)))
        _scale_add()
        assert sk.scale_add.__dict__["run"] is users_run
    finally:
        del sk.scale_add.run
    assert calls == [1, 1, 1] and launched == [64, 64, 128]


def test_a_subclass_that_overrides_run_is_never_armed(launched):
    calls: list[int] = []

    class Counting(autotuner_class()):  # type: ignore[misc]
        def run(self, *args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return super().run(*args, **kwargs)

    twin = copy.copy(sk.scale_add)
    twin.__class__ = Counting
    twin.cache = {}
    interception.install(_policy(), table=_table((KEY_40, 64)))
    for _ in range(3):
        _scale_add(kernel=twin)
    assert "run" not in twin.__dict__ and calls == [1, 1, 1] and launched == [64, 64, 64]


def test_compiled_runs_are_marked_with_the_installation_they_serve(launched):
    interception.install(_policy())
    _scale_add()
    run = sk.scale_add.__dict__["run"]
    assert run.__dict__[FAST_RUN_ATTR] is pinning.active and pinning.serving(run) is pinning.active
    assert pinning.serving(lambda: None) is None and pinning.serving(None) is None


# --------------------------------------------------------------------------- threads


def _launch_only(n: int = 40) -> None:
    x = torch.empty(n)
    sk.scale_add[grid(n)](x, x, x, n, 0.5)


def _record_only(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``scale_add``'s ``fn.run`` records its BLOCK_SIZE and runs nothing: the interpreter itself
    is not thread-safe (it swaps ``tl`` builtins globally), the launch path above it is."""
    blocks: list[int] = []
    monkeypatch.setattr(sk.scale_add.fn, "run", lambda *a, **kw: blocks.append(kw["BLOCK_SIZE"]))
    return blocks


def _in_threads(count: int, work: Callable[[], None]) -> None:
    start = threading.Barrier(count)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            start.wait()
            work()
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors


def test_threads_launching_after_each_install_launch_that_installations_config(launched, monkeypatch):
    blocks = _record_only(monkeypatch)
    rounds = (64, 128, 32, 16, 64, 128)
    per_round: list[list[int]] = []
    for block in rounds:
        interception.install(_policy(), table=_table((KEY_40, block)))
        before = len(blocks)
        _in_threads(4, lambda: [_launch_only() for _ in range(50)])
        assert len(blocks) - before == 200
        per_round.append(sorted(set(blocks[before:])))
    assert per_round == [[b] for b in rounds]
    assert len(get_decisions()) == len(rounds)  # one decision per key and installation, across threads


def test_threads_launching_while_another_installs_end_on_the_last_installation(launched, monkeypatch):
    blocks = _record_only(monkeypatch)
    interception.install(_policy(), table=_table((KEY_40, 64)))
    stop = threading.Event()
    errors: list[BaseException] = []

    def launcher() -> None:
        try:
            while not stop.is_set():
                _launch_only()
        except BaseException as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=launcher) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for i in range(60):  # installs racing with decisions, arming and instance-run launches
            interception.install(_policy(), table=_table((KEY_40, (128, 64)[i % 2])))
        interception.install(_policy(), table=_table((KEY_40, 32)))
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    assert set(blocks) <= {64, 128, 32} and len(blocks) > 0
    assert {d.signature.split(",")[0] for d in get_decisions()} <= {f"BLOCK_SIZE={b}" for b in (64, 128, 32)}
    before = len(blocks)
    _in_threads(3, lambda: [_launch_only() for _ in range(5)])  # all after the last install returned
    assert blocks[before:] == [32] * 15
    assert _serving() is pinning.active
