"""The ``score`` command: N fresh pinned processes pooled into one JSON, exit 0 / 3 / 4; ``score
compare``; the do_bench route (``score --do-bench``, ``run --score-do-bench``); bad options."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from megatron_tuning import commands as cli
from megatron_tuning.score.pooling import RUN_FORMAT
from tests.score.fakes import FakeDevice, seams
from tests.score.test_pooling import skeleton

REPO = Path(__file__).resolve().parents[2]
CHILD = str(Path(__file__).with_name("score_child.py"))


def _score(
    tmp_path: Path, *words: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], dict]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_TUNING_")}, **(env or {})}
    env["PYTHONPATH"] = str(REPO)
    out = tmp_path / "score.json"
    done = subprocess.run(
        [sys.executable, "-m", "megatron_tuning", "score", "--out", str(out), *words],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    return done, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.slow
def test_score_pools_three_fresh_processes_and_exits_0(tmp_path: Path) -> None:
    done, report = _score(tmp_path, "--processes", "3", "--", CHILD, "ok")
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = report["results"]
    assert (
        report["format"] == RUN_FORMAT
        and report["exit_codes"] == [0, 0, 0]
        and len(report["per_process"]) == 3
    )
    assert (
        result["processes"]["count"] == 3
        and result["status"] == "ok"
        and result["verdict"]["outcome"] == "faster"
    )
    assert len({r[0]["environment"]["host"] for r in report["per_process"]}) == 1
    assert done.stdout.startswith("twice: 0.") and "x 3 processes" in done.stdout
    assert done.stderr.count("\ntwice: 0.") == 3  # each process's own line, as it finished
    assert set(skeleton(report)) == {
        "format",
        "command",
        "processes",
        "exit_codes",
        "noise_floor",
        "results",
        "per_process",
    }


@pytest.mark.slow
def test_a_relative_table_is_found_by_a_harness_that_changes_folder(tmp_path: Path) -> None:
    """The review's eval_chdir.py: before, each process stopped at `import triton` with "Tuning table
    t.msgpack: no such file (relative to /)", status 2, though `score` had checked it."""
    from megatron_tuning.tables.table import Table, save_table

    save_table(Table([]), tmp_path / "t.msgpack")
    job = tmp_path / "job.py"
    job.write_text(
        "import os, runpy, sys\nos.chdir('/')\nimport triton\n"
        f"sys.argv = [{CHILD!r}, 'ok']\nrunpy.run_path({CHILD!r})\n"
    )
    done, report = _score(tmp_path, "--processes", "1", "--table", "t.msgpack", "--", str(job))
    assert done.returncode == 0, done.stderr[-3000:]
    assert report["per_process"][0][0]["pinning"]["policy"]["tables"] == [str(tmp_path / "t.msgpack")]


@pytest.mark.slow
def test_a_process_that_cannot_be_pinned_says_score_stopped_it(tmp_path: Path) -> None:
    """Its message named `run`, a command the user never typed."""
    from megatron_tuning.tables.table import Table, save_table

    save_table(Table([]), tmp_path / "t.msgpack")
    job = tmp_path / "job.py"
    job.write_text("import os\nos.remove('t.msgpack')\nimport triton\n")  # gone since the check
    done, _ = _score(tmp_path, "--processes", "1", "--table", "t.msgpack", "--", str(job))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "megatron_tuning score: cannot pin this process's kernels, stopping it" in done.stderr


@pytest.mark.slow
def test_a_kernel_without_an_entry_is_told_to_tune_then_score(tmp_path: Path) -> None:
    """A new candidate: its miss advised MEGATRON_TUNING_MODE=auto or ON_MISS=nearest, both of which
    `score` overrides, so neither worked."""
    from tests.commands.test_run import EVAL

    (tmp_path / "evaljob.py").write_text(EVAL)
    done, _ = _score(tmp_path, "--processes", "1", "--", "evaljob.py")
    assert done.returncode == 1 and "TableMissError" in done.stderr, done.stderr[-3000:]
    assert "Tune the candidate first" in done.stderr and "MEGATRON_TUNING_ON_MISS=nearest" not in done.stderr
    assert "megatron_tuning tune --out T.msgpack -- <the same command>" in done.stderr


