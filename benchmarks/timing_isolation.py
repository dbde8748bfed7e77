"""Cross-tenant timing isolation: can an attacker tenant tell from its own TTFT whether another tenant just
used a text (the prefix-cache attack) or holds a fact (the K/V-injection attack)?

Each probe draws a fresh secret. Prefix cache: the victim sends a chat holding the secret (or, in the other
class, an unrelated one), then the attacker sends the secret chat and times it. Injection: the victim stores
the secret as a fact with K/V (or does not), the attacker stores the same text in its own memory and asks
with `mode: inject`. The score is the ROC AUC of the best threshold on the attacker's TTFT between the two
classes (0.5: indistinguishable). A positive control runs the prefix probe with the attacker as its own
victim (a cache it may share), so the probe is shown to detect a cache hit when there is one. Both attacks
run twice: across two tenants, and across two end users (scopes) of one tenant, whose K/V, prefix-cache salts
and records are kept apart the same way.

    python benchmarks/timing_isolation.py --out out/timing.json [--quick] [--base-url URL --admin-key KEY]
"""

from __future__ import annotations

import random
import string
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import parser, target, write_report  # noqa: E402

MODEL = "inferscale-smollm2"


def auc(positive: list[float], negative: list[float]) -> float:
    """Probability that a random 'victim has it' TTFT is separated from a 'does not' one, taking the better
    direction (Mann-Whitney U / (n1 n2), folded to >= 0.5)."""
    wins = sum((p > n) + 0.5 * (p == n) for p in positive for n in negative)
    value = wins / (len(positive) * len(negative))
    return max(value, 1 - value)


def secret(rng: random.Random, words: int = 60) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) for _ in range(words))


@dataclass(frozen=True)
class Who:
    """A principal of the probes: a tenant's key, and an end user of that tenant (None: the tenant's own memory)."""

    key: str
    user: str | None = None

    def scope(self) -> dict[str, str]:
        return {"user_id": self.user} if self.user else {}


