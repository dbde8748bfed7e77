"""The history-TTFT report and what the benchmark serves: its ratios and targets, each tenant's history, and random
early layers a model shape's question pass can read."""

import json
from pathlib import Path

import pytest
import torch

from benchmarks._cluster import write_early_layers
from benchmarks.history_ttft import by_arena, history_tail, summarize, tenant_history
from kvcore.query_pass import question_queries
from models.early_layers import load_early_layers

TINY = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "tiny-llama-shape.json"


def _row(mode: str, ttft: float, choose: dict | None = None) -> dict:
    return {
        "tenant": "t",
        "round": 0,
        "mode": mode,
        "ttft_ms": ttft,
        "engine_ttft_ms": ttft - 1,
        "engine_phases_ms": {"queue": 0.5, "step": ttft - 1.5},
        "prefilled_tokens": 10,
        "injected_tokens": 0,
        "history_chunks": 0,
        "choose_ms": choose,
    }


def test_the_targets_are_ratios_of_the_modes_medians():
    steps = {"index": 0.1, "question": 1.0, "retrieval": 0.5, "bounds": 2.0, "total": 3.6}
    rows = [_row("no_memory", t) for t in (10.0, 12.0, 11.0)]
    rows += [_row("history", t, steps) for t in (13.0, 15.0, 14.0)]
    rows += [_row("whole_prefill", 700.0)]
    report = summarize(rows, budget=2048)
    assert report["modes"]["history"]["ttft_ms_p50"] == 14.0 and report["modes"]["no_memory"]["ttft_ms_p50"] == 11.0
    assert report["modes"]["history"]["engine_phases_ms_p50"] == {"queue": 0.5, "step": 12.5}
    by_name = {t["name"]: t for t in report["targets"]}
    ratio = by_name["history TTFT at 2048 tokens / k = 0 TTFT (p50)"]
    assert ratio["value"] == pytest.approx(14 / 11, abs=1e-4) and ratio["met"]
    speedup = by_name["whole history prefilled / history mode, TTFT (p50)"]
    assert speedup["value"] == pytest.approx(50.0) and speedup["met"]
    assert report["history_choose_ms_p50"] == steps


def test_the_engine_floor_compares_history_mode_with_the_engines_own_cache_of_as_many_tokens():
    """`budget_cached` (the budget's tokens pasted and served by vLLM's prefix cache) sets the floor: k = 0's TTFT
    plus the cache's engine extra, over k = 0's TTFT; history mode's engine extra is set beside it."""
    rows = [_row("no_memory", t) for t in (10.0, 11.0, 12.0)]  # engine 9, 10, 11
    rows += [_row("history", t) for t in (15.0, 16.0, 17.0)]  # engine 15 (p50)
    rows += [_row("budget_cached", t) | {"prefix_cached_tokens": 2048} for t in (18.0, 19.0, 20.0)]  # engine 18
    report = summarize(rows, budget=2048)
    assert report["modes"]["budget_cached"]["prefix_cached_tokens_mean"] == 2048
    assert report["engine_floor"] == {
        "budget_cached_engine_extra_ms": 8.0,
        "history_engine_extra_ms": 5.0,
        "history_engine_over_cached": pytest.approx(15 / 18, abs=1e-4),
        "floor_over_k0": pytest.approx(19 / 11, abs=1e-4),
    }
    assert "engine_floor" not in summarize(rows[:6], budget=2048)  # no cached mode: no floor


def test_history_chats_are_set_apart_by_whether_their_history_was_all_in_the_arena():
    rows = [_row("history", t) | {"arena_share": 1.0} for t in (10.0, 12.0, 14.0)]
    rows += [_row("history", t) | {"arena_share": 0.25} for t in (30.0, 40.0)]
    rows += [_row("history", 99.0) | {"arena_share": None}]  # no placement read: in neither group
    found = by_arena(rows)
    assert found["arena_share_mean"] == pytest.approx((3 + 0.5) / 5)
    assert found["all_in_arena"] == {"requests": 3, "ttft_ms_p50": 12.0, "engine_ttft_ms_p50": 11.0}
    assert found["partly_below"] == {"requests": 2, "ttft_ms_p50": 35.0, "engine_ttft_ms_p50": 34.0}
    assert by_arena([_row("history", 5.0)]) == {"arena_share_mean": None}


def test_the_cached_tail_is_the_historys_last_budget_tokens(loaded):
    text, _ = tenant_history(loaded.tokenizer, 0, 600)
    tail = history_tail(loaded.tokenizer, text, 64)
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    assert text.endswith(tail) and abs(len(loaded.tokenizer.encode(tail, add_special_tokens=False)) - 64) <= 2
    assert loaded.tokenizer.encode(tail, add_special_tokens=False)[-10:] == ids[-10:]


def test_a_run_without_the_whole_prefill_sets_only_the_validity_and_first_targets():
    report = summarize([_row("no_memory", 10.0), _row("history", 20.0)], budget=64)
    assert [t["met"] for t in report["targets"]] == [True, False]


def test_chats_whose_loads_failed_make_the_run_invalid_by_target():
    """A history load that failed was recomputed by the engine (an H100 run with an arena too large for the card
    measured prefill as if it were injection): the report counts those chats, and the target fails."""
    failed = _row("history", 40.0) | {"injected_tokens": 0, "load_failed_tokens": 2048}
    report = summarize([_row("no_memory", 10.0), _row("history", 12.0), failed], budget=64)
    validity = report["targets"][0]
    assert validity["value"] == 1 and not validity["met"] and "failed to load" in validity["name"]


def test_each_tenant_has_a_history_of_its_own_of_about_the_asked_length(loaded):
    first, questions = tenant_history(loaded.tokenizer, 0, 600)
    second, _ = tenant_history(loaded.tokenizer, 1, 600)
    tokens = len(loaded.tokenizer.encode(first, add_special_tokens=False))
    assert 600 <= tokens < 700 and first != second and questions


def test_random_early_layers_of_a_shape_feed_the_question_pass(tmp_path):
    config = json.loads(TINY.read_text())
    write_early_layers(config, tmp_path / "model.safetensors", layers=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    early = load_early_layers(tmp_path, 2)
    queries = question_queries(early, [5, 17, 300])
    assert queries.shape == (2, config["num_attention_heads"], 3, config["head_dim"])
    assert torch.isfinite(queries).all() and queries.abs().max() > 0
