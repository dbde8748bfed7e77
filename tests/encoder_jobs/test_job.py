"""Encoding jobs end to end: real Ray Data actors, SmolLM2, redis-server and the tenant store."""

import json

import pytest
import torch

from encoder_jobs.inputs import JobInputError
from encoder_jobs.job import encoder_gpu_share, run_job
from encoder_jobs.worker import CRASH_ENV
from kvcore.conversation import Fact, FactLimits, Turn
from kvcore.encoding import encode_jobs, plan_fact_jobs
from models.chat import TokenizerEncoder, build_frame
from models.loader import load_model

pytestmark = [pytest.mark.model, pytest.mark.redis]

SESSIONS = [
    [
        ("Maya", "Hi! I just moved to Porto for a new job."),
        ("Sam", "Welcome! What is the job?"),
        ("Maya", "I'm a marine biologist at the aquarium."),
    ],
    [("Sam", "Any pets?"), ("Maya", "A grey cat called Pixel."), ("Sam", "Cute!")],
    [
        ("Maya", "I'm training for the Lisbon half marathon."),
        ("Sam", "Good luck!"),
        ("Maya", "I'm allergic to peanuts, so energy bars are tricky."),
    ],
]
FACTS = [
    ("Maya works as a marine biologist at the aquarium in Porto.", 3),
    ("Maya has a grey cat called Pixel.", 5),
    ("Maya is training for the Lisbon half marathon.", 7),
    ("Maya is allergic to peanuts.", 9),
]


def write_input(path, facts=FACTS):
    turns = [
        {"speaker": s, "text": t, "time": f"2026-03-0{i + 1}"} for i, session in enumerate(SESSIONS) for s, t in session
    ]
    path.write_text(json.dumps({"turns": turns, "facts": [{"text": t, "turn": n} for t, n in facts]}))
    return path


def run(job_env, path, **kwargs):
    settings, service, admin = job_env
    return run_job(settings, redis_url=service.meta.url, key=admin, tenant_id="maya", input_path=path, **kwargs)


def test_a_conversation_is_encoded_once_and_equals_the_core(ray_local, job_env, tmp_path):
    settings, service, admin = job_env
    report = run(job_env, write_input(tmp_path / "in.json"), batch_size=2)
    assert (report.total, report.encoded, report.failed, report.skipped) == (4, 4, 0, 0), report.errors
    tenant = service.tenant_for_admin(admin, "maya")
    stored = {f.text: f for f in tenant.list_facts()}
    assert set(stored) == {t for t, _ in FACTS} and all(
        f.kv_ready and f.encoding["window"] == 2 for f in stored.values()
    )

    loaded = load_model(settings.model)  # the same facts encoded directly with the core
    frame = build_frame(loaded.tokenizer, settings.system_prompt)
    turns = [Turn(s, t, f"2026-03-0{i + 1}") for i, session in enumerate(SESSIONS) for s, t in session]
    from models.transformers_adapter import HFKVForward

    jobs = plan_fact_jobs(
        turns,
        [Fact(f"f{i}", t, n) for i, (t, n) in enumerate(FACTS)],
        window=2,
        prefix_ids=frame.prefix_ids,
        tokenizer=TokenizerEncoder(loaded.tokenizer),
        limits=FactLimits(),
    )
    direct = encode_jobs(jobs, HFKVForward(loaded), loaded.spec, tenant_id="maya", window=2, dtype=loaded.dtype)
    for (text, _), expected in zip(FACTS, direct):
        record = service.records.get("maya", stored[text].record_id)
        assert record.token_ids == expected.token_ids
        assert torch.allclose(record.k, expected.k, atol=1e-4) and torch.allclose(record.v, expected.v, atol=1e-4)

    again = run(job_env, write_input(tmp_path / "in.json"))  # resubmitted: nothing new
    assert (again.encoded, again.skipped) == (0, 4) and len(tenant.list_facts()) == 4
    assert len(service.records.record_ids("maya")) == 4


