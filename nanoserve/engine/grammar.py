"""Grammar state of constrained sequences in the engine (llguidance): one matcher per sequence, made
by copying a per-grammar template that is compiled once (LRU cache), the allowed-token bitmask of the
constrained sampling rows filled each step, and the matcher advanced by each sampled token.

Lifecycle: a matcher is made when its request is added, advanced once per sampled token, and freed
when its sequence finishes (stop, length, abort, failure). Preemption keeps a sequence's generated
tokens (the resume recomputes their KV), so its matcher stays valid across it: nothing to roll back.
Measured (experiment bench/structured_cost.py at c256b25): a template of a realistic schema costs ~1.5 ms, a copy ~1 us."""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from nanoserve.sampling_params import InvalidRequest
from nanoserve.sequence import Sequence
from nanoserve.structured import StructuredSpec

log = logging.getLogger("nanoserve")

CACHE_SIZE = 128  # distinct grammars kept compiled


class GrammarMatchers:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        self._tokenizer = None       # llguidance's view of the vocabulary, built on first use (~0.3 s)
        self._templates: OrderedDict[str, object] = OrderedDict()
        self._matchers: dict[int, object] = {}  # seq_id -> LLMatcher
        self._words = (vocab_size + 31) // 32
        self._bitmask = torch.empty(0, self._words, dtype=torch.int32)

    def __len__(self) -> int:
        return len(self._matchers)

    def _template(self, spec: StructuredSpec):
        grammar = spec.grammar()
        tpl = self._templates.get(grammar)
        if tpl is not None:
            self._templates.move_to_end(grammar)
            return tpl
        import llguidance
        if self._tokenizer is None:
            import llguidance.hf
            self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size)
        tpl = llguidance.LLMatcher(self._tokenizer, grammar)
        if tpl.is_error():
            raise InvalidRequest(f"{spec.param}: the {spec.kind} constraint cannot be compiled: {tpl.get_error()}",
                                 param=spec.param)
        self._templates[grammar] = tpl
        if len(self._templates) > CACHE_SIZE:
            self._templates.popitem(last=False)
        return tpl

    def check(self, spec: StructuredSpec | None) -> None:
        """Compile (or find) the grammar; raises InvalidRequest naming the field if it cannot be."""
        if spec is not None:
            self._template(spec)

    def add(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.params.structured is not None:
                self._matchers[seq.seq_id] = self._template(seq.params.structured).deep_copy()

    def free(self, seq: Sequence) -> None:
        self._matchers.pop(seq.seq_id, None)

    def bitmask(self, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor] | None:
        """(rows, allowed-token bitmask [rows, ceil(V/32)] int32) for the constrained rows of this
        sampling batch, or None when none is constrained (the unconstrained path costs one lookup)."""
        if not self._matchers:
            return None
        rows = [i for i, s in enumerate(seqs) if s.seq_id in self._matchers]
        if not rows:
            return None
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = torch.empty(len(rows), self._words, dtype=torch.int32)
        mask = self._bitmask[:len(rows)]
        # on this thread, one row at a time: llguidance's parallel fill (LLExecutor) competes with torch's
        # spinning OpenMP threads for the cores and measured 0.3-2.9 ms per step instead of ~0.3 ms
        from llguidance.torch import fill_next_token_bitmask
        for j, r in enumerate(rows):
            fill_next_token_bitmask(self._matchers[seqs[r].seq_id], mask, j)
        return rows, mask

    def accept(self, seq: Sequence, token: int) -> str | None:
        """Advance `seq`'s matcher by its sampled token. Returns None to go on, "stop" when the grammar
        is complete, "abort" when the token was refused (a bug: the mask allowed only legal tokens)."""
        m = self._matchers.get(seq.seq_id)
        if m is None:
            return None
        if not m.consume_token(token):
            log.error("grammar refused token %d of %s: %s", token, seq.request_id, m.get_error())
            return "abort"
        return "stop" if m.is_stopped() else None
