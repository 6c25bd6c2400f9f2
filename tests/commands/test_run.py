"""``run [policy options] -- <command>``: an unedited job pinned, options validated, status passed on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_tuning import commands as cli
from megatron_tuning.commands.bootstrap import ENV_LAUNCHER
from megatron_tuning.core.identity import config_data
from megatron_tuning.core.key import Key
from megatron_tuning.tables.entry import Entry
from megatron_tuning.tables.records import read_decisions
from megatron_tuning.tables.table import Table, save_table

REPO = Path(__file__).resolve().parents[2]
DOUBLE = "__main__:double_kernel"
DOUBLE_KEY = Key({"n": 100}, {"x_ptr": "torch.float32", "y_ptr": "torch.float32"})

# An evaluation script as a user has it: no megatron_tuning anywhere. Its kernel counts every
# benchmark Triton runs for it (do_bench), so a pinned run must report 0.
EVAL = textwrap.dedent("""
    import sys
    import torch
    import triton
    import triton.language as tl

    BENCH = []

    def counting_do_bench(fn, quantiles=None, **kwargs):
        BENCH.append(1)
        return [1.0, 1.0, 1.0]

    @triton.autotune(
        configs=[triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((16, 1), (64, 2), (256, 4))],
        key=["n"],
        do_bench=counting_do_bench,
    )
    @triton.jit
    def double_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2, mask=mask)

    for n in (100, 37):
        x = torch.arange(n, dtype=torch.float32)
        y = torch.empty_like(x)
        double_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n)
        assert torch.equal(y, x * 2)
    print(f"benchmark calls: {len(BENCH)}; library loaded: {'megatron_tuning' in sys.modules}")
