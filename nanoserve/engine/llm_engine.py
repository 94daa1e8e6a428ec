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
from pathlib import Path

import torch

from nanoserve.config import EngineConfig
from nanoserve.distributed.parallel import TensorParallel
from nanoserve.engine.grammar import GrammarMatchers
from nanoserve.engine.protocol import EngineSnapshot, ModelInfo, PromptRequest, StepFailed
from nanoserve.engine.request_table import RequestTable
from nanoserve.engine.requests import Request, RequestBuilder, eos_token_ids
from nanoserve.engine.step_pipeline import Collected, Launched, StepPipeline
from nanoserve.heap import trim_heap
from nanoserve.kernels import cpu_kernels
from nanoserve.parallel.ranks import Ranks
from nanoserve.parallel.shard import build_shard, check_memory, host_blocks, startup_phase
from nanoserve.kvcache.disk_store import DiskStore, load_or_create_key, slot_size
from nanoserve.kvcache.disk_tier import DiskTier, disk_fingerprint, weights_digest
from nanoserve.kvcache.host_tier import HostTier
from nanoserve.kvcache.manager import KVCacheManager
from nanoserve.kvcache.native import KVKernels
from nanoserve.kvcache.transfer import make_copier
from nanoserve.layers.sampler import Sampler
from nanoserve.models.hub import HubOptions
from nanoserve.models.llama import LlamaModel
from nanoserve.models.loader import (GENERIC_TOKENIZERS, ModelSource, cache_dir, load_config, load_tokenizer,
                                     materialize, resolve_model, tokenizer_dir)
from nanoserve.models.tokenizer_facts import facts_of, read_tokenizer_facts
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import SamplingParams
from nanoserve.runner.model_runner import KVLayout
from nanoserve.scheduler import Scheduler

log = logging.getLogger("nanoserve")

GiB = 1 << 30


class NoKVEvents:
    """KV events off: nothing to send."""
    def flush(self) -> None: ...
    def close(self) -> None: ...


def kv_event_publisher(config: EngineConfig, kv: KVCacheManager):
    """What each tier holds, stores and drops, for routers (--kv-events-config); pyzmq is imported only
    then."""
    if config.kv_events_config is None:
        return NoKVEvents()
    from nanoserve.engine.kv_events import KVEventPublisher
    from nanoserve.kvcache.events import KVEventLog
    events = KVEventLog(kv.block_size, config.kv_events_int_hashes, kv.chains.salt_id)
    publisher = KVEventPublisher(config.kv_events_config, events)
    events.watch(kv.pool, kv.host.pool if kv.host is not None else None,
                 kv.disk.pool if kv.disk is not None else None)
    publisher.flush()  # a starting replica's AllBlocksCleared and what its disk brought back, now
    return publisher


def host_tier(config: EngineConfig, layout: KVLayout, ranks: Ranks, kv_cache: torch.Tensor,
              device: torch.device, kernels: KVKernels) -> HostTier | None:
    blocks = host_blocks(config, layout, ranks.tp.size)
    if not blocks:
        return None
    with startup_phase("host tier") as phase:
        copier = ranks.copier(make_copier(device, kernels.copy_runs))
        host = HostTier(blocks, kv_cache, copier, kernels=kernels)
        how = f"pinned in {len(host.pinned_ranges)} range(s)" if device.type == "cuda" else "allocated"
        phase.what = (f"{blocks} blocks = {blocks * layout.block_size} tokens, "
                      f"{host.num_bytes * ranks.tp.size / GiB:.2f} GiB {how}")
    return host


