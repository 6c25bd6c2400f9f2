"""coverage_of: each decision source gets its own status, auto's included."""

from __future__ import annotations

from megatron_tuning.core.decisions import Decision
from megatron_tuning.tables.coverage import coverage_of


def test_auto_sources_are_reported_apart():
    sig = "BLOCK=64, num_warps=4, num_stages=3"
    rank0 = [
        Decision(kernel="k:a", key="n=1 | x:f", signature=sig, source="tuned", rank=0),
        Decision(kernel="k:a", key="n=3 | x:f", signature=sig, source="nearest", rank=0, origin="t.msgpack"),
        Decision(kernel="k:a", key="n=5 | x:f", signature=sig, source="cheapest", rank=0),
    ]
    rank1 = [
        Decision(kernel="k:a", key="n=1 | x:f", signature=sig, source="adopted", rank=1, origin="rank 0"),
        Decision(kernel="k:a", key="n=3 | x:f", signature=sig, source="nearest", rank=1, origin="t.msgpack"),
        Decision(kernel="k:a", key="n=5 | x:f", signature=sig, source="cheapest", rank=1),
    ]
    coverage = coverage_of([("r0.json", rank0), ("r1.json", rank1)])
    assert dict(coverage.counts()) == {"tuned": 1, "adopted": 1, "nearest": 2, "fallback": 2}
    assert coverage.diverged() == []
    report = coverage.report()
    assert "tuned: rank(s) 0; adopted: rank(s) 1" in report
    assert "Summary (kernel/key x rank): tuned 1, adopted 1, nearest 2, fallback 2" in report
