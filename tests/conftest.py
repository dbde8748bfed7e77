"""Shared fixtures: one real model per session, GPU tests skipped without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from cluster.ray_head import LOOPBACK_ENV

# Before any test module imports ray: Ray reads these at import (with them, a local Ray takes 127.0.0.1 as its
# node address and its processes listen there, not on the machine's public interface).
os.environ.update(LOOPBACK_ENV)
# Ray Serve holds a stopping direct-ingress replica open 30 s so that an outside load balancer can take it out of
# rotation; the tests' HAProxy runs beside it and their clusters are torn down whole, so every teardown (the
# session's cluster, the two-node run, the CLI's deploys) would wait those 30 s for nothing. Inherited by the Ray
# processes the tests start.
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")


# The session fixtures that start something heavy, and the marker of every test that uses one (directly or
# through another fixture), so `-m` selects tests by what they need; a module that needs one without a
# fixture (a library, a subprocess) says so with its own `pytestmark`.
NEEDS = {"redis_server": "redis", "loaded": "model", "ray_local": "ray", "cluster": "serve", "llm": "vllm"}
# A test with any of these is also marked `heavy`; `bash scripts/dev.sh test fast` runs the rest (the pure tier).
HEAVY = ("model", "vllm", "redis", "ray", "serve", "gpu", "slow")


def late_rank(item: pytest.Item) -> int:
    marker = item.get_closest_marker("late")
    return int(marker.args[0]) if marker is not None else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for fixture, marker in NEEDS.items():
            if fixture in item.fixturenames:
                item.add_marker(marker)
        if any(item.get_closest_marker(marker) for marker in HEAVY):
            item.add_marker("heavy")
    items.sort(key=late_rank)  # stable: tests marked `late` run last, in rank order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One real redis-server for the session (tests flush it as they need)."""
    from cluster.redis_server import LocalRedis

    server = LocalRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def settings():
    from config import load_settings

    return load_settings()


@pytest.fixture(scope="session")
def loaded(settings):
    """SmolLM2-135M-Instruct in float32, converted from the bundled GGUF once per cache."""
    from models.loader import load_model

    torch.manual_seed(0)
    return load_model(settings.model.model_copy(update={"dtype": "float32"}))


@pytest.fixture(scope="session")
def frame(loaded, settings):
    from models.chat import build_frame

    return build_frame(loaded.tokenizer, settings.system_prompt)


@pytest.fixture(scope="session")
def forward(loaded):
    from models.transformers_adapter import HFKVForward

    return HFKVForward(loaded)


@pytest.fixture(scope="session")
def engine(loaded):
    from models.transformers_adapter import ReferenceEngine

    return ReferenceEngine(loaded)


@pytest.fixture(scope="session")
def ray_local():
    """One in-process Ray for the session (encoding jobs and the Serve tests), on loopback, many logical CPUs,
    Serve in the proxy mode the settings name (INFERSCALE_SERVE__PROXY; high-throughput mode by default)."""
    import shutil
    import tempfile
    from pathlib import Path

    import ray

    from config import load_settings
    from deployments.ray_serve.serve_mode import apply_serve_env

    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's unix sockets must fit 107 characters
    serve = load_settings().serve
    apply_serve_env(serve.proxy, Path(temp_dir) / "serve", serve.haproxy_busy_polling)
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        _temp_dir=temp_dir,
        _node_ip_address="127.0.0.1",
    )
    yield ray
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)
