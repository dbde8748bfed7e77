"""Throughput of the encoding job (Ray Data actors, store writes included) against plain prefill.

One process, one model: for w in {0, 5, 20}, facts of ~30 tokens behind turns of ~24 tokens go through
`run_job` (validation, planning, Ray Data `map_batches` over an actor, context-window encoding, MiniLM
embedding, tenant-store writes in Redis and on disk), timed end to end after Ray is up; the same
tokens (context and fact) then go through a plain prefill of the same model in the same batch shapes.
Target on the GPU: the job keeps >= 50% of plain prefill's token throughput; the CPU figure is reported.
Both the end-to-end rate and the rate once running (between the first and the last batch reported done,
so without the actors' start and model load) are reported, each against the plain prefill. The disk's
durable write rate for files of a record's size (`write_floor`) is measured in the same run: at small
windows a fact's K/V is bytes the job must store faster than the GPU produces them, and
`write_floor_over_prefill` says what share of plain prefill's rate the disk alone admits; the same bytes written
as one file (`sequential_write_rate`) say how much any other layout of the records could gain over files.
`--config` runs the job with a model of that shape and random weights (saved once, SmolLM2's tokenizer):
a 135M model prefills a fact in microseconds, so only a serving-sized model shows whether the job keeps
the GPU busy rather than how fast per-fact store writes are.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._cluster import shaped_model  # noqa: E402
from benchmarks._common import parser, scratch_dir, target, write_report  # noqa: E402
from cluster.redis_server import LocalRedis  # noqa: E402
from config import load_settings  # noqa: E402
from encoder_jobs.job import run_job  # noqa: E402
from kvcore.conversation import Fact, Turn  # noqa: E402
from kvcore.encoding import plan_batches, plan_fact_jobs  # noqa: E402
from models.chat import TokenizerEncoder, build_frame  # noqa: E402
from models.loader import load_model, random_model  # noqa: E402
from models.minilm import MiniLMEmbedder  # noqa: E402
from tenants.connect import connect_service  # noqa: E402

WORDS = "river quiet garden number yellow market seven window travel piano coffee letter mountain silver".split()


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, help="HF config.json of a model shape to run with random weights")
    args = p.parse_args()
    facts_per_run = 12 if args.quick else 256  # quick: three batches a window, under ~2 minutes on two cores
    windows = (0, 5, 20)
    rng = random.Random(0)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    folder = Path(scratch_dir(prefix="encode-job-"))
    settings = load_settings(state_dir=folder / "state")
    settings.tenants.max_bytes = 1 << 40  # a window's records at the serving shape pass the default 4 GiB quota
    gpu = torch.cuda.is_available()
    if gpu:
        settings.model.dtype = "bfloat16"
        facts_per_run = 2048  # enough that the actor's start (model load, CUDA init) is a small share
    if args.config:
        settings.model.path = Path(random_weights_model(args.config, folder / "model", settings.model.dtype))
        facts_per_run = min(facts_per_run, 2048)  # records of a serving-sized model are MBs a fact (~9 GB a window)
    workers = settings.encoding.actors_per_gpu if gpu else 1
    server = LocalRedis(folder / "redis").start()
    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    loaded = load_model(settings.model.model_copy(update={"device": "cuda" if torch.cuda.is_available() else "cpu"}))
    frame = build_frame(loaded.tokenizer, settings.system_prompt)
    encoder = TokenizerEncoder(loaded.tokenizer)
    service = connect_service(server.url, settings.state_dir, MiniLMEmbedder(), settings.tenants)
    admin = service.ensure_admin_key()
    rows = []
    try:
        for window in windows:
            tenant = f"bench-w{window}"
            service.create_tenant(admin, tenant, window=window)
            turns = [Turn("User" if i % 2 else "Assistant", sentence(rng, 18)) for i in range(facts_per_run + 20)]
            facts = [(sentence(rng, 22), 20 + i) for i in range(facts_per_run)]
            path = folder / f"{tenant}.json"
            path.write_text(
                json.dumps(
                    {
                        "turns": [{"speaker": t.speaker, "text": t.text} for t in turns],
                        "facts": [{"text": text, "turn": turn} for text, turn in facts],
                    }
                )
            )
            marks: list[tuple[float, int]] = []  # (time, facts encoded) at each batch the job reports
            start = time.perf_counter()
            report = run_job(
                settings,
                redis_url=server.url,
                key=admin,
                tenant_id=tenant,
                input_path=path,
                window=window,
                workers=workers,
                batch_size=4 if args.quick else 64,
                progress=lambda r: marks.append((time.perf_counter(), r.encoded)),
            )
            job_s = time.perf_counter() - start
            steady = steady_rate(marks)
            assert report.encoded == facts_per_run, report.errors
            jobs = plan_fact_jobs(
                turns,
                [Fact(f"f{i}", t, n) for i, (t, n) in enumerate(facts)],
                window=window,
                prefix_ids=frame.prefix_ids,
                tokenizer=encoder,
            )
            tokens = sum(job.length for job in jobs)
            prefill_s = _plain_prefill(loaded, jobs, settings.encoding.max_batch_tokens)
            steady_ratio = steady * (tokens / facts_per_run) / (tokens / prefill_s) if steady else 0.0
            record_bytes = sum(f.stat().st_size for f in settings.state_dir.rglob(f"{tenant}/*.safetensors"))
            rows.append(
                {
                    "window": window,
                    "facts": facts_per_run,
                    "tokens": tokens,
                    "job_s": job_s,
                    "job_facts_per_s": facts_per_run / job_s,
                    "job_tokens_per_s": tokens / job_s,
                    "job_steady_facts_per_s": steady,
                    "prefill_tokens_per_s": tokens / prefill_s,
                    "ratio": prefill_s / job_s,
                    "steady_ratio": steady_ratio,
                    "record_bytes_per_fact": record_bytes / facts_per_run,
                    "records_bytes_per_s_at_prefill_rate": record_bytes / prefill_s,
                }
            )
            service.delete_tenant(admin, tenant)  # its records leave the disk before the next window writes its own
            print(
                f"w={window:>2}: job {facts_per_run / job_s:7.1f} facts/s ({tokens / job_s:8.0f} tok/s; "
                f"{steady:7.1f} facts/s once running), plain prefill {tokens / prefill_s:8.0f} tok/s, "
                f"ratio {prefill_s / job_s:.2f} (running {steady_ratio:.2f})",
                flush=True,
            )
        largest = max(rows, key=lambda r: r["record_bytes_per_fact"])
        floor = write_floor(folder / "floor", int(largest["record_bytes_per_fact"]), min(facts_per_run, 512))
        for row in rows:  # the share of plain prefill's rate that the disk can store, if the job did nothing else
            row["write_floor_over_prefill"] = floor / row["records_bytes_per_s_at_prefill_rate"]
        sequential = sequential_write_rate(
            folder / "sequential", int(largest["record_bytes_per_fact"]) * min(facts_per_run, 512)
        )
        print(
            f"disk write floor {floor / 1e9:.2f} GB/s (files of a record's size); one file {sequential / 1e9:.2f} GB/s",
            flush=True,
        )
    finally:
        ray.shutdown()
        server.stop()
    goal = ">= 0.5" if gpu else ">= 0.1"
    targets = [target(f"job_over_prefill_w{r['window']}", r["ratio"], goal) for r in rows]
    targets += [target(f"job_once_running_over_prefill_w{r['window']}", r["steady_ratio"], goal) for r in rows]
    write_report(
        args.out,
        {
            "benchmark": "encode_job",
            "quick": args.quick,
            "gpu": gpu,
            "workers": workers,
            "model": str(args.config) if args.config else "SmolLM2-135M",
            "disk_write_floor_bytes_per_s": floor,
            "disk_sequential_write_bytes_per_s": sequential,
            "rows": rows,
            "targets": targets,
        },
    )


def steady_rate(marks: list[tuple[float, int]]) -> float:
    """Facts a second between the first and the last batch the job reported done: the job's rate once its
    actors are up and their models loaded (a serving-sized model takes seconds to load, once per job)."""
    done = [(t, n) for t, n in marks if n > 0]
    if len(done) < 2 or done[-1][1] == done[0][1]:
        return 0.0
    return (done[-1][1] - done[0][1]) / (done[-1][0] - done[0][0])


def write_floor(folder: Path, file_bytes: int, count: int, threads: int = 8) -> float:
    """Bytes a second this disk takes durably in files of `file_bytes`: each written, fsynced and renamed on
    `threads` threads like the store's (the floor of any job that stores what it encodes)."""
    folder.mkdir(parents=True, exist_ok=True)
    payload = os.urandom(file_bytes)

    def one(index: int) -> None:
        tmp, final = folder / f".{index}.tmp", folder / f"{index}.bin"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(count)))
    fd = os.open(folder, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    elapsed = time.perf_counter() - start
    shutil.rmtree(folder, ignore_errors=True)
    return file_bytes * count / elapsed


def sequential_write_rate(folder: Path, total_bytes: int, chunk: int = 64 << 20) -> float:
    """Bytes a second this disk takes durably as one file written in large pieces and fsynced once: what a
    log-structured layout of the records could reach at best."""
    folder.mkdir(parents=True, exist_ok=True)
    payload = os.urandom(min(chunk, total_bytes))
    start = time.perf_counter()
    fd = os.open(folder / "all.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        while written < total_bytes:
            written += os.write(fd, payload[: total_bytes - written])
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - start
    shutil.rmtree(folder, ignore_errors=True)
    return total_bytes / elapsed


def random_weights_model(config_path: Path, into: Path, dtype: str) -> str:
    """A loadable model folder of the shape: SmolLM2's tokenizer and vocabulary, random weights."""
    path, _ = shaped_model(config_path, into)
    random_model(Path(path), dtype, "cuda" if torch.cuda.is_available() else "cpu").model.save_pretrained(path)
    return path


def _plain_prefill(loaded, jobs, max_batch_tokens: int) -> float:
    """Seconds for a plain forward of the same sequences, in the same token-budgeted batches (best of 2)."""
    model, device = loaded.model, next(loaded.model.parameters()).device
    batches = plan_batches(jobs, max_batch_tokens)
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        for batch in batches:
            rows = [jobs[i] for i in batch]
            width = max(job.length for job in rows)
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, job in enumerate(rows):
                seq = torch.tensor(job.context_ids + job.target_ids)
                ids[r, : len(seq)], mask[r, : len(seq)] = seq, 1
            with torch.inference_mode():
                model(input_ids=ids.to(device), attention_mask=mask.to(device))
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


if __name__ == "__main__":
    main()
