"""LLMEngine: schedule -> run model -> sample -> postprocess, one step at a time, on token ids (text
is the output processor's job, on the API side).

Not thread-safe by itself: the engine core (engine/core.py) or the offline LLM drives it from one
thread. `make_request` only reads immutable state (requests.py), so request validation errors reach
the caller before anything is queued."""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.grammar import GrammarMatchers
from nanoserve.heap import trim_heap
from nanoserve.engine.protocol import ModelInfo, PromptRequest
from nanoserve.distributed.parallel import TensorParallel, join, leave
from nanoserve.parallel.shard import build_shard, check_memory, host_blocks, startup_phase
from nanoserve.engine.requests import Request, RequestBuilder, eos_token_ids
from nanoserve.parallel.leader import (Followers, LocalWorkers, ParallelCopier, Setup, describe_fault, plan_node,
                                      shm_slot_bytes, start_worker, stop_workers)
from nanoserve.kvcache.host_tier import HostTier
from nanoserve.kvcache.manager import KVCacheManager
from nanoserve.kvcache.transfer import make_copier
from nanoserve.layers.sampler import Sampler
from nanoserve.models.hub import HubOptions
from nanoserve.models.llama import LlamaModel
from nanoserve.models.loader import (GENERIC_TOKENIZERS, load_config, load_tokenizer, materialize, resolve_model,
                                     tokenizer_dir)
