"""The serving benchmark's load generator keeps each answer's own account of its time when asked, and the
benchmark reads the legs of a loaded chat from it."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from benchmarks._http_load import closed_loop
from benchmarks.serve_http import load_legs


class _Answers(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        size = int(self.headers["Content-Length"])
        asked = json.loads(self.rfile.read(size))["n"]
        body = json.dumps(
            {"usage": {"ttft_ms": float(asked), "hop_ms": {"layout": asked / 10}, "engine_ttft_ms": 1.0, "x": 7}}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


def test_a_loaded_run_keeps_the_asked_usage_keys_and_their_medians_are_the_legs():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        calls = [("key", {"n": n}) for n in (1, 2, 3, 4, 5)]
        kept = closed_loop(base, "/chat", calls, users=2, processes=1, usage_keys=("ttft_ms", "hop_ms"))
        plain = closed_loop(base, "/chat", calls, users=2, processes=1)
    finally:
        server.shutdown()
    assert kept.requests == 5 and sorted(u["ttft_ms"] for u in kept.usages) == [1, 2, 3, 4, 5]
    assert all(set(u) == {"ttft_ms", "hop_ms"} for u in kept.usages)  # only the keys asked for
    assert plain.usages == []
    legs = load_legs(kept)
    assert legs["ttft_ms"] == 3 and legs["hop_layout"] == 0.3 and "engine_ttft_ms" not in legs
    assert legs["client"] > 0 and load_legs(plain) == {}