def test_facts_are_encoded_behind_their_nearest_facts_when_asked(ray_local, job_env, tmp_path):
    """`neighbours=2`: each fact's K/V is the core's encoding behind the two facts nearest it (by the retrieval
    embedding, the nearest last), after its window; the same facts alone differ."""
    from encoder_jobs.neighbours import nearest_texts
    from models.minilm import MiniLMEmbedder
    from models.transformers_adapter import HFKVForward

    settings, service, admin = job_env
    report = run(job_env, write_input(tmp_path / "in.json"), window=0, neighbours=2)
    assert (report.encoded, report.failed) == (4, 0), report.errors
    stored = {f.text: f for f in service.tenant_for_admin(admin, "maya").list_facts()}
    assert all(f.encoding["neighbours"] == 2 and f.encoding["window"] == 0 for f in stored.values())

    texts = [t for t, _ in FACTS]
    near = nearest_texts(texts, MiniLMEmbedder().embed_tensor(texts), [], 2)
    assert all(len(n) == 2 and t not in n for t, n in zip(texts, near))
    loaded = load_model(settings.model)
    frame = build_frame(loaded.tokenizer, settings.system_prompt)
    facts = [Fact(f"f{i}", t, 0) for i, t in enumerate(texts)]
    for neighbours, same in (({f"f{i}": n for i, n in enumerate(near)}, True), (None, False)):
        jobs = plan_fact_jobs(
            [],
            facts,
            window=0,
            prefix_ids=frame.prefix_ids,
            tokenizer=TokenizerEncoder(loaded.tokenizer),
            neighbours=neighbours,
        )
        direct = encode_jobs(jobs, HFKVForward(loaded), loaded.spec, tenant_id="maya", window=0, dtype=loaded.dtype)
        for text, expected in zip(texts, direct):
            record = service.records.get("maya", stored[text].record_id)
            assert torch.allclose(record.k, expected.k, atol=1e-4) is same, (text, neighbours is not None)


def test_a_killed_worker_is_finished_by_resubmitting_exactly_once(ray_local, job_env, tmp_path, monkeypatch):
    settings, service, admin = job_env
    path = write_input(tmp_path / "in.json")
    monkeypatch.setenv(CRASH_ENV, "2")  # the worker SIGKILLs itself after storing 2 facts
    try:
        first = run(job_env, path, batch_size=1)
        assert first.encoded + first.failed < 4 or first.encoded == 4  # Ray may retry on a new actor
    except Exception:  # noqa: BLE001 - the job may also fail with the worker: resubmitting must finish it
        pass
    monkeypatch.delenv(CRASH_ENV)
    tenant = service.tenant_for_admin(admin, "maya")
    assert 2 <= len(tenant.list_facts()) <= 4
    second = run(job_env, path, batch_size=1)
    assert second.failed == 0 and second.encoded + second.skipped == 4
    facts = tenant.list_facts()
    assert len(facts) == 4 and all(f.kv_ready for f in facts) and len(service.records.record_ids("maya")) == 4


def test_a_job_stores_its_records_in_the_dtype_the_serving_engine_stores_its_own(ray_local, job_env, tmp_path):
    """`record_dtype` bf16 (the serving app's `llm.record_dtype`): the same K/V as float32 records, rounded once."""
    settings, service, admin = job_env
    report = run(job_env, write_input(tmp_path / "in.json", facts=FACTS[:2]), record_dtype="bfloat16")
    assert (report.encoded, report.failed) == (2, 0), report.errors
    loaded = load_model(settings.model)
    frame = build_frame(loaded.tokenizer, settings.system_prompt)
    turns = [Turn(s, t, f"2026-03-0{i + 1}") for i, session in enumerate(SESSIONS) for s, t in session]
    from models.transformers_adapter import HFKVForward

    jobs = plan_fact_jobs(
        turns,
        [Fact(f"f{i}", t, n) for i, (t, n) in enumerate(FACTS[:2])],
        window=2,
        prefix_ids=frame.prefix_ids,
        tokenizer=TokenizerEncoder(loaded.tokenizer),
        limits=FactLimits(),
    )
    exact = encode_jobs(jobs, HFKVForward(loaded), loaded.spec, tenant_id="maya", window=2, dtype=torch.float32)
    stored = {f.text: f for f in service.tenant_for_admin(admin, "maya").list_facts()}
    for (text, _), expected in zip(FACTS, exact):
        record = service.records.get("maya", stored[text].record_id)
        assert record.k.dtype == record.v.dtype == torch.bfloat16 and record.params.dtype == "bfloat16"
        # one rounding of the float32 values: within a bf16 ulp (2^-8 relative), and not equal to them; near zero
        # the job's own float32 forward (its batches, its worker) may differ from this one's by a few 1e-6 (a 6.80e-4
        # value stored as 6.87e-4 on one CPU, more than one rounding), hence the absolute 1e-5
        assert torch.allclose(record.k.float(), expected.k, rtol=2**-8, atol=1e-5)
        assert torch.allclose(record.v.float(), expected.v, rtol=2**-8, atol=1e-5)
        assert not torch.equal(record.k.float(), expected.k)
    with pytest.raises(ValueError, match="record_dtype must be one of"):
        run(job_env, write_input(tmp_path / "in.json"), record_dtype="int8")


