"""auto mode across real torchrun ranks (gloo, CPU, Triton interpreter).

Ranks race to tune the same keys with a fake measurement that picks a different config on every
rank, arriving in rank order, in reverse, all at once, and with one rank 5 s late, at 2 and 4 ranks.
Every rank must launch one config per key (the first publisher's), no rank may wait for another's
tuning, and a second job reading the cache the first one wrote measures nothing. At 2 ranks, ranks
whose caches differ (one holds the keys; the other's is empty, corrupt, a folder or off) still
launch one config per key, a default-size cache (50,000 entries) starts the job, and one kernel file
loaded under a per-rank module name is tuned once per job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _launch import WORKERS, gloo_available, read_results, run_torchrun

from megatron_tuning.core.key import Key
from megatron_tuning.tables.entry import Entry
from megatron_tuning.tables.table import Table, load_table, save_table

RACES = ["forward", "reverse", "together", "slow_rank"]
SPLITS = ["split_empty", "split_corrupt", "split_folder", "split_off"]
KERNEL = "tests.support_kernels:add_kernel"


def add_key(n: int) -> Key:
    return Key({"n": n}, {"x_ptr": "torch.float32", "y_ptr": "torch.float32"})


def full_cache(path: Path) -> Path:
    """A cache at the default cap: 50,000 entries of the add kernel (n = 1 to 50,000; small launches,
    since the interpreter runs every program of them)."""
    config = {"kwargs": {"BLOCK": 128}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
    entries = [
        Entry(arch="unknown", kernel=KERNEL, key=add_key(1 + i), config=config, how="tuned")
        for i in range(50_000)
    ]
    save_table(Table(entries, meta={"kind": "auto-cache", "cache_format": "1"}), path)
    return path


def _jobs(nproc: int, tmp: Path, plan: list[tuple[str, list[str]]]) -> dict[str, Any]:
    """Run each (run name, scenarios) of ``plan`` as a torchrun job of ``nproc`` ranks sharing one cache."""
    if not gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    cache = tmp / "cache" / "auto.msgpack"
    table = tmp / "rank0_table.msgpack"
    config = {"kwargs": {"BLOCK": 128}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
    save_table(
        Table([Entry(arch="unknown", kernel=KERNEL, key=add_key(501), how="hand", config=config)]), table
    )
    out: dict[str, Any] = {}
    big = (
        full_cache(tmp / "full.msgpack") if any("full_cache" in scenarios for _, scenarios in plan) else None
    )
    for run, scenarios in plan:
        folder = tmp / run
        folder.mkdir()
        args = ["--out", str(folder), "--cache", str(cache), "--scenarios", ",".join(scenarios)]
        args += ["--table", str(table)] + (["--full-cache", str(big)] if big else [])
        if run == "run2":  # run 2 only reads the cache: a late rank proves nothing there
            args += ["--slow-s", "0"]
        done = run_torchrun(nproc, WORKERS / "auto_worker.py", args, tmp, timeout_s=240)
        results = read_results(folder, nproc)
        assert done.returncode == 0 and len(results) == nproc, done.stdout[-3000:] + done.stderr[-3000:]
        out[run] = results
    out["nproc"], out["cache"] = nproc, cache
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """2 ranks, two jobs: run 1 races, and runs the split-cache and table scenarios; run 2 reads the cache."""
    plan = [("run1", RACES + ["table_vs_published", *SPLITS, "full_cache", "module_names"]), ("run2", RACES)]
    return _jobs(2, tmp_path_factory.mktemp("auto_2"), plan)


@pytest.fixture(scope="module")
def races_at_4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """4 ranks, the races alone: three ranks adopt what one published."""
    return _jobs(4, tmp_path_factory.mktemp("auto_4"), [("run1", RACES)])


@pytest.fixture(params=["runs", "races_at_4"], ids=["2ranks", "4ranks"])
def races(request: pytest.FixtureRequest) -> dict[str, Any]:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


def rows(runs: dict[str, Any], run: str, scenario: str) -> list[dict[str, Any]]:
    return [runs[run][rank][scenario] for rank in range(runs["nproc"])]


@pytest.mark.parametrize("scenario", RACES)
def test_every_rank_launches_the_first_publishers_config(races, scenario):
    results = rows(races, "run1", scenario)
    assert all(r["error"] is None for r in results), [r.get("message") for r in results]
    by_key: dict[str, set[str]] = {}
    for r in results:
        assert len(r["decisions"]) == 3
        for d in r["decisions"]:
            by_key.setdefault(d["key"], set()).add(d["signature"])
    assert all(len(signatures) == 1 for signatures in by_key.values()), by_key
    # One rank tuned-and-published each key; every other rank adopted it (after measuring or not).
    for key in by_key:
        sources = sorted(d["source"] for r in results for d in r["decisions"] if d["key"] == key)
        assert sources == ["adopted"] * (races["nproc"] - 1) + ["tuned"], (key, sources)
    assert all(r["shared"] == 3 for r in results)  # verify_agreement compared all three keys


def test_adoptions_name_the_publishing_rank(races):
    for scenario in RACES:
        for r in rows(races, "run1", scenario):
            for d in r["decisions"]:
                if d["source"] == "adopted":
                    assert d["origin"].startswith("rank ")


def test_ranks_arriving_later_adopt_what_is_already_published(races):
    # Rank r starts 0.3 s after rank r-1 and a fake tuning takes 0.2 s: rank 0 finds nothing
    # published and tunes every key; by the time the last rank arrives, at least the first key
    # is published, so it measures less (how much less depends on the machine's speed).
    results = rows(races, "run1", "forward")
    assert results[0]["measured"] == 3
    assert results[-1]["measured"] < 3


def test_no_rank_waits_for_a_late_ranks_tuning(races):
    results = rows(races, "run1", "slow_rank")
    late = results[-1]
    assert late["measured"] == 0  # it arrived 5 s late and adopted everything
    assert all(r["kernel_s"] < 4.0 for r in results[:-1]), [r["kernel_s"] for r in results]


def test_a_rank_with_a_table_the_others_lack_is_named_at_init_on_every_rank(runs):
    """Rank 0 alone has a table: its choices are not the others' pure function. Before the inputs
    check this was a DivergenceError at the first key the table pinned; now every rank is told,
    at init or at its next check, which input differs."""
    results = rows(runs, "run1", "table_vs_published")
    errors = {r["error"] for r in results}
    assert errors == {"InputMismatchError"}, [r.get("message") for r in results]
    assert all("tables:" in r["message"] and "rank 0:" in r["message"] for r in results)


def test_the_cache_holds_every_tuned_key_and_run_two_measures_nothing(runs):
    cached = {e.key for e in load_table(runs["cache"])}
    for scenario in RACES:
        for r in rows(runs, "run1", scenario):
            assert {d["key"] for d in r["decisions"]} <= cached
    for scenario in RACES:
        results = rows(runs, "run2", scenario)
        assert all(r["error"] is None and r["measured"] == 0 for r in results)
        assert all(d["source"] == "table" for r in results for d in r["decisions"])
        assert all(d["origin"] == str(Path(runs["cache"])) for r in results for d in r["decisions"])


@pytest.mark.parametrize("scenario", SPLITS)
def test_ranks_whose_caches_differ_launch_the_one_config_rank_zero_proposed(runs, scenario):
    results = rows(runs, "run1", scenario)
    assert all(r["error"] is None for r in results), [r.get("message") for r in results]
    assert {d["signature"] for r in results for d in r["decisions"]} == {
        "BLOCK=128, num_warps=4, num_stages=3"
    }
    first, others = results[0], results[1:]
    assert all(d["source"] == "table" and d["origin"].endswith("rank0.msgpack") for d in first["decisions"])
    for r in others:  # they found rank 0's proposal published: adopted, nothing measured
        assert r["measured"] == 0 and all(
            (d["source"], d["origin"]) == ("adopted", "rank 0") for d in r["decisions"]
        )
    assert all(r["shared"] == 3 for r in results)


def test_a_default_size_cache_starts_a_multi_rank_job(runs):
    results = rows(runs, "run1", "full_cache")
    assert all(r["error"] is None and r["measured"] == 0 for r in results), [
        r.get("message") for r in results
    ]
    assert all(d["source"] == "table" for r in results for d in r["decisions"])


def test_one_file_under_per_rank_module_names_is_tuned_once_per_job(runs):
    """An eval pipeline's ``spec_from_file_location(f"candidate_{rank}", path)``: auto's decisions
    key on content, so one rank tunes each key and the others adopt it."""
    results = rows(runs, "run1", "module_names")
    assert all(r["error"] is None for r in results), [r.get("message") for r in results]
    for n in (0, 1, 2):
        decisions = [r["decisions"][n] for r in results]
        assert len({d["signature"] for d in decisions}) == 1, decisions
        assert sorted(d["source"] for d in decisions) == ["adopted", "tuned"], decisions
    # The agreement check keeps module names (one process may hold two, rightly pinned apart):
    # per-rank names share no entry there; the consensus above is what makes them agree.
    assert all(r["shared"] == 0 for r in results)
