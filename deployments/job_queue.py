"""Encoding jobs a request queues: an input file of facts (or a conversation to extract them from) encoded off
the request path, its status recorded on the tenant as it runs."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

from deployments.background import BackgroundTasks
from deployments.schemas import Message, SubmitJob
from encoder_jobs.inputs import JobInputError, parse_input
from tenants.errors import InvalidInputError
from tenants.tenant import Tenant

log = logging.getLogger(__name__)

# (job id, key, tenant, input file, window, neighbours (None: the tenant's), record dtype (None: the encoding
# model's), progress) -> the job's report
JobRunner = Callable[[str, str, str, Path, "int | None", "int | None", "str | None", Callable[[dict], None]], dict]
RecordDtypeOf = Callable[[], Awaitable[str]]  # what the serving engine stores records in, asked before each job


class JobQueue:
    """Validates, writes and runs encoding jobs in a thread; `Tenant.job` reads their status."""

    def __init__(
        self,
        jobs_dir: Path,
        run_job: JobRunner | None,
        extraction_window: int | None,
        max_fact_chars: int,
        background: BackgroundTasks,
        record_dtype: RecordDtypeOf | None = None,
    ) -> None:
        """`record_dtype`: the dtype jobs store records in, so that they match the records the LLM replicas encode
        themselves (None: the encoding model's own)."""
        self._jobs_dir, self._run_job, self._extraction_window = jobs_dir, run_job, extraction_window
        self._max_fact_chars, self._background, self._record_dtype = max_fact_chars, background, record_dtype

    def submit(self, tenant: Tenant, api_key: str, body: SubmitJob) -> dict[str, Any]:
        """An encoding job over an input in the job file format (explicit facts with turns, or LoCoMo),
        validated whole before it is queued."""
        try:
            parse_input(body.input, self._max_fact_chars)
        except JobInputError as exc:
            raise InvalidInputError(f"job input: {exc}") from None
        return self._queue(tenant, api_key, body.input, body.window, body.neighbours)

    def extract(self, holder: Tenant, api_key: str, messages: list[Message]) -> dict[str, Any]:
        """Queue an encoding job that extracts facts from a conversation (its id and status)."""
        if self._run_job is None:
            raise InvalidInputError("this deployment runs no extraction jobs; send explicit 'facts'")
        turns = [
            {"speaker": "User" if m.role == "user" else "Assistant", "text": m.content}
            for m in messages
            if m.role != "system"
        ]
        if not turns:
            raise InvalidInputError("messages hold no user or assistant turns to extract facts from")
        return self._queue(holder, api_key, {"turns": turns}, self._extraction_window)

    def _queue(
        self, tenant: Tenant, api_key: str, job_input: dict[str, Any], window: int | None, neighbours: int | None = None
    ) -> dict[str, Any]:
        if self._run_job is None:
            raise InvalidInputError("this deployment runs no encoding jobs")
        job_id = f"job-{uuid.uuid4().hex[:16]}"
        self._jobs_dir.mkdir(parents=True, exist_ok=True)
        path = self._jobs_dir / f"{tenant.id}-{job_id}.json"
        path.write_text(json.dumps(job_input))
        tenant.record_job(job_id, {"id": job_id, "status": "queued", "created": time.time()})

        def progress(report: dict) -> None:
            tenant.record_job(job_id, {"id": job_id, "status": "running", "report": report})

        def run(record_dtype: str | None, unknown: Exception | None) -> None:
            try:
                if unknown is not None:
                    raise unknown
                report = self._run_job(job_id, api_key, tenant.id, path, window, neighbours, record_dtype, progress)
                tenant.record_job(
                    job_id, {"id": job_id, "status": "succeeded", "report": report, "finished": time.time()}
                )
            except Exception as exc:  # noqa: BLE001 - the job's status carries the reason
                log.exception("encoding job failed")
                tenant.record_job(job_id, {"id": job_id, "status": "failed", "error": str(exc)[:500]})
            finally:
                path.unlink(missing_ok=True)

        async def start() -> None:
            record_dtype, unknown = None, None
            if self._record_dtype is not None:
                try:
                    record_dtype = await self._record_dtype()
                except Exception as exc:  # noqa: BLE001 - the job fails with it, in its thread
                    unknown = exc
            await asyncio.get_running_loop().run_in_executor(None, run, record_dtype, unknown)

        self._background.start(start())  # apart from the request: it answers before the job runs
        return {"results": [], "job_id": job_id, "status": "queued"}
