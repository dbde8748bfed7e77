"""Encoding jobs store their records in the dtype the LLM replicas store theirs (`llm.record_dtype`)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from deployments.background import BackgroundTasks
from deployments.job_queue import JobQueue
from deployments.schemas import SubmitJob

JOB_INPUT = {
    "turns": [{"speaker": "Maya", "text": "I moved to Porto."}],
    "facts": [{"text": "Maya lives in Porto.", "turn": 0}],
}


class Holder:
    """The tenant as the queue sees it: an id and its jobs' statuses."""

    id = "maya"

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}

    def record_job(self, job_id: str, status: dict[str, Any]) -> None:
        self.jobs[job_id] = status


def submit_and_finish(tmp_path: Path, record_dtype: Any) -> tuple[Holder, list[Any], list[Path]]:
    runs: list[Any] = []

    def runner(job_id, key, tenant_id, path, window, neighbours, dtype, progress) -> dict:
        runs.append(dtype)
        return {"encoded": 1}

    async def main() -> Holder:
        holder, background = Holder(), BackgroundTasks()
        queue = JobQueue(tmp_path / "jobs", runner, None, 2000, background, record_dtype=record_dtype)
        queue.submit(holder, "key", SubmitJob(input=JOB_INPUT))  # type: ignore[arg-type]
        while background._running:  # until the job's task is done: its status written and its file removed
            await asyncio.sleep(0.01)
        return holder

    holder = asyncio.run(main())
    return holder, runs, list((tmp_path / "jobs").iterdir())


def test_a_job_is_told_the_llm_replicas_record_dtype(tmp_path):
    async def engine_dtype() -> str:
        return "bfloat16"

    holder, runs, left = submit_and_finish(tmp_path, engine_dtype)
    assert runs == ["bfloat16"] and [s["status"] for s in holder.jobs.values()] == ["succeeded"] and left == []
    _, runs, _ = submit_and_finish(tmp_path, None)  # a queue without an LLM deployment: the encoder's own dtype
    assert runs == [None]


def test_a_job_whose_record_dtype_cannot_be_learned_fails_with_the_reason_and_runs_nothing(tmp_path):
    async def unreachable() -> str:
        raise ConnectionError("no model replica answered")

    holder, runs, left = submit_and_finish(tmp_path, unreachable)
    (status,) = holder.jobs.values()
    assert runs == [] and status["status"] == "failed" and "no model replica answered" in status["error"]
    assert left == []  # its input file is removed


class RecordDtypeHandle:
    """The LLM deployment's handle as `ServeLLMBackend.record_dtype` uses it: `record_dtype.remote()` answers
    `answer`, or never (None); `asked` counts the calls."""

    def __init__(self, answer: str | None) -> None:
        self.answer, self.asked = answer, 0

    def __getattr__(self, name: str) -> Any:
        return self

    def options(self, **kwargs: Any) -> "RecordDtypeHandle":
        return self

    def remote(self) -> Any:
        self.asked += 1
        future = asyncio.get_running_loop().create_future()
        if self.answer is not None:
            future.set_result(self.answer)
        return future


def test_the_ingress_asks_a_replica_for_the_engines_dtype_once_and_never_for_a_named_one():
    from deployments.ray_serve.ingress import ServeLLMBackend

    handle = RecordDtypeHandle("bfloat16")

    async def main() -> tuple[list[str], str]:
        engine = ServeLLMBackend(handle, record_dtype="engine")
        named = ServeLLMBackend(handle, record_dtype="float16")
        return [await engine.record_dtype(), await engine.record_dtype()], await named.record_dtype()

    answers, named = asyncio.run(main())
    assert answers == ["bfloat16", "bfloat16"] and named == "float16" and handle.asked == 1


def test_a_replica_that_never_names_its_record_dtype_fails_the_job_in_time_and_is_asked_again():
    from deployments.ray_serve.ingress import ServeLLMBackend

    silent = RecordDtypeHandle(None)

    async def main() -> list[str]:
        backend = ServeLLMBackend(silent, first_event_timeout_s=0.05, record_dtype="engine")
        errors = []
        for _ in range(2):
            try:
                await backend.record_dtype()
            except TimeoutError as exc:
                errors.append(str(exc))
        return errors

    errors = asyncio.run(main())
    assert len(errors) == 2 and "no model replica named its record dtype within 0.05 s" in errors[0]
    assert silent.asked == 2  # a failed ask is not kept: the next job asks again


def test_engine_resolves_to_the_engines_dtype_and_a_named_one_stays():
    import pytest

    from config.connector import stored_dtype

    assert stored_dtype("engine", "torch.bfloat16") == "bfloat16" and stored_dtype("engine", "float32") == "float32"
    assert stored_dtype("float32", "torch.bfloat16") == "float32"
    with pytest.raises(ValueError, match="cannot be stored in 'float8_e4m3fn'"):
        stored_dtype("engine", "torch.float8_e4m3fn")


def test_the_llm_replica_names_its_record_dtype(cluster, on_serve_loop):
    from ray import serve

    async def ask() -> str:  # in high-throughput mode a handle routes on the caller's event loop
        return await serve.get_deployment_handle("LLMServer", "inferscale").record_dtype.remote()

    assert on_serve_loop(ask) == "float32"  # llm.record_dtype `engine`, resolved: the CPU engine serves float32
