"""docs/launcher.md: every command it shows still parses (options renamed in code fail here)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from megatron_tuning import commands as cli

DOC = Path(__file__).resolve().parents[2] / "docs" / "launcher.md"


def _documented_commands() -> list[list[str]]:
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value prefixes
                words.pop(0)
            if words[:3] == ["python", "-m", "megatron_tuning"]:
                commands.append(words[3:])
    return commands


def test_the_doc_shows_commands() -> None:
    commands = _documented_commands()
    assert len(commands) >= 10 and {c[0] for c in commands} >= {"run", "enable", "disable"}


@pytest.mark.parametrize("argv", _documented_commands(), ids=" ".join)
def test_every_documented_command_parses(argv: list[str]) -> None:
    args = cli.build_parser(argv).parse_args(argv)
    assert args.command == argv[0] and args.handler is not None
