"""Engine outputs -> OpenAI response bodies: one streaming loop for both endpoints, each endpoint
supplying only how a choice, its logprobs and the envelope look (`CompletionRender`, `ChatRender`)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sequence import TokenLogprob


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(finals: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {
                "cached_tokens": sum(o.num_cached_tokens for o in finals),
                "device_cached_tokens": sum(o.num_device_cached_tokens for o in finals),
                "host_cached_tokens": sum(o.num_host_cached_tokens for o in finals)}}


@dataclass
class Render:
    """What differs between /v1/completions and /v1/chat/completions. `token_str` decodes one id."""
    cid: str
    created: int
    model: str
    n: int                                  # choices per prompt
    logprobs: bool                          # the client asked for logprobs
    token_str: Callable[[int], str]
    object: str = ""                        # "text_completion" | "chat.completion" (+ ".chunk")
    envelope_extra: dict = field(default_factory=dict)

    def envelope(self, choices: list[dict], streaming: bool) -> dict:
        obj = "chat.completion.chunk" if streaming and self.object == "chat.completion" else self.object
        return {"id": self.cid, "object": obj, "created": self.created, "model": self.model,
                **self.envelope_extra, "choices": choices}

    def opening(self, idx: int, out: RequestOutput) -> tuple[dict | None, str]:
        """When choice `idx` first streams: a choice sent as its own chunk first, and a text prefix."""
        return None, ""

    def render_logprobs(self, lps: list[TokenLogprob], prompt: RequestOutput | None) -> dict: ...

    def delta(self, idx: int, text: str, lp: dict | None, c: CompletionOutput) -> dict: ...

    def final(self, idx: int, out: RequestOutput, c: CompletionOutput) -> dict: ...

    def response(self, finals: list[RequestOutput]) -> dict:
        choices = [self.final(pi * self.n + c.index, out, c) for pi, out in enumerate(finals) for c in out.outputs]
        return {**self.envelope(choices, False), "usage": usage(finals), "system_fingerprint": None}


@dataclass
class CompletionRender(Render):
    echo: bool = False
    prompt_text: Callable[[RequestOutput], str] = lambda out: ""
    object: str = "text_completion"

    def opening(self, idx: int, out: RequestOutput) -> tuple[dict | None, str]:
        return None, self.prompt_text(out) if self.echo else ""

    def render_logprobs(self, lps: list[TokenLogprob], prompt: RequestOutput | None) -> dict:
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
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def delta(self, idx: int, text: str, lp: dict | None, c: CompletionOutput) -> dict:
        return {"index": idx, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def final(self, idx: int, out: RequestOutput, c: CompletionOutput) -> dict:
        prefix = self.opening(idx, out)[1]
        lp = self.render_logprobs(c.logprobs or [], out if self.echo else None) if self.logprobs else None
        return self.delta(idx, prefix + c.text, lp, c)


@dataclass
class ChatRender(Render):
    object: str = "chat.completion"
    envelope_extra: dict = field(default_factory=lambda: {"system_fingerprint": None})

    def opening(self, idx: int, out: RequestOutput) -> tuple[dict | None, str]:
        # the role chunk, sent when the choice's first token is ready
        return {"index": idx, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}, ""

    def _entry(self, tid: int, logprob: float) -> dict:
        s = self.token_str(tid)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    def render_logprobs(self, lps: list[TokenLogprob], prompt: RequestOutput | None) -> dict:
        return {"content": [dict(self._entry(lp.token_id, lp.logprob),
                                 top_logprobs=[self._entry(t, l) for t, l in lp.top]) for lp in lps],
                "refusal": None}

    def delta(self, idx: int, text: str, lp: dict | None, c: CompletionOutput) -> dict:
        return {"index": idx, "delta": {"content": text} if text else {}, "logprobs": lp,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def final(self, idx: int, out: RequestOutput, c: CompletionOutput) -> dict:
        return {"index": idx, "message": {"role": "assistant", "content": c.text, "refusal": None},
                "logprobs": self.render_logprobs(c.logprobs or [], None) if self.logprobs else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


async def stream_chunks(outputs: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int, render: Render,
                        include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
    """SSE chunks for (prompt index, output) pairs: each choice's new text (stop-string hold-back
    respected) and logprobs once, its finish reason once, usage as asked. Errors propagate."""
    sent: dict[int, list[int]] = {}  # choice index -> [characters sent, logprob tokens sent]
    done: set[int] = set()
    finals: list[RequestOutput | None] = [None] * num_prompts  # the latest output of each prompt

    def chunk(choices: list[dict]) -> str:
        obj = render.envelope(choices, True)
        if continuous_usage:
            obj["usage"] = usage([f for f in finals if f is not None])
        return sse(obj)

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
            choices.append(render.delta(idx, prefix + delta, lp, c))
            if c.finish_reason is not None:
                done.add(idx)
        if choices:
            yield chunk(choices)
    if include_usage:
        yield sse({**render.envelope([], True), "usage": usage([f for f in finals if f is not None])})
