"""The engine's requests: a prompt validated against the model's limits (checked again for one that
arrives validated: the engine trusts no sender) becomes one Sequence per choice, each with its own
seeded generator; plus the EOS ids that end its sequences. Reads only immutable state, so
validation errors reach the caller before anything is queued."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import torch

from nanoserve.engine.grammar import Compile, GrammarMatchers
from nanoserve.engine.protocol import ModelInfo, PromptRequest, check_prompt_request, make_prompt_request
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import SamplingParams
from nanoserve.sequence import Sequence


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    grammar: Compile | None = None  # its constraint's compile (the engine core admits it once done)


def eos_token_ids(tokenizer_eos: int | None, hf_config: Any, model_path: Path) -> frozenset[int]:
    """Every id that ends generation: the tokenizer's EOS, config.json's and generation_config.json's."""
    ids = {tokenizer_eos} if tokenizer_eos is not None else set()
    gen = {}
    try:
        gen = json.loads((model_path / "generation_config.json").read_text())
    except (OSError, ValueError):  # none: the tokenizer's and the config's EOS are enough
        pass
    for eos in (getattr(hf_config, "eos_token_id", None), gen.get("eos_token_id")):
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return frozenset(ids)


PromptChain = Callable[[list[int], str | None], tuple[list, list] | None]


class RequestBuilder:
    def __init__(self, info: ModelInfo, tokenize: Callable[[str, bool], list[int]], eos_ids: frozenset[int],
                 grammars: GrammarMatchers, device: torch.device,
                 prompt_chain: PromptChain | None = None) -> None:
        self.info, self.tokenize, self.eos_ids, self.grammars, self.device = (info, tokenize, eos_ids,
                                                                              grammars, device)
        self.prompt_chain = prompt_chain  # the prefix cache's digests of a prompt (PrefixChains.prompt_chain)
        self._seq_ids = count()

    def make(self, request_id: str, prompt: str | list[int], params: SamplingParams,
             add_special_tokens: bool = True) -> Request:
        """Validate and tokenize; raises InvalidRequest naming the bad field (a grammar that does not
        compile too: this waits for its compile)."""
        req = self.build(make_prompt_request(self.info, self.tokenize, request_id, prompt, params,
                                             add_special_tokens))
        if req.grammar is not None:
            req.grammar.future.result()
        return req

    def build(self, preq: PromptRequest) -> Request:
        """The engine's request (one sequence per choice) for a validated one; its grammar's compile is
        started (on the grammar thread, once per distinct grammar), not waited for; its prompt's chain of
        block digests is computed here, once for all its sequences (the engine core builds requests on
        its intake thread: core.py)."""
        check_prompt_request(self.info, preq)
        params, ids = preq.params, preq.prompt_token_ids
        grammar = self.grammars.prepare(params.structured) if params.structured is not None else None
        seqs = []
        for i in range(params.n):
            gen = (torch.Generator(device=self.device).manual_seed((params.seed + i) & 0xFFFF_FFFF_FFFF_FFFF)
                   if params.seed is not None else None)
            seqs.append(Sequence(next(self._seq_ids), preq.request_id, i, ids, params, preq.max_tokens,
                                 self.eos_ids, generator=gen, parent=seqs[0] if seqs else None))
        chain = self.prompt_chain(ids, params.cache_salt) if self.prompt_chain is not None else None
        for seq in seqs if chain is not None else ():
            seq.block_keys, seq.block_hashes = list(chain[0]), list(chain[1])
        return Request(preq.request_id, preq.prompt, ids, params, seqs, preq.arrival_time, grammar)


def request_output(req: Request) -> RequestOutput:
    """What the engine reports of a request after a step: every choice's tokens so far, finished or not."""
    outs = [CompletionOutput(seq.index, "", seq.output_token_ids, seq.finish_reason, seq.stop_reason,
                             seq.output_logprobs if seq.params.logprobs is not None else None)
            for seq in req.seqs]
    first = req.seqs[0]
    times = [s.first_token_time for s in req.seqs if s.first_token_time is not None]
    prompt_lps = first.prompt_logprobs if req.params.prompt_logprobs is not None else None
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs,
                         all(s.is_finished for s in req.seqs), first.num_cached_tokens,
                         first.num_device_cached_tokens, first.num_host_cached_tokens,
                         prompt_logprobs=prompt_lps,
                         metrics={"arrival": req.arrival_time, "first_token": min(times, default=0.0)})
