"""The `inferscale` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import logging
import sys

from config import load_settings
from kvcore.errors import KVCoreError

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferscale", description="Multi-tenant LLM serving with memory injected as KV.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="encode a built-in conversation's facts and answer questions both ways")
    demo.add_argument("--window", type=int, default=None, help="context window in turns (default: settings)")
    demo.add_argument("--max-new-tokens", type=int, default=40)
    demo.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    settings = load_settings()
    if getattr(args, "dtype", None):
        settings.model.dtype = args.dtype
    if getattr(args, "window", None) is not None:
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
    except (KVCoreError, FileNotFoundError) as exc:
        print(f"inferscale: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
