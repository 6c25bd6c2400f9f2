"""The generated hit path (``runtime/fastpath.py``) launches what the class path launches: held to it by
one differential property test, then the behaviour users see of it (policies replaced while it serves,
a user's own ``run``, subclasses, compiled copies, threads, notices)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatron_tuning.core.decisions import decision_log, get_decisions
from megatron_tuning.core.errors import LaunchOptionError
from megatron_tuning.core.identity import config_data, kernel_id
from megatron_tuning.core.key import Key, tuning_key
from megatron_tuning.core.notices import reset_warnings
from megatron_tuning.core.policy import TuningPolicy
from megatron_tuning.runtime import fastpath, inductor, interception, pinning

from .. import support_kernels as sk
from ..support_kernels import grid

F32 = "torch.float32"
KEY_40 = Key({"n": 40}, {"x_ptr": F32, "y_ptr": F32, "out_ptr": F32})
BY_BLOCK = {c.kwargs["BLOCK_SIZE"]: c for c in sk.ADD_CONFIGS}


@pytest.fixture(autouse=True)
def _clean_state():
    decision_log().clear()
    reset_warnings()
    sk.scale_add.cache.clear()
    yield
    interception.uninstall()
    decision_log().clear()


# --------------------------------------------------------------------------- the differential test

_NAMES = ("x_ptr", "y_ptr", "out_ptr", "n", "alpha")


def _calls() -> st.SearchStrategy[tuple[tuple[Any, ...], dict[str, Any]]]:
    """scale_add calls: arguments positional, by keyword or left out; tensors of two dtypes, None or
    ints where pointers go; key values of every type the key tells apart. Mostly five positional
    arguments, the shape the generated ``run`` serves once armed."""
    tensor = st.sampled_from((torch.float32, torch.float16)).map(lambda dtype: torch.empty(1, dtype=dtype))
    pointer = st.one_of(tensor, tensor, st.none(), st.just(0))
    # Values equal in Python that the key keeps apart (0.0 and -0.0, (1, 2) and (1.0, 2.0)), NaN, a list.
    key_value = st.sampled_from(
        [8, 9, True, 1, 1.0, 8.0, "8", None, 0.0, -0.0, (1, 2), (1.0, 2.0), math.nan, [1, 2]]
    )
    values = st.tuples(pointer, pointer, pointer, key_value, st.sampled_from([0.5, 1]))

    def split(
        drawn: tuple[tuple[Any, ...], int, int, bool, dict[str, Any]],
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, count, dropped, shuffle, options = drawn
        passed = max(count, 5 - dropped)  # the last `dropped` arguments left out (their defaults)
        kwargs = {**dict(zip(_NAMES[count:passed], args[count:passed])), **options}
        if shuffle:
            kwargs = dict(reversed(kwargs.items()))
        return tuple(args[:count]), kwargs

    count = st.one_of(st.just(5), st.just(5), st.integers(0, 5))
    # Now and then a keyword the decided config also sets (refused, as by stock Triton) or one it
    # leaves unset (passed on).
    options = st.one_of(st.just({}), st.sampled_from(_OPTIONS))
    return st.tuples(values, count, st.sampled_from([0, 0, 1, 2]), st.booleans(), options).map(split)


_OPTIONS = ({"num_warps": 4}, {"num_warps": 8, "num_stages": 1}, {"BLOCK_SIZE": 16}, {"maxnreg": 64})


def _tuner(salt: int) -> Callable[..., Any]:
    """A "tuner" whose pick is a pure function of the key text and ``salt``: distinct keys (and a
    new installation) mostly get distinct configs, so a launch of another key's decision shows."""

    def measure(autotuner, candidates, args, kwargs, kernel, key):  # noqa: ANN001, ANN202
        return candidates[(sum(map(ord, key)) + salt) % len(candidates)], {}

    return measure


def _plain(value: Any) -> Any:
    return ("tensor", id(value)) if isinstance(value, torch.Tensor) else (type(value), value)


def _entered_the_class_path(launch: Callable[[], Any]) -> bool:
    entered: list[bool] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call" and code.co_name == "slow" and code.co_filename == fastpath.__file__:
            entered.append(True)

    sys.setprofile(profile)
    try:
        launch()
    finally:
        sys.setprofile(None)
    return bool(entered)


