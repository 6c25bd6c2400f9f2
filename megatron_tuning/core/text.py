"""Text shown to a person: control and format characters escaped, so data cannot rewrite the screen.

Keys, kernel ids, notes and meta come from files other people (or tools) wrote. Printed raw, a
``\\r`` or an ANSI sequence such as ``\\x1b[2K`` could overwrite what a reviewer sees in ``show``
or ``diff``, and a bidi override (U+202E) could reorder it. Human output passes every such field
through ``printable``; JSON output stays exact (``json.dumps`` escapes control characters itself).
"""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with every non-printable character (``str.isprintable``) written as an escape."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"
