"""The note-ahead benchmark lays out real chats through `MemoryEngine.chat` (the bundled tokenizer, a real fact
store) in each of its conditions, and every chat reaches the engine."""

import pytest

from benchmarks.chat_ahead import measure, replica

pytestmark = [pytest.mark.vllm, pytest.mark.model]  # imports vLLM; reads the bundled model's tokenizer


def test_each_condition_times_chats_that_reach_the_engine(tmp_path):
    engine, reached = replica(tmp_path, facts=5)
    for gap, ahead in ((2.0, None), (30.0, 1.0)):
        times = measure(engine, reached, 5, gap, ahead, repeats=3)
        assert 0 < times["p50"] <= times["p99"] < 1000
    assert engine._last["acme"].facts[0].record_id == "fact-000"  # the last chat kept, for the next note
    assert not engine._splits  # every prepared question was taken by its chat
