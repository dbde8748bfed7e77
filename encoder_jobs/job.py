"""Run one encoding job: validate the input, decide what to store, encode on a Ray Data actor pool.

The driver validates the whole input first (a malformed file writes nothing), extracts facts when the
input is a conversation, applies UPDATE / DELETE decisions, then sends every fact that still lacks its
K/V through `map_batches(EncodeWorker)` (GPU actors when CUDA is present) and reports progress and a
summary with per-fact errors. Facts already encoded are skipped before any work, which is what makes
re-running a finished job a no-op and a killed one resumable.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from config.connector import STORED_DTYPES
from config.settings import Settings
from encoder_jobs.extract import extract_facts
from encoder_jobs.history import encode_history_records, name_history
from encoder_jobs.inputs import load_input
from encoder_jobs.neighbours import nearest_texts
from encoder_jobs.tasks import task_rows
from encoder_jobs.worker import EncodeWorker
from kvcore.store import LocalFactStore
from models.generation import ChatGenerator
from models.loader import load_model
from models.minilm import MiniLMEmbedder
from tenants.connect import connect_service
from tenants.errors import TenantError
from tenants.tenant import Tenant

log = logging.getLogger(__name__)

HISTORY_JOB_TIMEOUT_S = 3600  # a history's one pass, a model load included (a task never scheduled ends too)
MIN_GPU_SHARE = 0.005  # below this a GPU is as good as taken: encode on CPU rather than wait for it


@dataclass
class JobReport:
    """Counts of what an encoding job did, by outcome."""

    total: int = 0
    encoded: int = 0
    skipped: int = 0
    failed: int = 0
    updated: int = 0
    deleted: int = 0
    errors: dict[str, str] = field(default_factory=dict)
    history: dict | None = None  # a history job's: its id, tokens, chunks, and the replaced history's chunks deleted

    def to_dict(self) -> dict:
        return self.__dict__.copy()


def run_job(
    settings: Settings,
    *,
    redis_url: str,
    key: str,
    tenant_id: str,
    input_path: Path,
    window: int | None = None,
    neighbours: int | None = None,
    workers: int = 1,
    batch_size: int = 16,
    record_dtype: str | None = None,
    progress: Callable[[JobReport], None] = lambda report: None,
) -> JobReport:
    """`window` turns and `neighbours` nearest facts before each fact (None: the tenant's settings); records in
    `record_dtype` (the serving engine's records', so that both ways of encoding store the same bytes; None: the
    encoding model's dtype)."""
    if record_dtype not in (None, *STORED_DTYPES):
        raise ValueError(f"record_dtype must be one of {', '.join(STORED_DTYPES)}, got {record_dtype!r}")
    job_input = load_input(input_path, settings.tenants.max_fact_chars)  # before anything is written
    embedder = MiniLMEmbedder()
    service = connect_service(redis_url, settings.state_dir, embedder, settings.tenants)
    tenant = service.open_tenant(key, tenant_id)
    if job_input.history is not None:
        return _history_job(settings, tenant, service.records, job_input.history, progress, record_dtype)
    window = tenant.entry.window if window is None else window
    neighbours = tenant.entry.neighbours if neighbours is None else neighbours
    if window < 0 or neighbours < 0:
        raise ValueError("window and neighbours must be >= 0")
    report = JobReport()
    facts = job_input.facts
    if facts is None:  # a conversation: extract facts and decide what each one does to the store
        generate = ChatGenerator(load_model(settings.model))
        search = lambda q, k: [(f.id, f.text, s) for f, s in tenant.search(q, k)] if tenant.usage()["facts"] else []  # noqa: E731
        decisions = extract_facts(job_input.turns, job_input.sessions, generate, search)
        facts = []
        for decision in decisions:
            try:
                if decision.event == "DELETE":
                    tenant.delete_fact(decision.target_id)
                    report.deleted += 1
                elif decision.event == "UPDATE":
                    tenant.update_fact(decision.target_id, decision.fact.text)
                    report.updated += 1
                elif decision.event == "ADD":
                    facts.append(decision.fact)
            except TenantError as exc:
                report.errors[decision.target_id or decision.fact.text[:40]] = str(exc)
    rows = task_rows(tenant_id, job_input.turns, facts, window)
    report.total = len(rows)
    existing = service.meta.records.facts(tenant_id, [r["fact_id"] for r in rows])
    todo = [r for r, meta in zip(rows, existing) if not (meta and meta.get("record_id") and meta["state"] == "active")]
    report.skipped = len(rows) - len(todo)
    if todo:
        near = _neighbours(tenant, embedder, [r["text"] for r in rows], neighbours)
        by_id = {r["fact_id"]: texts for r, texts in zip(rows, near)}
        for row in todo:
            row["neighbours"] = by_id[row["fact_id"]]
    progress(report)
    if todo:
        _run_on_ray(
            settings, redis_url, key, tenant_id, window, record_dtype, todo, workers, batch_size, report, progress
        )
    return report


def _neighbours(tenant: Tenant, embedder: MiniLMEmbedder, texts: list[str], count: int) -> list[list[str]]:
    """The `count` nearest facts of each text, among the job's facts and the tenant's stored ones."""
    if count == 0:
        return [[] for _ in texts]
    vectors = embedder.embed_tensor(texts)
    stored = (
        [[(f.text, score) for f, score in tenant.retrieve(v, count + 1).hits] for v in vectors]
        if tenant.usage()["facts"]
        else None
    )
    return nearest_texts(texts, vectors, stored or [], count)


def _history_job(
    settings: Settings,
    tenant: Tenant,
    store: LocalFactStore,
    text: str,
    progress: Callable[[JobReport], None],
    record_dtype: str | None,
) -> JobReport:
    """Encode a history on one encoding actor (a GPU share when one is free), then name it in the tenant's entry."""
    import ray

    if tenant.entry.scope is not None:
        raise ValueError("a history belongs to a tenant, not to an end user's memory")
    report = JobReport(total=1)
    progress(report)
    _ray()
    share = encoder_gpu_share(ray.cluster_resources().get("GPU", 0.0), ray.available_resources().get("GPU", 0.0), 1, 1)
    task = ray.remote(num_cpus=0 if share else 1, num_gpus=share, max_retries=0)(encode_history_records)
    ref = task.remote(settings.model_dump(mode="json"), str(store.root), tenant.id, text, record_dtype)
    try:
        encoded = ray.get(ref, timeout=HISTORY_JOB_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        raise ValueError(f"history encoding did not finish within {HISTORY_JOB_TIMEOUT_S} s") from None
    except ray.exceptions.RayError as exc:  # the job's status names the cause, not Ray's traceback
        cause = getattr(exc, "cause", None)
        raise ValueError(f"history encoding failed: {cause if isinstance(cause, Exception) else exc}") from None
    replaced = name_history(tenant, store, encoded)
    report.total = report.encoded = encoded["chunks"]
    report.history = encoded | {"replaced_chunks_deleted": replaced}
    progress(report)
    return report


def _ray() -> None:
    import ray

    if not ray.is_initialized():
        ray.init(
            address=os.environ.get("RAY_ADDRESS") or "local",
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )


def _run_on_ray(
    settings: Settings,
    redis_url: str,
    key: str,
    tenant_id: str,
    window: int,
    record_dtype: str | None,
    rows: list[dict],
    workers: int,
    batch_size: int,
    report: JobReport,
    progress: Callable[[JobReport], None],
) -> None:
    import ray

    _ray()
    gpu_share = encoder_gpu_share(
        ray.cluster_resources().get("GPU", 0.0),
        ray.available_resources().get("GPU", 0.0),
        settings.encoding.actors_per_gpu,
        workers,
    )
    log.info(
        "encoding %d facts of %s on %s actors",
        len(rows),
        tenant_id,
        f"GPU ({gpu_share:.3g} each)" if gpu_share else "CPU",
    )
    dataset = ray.data.from_items(rows).map_batches(
        EncodeWorker,
        batch_size=batch_size,
        concurrency=workers,
        num_gpus=gpu_share,
        num_cpus=0 if gpu_share else 1,
        fn_constructor_kwargs={
            "settings": settings.model_dump(mode="json"),
            "redis_url": redis_url,
            "key": key,
            "tenant_id": tenant_id,
            "window": window,
            "record_dtype": record_dtype,
        },
    )
    for batch in dataset.iter_batches(batch_size=None, batch_format="default"):
        for fact_id, status, error in zip(batch["fact_id"], batch["status"], batch["error"]):
            if status == "encoded":
                report.encoded += 1
            elif status == "skipped":
                report.skipped += 1
            else:
                report.failed += 1
                report.errors[str(fact_id)] = str(error)
        progress(report)


def encoder_gpu_share(total: float, free: float, actors_per_gpu: int, workers: int) -> float:
    """The GPU share each encoding actor asks Ray for: 1/actors_per_gpu, or what the cluster has left when the
    serving replicas hold most of it (asking for more than is free would wait forever); 0 (CPU actors) when the
    cluster has no GPU or none of it is free."""
    if total <= 0 or free < MIN_GPU_SHARE * workers:
        return 0.0
    return min(1 / actors_per_gpu, free / workers)