@pytest.mark.slow
def test_a_stale_table_entry_is_flagged_and_demotes(tmp_path: Path) -> None:
    """The review's candidate whose entry was tuned for another source: before, a warning on stderr
    and a record whose pinning said source "table" as for a fresh entry, status ok, exit 0."""
    import triton

    from megatron_tuning.core.identity import config_data
    from megatron_tuning.core.key import Key
    from megatron_tuning.tables.entry import Entry
    from megatron_tuning.tables.table import Table, save_table
    from tests.commands.test_run import DOUBLE, EVAL

    config = config_data(triton.Config({"BLOCK": 64}, num_warps=2))
    dtypes = {"x_ptr": "torch.float32", "y_ptr": "torch.float32"}
    stale = [
        Entry(arch="unknown", kernel=DOUBLE, key=Key({"n": n}, dtypes), config=config, source_hash="cd" * 32)
        for n in (100, 37)
    ]
    save_table(Table(stale), tmp_path / "t.msgpack")
    job = tmp_path / "job.py"
    job.write_text(EVAL + f"import runpy\nsys.argv = [{CHILD!r}, 'ok']\nrunpy.run_path({CHILD!r})\n")
    done, report = _score(tmp_path, "--processes", "1", "--table", "t.msgpack", "--", str(job))
    assert done.returncode == 4, done.stderr[-3000:]
    (result,) = report["results"]
    assert [f["name"] for f in result["flags"]] == ["stale_entry", "stale_entry"]
    configs = report["per_process"][0][0]["pinning"]["configs"]
    assert all(c["stale"].startswith("kernel source hash cdcdcdcdcdcd in the table") for c in configs)
    assert result["verdict"]["demoted_from"] == "faster"


@pytest.mark.slow
def test_quiet_prints_no_line_per_process(tmp_path: Path) -> None:
    """A pipeline's log got a start line and a result line per process, with no way to turn them off."""
    done, report = _score(tmp_path, "-q", "--processes", "2", "--", CHILD, "ok")
    assert done.returncode == 0 and len(report["per_process"]) == 2, done.stderr[-3000:]
    assert "score: process" not in done.stderr and "twice: 0." not in done.stderr
    assert done.stdout.startswith("twice: 0.") and "x 2 processes" in done.stdout


@pytest.mark.slow
def test_a_failed_correctness_check_exits_3(tmp_path: Path) -> None:
    done, report = _score(tmp_path, "--processes", "1", "--", CHILD, "incorrect")
    assert done.returncode == 3, done.stderr[-3000:]
    assert report["results"][0]["correctness"]["before"] == "fail" and "incorrect" in done.stdout


@pytest.mark.slow
def test_a_demoting_flag_exits_4(tmp_path: Path) -> None:
    done, report = _score(tmp_path, "--processes", "1", "--", CHILD, "demoted")
    assert done.returncode == 4, done.stderr[-3000:]
    (result,) = report["results"]
    assert result["status"] == "demoted" and result["verdict"]["demoted_from"] == "faster"
    assert result["flags"][0]["name"] == "timer_patched"


@pytest.mark.slow
def test_an_unedited_harness_is_scored_through_do_bench_and_a_demoting_flag_exits_4(tmp_path: Path) -> None:
    done, report = _score(
        tmp_path, "--do-bench", "--budget-s", "0.5", "--processes", "1", "--", CHILD, "dobench"
    )
    assert done.returncode == 4, done.stderr[-3000:]  # on CPU the host clock timed it: flagged, demoted
    (result,) = report["results"]
    assert result["name"] == "do_bench@score_child.py:13#1" and result["flags"][0]["name"] == "host_clock"
    assert f"do_bench gave {result['latency']['median']:.6f}" in done.stdout  # the harness got the median
    assert "do_bench is scored by megatron_tuning.score.measure" in done.stderr


@pytest.mark.slow
def test_run_score_do_bench_asks_every_process_for_its_do_bench_records(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text("import os\nprint(os.environ['_MEGATRON_TUNING_SCORE'])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_TUNING_")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [sys.executable, "-m", "megatron_tuning", "run", "--score-do-bench", "bench.json", "--", str(script)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    asked = json.loads(done.stdout.strip().splitlines()[-1])
    assert (
        asked["do_bench"] is True and asked["out"] == str(tmp_path / "bench.json") and len(asked["run"]) == 32
    )


@pytest.mark.slow
def test_a_sigterm_to_score_ends_the_series_keeps_what_was_measured_and_exits_143(tmp_path: Path) -> None:
    """An eval harness's timeout: the job (which exits 0 on SIGTERM) and the series stop there."""
    job = tmp_path / "job.py"
    job.write_text(
        "import os, runpy, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
        f"sys.argv = [{CHILD!r}, 'ok']\n"
        f"runpy.run_path({CHILD!r})\n"
        "open(f'ready.{os.getpid()}', 'w').close()\n"
        "time.sleep(60)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_TUNING_")}
    env["PYTHONPATH"] = str(REPO)
    out = tmp_path / "score.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "megatron_tuning", "score", "--processes", "4", "--out", str(out),
         "--", str(job)],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("ready.*")) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        process.terminate()
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 143, err[-2000:]
    report = json.loads(out.read_text())
    assert report["exit_codes"] == [0] and len(report["results"]) == 1  # one process, kept
    assert "process 1 ended (score was sent SIGTERM); stopping" in err


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal and /proc: Linux")
def test_a_score_killed_on_timeout_leaves_no_process_and_no_folder(tmp_path: Path) -> None:
    """The review's spawner candidate under `timeout -s KILL`: before, its ``sleep`` ran on, and the
    series' folder (``megatron_tuning_score_*``) stayed in the temp folder."""
    from tests.commands.test_job import killed_launcher_leaves_nothing

    killed_launcher_leaves_nothing(tmp_path, "score")


