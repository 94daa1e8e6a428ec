"""Engine outputs -> OpenAI response bodies (typed: server/responses.py): one streaming loop for both
endpoints, each endpoint supplying only how a choice, its logprobs and the envelope look
(`CompletionRender`, `ChatRender`). With tools, the chat renderer passes each choice's text through a
ToolCallStreamer (server/tools.py): content streams as content, a call as OpenAI's `delta.tool_calls`
(id and name first, then argument pieces as they are generated)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from pydantic import BaseModel

from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sequence import TokenLogprob
from nanoserve.server.responses import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                                        ChatDelta, ChatLogprob, ChatLogprobs, ChatMessageOut, Completion,
                                        CompletionChoice, CompletionLogprobs, DeltaFunction, DeltaToolCall,
                                        PromptTokensDetails, TopLogprob, Usage)
from nanoserve.server.tools import (ArgumentsDelta, CallStarted, ContentDelta, ToolCallStreamer, ToolEvent,
                                    ToolMode)


def sse(obj: BaseModel | dict) -> str:
    data = obj.model_dump(mode="json") if isinstance(obj, BaseModel) else obj
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"  # the same text as before typed chunks


def usage(finals: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(
                     cached_tokens=sum(o.num_cached_tokens for o in finals),
                     device_cached_tokens=sum(o.num_device_cached_tokens for o in finals),
                     host_cached_tokens=sum(o.num_host_cached_tokens for o in finals)))


@dataclass
class Render:
    """What differs between /v1/completions and /v1/chat/completions. `token_str` decodes one id."""
    cid: str
    created: int
    model: str
    n: int                                  # choices per prompt
    logprobs: bool                          # the client asked for logprobs
    token_str: Callable[[int], str]

    def head(self) -> dict[str, Any]:
        return {"id": self.cid, "created": self.created, "model": self.model}

    def chunk(self, choices: list, usage: Usage | None = None) -> BaseModel: ...

    def opening(self, idx: int, out: RequestOutput) -> tuple[BaseModel | None, str]:
        """When choice `idx` first streams: a choice sent as its own chunk first, and a text prefix."""
        return None, ""

    def render_logprobs(self, lps: list[TokenLogprob], prompt: RequestOutput | None) -> BaseModel: ...

    def delta(self, idx: int, text: str, lp: BaseModel | None, c: CompletionOutput) -> BaseModel | None:
        """The streamed choice for this new text (None: nothing to send yet)."""

    def final(self, idx: int, out: RequestOutput, c: CompletionOutput) -> BaseModel: ...

    def response(self, finals: list[RequestOutput]) -> BaseModel: ...

    def _choices(self, finals: list[RequestOutput]) -> list:
        return [self.final(pi * self.n + c.index, out, c) for pi, out in enumerate(finals)
                for c in out.outputs]


@dataclass
class CompletionRender(Render):
    echo: bool = False
    prompt_text: Callable[[RequestOutput], str] = lambda out: ""

    def chunk(self, choices: list, usage: Usage | None = None) -> Completion:
        return Completion(**self.head(), choices=choices, usage=usage)

    def response(self, finals: list[RequestOutput]) -> Completion:
        return Completion(**self.head(), choices=self._choices(finals), usage=usage(finals))

    def opening(self, idx: int, out: RequestOutput) -> tuple[BaseModel | None, str]:
        return None, self.prompt_text(out) if self.echo else ""

    def render_logprobs(self, lps: list[TokenLogprob], prompt: RequestOutput | None) -> CompletionLogprobs:
        """OpenAI `logprobs` of a completion choice; with `prompt` (echo) the prompt tokens come first,
        the first of them with null logprobs as nothing precedes it."""
        tokens, token_lps, tops, offsets = [], [], [], []
        off = 0
        if prompt is not None:
            tokens.append(self.token_str(prompt.prompt_token_ids[0]))
            token_lps.append(None)
            tops.append(None)
            offsets.append(off)
            off += len(tokens[0])
            lps = [lp for lp in (prompt.prompt_logprobs or [])[1:] if lp is not None] + list(lps)
        for lp in lps:
            s = self.token_str(lp.token_id)
            tokens.append(s)
            token_lps.append(lp.logprob)
            top = {self.token_str(t): l for t, l in lp.top}
            top.setdefault(s, lp.logprob)
            tops.append(top)
            offsets.append(off)
            off += len(s)
        return CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops,
                                  text_offset=offsets)

    def delta(self, idx: int, text: str, lp: BaseModel | None, c: CompletionOutput) -> CompletionChoice:
        return CompletionChoice(index=idx, text=text, logprobs=lp, finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason)

    def final(self, idx: int, out: RequestOutput, c: CompletionOutput) -> CompletionChoice:
        prefix = self.opening(idx, out)[1]
        lp = self.render_logprobs(c.logprobs or [], out if self.echo else None) if self.logprobs else None
        return self.delta(idx, prefix + c.text, lp, c)


@dataclass
class ChatRender(Render):
    tools: ToolMode | None = None
    streamers: dict[int, ToolCallStreamer] = field(default_factory=dict)  # streamed choice -> its tool calls

    def chunk(self, choices: list, usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.head(), choices=choices, usage=usage)

    def response(self, finals: list[RequestOutput]) -> ChatCompletion:
        return ChatCompletion(**self.head(), choices=self._choices(finals), usage=usage(finals))

    def opening(self, idx: int, out: RequestOutput) -> tuple[BaseModel | None, str]:
        # the role chunk, sent when the choice's first token is ready
        return ChatChunkChoice(index=idx, delta=ChatDelta(role="assistant", content="")), ""

    def _entry(self, tid: int, logprob: float) -> dict:
        s = self.token_str(tid)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    def render_logprobs(self, lps: list[TokenLogprob], prompt: RequestOutput | None) -> ChatLogprobs:
        return ChatLogprobs(content=[ChatLogprob(**self._entry(lp.token_id, lp.logprob),
                                                 top_logprobs=[TopLogprob(**self._entry(t, l))
                                                               for t, l in lp.top])
                                     for lp in lps])

    def _outcome(self, text: str, c: CompletionOutput):
        """(content, tool calls, finish reason) of a finished choice's text."""
        content, calls = (self.tools.extract(text) if self.tools is not None and c.finish_reason == "stop"
                          else (text, []))
        return content, calls, "tool_calls" if calls else c.finish_reason

    def delta(self, idx: int, text: str, lp: BaseModel | None, c: CompletionOutput) -> ChatChunkChoice | None:
        reason = c.finish_reason
        if self.tools is None:
            return ChatChunkChoice(index=idx, delta=ChatDelta(content=text or None), logprobs=lp,
                                   finish_reason=reason, stop_reason=c.stop_reason)
        streamer = self.streamers.setdefault(idx, ToolCallStreamer(self.tools))
        events = streamer.feed(text) + (streamer.finish() if reason is not None else [])
        content, calls = tool_delta(events)
        if reason == "stop" and streamer.calls:
            reason = "tool_calls"
        if not content and not calls and lp is None and reason is None:
            return None
        return ChatChunkChoice(index=idx, delta=ChatDelta(content=content or None, tool_calls=calls or None),
                               logprobs=lp, finish_reason=reason, stop_reason=c.stop_reason)

    def final(self, idx: int, out: RequestOutput, c: CompletionOutput) -> ChatChoice:
        content, calls, reason = self._outcome(c.text, c)
        return ChatChoice(index=idx, message=ChatMessageOut(content=content, tool_calls=calls),
                          logprobs=self.render_logprobs(c.logprobs or [], None) if self.logprobs else None,
                          finish_reason=reason, stop_reason=c.stop_reason)


