"""The row-set summaries a digest claim carries (``distributed/reconcile.py``): exact or nothing."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tuning.distributed import reconcile
from megatron_tuning.distributed.reconcile import INLINE, TABLE, cells_for, difference, summarize

ROWS = st.binary(min_size=32, max_size=32)


def _rows(rng: random.Random, count: int) -> list[bytes]:
    return [rng.randbytes(32) for _ in range(count)]


def test_small_batches_travel_as_rows_and_large_ones_as_a_table_a_quarter_their_size() -> None:
    assert summarize(_rows(random.Random(0), 10))[0] == INLINE
    kind, payload = summarize(_rows(random.Random(0), 2000))
    assert kind == TABLE and cells_for(2000) == 500
    assert len(payload) == 500 * reconcile.CELL < 2000 * 32 // 2


@pytest.mark.parametrize(
    ("count", "only_ours", "only_theirs"), [(2000, 100, 100), (2000, 1, 1), (300, 20, 0)]
)
def test_a_difference_within_the_tables_reach_is_recovered_exactly(
    count: int, only_ours: int, only_theirs: int
) -> None:
    rng = random.Random(count + only_ours)
    shared = _rows(rng, count - only_theirs)
    theirs, ours = shared + _rows(rng, only_theirs), shared + _rows(rng, only_ours)
    # One row of ours has their identity (first 16 bytes) and another signature: a divergence.
    ours[0] = theirs[0][:16] + rng.randbytes(16)
    found = difference(*summarize(theirs), count, ours)
    assert found is not None
    assert set(found.ours) == set(ours) - set(theirs) and len(found.ours) == only_ours + 1
    assert set(found.theirs) == set(theirs) - set(ours) and len(found.theirs) == only_theirs + 1


def test_batches_too_different_to_decode_say_so() -> None:
    rng = random.Random(3)
    theirs = _rows(rng, 2000)
    assert difference(*summarize(theirs), 2000, _rows(rng, 2000)) is None  # another pipeline stage
    chaos = [row[:16] + rng.randbytes(16) for row in theirs]  # same identities, other signatures
    assert difference(*summarize(theirs), 2000, chaos) is None


@settings(max_examples=60, deadline=None)
@given(
    shared=st.lists(ROWS, max_size=300, unique=True),
    only_theirs=st.lists(ROWS, max_size=40, unique=True),
    only_ours=st.lists(ROWS, max_size=40, unique=True),
)
def test_whatever_decodes_is_the_true_difference(
    shared: list[bytes], only_theirs: list[bytes], only_ours: list[bytes]
) -> None:
    theirs = list(dict.fromkeys(shared + only_theirs))
    ours = list(dict.fromkeys(shared + only_ours))
    if not theirs:
        return
    found = difference(*summarize(theirs), len(theirs), ours)
    if found is None:  # allowed past the table's reach; never a wrong answer
        assert summarize(theirs)[0] == TABLE
        return
    assert found.ours == sorted(set(ours) - set(theirs))
    assert found.theirs == sorted(set(theirs) - set(ours))


@settings(max_examples=60, deadline=None)
@given(ours=st.lists(ROWS, min_size=1, max_size=200, unique=True), noise=st.randoms(use_true_random=False))
def test_a_forged_table_never_hides_a_row_of_ours(ours: list[bytes], noise: random.Random) -> None:
    """Garbage of the right length decodes to nothing, or to rows that really are (not) ours."""
    count = 300
    payload = noise.randbytes(cells_for(count) * reconcile.CELL)
    found = difference(TABLE, payload, count, ours)
    if found is not None:
        assert set(found.ours) <= set(ours) and not set(found.theirs) & set(ours)


def test_a_summary_of_the_wrong_length_or_kind_is_refused() -> None:
    rows = _rows(random.Random(5), 100)
    kind, payload = summarize(rows)
    with pytest.raises(ValueError, match="a summary of 10 bytes for 100 rows"):
        difference(kind, payload[:10], 100, rows)
    with pytest.raises(ValueError, match="for 1000 rows"):
        difference(kind, payload, 1000, rows)
    with pytest.raises(ValueError, match="of kind b'X'"):
        difference(b"X", payload, 100, rows)