def test_bad_facts_are_reported_and_the_rest_continue(ray_local, job_env, tmp_path):
    settings, service, admin = job_env
    too_long = " ".join(["word"] * 400)  # more tokens than a fact may have
    report = run(job_env, write_input(tmp_path / "in.json", facts=[FACTS[0], (too_long, 2)]))
    assert (report.encoded, report.failed) == (1, 1) and "tokens" in next(iter(report.errors.values()))
    assert len(service.tenant_for_admin(admin, "maya").list_facts()) == 1


def test_a_malformed_file_writes_nothing(job_env, tmp_path):
    settings, service, admin = job_env
    (tmp_path / "bad.json").write_text(
        json.dumps({"turns": [{"speaker": "a", "text": "b"}], "facts": [{"text": "x", "turn": 9}]})
    )
    with pytest.raises(JobInputError, match="facts\\[0\\].turn"):
        run(job_env, tmp_path / "bad.json")
    assert service.meta.records.fact_ids("maya") == [] and service.records.record_ids("maya") == []


def test_a_locomo_conversation_goes_through_extraction_with_the_model(ray_local, job_env, tmp_path):
    """The real model extracts (modestly, at 135M); whatever it adds is stored, encoded and counted once."""
    settings, service, admin = job_env
    tenant = service.tenant_for_admin(admin, "maya")
    tenant.add_fact("Maya lives in Porto.")  # something for the ADD/UPDATE/DELETE/NOOP step to compare with
    sessions = {
        f"session_{n + 1}": [{"speaker": s, "dia_id": f"D{n + 1}:{i}", "text": t} for i, (s, t) in enumerate(session)]
        for n, session in enumerate(SESSIONS[:2])
    }
    path = tmp_path / "locomo.json"
    path.write_text(json.dumps({"conversation": {"speaker_a": "Maya", "speaker_b": "Sam", **sessions}}))
    report = run(job_env, path)
    assert report.failed == 0 and report.encoded + report.skipped == report.total
    facts = tenant.list_facts()
    assert len(facts) == 1 + report.encoded - report.deleted
    assert all(f.kv_ready for f in facts if f.id.startswith("ej-"))
    again = run(job_env, path)  # greedy extraction repeats itself: nothing new is encoded
    assert again.encoded == 0 and len(tenant.list_facts()) == len(facts)


@pytest.mark.parametrize(
    "total, free, per_gpu, workers, share",
    [
        (0.0, 0.0, 2, 1, 0.0),  # no GPU in the cluster: CPU actors
        (1.0, 1.0, 2, 1, 0.5),  # a free GPU: the configured share
        (1.0, 0.1, 2, 1, 0.1),  # the serving replica holds 0.9: what is left, not a share that never comes
        (1.0, 0.1, 2, 4, 0.025),  # split over the workers
        (1.0, 0.004, 2, 1, 0.0),  # the GPU is taken: CPU actors rather than waiting
    ],
)
def test_encoding_actors_ask_for_a_gpu_share_the_cluster_has(total, free, per_gpu, workers, share):
    assert encoder_gpu_share(total, free, per_gpu, workers) == pytest.approx(share)
