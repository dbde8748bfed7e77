"""Multi-tenant load on an inferscale cluster: users spread over N tenants, questions and memory writes mixed.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --tenants 20 --mode inject
    locust -f loadtest/locustfile.py --host ... --headless -u 50 -r 10 -t 2m --csv out/run --mode prompt

Needs the admin key (`INFERSCALE_ADMIN_KEY`, or `--admin-key`). At start it creates the tenants
(`loadtest-<run>-<i>`), gives each its own facts, and removes them at the end (unless `--keep-tenants`);
`--tenants-file` instead loads tenants made beforehand (a JSON list of `{"id", "key", "person"}`), so the
load starts once their facts are encoded and measures steady serving apart from the write burst.
`--mode` compares KV injection with pasting the same facts (`prompt`) or no memory (`off`); `--k` sets the
facts per question; `--ack-log` records every acknowledged write, for fault tests to audit.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import time
import uuid

import requests
from gevent.pool import Pool
from locust import HttpUser, between, events, task

NAMES = ["Maya", "Ravi", "Lena", "Tomas", "Aiko", "Omar", "Nina", "Jonas"]
PETS = ["cat", "dog", "parrot", "rabbit"]
CITIES = ["Porto", "Lyon", "Osaka", "Quito", "Tallinn", "Accra"]
QUESTIONS = [
    "What pet does {n} have?",
    "Where does {n} live?",
    "What is {n} allergic to?",
    "What does {n} do for work?",
]
_tenants: list[tuple[str, str, str]] = []  # (tenant id, api key, person)
_next = itertools.count()


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--tenants", type=int, default=10, help="tenants to create")
    parser.add_argument("--facts", type=int, default=20, help="facts per tenant")
    parser.add_argument("--mode", choices=["inject", "prompt", "off"], default="inject")
    parser.add_argument("--k", type=int, default=10, help="facts retrieved per question")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream chats (their first token is an entry of its own); --no-stream: whole answers, whose status codes "
        "fault tests audit",
    )
    parser.add_argument("--write-ratio", type=float, default=0.1, help="share of tasks that write a memory")
    parser.add_argument("--admin-key", default=os.environ.get("INFERSCALE_ADMIN_KEY", ""))
    parser.add_argument(
        "--ack-log", default="", help="append `tenant<TAB>fact id<TAB>text` of every acknowledged write"
    )
    parser.add_argument(
        "--keep-tenants", action="store_true", help="leave the tenants in place at the end (to audit them)"
    )
    parser.add_argument(
        "--tenants-file",
        default="",
        help="JSON list of existing tenants {id, key, person} to load instead of creating (and removing) tenants",
    )


def facts_for(person: str, count: int, rng: random.Random) -> list[str]:
    base = [
        f"{person} has a {rng.choice(PETS)} called {rng.choice(['Pixel', 'Tofu', 'Mango', 'Biscuit'])}.",
        f"{person} lives in {rng.choice(CITIES)}.",
        f"{person} is allergic to {rng.choice(['peanuts', 'pollen', 'cats'])}.",
        f"{person} works as a {rng.choice(['nurse', 'baker', 'pilot', 'teacher'])}.",
    ]
    return (base + [f"{person} noted detail number {i}: {rng.choice(CITIES)} in {2000 + i}." for i in range(count)])[
        :count
    ]


@events.test_start.add_listener
def _create_tenants(environment, **_) -> None:
    """The tenants and their facts, 16 at a time (a hundred tenants one by one would eat a short run)."""
    options = environment.parsed_options
    if options.tenants_file:
        with open(options.tenants_file) as given:
            _tenants.extend((t["id"], t["key"], t["person"]) for t in json.load(given))
        return
    run = uuid.uuid4().hex[:6]
    admin = {"Authorization": f"Bearer {options.admin_key}"}

    def create(i: int) -> tuple[str, str, str]:
        tenant_id, person = f"loadtest-{run}-{i}", NAMES[i % len(NAMES)]
        created = requests.post(f"{environment.host}/v1/tenants", json={"id": tenant_id}, headers=admin, timeout=60)
        created.raise_for_status()
        key = created.json()["api_key"]
        requests.post(
            f"{environment.host}/v1/memories",
            json={"facts": facts_for(person, options.facts, random.Random(i))},
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        ).raise_for_status()
        return tenant_id, key, person

    _tenants.extend(Pool(16).map(create, range(options.tenants)))  # greenlets: locust runs under gevent


@events.test_stop.add_listener
def _remove_tenants(environment, **_) -> None:
    if environment.parsed_options.keep_tenants or environment.parsed_options.tenants_file:
        return
    admin = {"Authorization": f"Bearer {environment.parsed_options.admin_key}"}
    for tenant_id, _, _ in _tenants:
        requests.delete(f"{environment.host}/v1/tenants/{tenant_id}", headers=admin, timeout=60)
    _tenants.clear()


class MemoryUser(HttpUser):
    """One user of one tenant (users are dealt over the tenants round robin)."""

    wait_time = between(0.05, 0.3)

    def on_start(self) -> None:
        self.tenant_id, key, self.person = _tenants[next(_next) % len(_tenants)]
        self.client.headers["Authorization"] = f"Bearer {key}"
        self.options = self.environment.parsed_options

    @task
    def ask_or_write(self) -> None:
        if random.random() < self.options.write_ratio:
            text = f"{self.person} mentioned {uuid.uuid4().hex[:8]} today."
            answer = self.client.post("/v1/memories", json={"facts": [text]}, name="/v1/memories")
            if answer.status_code == 200 and self.options.ack_log:
                with open(self.options.ack_log, "a") as log:  # acknowledged: it must be stored, exactly once
                    log.write(f"{self.tenant_id}\t{answer.json()['results'][0]['id']}\t{text}\n")
            return
        if self.options.stream:
            self._streamed_chat()
        else:
            self._chat()

    def _body(self) -> dict:
        return {
            "model": "inferscale-smollm2",
            "max_tokens": self.options.max_tokens,
            "messages": [{"role": "user", "content": random.choice(QUESTIONS).format(n=self.person)}],
            "memory": {"k": self.options.k, "mode": self.options.mode},
        }

    def _chat(self) -> None:
        with self.client.post(
            "/v1/chat/completions",
            json=self._body(),
            name=f"/v1/chat/completions [{self.options.mode}]",
            catch_response=True,
        ) as response:
            if response.status_code != 200:
                response.failure(f"{response.status_code}: {response.text[:200]}")
            elif self._prefilled_everything(response.json()["usage"]):
                response.failure("inject mode prefilled the whole prompt")

    def _prefilled_everything(self, usage: dict) -> bool:
        return self.options.mode == "inject" and usage["prefilled_tokens"] >= usage["prompt_tokens"] > 60

    def _streamed_chat(self) -> None:
        """One question, streamed as chat clients read it: the whole answer is the request's entry, and the time to
        its first token is an entry of its own (`... first token`), as the serving figures report it."""
        body = self._body() | {"stream": True, "stream_options": {"include_usage": True}}
        name = f"/v1/chat/completions [{self.options.mode}]"
        started = time.perf_counter()
        with self.client.post(
            "/v1/chat/completions", json=body, name=name, stream=True, catch_response=True
        ) as response:
            if response.status_code != 200:
                response.failure(f"{response.status_code}: {response.text[:200]}")
                return
            try:
                first, usage, error, size = read_stream(response, started)
            except (requests.RequestException, ValueError, AttributeError, TypeError) as exc:
                # cut mid-stream, a line that is not JSON, or an event that is not the shape a chat's is
                first, usage, error, size = None, None, f"the stream broke: {exc!r}", 0
            finally:
                response.close()  # read to its end or not: its connection goes back to the pool
            response.request_meta["response_time"] = (time.perf_counter() - started) * 1000  # not its headers'
            response.request_meta["response_length"] = size
            if error is not None:
                response.failure(error)
            elif first is None:
                response.failure("the stream ended with no token")
            elif usage is None:
                response.failure("the stream carried no usage (stream_options.include_usage)")
            elif self._prefilled_everything(usage):
                response.failure("inject mode prefilled the whole prompt")
            if first is not None:
                self.environment.events.request.fire(
                    request_type="POST",
                    name=f"{name} first token",
                    response_time=first,
                    response_length=0,
                    exception=None,
                    context={},
                )


def read_stream(response, started: float) -> tuple[float | None, dict | None, str | None, int]:
    """An SSE chat stream read to its end: ms from `started` to the first chunk with a choice, the usage chunk, an
    error event's message, and the bytes read."""
    first = usage = error = None
    size = 0
    for line in response.iter_lines():
        size += len(line) + 1
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[len(b"data: ") :])
        if "error" in event:
            error = f"the stream ended in an error: {event['error'].get('message', event['error'])}"
            break
        if event.get("choices") and first is None:
            first = (time.perf_counter() - started) * 1000
        if event.get("usage"):
            usage = event["usage"]
    return first, usage, error, size
