"""init_deterministic_tuning as a single-process user calls it: env policy, tables, outputs."""

from __future__ import annotations

import logging

import pytest
import torch
from triton.runtime.autotuner import Autotuner

import megatron_tuning
from megatron_tuning.core.errors import PolicyError
from megatron_tuning.core.identity import config_data, config_signature, kernel_id
from megatron_tuning.core.key import Key
from megatron_tuning.runtime import interception
from megatron_tuning.tables.entry import Entry
from megatron_tuning.tables.records import read_decisions, recording_path
from megatron_tuning.tables.table import Table, load_table, save_table

from . import support_kernels as sk
from .support_kernels import grid

KEY_30 = Key({"n": 30}, dict.fromkeys(("x_ptr", "y_ptr", "out_ptr"), "torch.float32"))


@pytest.fixture(autouse=True)
def _fresh_kernels():
    sk.BENCH_CALLS.clear()
    sk.scale_add.cache.clear()
    yield
    sk.scale_add.cache.clear()


def _launch(n: int = 30) -> None:
    x, y = torch.randn(n), torch.randn(n)
    out = torch.empty(n)
    sk.scale_add[grid(n)](x, y, out, n, 2.0)
    torch.testing.assert_close(out, 2.0 * x + y)


def _table_pinning(path, config) -> None:  # noqa: ANN001
    table = Table()
    table.add(Entry(arch="unknown", kernel=kernel_id(sk.scale_add), key=KEY_30, config=config_data(config)))
    save_table(table, path)


def test_env_table_pins_and_close_restores_triton(tmp_path, monkeypatch, caplog):
    table_path = tmp_path / "pins.msgpack"
    _table_pinning(table_path, sk.ADD_CONFIGS[2])
    monkeypatch.setenv("MEGATRON_TUNING_TABLE", str(table_path))
    monkeypatch.setenv("MEGATRON_TUNING_ON_MISS", "error")
    original_run = Autotuner.__dict__["run"]
    with (
        caplog.at_level(logging.INFO, logger="megatron_tuning"),
        megatron_tuning.init_deterministic_tuning() as handle,
    ):
        assert handle.policy.mode == "deterministic" and interception.installed()
        _launch(30)
        with pytest.raises(megatron_tuning.TableMissError, match="n=31"):
            _launch(31)
    assert Autotuner.__dict__["run"] is original_run and not interception.installed()
    decision = megatron_tuning.get_decisions()[0]
    assert (decision.source, decision.origin) == ("table", str(table_path))
    assert decision.signature == config_signature(sk.ADD_CONFIGS[2])
    assert sk.BENCH_CALLS == []
    started = [r.getMessage() for r in caplog.records if r.getMessage().startswith("megatron_tuning: mode=")]
    assert len(started) == 1 and str(table_path) in started[0]


