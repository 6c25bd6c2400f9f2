"""``render``: the text of one value in a key or a config signature, the same in every process."""

from __future__ import annotations

import pytest
import torch
from triton.runtime.jit import JITFunction

from megatron_tuning.core.key import render

from .. import support_kernels as sk


def relu(x):  # noqa: ANN001, ANN201
    return x


def gelu(x):  # noqa: ANN001, ANN201
    return x


class Act:
    def __call__(self, x):  # noqa: ANN001, ANN204
        return x


def test_a_function_renders_as_where_it_is_defined_not_as_its_address():
    assert render(relu) == f"function({__name__}:relu)"
    assert render(gelu) == f"function({__name__}:gelu)"
    assert render(Act().__call__) == f"method({__name__}:Act.__call__)"
    # A jit function: the interpreter's by its function; a compiled one keeps Triton's own repr.
    assert render(sk.negate) == f"{type(sk.negate).__name__}({sk.__name__}:negate)"
    assert render(JITFunction(relu)) == f"JITFunction({__name__}:relu)"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "None"),
        (True, "True"),
        (3, "3"),
        (2.5, "2.5"),
        ("x", "'x'"),
        ((1, 2), "(1, 2)"),
        (torch.zeros(2), "tensor([2], torch.float32)"),
        (Act, f"<class '{__name__}.Act'>"),
        (max, "<built-in function max>"),
        (Act(), "Act"),  # no name of its own: its type (identity refuses configs it would confuse)
    ],
)
def test_values_without_an_address_keep_their_text(value, text):  # noqa: ANN001
    assert render(value) == text
