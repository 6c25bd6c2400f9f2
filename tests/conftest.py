"""Shared test setup: interpreter mode, isolated Triton state, and a clean interception.

``TRITON_INTERPRET=1`` is set here, at import, because Triton reads it when a kernel is decorated:
it must be in place before any test module imports a kernel module.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType

import pytest

os.environ["TRITON_INTERPRET"] = "1"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files whose tests start jobs of their own (``slow``, ``distributed``) come first.

    scripts/test.sh hands whole files to the xdist workers in this order (``--no-loadscope-reorder``;
    xdist would otherwise start with the files that hold the most tests). Long files first, short
    ones filling in at the end, lets both workers finish together: 26-53 s less on 2 cores.
    """
    starts_jobs = ("slow", "distributed")
    items.sort(key=lambda item: not any(item.get_closest_marker(name) for name in starts_jobs))


@pytest.fixture(autouse=True)
def _restore_environ() -> Iterator[None]:
    """Undo any change a test makes to ``os.environ`` (including ones made without monkeypatch).

    Each test also starts without the caller's ``MEGATRON_TUNING_*`` settings, so a developer's
    shell (say ``MEGATRON_TUNING_MODE=chaos``) cannot change what the suite checks.
    """
    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith("MEGATRON_TUNING_")]:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _fresh_triton_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Give each test its own Triton cache dir so no test reads another's compiled or tuned state."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton_cache")))


def _uninstall_interception() -> None:
    # Guarded: the interception (and the decision log) may not exist in every checkout state.
    try:
        from megatron_tuning.runtime import interception
    except ImportError:
        return
    if interception.installed():
        interception.uninstall()
    try:
        from megatron_tuning.core.decisions import decision_log

        decision_log().clear()
    except ImportError:
        pass
    try:
        from megatron_tuning.core.notices import reset_warnings

        reset_warnings()
    except ImportError:
        pass


@pytest.fixture(autouse=True)
def _no_interception_leak() -> Iterator[None]:
    """Guarantee every test starts and ends with stock Triton and an empty decision log."""
    _uninstall_interception()
    try:
        yield
    finally:
        _uninstall_interception()


class Notices:
    """The ``TuningWarning`` notices issued while the ``notices`` fixture is active."""

    def __init__(self, caught: list[warnings.WarningMessage]) -> None:
        self._caught = caught

    @property
    def messages(self) -> list[str]:
        from megatron_tuning.core.notices import TuningWarning

        return [str(w.message) for w in self._caught if issubclass(w.category, TuningWarning)]

    def matching(self, text: str) -> list[str]:
        return [m for m in self.messages if text in m]

    @property
    def text(self) -> str:
        return "\n".join(self.messages)

    def clear(self) -> None:
        self._caught.clear()


@pytest.fixture
def notices() -> Iterator[Notices]:
    """Record every warning the test issues (notices are ``TuningWarning``s, see ``core.notices``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield Notices(caught)


def _import_kernel_module(name: str) -> ModuleType:
    """Import a kernel module; on Triton 3.2/3.3 decoration needs the interception's lazy benchmarker.

    Stock ``Autotuner.__init__`` resolves the GPU benchmarker at decoration on those releases and
    fails with "0 active drivers" on CPU. A module is decorated once and cached in ``sys.modules``,
    so the lazy benchmarker only matters for the first import.
    """
    if name in sys.modules:
        return sys.modules[name]
    try:
        from megatron_tuning.runtime.interception import lazy_benchmarker
    except ImportError:
        return importlib.import_module(name)
    with lazy_benchmarker():
        return importlib.import_module(name)


@pytest.fixture
def import_kernel() -> Callable[[str], ModuleType]:
    """``import_kernel("megatron_tuning.kernels")`` -> the module, decorated safely on any Triton."""
    return _import_kernel_module
