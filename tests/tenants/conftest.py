"""The session's redis-server, flushed between tenants tests, and services built on it."""

from __future__ import annotations

import hashlib
import re

import numpy as np
import pytest
import redis

from config.settings import TenantSettings
from tenants.connect import connect_service


class WordEmbedder:
    """A fast stand-in for MiniLM in logic tests: hashed bag of words, normalised (shared words -> close)."""

    dim = 384

    def embed(self, texts):
        out = np.zeros((len(texts), self.dim), np.float32)
        for row, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()):
                out[row, int(hashlib.md5(word.encode()).hexdigest(), 16) % self.dim] += 1.0
            out[row] /= max(np.linalg.norm(out[row]), 1e-6)
        return out


@pytest.fixture()
def redis_url(redis_server):
    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url


@pytest.fixture()
def make_service(redis_url, tmp_path):
    """Build a service (a fresh one per call acts like another process over the same Redis and disk)."""

    def build(fault=None, embedder=None, **limits):
        service = connect_service(redis_url, tmp_path, embedder or WordEmbedder(), TenantSettings(**limits))
        if fault is not None:
            service.fault = fault
        return service

    return build


@pytest.fixture()
def service(make_service):
    return make_service()


@pytest.fixture()
def admin(service):
    return service.ensure_admin_key()
