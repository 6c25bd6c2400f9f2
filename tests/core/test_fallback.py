"""The nearest-shape rule: which keys are comparable, log-space distance, ties, and purity."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tuning.core.fallback import (
    BRACKET_RATIO,
    key_distance,
    key_shape,
    nearest_keys,
    pick_neighbour,
    side_of,
)
from megatron_tuning.core.key import Key, Shown

BF16 = {"a_ptr": "torch.bfloat16", "b_ptr": "torch.bfloat16", "c_ptr": "torch.bfloat16"}


def mnk(m: int, n: int = 4096, k: int = 4096, dtypes: dict[str, str] = BF16) -> Key:
    return Key({"M": m, "N": n, "K": k}, dtypes)


def kx(**values: object) -> Key:
    """A key of ``values`` with one argument ``x`` of dtype ``f``."""
    return Key(values, {"x": "f"})  # type: ignore[arg-type]


def test_key_shape_splits_numbers_from_what_must_match():
    key = Key(
        {"M": 64, "flag": True, "scale": 0.25, "name": "a, b", "X": None, "t": Shown("inf")}, {"x": "f16"}
    )
    shape = key_shape(key)
    assert shape.numbers == (64.0, 0.25)
    assert shape.fixed == ("M=#", "flag=True", "scale=#", "name='a, b'", "X=None", "t=inf", (("x", "f16"),))
    assert key_shape(Key({}, {"x": "f32"})) == key_shape(Key({}, {"x": "f32"}))  # no key= values


def test_only_numbers_may_differ():
    base = key_shape(mnk(1024))
    assert 0 < key_distance(base, key_shape(mnk(2048))) < float("inf")
    half = {"a_ptr": "torch.float16", "b_ptr": "torch.float16", "c_ptr": "torch.float16"}
    assert key_distance(base, key_shape(mnk(1024, dtypes=half))) == float("inf")
    assert key_distance(key_shape(kx(n=1, flag=True)), key_shape(kx(n=1, flag=False))) == float("inf")
    # True is not the number 1: a bool key never matches an int key.
    assert key_distance(key_shape(kx(flag=True)), key_shape(kx(flag=1))) == float("inf")
    assert key_distance(key_shape(kx(M=1, N=2)), key_shape(kx(N=1, M=2))) == float("inf")
    # A float is a number as an int is: 1.0 and 3 are comparable.
    assert key_distance(key_shape(kx(n=1.0)), key_shape(kx(n=3))) == 1.0


def test_distance_is_log_space():
    a, b, c = key_shape(kx(n=1)), key_shape(kx(n=3)), key_shape(kx(n=15))
    assert key_distance(a, b) == 1.0  # log2(2) vs log2(4)
    assert key_distance(b, c) == 2.0  # log2(4) vs log2(16)
    assert key_distance(key_shape(kx(n=0)), key_shape(kx(n=-1))) == 1.0  # defined at 0 and below


def test_nearest_keys_orders_by_distance_then_key_text():
    table = [mnk(m) for m in (1024, 2048, 4096, 8192, 16384)]
    assert nearest_keys(mnk(1536), table)[:2] == [mnk(2048), mnk(1024)]
    assert nearest_keys(mnk(12288), table)[0] == mnk(16384)
    assert nearest_keys(mnk(3072), table)[0] == mnk(4096)
    # n=3 sits at distance 1 from both n=1 and n=7: the key text breaks the tie.
    assert nearest_keys(kx(n=3), [kx(n=7), kx(n=1)]) == [kx(n=1), kx(n=7)]
    # The key itself and keys of another shape family are left out.
    assert nearest_keys(mnk(1024), [mnk(1024), mnk(64, dtypes={"a": "f"})]) == []


keys = st.lists(
    st.tuples(st.integers(0, 1 << 20), st.integers(1, 8192), st.sampled_from(["float16", "bfloat16"])),
    max_size=12,
).map(lambda rows: [Key({"M": m, "N": n}, {"a": f"torch.{d}"}) for m, n, d in rows])


@settings(max_examples=200, deadline=None)
@given(key=st.tuples(st.integers(0, 1 << 20), st.integers(1, 8192)), table=keys, seed=st.randoms())
def test_nearest_is_a_pure_function_of_table_and_key(key, table, seed):
    target = Key({"M": key[0], "N": key[1]}, {"a": "torch.float16"})
    expected = nearest_keys(target, table)
    shuffled = list(table) + list(table)  # order and duplicates of the table do not matter
    seed.shuffle(shuffled)
    assert nearest_keys(target, shuffled) == expected
    if expected:
        shape = key_shape(target)
        best = min(key_distance(shape, key_shape(k)) for k in table if k != target)
        assert key_distance(shape, key_shape(expected[0])) == best
        assert all(k.dtypes == (("a", "torch.float16"),) for k in expected)


def test_nearest_is_the_same_in_every_process():
    """Python salts str hashes per process; the order must not depend on them."""
    code = (
        "import json, sys; from megatron_tuning.core.fallback import nearest_keys; "
        "from megatron_tuning.core.key import Key; "
        "keys = [Key({'n': int(n)}, {'x': 'f'}) for n in sys.argv[1:]]; "
        "print(json.dumps(nearest_keys(keys[0], keys[1:])))"
    )
    outputs = set()
    for seed in ("1", "2", "3"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        done = subprocess.run(
            [sys.executable, "-c", code, "5", "1", "7", "3", "5", "9", "2", "6", "4", "8"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        outputs.add(done.stdout)
    assert len(outputs) == 1
    # log2(1 + n): 5 -> 2.585; 6 -> 2.807, 4 -> 2.322, 7 -> 3.0
    assert json.loads(outputs.pop())[:3] == ["n=6 | x:f", "n=4 | x:f", "n=7 | x:f"]


# --------------------------------------------------------------------------- bracketing entries


def _pick(key: Key, configs: dict[Key, str]) -> Key | None:
    """``pick_neighbour`` fed as ``choose`` feeds it: usable neighbours, nearest first."""
    return pick_neighbour(key, {k: configs[k] for k in nearest_keys(key, configs)})


def test_between_two_disagreeing_entries_the_lower_one_is_used_while_at_most_twice_as_far():
    table = {mnk(1024): "a", mnk(2048): "b"}
    # 1536: 2048 is nearer (0.415 vs 0.585 in log2), but the lower entry is within 2x its distance.
    assert nearest_keys(mnk(1536), table)[0] == mnk(2048)
    assert _pick(mnk(1536), table) == mnk(1024)
    # 1800: the lower entry is 4.4x as far (0.81 vs 0.19): the nearer one wins, as before.
    assert _pick(mnk(1800), table) == mnk(2048)
    assert _pick(mnk(1200), table) == mnk(1024)  # the nearest is the lower entry anyway
    # With s(n) = log2(1 + n), n=1023 and n=2047 sit at 10 and 11; two thirds of the way up is
    # s = 10 + 2/3, i.e. n = 2 ** (32 / 3) - 1 = 1624.5.
    assert BRACKET_RATIO == 2.0
    pow2 = {kx(n=1023): "a", kx(n=2047): "b"}
    assert _pick(kx(n=1624), pow2) == kx(n=1023)
    assert _pick(kx(n=1625), pow2) == kx(n=2047)


def test_brackets_that_agree_or_a_missing_side_leave_the_nearest_entry():
    assert _pick(mnk(1536), {mnk(1024): "a", mnk(2048): "a"}) == mnk(2048)
    assert _pick(mnk(512), {mnk(1024): "a", mnk(2048): "b"}) == mnk(1024)  # nothing below
    assert _pick(mnk(3072), {mnk(1024): "a", mnk(2048): "b"}) == mnk(2048)  # nothing above
    assert _pick(mnk(1536), {}) is None


def test_only_an_entry_below_in_every_number_is_a_lower_bracket():
    # (1024, 8192) is below in M but above in N: mixed, so it is no bracket; (1024, 2048) is one.
    table = {mnk(2048, 4096): "b", mnk(1024, 8192): "c", mnk(1024, 2048): "a"}
    key = mnk(1536, 3072)
    assert side_of(key_shape(key), key_shape(mnk(1024, 8192))) is None
    assert side_of(key_shape(key), key_shape(mnk(1024, 2048))) == -1
    assert side_of(key_shape(key), key_shape(mnk(2048, 4096))) == 1
    assert _pick(key, table) == mnk(1024, 2048)


@settings(max_examples=300, deadline=None)
@given(
    key=st.tuples(st.integers(1, 1 << 16), st.integers(1, 64)),
    rows=st.lists(
        st.tuples(st.integers(1, 1 << 16), st.integers(1, 64), st.sampled_from("abc")), max_size=10
    ),
    seed=st.randoms(),
)
def test_the_bracketing_rule_is_pure_and_picks_the_nearest_or_the_lower_bracket(key, rows, seed):
    target = Key({"M": key[0], "N": key[1]}, {"a": "f"})
    configs = {Key({"M": m, "N": n}, {"a": "f"}): c for m, n, c in rows}
    picked = _pick(target, configs)
    shuffled = list(configs.items())
    seed.shuffle(shuffled)
    assert _pick(target, dict(shuffled)) == picked  # table order does not matter
    ordered = nearest_keys(target, configs)
    if not ordered:
        assert picked is None
        return
    shape = key_shape(target)
    below = [k for k in ordered if side_of(shape, key_shape(k)) in (-1, 0)]
    assert picked in (ordered[0], below[0] if below else None)
    if picked != ordered[0]:  # the rule moved the choice: only for disagreeing brackets
        assert side_of(shape, key_shape(ordered[0])) == 1 and configs[picked] != configs[ordered[0]]
        near, low = (key_distance(shape, key_shape(k)) for k in (ordered[0], picked))
        assert low <= BRACKET_RATIO * near
    if len(set(configs.values())) == 1:
        assert picked == ordered[0]
