"""A model replica that dies, is unavailable or sheds load mid-request ends the chat with a retryable 503 event
(the HTTP layer answers 503 before the first byte, or ends the stream with an error), never a 500."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.exceptions import BackPressureError

from deployments.ray_serve.ingress import ServeLLMBackend
from kvcore.errors import KVCoreError


class _Stream:
    def __init__(self, events, error):
        self.chat = self
        self._events, self._error = events, error

    def remote(self, task):
        return _Events(self._events, self._error)


class _Events:
    """What a streaming handle call returns: an async iterator that can be cancelled."""

    def __init__(self, events, error, delay_s=0.0):
        self._events, self._error, self._delay_s, self.cancelled = list(events), error, delay_s, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(self._delay_s)
        if self._events:
            return self._events.pop(0)
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled = True


class _Handle:
    """A deployment handle: `options(stream=True)` streams; the transport option keeps the handle."""

    handle_options = SimpleNamespace(_by_reference=False)

    def __init__(self, events, error):
        self._stream = _Stream(events, error)

    def options(self, stream=False, **transport):
        return self._stream if stream else self


async def _collect(backend):
    return [event async for event in backend.chat({"tenant_id": "t"})]


@pytest.mark.parametrize(
    "error",
    [
        ActorDiedError(),
        ActorUnavailableError("gone", None),
        BackPressureError(num_queued_requests=9, max_queued_requests=8),
    ],
    ids=["died", "unavailable", "back-pressure"],
)
def test_a_replica_lost_mid_chat_ends_it_with_a_retryable_503(error):
    events = asyncio.run(_collect(ServeLLMBackend(_Handle([{"delta": "Hel"}], error))))
    assert events[0] == {"delta": "Hel"} and events[-1]["error"]["status"] == 503 and len(events) == 2


def test_other_errors_are_not_hidden():
    with pytest.raises(ZeroDivisionError):
        asyncio.run(_collect(ServeLLMBackend(_Handle([], ZeroDivisionError()))))
    assert asyncio.run(_collect(ServeLLMBackend(_Handle([{"done": True}], None)))) == [{"done": True}]


def test_a_chat_no_replica_starts_in_time_is_a_retryable_503_and_is_cancelled():
    pending = _Events([{"delta": "late"}], None, delay_s=5.0)

    class _Slow:
        chat = None
        handle_options = SimpleNamespace(_by_reference=False)

        def options(self, stream=False, **transport):
            return self

        def remote(self, task):
            return pending

    _Slow.chat = _Slow()
    events = asyncio.run(_collect(ServeLLMBackend(_Slow(), first_event_timeout_s=0.05)))
    assert len(events) == 1 and events[0]["error"]["status"] == 503 and "0.05 s" in events[0]["error"]["message"]
    assert pending.cancelled


class _HistoryEngine:
    """An engine whose history capture fails as given, and remembers what it was asked to drop."""

    def __init__(self, error):
        self.error, self.dropped = error, []

    async def encode_history(self, tenant_id, history_id, text):
        raise self.error

    def drop_history(self, tenant_id, history_id):
        self.dropped.append((tenant_id, history_id))
        return 3


@pytest.mark.parametrize(
    ("error", "status", "says"),
    [
        (ValueError("the history is empty"), 422, "the history is empty"),
        (KVCoreError("record h.c00007 not found"), 503, "retry"),
        (OSError("No space left on device"), 503, "No space left"),
        (torch.OutOfMemoryError("CUDA out of memory"), 503, "out of device memory"),
    ],
)
def test_a_history_capture_that_fails_answers_a_4xx_or_503_and_keeps_none_of_its_chunks(error, status, says):
    """A capture that left a chunk unwritten (a record missing, a full disk) is the server's, retryable, and its
    chunks are deleted; a history the engine refuses is the caller's. Neither is a 500."""
    from deployments.ray_serve.llm_server import LLMServer

    server = LLMServer.__new__(LLMServer)  # no engine started: the method's error handling alone
    server.engine = _HistoryEngine(error)
    server.service = SimpleNamespace(open_tenant=lambda key, tenant_id: SimpleNamespace(id=tenant_id))
    answer = asyncio.run(server.encode_history({"api_key": "k", "tenant_id": "t", "text": "hi"}))
    assert answer["error"]["status"] == status and says in answer["error"]["message"]
    assert len(server.engine.dropped) == 1 and server.engine.dropped[0][0] == "t"


class _ChatEngine:
    """An engine whose chat fails as given before its first event."""

    def __init__(self, error):
        self.error = error

    async def chat(self, task):
        raise self.error
        yield {}


@pytest.mark.parametrize(
    ("error", "status"), [(ValueError("prompt too long"), 400), (torch.OutOfMemoryError("CUDA out of memory"), 503)]
)
def test_a_chat_the_engine_refuses_or_has_no_device_memory_for_is_a_4xx_or_a_retryable_503(error, status):
    from deployments.ray_serve.llm_server import LLMServer

    server = LLMServer.__new__(LLMServer)
    server.engine = _ChatEngine(error)

    async def events():
        return [event async for event in server.chat(SimpleNamespace(tenant_id="t"))]

    (event,) = asyncio.run(events())
    assert event["error"]["status"] == status
