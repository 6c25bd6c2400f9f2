"""``printable``: what a person sees is what the data holds, escaped where it could not be shown."""

from __future__ import annotations

from megatron_tuning.core.errors import printable


def test_printable_text_is_unchanged():
    for text in ("M=4096, N=8 | a_ptr:torch.float16", "é ü 漢字 🚀", ""):
        assert printable(text) is text


def test_control_format_and_separator_characters_are_escaped():
    assert printable("a\rb\x1b[2Kc") == "a\\x0db\\x1b[2Kc"
    assert printable("tab\there\nnewline") == "tab\\x09here\\x0anewline"
    assert printable("\u202egnp.exe") == "\\u202egnp.exe"  # right-to-left override
    assert printable("\u2028") == "\\u2028"  # line separator
    assert printable("\U000e0041") == "\\U000e0041"  # a tag character