def test_decision_log_is_written_per_rank_at_close(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    log = tmp_path / "decisions-{rank}.json"
    handle = megatron_tuning.init_deterministic_tuning(megatron_tuning.TuningPolicy(decision_log=str(log)))
    _launch(30)
    handle.close()
    handle.close()  # idempotent
    (decision,) = read_decisions(tmp_path / "decisions-3.json")
    assert decision.rank == 3 and decision.key == KEY_30 and decision.source == "cheapest"


def test_record_mode_writes_this_ranks_recording(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    policy = megatron_tuning.TuningPolicy(mode="record", record_dir=str(tmp_path))
    with megatron_tuning.init_deterministic_tuning(policy):
        _launch(30)
    assert len(sk.BENCH_CALLS) == len(sk.ADD_CONFIGS)  # Triton tuned as usual
    (entry,) = list(load_table(recording_path(tmp_path, 1)))
    assert entry.how == "recorded" and entry.key == KEY_30
    assert config_signature(entry.config) == config_signature(sk.scale_add.best_config)


def test_record_mode_without_a_record_dir_says_where_the_winners_are(notices):
    with megatron_tuning.init_deterministic_tuning(megatron_tuning.TuningPolicy(mode="record")):
        _launch(30)
    (notice,) = notices.matching("without a record_dir")
    assert "MEGATRON_TUNING_RECORD_DIR" in notice and "only in the decision log" in notice


def test_print_decisions_prints_each_decision_of_its_session(capfd):
    policy = megatron_tuning.TuningPolicy(print_decisions=True, use_shipped_tables=False)
    with megatron_tuning.init_deterministic_tuning(policy):
        _launch(30)
    line = f"megatron_tuning: rank 0: {kernel_id(sk.scale_add)} [{KEY_30}] -> "
    assert line in capfd.readouterr().err
    with megatron_tuning.init_deterministic_tuning(policy.replace(print_decisions=False)):
        _launch(31)
    assert "megatron_tuning: rank 0:" not in capfd.readouterr().err


def test_close_at_exit_runs_the_launchers_hooks_after_the_close(monkeypatch):
    from megatron_tuning import session

    ran = []
    handle = megatron_tuning.init_deterministic_tuning(megatron_tuning.TuningPolicy(use_shipped_tables=False))
    monkeypatch.setattr(session, "exit_hooks", [lambda: ran.append(handle.closed)])
    session.close_at_exit()
    assert ran == [True]


class _Reads(dict):
    """``os.environ`` as a dict that records every variable read."""

    def __init__(self, env) -> None:  # noqa: ANN001
        super().__init__(env)
        self.names: list[str] = []

    def get(self, key, default=None):  # noqa: ANN001, ANN201
        self.names.append(key)
        return super().get(key, default)

    def __getitem__(self, key):  # noqa: ANN001, ANN204
        self.names.append(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:  # noqa: ANN001
        self.names.append(key)
        return super().__contains__(key)

    def __iter__(self):  # noqa: ANN204
        self.names.append("<all of them>")
        return super().__iter__()


@pytest.mark.parametrize("mode", ["deterministic", "auto"])
def test_a_session_of_a_policy_built_in_code_reads_no_variable(tmp_path, monkeypatch, notices, mode):
    """The policy is the whole input. Before, the table search path, the auto cache, the tuner and
    the decision log read MEGATRON_TUNING_* variables beside it."""
    import os

    reads = _Reads(os.environ)
    monkeypatch.setattr(os, "environ", reads)
    policy = megatron_tuning.TuningPolicy(
        mode=mode, cache=str(tmp_path / "auto.msgpack"), tune_rounds=1, decision_log=str(tmp_path / "d.json")
    )
    with megatron_tuning.init_deterministic_tuning(policy):
        _launch(30)
    assert [d.source for d in megatron_tuning.get_decisions()] == [{"auto": "tuned"}.get(mode, "cheapest")]
    assert [name for name in reads.names if "MEGATRON_TUNING_" in name or name.startswith("<")] == []


def test_second_init_replaces_the_first(tmp_path):
    first = megatron_tuning.init_deterministic_tuning(megatron_tuning.TuningPolicy())
    second = megatron_tuning.init_deterministic_tuning(megatron_tuning.TuningPolicy(mode="chaos"))
    assert first.closed and not second.closed
    assert interception.current_policy().mode == "chaos"
    second.close()
    assert not interception.installed()


def test_bad_environment_installs_nothing(monkeypatch):
    monkeypatch.setenv("MEGATRON_TUNING_ON_MISS", "sometimes")
    with pytest.raises(PolicyError, match="MEGATRON_TUNING_ON_MISS"):
        megatron_tuning.init_deterministic_tuning()
    assert not interception.installed()


def test_corrupt_table_file_is_a_clear_error_and_installs_nothing(tmp_path, monkeypatch):
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(b"\x93not a table")
    monkeypatch.setenv("MEGATRON_TUNING_TABLE", str(bad))
    with pytest.raises(megatron_tuning.TableError, match="bad.msgpack"):
        megatron_tuning.init_deterministic_tuning()
    assert not interception.installed()


def test_mamba_variable_warns_when_mode_is_off(monkeypatch, notices):
    monkeypatch.setenv("MAMBA_DETERMINISTIC", "1")
    megatron_tuning.init_deterministic_tuning(megatron_tuning.TuningPolicy(mode="off")).close()
    assert any("MAMBA_DETERMINISTIC" in m for m in notices.messages)


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda tmp: tmp / "missing" / "d-{rank}.json", "does not exist"),
        (lambda tmp: tmp, "is a folder"),
        (lambda tmp: tmp / "fifo", "FIFO"),
    ],
)
def test_a_bad_decision_log_path_fails_at_init_naming_the_variable(tmp_path, monkeypatch, make, problem):
    import os

    os.mkfifo(tmp_path / "fifo")
    monkeypatch.setenv("MEGATRON_TUNING_DECISION_LOG", str(make(tmp_path)))
    with pytest.raises(PolicyError, match="MEGATRON_TUNING_DECISION_LOG") as info:
        megatron_tuning.init_deterministic_tuning()
    assert problem in str(info.value) and ".tmp" not in str(info.value)
    assert not interception.installed()


