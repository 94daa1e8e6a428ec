"""LLMEngine: schedule -> run model -> sample -> postprocess, one step at a time, on token ids (text
is the output processor's job, on the API side).

Not thread-safe by itself: the engine core (engine/core.py) or the offline LLM drives it from one
thread. `make_request` only reads immutable state (requests.py), so request validation errors reach
the caller before anything is queued."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from nanoserve.config import EngineConfig
from nanoserve.distributed.parallel import TensorParallel
from nanoserve.engine.grammar import GrammarMatchers
from nanoserve.engine.protocol import EngineSnapshot, ModelInfo, PromptRequest, StepFailed
from nanoserve.engine.requests import Request, RequestBuilder, eos_token_ids, request_output
from nanoserve.heap import trim_heap
from nanoserve.parallel.ranks import Ranks
from nanoserve.parallel.shard import build_shard, check_memory, host_blocks, startup_phase
from nanoserve.kvcache.host_tier import HostTier
from nanoserve.kvcache.manager import KVCacheManager
from nanoserve.kvcache.transfer import make_copier
from nanoserve.layers.sampler import Sampler
from nanoserve.models.hub import HubOptions
from nanoserve.models.llama import LlamaModel
from nanoserve.models.loader import (GENERIC_TOKENIZERS, load_config, load_tokenizer, materialize,
                                     resolve_model, tokenizer_dir)
from nanoserve.models.tokenizer_facts import facts_of, read_tokenizer_facts
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import InvalidRequest, SamplingParams
from nanoserve.scheduler import Scheduler
from nanoserve.sequence import Sequence

log = logging.getLogger("nanoserve")

GiB = 1 << 30


@dataclass
class EngineStats:
    """Monotonic counters for /metrics and benchmarks."""
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    steps: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        t0 = time.monotonic()
        self.device = config.resolved_device()
        check_memory(config, self.device)  # before a download or a weight read
        hub = HubOptions(config.revision, config.download_dir, config.gguf_file)
        self.source = materialize(resolve_model(config.model, hub), dequantize=config.gguf_dequantize)
        self.hf_config = load_config(self.source)
        self._tokenizer, self._tokenizer_lock = None, threading.Lock()
        self.dtype = config.resolved_dtype(self.device)
        torch.manual_seed(config.seed)
        self.ranks = Ranks()
        if config.tensor_parallel_size > 1:
            # refuse a split the model cannot take before starting anything (meta: no memory)
            LlamaModel(self.hf_config, self.dtype, torch.device("meta"),
                       TensorParallel(0, config.tensor_parallel_size))
            self.ranks = Ranks.start(config, self.device, self.hf_config, Ranks.setup_message(
                config, self.source.name, str(self.source.path), self.dtype))
        try:
            shard = build_shard(config, self.source, self.hf_config, self.device, self.dtype, self.ranks.tp)
        except BaseException:
            self.ranks.close()
            raise
        self.model, self.layout, self.runner = shard.model, shard.layout, shard.runner
        num_blocks, block_size, self.max_model_len = (shard.num_blocks, shard.layout.block_size,
                                                      shard.max_model_len)
        self.runner.listener = self.ranks.followers
        host = self._host_tier()
        # the cleaner sizes its target from demand; a watermark only overrides it
        self.kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching, host,
                                 config.host_offload_watermark)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.step_tokens,
                                   inline_loads=self.device.type == "cpu")
        self.sampler = Sampler(config.seed, self.device)
        # constrained sequences
        self.grammars = GrammarMatchers(lambda: self.tokenizer, self.model.vocab_size)
        facts = (read_tokenizer_facts(tokenizer_dir(self.source, config.tokenizer), GENERIC_TOKENIZERS)
                 or facts_of(self.tokenizer))
        eos_ids = eos_token_ids(facts.eos_token_id, self.hf_config, self.source.path)
        self.max_token_chars = facts.max_token_chars
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.model_name = self.source.name
        self.info = ModelInfo(self.model_name, str(self.source.path), self.model.vocab_size,
                              self.max_model_len, self.max_token_chars, tuple(sorted(eos_ids)))
        self.request_builder = RequestBuilder(self.info, self.tokenize, eos_ids, self.grammars, self.device)
        trim_heap()  # what reading the tokenizer's files left
        log.info("model %s loaded in %.1fs (%s, %s)", self.model_name, time.monotonic() - t0,
                 self.device, str(self.dtype).removeprefix("torch."))

    @property
    def tokenizer(self):
        """transformers' tokenizer, loaded on first use (behind an API process: the first constrained
        request)."""
        with self._tokenizer_lock:  # the grammar thread may ask too
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self.source, self.config.tokenizer)
            return self._tokenizer

    def _host_tier(self) -> HostTier | None:
        blocks = host_blocks(self.config, self.layout, self.ranks.tp.size)
        if not blocks:
            return None
        with startup_phase("host tier") as phase:
            host = HostTier(blocks, self.runner.kv_cache, self.ranks.copier(make_copier(self.device)))
            how = (f"pinned in {len(host.pinned_ranges)} range(s)" if self.device.type == "cuda"
                   else "allocated")
            phase.what = (f"{blocks} blocks = {blocks * self.layout.block_size} tokens, "
                          f"{host.num_bytes * self.ranks.tp.size / GiB:.2f} GiB {how}")
        return host

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     add_special_tokens: bool = True) -> Request:
        """Validate and tokenize; raises InvalidRequest naming the bad field."""
        return self.request_builder.make(request_id, prompt, params, add_special_tokens)

    def request_from(self, preq: PromptRequest) -> Request:
        """The engine's request for a validated one (checked again: the engine trusts no sender)."""
        return self.request_builder.build(preq)

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise InvalidRequest(f"duplicate request id {req.request_id!r}", param="request_id")
        self.requests[req.request_id] = req
        self.grammars.add(req.seqs)
        self.stats.prompt_tokens += len(req.prompt_token_ids) * len(req.seqs)
        for seq in req.seqs:
            self.scheduler.add(seq)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        self.add(self.make_request(request_id, prompt, params))

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, "abort")
        return self._output(req)

    def finish(self, request_id: str, indices: list[int], stop_reason: str) -> RequestOutput | None:
        """Finish these choices with reason "stop" (the output processor found their stop string)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.seqs:
            if seq.index in indices and not seq.is_finished:
                seq.stop_reason = stop_reason
                self._finish(seq, "stop")
        return self._output(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def active_request_ids(self) -> set[str]:
        """The running requests and the head of the queue: what a step that failed to schedule concerns."""
        sch = self.scheduler
        return {s.request_id for s in sch.running} | ({sch.waiting[0].request_id} if sch.waiting else set())

    def request_counts(self) -> tuple[int, int]:
        """(running, waiting) requests, each counted once whatever its number of sequences."""
        sch = self.scheduler
        return len({s.request_id for s in sch.running}), len({s.request_id for s in sch.waiting})

    def next_step_kind(self) -> str:
        return self.scheduler.next_step_kind()

    def discard(self, request_id: str) -> None:
        """Forget a request whose abort failed, so that it cannot fail every later step."""
        self.requests.pop(request_id, None)

    def snapshot(self) -> EngineSnapshot:
        """Counts and counters for /metrics; the loop adds its own (step errors, invariant violations)."""
        running, waiting = self.request_counts()
        st = self.stats
        return EngineSnapshot(num_running=running, num_waiting=waiting,
                              num_preemptions=self.scheduler.num_preemptions, prompt_tokens=st.prompt_tokens,
                              generation_tokens=st.generation_tokens, finished=dict(st.finished),
                              steps=st.steps, tiers=[dataclasses.replace(r) for r in self.kv.reports()],
                              time=time.time())

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step; raises StepFailed naming the requests a failure concerns (the scheduled ones, or,
        when scheduling itself failed, the running ones and the one it was admitting)."""
        try:
            sched = self.scheduler.schedule()
        except Exception as e:
            raise StepFailed(self.active_request_ids(), e) from e
        try:
            return self._step(sched)
        except Exception as e:
            raise StepFailed({s.seq.request_id for s in sched.scheduled}, e) from e

    def _step(self, sched) -> list[RequestOutput]:
        # the cleaner after scheduling: its saves overlap this step's forward, and it sees what the
        # next step will ask for
        self.kv.offload_cold_blocks(self.scheduler.kv_demand())
        # only copies in flight (loads, or saves a deferral waits for): block, don't spin
        if not sched.scheduled:
            self.ranks.guard(self.scheduler.wait_for_transfers, 0.05)
            return []
        self.stats.steps += 1
        logits, samplers, prompt_rows = self._run(sched)
        for s in sched.scheduled:
            s.seq.num_computed_tokens += s.num_tokens
            self.kv.publish_computed(s.seq)
        row = len(samplers)
        for pr in prompt_rows:
            targets = pr.seq.token_ids[pr.first_target:pr.first_target + pr.count]
            pr.seq.prompt_logprobs += self.sampler.prompt_logprobs(
                logits[row:row + pr.count], targets, pr.seq.params.prompt_logprobs)
            row += pr.count
        touched: dict[str, Request] = {}
        if samplers:
            result = self.sampler(logits[:len(samplers)], samplers, self.grammars.bitmask(samplers))
            now = time.monotonic()
            for seq, tok, lp in zip(samplers, result.token_ids, result.logprobs):
                req = self.requests[seq.request_id]
                touched[req.request_id] = req
                self._append(req, seq, tok, lp, now)
        return [self._output(r) for r in touched.values()]

    def check_workers(self) -> None:
        self.ranks.check()

    def _run(self, sched):
        return self.ranks.guard(self.runner.run, sched.scheduled)

    def _append(self, req: Request, seq: Sequence, tok: int, lp, now: float) -> None:
        seq.token_ids.append(tok)
        self.stats.generation_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        if lp is not None:
            seq.output_logprobs.append(lp)
        p = seq.params
        if (grammar_end := self.grammars.accept(seq, tok)) is not None:  # complete (or, a bug, refused)
            self._finish(seq, grammar_end)
        elif tok in p.stop_token_ids:
            seq.stop_reason = tok
            self._finish(seq, "stop")
        elif tok in seq.eos_token_ids and not p.ignore_eos:
            self._finish(seq, "stop")
        elif seq.num_output_tokens >= seq.max_tokens:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self.grammars.free(seq)
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    def _output(self, req: Request) -> RequestOutput:
        out = request_output(req)
        if out.finished:
            del self.requests[req.request_id]
        return out

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def close(self) -> None:
        """Shutdown: end the KV copies in flight before the host pool is released; stop the
        other tensor-parallel ranks."""
        self.grammars.close()
        try:
            self.kv.close()
        finally:
            self.ranks.close()

