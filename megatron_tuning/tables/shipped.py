"""Where the shipped tuning tables live, in a source checkout and in every install mode.

The tables are kept in the repository's top-level ``configs/`` folder (``configs/sm90/...``).
A regular ``pip install .`` copies that folder into the package as ``megatron_tuning/_configs``
(see ``setup.py``); a source checkout or ``pip install -e .`` leaves it where it is.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # megatron_tuning/


def shipped_tables_dir() -> Path:
    """Return the folder that holds the per-arch table folders (``sm90/`` and so on).

    The installed copy wins over the checkout so that an installed wheel never picks up a
    stray ``configs/`` folder next to ``site-packages``. The returned folder may not exist
    when no table was shipped; callers treat that as "no shipped tables".
    """
    installed = _PACKAGE_DIR / "_configs"
    if installed.is_dir():
        return installed
    checkout = _PACKAGE_DIR.parent / "configs"
    # Only trust a sibling configs/ folder inside a source tree (setup.py next to it), never
    # an unrelated folder of that name in site-packages.
    if checkout.is_dir() and (_PACKAGE_DIR.parent / "setup.py").is_file():
        return checkout
    return installed
