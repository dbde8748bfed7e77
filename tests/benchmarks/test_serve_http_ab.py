"""The serving benchmark's A/B of two ingress apps: each sample key reaches its own app's route (the base URL's path
kept on the wire), and the A/B figures are each side's own."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from benchmarks import serve_http


def _sample(ttft: float, engine: float, retrieval: float) -> dict:
    return {
        "ttft_ms": ttft,
        "server_ttft_ms": ttft - 1.0,
        "engine_ttft_ms": engine,
        "retrieval_ms": retrieval,
        "retrieval_embed_ms": retrieval - 0.1,
        "embed_legs_ms": {},
        "retrieval_legs_ms": {},
        "hop_ms": {},
        "ingress_ms": {},
        "cpu_ms": {},
        "prefilled_tokens": 5,
        "load_failed_tokens": 0,
    }


class _Paths(BaseHTTPRequestHandler):
    """A streamed chat's one event with usage, its usage saying which path was asked."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        usage = {
            "engine_ttft_ms": 1.0,
            "ttft_ms": 2.0,
            "retrieval_ms": 0.5,
            "retrieval_ahead_ms": 0.1,
            "retrieval_embed_ms": 0.4,
        }
        usage |= {"prefilled_tokens": 3, "injected_tokens": 0, "load_failed_tokens": 0, "prompt_tokens": 9}
        usage["path"] = self.path
        event = {"choices": [{"delta": {"content": "x"}}], "usage": usage}
        body = f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


def test_each_sample_key_reaches_its_own_ingress_route(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Paths)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    paths: list[str] = []
    real = serve_http.streamed

    def recording(url, key, k, mode, text):
        ms, usage = real(url, key, k, mode, text)
        paths.append((mode, usage["path"]))
        return ms, usage

    monkeypatch.setattr(serve_http, "streamed", recording)
    samples: dict[str, list[dict]] = {"inject": [], "prompt": [], "inject@b": []}
    try:
        serve_http.sample_rounds(base, [("t", "key")], 5, 2, samples, alternate=base + "/b")
    finally:
        server.shutdown()
    assert (
        paths
        == [
            ("inject", "/v1/chat/completions"),
            ("prompt", "/v1/chat/completions"),
            ("inject", "/b/v1/chat/completions"),
        ]
        * 2
    )
    assert [len(v) for v in samples.values()] == [2, 2, 2]


def test_the_ab_figures_are_each_sides_own_and_b_over_a_their_ratio():
    first = [_sample(10.0 + i, 6.0, 1.5) for i in range(5)]  # HTTP - engine 4..8, p50 6
    second = [_sample(9.0 + i, 6.0, 1.0) for i in range(5)]  # 3..7, p50 5
    ab = serve_http.ab_figures({"query_embedding": "process"}, first, second)
    assert ab["a"]["http_minus_engine_ttft_ms"]["p50"] == 6.0 and ab["b"]["http_minus_engine_ttft_ms"]["p50"] == 5.0
    assert ab["b_over_a"] == {"http_minus_engine_p50": round(5 / 6, 4), "retrieval_p50": round(1.0 / 1.5, 4)}
    assert ab["ingress_b"] == {"query_embedding": "process"}


def test_the_gap_counts_only_the_part_of_retrieval_inside_the_handler_and_its_legs_sum_to_it():
    """Retrieval begun in the middleware overlaps the way to the handler: counting it whole would count that time
    twice (the legs would sum to more than the gap)."""
    sample = _sample(20.0, 12.0, 1.5) | {
        "retrieval_ahead_ms": 0.4,
        "ingress_ms": {"to_handler": 0.5, "to_transport": 0.05},
        "hop_ms": {"to_replica": 0.5, "layout": 0.3, "first_token_back": 0.25},
    }
    legs = serve_http.gap_legs([sample])
    assert legs["retrieval"] == 1.1
    assert abs(sum(legs.values()) - (sample["ttft_ms"] - sample["engine_ttft_ms"])) < 1e-9
    assert serve_http.gap_legs([sample | {"retrieval_ahead_ms": 0.0}])["retrieval"] == 1.5


def test_an_ab_only_run_states_each_sides_gap_as_a_target():
    ab = serve_http.ab_figures(
        {"retrieval_ahead": "off"},
        [_sample(10.0, 7.0, 1.0), _sample(12.0, 8.0, 1.2)],
        [_sample(11.0, 7.0, 1.5), _sample(14.0, 8.0, 1.7)],
    )
    targets = serve_http.ab_targets(ab, k=50)
    assert [(t["value"], t["goal"], t["met"]) for t in targets] == [(3.5, "<= 3", False), (5.0, "<= 3", False)]
    assert "ingress a" in targets[0]["name"] and "ingress b" in targets[1]["name"]
