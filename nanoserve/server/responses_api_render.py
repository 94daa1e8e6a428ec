"""Engine outputs -> a Responses API response and its stream events. One path for both: a whole response
is the same builder fed only the final output, so streamed and whole responses carry the same items.

A choice's text goes through server/tools.py's ToolCallStreamer when the request has tools: content
becomes `message` items (output_text deltas), each call a `function_call` item whose arguments stream
as they are generated (`response.function_call_arguments.delta`)."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.server.api_error import APIError
from nanoserve.server.responses_api_objects import (ArgumentsDeltaEvent, ArgumentsDoneEvent, ContentPartEvent,
                                                    ErrorEvent, FunctionCallItem, IncompleteDetails,
                                                    InputTokensDetails, LifecycleEvent, OutputItemEvent,
                                                    OutputMessage, OutputText, ResponseError, ResponseObject,
                                                    ResponseUsage, StreamEvent, TextDeltaEvent, TextDoneEvent)
from nanoserve.server.tools import (ArgumentsDelta, CallDone, CallStarted, ContentDelta, ToolCallStreamer,
                                    ToolEvent, ToolMode)


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse_event(event: StreamEvent) -> str:
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


@dataclass
class ResponseBuilder:
    """One response, built from its engine outputs as they arrive. Each method returns the stream
    events (SSE text, serialized when made: the items they show keep changing) in order, numbered."""
    state: ResponseObject                   # the response as it stands
    tools: ToolMode | None
    on_done: Callable[[ResponseObject], None]  # called with the response once it completed or is incomplete
    streamer: ToolCallStreamer | None = None
    seq: int = 0
    consumed: int = 0                       # characters of the choice's text seen so far
    message: OutputMessage | None = None    # the message item being written
    calls: dict[int, FunctionCallItem] = field(default_factory=dict)  # streamer call index -> its item

    def __post_init__(self) -> None:
        if self.tools is not None:
            self.streamer = ToolCallStreamer(self.tools)

    def _emit(self, event: StreamEvent) -> str:
        event.sequence_number, self.seq = self.seq, self.seq + 1
        return sse_event(event)

    def _lifecycle(self, kind: str) -> str:
        return self._emit(LifecycleEvent(type=kind, response=self.state))

    def opening(self) -> list[str]:
        return [self._lifecycle("response.created"), self._lifecycle("response.in_progress")]

    def update(self, out: RequestOutput) -> list[str]:
        """The events for this output's new text (the stop-string hold-back respected), and the closing
        ones when it is the final output."""
        c = out.outputs[0]
        text = c.text if c.finish_reason is not None else c.stream_text
        new, self.consumed = text[self.consumed:], max(self.consumed, len(text))
        if self.streamer is None:
            events: list[ToolEvent] = [ContentDelta(new)] if new else []
        else:
            events = self.streamer.feed(new) + (self.streamer.finish() if c.finish_reason is not None else [])
        sent = [s for e in events for s in self._on(e)]
        if c.finish_reason is not None:
            sent += self._finish(out, c)
        return sent

    def response(self, finals: list[RequestOutput]) -> ResponseObject:
        """The whole response from the final output (Server.respond's render interface)."""
        self.update(finals[0])
        if self.state.error is not None:
            raise APIError(self.state.error.message, 500, "server_error", code="server_error")
        return self.state

    def fail(self, message: str, code: str | None) -> list[str]:
        """An error mid-stream: OpenAI's `error` event, then `response.failed`."""
        self.state.status, self.state.error = "failed", ResponseError(message=message)
        return [self._emit(ErrorEvent(code=code, message=message)), self._lifecycle("response.failed")]

    # ---- items -------------------------------------------------------------------------------------
    def _on(self, e: ToolEvent) -> list[str]:
        if isinstance(e, ContentDelta):
            sent = self._open_message() if self.message is None else []
            self.message.content[0].text += e.text
            return sent + [self._emit(TextDeltaEvent(item_id=self.message.id,
                                                     output_index=self._index(self.message), delta=e.text))]
        if isinstance(e, CallStarted):
            sent = self._close_message("completed")
            item = self.calls[e.index] = FunctionCallItem(id=item_id("fc"), call_id=e.id, name=e.name,
                                                          arguments="", status="in_progress")
            self.state.output.append(item)
            return sent + [self._emit(OutputItemEvent(type="response.output_item.added",
                                                      output_index=self._index(item), item=item))]
        item = self.calls[e.index]
        if isinstance(e, ArgumentsDelta):
            item.arguments += e.text
            return [self._emit(ArgumentsDeltaEvent(item_id=item.id, output_index=self._index(item),
                                                   delta=e.text))]
        assert isinstance(e, CallDone)
        # arguments already streamed stay as sent; a call the output ended inside is marked incomplete
        item.arguments, item.status = e.arguments, "completed" if _is_object(e.arguments) else "incomplete"
        at = self._index(item)
        return [self._emit(ArgumentsDoneEvent(item_id=item.id, output_index=at, arguments=item.arguments)),
                self._emit(OutputItemEvent(type="response.output_item.done", output_index=at, item=item))]

    def _index(self, item) -> int:
        return next(i for i, x in enumerate(self.state.output) if x is item)

    def _open_message(self) -> list[str]:
        msg = self.message = OutputMessage(id=item_id("msg"), status="in_progress", content=[])
        self.state.output.append(msg)
        at = self._index(msg)
        sent = [self._emit(OutputItemEvent(type="response.output_item.added", output_index=at, item=msg))]
        msg.content.append(OutputText(text=""))
        return sent + [self._emit(ContentPartEvent(type="response.content_part.added", item_id=msg.id,
                                                   output_index=at, part=msg.content[0]))]

    def _close_message(self, status: str) -> list[str]:
        msg, self.message = self.message, None
        if msg is None:
            return []
        at, part = self._index(msg), msg.content[0]
        msg.status = status  # type: ignore[assignment]
        return [self._emit(TextDoneEvent(item_id=msg.id, output_index=at, text=part.text)),
                self._emit(ContentPartEvent(type="response.content_part.done", item_id=msg.id,
                                            output_index=at, part=part)),
                self._emit(OutputItemEvent(type="response.output_item.done", output_index=at, item=msg))]

    def _finish(self, out: RequestOutput, c: CompletionOutput) -> list[str]:
        cut = c.finish_reason == "length"
        sent = self._open_message() if not self.state.output else []  # an empty answer is an empty message
        sent += self._close_message("incomplete" if cut else "completed")
        r = self.state
        cached = out.num_cached_tokens
        r.usage = ResponseUsage(input_tokens=len(out.prompt_token_ids), output_tokens=len(c.token_ids),
                                total_tokens=len(out.prompt_token_ids) + len(c.token_ids),
                                input_tokens_details=InputTokensDetails(cached_tokens=cached))
        if c.finish_reason not in ("stop", "length"):  # aborted or failed in the engine
            return sent + self.fail(f"generation ended early ({c.finish_reason})", "server_error")
        if cut:
            r.status, r.incomplete_details = "incomplete", IncompleteDetails(reason="max_output_tokens")
        else:
            r.status, r.completed_at = "completed", int(time.time())
        self.on_done(r)
        return sent + [self._lifecycle(f"response.{r.status}")]
