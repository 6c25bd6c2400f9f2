"""Files read and written safely: special files, symlinked tables, locks, planted links.

Every test here failed before ``tables/files.py`` learned the rule it checks. Tests that would
hang or exhaust memory on a regression (a FIFO read, ``/dev/zero``) run in a child process with
a timeout and a memory limit, so a regression fails the test instead of the machine.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import filelock
import pytest

from megatron_tuning.core.decisions import Decision
from megatron_tuning.core.errors import TableError
from megatron_tuning.core.key import Key
from megatron_tuning.tables import files
from megatron_tuning.tables.records import read_decisions, write_decisions
from megatron_tuning.tables.search import expand_table_paths
from megatron_tuning.tables.table import Entry, Table, add_entries, load_table, save_table, update_table
from megatron_tuning.tables.vote import vote_files

REPO = Path(__file__).resolve().parents[2]


def _entry(i: int, kernel: str = "pkg:k") -> Entry:
    return Entry(
        arch="sm90",
        kernel=kernel,
        key=Key({"M": i}),
        config={"kwargs": {"B": i}, "num_warps": 4, "num_stages": 3},
    )


def _child(code: str, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a child limited to 2 GiB of address space and ``timeout`` seconds."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_TUNING_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    try:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=limit,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child blocked for {timeout}s (it must refuse the file at once)")


# -- special files are never read --------------------------------------------------
_LOAD = """
    import sys
    from megatron_tuning.core.errors import TableError
    from megatron_tuning.tables.table import load_table
    try:
        load_table(sys.argv[1])
    except TableError as exc:
        print(exc)
        sys.exit(3)
