"""The shared bootstrap: processes armed at ``import triton`` and not before, the ``.pth`` line, chaining."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pytest import CaptureFixture, MonkeyPatch

from megatron_tuning import commands as cli
from megatron_tuning.commands import bootstrap

REPO = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent("""
    import sys
    before = ("megatron_tuning" in sys.modules, "torch" in sys.modules, "triton" in sys.modules)
    waiting = any(type(f).__name__ == "_AfterImport" for f in sys.meta_path)
    print("before triton:", before, "bootstrap loaded:", "_megatron_tuning_bootstrap" in sys.modules,
          "waiting:", waiting)
    if "--import-triton" in sys.argv:
        import triton
        from megatron_tuning.runtime import interception
        policy = interception.current_policy()
        print("after triton: installed", interception.installed(), getattr(policy, "mode", None))
""")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_TUNING_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(TRITON_INTERPRET="1", TRITON_CACHE_DIR=str(tmp_path / "triton_cache"), OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def test_a_process_that_never_imports_triton_loads_nothing_of_the_package(
    tmp_path: Path, capfd: CaptureFixture[str]
) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    assert cli.main(["run", "--", str(tmp_path / "probe.py")]) == 0
    out = capfd.readouterr().out
    assert "before triton: (False, False, False) bootstrap loaded: True waiting: True" in out


def test_a_process_is_armed_at_its_import_of_triton(tmp_path: Path, capfd: CaptureFixture[str]) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    assert cli.main(["run", "--mode", "chaos", "--", str(tmp_path / "probe.py"), "--import-triton"]) == 0
    assert "after triton: installed True chaos" in capfd.readouterr().out


def test_run_stops_a_process_it_cannot_arm(tmp_path: Path, monkeypatch: MonkeyPatch) -> None:
    """A failure at arming must not let the job run unpinned without a word."""
    (tmp_path / "probe.py").write_text(PROBE)
    done = subprocess.run(
        [sys.executable, "-m", "megatron_tuning", "run", "--", str(tmp_path / "probe.py"), "--import-triton"],
        env=_env(tmp_path, RANK="first"),  # only the job's processes read RANK
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "after triton" not in done.stdout
    assert "megatron_tuning run: cannot pin this process's kernels, stopping it" in done.stderr
    assert "RANK='first'" in done.stderr and "Traceback" not in done.stderr


# -- the .pth line --------------------------------------------------------------------------------


def _with_pth(tmp_path: Path, text: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    site_dir = tmp_path / "site"
    site_dir.mkdir(exist_ok=True)
    (site_dir / bootstrap.PTH_NAME).write_text(text)
    (tmp_path / "probe.py").write_text(PROBE)
    # addsitedir processes .pth files exactly as Python's start-up does for site-packages.
    code = f"import site; site.addsitedir({str(site_dir)!r}); import runpy; runpy.run_path('probe.py')"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=tmp_path,
        env=_env(tmp_path, **extra),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_pth_line_is_one_executable_line_after_a_marker() -> None:
    lines = bootstrap.pth_text("/x/megatron_tuning_enable.pth").splitlines()
    assert len(lines) == 2 and lines[0].startswith(bootstrap.PTH_MARKER)
    assert lines[1].startswith("import ")  # the only kind of .pth line Python executes


def test_the_pth_does_nothing_without_the_mode(tmp_path: Path) -> None:
    done = _with_pth(tmp_path, bootstrap.pth_text("p"))
    assert done.returncode == 0, done.stderr
    assert "before triton: (False, False, False) bootstrap loaded: False waiting: False" in done.stdout


@pytest.mark.parametrize("extra", [{"MEGATRON_TUNING_MODE": "off"}, {bootstrap.ENV_LAUNCHER: "run"}])
def test_the_pth_stands_down_for_mode_off_and_under_a_launcher(tmp_path: Path, extra: dict[str, str]) -> None:
    done = _with_pth(tmp_path, bootstrap.pth_text("p"), **{"MEGATRON_TUNING_MODE": "deterministic", **extra})
    assert done.returncode == 0, done.stderr
    assert "bootstrap loaded: True waiting: False" in done.stdout


@pytest.mark.slow
def test_the_pth_arms_at_triton_import_when_the_mode_is_set(tmp_path: Path) -> None:
    done = _with_pth(
        tmp_path, bootstrap.pth_text("p"), "--import-triton", MEGATRON_TUNING_MODE="deterministic"
    )
    assert done.returncode == 0, done.stderr
    assert "before triton: (False, False, False) bootstrap loaded: True waiting: True" in done.stdout
    assert "after triton: installed True deterministic" in done.stdout


def test_a_pth_whose_bootstrap_is_gone_says_so_and_the_process_goes_on(tmp_path: Path) -> None:
    text = bootstrap.pth_text("/site/megatron_tuning_enable.pth").replace(
        repr(os.path.abspath(bootstrap.__file__)), repr(str(tmp_path / "gone.py"))
    )
    done = _with_pth(tmp_path, text, MEGATRON_TUNING_MODE="deterministic")
    assert done.returncode == 0 and "before triton" in done.stdout
    assert "the environment switch /site/megatron_tuning_enable.pth failed" in done.stderr
    assert "python -m megatron_tuning disable" in done.stderr


# -- chaining another sitecustomize ----------------------------------------------------------------


@pytest.mark.parametrize(
    "body, shown",
    [
        ("raise RuntimeError('site setup broke')\n", "RuntimeError: site setup broke"),
        ("import no_such_module_for_megatron_tuning\n", "no_such_module_for_megatron_tuning"),
    ],
)
def test_a_broken_user_sitecustomize_is_reported_and_does_not_stop_the_bootstrap(
    monkeypatch: MonkeyPatch, tmp_path: Path, capsys: CaptureFixture[str], body: str, shown: str
) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text(body)
    monkeypatch.setattr(sys, "path", [str(ours), str(theirs), *sys.path])
    monkeypatch.delitem(sys.modules, "sitecustomize", raising=False)
    bootstrap._chain_sitecustomize(str(ours))  # raised (or said nothing) before
    assert shown in capsys.readouterr().err


def test_the_users_own_sitecustomize_still_runs_in_the_job(
    tmp_path: Path, capfd: CaptureFixture[str]
) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import builtins\nbuiltins.USER_SITE_RAN = True\n")
    (tmp_path / "job.py").write_text(
        "import builtins\nprint('user sitecustomize ran:', builtins.USER_SITE_RAN)\n"
    )
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(theirs), env_path) if p)
    assert cli.main(["run", "--", str(tmp_path / "job.py")]) == 0
    assert "user sitecustomize ran: True" in capfd.readouterr().out


def test_the_bootstrap_refuses_an_existing_folder(tmp_path: Path) -> None:
    (tmp_path / "bootstrap").mkdir()
    with pytest.raises(FileExistsError):
        bootstrap.job_environment(tmp_path, "run")


def test_a_job_that_starts_its_own_session_replaces_the_armed_one(
    tmp_path: Path, capfd: CaptureFixture[str]
) -> None:
    (tmp_path / "own.py").write_text(
        textwrap.dedent("""
            import sys
            import megatron_tuning  # before Triton: arming happens inside the call below
            from megatron_tuning import session
            from megatron_tuning.runtime import interception, pinning
            handle = megatron_tuning.init_deterministic_tuning(megatron_tuning.TuningPolicy(mode="chaos"))
            hooks = [hook is handle._late for hook in pinning.before_decision]
            print("policy:", interception.current_policy().mode, "hooks of the active session:", hooks)
        """)
    )
    assert cli.main(["run", "--mode", "deterministic", "--", str(tmp_path / "own.py")]) == 0
    # The armed session was closed (its hook gone), not left behind half-replaced.
    assert "policy: chaos hooks of the active session: [True]" in capfd.readouterr().out


def test_the_pth_names_a_misspelt_variable_and_arms_nothing(tmp_path: Path) -> None:
    done = _with_pth(tmp_path, bootstrap.pth_text("p"), "--import-triton", MEGATRON_TUNING_MOD="auto")
    assert done.returncode == 0, done.stderr
    assert "after triton: installed False" in done.stdout
    assert "MEGATRON_TUNING_MOD is set but is not a megatron_tuning setting" in done.stderr
    assert "Did you mean MEGATRON_TUNING_MODE?" in done.stderr


def test_a_bad_value_under_enable_stops_the_process_in_one_line_naming_enable(tmp_path: Path) -> None:
    done = _with_pth(tmp_path, bootstrap.pth_text("p"), "--import-triton", MEGATRON_TUNING_MODE="fast")
    assert done.returncode == 2 and "after triton" not in done.stdout
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert (
        done.stderr.startswith("megatron_tuning enable: cannot pin this process's kernels")
        and "'fast'" in done.stderr
    )


def test_without_a_gpu_driver_the_notice_names_triton_interpret(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU driver is present")
    extra = {"MEGATRON_TUNING_MODE": "deterministic", "TRITON_INTERPRET": "0"}
    done = _with_pth(tmp_path, bootstrap.pth_text("p"), "--import-triton", **extra)
    assert "after triton: installed True" in done.stdout, done.stderr
    assert "set TRITON_INTERPRET=1" in done.stderr


def test_a_run_jobs_process_marks_each_divergence_it_raised(tmp_path: Path, monkeypatch: MonkeyPatch) -> None:
    """What `run` counts, handled errors too (the wiring: test_run's exit-3 test, with and without
    Triton). The bootstrap, not the session, knows the folder."""
    from megatron_tuning.core.errors import DivergenceError

    monkeypatch.setattr(DivergenceError, "raised", 0)
    bootstrap._mark_divergences(str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    DivergenceError("k", "n=1", {0: "a", 1: "b"})  # each one built is raised
    bootstrap._mark_divergences(str(tmp_path))
    assert (tmp_path / f"divergence-{os.getpid()}").read_bytes() == b"1"


LEADER = textwrap.dedent("""
    import os, subprocess, sys, time
    from megatron_tuning.commands import bootstrap
    os.setsid()  # as torchrun starts each worker
    bootstrap.stop_with_launcher(sys.argv[1])
    child = subprocess.Popen(["sleep", "300"])
    print(child.pid, flush=True)
    time.sleep(300)
""")


def test_a_worker_leading_its_own_group_takes_what_it_started_with_it(tmp_path: Path) -> None:
    """torchrun puts each worker in a session of its own, out of reach of the launcher's group kill:
    before, a worker died with its launcher but the `sleep` it started lived on, reparented to init."""
    lifeline = tmp_path / "lifeline"
    lifeline.write_text("")
    fd = bootstrap.hold_lifeline(lifeline)
    worker = subprocess.Popen(
        [sys.executable, "-c", LEADER, str(lifeline)], stdout=subprocess.PIPE, text=True, env=_env(tmp_path)
    )
    try:
        assert worker.stdout is not None
        grandchild = int(worker.stdout.readline())
        os.close(fd)  # the launcher lets go (or dies)
        assert worker.wait(timeout=30) == -9
        for _ in range(300):
            try:
                os.kill(grandchild, 0)
            except ProcessLookupError:
                break
            if Path(f"/proc/{grandchild}/stat").read_text().split(") ")[1].startswith("Z"):
                break  # killed, waiting for its reaper
            __import__("time").sleep(0.05)
        else:
            pytest.fail(f"the worker's child {grandchild} outlived it")
    finally:
        worker.kill()
        worker.wait()
