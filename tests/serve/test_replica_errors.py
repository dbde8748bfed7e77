"""A model replica that dies, is unavailable or sheds load mid-request ends the chat with a retryable 503 event
(the HTTP layer answers 503 before the first byte, or ends the stream with an error), never a 500."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.exceptions import BackPressureError

from deployments.ray_serve.ingress import ServeLLMBackend


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
