"""A local Ray, a redis-server and a tenant for the encoder-job tests (real model, real Ray, real Redis)."""

from __future__ import annotations

import pytest

from config.settings import Settings
from models.minilm import MiniLMEmbedder
from tenants.connect import connect_service


@pytest.fixture()
def job_env(redis_server, tmp_path):
    """Settings on a fresh state folder, the admin key and a tenant with window 2."""
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    settings = Settings(state_dir=tmp_path / "state")
    service = connect_service(redis_server.url, settings.state_dir, MiniLMEmbedder(), settings.tenants)
    admin = service.ensure_admin_key()
    service.create_tenant(admin, "maya", window=2)
    return settings, service, admin
