"""Grammar state of constrained sequences in the engine (llguidance): one matcher per sequence, made
by copying a per-grammar template that is compiled once (LRU cache), the allowed-token bitmask of the
constrained sampling rows filled each step, and the matcher advanced by each sampled token.

Compiling never happens inside the step: `prepare` hands a grammar to one worker thread and returns
a Compile to poll; the engine core admits a request only once its grammar is compiled (core.py), and a
compile that fails or takes longer than COMPILE_TIMEOUT_S fails its request (InvalidRequest naming
the field). llguidance's view of the vocabulary (~0.3 s, holding the GIL most of that time, and ~100 MB
resident with the transformers tokenizer it is read from) is built on the grammar thread before the first
compile: a server that never sees a constrained request never pays for it, and its first one waits for it
(the running sequences do not: the step goes on while a grammar compiles).
The offline path (`add` of a request whose grammar is still compiling) waits for it.

Lifecycle: a matcher is made when its request is added, advanced once per sampled token, and freed
when its sequence finishes (stop, length, abort, failure). Preemption keeps a sequence's generated
tokens (the resume recomputes their KV), so its matcher stays valid across it: nothing to roll back.
Measured: a template of a realistic schema costs ~1.5 ms, a copy ~1 us."""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from nanoserve.sampling_params import InvalidRequest
from nanoserve.sequence import Sequence
from nanoserve.structured import COMPILE_TIMEOUT_S, StructuredSpec

log = logging.getLogger("nanoserve")

CACHE_SIZE = 128  # distinct grammars kept compiled
# the vocabulary's own bound (importing transformers, loading the tokenizer, llguidance's view: ~1 s for
# the embedded model's 49k tokens); a compile's clock starts once it is there
VOCAB_TIMEOUT_S = 60.0


@dataclass
class Compile:
    """A grammar being compiled (or compiled) on the worker thread."""
    spec: StructuredSpec
    future: Future
    started: float = field(default_factory=time.monotonic)


class GrammarMatchers:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int,
                 compile_timeout: float = COMPILE_TIMEOUT_S, vocab_timeout: float = VOCAB_TIMEOUT_S) -> None:
        self.load_tokenizer, self.vocab_size, self.compile_timeout = (load_tokenizer, vocab_size,
                                                                      compile_timeout)
        self.vocab_timeout, self._vocab_started = vocab_timeout, 0.0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="nanoserve-grammar")
        self._tokenizer: Future | None = None   # llguidance's view of the vocabulary
        self._templates: OrderedDict[str, Compile] = OrderedDict()
        # the engine core's intake thread builds requests (prepare) while the loop adds them (prepare too)
        self._lock = threading.RLock()
        self._matchers: dict[int, object] = {}  # seq_id -> LLMatcher
        self._words = (vocab_size + 31) // 32
        self._bitmask = torch.empty(0, self._words, dtype=torch.int32)

    def __len__(self) -> int:
        return len(self._matchers)

    def start(self) -> Future:
        """Build llguidance's tokenizer on the worker thread (once; the first compile waits for it)."""
        with self._lock:
            if self._tokenizer is None:
                self._vocab_started = time.monotonic()
                self._tokenizer = self._pool.submit(self._build_tokenizer)
            return self._tokenizer

    def _build_tokenizer(self):
        t0 = time.perf_counter()
        try:
            import llguidance.hf
            tok = llguidance.hf.from_tokenizer(self.load_tokenizer(), n_vocab=self.vocab_size)
        except Exception as e:  # kept: every constrained request is refused with it, the rest are served
            log.error("structured outputs are unavailable: llguidance cannot read this model's "
                      "tokenizer: %s", e)
            raise
        log.debug("llguidance tokenizer built in %.2fs", time.perf_counter() - t0)
        return tok

    def _compile(self, spec: StructuredSpec, grammar: str):
        import llguidance
        try:
            vocabulary = self._tokenizer.result()
        except Exception as e:
            raise InvalidRequest(f"{spec.param}: structured outputs are unavailable for this model: "
                                 f"llguidance cannot read its tokenizer ({type(e).__name__}: {e})",
                                 param=spec.param) from e
        tpl = llguidance.LLMatcher(vocabulary, grammar)
        if tpl.is_error():
            raise InvalidRequest(f"{spec.param}: the {spec.kind} constraint cannot be compiled: "
                                 f"{tpl.get_error()}", param=spec.param)
        return tpl

    def prepare(self, spec: StructuredSpec) -> Compile:
        """The compile of this grammar: found in the cache, or started on the worker thread."""
        grammar = spec.grammar()
        with self._lock:
            c = self._templates.get(grammar)
            if c is not None:
                self._templates.move_to_end(grammar)
                return c
            self.start()
            c = self._templates[grammar] = Compile(spec, self._pool.submit(self._compile, spec, grammar))
            if len(self._templates) > CACHE_SIZE:
                self._templates.popitem(last=False)
            return c

    def ready(self, c: Compile) -> bool:
        """Whether the grammar is compiled; raises InvalidRequest if it failed or is taking too long."""
        if c.future.done():
            c.future.result()  # raises what the compile raised
            return True
        # the first compile waits for the vocabulary: its clock has not started
        if not self._tokenizer.done():
            if time.monotonic() - self._vocab_started > self.vocab_timeout:
                raise InvalidRequest(f"{c.spec.param}: structured outputs are not ready: reading this "
                                     f"model's vocabulary took longer than {self.vocab_timeout:g}s",
                                     param=c.spec.param)
            c.started = time.monotonic()
            return False
        if time.monotonic() - c.started > self.compile_timeout:
            raise InvalidRequest(f"{c.spec.param}: the {c.spec.kind} constraint took longer than "
                                 f"{self.compile_timeout:g}s to compile", param=c.spec.param)
        return False

    def check(self, spec: StructuredSpec | None) -> None:
        """Compile (or find) the grammar, waiting for it; raises InvalidRequest naming the field if it
        cannot be."""
        if spec is not None:
            self.prepare(spec).future.result()

    def add(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.params.structured is not None:
                self._matchers[seq.seq_id] = self.prepare(seq.params.structured).future.result().deep_copy()

    def free(self, seq: Sequence) -> None:
        self._matchers.pop(seq.seq_id, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

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
        # spinning OpenMP threads for the cores and measured 0.3-2.9 ms per step instead of ~0.3 ms. The
        # matcher writes the row itself, as llguidance.torch's fill does: importing that module costs the
        # engine ~150 MB resident (its torch.compile decorator pulls in inductor and triton)
        row_bytes = self._words * 4
        for j, r in enumerate(rows):
            self._matchers[seqs[r].seq_id].unsafe_compute_mask_ptr(mask[j].data_ptr(), row_bytes)
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
