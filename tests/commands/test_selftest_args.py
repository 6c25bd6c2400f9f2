"""``selftest``'s options: a bad value is a usage error (exit 2, one line), never a traceback or "FAILED"."""

from __future__ import annotations

import pytest

from megatron_tuning.commands import build_parser, selftest


@pytest.mark.parametrize(
    "argv, shown",
    [
        (["--timeout", "nan"], "argument --timeout: expected a number of seconds above 0"),
        (["--timeout", "inf"], "argument --timeout: expected a number of seconds above 0"),
        (["--timeout", "-1"], "argument --timeout: expected a number of seconds above 0"),
        (["--timeout", "0"], "argument --timeout: expected a number of seconds above 0"),
        (["--timeout", "soon"], "argument --timeout: expected a number of seconds, not 'soon'"),
        (["--nproc", "1"], "argument --nproc: must be at least 2"),
        (["--nproc", "two"], "argument --nproc: expected an integer number of ranks"),
    ],
)
def test_a_bad_option_is_a_usage_error_before_any_job(
    capsys: pytest.CaptureFixture[str], argv: list[str], shown: str
) -> None:
    words = ["selftest", *argv]
    with pytest.raises(SystemExit) as info:  # parsing only: no job can start
        build_parser(words).parse_args(words)
    err = capsys.readouterr().err
    assert info.value.code == 2 and shown in err and "Traceback" not in err


def test_good_values_are_accepted() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    selftest.add_selftest(parser)
    args = parser.parse_args(["--timeout", "2.5", "--nproc", "3"])
    assert (args.timeout, args.nproc) == (2.5, 3)


def test_a_dash_dash_without_a_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    words = ["selftest", "--"]
    assert selftest.run_selftest(build_parser(words).parse_args(words)) == 2  # an IndexError before
    assert "give the command to run after `--`" in capsys.readouterr().err
