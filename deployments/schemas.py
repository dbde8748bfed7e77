"""Request bodies of the HTTP API: OpenAI's chat completions (plus `memory`), Mem0-shaped memories, admin."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from deployments.memory_prompt import FactOrder, Mode


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


class MemoryOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    k: int | None = Field(None, ge=0, le=1000, description="Facts to retrieve (0: none).")
    mode: Mode = "inject"
    recompute: int | None = Field(None, ge=0, le=1000, description="inject: of the retrieved facts, this many of "
                                  "the best-scored are prefilled after the injected ones instead of injected, so "
                                  "they attend to all of them (default: the server's).")
    order: FactOrder | None = Field(None, description="The facts' order in the prompt: best_first (retrieval's), "
                                    "best_last (the best nearest the question) or time (as said); default: the server's.")


class StreamOptions(BaseModel):
    include_usage: bool = False


# OpenAI chat parameters that would change the answer and are not served: refused by name, never ignored
_REFUSED = {"tools": None, "tool_choice": None, "functions": None, "function_call": None, "parallel_tool_calls": None,
            "logit_bias": None, "audio": None, "modalities": None, "prediction": None, "web_search_options": None,
            "response_format": {"type": "text"}, "logprobs": False, "top_logprobs": None, "frequency_penalty": 0,
            "presence_penalty": 0}  # name -> the value that changes nothing (accepted)


class ChatRequest(BaseModel):
    """OpenAI's fields that change the answer are honoured; those that would and are not served (tools, a JSON
    response format, logprobs, penalties, n > 1) are refused by name; bookkeeping fields (user, metadata,
    store, service_tier) are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unserved(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, harmless in _REFUSED.items():
                if name in data and data[name] is not None and data[name] != harmless:
                    raise unsupported(name, f"{name} is not supported by this server")
            if data.get("n") not in (None, 1):
                raise unsupported("n", "n must be 1: this server returns one choice")
        return data

    model: str = Field(..., min_length=1, max_length=256)
    messages: list[Message] = Field(..., min_length=1, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)
    memory: MemoryOptions = Field(default_factory=MemoryOptions)

    @model_validator(mode="after")
    def _ends_with_user(self) -> "ChatRequest":
        if self.messages[-1].role != "user":
            raise ValueError("the last message must come from the user")
        return self

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4 or any(not s or len(s) > 64 for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings of at most 64 characters")
        return stops

    def last_user_text(self) -> str:
        return self.messages[-1].content


class AddMemories(BaseModel):
    """Either explicit facts, or a conversation to extract facts from (as an encoding job)."""

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
    neighbours: int | None = Field(None, ge=0, le=64, description="Nearest facts each fact is encoded behind, "
                                                                    "after its window turns (None: the tenant's).")


class SearchMemories(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str = Field(..., min_length=1)
    limit: int = Field(10, ge=1, le=1000)


class UpdateMemory(BaseModel):
    model_config = ConfigDict(extra="forbid")

    memory: str = Field(..., min_length=1)
    version: int | None = Field(None, ge=1, description="Refuse (409) unless the fact is at this version.")


class CreateTenant(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(..., min_length=1, max_length=128)
    max_facts: int | None = Field(None, ge=1)
    max_bytes: int | None = Field(None, ge=1)
    window: int = Field(5, ge=0, le=1000)
    recompute: int | None = Field(None, ge=0, le=1000, description="Facts its chats prefill after the injected ones "
                                                                    "when a chat does not say (None: the cluster's).")
    neighbours: int = Field(0, ge=0, le=64, description="Nearest facts (by embedding) each of its facts is encoded "
                                                         "behind in encoding jobs, after its window turns.")


class ErrorDetail(BaseModel):
    code: str
    message: str
    type: str  # OpenAI's error type: invalid_request_error, authentication_error, not_found_error, ...
    param: str | None = None  # the request field at fault, where one is


class ErrorBody(BaseModel):
    """Every error answer: `{"error": {"code", "message"}}`."""

    error: ErrorDetail
