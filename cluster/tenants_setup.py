"""Bootstrap the tenants layer from settings: Redis (given, or a local redis-server), records, indexes, MiniLM."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from cluster.redis_server import LocalRedis
from config.settings import Settings
from models.minilm import MiniLMEmbedder
from tenants.connect import connect_service
from tenants.embedding import Embedder
from tenants.reconcile import reconcile
from tenants.service import TenantService

log = logging.getLogger(__name__)


@dataclass
class Tenants:
    """The tenant service of a command, and the redis-server it started, closed together."""

    service: TenantService
    redis: LocalRedis | None  # the server this process started, if any

    def close(self) -> None:
        self.service.indexes.save_all()
        self.service.meta.close()
        if self.redis is not None:
            self.redis.stop()


def open_tenants(settings: Settings, embedder: Embedder | None = None) -> Tenants:
    """Connect (starting redis-server under the state folder when no URL is set) and repair old half-done changes."""
    server = None
    url = settings.redis.url
    if url is None:
        server = LocalRedis(settings.state_dir / "redis", settings.redis.port, settings.redis.appendfsync).start()
        url = server.url
    service = connect_service(url, settings.state_dir, embedder or MiniLMEmbedder(), settings.tenants)
    reconcile(service.meta, service.records, older_than_s=settings.tenants.reconcile_after_s)
    return Tenants(service, server)
