"""Greedy equivalence of KV injection through vLLM against plain prefill, over many prompts.

Ten generated conversations (five turns each) are encoded jointly-exact (each turn behind all earlier
ones, Corollary 9), stored, and injected through InferscaleConnector; five questions each give 50
prompts (`--quick`: 2 x 5 on CPU). `--encoder engine` (default) encodes with the serving engine itself
(capture plans), `--encoder transformers` with the transformers reference model in the served dtype;
the gap between the two is the kernel rounding of two implementations of one model.
Each prompt is answered greedily by plain prefill and with injection, in the same engine. Reports the share of
identical greedy continuations and the largest logprob gap before any divergence. Records are stored as the
encoder made them (float32 from the engine) and, beside them under tenants of their own, rounded to bf16 as
`record_dtype` bf16 / `engine` stores them (the same one rounding of the pre-RoPE keys and the values):
`record_dtypes` compares both against plain prefill and each other, with their bytes in the store; and a third
copy as a store set to int8 holds the bf16 one (codes with a scale per layer, head and channel), against both.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import parser, scratch_dir, target, wilson, write_report  # noqa: E402
from kvcore.conversation import Fact, Turn  # noqa: E402
from kvcore.encoding import EncodingJob, encode_jobs, plan_fact_jobs  # noqa: E402
from kvcore.plan import MemoryPlan  # noqa: E402
from kvcore.record import FactKV  # noqa: E402
from kvcore.store import LocalFactStore  # noqa: E402

BF16 = "-bf16"  # the tenant suffix of the bf16 copies
INT8 = "-int8"  # and of their int8 codes, as a record store set to int8 holds them

PEOPLE = [
    ("Maya", "Porto", "marine biologist", "cat", "Pixel", "octopus stew", "tennis"),
    ("Tom", "Leeds", "train driver", "dog", "Biscuit", "ramen", "rugby"),
    ("Ines", "Seville", "architect", "parrot", "Kiwi", "paella", "padel"),
    ("Ravi", "Pune", "data engineer", "tortoise", "Shelly", "dosa", "cricket"),
    ("Lena", "Graz", "violin teacher", "rabbit", "Clover", "apple strudel", "skiing"),
    ("Omar", "Tunis", "pharmacist", "cat", "Saffron", "couscous", "football"),
    ("Sofia", "Turin", "chef", "dog", "Nebbia", "risotto", "cycling"),
    ("Ken", "Sapporo", "pilot", "goldfish", "Bubbles", "miso ramen", "judo"),
    ("Ada", "Lagos", "nurse", "dog", "Tiger", "jollof rice", "basketball"),
    ("Luis", "Quito", "geologist", "llama", "Pancho", "ceviche", "climbing"),
]


def conversation(person) -> tuple[list[Turn], list[str]]:
    name, city, job, kind, pet, food, sport = person
    turns = [
        Turn(name, f"I moved to {city} last year to work as a {job}."),
        Turn("Assistant", "That sounds exciting! How are you settling in?"),
        Turn(name, f"Well, thanks. I also have a {kind} called {pet}."),
        Turn("Assistant", f"{pet} is a lovely name."),
        Turn(name, f"My favourite food is {food}, and I play {sport} at weekends."),
    ]
    questions = [
        f"Which city does {name} live in?",
        f"What is {name}'s job?",
        f"What is the name of {name}'s {kind}?",
        f"What is {name}'s favourite food?",
        f"Which sport does {name} play?",
    ]
    return turns, questions


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--encoder", choices=["engine", "transformers"], default="engine")
    args = p.parse_args()
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # this process may touch CUDA first
    gpu = torch.cuda.is_available()
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    people = PEOPLE[:2] if args.quick else PEOPLE

    from vllm import SamplingParams

    from config import load_settings
    from config.connector import ConnectorConfig
    from deployments.vllm_adapter.engine import build_llm, capture_request, memory_request
    from kvcore.plan import CapturePlan, CaptureSpan
    from models.chat import TokenizerEncoder, build_frame
    from models.loader import load_model
    from models.transformers_adapter import HFKVForward

    settings = load_settings()
    reference = load_model(settings.model.model_copy(update={"dtype": dtype}))  # the weights vLLM serves
    served = reference.path
    if gpu:
        reference.model.to("cuda")
    fingerprint = reference.spec.fingerprint  # the same for every dtype of these weights
    frame = build_frame(reference.tokenizer, settings.system_prompt)
    forward = HFKVForward(reference)
    store = LocalFactStore(Path(scratch_dir(prefix="facts-")))
    conversations = []
    for index, person in enumerate(people):
        turns, questions = conversation(person)
        tenant = f"person{index}"
        facts = [Fact(f"turn{i}", t.render().rstrip("\n"), i) for i, t in enumerate(turns)]
        if args.encoder == "transformers":
            jobs = plan_fact_jobs(
                turns,
                facts,
                window=len(turns),
                prefix_ids=frame.prefix_ids,
                tokenizer=TokenizerEncoder(reference.tokenizer),
            )
            jobs.append(EncodingJob("prefix", (), frame.prefix_ids))
            for record in encode_jobs(
                jobs, forward, reference.spec, tenant_id=tenant, window=len(turns), dtype=getattr(torch, dtype)
            ):
                store.put(record)
        segments = [("prefix", list(frame.prefix_ids))] + [
            (f.fact_id, reference.tokenizer.encode(f.render(), add_special_tokens=False)) for f in facts
        ]
        conversations.append((tenant, segments, questions))
    questions_ids = [[frame.query_ids(reference.tokenizer, q) for q in qs] for _, _, qs in conversations]
    del reference, forward
    torch.cuda.empty_cache() if gpu else None

    engine_kwargs = {"gpu_memory_utilization": 0.5} if gpu else {"kv_cache_memory_bytes": 512 << 20}
    llm = build_llm(
        served,
        ConnectorConfig(store_root=store.root, fingerprint=fingerprint),
        dtype=dtype,
        enforce_eager=True,
        max_model_len=2048,
        seed=0,
        **engine_kwargs,
    )
    if args.encoder == "engine":  # one prefill per conversation stores every segment as a record
        captures = []
        for tenant, segments, _ in conversations:
            spans, cursor = [], 0
            for fact_id, ids in segments:
                spans.append(CaptureSpan(fact_id, cursor, cursor + len(ids)))
                cursor += len(ids)
            captures.append(
                capture_request(
                    [t for _, ids in segments for t in ids], CapturePlan(tenant, tuple(spans), window=len(segments))
                )
            )
        llm.generate([c[0] for c in captures], [c[1] for c in captures], use_tqdm=False)
    coded = LocalFactStore(store.root, precision="int8")
    for tenant, segments, _ in conversations:  # the same records rounded to bf16, as `record_dtype` stores them
        rounded = [as_bf16(store.get(tenant, fact_id), tenant + BF16) for fact_id, _ in segments]
        store.put_many(rounded)
        coded.put_many([dataclasses.replace(record, tenant_id=tenant + INT8) for record in rounded])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=1, ignore_eos=True)
    prompts = {suffix: [] for suffix in ("", BF16, INT8)}
    for (tenant, segments, _), queries in zip(conversations, questions_ids):
        for suffix, listed in prompts.items():
            plan = MemoryPlan(tenant + suffix, tuple(f for f, _ in segments), store.version(tenant + suffix))
            memory = [t for rid in plan.record_ids for t in store.info(tenant + suffix, rid).token_ids]
            listed += [(memory + query, plan) for query in queries]
    plain = llm.generate([memory_request(ids, None, params)[0] for ids, _ in prompts[""]], params, use_tqdm=False)
    injected = {}
    for suffix, listed in prompts.items():
        requests = [memory_request(ids, plan, params) for ids, plan in listed]
        injected[suffix] = llm.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False)
    copies = (("float32", ""), ("bfloat16", BF16), ("int8", INT8))
    figures = {name: compare(plain, injected[suffix]) for name, suffix in copies}
    for name, suffix in copies:
        figures[name]["store_bytes"] = sum(tenant_bytes(store, tenant + suffix) for tenant, _, _ in conversations)
    bf16_vs_f32 = compare(injected[""], injected[BF16])["identical"]
    int8_vs_bf16 = compare(injected[BF16], injected[INT8])["identical"]
    total, f32, bf16, int8 = len(plain), figures["float32"], figures["bfloat16"], figures["int8"]
    print(f"{f32['identical']}/{total} identical greedy continuations; max logprob gap {f32['max_logprob_gap']:.3g}")
    print(f"bf16 records: {bf16['identical']}/{total} identical to plain, {bf16_vs_f32}/{total} to float32 records")
    print(f"int8 records: {int8['identical']}/{total} identical to plain, {int8_vs_bf16}/{total} to bf16 records")
    write_report(
        args.out,
        {
            "benchmark": "injection_equivalence",
            "quick": args.quick,
            "gpu": gpu,
            "dtype": dtype,
            "encoder": args.encoder,
            "prompts": total,
            "identical": f32["identical"],
            "max_logprob_gap": f32["max_logprob_gap"],
            "mean_logprob_gap": f32["mean_logprob_gap"],
            "requests_served_from_injected_kv": f32["served_injected"],
            "record_dtypes": figures
            | {"bf16_identical_to_float32_records": bf16_vs_f32, "int8_identical_to_bf16_records": int8_vs_bf16},
            "targets": [
                target("greedy_identical_share", f32["identical"] / total, ">= 0.95"),
                target("requests_served_from_injected_kv_share", f32["served_injected"] / total, ">= 1.0"),
                target("greedy_identical_share_bf16_records", bf16["identical"] / total, ">= 0.95"),
                target("bf16_record_bytes_over_float32", bf16["store_bytes"] / f32["store_bytes"], "<= 0.55"),
                target("greedy_identical_share_int8_records", int8["identical"] / total, ">= 0.95"),
                # codes and scales of a T-token record: (T + 4) / 2T of bf16's, plus the file's header (4 tensors a layer)
                target("int8_record_bytes_over_bf16", int8["store_bytes"] / bf16["store_bytes"], "<= 0.7"),
            ],
        },
    )


def as_bf16(record: FactKV, tenant_id: str) -> FactKV:
    """`record` rounded to bf16 under another tenant, as the capture worker stores it with `record_dtype` bf16."""
    return dataclasses.replace(
        record,
        tenant_id=tenant_id,
        k=record.k.to(torch.bfloat16),
        v=record.v.to(torch.bfloat16),
        params=dataclasses.replace(record.params, dtype="bfloat16"),
    )


def tenant_bytes(store: LocalFactStore, tenant_id: str) -> int:
    return sum(path.stat().st_size for path in (store.root / tenant_id).glob("*.safetensors"))


def compare(plain: list, injected: list) -> dict:
    """Identical greedy continuations, the logprob gaps up to the first divergence, requests served injected."""
    equal, gaps, served = 0, [], 0
    for a, b in zip(plain, injected):
        ta, tb = list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)
        equal += ta == tb
        report = (b.kv_transfer_params or {}).get("inferscale") or {}
        served += report.get("injected_tokens", 0) > 0 or b.num_cached_tokens > 0
        for position, (x, y) in enumerate(zip(ta, tb)):
            gaps.append(abs(a.outputs[0].logprobs[position][x].logprob - b.outputs[0].logprobs[position][y].logprob))
            if x != y:
                break
    return {
        "identical": equal,
        "identical_share_interval": wilson(equal, len(plain)),
        "max_logprob_gap": max(gaps),
        "mean_logprob_gap": statistics.fmean(gaps),
        "served_injected": served,
    }


if __name__ == "__main__":
    main()