from nanoserve.models.tokenizer_facts import facts_of, read_tokenizer_facts
from nanoserve.outputs import CompletionOutput, RequestOutput
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
        self.tp, self.followers, self.local_workers = TensorParallel(), None, None
        if config.tensor_parallel_size > 1:
            # refuse a split the model cannot take before starting anything (meta: no memory)
            LlamaModel(self.hf_config, self.dtype, torch.device("meta"), TensorParallel(0, config.tensor_parallel_size))
            self._start_workers()
        try:
            shard = build_shard(config, self.source, self.hf_config, self.device, self.dtype, self.tp)
        except BaseException:
            if self.followers is not None:
                self._stop_workers()
            elif self.local_workers is not None:
                self.local_workers.stop(timeout=0)
            raise
        self.model, self.layout, self.runner = shard.model, shard.layout, shard.runner
        num_blocks, block_size, self.max_model_len = shard.num_blocks, shard.layout.block_size, shard.max_model_len
        self.runner.listener = self.followers
        host = self._host_tier()
        # the cleaner sizes its target from demand; a watermark only overrides it
        self.kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching, host,
                                 config.host_offload_watermark)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.step_tokens,
                                   inline_loads=self.device.type == "cpu")
        self.sampler = Sampler(config.seed, self.device)
        self.grammars = GrammarMatchers(lambda: self.tokenizer, self.model.vocab_size)  # constrained sequences
        facts = (read_tokenizer_facts(tokenizer_dir(self.source, config.tokenizer), GENERIC_TOKENIZERS)
                 or facts_of(self.tokenizer))
        eos_ids = eos_token_ids(facts.eos_token_id, self.hf_config, self.source.path)
        self.max_token_chars = facts.max_token_chars
        self.requests: dict[str, Request] = {}
        # which requests a failure inside the current step concerns; None until scheduling has decided
        self.step_request_ids: set[str] | None = None
        self.stats = EngineStats()
        self.model_name = self.source.name
        self.info = ModelInfo(self.model_name, str(self.source.path), self.model.vocab_size, self.max_model_len,
                              self.max_token_chars, tuple(sorted(eos_ids)))
        self.request_builder = RequestBuilder(self.info, self.tokenize, eos_ids, self.grammars, self.device)
        trim_heap()  # what reading the tokenizer's files left
        log.info("model %s loaded in %.1fs (%s, %s)", self.model_name, time.monotonic() - t0,
                 self.device, str(self.dtype).removeprefix("torch."))

    @property
    def tokenizer(self):
        """transformers' tokenizer, loaded on first use (behind an API process: the first constrained request)."""
        with self._tokenizer_lock:  # the grammar thread may ask too
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self.source, self.config.tokenizer)
            return self._tokenizer

    # ---- setup helpers -------------------------------------------------------------------
    def _start_workers(self) -> None:
        """Tensor parallel: start this node's other ranks, join them as rank 0, send the settings."""
        specs = plan_node(self.config, self.device, shm_slot_bytes(self.config, self.hf_config, self.device))
        if self.device.type == "cpu" and specs[0].threads is not None:
            torch.set_num_threads(specs[0].threads)
            if specs[0].cpus is not None:
                os.sched_setaffinity(0, specs[0].cpus)
        self.local_workers = LocalWorkers({s.rank: start_worker(s) for s in specs[1:]})
        try:
            self.tp, channel = join(specs[0].rendezvous, 0, self.device)
        except BaseException:
            self.local_workers.stop(timeout=0)
            raise
        if self.tp.shm is not None:  # fail the shared-memory waits at once
            self.local_workers.on_death = lambda: (self.tp.shm.abort(), channel.abort())
        self.followers = Followers(channel, self.tp)
        # also at interpreter exit: an offline LLM nobody closed must not leave its workers waiting
        self._stop_workers = weakref.finalize(self, stop_workers, self.followers, self.local_workers)
        self.followers.send(Setup(dataclasses.asdict(self.config), self.source.name, str(self.source.path),
                                   str(self.dtype).removeprefix("torch.")))
        log.info("tensor parallel: %d ranks (%d on this node), collectives through %s", self.tp.size, len(specs),
                 "NCCL" if self.device.type == "cuda" else "shared memory" if self.tp.shm else "gloo")

    def _host_tier(self) -> HostTier | None:
        blocks = host_blocks(self.config, self.layout, self.tp.size)
        if not blocks:
            return None
        with startup_phase("host tier") as phase:
            copier = make_copier(self.device)
            if self.followers is not None:
                copier = ParallelCopier(copier, self.followers)
            host = HostTier(blocks, self.runner.kv_cache, copier)
            how = f"pinned in {len(host.pinned_ranges)} range(s)" if self.device.type == "cuda" else "allocated"
            phase.what = (f"{blocks} blocks = {blocks * self.layout.block_size} tokens, "
                          f"{host.num_bytes * self.tp.size / GiB:.2f} GiB {how}")
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

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.step_request_ids = None
        sched = self.scheduler.schedule()
        self.step_request_ids = {s.seq.request_id for s in sched.scheduled}
        # the cleaner after scheduling: its saves overlap this step's forward, and it sees what the
        # next step will ask for
        self.kv.offload_cold_blocks(self.scheduler.kv_demand())
        if not sched.scheduled:  # only copies in flight (loads, or saves a deferral waits for): block, don't spin
            self._parallel(self.scheduler.wait_for_transfers, 0.05)
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
        """Raise ParallelFault if a worker of this node has exited (an idle engine's periodic check;
        a busy one notices in its next collective)."""
        if self.followers is not None and self.local_workers is not None and self.local_workers.dead():
            raise describe_fault(RuntimeError("a worker process exited"), self.local_workers)

    def _run(self, sched):
        return self._parallel(self.runner.run, sched.scheduled)

    def _parallel(self, fn, *args):
        """Under tensor parallelism any failure where the ranks meet is fatal (ParallelFault): the
        others may be inside a collective rank 0 will never join."""
        if self.followers is None:
            return fn(*args)
        try:
            return fn(*args)
        except Exception as e:
            self.followers.failed = True
            raise describe_fault(e, self.local_workers) from e

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
        finished = all(s.is_finished for s in req.seqs)
        outs = [CompletionOutput(seq.index, "", seq.output_token_ids, seq.finish_reason, seq.stop_reason,
                                 seq.output_logprobs if seq.params.logprobs is not None else None)
                for seq in req.seqs]
        if finished:
            del self.requests[req.request_id]
        first = req.seqs[0]
        times = [s.first_token_time for s in req.seqs if s.first_token_time is not None]
        prompt_lps = first.prompt_logprobs if req.params.prompt_logprobs is not None else None
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished,
                             first.num_cached_tokens, first.num_device_cached_tokens,
                             first.num_host_cached_tokens, prompt_logprobs=prompt_lps,
                             metrics={"arrival": req.arrival_time, "first_token": min(times, default=0.0)})

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def close(self) -> None:
        """Shutdown: end the KV copies in flight before the host pool is released; stop the
        other tensor-parallel ranks."""
        self.grammars.close()
        try:
            self.kv.close()
        finally:
            if self.followers is not None:
                self._stop_workers()
                self.followers = None

