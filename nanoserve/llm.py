"""Offline API: LLM(...).generate(prompts, SamplingParams) and LLM.chat(messages)."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from itertools import count
from typing import Any

from tqdm import tqdm

from nanoserve.config import EngineConfig
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.requests import Request
from nanoserve.client.output_processor import OutputProcessor
from nanoserve.engine.protocol import DeltaEncoder, StepFailed
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import SamplingParams
from nanoserve.chat import render_chat

Prompt = str | list[int] | dict


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = count()

    def close(self) -> None:
        """End KV copies and stop tensor-parallel workers (also done at interpreter exit)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        prompts = _as_list(prompts)
        params_list = (list(params) if isinstance(params, (list, tuple))
                       else [params or SamplingParams()] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams per prompt (or a single one for all)")
        # validate everything before queueing anything, so a bad prompt leaves nothing behind
        reqs = [self.engine.make_request(str(next(self._ids)), _prompt_of(p), sp,
                                         add_special_tokens=not (isinstance(p, dict) and p.get("chat")))
                for p, sp in zip(prompts, params_list)]
        return self._run(reqs, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """`chat_template_kwargs`: extra variables of the chat template, as the server's request field
        (e.g. {"enable_thinking": False} for Qwen3)."""
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        texts = [render_chat(self.engine, conv, add_generation_prompt, template_kwargs=chat_template_kwargs)
                 for conv in convs]
        return self.generate([{"prompt": t, "chat": True} for t in texts], params, use_tqdm)

    def _run(self, reqs: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until every request finished; outputs go through the same output processor
        as the server's (text, stop strings), and a stop string found there finishes its choice."""
        pending = {r.request_id: (DeltaEncoder(),
                                  OutputProcessor(self.tokenizer, r.prompt, r.prompt_token_ids, r.params))
                   for r in reqs}
        for r in reqs:
            self.engine.add(r)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(reqs), desc="Generating", disable=not use_tqdm)
        try:
            while len(done) < len(reqs):
                for out in self._step():
                    self._process(out, pending, done, bar)
            self.engine.drain()  # one step ahead: a step of finished sequences may still be in flight
        except BaseException:
            for r in reqs:  # leave the engine clean for the next call
                if r.request_id not in done:
                    self.engine.abort(r.request_id)
            raise
        finally:
            bar.close()
        return [done[r.request_id] for r in reqs]

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except StepFailed as e:  # offline, every request is the caller's: raise what the step raised
            raise e.cause

    def _process(self, out: RequestOutput, pending: dict, done: dict[str, RequestOutput], bar) -> None:
        if out.request_id in done:
            return
        encoder, processor = pending[out.request_id]
        res, stopped = processor.apply(encoder.delta(out))
        for i in stopped:  # found here, not by the engine: tell it, so its blocks are freed
            if (more := self.engine.finish(out.request_id, [i], res.outputs[i].stop_reason)) is not None:
                res, _ = processor.apply(encoder.delta(more))
        if res.finished:
            done[out.request_id] = res
            bar.update(1)


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]
    return list(prompts)


def _prompt_of(p: Prompt) -> str | list[int]:
    if isinstance(p, dict):
        return p["prompt_token_ids"] if "prompt_token_ids" in p else p["prompt"]
    return p
