"""Where an encoding worker spends its time: cProfile over `EncodeWorker` batches, beside the disk's write floor.

The worker runs in this process (no Ray), on batches of task rows like a job's, so forward passes, host
copies, embedding and the tenant store's writes (records, Redis, index) show up in one profile. The
floor writes the same bytes in files of the same size, each fsynced, on the store's thread count. Not a
benchmark with targets: a diagnostic that prints the phases and the top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks._common import scratch_dir, write_profile  # noqa: E402
from benchmarks.encode_job import random_weights_model, sentence, write_floor  # noqa: E402
from cluster.redis_server import LocalRedis  # noqa: E402
from config import load_settings  # noqa: E402
from encoder_jobs.inputs import ExplicitFact  # noqa: E402
from encoder_jobs.tasks import task_rows  # noqa: E402
from encoder_jobs.worker import EncodeWorker  # noqa: E402
from kvcore.conversation import Turn  # noqa: E402
from models.minilm import MiniLMEmbedder  # noqa: E402
from tenants.connect import connect_service  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, help="HF config.json of a model shape to run with random weights")
    p.add_argument("--window", type=int, default=0)
    p.add_argument("--facts", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--out", type=Path, required=True, help="where to write the profile as text")
    args = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    folder = Path(scratch_dir(prefix="profile-encode-"))
    settings = load_settings(state_dir=folder / "state")
    if torch.cuda.is_available():
        settings.model.dtype = "bfloat16"
    if args.config:
        settings.model.path = Path(random_weights_model(args.config, folder / "model", settings.model.dtype))
    server = LocalRedis(folder / "redis").start()
    try:
        service = connect_service(server.url, settings.state_dir, MiniLMEmbedder(), settings.tenants)
        admin = service.ensure_admin_key()
        service.create_tenant(admin, "prof", window=args.window)
        rng = random.Random(0)
        turns = [Turn("User" if i % 2 else "Assistant", sentence(rng, 18)) for i in range(args.facts + 20)]
        facts = [ExplicitFact(sentence(rng, 22), 20 + i) for i in range(args.facts)]
        rows = task_rows("prof", turns, facts, args.window)
        worker = EncodeWorker(settings.model_dump(mode="json"), server.url, admin, "prof", args.window)
        batches = [rows[i : i + args.batch] for i in range(0, len(rows), args.batch)]
        worker(_columns(batches[0]))  # warm-up (kernels, allocator), unprofiled
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        for batch in batches[1:]:
            statuses = worker(_columns(batch))["status"]
            assert set(statuses) == {"encoded"}, statuses
        profile.disable()
        elapsed = time.perf_counter() - start
        stored = sum(f.stat().st_size for f in (settings.state_dir).rglob("*.safetensors"))
        per_fact = stored / len(rows)
        floor = write_floor(folder / "floor", int(per_fact), len(rows) - len(batches[0]))
        done = len(rows) - len(batches[0])
        write_profile(
            args.out,
            f"w={args.window}: {done / elapsed:.1f} facts/s ({done * per_fact / elapsed / 1e9:.2f} "
            f"GB/s of records, {per_fact / 1e6:.2f} MB a fact); disk write floor "
            f"{floor / 1e9:.2f} GB/s",
            profile,
        )
    finally:
        server.stop()


def _columns(rows: list[dict]) -> dict[str, list]:
    return {name: [row[name] for row in rows] for name in rows[0]}


if __name__ == "__main__":
    main()
