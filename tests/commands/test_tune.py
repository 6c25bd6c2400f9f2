"""``tune -- <command>`` end to end on CPU (interpreter, host clock), pooling and plots."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
from pytest import CaptureFixture, MonkeyPatch

from megatron_tuning.commands.tune import add_tune as add_arguments
from megatron_tuning.commands.tune import run_tune as run
from megatron_tuning.core.decisions import Decision
from megatron_tuning.core.identity import config_data, config_signature
from megatron_tuning.core.key import Key
from megatron_tuning.tables.records import read_decisions, recording_table, write_decisions
from megatron_tuning.tables.table import load_table
from megatron_tuning.tables.vote import vote_tables
from megatron_tuning.tuning.stats import TuneSettings, analyze_configs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

JOB = textwrap.dedent("""
    import sys
    import torch
    import triton
    from megatron_tuning import kernels as tiny

    x = torch.arange(100, dtype=torch.float32)
    torch.testing.assert_close(tiny.add_one(x), x + 1)   # tuned at this first launch
    torch.testing.assert_close(tiny.add_one(x), x + 1)   # pinned afterwards
    sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
""")


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def tiny_records(signatures_fast: int = 0, n: int = 100, tie_band: float = 0.02) -> list[Decision]:
    import triton

    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((64, 1), (128, 2), (256, 4))]
    decisions = []
    for rank, fast in enumerate((0, 1)):  # two ranks, near-tied fastest candidates
        samples = [[1.0 + (0.0 if i == fast else 0.005 * (i + 1))] * 3 for i in range(3)]
        settings = TuneSettings(
            tie_band=tie_band, overlap_cap=max(tie_band, 1.5 * tie_band) if tie_band else 0.0
        )
        result = analyze_configs(configs, samples, settings=settings)
        decisions.append(
            Decision(
                kernel="pkg.mod:k",
                key=Key({"n": n}, {"x": "torch.float32"}),
                signature=result.winner_signature,
                source="tuned",
                config=config_data(configs[result.winner]),
                arch="sm90",
                rank=rank,
                timings=result.to_timings(),
            )
        )
    return decisions


@pytest.mark.slow
def test_tune_runs_the_job_and_writes_table_results_and_plots(tmp_path: Path) -> None:
    pytest.importorskip("msgpack")
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / "tuned.msgpack"
    # The plot is checked here when matplotlib (an optional dependency) is installed.
    plot = ["--plot", str(tmp_path / "plots")] if _has_matplotlib() else []
    args = _parse(
        ["--out", str(out), "--rounds", "2", *plot, "--work-dir", str(tmp_path / "work"), "--", str(script)]
    )
    os.environ["MEGATRON_TUNING_SCOPE"] = "megatron_tuning.kernels"
    assert run(args) == 0

    from megatron_tuning.tables.table import load_table

    (entry,) = load_table(out).entries()
    assert entry.kernel == "megatron_tuning.kernels:add_one_kernel"
    assert entry.how == "tuned" and entry.timing is not None and entry.timing.candidates == 5
    assert entry.votes == (1, 1)
    (decision,) = read_decisions(tmp_path / "tuned.tuning.json")  # every process's tuned decisions
    assert decision.source == "tuned" and decision.signature == config_signature(entry.config)
    assert all(len(s) == 2 for s in decision.timings["samples"].values())
    if plot:
        (png,) = (tmp_path / "plots").iterdir()
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000


@pytest.mark.slow
def test_tune_keeps_partial_results_and_returns_the_job_status(tmp_path: Path) -> None:
    pytest.importorskip("msgpack")
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / "t.msgpack"
    os.environ["MEGATRON_TUNING_SCOPE"] = "megatron_tuning.kernels"
    assert run(_parse(["--out", str(out), "--rounds", "1", "--", str(script), "3"])) == 3
    assert out.exists()


def test_tune_without_a_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_parse(["--out", "x.msgpack"])) == 2
    assert "after `--`" in capsys.readouterr().err


def test_tune_reports_a_job_that_tuned_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "noop.py"
    script.write_text("print('nothing to tune')\n")
    assert run(_parse(["--out", str(tmp_path / "t.msgpack"), "--", sys.executable, str(script)])) == 1
    assert "recorded no tuned" in capsys.readouterr().err


def test_tune_refuses_a_kernel_whose_config_cannot_be_stored_before_measuring(
    tmp_path: Path, capfd: CaptureFixture[str]
) -> None:
    # The kernel's configs hold a jit function: no table could hold its winner.
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(f"""
            import sys
            import torch
            sys.path.insert(0, {str(Path(__file__).parents[2])!r})
            from tests import support_kernels as sk

            x = torch.arange(8, dtype=torch.float32)
            sk.activate[sk.grid(8)](x, torch.empty(8), 8)
            print("measured", len(sk.BENCH_CALLS))
        """)
    )
    out = tmp_path / "t.msgpack"
    assert run(_parse(["--out", str(out), "--rounds", "1", "--", str(script)])) == 1
    captured = capfd.readouterr()
    assert "UnstorableConfigError: Kernel tests.support_kernels:activate cannot run in mode 'tune'" in (
        captured.err
    )
    assert "config field ACT" in captured.err and "as a launch argument" in captured.err
    assert "the job exited with status 1 before it tuned anything" in captured.err
    assert "measured" not in captured.out and not out.exists()


def test_ranks_pool_through_the_vote_merge_uses_whatever_the_order() -> None:
    # Two ranks tuned one key and picked different winners (near-tied): one entry, two votes, the
    # same bytes in either order; equal medians, so the tie goes to the lower static cost.
    decisions = tiny_records(tie_band=0.0)
    assert decisions[0].signature != decisions[1].signature
    tables = [(f"rank{d.rank}", recording_table([d])) for d in decisions]
    forward, backward = vote_tables(tables), vote_tables(tables[::-1])
    assert forward.table.to_bytes() == backward.table.to_bytes()
    (entry,) = forward.table.entries()
    assert entry.votes == (1, 2) and forward.disagreements[0].rule == "tie: lowest static cost"


def no_matplotlib(monkeypatch: MonkeyPatch) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)


def _fake_job(monkeypatch: MonkeyPatch, returncode: int = 0, n: int = 100) -> list[list[str]]:
    """Replace the job by one that writes a per-process result, as the bootstrap would."""
    from megatron_tuning.commands import tune as tune_command

    calls: list[list[str]] = []

    def fake_run_armed(
        argv: list[str], updates: Any, prog: str, *, launcher: str, folder: Path, **_: Any
    ) -> Any:
        calls.append(argv)
        # One file name per process (the real names carry the pid), so jobs do not overwrite each other.
        write_decisions(folder / f"tuned-host-{n}.json", tiny_records(n=n)[:1])
        return returncode, 0

    monkeypatch.setattr(tune_command, "command_problem", lambda argv, env: None)
    monkeypatch.setattr(tune_command, "run_armed", fake_run_armed)
    return calls


def test_tune_plot_without_matplotlib_fails_before_running_the_job(
    monkeypatch: MonkeyPatch, tmp_path: Path, capsys: CaptureFixture[str]
) -> None:
    calls = _fake_job(monkeypatch)
    no_matplotlib(monkeypatch)
    out = tmp_path / "t.msgpack"
    assert run(_parse(["--out", str(out), "--plot", str(tmp_path / "p"), "--", "job.py"])) == 2
    assert "pip install matplotlib" in capsys.readouterr().err
    assert calls == [] and not out.exists()  # no hour-long run ending in a traceback


def test_tune_names_a_command_that_cannot_start_before_making_anything(
    monkeypatch: MonkeyPatch, tmp_path: Path, capsys: CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert run(_parse(["--out", str(tmp_path / "t.msgpack"), "--", "/no/such/command"])) == 127
    assert "no such program: /no/such/command" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_tune_keeps_the_measurements_when_the_table_cannot_be_written(
    monkeypatch: MonkeyPatch, tmp_path: Path, capsys: CaptureFixture[str]
) -> None:
    pytest.importorskip("msgpack")
    _fake_job(monkeypatch)
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    from megatron_tuning.commands import tune as tune_command

    def disk_full(out: Any, records: Any) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tune_command, "add_entries", disk_full)
    args = _parse(
        ["--out", str(tmp_path / "t.msgpack"), "--results", str(tmp_path / "r.json"), "--", "job.py"]
    )
    with pytest.raises(OSError):
        run(args)
    (kept,) = temp.glob("megatron_tuning_tune_*/tuned-*.json")
    err = capsys.readouterr().err
    assert f"per-process results kept in {kept.parent}" in err
    assert f"python -m megatron_tuning merge OUT {kept.parent}/tuned-*.json" in err


def test_merge_votes_a_jobs_kept_per_process_results_as_tune_did(
    monkeypatch: MonkeyPatch, tmp_path: Path, capsys: CaptureFixture[str]
) -> None:
    # --work-dir keeps each process's tuned-<host>-<pid>.json; `merge` refused them (not a table).
    from megatron_tuning import commands as cli
    from megatron_tuning.commands import tune as tune_command

    def two_processes(
        argv: list[str], updates: Any, prog: str, *, launcher: str, folder: Path, **_: Any
    ) -> Any:
        first, second = tiny_records(tie_band=0.0)  # two processes, two near-tied winners
        # the first ran two sessions: its log holds two decisions for the key, and it votes once
        write_decisions(folder / "tuned-host-0.json", [first, second])
        write_decisions(folder / "tuned-host-1.json", [second])
        return 0, 0

    monkeypatch.setattr(tune_command, "command_problem", lambda argv, env: None)
    monkeypatch.setattr(tune_command, "run_armed", two_processes)
    out, work, merged = tmp_path / "t.msgpack", tmp_path / "work", tmp_path / "m.msgpack"
    assert run(_parse(["--out", str(out), "--work-dir", str(work), "--", "job.py"])) == 0
    kept = sorted(str(p) for p in work.glob("job-*/tuned-*.json"))
    assert len(kept) == 2 and load_table(out).entries()[0].votes == (1, 2)
    for inputs in (kept, [str(tmp_path / "t.tuning.json")]):  # the kept logs, or --results
        capsys.readouterr()
        assert cli.main(["merge", str(merged), *inputs]) == 0
        assert "1 with disagreement" in capsys.readouterr().out
        assert load_table(merged).entries() == load_table(out).entries()


def test_tune_removes_its_temp_dir_after_a_successful_run(monkeypatch: MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("msgpack")
    _fake_job(monkeypatch, returncode=5)
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    assert run(_parse(["--out", str(tmp_path / "t.msgpack"), "--", "job.py"])) == 5
    assert (tmp_path / "t.msgpack").exists() and list(temp.iterdir()) == []


# -- --work-dir: each job in a fresh folder of its own ---------------------------------------------


def test_a_reused_work_dir_pools_only_the_new_jobs_results(monkeypatch: MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("msgpack")
    from megatron_tuning.tables.table import load_table

    work = tmp_path / "work"
    for n, out in ((100, tmp_path / "first.msgpack"), (200, tmp_path / "second.msgpack")):
        _fake_job(monkeypatch, n=n)
        assert run(_parse(["--out", str(out), "--work-dir", str(work), "--", "job.py"])) == 0
    assert [e.key for e in load_table(tmp_path / "second.msgpack").entries()] == ["n=200 | x:torch.float32"]
    jobs = sorted(p.name for p in work.iterdir() if p.is_dir())
    assert len(jobs) == 2 and all(name.startswith("job-") for name in jobs)  # both kept, apart


def _planting_job(tmp_path: Path) -> tuple[Path, Path]:
    """A job that imports ``fractions``, and a folder whose bootstrap/ plants a fake one."""
    marker = tmp_path / "planted_code_ran"
    script = tmp_path / "job.py"
    script.write_text("import fractions\nprint(fractions.__file__)\n")
    work = tmp_path / "work"
    (work / "bootstrap").mkdir(parents=True)
    (work / "bootstrap" / "fractions.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    return work, script


def test_a_work_dir_with_foreign_files_is_refused(tmp_path: Path, capsys: CaptureFixture[str]) -> None:
    work, script = _planting_job(tmp_path)
    args = _parse(["--out", str(tmp_path / "t.msgpack"), "--work-dir", str(work), "--", str(script)])
    assert run(args) == 2
    assert "already holds files tune did not write" in capsys.readouterr().err
    assert not (tmp_path / "planted_code_ran").exists()


def test_files_planted_in_a_used_work_dir_never_run_in_the_job(
    tmp_path: Path, capfd: CaptureFixture[str]
) -> None:
    from megatron_tuning.commands.tune import WORK_DIR_MARKER

    work, script = _planting_job(tmp_path)
    (work / WORK_DIR_MARKER).write_text("")  # a folder tune used before, then someone planted code
    args = _parse(["--out", str(tmp_path / "t.msgpack"), "--work-dir", str(work), "--", str(script)])
    assert run(args) == 1  # the job ran (and tuned nothing)
    assert not (tmp_path / "planted_code_ran").exists()
    assert "recorded no tuned" in capfd.readouterr().err


# -- outputs are checked before the job, and the job's end is reported as a shell would -----------


@pytest.mark.parametrize(
    "which, shown",
    [
        ("out-dir", "is a folder; name a file in it"),
        ("out-under-file", "is a regular file, not a folder"),
        ("results-dir", "is a folder; name a file in it"),
    ],
)
def test_an_unwritable_output_fails_before_the_job(
    monkeypatch: MonkeyPatch, tmp_path: Path, capsys: CaptureFixture[str], which: str, shown: str
) -> None:
    calls = _fake_job(monkeypatch)
    folder = tmp_path / "a_folder"
    folder.mkdir()
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    argv = {
        "out-dir": ["--out", str(folder)],
        "out-under-file": ["--out", str(blocker / "sub" / "t.msgpack")],
        "results-dir": ["--out", str(tmp_path / "t.msgpack"), "--results", str(folder)],
    }[which]
    assert run(_parse([*argv, "--", "job.py"])) == 2
    err = capsys.readouterr().err
    assert shown in err and ("--results" if which == "results-dir" else "--out") in err
    assert calls == []  # no hour-long job that ends in "cannot write"


def test_outputs_in_folders_that_do_not_exist_yet_are_written_there(
    monkeypatch: MonkeyPatch, tmp_path: Path
) -> None:
    _fake_job(monkeypatch)
    out, results = tmp_path / "new" / "sub" / "t.msgpack", tmp_path / "other" / "r.json"
    assert run(_parse(["--out", str(out), "--results", str(results), "--", "job.py"])) == 0
    assert len(load_table(out)) == 1 and read_decisions(results)  # the folders were made, nothing lost


def test_an_existing_out_that_cannot_be_read_fails_before_the_job(
    monkeypatch: MonkeyPatch, tmp_path: Path, capsys: CaptureFixture[str]
) -> None:
    calls = _fake_job(monkeypatch)
    out = tmp_path / "t.msgpack"
    out.write_bytes(b"\x94garbage")
    assert run(_parse(["--out", str(out), "--", "job.py"])) == 2
    assert str(out) in capsys.readouterr().err and calls == []  # merged into at the end: read it now
    assert out.read_bytes() == b"\x94garbage"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_out_folder_fails_before_the_job(
    monkeypatch: MonkeyPatch, tmp_path: Path, capsys: CaptureFixture[str]
) -> None:
    calls = _fake_job(monkeypatch)
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        assert run(_parse(["--out", str(folder / "t.msgpack"), "--", "job.py"])) == 2
    finally:
        folder.chmod(0o755)
    assert "is not writable" in capsys.readouterr().err and calls == []


def test_a_job_killed_by_sigkill_exits_137_and_says_so(tmp_path: Path, capsys: CaptureFixture[str]) -> None:
    script = tmp_path / "killed.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert run(_parse(["--out", str(tmp_path / "t.msgpack"), "--", str(script)])) == 137
    assert "the job was killed by SIGKILL (exit status 137)" in capsys.readouterr().err


@pytest.mark.parametrize("versions", [("2.0.0", "2.0.0"), ("2.0.0", "2.1.0"), (None, None)])
def test_tune_stamps_each_entry_with_the_triton_its_process_ran(
    monkeypatch: MonkeyPatch, tmp_path: Path, capsys: CaptureFixture[str], versions: tuple[str | None, ...]
) -> None:
    # The job's processes may run another Triton than the one installed where tune runs: the entries
    # claimed the installed one.
    from megatron_tuning.commands import tune as tune_command

    decisions = tiny_records(tie_band=0.0)  # two processes, two winners

    def processes(argv: list[str], updates: Any, prog: str, *, launcher: str, folder: Path, **_: Any) -> Any:
        for decision, version in zip(decisions, versions):
            write_decisions(folder / f"tuned-host-{decision.rank}.json", [decision], triton_version=version)
        return 0, 0

    monkeypatch.setattr(tune_command, "command_problem", lambda argv, env: None)
    monkeypatch.setattr(tune_command, "run_armed", processes)
    out, results = tmp_path / "t.msgpack", tmp_path / "r.json"
    assert run(_parse(["--out", str(out), "--results", str(results), "--", "job.py"])) == 0
    (entry,) = load_table(out).entries()
    assert (
        entry.triton_version
        == dict(zip((d.signature for d in decisions), versions))[config_signature(entry.config)]
    )
    different = "tune: the job's processes ran different Tritons (2.0.0, 2.1.0): each entry is stamped"
    assert (different in capsys.readouterr().err) == (len(set(versions)) > 1)
    pooled = json.loads(results.read_text())["triton_version"]
    assert pooled == (versions[0] if len(set(versions)) == 1 else None)  # null: none known, none stamped