"""


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_character_device_is_refused_not_read_to_exhaustion(device):
    if not os.path.exists(device):
        pytest.skip(f"{device} does not exist here")
    done = _child(_LOAD, device)
    assert done.returncode == 3, done.stderr[-2000:]
    assert f"{device}: is a character device, not a regular file" in done.stdout


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "table.msgpack"
    os.mkfifo(fifo)
    done = _child(_LOAD, str(fifo), timeout=20)
    assert done.returncode == 3 and "FIFO" in done.stdout and "not a regular file" in done.stdout


def test_session_start_with_a_fifo_table_fails_fast(tmp_path):
    fifo = tmp_path / "table.msgpack"
    os.mkfifo(fifo)
    code = """
        import os, sys
        os.environ["MEGATRON_TUNING_TABLE"] = sys.argv[1]
        import megatron_tuning
        from megatron_tuning.core.errors import TableError
        try:
            megatron_tuning.init_deterministic_tuning()
        except TableError as exc:
            print(exc)
            sys.exit(3)
    """
    done = _child(code, str(fifo), timeout=60)
    assert done.returncode == 3 and "FIFO" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("command", [["show"], ["import", "-"], ["coverage"], ["diff", "-"]])
def test_cli_commands_refuse_a_fifo_with_exit_2(tmp_path, command):
    fifo = tmp_path / "in.json"
    os.mkfifo(fifo)
    other = tmp_path / "t.msgpack"
    save_table(Table([_entry(1)]), other)
    argv = [command[0], str(fifo)] + [
        str(tmp_path / "out.msgpack") if a == "-" and command[0] == "import" else str(other)
        for a in command[1:]
    ]
    done = _child(
        "import sys; from megatron_tuning.commands import main; sys.exit(main(sys.argv[1:]))", *argv
    )
    assert done.returncode == 2 and "not a regular file" in done.stderr, done.stderr[-2000:]


def test_decision_log_reader_refuses_special_files(tmp_path):
    fifo = tmp_path / "decisions.json"
    os.mkfifo(fifo)
    with pytest.raises(TableError, match="Decision log .*FIFO"):
        read_decisions(fifo)  # non-blocking open: returns at once
    with pytest.raises(TableError, match="Decision log .*is a directory"):
        read_decisions(tmp_path)


def test_symlink_loops_and_broken_links_are_named(tmp_path):
    loop = tmp_path / "loop.msgpack"
    loop.symlink_to(loop.name)
    with pytest.raises(TableError, match="symlink loop"):
        load_table(loop)
    with pytest.raises(TableError, match="symlink loop"):
        expand_table_paths([loop])
    broken = tmp_path / "broken.msgpack"
    broken.symlink_to("v9.msgpack")
    with pytest.raises(TableError, match="broken symlink"):
        load_table(broken)
    with pytest.raises(TableError, match="broken symlink"):
        expand_table_paths([broken])


# -- outputs must be regular files or new paths ------------------------------------
def test_outputs_refuse_to_replace_a_fifo(tmp_path, capsys):
    from megatron_tuning.commands import main

    table = tmp_path / "t.msgpack"
    save_table(Table([_entry(1)]), table)
    fifo = tmp_path / "fakenull.json"  # a name export takes: the FIFO is what is refused
    os.mkfifo(fifo)
    for argv in (["export", str(table), str(fifo)], ["merge", str(fifo), str(table)]):
        assert main(argv) == 2
        assert "not a regular file" in capsys.readouterr().err
        assert fifo.is_fifo()
    with pytest.raises(TableError, match="Decision log .*FIFO"):
        write_decisions(fifo, [])
    assert fifo.is_fifo()


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a device node needs root")
def test_outputs_refuse_to_replace_a_device_node(tmp_path, capsys):
    from megatron_tuning.commands import main

    table = tmp_path / "t.msgpack"
    save_table(Table([_entry(1)]), table)
    fake_null = tmp_path / "fakenull"
    os.mknod(fake_null, 0o666 | 0o020000, os.makedev(1, 3))  # a character device, like /dev/null
    assert main(["merge", str(fake_null), str(table)]) == 2
    assert "character device" in capsys.readouterr().err
    assert main(["export", str(table), str(fake_null)]) == 2
    assert fake_null.is_char_device()


def test_temp_files_are_created_exclusively_and_never_followed(tmp_path, monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: "guessed")
    target = tmp_path / "t.msgpack"
    (tmp_path / f".t.msgpack.{os.getpid()}.guessed.tmp").symlink_to(victim)
    with pytest.raises(OSError, match=f"cannot write {target}"):
        save_table(Table([_entry(1)]), target)
    assert victim.read_text() == "keep me" and not target.exists()


# -- one lock per real file --------------------------------------------------------
def test_a_symlink_and_its_target_share_one_lock(tmp_path):
    real = tmp_path / "v3.msgpack"
    save_table(Table([_entry(0)]), real)
    link = tmp_path / "current.msgpack"
    link.symlink_to(real.name)
    with filelock.FileLock(str(real) + ".lock", timeout=1):  # a writer that names the real file
        start = time.monotonic()
        with pytest.raises(TableError, match="timed out") as info:
            update_table(link, lambda t: t.add(_entry(1)), timeout_s=0.3)
        assert time.monotonic() - start < 10
    message = str(info.value)
    assert f"{real}.lock" in message and f"pid {os.getpid()}" in message
    assert load_table(real).get(*_entry(1).ident) is None  # nothing written while locked out
    add_entries(link, [_entry(1)])
    assert load_table(real).get(*_entry(1).ident) is not None
    assert not (tmp_path / "current.msgpack.lock").exists()


_WRITER = """
    import sys
    from megatron_tuning.core.key import Key
    from megatron_tuning.tables.table import Entry, add_entries
    path, worker, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    for i in range(count):
        add_entries(path, [Entry(arch="sm90", kernel=f"pkg:w{worker}", key=Key({"i": i}),
                                   config={"kwargs": {}, "num_warps": 4, "num_stages": 3})])
