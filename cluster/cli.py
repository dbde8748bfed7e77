"""The `inferscale` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from config import load_settings
from config.connector import STORED_DTYPES
from encoder_jobs.inputs import JobInputError
from kvcore.errors import KVCoreError
from tenants.errors import TenantError

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inferscale", description="Multi-tenant LLM serving with memory injected as KV."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="encode a built-in conversation's facts and answer questions both ways")
    demo.add_argument("--window", type=int, default=None, help="context window in turns (default: settings)")
    demo.add_argument("--max-new-tokens", type=int, default=40)
    demo.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    up = sub.add_parser("up", help="start redis-server, a local Ray head and the serving app; create a demo tenant")
    up.add_argument("--port", type=int, default=None, help="HTTP port (default 8000, or a free one)")
    sub.add_parser("down", help="stop what `inferscale up` started")
    serve = sub.add_parser("serve", help="deploy a Serve config YAML onto the Ray cluster at RAY_ADDRESS")
    serve.add_argument("--config", required=True, type=Path)
    encode = sub.add_parser(
        "encode", help="encode a tenant's facts (explicit, or extracted from a conversation) or its history on Ray"
    )
    encode.add_argument("--tenant", required=True)
    encode.add_argument(
        "--input", required=True, type=Path, help="JSON: turns + facts, a LoCoMo conversation, or a history"
    )
    encode.add_argument("--window", type=int, default=None, help="context window in turns (default: the tenant's)")
    encode.add_argument(
        "--neighbours",
        type=int,
        default=None,
        help="nearest facts each fact is encoded behind, after its window (default: the tenant's)",
    )
    encode.add_argument(
        "--workers", type=int, default=1, help="encoding actors (on a GPU, encoding.actors_per_gpu of them share one)"
    )
    encode.add_argument("--batch-size", type=int, default=16, help="facts per actor call")
    encode.add_argument(
        "--record-dtype",
        choices=STORED_DTYPES,
        default=None,
        help="what the records are stored in: the serving app's llm.record_dtype (default: the encoding model's dtype)",
    )
    encode.add_argument(
        "--submit",
        metavar="DASHBOARD_URL",
        default=None,
        help="submit through the Ray Jobs API of an existing cluster instead of running here",
    )
    jobs = sub.add_parser("job", help="status or stop of a submitted encoding job")
    jobs.add_argument("action", choices=["status", "stop"])
    jobs.add_argument("job_id")
    jobs.add_argument("--submit", metavar="DASHBOARD_URL", required=True, help="the cluster's Ray Jobs API")
    tenants = sub.add_parser("tenant", help="create a tenant (prints its API key once)")
    tenants.add_argument("name")
    tenants.add_argument("--window", type=int, default=5)
    tenants.add_argument("--neighbours", type=int, default=0, help="nearest facts each fact is encoded behind")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    settings = load_settings()
    if getattr(args, "dtype", None):
        settings.model.dtype = args.dtype
    if getattr(args, "window", None) is not None and args.command == "demo":
        if args.window < 0:
            print("inferscale: error: --window must be >= 0", file=sys.stderr)
            return 2
        settings.encoding.window = args.window
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "demo":
            from cluster.demo import run_demo

            run_demo(settings, max_new_tokens=args.max_new_tokens, out=sys.stdout)
            return 0
        if args.command in ("up", "down", "serve"):
            from cluster import up

            if args.command == "up":
                return up.run_up(settings, port=args.port or up.default_port(), out=sys.stdout)
            return up.run_down(settings) if args.command == "down" else up.run_serve(settings, args.config)
        if args.command in ("encode", "tenant", "job"):
            from cluster.jobs_cli import run_encode, run_job_action, run_tenant_create

            handler = {"encode": run_encode, "tenant": run_tenant_create, "job": run_job_action}[args.command]
            return handler(settings, args)
    except (KVCoreError, FileNotFoundError, JobInputError, TenantError, ValueError) as exc:
        print(f"inferscale: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
