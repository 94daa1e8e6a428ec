"""Output processing on the API side, as vLLM V1's output processor does it: rebuild each request's
cumulative RequestOutput from the engine's token-id deltas, detokenize, and match stop strings. The
engine never touches text; the server (through EngineClient) and the offline LLM both come here.

A choice whose stop string matches is finished here at once; tokens the engine made after it (it
learns of the stop one step later) are dropped, and the caller sends the engine "finish" for it so
its KV blocks are freed."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nanoserve.detokenizer import Detokenizer
from nanoserve.engine.protocol import OutputDelta
from nanoserve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from nanoserve.sampling_params import SamplingParams

PROMPT_CONTEXT = 5  # prompt tokens the detokenizer re-reads for word-boundary spaces (its prefix_offset)


@dataclass
class _Choice:
    out: CompletionOutput
    detok: Detokenizer
    ids: list[int]             # prompt tail + output tokens: all the detokenizer reads
    done: bool = False         # finished by the engine, or by a stop string here


class OutputProcessor:
    def __init__(self, tokenizer: object, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self.tokenizer, self.prompt, self.prompt_token_ids, self.params = (tokenizer, prompt,
                                                                           prompt_token_ids, params)
        self.context = prompt_token_ids[-PROMPT_CONTEXT:]
        self.choices: dict[int, _Choice] = {}
        self.prompt_logprobs: list[TokenLogprob | None] | None = None

    def _choice(self, index: int) -> _Choice:
        ch = self.choices.get(index)
        if ch is None:
            p = self.params
            out = CompletionOutput(index, "", [], logprobs=[] if p.logprobs is not None else None)
            det = Detokenizer(self.tokenizer, len(self.context), p.stop, p.include_stop_str_in_output)
            ch = self.choices[index] = _Choice(out, det, list(self.context))
        return ch

    def apply(self, delta: OutputDelta) -> tuple[RequestOutput, list[int]]:
        """Apply one engine delta. Returns the cumulative output and the choices whose stop string
        matched just now (the engine still runs them)."""
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        stopped = []
        for c in delta.choices:
            ch = self._choice(c.index)
            if ch.done:
                continue
            new_lps = c.logprobs if ch.out.logprobs is not None else None
            if self._extend(ch, c.token_ids, new_lps):
                stopped.append(c.index)
            elif c.finish_reason is not None:
                ch.detok.flush(ch.ids)
                ch.out.finish_reason, ch.out.stop_reason, ch.done = c.finish_reason, c.stop_reason, True
        finished = len(self.choices) == self.params.n and all(c.done for c in self.choices.values())
        # fresh objects per output: the consumer may keep an earlier one while we extend ours
        outs = [dataclasses.replace(c.out, text=c.detok.text, token_ids=list(c.out.token_ids),
                                    stream_text=c.detok.stream_text(c.done),
                                    logprobs=None if c.out.logprobs is None else list(c.out.logprobs))
                for _, c in sorted(self.choices.items())]
        return RequestOutput(delta.request_id, self.prompt, self.prompt_token_ids, outs, finished,
                             delta.num_cached_tokens, delta.num_device_cached_tokens,
                             delta.num_host_cached_tokens,
                             prompt_logprobs=self.prompt_logprobs, metrics=delta.metrics or {}), stopped

    def _extend(self, ch: _Choice, ids: list[int], lps: list[TokenLogprob | None] | None) -> bool:
        """Detokenize the new tokens one by one; True when a stop string matched (the rest dropped)."""
        min_tokens = self.params.min_tokens
        for k, tok in enumerate(ids):
            ch.ids.append(tok)
            ch.out.token_ids.append(tok)
            if lps is not None:
                ch.out.logprobs.append(lps[k])
            matched = ch.detok.step(ch.ids, check_stop=len(ch.out.token_ids) >= min_tokens)
            if matched is not None:
                ch.out.finish_reason, ch.out.stop_reason, ch.done = "stop", matched, True
                return True
        return False