@pytest.mark.slow
def test_a_series_that_measured_nothing_keeps_an_existing_out_and_a_partial_one_is_written(
    tmp_path: Path,
) -> None:
    """Nothing already written is lost: --out used to be replaced by a file of 0 results."""
    job = tmp_path / "job.py"  # measures in its first process and fails in the next ones
    job.write_text(
        "import os, runpy, sys\n"
        "if os.path.exists('measured') or os.environ.get('FAIL_FIRST'):\n"
        "    sys.exit(5)\n"
        "open('measured', 'w').close()\n"
        f"sys.argv = [{CHILD!r}, 'ok']\n"
        f"runpy.run_path({CHILD!r})\n"
    )
    nothing = tmp_path / "nothing.py"
    nothing.write_text("print('no measure() here')\n")
    out = tmp_path / "score.json"
    earlier = '{"format": "an earlier series"}'
    out.write_text(earlier)
    done, _ = _score(tmp_path, "--processes", "3", "--", str(job), env={"FAIL_FIRST": "1"})
    assert done.returncode == 5 and out.read_text() == earlier, done.stderr[-3000:]
    assert (
        f"score: nothing was measured: process 1 ended with status 5; {out} is left as it was" in done.stderr
    )
    done, _ = _score(tmp_path, "--", str(nothing))
    assert done.returncode == 1 and out.read_text() == earlier, done.stderr[-3000:]
    assert "the job called measure() nowhere" in done.stderr and "is left as it was" in done.stderr
    done, report = _score(tmp_path, "--processes", "3", "--", str(job))  # measured, then a failure
    assert done.returncode == 5, done.stderr[-3000:]
    assert report["exit_codes"] == [0, 5] and len(report["results"]) == 1
    assert report["results"][0]["processes"]["requested"] == 3  # measured in 1 of the 3 asked for
    assert f"score: 1 result(s) from 1 process(es) in {out}" in done.stdout


def _write(tmp_path: Path, name: str, ms: float, seed: int) -> Path:
    dev = FakeDevice(seed=seed, noise=0.002)
    from megatron_tuning.score import measure

    path = tmp_path / name
    path.write_text(
        json.dumps(
            {"format": RUN_FORMAT, "results": [measure(dev.kernel(ms), name="k", **seams(dev)).record]}
        )
    )
    return path


def test_score_compare_prints_the_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    new, old = _write(tmp_path, "new.json", 0.50, 1), _write(tmp_path, "old.json", 0.53, 2)
    assert cli.main(["score", "compare", str(new), str(old)]) == 0
    assert "-> faster" in capsys.readouterr().out
    assert cli.main(["score", "compare", str(new), str(old), "--margin", "0.1"]) == 0
    assert "-> same" in capsys.readouterr().out


def test_score_compare_refuses_what_is_not_a_score(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "x.json").write_text("[]")
    assert cli.main(["score", "compare", str(tmp_path / "x.json"), str(tmp_path / "x.json")]) == 2
    assert "not a score result" in capsys.readouterr().err
    (tmp_path / "cut.json").write_text('{"format":')  # a file cut short: named, not a bare parser message
    assert cli.main(["score", "compare", str(tmp_path / "cut.json"), str(tmp_path / "x.json")]) == 2
    assert f"{tmp_path / 'cut.json'}: not JSON (Expecting value" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["--processes", "0", "--", "x.py"], "--processes 0: give 1 to 1000 processes"),
        (["--budget-s", "-1", "--", "x.py"], "--budget-s -1.0: give a positive number of seconds"),
        (["noise-floor", "--target-ci", "2", "--", "x.py"], "--target-ci 2.0: give a fraction in (0, 1)"),
        ([], "give the command to run after `--`"),
        (["--table", "missing.msgpack", "--", "x.py"], "missing.msgpack"),
    ],
)
def test_bad_options_are_usage_errors(
    words: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["score", *words]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("margin", ["-1", "nan", "1", "inf"])
def test_score_compare_refuses_a_margin_outside_0_to_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], margin: str
) -> None:
    new, old = _write(tmp_path, "new.json", 0.50, 1), _write(tmp_path, "old.json", 0.53, 2)
    assert cli.main(["score", "compare", str(new), str(old), "--margin", margin]) == 2
    assert "--margin" in capsys.readouterr().err


