"""The retrieval benchmark's spacing diagnosis times each piece of a query's embedding under each spacing."""

import pytest

from benchmarks.retrieval import spacing_pieces
from models.minilm import MiniLMEmbedder

QUERY = "What does box 17 hold, and where is it?"


def test_spacing_pieces_on_the_cpu_report_each_piece_without_the_device():
    report = spacing_pieces(MiniLMEmbedder(device="cpu"), QUERY, repeats=4, gap_ms=30.0)
    assert report["gap_ms"] == 30.0 and report["repeats"] == 4
    assert set(report["extra_ms_by_condition"]) == {"spaced"}
    for name in ("back_to_back", "spaced"):
        pieces = report[name]
        assert set(pieces) == {"tokenize", "launch", "wait", "total"}
        assert all(0 <= p["p50"] <= p["p99"] for p in pieces.values())
        parts = pieces["tokenize"]["p50"] + pieces["launch"]["p50"] + pieces["wait"]["p50"]
        assert pieces["total"]["p50"] == pytest.approx(parts, rel=0.5)
    assert report["extra_ms"] == report["extra_ms_by_condition"]["spaced"]
    assert report["extra_ms"]["total"] == pytest.approx(
        report["spaced"]["total"]["p50"] - report["back_to_back"]["total"]["p50"], abs=1e-3
    )


@pytest.mark.gpu
def test_spacing_pieces_on_cuda_add_the_kept_warm_gaps_and_the_device_time():
    report = spacing_pieces(MiniLMEmbedder(device="cuda"), QUERY, repeats=4, gap_ms=30.0)
    assert set(report["extra_ms_by_condition"]) == {"spaced", "spaced_gpu_kept_warm", "spaced_cpu_kept_busy"}
    for name in ("back_to_back", *report["extra_ms_by_condition"]):
        assert 0 < report[name]["device"]["p50"] <= report[name]["total"]["p50"]
