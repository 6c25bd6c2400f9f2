"""Notices reach stderr by default, once per cause; diagnostics are logging records the application shows."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest

from megatron_tuning.core import notices as notice
from megatron_tuning.core.notices import TuningWarning, reset_warnings, tallies, tally, warn_once

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, *flags: str, rank: int = 0) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter with no logging or warnings setup of its own: what a user's script gets."""
    return subprocess.run(
        [sys.executable, *flags, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1", "RANK": str(rank)},
        capture_output=True,
        text=True,
        timeout=180,
    )


NOTICE_TWICE = """
    from megatron_tuning.core.notices import warn_once
    for _ in range(2):
        warn_once(("cause",), "kernel k:f key %s is not pinned; fix: run tune", "n=1 | x:f")
    print("done")
"""


def test_a_notice_reaches_stderr_once_with_no_setup_at_all():
    result = _python(NOTICE_TWICE)
    assert result.returncode == 0 and result.stdout == "done\n"
    assert result.stderr.count("TuningWarning: megatron_tuning: kernel k:f key n=1 | x:f is not pinned") == 1
    assert "fix: run tune" in result.stderr
    # Attributed to the caller's line (here the -c script), not to megatron_tuning's own code.
    assert "<string>:4" in result.stderr and "megatron_tuning/core/notices.py" not in result.stderr


def test_notices_are_filtered_with_the_standard_tools():
    assert _python(NOTICE_TWICE, "-W", "ignore:megatron_tuning").stderr == ""
    failed = _python(NOTICE_TWICE, "-W", "error:megatron_tuning")
    assert failed.returncode == 1 and "TuningWarning: megatron_tuning: kernel k:f" in failed.stderr
    by_category = _python(
        """
        import warnings, megatron_tuning
        warnings.filterwarnings("ignore", category=megatron_tuning.TuningWarning)
        from megatron_tuning.core.notices import warn_once
        warn_once(("cause",), "kernel k:f is not pinned")
        """
    )
    assert by_category.returncode == 0 and by_category.stderr == ""


def test_logging_is_the_applications_to_configure():
    """Before, the package installed a stderr handler at import and the tuner's progress logger set
    its own level: records reached stderr whatever the application had decided."""
    quiet = _python(
        """
        import logging, megatron_tuning, megatron_tuning.tuning.tuner, megatron_tuning.score.measure
        for name, log in logging.root.manager.loggerDict.items():
            if name.startswith("megatron_tuning") and isinstance(log, logging.Logger):
                assert log.level == logging.NOTSET, name
                assert all(type(h) is logging.NullHandler for h in log.handlers), (name, log.handlers)
        package = logging.getLogger("megatron_tuning")
        assert [type(h) for h in package.handlers] == [logging.NullHandler]
        logging.getLogger("megatron_tuning.tables.search").warning("not shown: no logging setup")
        logging.getLogger("megatron_tuning.tuning.tuner.progress").info("not shown either")
        logging.getLogger("megatron_tuning.score.measure.progress").info("nor this")
        """
    )
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    configured = _python(
        """
        import logging, sys, megatron_tuning
        logging.basicConfig(level=logging.INFO, format="APP %(name)s %(message)s", stream=sys.stderr)
        logging.getLogger("megatron_tuning.runtime.interception").info("kernel k -> BLOCK=64")
        """
    )
    assert configured.returncode == 0
    assert configured.stderr == "APP megatron_tuning.runtime.interception kernel k -> BLOCK=64\n"  # once


def test_a_notice_at_exit_names_the_script_that_ran(tmp_path: Path):
    """No frame of the user's runs at exit, and CPython has removed ``__main__.__file__`` by then
    (once a script returns): the notice named megatron_tuning's own file, line 0, before."""
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """
            import atexit, functools
            from megatron_tuning.core.notices import report_policy_end
            from megatron_tuning.core.notices import tally
            for n in (1, 2):
                tally(("cheapest", "k:f"), f"n={n}")
            atexit.register(functools.partial(report_policy_end, None))  # a close at exit does this
            """
        )
    )
    ran = subprocess.run(
        [sys.executable, str(script)],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert f"{script}:0: TuningWarning: megatron_tuning: 2 keys of 1 kernel(s)" in ran.stderr, ran.stderr
    assert "megatron_tuning/core" not in ran.stderr
    ran = _python(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")  # no file: -c
    assert "<string>:0: TuningWarning: megatron_tuning: 2 keys of 1 kernel(s)" in ran.stderr, ran.stderr


def test_once_per_cause_until_reset(notices):
    assert warn_once(("a",), "first %s", "x") is True
    assert warn_once(("a",), "first %s", "x") is False
    assert warn_once(("b",), "second") is True
    assert notices.messages == ["megatron_tuning: first x", "megatron_tuning: second"]
    reset_warnings()  # a new policy: it reports again
    assert warn_once(("a",), "first %s", "x") is True
    assert len(notices.messages) == 3


def test_an_error_filter_raises_every_time_not_only_the_first():
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuningWarning)
        for _ in range(2):
            with pytest.raises(TuningWarning, match="megatron_tuning: kernel k"):
                warn_once(("strict",), "kernel k falls back")


def test_the_notice_points_at_the_callers_file(notices):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_once(("where",), "here")
    assert caught[0].filename == __file__ and caught[0].category is TuningWarning


def test_tallies_count_distinct_items_per_group_until_reset():
    assert tally(("cheapest", "k:a"), "n=1") == 1
    assert tally(("cheapest", "k:a"), "n=1") == 1
    assert tally(("cheapest", "k:a"), "n=2") == 2
    tally(("nearest", "k:b"), "n=1")
    assert tallies("cheapest") == {("cheapest", "k:a"): frozenset({"n=1", "n=2"})}
    reset_warnings()
    assert tallies("cheapest") == {}


RANK_LOCAL_AND_JOB_WIDE = """
    from megatron_tuning.core import notices
    notices.cheapest_used("candidate_1:kern", "n=1", "no table entry", "cheapest", "BLOCK=16", 3, "tune it")
    notices.warn_once(("job-wide",), "a cause every rank meets")
"""


def test_a_notice_only_this_rank_may_meet_reaches_stderr_on_a_rank_other_than_0():
    """Before, every notice on a rank other than 0 was an INFO record (no output by default): a rank
    whose lookup fell back (its kernel id under its own module name) said nothing anywhere."""
    result = _python(RANK_LOCAL_AND_JOB_WIDE, rank=1)
    assert result.returncode == 0, result.stderr
    # Each rank says it, so it names the rank: a job's merged log shows which ranks fell back.
    said = "TuningWarning: megatron_tuning: rank 1: kernel candidate_1:kern has no tuned config"
    assert said in result.stderr
    assert "a cause every rank meets" not in result.stderr  # said once per job, by rank 0
    assert "a cause every rank meets" in _python(RANK_LOCAL_AND_JOB_WIDE, rank=0).stderr


_FOUND = types.SimpleNamespace(
    origin="t.msgpack", numerics=types.SimpleNamespace(deterministic=False, alternatives=["BLOCK=8"])
)


def _fallback_on_two_keys() -> None:
    for n in (1, 2):
        tally(("cheapest", "m:k"), f"n={n}")
    notice.report_policy_end(None)


@pytest.mark.parametrize(
    ("say", "text"),
    [
        (
            lambda: notice.entry_matches_nothing("m:k", "n=1", "t.msgpack", "BLOCK=8", ["BLOCK=16"]),
            "matches none",
        ),
        (lambda: notice.ambiguous_entry("m:k", "m:k@0123456789ab", "n=1", "t.msgpack"), "several autotuners"),
        (lambda: notice.nearest_used("m:k", "n=1", "n=2", "t.msgpack", "tune it"), "nearest shape"),
        (
            lambda: notice.cheapest_used("m:k", "n=1", "no entry", "cheapest", "BLOCK=8", 2, "tune it"),
            "cheapest",
        ),
        (lambda: notice.cannot_measure("m:k", "n=1"), "nothing can be measured"),
        (lambda: notice.check_numerics("any", "m:k", "n=1", _FOUND, "BLOCK=16"), "non-deterministic"),
        (_fallback_on_two_keys, "2 keys of 1 kernel(s)"),
    ],
)
def test_causes_that_follow_from_this_ranks_kernels_and_lookups_are_said_on_every_rank(
    say, text, notices, monkeypatch
):
    monkeypatch.setenv("RANK", "1")
    say()
    assert notices.matching(text), notices.messages