def tool_delta(events: list[ToolEvent]) -> tuple[str, list[DeltaToolCall]]:
    """One chunk's content and `delta.tool_calls` for a streamer's events: a call's first delta carries
    its id, type and name (arguments ""), later ones pieces of its arguments, one entry per call."""
    content, calls = "", []
    for e in events:
        if isinstance(e, ContentDelta):
            content += e.text
        elif isinstance(e, CallStarted):
            calls.append(DeltaToolCall(index=e.index, id=e.id, type="function",
                                       function=DeltaFunction(name=e.name, arguments="")))
        elif isinstance(e, ArgumentsDelta):
            if not calls or calls[-1].index != e.index:
                calls.append(DeltaToolCall(index=e.index, function=DeltaFunction(arguments="")))
            calls[-1].function.arguments += e.text
    return content, calls


async def stream_chunks(outputs: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int, render: Render,
                        include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
    """SSE chunks for (prompt index, output) pairs: each choice's new text (stop-string hold-back
    respected) and logprobs once, its finish reason once, usage as asked. Errors propagate."""
    sent: dict[int, list[int]] = {}  # choice index -> [characters sent, logprob tokens sent]
    done: set[int] = set()
    finals: list[RequestOutput | None] = [None] * num_prompts  # the latest output of each prompt

    def chunk(choices: list) -> str:
        return sse(render.chunk(choices, usage([f for f in finals if f is not None]) if continuous_usage
                                else None))

    async for pi, out in outputs:
        finals[pi] = out
        choices = []
        for c in out.outputs:
            idx = pi * render.n + c.index
            if idx in done or (c.finish_reason is None and not c.token_ids):
                continue
            prefix = ""
            if idx not in sent:
                sent[idx] = [0, 0]
                opening, prefix = render.opening(idx, out)
                if opening is not None:
                    yield chunk([opening])
            state = sent[idx]
            new = c.text if c.finish_reason is not None else c.stream_text
            delta = new[state[0]:]
            if not delta and not prefix and c.finish_reason is None:
                continue
            lp = None
            if render.logprobs:
                ntok = len(c.logprobs or [])
                lp = render.render_logprobs((c.logprobs or [])[state[1]:ntok], out if prefix else None)
                state[1] = ntok
            state[0] = max(state[0], len(new))
            if (choice := render.delta(idx, prefix + delta, lp, c)) is not None:
                choices.append(choice)
            if c.finish_reason is not None:
                done.add(idx)
        if choices:
            yield chunk(choices)
    if include_usage:
        yield sse(render.chunk([], usage([f for f in finals if f is not None])))
