"""The engine's requests: a prompt validated against the model's limits (checked again for one that
arrives validated: the engine trusts no sender) becomes one Sequence per choice, each with its own
seeded generator; plus the tokenizer facts that validation needs. Reads only immutable state, so
validation errors reach the caller before anything is queued."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import torch

from nanoserve.engine.grammar import Compile, GrammarMatchers
from nanoserve.engine.protocol import ModelInfo, PromptRequest, check_prompt_request, make_prompt_request
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


def eos_token_ids(tokenizer: Any, hf_config: Any, model_path: Path) -> frozenset[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    eos = getattr(hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    try:
        from transformers import GenerationConfig
        gen = GenerationConfig.from_pretrained(model_path)
        eos = gen.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except Exception:  # no generation_config.json: the tokenizer's EOS is enough
        pass
    return frozenset(ids)


def max_token_chars(tokenizer: Any) -> int:
    """The longest text one token can stand for: a prompt longer than max_model_len times this
    cannot fit, whatever its tokenization."""
    return max((len(t or "") for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))),
               default=1) or 1


class RequestBuilder:
    def __init__(self, info: ModelInfo, tokenizer: Any, eos_ids: frozenset[int], grammars: GrammarMatchers,
                 device: torch.device) -> None:
        self.info, self.tokenizer, self.eos_ids, self.grammars, self.device = info, tokenizer, eos_ids, grammars, device
        self._seq_ids = count()

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def make(self, request_id: str, prompt: str | list[int], params: SamplingParams,
             add_special_tokens: bool = True) -> Request:
        """Validate and tokenize; raises InvalidRequest naming the bad field (a grammar that does not
        compile too: this waits for its compile)."""
        req = self.build(make_prompt_request(self.info, self.tokenize, request_id, prompt, params, add_special_tokens))
        if req.grammar is not None:
            req.grammar.future.result()
        return req

    def build(self, preq: PromptRequest) -> Request:
        """The engine's request (one sequence per choice) for a validated one; its grammar's compile is
        started (on the grammar thread, once per distinct grammar), not waited for."""
        check_prompt_request(self.info, preq)
        params, ids = preq.params, preq.prompt_token_ids
        grammar = self.grammars.prepare(params.structured) if params.structured is not None else None
        seqs = []
        for i in range(params.n):
            gen = (torch.Generator(device=self.device).manual_seed((params.seed + i) & 0xFFFF_FFFF_FFFF_FFFF)
                   if params.seed is not None else None)
            seqs.append(Sequence(next(self._seq_ids), preq.request_id, i, ids, params, preq.max_tokens,
                                 self.eos_ids, generator=gen, parent=seqs[0] if seqs else None))
        return Request(preq.request_id, preq.prompt, ids, params, seqs, preq.arrival_time, grammar)