@pytest.mark.parametrize(("content", "shown"), [("hello", "not JSON"), ("[1, 2]", "not a score result")])
def test_run_score_do_bench_refuses_an_out_that_holds_something_else_before_the_job(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    content: str,
    shown: str,
) -> None:
    from megatron_tuning.commands import launch

    ran: list[Any] = []
    monkeypatch.setattr(launch, "run_armed", lambda *a, **k: ran.append(a) or (0, 0))
    out = tmp_path / "bench.json"
    out.write_text(content)
    assert cli.main(["run", "--score-do-bench", str(out), "--", "x.py"]) == 2
    assert shown in capsys.readouterr().err and ran == [] and out.read_text() == content
    assert cli.main(["run", "--score-do-bench", str(tmp_path / "no" / "b.json"), "--", "x.py"]) == 2
    assert "does not exist" in capsys.readouterr().err and ran == []


def test_score_compare_exits_4_when_a_side_is_flagged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new, old = _write(tmp_path, "new.json", 0.50, 1), _write(tmp_path, "old.json", 0.53, 2)
    report = json.loads(new.read_text())
    report["results"][0]["flags"] = [{"name": "host_clock", "message": "host", "demotes": True}]
    new.write_text(json.dumps(report))
    assert cli.main(["score", "compare", str(new), str(old)]) == 4
    assert "-> inconclusive" in capsys.readouterr().out


def test_score_compare_exits_4_and_says_why_when_the_clocks_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, a verdict demoted by compare's own clock rule exited 0: only the results' flags counted."""
    new, old = _write(tmp_path, "new.json", 0.50, 1), _write(tmp_path, "old.json", 0.50, 2)
    report = json.loads(new.read_text())
    report["results"][0]["clocks"]["nvml"]["candidate"]["sm_mhz"]["median"] = 1890.0
    new.write_text(json.dumps(report))
    assert cli.main(["score", "compare", str(new), str(old)]) == 4
    out = capsys.readouterr().out
    assert "-> inconclusive" in out and "demoted by clock_offset" in out
    assert "\n  clock_offset: k ran at 1890 MHz, k at 1980 MHz (nvml SM clock)\n" in out


def _two_files_with_names_in_one_only(tmp_path: Path) -> tuple[Path, Path]:
    """new.json: "k" flagged by processes 0 and 1 of a pooled result, and "only_new"; old.json: "k"
    and "only_old"."""
    new, old = _write(tmp_path, "new.json", 0.50, 1), _write(tmp_path, "old.json", 0.53, 2)
    for path, extra in ((new, "only_new"), (old, "only_old")):
        report = json.loads(path.read_text())
        (k,) = report["results"]
        if path == new:
            k["flags"] = [
                {"name": "host_clock", "message": f"process {p}: host", "demotes": True} for p in (0, 1)
            ]
        report["results"].append({**k, "name": extra})
        path.write_text(json.dumps(report))
    return new, old


def test_score_compare_json_names_each_flags_file_once_and_the_unmatched_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: no machine-readable form, a flag line per process per side naming neither file, and
    names in one file only skipped without a word."""
    new, old = _two_files_with_names_in_one_only(tmp_path)
    assert cli.main(["score", "compare", "--json", str(new), str(old)]) == 4
    out, err = capsys.readouterr()
    document = json.loads(out)
    (comparison,) = document["comparisons"]
    assert document["format"] == "megatron_tuning.score-compare/1" and document["exit_status"] == 4
    assert document["unmatched"] == {"a": ["only_new"], "b": ["only_old"]}
    assert comparison["a"] == comparison["b"] == "k" and comparison["outcome"] == "inconclusive"
    assert comparison["flags"] == [
        {"name": "host_clock", "message": "host", "demotes": True, "file": str(new), "processes": [0, 1]}
    ]
    assert f"not compared, only in {new}: only_new" in err and f"only in {old}: only_old" in err
    assert cli.main(["score", "compare", str(new), str(old)]) == 4
    out, _ = capsys.readouterr()
    assert out.count("  host_clock") == 1 and f"  host_clock ({new}, processes 0, 1): host\n" in out


def test_score_compare_writes_its_json_to_out_and_refuses_a_series_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`score --out x compare a b` ignored --out without a word."""
    new, old = _write(tmp_path, "new.json", 0.50, 1), _write(tmp_path, "old.json", 0.53, 2)
    verdict = tmp_path / "verdict.json"
    assert cli.main(["score", "--out", str(verdict), "compare", str(new), str(old)]) == 0
    assert "-> faster" in capsys.readouterr().out
    assert json.loads(verdict.read_text())["comparisons"][0]["outcome"] == "faster"
    assert cli.main(["score", "--processes", "3", "compare", str(new), str(old)]) == 2
    assert "--processes: an option of a series (score -- COMMAND), not of compare" in capsys.readouterr().err
