"""Request bodies of the HTTP API: OpenAI's chat completions (plus `memory`), Mem0-shaped memories, admin."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from deployments.memory_prompt import ChatMode, FactOrder
from tenants.errors import InvalidInputError
from tenants.scopes import Scope

UNSUPPORTED = "unsupported_parameter"  # a pydantic error type the chat route answers as OpenAI's 400 naming the field


def unsupported(param: str, message: str) -> PydanticCustomError:
    return PydanticCustomError(UNSUPPORTED, "{message}", {"param": param, "message": message})


class Message(BaseModel):
    """A chat message; OpenAI's `developer` role is a system message, text content parts are joined."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str = Field(..., min_length=1, max_length=32_000)

    @field_validator("role")
    @classmethod
    def _developer_is_system(cls, role: str) -> str:
        return "system" if role == "developer" else role

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, content: Any) -> Any:
        if not isinstance(content, list):
            return content
        kinds = sorted({str(part.get("type")) if isinstance(part, dict) else type(part).__name__ for part in content})
        if kinds != ["text"]:
            raise unsupported("content", f"content parts of type {', '.join(kinds)}: only text parts are supported")
        return "\n".join(str(part.get("text", "")) for part in content)


def scope_of(user_id: str | None, agent_id: str | None = None, run_id: str | None = None) -> Scope | None:
    """The end user's scope the ids name (None: the tenant's own memory); `ValueError` naming the problem."""
    if user_id is None:
        if agent_id is not None or run_id is not None:
            raise ValueError("agent_id and run_id narrow a user_id: send user_id too")
        return None
    try:
        return Scope(user_id, agent_id, run_id)
    except InvalidInputError as exc:
        raise ValueError(str(exc)) from None


def scope_input(user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None) -> Scope | None:
    """`scope_of` for ids a request sent apart from a body (a query, Mem0's fields): bad ids are bad input."""
    try:
        return scope_of(user_id, agent_id, run_id)
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None


class ScopeFields(BaseModel):
    """Whose memory a request is about (Mem0's entity ids); none: the tenant's own."""

    user_id: str | None = Field(None, description="The end user whose memory this is (a scope inside the tenant).")
    agent_id: str | None = Field(None, description="Narrows user_id to one agent of theirs.")
    run_id: str | None = Field(None, description="Narrows user_id to one run (session) of theirs.")

    @model_validator(mode="after")
    def _valid_scope(self) -> "ScopeFields":
        self.scope()
        return self

    def scope(self) -> Scope | None:
        return scope_of(self.user_id, self.agent_id, self.run_id)


