"""Agreement checks across real torchrun ranks (gloo, CPU, Triton interpreter; NCCL on every GPU).

One torchrun job per world size (and, where two or more GPUs exist, one NCCL job with one rank
per visible GPU) runs every scenario of ``workers/agreement_worker.py`` in order (a job costs ~5 s
of start-up; scenarios cost milliseconds), then each test asserts on one scenario's per-rank
results. Every detector has a run that must fire and one that must stay quiet.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from _launch import WORKERS, gloo_available, gpu_count, read_results, run_torchrun

from megatron_tuning.core.errors import FIX_A_CONFIG_LIST
from megatron_tuning.distributed.verify import MAX_NAMED

CONFIG_LIST_SCENARIOS = [
    "config_list_store_deterministic",
    "config_list_allgather_deterministic",
    "config_list_verify_deterministic",
    "config_list_store_chaos",
    "config_list_store_auto",
]
SCENARIOS = [
    "store_agree",
    "store_chaos",
    "allgather_agree",
    "allgather_chaos",
    "allgather_order",
    "verify_agree",
    "verify_chaos",
    "asymmetric_store",
    "asymmetric_verify",
    "allgather_missing",
    "capture_deferred",
    "kernels_asymmetric",
    "kernels_factory",
    "kernels_store_deterministic",
    "kernels_store_chaos",
    "kernels_allgather_deterministic",
    "kernels_allgather_chaos",
    "kernels_off_deterministic",
    "kernels_off_chaos",
    "kernels_verify_deterministic",
    "kernels_verify_chaos",
    "verify_tp",
    "verify_pp",
    "verify_varlen",
    "verify_chaos_tp",
    "verify_chaos_strided",
    "verify_chaos_pair",
    "verify_close_chaos",
    *CONFIG_LIST_SCENARIOS,
]
GPU_SCENARIOS = ["cuda_graph_agree", "cuda_graph_chaos"]  # real CUDA graph capture
MISSING_TIMEOUT_S = 2.0  # the allgather_missing scenario's agreement timeout

Results = dict[int, dict[str, dict[str, Any]]]


@pytest.fixture(
    scope="module",
    params=[("gloo", 2), ("gloo", 4), ("nccl", 0)],
    ids=lambda p: f"{p[0]}-{p[1] or 'all'}ranks",
)
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Results]:
    backend, nproc = request.param
    if not gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if backend == "nccl":  # one rank per visible GPU: the largest world size the machine has
        nproc = gpu_count()
        if nproc < 2:
            pytest.skip("the NCCL run needs 2 or more GPUs")
    tmp = tmp_path_factory.mktemp(f"agreement_{backend}_{nproc}")
    scenarios = SCENARIOS + (GPU_SCENARIOS if backend == "nccl" else [])
    args = ["--out", str(tmp), "--scenarios", ",".join(scenarios), "--backend", backend]
    done = run_torchrun(
        nproc, WORKERS / "agreement_worker.py", args, tmp, timeout_s=240, interpret=backend == "gloo"
    )
    results = read_results(tmp, nproc)
    assert done.returncode == 0 and len(results) == nproc, done.stdout[-3000:] + done.stderr[-3000:]
    return nproc, results


def _scenario(job: tuple[int, Results], name: str) -> list[dict[str, Any]]:
    nproc, results = job
    if name not in results[0]:
        pytest.skip(f"scenario {name} needs GPUs")
    rows = [results[rank][name] for rank in range(nproc)]
    for row in rows:
        assert "traceback" not in row, row["traceback"]
    return rows


@pytest.mark.parametrize(
    "name",
    [
        "store_agree",
        "allgather_agree",
        "verify_agree",
        "asymmetric_store",
        "asymmetric_verify",
        "kernels_asymmetric",
        "kernels_factory",
        "kernels_store_deterministic",
        "kernels_allgather_deterministic",
        "kernels_off_deterministic",
        "kernels_verify_deterministic",
        "verify_tp",
        "verify_pp",
        "verify_varlen",
    ],
)
def test_agreeing_ranks_raise_nothing(job: tuple[int, Results], name: str) -> None:
    rows = _scenario(job, name)
    assert [row["error"] for row in rows] == [None] * len(rows), rows[0].get("message") or rows


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("verify_agree", 3),
        ("kernels_off_deterministic", 3),
        ("asymmetric_verify", None),
        ("asymmetric_store", None),
        ("kernels_asymmetric", 1),
    ],
)
def test_verify_compares_only_shared_entries(
    job: tuple[int, Results], name: str, expected: int | None
) -> None:
    nproc = job[0]
    if expected is None:  # the shared kernel, plus stage_0/stage_1 once two ranks run each
        expected = 1 + (2 if nproc >= 4 else 0)
    assert [row["shared"] for row in _scenario(job, name)] == [expected] * nproc


def test_factory_kernels_in_opposite_orders_are_distinct_kernels(job: tuple[int, Results]) -> None:
    rows = _scenario(job, "kernels_factory")
    launched = rows[0]["launched"]
    assert all(row["launched"] == launched for row in rows)
    # Four kernel ids, each launching the cheapest of its own config list (BLOCK 16 or 32).
    blocks = sorted(
        (kernel.split(":")[1].split("@")[0], sig.split(",")[0]) for kernel, sig in launched.items()
    )
    assert blocks == [
        ("_lone_shift_body", "BLOCK=16"),
        ("_lone_shift_body", "BLOCK=32"),
        ("_make_shift.<locals>.made_shift", "BLOCK=16"),
        ("_make_shift.<locals>.made_shift", "BLOCK=32"),
    ], launched


def _named_ranks(message: str) -> set[int]:
    """Ranks a divergence message names: "Rank(s) [0, 4] ran ..." groups and "rank 3: ..." lines."""
    named = {int(r) for group in re.findall(r"Rank\(s\) \[([\d, ]+)\]", message) for r in group.split(",")}
    return named | {int(r) for r in re.findall(r"\brank (\d+)", message)}


@pytest.mark.parametrize(
    "name",
    [
        "store_chaos",
        "allgather_chaos",
        "verify_chaos",
        "kernels_store_chaos",
        "kernels_allgather_chaos",
        "kernels_off_chaos",
        "kernels_verify_chaos",
        "verify_close_chaos",
        "capture_deferred",
    ],
)
def test_divergence_is_raised_on_every_rank_with_one_message(job: tuple[int, Results], name: str) -> None:
    rows = _scenario(job, name)
    assert {row["error"] for row in rows} == {"DivergenceError"}, rows
    messages = {row["message"] for row in rows}
    assert len(messages) == 1, messages
    message, row = messages.pop(), rows[0]
    assert row["kernel"] in message and row["key"] in message
    assert len(row["ranks"]) >= 2
    # With more ranks than configs, chaos gives some ranks the same config: "Rank(s) [0, 4] ran ...".
    assert set(row["ranks"]) <= _named_ranks(message), message
    assert "diff:" in message


@pytest.mark.parametrize("name", ["kernels_store_chaos", "kernels_allgather_chaos", "kernels_off_chaos"])
def test_chaos_through_real_launches_names_the_kernel(job: tuple[int, Results], name: str) -> None:
    row = _scenario(job, name)[0]
    assert row["kernel"] in ("tests.support_kernels:add_kernel", "tests.support_kernels:scale_kernel")
    assert row["key"].startswith("n=64 | x_ptr:torch.float32")


def test_allgather_names_all_ranks_and_verify_names_all(job: tuple[int, Results]) -> None:
    nproc = job[0]
    for name in ("allgather_chaos", "verify_chaos", "kernels_allgather_chaos", "kernels_off_chaos"):
        assert _scenario(job, name)[0]["ranks"] == list(range(nproc)), name


def test_verify_names_a_bounded_number_of_entries(job: tuple[int, Results]) -> None:
    message = _scenario(job, "verify_chaos")[0]["message"]
    assert "13 of 14 shared entries differ" in message
    assert f"... and {13 - MAX_NAMED} more." in message
    # The earliest launched divergence leads: the log order, not digest order.
    assert "kernel synthetic.kernels:matmul with key M=64" in message.splitlines()[0]


def test_allgather_order_mismatch_is_named(job: tuple[int, Results]) -> None:
    rows = _scenario(job, "allgather_order")
    assert {row["error"] for row in rows} == {"DivergenceError"}
    assert len({row["message"] for row in rows}) == 1
    assert "Ranks reached different kernels at this check" in rows[0]["message"]
    assert "rank 1 was at kernel synthetic.kernels:kernel_1" in rows[0]["message"]


def test_rank_that_never_joins_allgather_is_named_within_timeout(job: tuple[int, Results]) -> None:
    nproc = job[0]
    rows = _scenario(job, "allgather_missing")
    assert rows[-1]["error"] is None  # the absent rank itself is not blamed
    for row in rows[:-1]:
        assert row["error"] == "AgreementTimeoutError", row
        assert row["missing_ranks"] == [nproc - 1]
        assert f"rank(s) [{nproc - 1}]" in row["message"]
        assert MISSING_TIMEOUT_S <= row["elapsed_s"] < MISSING_TIMEOUT_S + 5


def test_no_store_traffic_during_capture(job: tuple[int, Results]) -> None:
    rows = _scenario(job, "capture_deferred")
    for row in rows:
        assert row["store_calls_during_capture"] == 0
        assert row["pending"] == 1
    # The deferred checks run at verify_agreement; the first divergence they record is what every
    # rank raises, also a rank whose own deferred check passed.
    assert len({row["message"] for row in rows}) == 1
    assert "Found by the store check at first use." in rows[0]["message"]


def test_store_chaos_stops_every_rank_with_the_first_diagnosis(job: tuple[int, Results]) -> None:
    rows = _scenario(job, "store_chaos")
    assert "Found by the store check at first use." in rows[0]["message"]
    assert len(rows[0]["ranks"]) == 2  # the first claimer and the first rank that disagreed


def test_first_use_inside_a_real_cuda_graph_capture_is_checked_after_it(job: tuple[int, Results]) -> None:
    for row in _scenario(job, "cuda_graph_agree"):
        assert (row["error"], row["pending"], row["replay_ok"], row["shared"]) == (None, 1, True, 1), row
    rows = _scenario(job, "cuda_graph_chaos")
    assert {row["error"] for row in rows} == {"DivergenceError"}
    assert all(row["pending"] == 1 and row["replay_ok"] for row in rows)  # nothing raised mid-capture
    assert len({row["message"] for row in rows}) == 1
    assert "Found by the store check at first use." in rows[0]["message"]  # checked after the capture


def _raised(row: dict[str, Any]) -> str | None:
    """What a verify scenario raised on this rank: in verify_agreement, else at close."""
    return row.get("verify_error") or row["error"]


@pytest.mark.parametrize("name", ["verify_chaos_tp", "verify_chaos_strided", "verify_chaos_pair"])
def test_verify_mode_catches_chaos_on_every_rank(job: tuple[int, Results], name: str) -> None:
    rows = _scenario(job, name)
    if name == "verify_chaos_strided" and len(rows) < 4:  # one rank per stage: nothing shared differs
        assert [_raised(row) for row in rows] == [None] * len(rows), rows
        return
    assert [_raised(row) for row in rows] == ["DivergenceError"] * len(rows), rows
    for row in rows:
        message = row.get("verify_message") or row.get("message")
        assert "synthetic.kernels" in message and "key" in message


def test_verify_mode_sends_nothing_per_key_and_32_bytes_per_rank_when_all_agree(
    job: tuple[int, Results],
) -> None:
    for row in _scenario(job, "verify_tp"):
        assert row["requests_per_key"] == 0  # first use records and launches: no store request
        assert row["shared"] == 40
        # Identical logs: verify_agreement sends one 32-byte header per rank, no rows at all.
        assert row["verify_bytes"] == 32, row


def test_verify_sends_rows_only_where_logs_differ(job: tuple[int, Results]) -> None:
    """Pipeline stages: one representative per distinct log sends its rows, the others nothing."""
    rows = _scenario(job, "verify_pp")
    representatives = {0, 1}  # stage = rank % 2: ranks 0 and 1 stand for the two stages
    for rank, row in enumerate(rows):
        rows_sent = (row["verify_bytes"] - 32 - (16 + 8 * 24)) // 36  # header, summary, then rows
        assert rows_sent == (21 if rank in representatives else 0), (rank, row["verify_bytes"])


def test_the_check_at_close_catches_chaos_when_the_job_never_verifies(job: tuple[int, Results]) -> None:
    rows = _scenario(job, "verify_close_chaos")
    assert [row["error"] for row in rows] == ["DivergenceError"] * len(rows)
    assert all("Found by verify_agreement" in row["message"] and "key M=3" in row["message"] for row in rows)
    assert all(row["close_s"] < 30 for row in rows)


@pytest.mark.parametrize("name", CONFIG_LIST_SCENARIOS)
def test_ranks_whose_config_lists_differ_raise_naming_the_lists(job: tuple[int, Results], name: str) -> None:
    """Rank 0 offers one config more: each rank's records of the kernel carry its own list's digest,
    so they never pair; the comparison of the lists fires in every mode, chaos and auto included."""
    rows = _scenario(job, name)
    assert [_raised(row) for row in rows] == ["DivergenceError"] * len(rows), rows
    messages = {row.get("message") or row["verify_message"] for row in rows}
    if name.endswith("_chaos"):
        # Ranks sharing a list also differ by chaos, on purpose: which divergence is found first
        # depends on the order of the claims, and every rank raises the first one. So with more than
        # two ranks it may be the planted one: the control fired; a run without chaos names the lists.
        planted = {m for m in messages if "Ranks offer different config lists" not in m}
        assert all("Planted by chaos mode" in m for m in planted), planted
        if planted:
            return
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "Ranks offer different config lists for kernel tests.support_kernels:write_block_kernel" in message
    assert "only rank(s) [0]: BLOCK=256, num_warps=4" in message and "(none)" in message
    assert FIX_A_CONFIG_LIST in message and "Planted" not in message
