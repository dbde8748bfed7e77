"""Encode calls to an LLM replica stay under Serve's gRPC message limit, whatever a request adds."""

from __future__ import annotations

from deployments.fact_encoding import ENCODE_CALL_BYTES, by_size


def test_work_is_cut_in_order_into_calls_under_the_limit():
    work = [(f"f{i}", 1, "x" * 300) for i in range(10)]
    parts = by_size(work, 1000)
    assert [len(p) for p in parts] == [3, 3, 3, 1]
    assert [item for part in parts for item in part] == work
    assert all(sum(len(t) for _, _, t in part) <= 1000 for part in parts)


def test_a_text_longer_than_the_limit_goes_alone_and_nothing_is_dropped():
    work = [("a", 1, "é" * 600), ("b", 1, "y" * 10), ("c", 2, "z" * 10)]  # 1,200 bytes in UTF-8
    assert by_size(work, 1000) == [[work[0]], work[1:]]
    assert by_size([], 1000) == []
    assert ENCODE_CALL_BYTES <= 2 << 20  # well under the 4 MiB gRPC limit, with room for the pickling
