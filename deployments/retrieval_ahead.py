"""A chat's retrieval started as its request reaches the ingress's middleware, before FastAPI routes, parses and
validates it for the handler: the question's forward and search then run on the device while FastAPI works (on H100
hosts that way to the handler was 0.41-0.44 ms of the 4.6 ms between HTTP's and the engine's first token,
2026-12-07).

The middleware reads the body (replaying it to FastAPI unchanged), validates it with the route's own model,
authenticates the key once for the request (the handler's dependency takes the outcome from the request's state,
so the rate limit counts it once) and plans the chat with the gateway's own checks. Anything it cannot do, it
leaves to the handler, which then does it as it always did and answers any error itself.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Awaitable, Callable, Mapping

from starlette.requests import Request

from deployments.gateway import EarlyChat, Gateway
from deployments.route_path import route_path
from deployments.schemas import GenerationRequest
from tenants.errors import TenantError

log = logging.getLogger(__name__)

AUTHENTICATED = "inferscale_authenticated"  # the request's state: its Tenant, or the TenantError its key met
EARLY = "inferscale_early_chat"  # the request's state: its EarlyChat
Receive = Callable[[], Awaitable[dict[str, Any]]]


class RetrievalAhead:
    """`begin` at a chat's arrival; the handler takes `EARLY` (and its dependency `AUTHENTICATED`) from the
    request's state; `end` once the app answered, for a chat whose handler never ran."""

    def __init__(
        self,
        gateway: Gateway,
        models: Mapping[str, type[GenerationRequest]],
        key_of: Callable[[Request], str | None],
    ) -> None:
        """`models`: each chat path's request model (FastAPI's own for the route); `key_of`: the request's API key."""
        self._gateway, self._models, self._key_of = gateway, models, key_of

    async def begin(self, scope: dict[str, Any], receive: Receive) -> Receive:
        """Read the body, and where it is a valid chat of a known key, plan it and start its retrieval; the
        `receive` to hand FastAPI, which gives it the same body."""
        read, whole = await _read_body(receive, self._gateway.args.max_body_bytes)

        async def replay() -> dict[str, Any]:
            return read.pop(0) if read else await receive()

        if whole is None or not _is_json(scope):
            return replay
        try:
            body = self._models[route_path(scope)].model_validate(json.loads(whole))
        except (ValueError, RecursionError):  # pydantic's ValidationError too; FastAPI answers it (422, or 400)
            return replay
        state = scope.setdefault("state", {})
        api_key = self._key_of(Request(scope))
        try:
            tenant = self._gateway.tenant(api_key)
        except TenantError as refused:
            state[AUTHENTICATED] = refused
            return replay
        except Exception:  # noqa: BLE001 - the handler's dependency meets it again and answers it
            log.warning("authenticating a chat ahead of its handler failed", exc_info=True)
            return replay
        state[AUTHENTICATED] = tenant
        try:
            plan = self._gateway.plan_chat(tenant, body)
        except TenantError:  # the handler plans it again and answers the error
            return replay
        except Exception:  # noqa: BLE001 - likewise
            log.warning("planning a chat ahead of its handler failed", exc_info=True)
            return replay
        state[EARLY] = EarlyChat(plan, self._gateway.start_retrieval(plan, body))
        return replay

    @staticmethod
    def end(scope: dict[str, Any]) -> None:
        early = scope.get("state", {}).pop(EARLY, None)
        if early is not None:
            early.abandon()


async def _read_body(receive: Receive, limit: int) -> tuple[list[dict[str, Any]], bytes | None]:
    """The messages read, and the whole body (None: the client left, or it outgrew `limit` without a length)."""
    read: list[dict[str, Any]] = []
    pieces, size = [], 0
    while True:
        message = await receive()
        read.append(message)
        if message["type"] != "http.request":
            return read, None
        piece = message.get("body", b"")
        pieces.append(piece)
        size += len(piece)
        if size > limit:
            return read, None
        if not message.get("more_body", False):
            return read, b"".join(pieces)


def _is_json(scope: dict[str, Any]) -> bool:
    """A body FastAPI would parse as JSON: no content type, or `application/json` or `application/...+json`."""
    value = next((v for k, v in scope["headers"] if k == b"content-type"), None)
    if value is None:
        return True
    kind = value.decode("latin-1").split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))