"""


def test_writers_through_a_symlink_and_the_target_lose_nothing(tmp_path):
    real = tmp_path / "v3.msgpack"
    save_table(Table(), real)
    link = tmp_path / "current.msgpack"
    link.symlink_to(real.name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_TUNING_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    count = 40
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_WRITER), str(path), str(n), str(count)],
            env=env,
            stderr=subprocess.PIPE,
        )
        for n, path in enumerate((link, real))
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err.decode()[-2000:]
    assert len(load_table(link)) == 2 * count


def test_merge_into_its_own_input_times_out_naming_the_holder(tmp_path):
    out = tmp_path / "t.msgpack"
    save_table(Table([_entry(0)]), out)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, filelock; l = filelock.FileLock(sys.argv[1]); l.acquire(); "
            "print('locked', flush=True); time.sleep(60)",
            f"{out}.lock",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(TableError, match="timed out") as info:
            vote_files(out, [out], timeout_s=0.3)
        assert f"pid {holder.pid}" in str(info.value) and f"{out}.lock" in str(info.value)
    finally:
        holder.kill()
        holder.wait()
    assert len(vote_files(out, [out]).table) == 1  # the lock is free again


def test_a_waiting_writer_says_who_holds_the_lock(tmp_path, caplog):
    path = tmp_path / "t.msgpack"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, filelock; l = filelock.FileLock(sys.argv[1]); l.acquire(); "
            "print('locked', flush=True); time.sleep(0.5)",
            f"{path}.lock",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with caplog.at_level("WARNING", logger="megatron_tuning.tables.files"):
            add_entries(path, [_entry(1)], timeout_s=30)
    finally:
        holder.wait(timeout=30)
    assert f"held by pid {holder.pid}" in caplog.text
    assert len(load_table(path)) == 1


def test_decision_logs_go_through_the_safe_writer(tmp_path):
    path = tmp_path / "d.json"
    write_decisions(path, [Decision(kernel="m:k", key=Key({"k": 1}), signature="S", source="table")])
    assert [d.kernel for d in read_decisions(path)] == ["m:k"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.json"]


# -- planted lock files (issue 16 item 9) ------------------------------------------
def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("123456789")
    return victim


def test_a_planted_lock_symlink_is_refused_and_its_target_kept_through_add_entries(tmp_path):
    table = tmp_path / "t.msgpack"
    save_table(Table([_entry(0)]), table)
    victim = _victim(tmp_path)
    Path(f"{table}.lock").symlink_to(victim)
    with pytest.raises(TableError) as info:
        add_entries(table, [_entry(1)])  # what auto's cache persist does
    message = str(info.value)
    assert f"the lock file {table}.lock is a symbolic link to {str(victim)!r}" in message
    assert "Remove it" in message
    assert victim.read_text() == "123456789"  # filelock < 3.20.1 truncated it to 0 bytes here
    assert load_table(table).get(*_entry(1).ident) is None


def test_a_planted_lock_symlink_is_refused_through_merge_and_the_auto_cache(tmp_path, notices):
    from megatron_tuning.core.policy import TuningPolicy
    from megatron_tuning.tables.cache import open_cache

    out = tmp_path / "t.msgpack"
    save_table(Table([_entry(0)]), out)
    victim = _victim(tmp_path)
    Path(f"{out}.lock").symlink_to(victim)
    with pytest.raises(TableError, match="is a symbolic link"):
        vote_files(out, [out])
    cache_file = tmp_path / "auto.msgpack"
    Path(f"{cache_file}.lock").symlink_to(victim)
    cache = open_cache(TuningPolicy(mode="auto", cache=str(cache_file)), "sm90")
    assert cache is not None
    config = {"kwargs": {"BLOCK": 64}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
    decision = Decision(
        kernel="pkg:k",
        key=Key({"n": 2}, {"x": "f"}),
        signature="s",
        source="tuned",
        config=config,
        arch="sm90",
    )
    assert cache.persist([decision]) == 0
    assert notices.matching("is a symbolic link")  # the cache's notice: it was not written
    assert victim.read_text() == "123456789"


def test_an_ordinary_lock_file_is_reused_and_a_missing_folder_is_made(tmp_path):
    table = tmp_path / "t.msgpack"
    save_table(Table([_entry(0)]), table)
    Path(f"{table}.lock").write_text("")  # left by an earlier writer: harmless
    add_entries(table, [_entry(1)])
    assert load_table(table).get(*_entry(1).ident) is not None
    nested = tmp_path / "new" / "folder" / "t.msgpack"
    add_entries(nested, [_entry(2)])
    assert load_table(nested).get(*_entry(2).ident) is not None
