"""The README's client snippets (Mem0's and OpenAI's), run as written against the real cluster."""

from __future__ import annotations

import contextlib
import io
import os
import re
import time
from pathlib import Path

import pytest
import requests

os.environ.setdefault("MEM0_TELEMETRY", "False")  # read when mem0 is imported: no calls home from the tests
README = Path(__file__).resolve().parents[2] / "README.md"


def snippet(name: str) -> str:
    found = re.search(rf"<!-- snippet: {name} -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert found, f"the README has no {name} snippet"
    return found.group(1)


def run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the README's own code, as a user runs it
    return out.getvalue()


def test_the_readmes_mem0_and_openai_snippets_run_as_written(cluster, monkeypatch):
    pytest.importorskip("mem0", reason="mem0ai is not installed (scripts/dev.sh setup installs it)")
    auth = cluster.new_tenant("readme-app")
    monkeypatch.setenv("INFERSCALE_URL", cluster.base)
    monkeypatch.setenv("INFERSCALE_KEY", auth["Authorization"].split()[1])
    assert run(snippet("mem0")).strip() == "My cat is called Pixel."
    listed = requests.get(f"{cluster.base}/v1/memories", params={"user_id": "alice"}, headers=auth, timeout=30).json()
    deadline = time.monotonic() + 120
    while not all(m["kv_ready"] for m in listed["results"]):  # encoded, so the chat injects it
        assert time.monotonic() < deadline, "the memory was not encoded in time"
        time.sleep(0.3)
        listed = requests.get(
            f"{cluster.base}/v1/memories", params={"user_id": "alice"}, headers=auth, timeout=30
        ).json()
    answer, injected = run(snippet("openai")).rsplit(maxsplit=1)
    assert "Pixel" in answer and int(injected) > 0, (answer, injected)