class Api:
    """The cluster's HTTP API as the timing attacks use it."""

    def __init__(self, base: str, admin_key: str) -> None:
        self.base, self.admin_key, self.http = base, admin_key, requests.Session()

    def tenant(self, tenant_id: str) -> str:
        self.http.delete(f"{self.base}/v1/tenants/{tenant_id}", headers=self._auth(self.admin_key), timeout=60)
        made = self.http.post(
            f"{self.base}/v1/tenants",
            json={"id": tenant_id, "window": 0},
            headers=self._auth(self.admin_key),
            timeout=60,
        )
        made.raise_for_status()
        return made.json()["api_key"]

    def chat(self, who: Who, text: str, mode: str, k: int = 0) -> float:
        """Engine TTFT (ms) of a one-token answer."""
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 1,
            "temperature": 0,
            "memory": {"k": k, "mode": mode},
        } | ({"user": who.user} if who.user else {})
        answer = self.http.post(f"{self.base}/v1/chat/completions", json=body, headers=self._auth(who.key), timeout=300)
        answer.raise_for_status()
        return answer.json()["usage"]["engine_ttft_ms"]

    def remember(self, who: Who, facts: list[str], timeout_s: float = 120) -> None:
        added = self.http.post(
            f"{self.base}/v1/memories", json={"facts": facts, **who.scope()}, headers=self._auth(who.key), timeout=120
        )
        added.raise_for_status()
        ids = [r["id"] for r in added.json()["results"]]
        deadline = time.monotonic() + timeout_s
        while not all(
            self.http.get(
                f"{self.base}/v1/memories/{i}", params=who.scope(), headers=self._auth(who.key), timeout=60
            ).json()["kv_ready"]
            for i in ids
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("facts were not encoded in time")
            time.sleep(0.2)

    def forget_all(self, who: Who) -> None:
        listed = self.http.get(
            f"{self.base}/v1/memories", params={"limit": 1000, **who.scope()}, headers=self._auth(who.key), timeout=60
        ).json()["results"]
        for fact in listed:
            self.http.delete(
                f"{self.base}/v1/memories/{fact['id']}", params=who.scope(), headers=self._auth(who.key), timeout=60
            )

    @staticmethod
    def _auth(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}


def prefix_probes(
    api: Api, victim: Who, attacker: Who, probes: int, rng: random.Random, words: int
) -> tuple[list[float], list[float]]:
    """Attacker TTFTs after the victim sent the same secret chat of `words` words (has) or another one (not),
    interleaved."""
    has, not_ = [], []
    for i in range(2 * probes):
        shared = secret(rng, words)
        api.chat(victim, shared if i % 2 == 0 else secret(rng, words), mode="off")
        (has if i % 2 == 0 else not_).append(api.chat(attacker, shared, mode="off"))
    return has, not_


def injection_probes(
    api: Api, victim: Who, attacker: Who, probes: int, rng: random.Random
) -> tuple[list[float], list[float]]:
    """Attacker TTFTs with the secret as its own injected fact, when the victim holds (and just used) it or not."""
    has, not_ = [], []
    for i in range(2 * probes):
        fact = "The code word is " + secret(rng, 20) + "."
        if i % 2 == 0:
            api.remember(victim, [fact])
            api.chat(victim, "What is the code word?", mode="inject", k=1)
        api.remember(attacker, [fact])
        (has if i % 2 == 0 else not_).append(api.chat(attacker, "What is the code word?", mode="inject", k=1))
        api.forget_all(attacker)
        api.forget_all(victim)
    return has, not_


def principals(api: Api, across: str) -> tuple[Who, Who]:
    """(victim, attacker): two tenants, or two end users (scopes) of one tenant."""
    if across == "tenants":
        return Who(api.tenant("timing-victim")), Who(api.tenant("timing-attacker"))
    key = api.tenant("timing-app")
    return Who(key, "victim"), Who(key, "attacker")


def run(
    api: Api, probes: int, injection_probes_count: int, seed: int = 0, across: str = "tenants", words: int = 60
) -> dict:
    """`words`: a prefix probe's secret length (a longer secret makes a cache hit save more prefill)."""
    rng = random.Random(seed)
    victim, attacker = principals(api, across)
    api.chat(attacker, "warm up", mode="off")
    clock = time.monotonic()
    prefix = prefix_probes(api, victim, attacker, probes, rng, words)
    control_started = time.monotonic()
    control = prefix_probes(api, attacker, attacker, max(10, probes // 4), rng, words)  # a cache it shares: detectable
    injection_started = time.monotonic()
    injection = injection_probes(api, victim, attacker, injection_probes_count, rng)
    seconds = {
        "prefix": control_started - clock,
        "control": injection_started - control_started,
        "injection": time.monotonic() - injection_started,
    }
    return {
        "across": across,
        "seconds": {name: round(value, 1) for name, value in seconds.items()},
        "probes": {"prefix": probes, "injection": injection_probes_count},
        "auc": {"prefix_cache": auc(*prefix), "fact_injection": auc(*injection), "control_own_cache": auc(*control)},
        "ttft_ms": {"prefix": prefix, "injection": injection, "control": control},
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--base-url")
    p.add_argument("--admin-key")
    args = p.parse_args()
    probes, injected = (60, 20) if args.quick else (200, 200)
    from benchmarks._cluster import cluster_for

    with cluster_for(args.base_url, args.admin_key, "timing") as (base, admin):
        runs = {across: run(Api(base, admin), probes, injected, across=across) for across in ("tenants", "scopes")}
    report = {
        "runs": runs,
        "targets": [
            t
            for across, r in runs.items()
            for t in (
                target(f"AUC, prefix-cache probe across {across}", r["auc"]["prefix_cache"], "<= 0.6"),
                target(f"AUC, fact-injection probe across {across}", r["auc"]["fact_injection"], "<= 0.6"),
                target(f"AUC, control: the attacker's own cache ({across})", r["auc"]["control_own_cache"], ">= 0.9"),
            )
        ],
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
