"""LLMEngine: schedule -> run model -> sample -> postprocess, one step at a time, on token ids (text
is the output processor's job, on the API side).

Not thread-safe by itself: the engine core (engine/core.py) or the offline LLM drives it from one
thread. `make_request` only reads immutable state, so request validation errors reach the caller
before anything is queued."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from itertools import count

import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.grammar import GrammarMatchers
from nanoserve.engine.protocol import ModelInfo, PromptRequest, check_prompt_request, make_prompt_request
from nanoserve.kvcache.host_tier import HostTier, host_memory_available
from nanoserve.kvcache.manager import KVCacheManager
from nanoserve.layers import cpu_kernels
from nanoserve.layers.sampler import Sampler
from nanoserve.models.llama import LlamaModel
from nanoserve.models.loader import iter_weights, load_config, load_tokenizer, materialize, resolve_model
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.layers.backend_choice import resolve_attention
from nanoserve.runner import KVLayout, ModelRunner, RunnerOptions, profile_memory
from nanoserve.sampling_params import InvalidRequest, SamplingParams
from nanoserve.scheduler import Scheduler
from nanoserve.sequence import Sequence

log = logging.getLogger("nanoserve")

GiB = 1 << 30


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)


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
        self.source = materialize(resolve_model(config.model))
        self.hf_config = load_config(self.source)
        self.tokenizer = load_tokenizer(self.source, config.tokenizer)
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype(self.device)
        torch.manual_seed(config.seed)
        self.model = LlamaModel(self.hf_config, self.dtype, self.device)
        if config.load_format == "dummy":  # benchmarks: random weights made on the device, nothing read
            self.model.init_dummy(config.seed)
        else:
            self.model.load_weights(iter_weights(self.source))
        self.model.finalize(cpu_kernels.load() if self.device.type == "cpu" else None)
        backend, flash, block_size = resolve_attention(config.attention_backend, self.device, self.dtype,
                                                       config.block_size, config.flash_attn_module)
        self.layout = KVLayout(self.model.num_layers, block_size, self.model.num_kv_heads,
                               self.model.head_dim, self.dtype, backend)
        runner_opts = RunnerOptions(flash, config.max_num_seqs, config.max_num_batched_tokens,
                                    max_model_len=config.max_model_len or 0, cuda_graphs=not config.enforce_eager)
        num_blocks = self._num_device_blocks(runner_opts)
        self.max_model_len = self._max_model_len(num_blocks * block_size)
        runner_opts.max_model_len = self.max_model_len
        self.runner = ModelRunner(self.model, self.layout, num_blocks, self.device, runner_opts)
        host = self._host_tier()
        # the cleaner sizes its target from demand; a watermark only overrides it
        self.kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching, host,
                                 config.host_offload_watermark)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   inline_loads=self.device.type == "cpu")
        self.sampler = Sampler(config.seed, self.device)
        self.grammars = GrammarMatchers(self.tokenizer, self.model.vocab_size)  # constrained sequences
        self.eos_token_ids = self._eos_ids()
        # the longest text one token can stand for: a prompt longer than max_model_len times this
        # cannot fit, whatever its tokenization
        self.max_token_chars = max((len(t or "") for t in self.tokenizer.convert_ids_to_tokens(
            list(range(len(self.tokenizer))))), default=1) or 1
        self.requests: dict[str, Request] = {}
        # which requests a failure inside the current step concerns; None until scheduling has decided
        self.step_request_ids: set[str] | None = None
        self.stats = EngineStats()
        self._seq_ids = count()
        self.model_name = self.source.name
        self.info = ModelInfo(self.model_name, str(self.source.path), self.model.vocab_size, self.max_model_len,
                              self.max_token_chars, tuple(sorted(self.eos_token_ids)))
        log.info("model %s loaded in %.1fs (%s, %s)", self.model_name, time.monotonic() - t0,
                 self.device, str(self.dtype).removeprefix("torch."))
        log.info("KV cache: device %d blocks x %d tokens = %d tokens, %.2f GiB; %s; max_model_len %d",
                 num_blocks, block_size, num_blocks * block_size,
                 num_blocks * self.layout.bytes_per_block / GiB,
                 f"host {host.pool.num_blocks} blocks = {host.pool.num_blocks * block_size} tokens, "
                 f"{host.num_bytes / GiB:.2f} GiB" if host else "host tier off", self.max_model_len)

    # ---- setup helpers -------------------------------------------------------------------
    def _num_device_blocks(self, opts: RunnerOptions) -> int:
        cfg, per_block = self.config, self.layout.bytes_per_block
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        if cfg.kv_cache_gb is not None:
            budget = cfg.kv_cache_gb * GiB
        elif self.device.type == "cuda":
            # the largest step's activations and the decode graphs, measured (runner.profile_memory)
            prof = profile_memory(self.model, self.layout, self.device, opts)
            opts.cuda_graphs = opts.cuda_graphs and prof.graphs_ok  # the real runner would fail the same way
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - cfg.gpu_memory_utilization) * total - prof.activation_bytes - prof.graph_bytes
            log.info("profiled: %.2f GiB activations at %d tokens per step, %.2f GiB decode graphs",
                     prof.activation_bytes / GiB, opts.max_num_batched_tokens, prof.graph_bytes / GiB)
        else:
            budget = min(4 * GiB, 0.2 * _available_memory())
        blocks = int(budget // per_block)
        if blocks < 1:
            raise ValueError(f"KV cache budget {budget / GiB:.3f} GiB holds no block "
                             f"({per_block / GiB:.4f} GiB each); raise --kv-cache-gb")
        return blocks

    def _max_model_len(self, kv_tokens: int) -> int:
        """An explicit length the model or the KV cache cannot hold refuses to start (as vLLM
        does); the model's own length is capped by the KV capacity with a warning."""
        model_max, asked = self.hf_config.max_position_embeddings, self.config.max_model_len
        if asked:
            if asked > model_max:
                raise ValueError(f"--max-model-len {asked} exceeds the model's max_position_embeddings "
                                 f"{model_max}")
            if asked > kv_tokens:
                raise ValueError(f"--max-model-len {asked} does not fit the KV cache: it holds {kv_tokens} "
                                 f"tokens; raise --kv-cache-gb or lower --max-model-len")
            return asked
        if model_max > kv_tokens:
            log.warning("max_model_len capped at the KV cache capacity: %d tokens (the model supports %d); "
                        "raise --kv-cache-gb for longer contexts", kv_tokens, model_max)
        return min(model_max, kv_tokens)

    def _host_tier(self) -> HostTier | None:
        gb = self.config.host_cache_gb
        if not gb:
            return None
        available = _available_memory()
        if gb * GiB > available:
            raise ValueError(f"--host-cache-gb {gb} asks for more than this machine has available "
                             f"({available / GiB:.1f} GiB)")
        blocks = int(gb * GiB // self.layout.bytes_per_block)
        if blocks < 1:
            raise ValueError(f"--host-cache-gb {gb} holds no block ({self.layout.bytes_per_block / GiB:.4f} GiB each)")
        return HostTier(blocks, self.runner.kv_cache)

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        eos = getattr(self.hf_config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        try:
            from transformers import GenerationConfig
            gen = GenerationConfig.from_pretrained(self.source.path)
            eos = gen.eos_token_id
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        except Exception:  # no generation_config.json: the tokenizer's EOS is enough
            pass
        return frozenset(ids)

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     add_special_tokens: bool = True) -> Request:
        """Validate and tokenize; raises InvalidRequest naming the bad field."""
        return self.request_from(make_prompt_request(self.info, self.tokenize, request_id, prompt, params,
                                                     add_special_tokens))

    def request_from(self, preq: PromptRequest) -> Request:
        """The engine's request (one sequence per choice) for a validated one (checked again here:
        the engine trusts no sender)."""
        check_prompt_request(self.info, preq)
        params, ids = preq.params, preq.prompt_token_ids
        self.grammars.check(params.structured)  # compiled once per distinct grammar, cached
        seqs = []
        for i in range(params.n):
            gen = (torch.Generator(device=self.device).manual_seed((params.seed + i) & 0xFFFF_FFFF_FFFF_FFFF)
                   if params.seed is not None else None)
            seqs.append(Sequence(next(self._seq_ids), preq.request_id, i, ids, params, preq.max_tokens,
                                 self.eos_token_ids, generator=gen, parent=seqs[0] if seqs else None))
        return Request(preq.request_id, preq.prompt, ids, params, seqs, preq.arrival_time)

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
            self.scheduler.wait_for_transfers(timeout=0.05)
            return []
        self.stats.steps += 1
        logits, samplers, prompt_rows = self.runner.run(sched.scheduled)
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
        """Shutdown: end the KV copies in flight before the host pool is released."""
        self.kv.close()


def _available_memory() -> int:
    return host_memory_available()  # MemAvailable capped by the container's cgroup limit