""")


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_TUNING_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["TRITON_INTERPRET"] = "1"
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _cli(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "megatron_tuning", *argv],
        cwd=tmp_path,
        env=env or _env(tmp_path),
        capture_output=True,
        text=True,
        timeout=240,
    )


def _table_for_double(path: Path) -> None:
    import triton

    config = triton.Config({"BLOCK": 64}, num_warps=2)
    save_table(
        Table([Entry(arch="unknown", kernel=DOUBLE, key=DOUBLE_KEY, config=config_data(config))]), path
    )


@pytest.mark.slow
@pytest.mark.parametrize("form", ["script", "python -m"])
def test_run_pins_an_unedited_script(tmp_path: Path, form: str) -> None:
    (tmp_path / "evaljob.py").write_text(EVAL)
    table = tmp_path / "pins.msgpack"
    _table_for_double(table)
    job = ["evaljob.py"] if form == "script" else [sys.executable, "-m", "evaljob"]
    log = tmp_path / "decisions.json"
    env = {**_env(tmp_path), "MEGATRON_TUNING_PRINT_DECISIONS": "1"}
    done = _cli(tmp_path, "run", "--table", str(table), "--decision-log", str(log), "--", *job, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "benchmark calls: 0; library loaded: True" in done.stdout
    decisions = {d.key.values[0]: d for d in read_decisions(log)}  # by n, the one key value
    assert decisions[100].source == "table" and decisions[100].origin == str(table)
    assert decisions[100].signature == "BLOCK=64, num_warps=2, num_stages=3"
    assert decisions[37].source in ("nearest", "cheapest")  # no entry: the deterministic rule
    # MEGATRON_TUNING_PRINT_DECISIONS: one line per decision, as TRITON_PRINT_AUTOTUNING prints.
    printed = [line for line in done.stderr.splitlines() if line.startswith("megatron_tuning: rank 0: ")]
    assert printed == [
        f"megatron_tuning: rank 0: {DOUBLE} [{DOUBLE_KEY}] -> BLOCK=64, num_warps=2, num_stages=3 "
        f"(table from {table})",
        f"megatron_tuning: rank 0: {DOUBLE} [{decisions[37].key}] -> "
        f"{decisions[37].signature} (nearest from {table})",
    ], done.stderr


@pytest.mark.slow
def test_a_relative_table_is_found_by_a_job_that_changes_folder(tmp_path: Path) -> None:
    """Checked relative to `run`'s folder, it was passed on as given: a job that changed folder
    before `import triton` stopped with "no such file" (status 2, a bad option's)."""
    (tmp_path / "evaljob.py").write_text("import os\nos.chdir('/')\n" + EVAL)
    _table_for_double(tmp_path / "pins.msgpack")
    done = _cli(tmp_path, "run", "--table", "pins.msgpack", "--", "evaljob.py")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "benchmark calls: 0; library loaded: True" in done.stdout


def test_the_same_script_without_run_autotunes(tmp_path: Path) -> None:
    """The control: the counter above does count, so "0" means nothing was benchmarked."""
    (tmp_path / "evaljob.py").write_text(EVAL)
    # Stock Triton 3.2/3.3 resolve a GPU benchmarker when decorating; this shim only defers that.
    shim = (
        "from megatron_tuning.runtime.interception import lazy_benchmarker; import runpy\n"
        "with lazy_benchmarker(): runpy.run_path('evaljob.py', run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", shim],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "benchmark calls: 6;" in done.stdout  # 3 configs x 2 shapes


# -- in-process: validation and exit status (the jobs here never import Triton) -------------------


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["run", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _script(tmp_path: Path, body: str, name: str = "job.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_run_help_shows_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    assert "examples:" in out and "run --mode auto -- torchrun" in out and "--decision-log" in out


def _help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines where it likes


def test_run_help_tells_what_the_job_gets_without_an_option(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "default deterministic" while an exported MEGATRON_TUNING_MODE=auto won."""
    from megatron_tuning.commands.launch import validated_policy

    monkeypatch.delenv("MEGATRON_TUNING_MODE", raising=False)
    default = validated_policy({}).mode
    shown = _help(capsys)
    assert f"default {default} unless the variable is set [MEGATRON_TUNING_MODE]" in shown
    assert "your environment sets" not in shown
    monkeypatch.setenv("MEGATRON_TUNING_MODE", "auto")
    monkeypatch.setenv("MEGATRON_TUNING_ON_MISS", "error")
    assert validated_policy({}).mode == "auto"
    shown = _help(capsys)
    assert "[MEGATRON_TUNING_MODE; your environment sets 'auto']" in shown
    assert "[MEGATRON_TUNING_ON_MISS; your environment sets 'error']" in shown


def test_run_without_a_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert _main(capsys)[0] == 2
    code, _, err = _main(capsys, "--mode", "auto", "--")
    assert code == 2 and "after `--`" in err


@pytest.mark.parametrize(
    "options, shown",
    [
        (["--scope", "my-pkg"], "--scope: Unable to use MEGATRON_TUNING_SCOPE='my-pkg'"),
        (["--block-sizes", "BLOCK=x"], "--block-sizes: Unable to use MEGATRON_TUNING_BLOCK_SIZES"),
        (
            ["--agreement-timeout", "nan"],
            "--agreement-timeout: Unable to use MEGATRON_TUNING_AGREEMENT_TIMEOUT",
        ),
        (["--decision-log", "/no/such/folder/d.json"], "--decision-log: Unable to use decision_log"),
        (["--table", "/no/such/table.msgpack"], "/no/such/table.msgpack"),
    ],
)
def test_a_bad_option_fails_before_the_job_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], shown: str
) -> None:
    marker = tmp_path / "started"
    job = _script(tmp_path, f"open({str(marker)!r}, 'w').close()\n")
    code, _, err = _main(capsys, *options, "--", job)
    assert code == 2 and shown in err and "Traceback" not in err, err
    assert not marker.exists()


def test_a_bad_choice_is_an_argparse_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--on-miss", "sometimes", "--", "job.py"])
    assert info.value.code == 2 and "invalid choice: 'sometimes'" in capsys.readouterr().err


def test_tune_mode_is_refused_with_the_command_to_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MEGATRON_TUNING_MODE", "tune")
    code, _, err = _main(capsys, "--", _script(tmp_path, "pass\n"))
    assert code == 2 and "python -m megatron_tuning tune --out TABLE" in err


def test_an_unrelated_bad_variable_in_the_environment_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MEGATRON_TUNING_STRICT", "maybe")
    code, _, err = _main(capsys, "--", _script(tmp_path, "pass\n"))
    assert code == 2 and "MEGATRON_TUNING_STRICT='maybe'" in err and not err.startswith("run: --")


def test_options_set_the_variables_and_the_environment_passes_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MEGATRON_TUNING_ON_MISS", "error")  # replaced by --on-miss
    monkeypatch.setenv("MEGATRON_TUNING_STALE_ENTRIES", "miss")  # no option names it: kept
    out = tmp_path / "env.json"
    job = _script(
        tmp_path,
        f"""
        import json, os, sys
        names = [n for n in os.environ if "MEGATRON_TUNING_" in n]
        json.dump({{n: os.environ[n] for n in names}}, open({str(out)!r}, "w"))
        json.dump(sys.path, open({str(out)!r} + ".path", "w"))
        """,
    )
    code, _, err = _main(
        capsys, "--on-miss", "min_cost", "--scope", "a.b", "--scope", "c", "--strict", "--", job
    )
    assert code == 0, err
    seen = json.loads(out.read_text())
    assert seen["MEGATRON_TUNING_MODE"] == "deterministic"  # the default, spelled out
    assert seen["MEGATRON_TUNING_ON_MISS"] == "min_cost" and seen["MEGATRON_TUNING_STALE_ENTRIES"] == "miss"
    assert seen["MEGATRON_TUNING_SCOPE"] == "a.b,c" and seen["MEGATRON_TUNING_STRICT"] == "1"
    assert seen[ENV_LAUNCHER] == "run"
    bootstrap = Path(json.loads(Path(str(out) + ".path").read_text())[1])
    assert bootstrap.name == "bootstrap" and not bootstrap.exists()  # removed after the job


def test_the_bootstrap_folder_holds_only_our_sitecustomize(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    job = _script(
        tmp_path,
        """
        import os, sys
        names = set(os.listdir(sys.path[1])) - {"__pycache__"}  # Python's own cache of our file
        print(sorted(names), oct(os.stat(sys.path[1]).st_mode & 0o777))
        """,
    )
    code, out, err = _main(capfd, "--", job)
    assert code == 0, err
    assert "['sitecustomize.py'] 0o700" in out


def test_the_jobs_exit_status_is_passed_through(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _main(capsys, "--", _script(tmp_path, "raise SystemExit(3)\n"))
    assert code == 3 and err == ""


def test_a_job_killed_by_a_signal_exits_128_plus_n_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = _script(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    code, _, err = _main(capsys, "--", job)
    assert code == 137 and "the job was killed by SIGKILL (exit status 137)" in err


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])  # SIGINT: a scheduler's or a notebook's
def test_a_signal_a_program_sends_the_launcher_reaches_the_job(tmp_path: Path, name: str) -> None:
    ready = tmp_path / "ready"
    job = _script(
        tmp_path,
        f"""
        import signal, sys, time
        signal.signal(signal.{name}, lambda *a: sys.exit(42))
        open({str(ready)!r}, "w").close()
        time.sleep(60)
        """,
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "megatron_tuning", "run", "--", job],
        env=_env(tmp_path),
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(300):
            if ready.exists():
                break
            if process.poll() is not None:
                break
            import time

            time.sleep(0.05)
        assert ready.exists(), process.stderr.read() if process.stderr else ""
        process.send_signal(getattr(signal, name))
        assert process.wait(timeout=30) == 42  # the job's handler ran: the signal was passed on
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_signal_sent_to_the_launchers_process_group_reaches_the_job_once(tmp_path: Path, name: str) -> None:
    """GNU timeout, Slurm and killpg-based harnesses signal the whole group the launcher leads."""
    ready = tmp_path / "ready"
    job = _script(
        tmp_path,
        f"""
        import signal, sys, time
        got = []
        signal.signal(signal.{name}, lambda *a: got.append(1))
        open({str(ready)!r}, "w").close()
        end = time.monotonic() + 60
        while not got and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(1.0)  # a second delivery would land here
        sys.exit(40 + len(got))
        """,
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "megatron_tuning", "run", "--", job],
        env=_env(tmp_path),
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own group, as a harness starts it: killpg reaches only it
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), process.stderr.read() if process.stderr else ""
        os.killpg(process.pid, getattr(signal, name))
        assert process.wait(timeout=30) == 41  # once, not once from the group and once passed on
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_a_command_name_with_control_characters_is_shown_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _main(capsys, "--", "evil\x1b[2J\nname")
    assert code == 127 and "\x1b" not in err and "\\x1b[2J" in err and err.count("\n") == 1


def test_the_users_pythonpath_comes_before_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The checkout's own ``tests`` package must not shadow the user's."""
    package = tmp_path / "lib" / "tests"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text("WHO = 'the user'\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "lib"))
    code, out, err = _main(capfd, "--", _script(tmp_path, "from tests.helpers import WHO\nprint(WHO)\n"))
    assert code == 0 and "the user" in out, err


def test_torchrun_and_python_resolve_beside_the_interpreter_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatron_tuning.commands.launch import job_argv

    for folder in ("venv", "elsewhere"):
        (tmp_path / folder).mkdir()
        for name in ("python", "torchrun"):
            (tmp_path / folder / name).write_text("#!/bin/sh\n")
            (tmp_path / folder / name).chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "python"))
    monkeypatch.setenv("PATH", f"{tmp_path / 'elsewhere'}{os.pathsep}{os.environ['PATH']}")
    assert job_argv(["torchrun", "--standalone", "x.py"]) == [
        str(tmp_path / "venv" / "torchrun"),
        "--standalone",
        "x.py",
    ]
    assert job_argv(["python", "-c", "0"])[0] == str(tmp_path / "venv" / "python")
    (tmp_path / "venv" / "torchrun").unlink()
    assert job_argv(["torchrun", "x.py"])[0] == "torchrun"  # none beside it: PATH's


def test_a_divergence_makes_the_process_and_the_run_exit_3(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Distinct from a crash (1), so CI need not grep; `run` also counts one the job caught."""
    error = 'DivergenceError("m:k", "n=1", {0: "BLOCK=16", 1: "BLOCK=32"})'
    imports = "from megatron_tuning.core.errors import DivergenceError\n"
    died = _script(tmp_path, f"{imports}raise {error}\n")
    done = subprocess.run([sys.executable, died], env=_env(tmp_path), capture_output=True, text=True)
    assert done.returncode == 3 and "DivergenceError" in done.stderr
    caught = _script(
        tmp_path, f"{imports}try:\n    raise {error}\nexcept DivergenceError:\n    pass\n", "c.py"
    )
    code, _, err = _main(capfd, "--", caught)
    assert code == 3 and "1 process(es) of the job raised DivergenceError" in err


@pytest.mark.parametrize(
    "command, code, shown",
    [
        (["no-such-program-for-megatron-tuning"], 127, "command not found on PATH"),
        (["/no/such/program"], 127, "no such program: /no/such/program"),
        (["missing_script.py"], 2, "no such script: missing_script.py"),
    ],
)
def test_a_command_that_cannot_start_is_named(
    capsys: pytest.CaptureFixture[str], command: list[str], code: int, shown: str
) -> None:
    got, _, err = _main(capsys, "--", *command)
    assert got == code and shown in err and "Traceback" not in err


def test_a_file_that_is_not_executable_exits_126(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = tmp_path / "data.txt"
    plain.write_text("not a program\n")
    plain.chmod(0o644)
    got, _, err = _main(capsys, "--", str(plain))
    assert got == 126 and "is not an executable program" in err


# -- the job dies with its launcher ---------------------------------------------------------------


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped yet does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _wait_for(path: Path, process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> str:
    import time

    deadline = time.monotonic() + timeout_s
    while not path.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"the job never wrote {path.name} (launcher status {process.poll()})"
    return path.read_text()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal and /proc: Linux")
def test_a_harness_that_kills_run_on_timeout_kills_the_whole_job(tmp_path: Path) -> None:
    """``subprocess.run(..., timeout=)`` SIGKILLs only the launcher's pid. The job's first process
    (here exec'd into ``sleep``, which Python cannot watch over) and an armed grandchild in a session
    of its own (as torchrun starts its workers) must be gone 2 s later. Before, both ran on."""
    import shutil
    import time

    pids = tmp_path / "pids"
    job = _script(
        tmp_path,
        f"""
        import os, subprocess, sys
        sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
        child = subprocess.Popen(sleeper, start_new_session=True)
        with open({str(pids)!r} + ".tmp", "w") as f:
            f.write(f"{{os.getpid()}} {{child.pid}}")
        os.rename({str(pids)!r} + ".tmp", {str(pids)!r})
        os.execv({shutil.which("sleep")!r}, ["sleep", "600"])
        """,
    )
    env = {**_env(tmp_path), "TMPDIR": str(tmp_path)}  # a killed `run` leaves its folder there
    launcher = subprocess.Popen([sys.executable, "-m", "megatron_tuning", "run", "--", job], env=env)
    job_pids = [int(p) for p in _wait_for(pids, launcher).split()]
    try:
        time.sleep(0.5)  # the grandchild is up, its bootstrap has run
        assert all(map(_alive, job_pids))
        launcher.kill()  # what subprocess.run does at its timeout
        launcher.wait()
        deadline = time.monotonic() + 2.0
        while any(map(_alive, job_pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in job_pids if _alive(pid)] == [], "the job outlived its launcher"
    finally:
        for pid in filter(_alive, job_pids):
            os.kill(pid, signal.SIGKILL)