class MemoryOptions(ScopeFields):
    """The `memory` object of a chat request: which end user's facts, how many, and how they reach the model."""

    model_config = ConfigDict(extra="forbid")

    k: int | None = Field(
        None,
        ge=0,
        le=1000,
        description="Facts to retrieve (0: none; default: the server's, and none in history mode, where facts "
        "retrieved are injected after the history's chosen chunks).",
    )
    mode: ChatMode = "inject"
    budget: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="history mode: tokens of the tenant's history a request attends to at most (default: the server's).",
    )
    recompute: int | None = Field(
        None,
        ge=0,
        le=1000,
        description="inject: of the retrieved facts, this many of "
        "the best-scored are prefilled after the injected ones instead of injected, so "
        "they attend to all of them (default: the server's).",
    )
    order: FactOrder | None = Field(
        None,
        description="The facts' order in the prompt: best_first (retrieval's), "
        "best_last (the best nearest the question) or time (as said); default: the server's.",
    )


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`: whether the last streamed chunk carries the usage."""

    include_usage: bool = False


# OpenAI chat parameters that would change the answer and are not served: refused by name, never ignored
_REFUSED = {
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "parallel_tool_calls": None,
    "logit_bias": None,
    "audio": None,
    "modalities": None,
    "prediction": None,
    "web_search_options": None,
    "response_format": {"type": "text"},
    "frequency_penalty": 0,
    "presence_penalty": 0,
}  # name -> the value that changes nothing (accepted)


class GenerationRequest(BaseModel):
    """What chat and text completions share. OpenAI's fields that change the answer are honoured; those that
    would and are not served (tools, a JSON response format, penalties, n > 1) are refused by name;
    bookkeeping fields (metadata, store, service_tier) are accepted and ignored; `user` names the end user
    whose memory is used."""

    model_config = ConfigDict(extra="ignore")
    refused: ClassVar[dict[str, Any]] = _REFUSED
    default_max_tokens: ClassVar[int] = 128

    @model_validator(mode="before")
    @classmethod
    def _refuse_unserved(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, harmless in cls.refused.items():
                if name in data and data[name] is not None and data[name] != harmless:
                    raise unsupported(name, f"{name} is not supported by this server")
            if data.get("n") not in (None, 1):
                raise unsupported("n", "n must be 1: this server returns one choice")
        return data

    model: str = Field(..., min_length=1, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)
    memory: MemoryOptions = Field(default_factory=MemoryOptions)
    user: str | None = Field(
        None,
        description="OpenAI's end-user field: the scope whose memory the request uses "
        "(memory.user_id, when given, wins).",
    )

    @model_validator(mode="after")
    def _valid_user(self) -> "GenerationRequest":
        self.scope()
        return self

    def scope(self) -> Scope | None:
        """The end user's memory this request uses (None: the tenant's own)."""
        return self.memory.scope() or (scope_of(self.user) if self.user is not None else None)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4 or any(not s or len(s) > 64 for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings of at most 64 characters")
        return stops

    def query_text(self) -> str:
        """The text retrieval embeds."""
        raise NotImplementedError

    def conversation(self) -> tuple[tuple[str, str], ...]:
        """(role, content) of a chat's messages; () for a text completion."""
        return ()

    def raw_prompt(self) -> str | None:
        """A text completion's prompt (continued as it is, after the memory region); None for a chat."""
        return None

    def token_budget(self) -> int:
        return self.max_tokens or self.default_max_tokens

    def logprob_count(self) -> int | None:
        """How many alternatives to report with each token's log probability; None: no log probabilities."""
        return None


class ChatRequest(GenerationRequest):
    """An OpenAI chat completion request, with inferscale's optional `memory` options."""

    messages: list[Message] = Field(..., min_length=1, max_length=256)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _ends_with_user(self) -> "ChatRequest":
        if self.messages[-1].role != "user":
            raise ValueError("the last message must come from the user")
        if self.top_logprobs is not None and not self.logprobs:
            raise unsupported("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def last_user_text(self) -> str:
        return self.messages[-1].content

    def query_text(self) -> str:
        return self.last_user_text()

    def conversation(self) -> tuple[tuple[str, str], ...]:
        return tuple((m.role, m.content) for m in self.messages)

    def token_budget(self) -> int:
        return self.max_completion_tokens or self.max_tokens or self.default_max_tokens


class CompletionRequest(GenerationRequest):
    """OpenAI's legacy text completion: the prompt continued as it is, the tenant's memory before it."""

    refused: ClassVar[dict[str, Any]] = {**_REFUSED, "echo": False, "suffix": None, "best_of": 1}
    default_max_tokens: ClassVar[int] = 16  # OpenAI's default for completions

    prompt: str = Field(..., min_length=1, max_length=32_000)
    logprobs: int | None = Field(
        None, ge=0, le=5, description="Alternatives reported with each token's log probability."
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list):
            if len(value) == 1 and isinstance(value[0], str):
                return value[0]
            raise unsupported("prompt", "prompt must be one string (a batch of prompts or token ids is not supported)")
        return value

    def query_text(self) -> str:
        return self.prompt

    def raw_prompt(self) -> str | None:
        return self.prompt

    def logprob_count(self) -> int | None:
        return self.logprobs


class AddMemories(ScopeFields):
    """Either explicit facts, or a conversation to extract facts from (as an encoding job); for an end user's
    scope when `user_id` is given."""

    model_config = ConfigDict(extra="forbid")

    facts: list[str] | None = Field(None, min_length=1, max_length=1000)
    messages: list[Message] | None = Field(None, min_length=1, max_length=2000)

    @model_validator(mode="after")
    def _one_of(self) -> "AddMemories":
        if (self.facts is None) == (self.messages is None):
            raise ValueError("send exactly one of 'facts' and 'messages'")
        return self


class SubmitJob(BaseModel):
    """An encoding job: `input` in the job file format (explicit facts with their turns, or a LoCoMo
    conversation to extract facts from), encoded behind `window` turns and `neighbours` nearest facts (None:
    the tenant's settings)."""

    model_config = ConfigDict(extra="forbid")

    input: dict[str, Any]
    window: int | None = Field(None, ge=0, le=256)
    neighbours: int | None = Field(
        None,
        ge=0,
        le=64,
        description="Nearest facts each fact is encoded behind, after its window turns (None: the tenant's).",
    )


class SearchMemories(ScopeFields):
    """The body of a memory search: the query, how many facts, and whose."""

    model_config = ConfigDict(extra="forbid")

    query: str = Field(..., min_length=1)
    limit: int = Field(10, ge=1, le=1000)


class WriteHistory(BaseModel):
    """The body of a history write: the tenant's conversation history as text (turns one after another), which
    history mode serves from; it replaces the history written before."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(..., min_length=1, max_length=4_000_000)


class UpdateMemory(BaseModel):
    """The body of a fact's update: its new text, optionally guarded by the version it replaces."""

    model_config = ConfigDict(extra="forbid")

    memory: str = Field(..., min_length=1)
    version: int | None = Field(None, ge=1, description="Refuse (409) unless the fact is at this version.")


class CreateTenant(BaseModel):
    """The body of an admin's tenant creation: its id and quotas."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(..., min_length=1, max_length=128)
    max_facts: int | None = Field(None, ge=1, description="Facts of the tenant and all its end users together.")
    max_bytes: int | None = Field(None, ge=1, description="Bytes of the tenant and all its end users together.")
    scope_max_facts: int | None = Field(None, ge=1, description="Facts of each end user (None: max_facts).")
    scope_max_bytes: int | None = Field(None, ge=1, description="Bytes of each end user (None: max_bytes).")
    window: int = Field(5, ge=0, le=1000)
    recompute: int | None = Field(
        None,
        ge=0,
        le=1000,
        description="Facts its chats prefill after the injected ones when a chat does not say (None: the cluster's).",
    )
    neighbours: int = Field(
        0,
        ge=0,
        le=64,
        description="Nearest facts (by embedding) each of its facts is encoded "
        "behind in encoding jobs, after its window turns.",
    )
    kv_budget_bytes: int | None = Field(
        None,
        ge=0,
        description="K/V bytes its memory and each end user's keep at most: past it the least retrieved facts "
        "are served by their text until used again (None: the cluster's `residency.memory_kv_bytes`).",
    )


class ErrorDetail(BaseModel):
    """An error as OpenAI's clients read it (`error.code`, `message`, `type`, `param`)."""

    code: str
    message: str
    type: str  # OpenAI's error type: invalid_request_error, authentication_error, not_found_error, ...
    param: str | None = None  # the request field at fault, where one is


class ErrorBody(BaseModel):
    """Every error answer: `{"error": {"code", "message", "type", "param"}, "detail"}` (`detail`: the message,
    where Mem0's clients read it)."""

    error: ErrorDetail
    detail: str