def test_a_record_dir_that_is_a_file_fails_at_init(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("MEGATRON_TUNING_MODE", "record")
    monkeypatch.setenv("MEGATRON_TUNING_RECORD_DIR", str(blocker / "sub"))
    with pytest.raises(PolicyError, match="MEGATRON_TUNING_RECORD_DIR") as info:
        megatron_tuning.init_deterministic_tuning()
    assert "not a folder" in str(info.value) and not interception.installed()


# -- what a new user sees on stderr, with no logging or warnings setup (issue 17 items 2, 3) --
_FIRST_RUN = """
import torch, megatron_tuning
from tests import support_kernels as sk
handle = megatron_tuning.init_deterministic_tuning()
for _ in range(2):
    for n in (7, 100, 257):
        x = torch.zeros(n)
        sk.scale_add[sk.grid(n)](x, x, torch.empty(n), n, 1.0)
handle.close()
"""


def _fresh_process(script: str, tmp_path, **env: str):  # noqa: ANN001, ANN003, ANN202
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_TUNING_", "PYTHONWARNINGS"))}
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={**base, "PYTHONPATH": str(repo), "TRITON_INTERPRET": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_first_deterministic_run_says_once_that_it_fell_back_and_how_often(tmp_path):
    result = _fresh_process(_FIRST_RUN, tmp_path, MEGATRON_TUNING_TABLES=str(tmp_path / "t.msgpack"))
    assert result.returncode == 0, result.stderr[-3000:]
    err = result.stderr
    assert (
        err.count("TuningWarning: megatron_tuning: kernel tests.support_kernels:scale_add has no tuned") == 1
    )
    assert "12-14% of the best config" in err and "MEGATRON_TUNING_MODE=auto" in err
    assert "3 keys of 1 kernel(s) launched the cheapest config" in err  # at close
    assert err.count("MEGATRON_TUNING_TABLES is set but is not a megatron_tuning setting") == 1
    assert "Did you mean MEGATRON_TUNING_TABLE?" in err


def test_a_first_auto_run_on_cpu_says_it_times_with_the_host_clock_and_shows_each_key(tmp_path):
    # The application's logging keeps the progress lines (docs/policy.md); the notice needs nothing.
    progress = "megatron_tuning.tuning.tuner.progress"
    logging_setup = (
        "import logging; logging.basicConfig(format='%(levelname)s %(name)s: %(message)s')\n"
        f"logging.getLogger({progress!r}).setLevel('INFO')\n"
    )
    result = _fresh_process(
        logging_setup + _FIRST_RUN,
        tmp_path,
        MEGATRON_TUNING_MODE="auto",
        MEGATRON_TUNING_CACHE=str(tmp_path / "auto.msgpack"),
        MEGATRON_TUNING_TUNE_ROUNDS="1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    err = result.stderr
    assert err.count("tuning times candidates with the host clock") == 1  # once, not per key
    tuned = [line for line in err.splitlines() if "INFO megatron_tuning.tuning.tuner.progress: tuned" in line]
    assert len(tuned) == 3 and "tuned tests.support_kernels:scale_add [n=7 | x_ptr:torch.float32" in tuned[0]
    assert "has no tuned config" not in err  # auto tuned every key: no fallback to report


def _fake_gpus(monkeypatch, capability: dict[int, tuple[int, int]], current=None) -> None:  # noqa: ANN001
    """A node of ``capability`` GPUs; ``current`` None: reading the current device fails the test."""

    def current_device() -> int:
        if current is None:
            raise AssertionError("init read torch.cuda.current_device() (device 0 before set_device)")
        return current

    monkeypatch.delenv("TRITON_INTERPRET")  # arch reads return "unknown" early under the interpreter
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capability))
    monkeypatch.setattr(torch.cuda, "current_device", current_device)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability[index])
    monkeypatch.setattr(torch.version, "hip", None, raising=False)


