"""What the ingress needs of the LLM deployment: chats streamed (the gateway) and new facts encoded (the fact
encoder). `deployments/ray_serve/ingress.py` implements it over Serve handles."""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Protocol

from deployments.chat_task import ChatAhead, ChatTask


class LLMBackend(Protocol):
    """What the gateway needs of the LLM deployment: chats streamed, facts and histories encoded."""

    def chat(self, task: ChatTask, sent: Callable[[], None] | None = None) -> AsyncIterator[dict[str, Any]]:
        """The chat's events; `sent` is called once the task has left for the replica."""
        ...

    def ahead(self, note: ChatAhead) -> None:
        """Tell the replica that will serve the chat what it can prepare before its task comes (or nothing)."""
        ...

    async def encode(self, api_key: str, tenant_id: str, facts: list[tuple[str, int, str]]) -> dict[str, str]: ...

    async def encode_history(self, api_key: str, tenant_id: str, text: str) -> dict[str, Any]: ...

    async def record_dtype(self) -> str:
        """The dtype the LLM replicas store the records they encode in (encoding jobs store theirs alike)."""
        ...
