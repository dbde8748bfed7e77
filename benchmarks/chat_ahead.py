"""The LLM replica's layout of a chat after idleness, with and without a note sent ahead of it.

The real `MemoryEngine.chat` up to the engine (a stand-in engine behind it records when it is called): the
bundled model's tokenizer and chat frame, k = 50 records of 30 tokens in a real fact store. Chats are timed back
to back (2 ms apart), 30 ms apart as the serving benchmark's chats come (the core idle in between, its caches
cold), and 30 ms apart with the note that the ingress now sends at the start of a chat (`ChatAhead`:
`MemoryEngine.prepare` tokenizes the question and lays the tenant's last chat out again) `--ahead-ms` before it,
as retrieval keeps the ingress busy for about that long. Target: the layout with the note ahead <= 0.6x without it.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import parser, scratch_dir, target, write_report  # noqa: E402

QUESTIONS = ("What does the yellow box hold?", "Where is the red box kept?", "Who gave me the blue box?")


def replica(root: Path, facts: int):
    """A `MemoryEngine` with what a chat's layout touches (tokenizer, frame, store), its engine a stand-in that
    stamps the moment the chat reaches it."""
    from transformers import AutoTokenizer

    from config import load_settings
    from deployments.vllm_adapter.async_engine import MemoryEngine
    from kvcore.record import EncodingParams, FactKV
    from kvcore.rope import RopeConfig
    from kvcore.store import LocalFactStore
    from models.chat import build_frame
    from models.loader import model_path

    store = LocalFactStore(root)
    params = EncodingParams(
        window=0, model_fingerprint="b" * 24, rope=RopeConfig(head_dim=8, theta=1e4), dtype="float32"
    )
    shape = (2, 1, 30, 8)
    store.put_many(
        [
            FactKV(
                "acme", f"fact-{i:03d}", tuple(range(100 + i, 130 + i)), torch.zeros(shape), torch.zeros(shape), params
            )
            for i in range(facts)
        ]
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path(load_settings().model))
    engine = MemoryEngine.__new__(MemoryEngine)
    engine._store, engine._tier_root, engine.tokenizer = store, None, tokenizer
    engine._system_prompt = "You are a helpful assistant."
    engine._chat_frame = build_frame(tokenizer, engine._system_prompt)
    engine.prefix_ids, engine.frame_id = engine._chat_frame.prefix_ids, "chat-frame-bench"
    engine._frames, engine.max_model_len = {"acme": True}, 8192
    engine._splits, engine._last, engine._warm_ahead = OrderedDict(), OrderedDict(), True  # as a GPU replica does

    class Reached:
        at = 0.0

        async def generate(self, prompt, params, request_id):
            Reached.at = time.perf_counter()
            return
            yield

    engine._engine = Reached()
    return engine, Reached


def measure(engine, reached, facts: int, gap_ms: float, ahead_ms: float | None, repeats: int) -> dict[str, float]:
    """p50 and p99 (ms) from a chat's arrival to the engine, chats `gap_ms` apart, a note `ahead_ms` before each."""
    from deployments.chat_task import ChatAhead, ChatTask, RetrievedFact

    retrieved = tuple(RetrievedFact(f"fact-{i:03d}", f"fact {i}", f"fact-{i:03d}", 0.5) for i in range(facts))

    async def run() -> list[float]:
        times = []
        for i in range(repeats + 10):
            await asyncio.sleep(gap_ms / 1000)
            messages = (("user", QUESTIONS[i % len(QUESTIONS)]),)
            if ahead_ms is not None:
                engine.prepare(ChatAhead("acme", messages), idle=True)
                await asyncio.sleep(ahead_ms / 1000)
            started = time.perf_counter()
            async for _ in engine.chat(ChatTask("acme", 3, messages, retrieved, "inject", 16)):
                pass
            if i >= 10:
                times.append((reached.at - started) * 1000)
        return times

    times = sorted(asyncio.run(run()))
    return {"p50": round(statistics.median(times), 3), "p99": round(times[int(0.99 * (len(times) - 1))], 3)}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--facts", type=int, default=50)
    p.add_argument("--ahead-ms", type=float, default=1.5, help="how long before its chat the note comes")
    args = p.parse_args()
    repeats = 60 if args.quick else 300
    engine, reached = replica(Path(scratch_dir(prefix="chat-ahead-")), args.facts)
    layout = {}
    for name, gap, ahead in (
        ("back_to_back", 2.0, None),
        ("spaced_30ms", 30.0, None),
        ("spaced_30ms_note_ahead", 30.0, args.ahead_ms),
    ):
        layout[name] = measure(engine, reached, args.facts, gap, ahead, repeats)
    ratio = layout["spaced_30ms_note_ahead"]["p50"] / layout["spaced_30ms"]["p50"]
    write_report(
        args.out,
        {
            "facts": args.facts,
            "ahead_ms": args.ahead_ms,
            "repeats": repeats,
            "layout_ms": layout,
            "targets": [target("layout 30 ms apart, note ahead / none (p50)", ratio, "<= 0.6")],
        },
    )


if __name__ == "__main__":
    main()