def test_auto_init_files_the_default_cache_by_the_nodes_arch_without_the_current_device(
    tmp_path, monkeypatch, notices
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("MEGATRON_TUNING_CACHE", raising=False)
    _fake_gpus(monkeypatch, {0: (9, 0), 1: (9, 0)})
    with megatron_tuning.init_deterministic_tuning(megatron_tuning.TuningPolicy(mode="auto")) as handle:
        assert handle.cache.path == str(tmp_path / "xdg" / "megatron_tuning" / "sm90" / "auto.msgpack")
    assert not notices.matching("more than one arch")


@pytest.mark.parametrize("rank", ["0", "1"])  # its node's GPUs: rank 0's node may hold one arch
def test_auto_init_on_a_mixed_node_uses_the_current_device_and_says_how_to_be_sure(
    tmp_path, monkeypatch, notices, rank
):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("MEGATRON_TUNING_CACHE", raising=False)
    _fake_gpus(monkeypatch, {0: (8, 0), 1: (9, 0)}, current=1)
    with megatron_tuning.init_deterministic_tuning(megatron_tuning.TuningPolicy(mode="auto")) as handle:
        assert handle.cache.path.endswith("/sm90/auto.msgpack")
    (notice,) = notices.matching("more than one arch")
    assert "after torch.cuda.set_device(local_rank)" in notice and "MEGATRON_TUNING_CACHE" in notice


def test_auto_init_with_a_named_cache_file_reads_no_gpu(tmp_path, monkeypatch):
    _fake_gpus(monkeypatch, {0: (9, 0)})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: pytest.fail("read a GPU"))
    policy = megatron_tuning.TuningPolicy(mode="auto", cache=str(tmp_path / "mine.msgpack"))
    with megatron_tuning.init_deterministic_tuning(policy) as handle:
        assert handle.cache.path == str(tmp_path / "mine.msgpack")


def test_the_handle_says_whether_it_is_closed_and_cannot_be_told_otherwise():
    handle = megatron_tuning.init_deterministic_tuning(
        megatron_tuning.TuningPolicy(mode="deterministic", use_shipped_tables=False)
    )
    assert not handle.closed
    with pytest.raises(AttributeError):
        handle.closed = True  # a settable flag would skip close()'s restore of Triton
    handle.close()
    assert handle.closed


_CLOSE_FAILS_AT_EXIT = """
from megatron_tuning import session
from megatron_tuning.core.errors import InputMismatchError, StoreError

class Handle:  # a session whose close at exit raises what the check at close found
    closed = False

    def close(self):
        if {error!r} == "InputMismatchError":
            differences = {{"tuning sessions started": {{0: 2, 1: 1}}}}
            raise InputMismatchError("verify_agreement call #2", [0, 1], differences)
        if {error!r} == "StoreError":
            raise StoreError("the final check", "the job's store failed")
        if {error!r} == "OSError":
            raise OSError(28, "No space left on device")

session._active = Handle()
"""


@pytest.mark.parametrize(
    "error, status, said",
    [
        ("InputMismatchError", 3, "tuning sessions started: rank 0: 2; rank 1: 1"),
        ("StoreError", 1, "the final check: the job's store failed"),
        ("OSError", 0, "closing the tuning session at exit failed: [Errno 28] No space left on device"),
        ("", 0, ""),
    ],
)
def test_an_error_the_close_at_exit_finds_sets_the_exit_status(tmp_path, error, status, said):
    """Before, only a DivergenceError did (3); the others were logged and the process exited 0. Each
    is told once, as a notice (the application's logging may be unconfigured)."""
    result = _fresh_process(_CLOSE_FAILS_AT_EXIT.format(error=error), tmp_path)
    assert result.returncode == status, result.stderr[-3000:]
    checks = "the tuning session's checks at exit failed"
    assert (checks in result.stderr) == (error in ("InputMismatchError", "StoreError"))
    assert said in result.stderr and "Traceback" not in result.stderr
