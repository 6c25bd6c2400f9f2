"""No module of the package is over 400 lines (docs/development.md, Layout): one concern per module, read
in one sitting. A module that grows past it is split by concern, not trimmed of its comments."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_tuning"
LIMIT = 400


def test_every_module_of_the_package_is_at_most_400_lines():
    sizes = {
        p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")
    }
    assert len(sizes) > 40  # the package was found
    assert {name: n for name, n in sizes.items() if n > LIMIT} == {}
