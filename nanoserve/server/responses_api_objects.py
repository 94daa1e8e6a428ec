"""What `/v1/responses` sends back, typed: the response object, its output items and the stream events,
shaped as the `openai` package's `types.responses` (checked by the tests with the real client and its
`responses.stream` helper, which validates the event sequence)."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel

Status = Literal["in_progress", "completed", "incomplete", "failed"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = []
    logprobs: list = []


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Union[OutputMessage, FunctionCallItem]


class InputTokensDetails(BaseModel):
    cached_tokens: int
    # explicit cache writes (prompt_cache_options), not done: prefix caching is automatic
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # a non-reasoning model


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: Literal["server_error"] = "server_error"
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Status
    model: str
    output: list[OutputItem] = []
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] = []
    tool_choice: Union[str, dict] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = {"format": {"type": "text"}}
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] = {}
    background: bool = False
    truncation: Literal["disabled"] = "disabled"
    service_tier: Literal["default"] = "default"


# ---- stream events (each carries its place in the stream: sequence_number) -----------------------------
class _Event(BaseModel):
    sequence_number: int = 0


class LifecycleEvent(_Event):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class _ItemEvent(_Event):
    item_id: str
    output_index: int


class ContentPartEvent(_ItemEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    content_index: int = 0
    part: OutputText


class TextDeltaEvent(_ItemEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    content_index: int = 0
    delta: str
    logprobs: list = []


class TextDoneEvent(_ItemEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    content_index: int = 0
    text: str
    logprobs: list = []


class ArgumentsDeltaEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    delta: str


class ArgumentsDoneEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    arguments: str


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    code: str | None = None
    message: str
    param: str | None = None


StreamEvent = Union[LifecycleEvent, OutputItemEvent, ContentPartEvent, TextDeltaEvent, TextDoneEvent,
                    ArgumentsDeltaEvent, ArgumentsDoneEvent, ErrorEvent]
