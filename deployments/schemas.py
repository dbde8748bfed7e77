"""Request bodies of the HTTP API: OpenAI's chat completions (plus `memory`), Mem0-shaped memories, admin."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deployments.memory_prompt import Mode


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str = Field(..., min_length=1, max_length=32_000)


class MemoryOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    k: int | None = Field(None, ge=0, le=1000, description="Facts to retrieve (0: none).")
    mode: Mode = "inject"
    recompute: int | None = Field(None, ge=0, le=1000, description="inject: of the retrieved facts, this many of "
                                  "the best-scored are prefilled after the injected ones instead of injected, so "
                                  "they attend to all of them (default: the server's).")


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(BaseModel):
    """OpenAI's fields that change the answer are honoured; ones that do not apply are ignored, as OpenAI-
    compatible servers do, except `n` > 1, which is refused."""

    model_config = ConfigDict(extra="ignore")

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
    conversation to extract facts from), encoded behind `window` turns (None: the tenant's window)."""

    model_config = ConfigDict(extra="forbid")

    input: dict[str, Any]
    window: int | None = Field(None, ge=0, le=256)


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


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorBody(BaseModel):
    """Every error answer: `{"error": {"code", "message"}}`."""

    error: ErrorDetail
