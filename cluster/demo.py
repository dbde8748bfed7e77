"""The local demo: one built-in conversation, its facts encoded once, three questions answered twice.

Prompt injection pastes the facts into the prompt and prefills them; KV injection reuses the facts'
precomputed K/V (context-window encoded, keys rotated to their positions) and prefills only the query.
"""

from __future__ import annotations

import logging
import time
from typing import TextIO

from config import Settings
from kvcore.compose import compose
from kvcore.conversation import Fact, FactLimits, Turn
from kvcore.encoding import EncodingJob, encode_jobs, plan_fact_jobs
from models.chat import TokenizerEncoder, build_frame
from models.loader import load_model
from models.transformers_adapter import HFKVForward, ReferenceEngine

log = logging.getLogger(__name__)

TENANT = "demo-user"
CONVERSATION = (
    Turn("Maya", "Hi! I just moved to Porto for a new job.", "2026-03-02"),
    Turn("Assistant", "Welcome to Porto! What is the new job?", "2026-03-02"),
    Turn("Maya", "I'm a marine biologist at the aquarium, studying octopuses.", "2026-03-02"),
    Turn("Assistant", "Fascinating. Do you have any pets at home?", "2026-03-02"),
    Turn("Maya", "Yes, a grey cat called Pixel. She hates the rain.", "2026-03-09"),
    Turn("Assistant", "Porto has plenty of rain! Anything else new?", "2026-03-09"),
    Turn("Maya", "I'm training for the Lisbon half marathon in October.", "2026-03-16"),
    Turn("Assistant", "Good luck! How is the training going?", "2026-03-16"),
    Turn("Maya", "Slowly. I'm allergic to peanuts, so energy bars are tricky.", "2026-03-16"),
)
FACTS = (
    Fact("job", "Maya works as a marine biologist at the aquarium in Porto.", 3),
    Fact("pet", "Maya has a grey cat called Pixel.", 5),
    Fact("race", "Maya is training for the Lisbon half marathon in October.", 7),
    Fact("allergy", "Maya is allergic to peanuts.", 9),
)
QUESTIONS = ("What is the name of Maya's cat?", "Where does Maya work?", "Which race is Maya training for?")


def run_demo(settings: Settings, *, max_new_tokens: int, out: TextIO) -> None:
    """Load the model, encode the facts once, then answer each question by both routes."""
    loaded = load_model(settings.model)
    tokenizer = loaded.tokenizer
    frame = build_frame(tokenizer, settings.system_prompt)
    forward, engine = HFKVForward(loaded), ReferenceEngine(loaded)
    window = settings.encoding.window
    limits = FactLimits(settings.encoding.max_fact_chars, settings.encoding.max_fact_tokens)

    started = time.perf_counter()
    jobs = plan_fact_jobs(
        CONVERSATION,
        FACTS,
        window=window,
        prefix_ids=frame.prefix_ids,
        tokenizer=TokenizerEncoder(tokenizer),
        limits=limits,
    )
    jobs.append(EncodingJob("system-prefix", (), frame.prefix_ids))
    records = encode_jobs(jobs, forward, loaded.spec, tenant_id=TENANT, window=window, dtype=loaded.dtype)
    prefix, facts = records[-1], records[:-1]
    print(
        f"model {loaded.path.name} ({loaded.spec.fingerprint}), {len(facts)} facts encoded with window w={window} "
        f"in {time.perf_counter() - started:.2f}s",
        file=out,
    )
    memory = compose(facts, prefix)

    saved_total = 0
    for question in QUESTIONS:
        query = frame.query_ids(tokenizer, question)
        prompt = list(memory.token_ids) + query
        plain = _one_line(tokenizer.decode(engine.generate_plain(prompt, max_new_tokens)))
        injected = _one_line(tokenizer.decode(engine.generate_injected(memory, query, max_new_tokens)))
        saved_total += len(prompt) - len(query)
        print(f"\nQ: {question}", file=out)
        print(f"  prompt injection (prefills {len(prompt)} tokens): {plain}", file=out)
        print(f"  KV injection     (prefills {len(query)} tokens): {injected}", file=out)
        print(f"  prefill tokens saved: {len(prompt) - len(query)} of {len(prompt)}", file=out)
    print(f"\ntotal prefill tokens saved over {len(QUESTIONS)} questions: {saved_total}", file=out)


def _one_line(text: str) -> str:
    return " ".join(text.split())