def _launch_all(actions: list[Any], *, fast_path: bool) -> tuple[list[Any], list[bool]]:
    """What every launch of ``actions`` (each made twice in a row) hands the kernel (``fn.run``'s
    arguments and options, the config's ``pre_hook`` arguments, ``best_config``), each its own
    key's decision; and for each repeat the generated ``run`` served, whether it launched it alone."""
    seen: list[Any] = []
    alone: list[bool] = []
    armed_by: tuple[bool, ...] | None = None  # which arguments had a dtype in the call that armed it
    decided: set[tuple[int, str]] = set()
    decision_log().clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sk.scale_add.fn, "run", lambda *a, **kw: seen.append(("run", a, sorted(kw.items()))))
        # A GPU backend's defaults (the interpreter has none), so launches leave some options out.
        patch.setattr(fastpath, "_launch_option_defaults", lambda: {"num_warps": 4, "num_ctas": 1})
        for config in sk.ADD_CONFIGS:
            hook = lambda nargs: seen.append(("pre_hook", sorted((k, _plain(v)) for k, v in nargs.items())))  # noqa: E731
            patch.setattr(config, "pre_hook", hook)
        try:
            for step, action in enumerate(actions):
                if isinstance(action, int):  # a new installation: its own decisions from now on
                    salt = action
                    policy = TuningPolicy(mode="tune", agreement="off")
                    interception.install(policy, measure=_tuner(salt), fast_path=fast_path)
                elif isinstance(action, str):  # replaced without an install, as a late attach does
                    salt = len(action) + step
                    pinning.set_active(
                        dataclasses.replace(pinning.active, measure=_tuner(salt), generation=-step)
                    )
                else:
                    args, kwargs = action
                    key = tuning_key(sk.scale_add, args, kwargs)
                    expected = sk.ADD_CONFIGS[(sum(map(ord, key)) + salt) % len(sk.ADD_CONFIGS)]
                    dtypes = tuple(hasattr(a, "dtype") for a in args)
                    # Any config's keyword is refused before the key is decided.
                    clashes = sorted({k for c in sk.ADD_CONFIGS for k in c.all_kwargs()} & kwargs.keys())
                    if not clashes:
                        decided.add((pinning.active.generation, key))
                    for repeat in (False, True):
                        served = fastpath.serving(sk.scale_add) is pinning.active
                        refused = pytest.raises(LaunchOptionError) if clashes else contextlib.nullcontext()
                        with refused as raised:
                            entered = _entered_the_class_path(
                                lambda a=args, k=kwargs: sk.scale_add[(1,)](*a, **k)
                            )
                        if raised is not None:  # refused, by either path alike
                            assert sorted(raised.value.options) == clashes
                            seen.append(("raised", str(raised.value)))
                            continue
                        assert sk.scale_add.best_config is expected  # its own key's decision
                        # Its shape: as many arguments, a dtype where the arming call had one.
                        shape = armed_by is not None and len(dtypes) == len(armed_by) and not kwargs
                        if repeat and served and shape and all(d for d, a in zip(dtypes, armed_by) if a):
                            alone.append(not entered)
                        if not served and fastpath.serving(sk.scale_add) is pinning.active:
                            armed_by = dtypes
        finally:
            interception.uninstall()
    assert len(get_decisions()) == len(decided)  # one decision per key and installation
    # Config.pre_hook gets every argument, the launch keywords and the config's, as on Triton's hit path.
    hooked = [dict(rest[0]) for kind, *rest in seen if kind == "pre_hook"]
    assert all(
        {"grid", "warmup", "BLOCK_SIZE", "num_warps", "num_stages"} <= nargs.keys() for nargs in hooked
    )
    return [(kind, *(_plain(v) if kind == "run" else v for v in rest)) for kind, *rest in seen], alone


_ARMING = ((torch.empty(1), torch.empty(1), torch.empty(1), 8, 0.5), {})


@settings(max_examples=200, deadline=None)
@given(
    salt=st.integers(0, 4),
    actions=st.lists(
        st.one_of(_calls(), _calls(), _calls(), st.integers(0, 4), st.sampled_from(["r", "rr"])), max_size=12
    ),
)
@example(salt=0, actions=[_ARMING, "r", _ARMING, 3, _ARMING])  # armed, then a new installation of either kind
def test_the_generated_path_launches_what_the_class_path_launches(salt, actions):
    actions = [salt, *actions]
    class_path, never = _launch_all(actions, fast_path=False)
    generated, alone = _launch_all(actions, fast_path=True)
    assert generated == class_path and never == []
    assert all(alone)  # a call of the shape it serves, repeated: launched without the class path
    if any(not isinstance(a, (int, str)) and not a[1] for a in actions):
        assert alone  # a call without keywords armed it


# --------------------------------------------------------------------------- what users see of it


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The BLOCK_SIZE of every launch that reaches ``scale_add``'s ``fn.run`` (the launch still runs)."""
    return sk.record_block_sizes(monkeypatch, (sk.scale_add.fn,))


def _policy(**changes: Any) -> TuningPolicy:
    changes.setdefault("on_miss", "min_cost")  # a key without an entry gets the cheapest config (8)
    return TuningPolicy(mode="deterministic", agreement="off", use_shipped_tables=False, **changes)


def _table(*entries: tuple[Key, int]) -> dict[tuple[str, str], Any]:
    return {(kernel_id(sk.scale_add), key): config_data(BY_BLOCK[block]) for key, block in entries}


def _scale_add(n: int = 40, kernel: Any = sk.scale_add) -> None:
    x, y, out = torch.randn(n), torch.randn(n), torch.full((n,), float("nan"))
    kernel[grid(n)](x, y, out, n, 0.5)
    torch.testing.assert_close(out, 0.5 * x + y)


