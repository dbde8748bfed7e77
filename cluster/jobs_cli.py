"""`inferscale encode` and `inferscale tenant`: run on the embedded default, or submit to a Ray cluster.

Without `INFERSCALE_REDIS__URL` the command starts the project's redis-server on its state folder for
its own duration. The admin key comes from `INFERSCALE_ADMIN_KEY` (installed, replacing a stored one); without
it, on a store that has none yet, one is created and printed once. `--submit URL` sends the same command to a cluster's Ray Jobs API instead
(the input file travels in the job's working directory) and follows its log.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from cluster.tenants_setup import open_tenants
from config.settings import Settings
from encoder_jobs.inputs import load_input
from encoder_jobs.job import JobReport, run_job
from tenants.service import TenantService

ADMIN_ENV = "INFERSCALE_ADMIN_KEY"


@contextmanager
def _store(settings: Settings) -> Iterator[tuple[str, TenantService, str]]:
    """(redis url, service, admin key) for this command."""
    tenants = open_tenants(settings)
    try:
        service = tenants.service
        admin = settings.admin_key
        if admin:  # a configured key is authoritative, as for the serving app: installed, replacing a stored one
            service.install_admin_key(admin)
        elif created := service.ensure_admin_key():
            print(f"admin key (shown once; export {ADMIN_ENV}=...): {created}", file=sys.stderr)
            admin = created
        if not admin:
            raise ValueError(f"set {ADMIN_ENV} to the admin key of this store")
        yield service.meta.url, service, admin
    finally:
        tenants.close()


def run_tenant_create(settings: Settings, args: argparse.Namespace) -> int:
    with _store(settings) as (_, service, admin):
        info, key = service.create_tenant(admin, args.name, window=args.window, neighbours=args.neighbours)
    print(
        json.dumps({"tenant": info["id"], "api_key": key, "window": info["window"], "neighbours": info["neighbours"]})
    )
    return 0


def run_encode(settings: Settings, args: argparse.Namespace) -> int:
    load_input(args.input, settings.tenants.max_fact_chars)  # refuse a bad file before anything starts
    if args.submit:
        return _submit(args)
    with _store(settings) as (url, _, admin):
        report = run_job(
            settings,
            redis_url=url,
            key=admin,
            tenant_id=args.tenant,
            input_path=args.input,
            window=args.window,
            neighbours=args.neighbours,
            workers=args.workers,
            batch_size=args.batch_size,
            record_dtype=args.record_dtype,
            progress=_progress,
        )
    print(file=sys.stderr)
    print(json.dumps(report.to_dict()))
    return 0 if report.failed == 0 else 1


def _progress(report: JobReport) -> None:
    done = report.encoded + report.skipped + report.failed
    width = 30
    filled = int(width * done / report.total) if report.total else width
    print(
        f"\rencoding [{'#' * filled}{'.' * (width - filled)}] {done}/{report.total} "
        f"(encoded {report.encoded}, skipped {report.skipped}, failed {report.failed})",
        end="",
        file=sys.stderr,
        flush=True,
    )


def _submit(args: argparse.Namespace) -> int:
    """The same command as a Ray job: the cluster's workers need inferscale installed (the Helm image has it)."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    folder = Path(tempfile.mkdtemp(prefix="inferscale-job-"))
    shutil.copy(args.input, folder / "input.json")
    command = [
        "inferscale",
        "encode",
        "--tenant",
        args.tenant,
        "--input",
        "input.json",
        "--workers",
        str(args.workers),
        "--batch-size",
        str(args.batch_size),
    ]
    for flag, value in (
        ("--window", args.window),
        ("--neighbours", args.neighbours),
        ("--record-dtype", args.record_dtype),
    ):
        if value is not None:
            command += [flag, str(value)]
    env = {k: v for k, v in os.environ.items() if k.startswith("INFERSCALE_")}
    client = JobSubmissionClient(args.submit)
    deadline = time.monotonic() + 120
    try:
        while True:  # a head that just started has no job agent for a few seconds
            try:
                job_id = client.submit_job(
                    entrypoint=" ".join(command), runtime_env={"working_dir": str(folder), "env_vars": env}
                )
                break
            except RuntimeError as exc:
                if "No available agent" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(2)
    finally:  # submit_job uploads the folder to the cluster: the local copy is not needed afterwards
        shutil.rmtree(folder, ignore_errors=True)
    print(f"submitted {job_id}", file=sys.stderr)
    import asyncio

    async def follow() -> None:
        async for lines in client.tail_job_logs(job_id):
            print(lines, end="", file=sys.stderr, flush=True)

    asyncio.run(follow())
    status = client.get_job_status(job_id)
    print(json.dumps({"job_id": job_id, "status": str(status)}))
    return 0 if status == JobStatus.SUCCEEDED else 1


def run_job_action(settings: Settings, args: argparse.Namespace) -> int:
    """`inferscale job status|stop JOB_ID --submit URL`."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(args.submit)
    if args.action == "stop":
        stopped = client.stop_job(args.job_id)
        print(json.dumps({"job_id": args.job_id, "stopped": bool(stopped)}))
        return 0
    info = client.get_job_info(args.job_id)
    print(json.dumps({"job_id": args.job_id, "status": str(info.status), "message": info.message}))
    return 0