def disk_tier(config: EngineConfig, source: ModelSource, layout: KVLayout,
              host: HostTier | None) -> DiskTier | None:
    """The disk level (--disk-cache-gb) in its directory, with the hash key kept there: chains hashed
    after a restart must name the same prefixes."""
    if host is None or not config.disk_cache_gb:
        return None
    directory = Path(config.disk_cache_dir or cache_dir() / "kv" / source.name.replace("/", "--"))
    with startup_phase("disk tier") as phase:
        slot_bytes = slot_size(host.block_bytes)
        try:
            store = DiskStore(directory, int(config.disk_cache_gb * GiB) // slot_bytes, host.block_bytes)
            key = load_or_create_key(directory)
        except OSError as e:
            raise ValueError(f"--disk-cache-dir {directory}: {e.strerror or e}") from None
        shape = (layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim)
        kind = (f"{shape} {layout.dtype} {layout.backend.__name__} {tuple(host.cache.shape[1:])} "
                f"quantization={config.quantization}")
        # random weights are a function of the seed; real ones are not
        weights = (f"dummy seed {config.seed}".encode() if config.load_format == "dummy"
                   else weights_digest(source.path))
        disk = DiskTier(store, host, disk_fingerprint(weights, kind, key), key)
        phase.what = f"{store.num_slots} blocks, {store.num_slots * slot_bytes / GiB:.2f} GiB in {directory}"
    return disk


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
        kernels = KVKernels.of(cpu_kernels.built())  # the C++ bookkeeping kernels, where built
        host = host_tier(config, self.layout, self.ranks, self.runner.kv_cache, self.device, kernels)
        disk = disk_tier(config, self.source, self.layout, host)
        # the cleaner sizes its target from demand; a watermark only overrides it
        self.kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching, host,
                                 config.host_offload_watermark, disk.hash_key if disk else None, disk,
                                 kernels)
        if disk is not None:
            disk.restore()
        self.kv_events = kv_event_publisher(config, self.kv)  # routers hear what the disk brought back
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.step_tokens,
                                   inline_loads=self.device.type == "cpu")
        self.sampler = Sampler(config.seed, self.device)
        # constrained sequences
        self.grammars = GrammarMatchers(lambda: self.tokenizer, self.model.vocab_size)
        self.pipeline = StepPipeline(self.runner, self.sampler, self.grammars, self.ranks,
                                     config.resolved_async_scheduling(self.device))
        self.inflight: Launched | None = None  # one step ahead: the step whose forward runs
        facts = (read_tokenizer_facts(tokenizer_dir(self.source, config.tokenizer), GENERIC_TOKENIZERS)
                 or facts_of(self.tokenizer))
        eos_ids = eos_token_ids(facts.eos_token_id, self.hf_config, self.source.path)
        self.max_token_chars = facts.max_token_chars
        self.table = RequestTable(self.scheduler, self.grammars)
        self.requests, self.stats = self.table.requests, self.table.stats
        self.model_name = self.source.name
        self.info = ModelInfo(self.model_name, str(self.source.path), self.model.vocab_size,
                              self.max_model_len, self.max_token_chars, tuple(sorted(eos_ids)))
        self.request_builder = RequestBuilder(self.info, self.tokenize, eos_ids, self.grammars, self.device,
                                              self.kv.chains.prompt_chain)
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
        self.table.add(req)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        self.add(self.make_request(request_id, prompt, params))

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.table.abort(request_id)

    def finish(self, request_id: str, indices: list[int], stop_reason: str) -> RequestOutput | None:
        """Finish these choices with reason "stop" (the output processor found their stop string)."""
        return self.table.finish(request_id, indices, stop_reason)

    def has_unfinished(self) -> bool:
        """Requests to step (a step left in flight only for finished ones completes with the next)."""
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
        self.table.discard(request_id)

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
        try:
            return self._step()
        finally:
            self.kv_events.flush()  # what the step stored and dropped, for routers

    def _step(self) -> list[RequestOutput]:
        """One turn: schedule a step, collect the one in flight (one step ahead), launch the new one, complete
        the collected one; serially, launch, collect and complete the new one. Returns the outputs of the step
        completed. Raises StepFailed naming the requests a failure concerns (a failed step's, or, when
        scheduling itself failed, the running ones and the one it was admitting), with the outputs already
        made."""
        try:
            sched = self.scheduler.schedule()
        except Exception as e:
            raise StepFailed(self.active_request_ids(), e) from e
        # the cleaner after scheduling: its saves overlap the forward, and it sees what the next step needs
        self.kv.offload_cold_blocks(self.scheduler.kv_demand())
        prev, self.inflight = self.inflight, None
        collected = self._guarded(prev, self.pipeline.collect, prev) if prev is not None else None
        try:
            launched = self._launch(sched.scheduled, collected)
        except StepFailed as e:
            if collected is not None:  # the step before is done all the same: its outputs go with the error
                try:
                    e.outputs = self._complete(collected)
                except Exception:
                    e.request_ids = e.request_ids | prev.request_ids
            raise
        if self.pipeline.one_ahead:  # in flight before N completes: a failure there leaves N+1 to collect
            self.inflight = launched
        outputs = self._guarded(prev, self._complete, collected) if collected is not None else []
        if launched is not None and not self.pipeline.one_ahead:
            outputs += self._guarded(launched, self._complete, self._guarded(launched, self.pipeline.collect,
                                                                              launched))
        if launched is None and prev is None:  # only copies in flight: block, don't spin
            self.ranks.guard(self.scheduler.wait_for_transfers, 0.05)
        return outputs

    def _launch(self, scheduled, collected):
        if not scheduled:
            return None
        try:
            launched = self.pipeline.launch(scheduled, collected)
        except Exception as e:
            raise StepFailed({s.seq.request_id for s in scheduled}, e) from e
        self.stats.steps += 1
        return launched

    @staticmethod
    def _guarded(launched: Launched, fn, *args):
        try:
            return fn(*args)
        except StepFailed:
            raise
        except Exception as e:
            raise StepFailed(launched.request_ids, e) from e

    def drain(self) -> list[RequestOutput]:
        """Complete the step in flight (one step ahead), if any."""
        prev, self.inflight = self.inflight, None
        return [] if prev is None else self._guarded(prev, self._complete,
                                                     self._guarded(prev, self.pipeline.collect, prev))

    def _complete(self, collected: Collected) -> list[RequestOutput]:
        """A collected step's KV into the prefix cache and its tokens into their sequences."""
        launched = collected.launched
        for s, start in zip(launched.scheduled, launched.starts):
            seq = s.seq
            seq.num_inflight_tokens = max(0, seq.num_inflight_tokens - s.num_tokens)  # N+1's may be on it
            if seq.block_table and not seq.is_finished:  # not freed since (finished, aborted, preempted)
                self.kv.publish_computed(seq, start + s.num_tokens)
        touched: dict[str, Request] = {}
        if collected.result is not None:
            result, now = collected.result, time.monotonic()
            for seq, tok, lp in zip(launched.samplers, result.token_ids, result.logprobs):
                seq.num_pending -= 1
                if seq.is_finished:  # finished or aborted after this step was launched: its token is dropped
                    continue
                req = self.table.append(seq, tok, lp, now)
                touched[req.request_id] = req
        return [self.table.output(r) for r in touched.values()]

    def idle(self) -> None:
        """The loop waits for work (each second): a tensor-parallel worker that died meanwhile raises
        ParallelFault; the copies that landed end, and routers hear what the tiers did."""
        self.ranks.check()
        self.kv.poll_transfers()
        self.kv_events.flush()

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def close(self) -> None:
        """Shutdown: end the KV copies in flight before the host pool is released; stop the
        other tensor-parallel ranks."""
        self.grammars.close()
        try:
            self.drain()
        except StepFailed:  # its requests are being failed by whoever closes the engine
            pass
        finally:
            try:
                try:
                    self.kv.persist()  # with a disk tier: what is cached survives the restart
                except Exception:  # (a full disk): the next start finds the previous index, or none
                    log.exception("saving the disk KV cache's index failed")
                self.kv.close()
            finally:
                self.ranks.close()
                self.kv_events.close()  # (what the shutdown's saves stored, sent first)