def test_a_new_table_or_policy_is_launched_at_once(launched):
    for changes, table in (
        ({}, _table((KEY_40, 64))),
        ({}, _table((KEY_40, 128))),
        ({}, {}),
        ({"block_sizes": (("BLOCK_SIZE", 32),)}, {}),
    ):
        interception.install(_policy(**changes), table=table)
        _scale_add()
        _scale_add()  # the hit path
    assert launched == [64, 64, 128, 128, 8, 8, 32, 32]
    assert [d.source for d in get_decisions()] == ["table", "table", "cheapest", "override"]
    interception.uninstall()
    assert "run" not in sk.scale_add.__dict__  # stock Triton again, exactly


def test_a_late_attach_that_replaces_the_installation_keeps_every_pinned_key(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    replaced = dataclasses.replace(pinning.active)  # what session._LateAttach returns: same decisions
    pinning.before_decision.append(lambda installation: replaced)
    try:
        _scale_add(12)  # a new key: the hook runs inside the decision and replaces the installation
    finally:
        pinning.before_decision.clear()
    for _ in range(2):
        _scale_add()
    assert pinning.active is replaced and fastpath.serving(sk.scale_add) is replaced
    assert launched == [64, 8, 64, 64] and len(get_decisions()) == 2


def test_a_notice_decided_under_the_generated_run_points_at_the_users_line(launched):
    interception.install(_policy(on_miss="nearest"), table=_table((KEY_40, 64)))
    _scale_add()
    assert fastpath.serving(sk.scale_add) is pinning.active
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _scale_add(12)  # a miss, decided under the generated run
    (notice,) = caught
    assert "nearest shape" in str(notice.message) and notice.filename == __file__, notice


def test_a_users_own_instance_run_and_a_subclass_that_overrides_run_are_kept(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    calls: list[str] = []
    cls_run = interception.autotuner_class().run
    sk.scale_add.run = lambda *args, **kwargs: calls.append("own") or cls_run(sk.scale_add, *args, **kwargs)
    try:
        own = sk.scale_add.__dict__["run"]
        for _ in range(2):
            _scale_add()
        interception.install(_policy(), table=_table((KEY_40, 128)))
        _scale_add()
        assert sk.scale_add.__dict__["run"] is own
    finally:
        del sk.scale_add.run

    class Counting(interception.autotuner_class()):  # type: ignore[misc]
        def run(self, *args: Any, **kwargs: Any) -> Any:
            calls.append("subclass")
            return super().run(*args, **kwargs)

    twin = copy.copy(sk.scale_add)
    twin.__class__, twin.cache = Counting, {}
    for _ in range(2):
        _scale_add(kernel=twin)
    assert "run" not in twin.__dict__
    assert calls == ["own"] * 3 + ["subclass"] * 2 and launched == [64, 64, 128, 128, 128]


def test_torch_dynamo_reset_keeps_the_pin_and_a_new_installation_replaces_it(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    torch._dynamo.reset()
    _scale_add()
    interception.install(_policy(), table=_table((KEY_40, 128)))
    torch._dynamo.reset()
    _scale_add()
    _scale_add()
    assert launched == [64, 64, 128, 128]


def test_copies_for_compiled_code_launch_their_own_config_never_the_originals(launched):
    interception.install(_policy(), table=_table((KEY_40, 64)))
    _scale_add()
    twin = copy.copy(sk.scale_add)  # a shallow copy carries the state and the instance run along
    twin.configs = [BY_BLOCK[32]]
    inductor._mark_nested_copy(twin)  # how runtime/inductor.py marks a one-config copy it launches
    one = inductor._one_config_copy(sk.scale_add, BY_BLOCK[16])
    for kernel in (twin, twin, one, one, sk.scale_add):
        _scale_add(kernel=kernel)
    assert launched == [64, 32, 32, 16, 16, 64]


def _launch_only(n: int = 40) -> None:
    x = torch.empty(n)
    sk.scale_add[grid(n)](x, x, x, n, 0.5)


def _record_only(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``scale_add``'s ``fn.run`` records its BLOCK_SIZE and runs nothing: the interpreter itself is
    not thread-safe (it swaps ``tl`` builtins globally), the launch path above it is."""
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


def test_threads_launching_after_each_install_launch_that_installations_config(monkeypatch):
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


def test_threads_launching_while_another_installs_end_on_the_last_installation(monkeypatch):
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
    assert fastpath.serving(sk.scale_add) is pinning.active


def test_launch_options_leave_out_only_what_equals_the_backends_defaults():
    config = BY_BLOCK[16]  # num_warps=4
    defaults = {"num_warps": 4, "num_stages": config.num_stages + 1, "num_ctas": 1}
    options = fastpath.launch_options(config, defaults)
    assert options == {k: v for k, v in config.all_kwargs().items() if k not in ("num_warps", "num_ctas")}
    assert fastpath.launch_options(config) == config.all_kwargs()  # the interpreter: no defaults
