"""OpenAI response bodies and stream chunks as typed pydantic models, owned by the server.

Why our own models and not the `openai` package's types: the server's wire format is a contract we own
(vLLM's extras: `stop_reason`, the device/host split of cached tokens), the openai SDK is a client
library with its own dependency tree (httpx, anyio, jiter, ...) whose response types follow the
client's release cycle; the tests check the bodies with the real openai client anyway."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, model_serializer


class PromptTokensDetails(BaseModel):
    cached_tokens: int
    device_cached_tokens: int
    host_cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


# ---- /v1/completions --------------------------------------------------------------------------------
class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class _Choice(BaseModel):
    index: int
    finish_reason: str | None = None
    stop_reason: Union[str, int, None] = None   # vLLM's: the stop string or token that ended it


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None


class _Envelope(BaseModel):
    id: str
    created: int
    model: str
    system_fingerprint: str | None = None
    usage: Usage | None = None


class Completion(_Envelope):
    """A whole response (object "text_completion") or one stream chunk (the same shape)."""
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


# ---- /v1/chat/completions ---------------------------------------------------------------------------
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob]
    refusal: None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str          # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _Sparse(BaseModel):
    """Only what this chunk carries: unset fields are left out of the JSON (OpenAI's deltas)."""

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunction(_Sparse):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Sparse):
    """A streamed call: the first delta of a call has its id, type and name (arguments ""), the next
    ones only pieces of `function.arguments`."""
    index: int              # position among the choice's calls
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] = []


class _ChatChoiceBase(_Choice):
    logprobs: ChatLogprobs | None = None


class ChatChoice(_ChatChoiceBase):
    message: ChatMessageOut


class ChatCompletion(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatDelta(_Sparse):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_ChatChoiceBase):
    delta: ChatDelta


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
