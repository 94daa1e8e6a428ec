"""Model runner: owns the model, the device KV cache tensor and the attention backend; turns a
scheduler step into flat batch tensors and returns the logits of the sequences that sample.

Graph-ready: the step's token ids, positions, slots and logits rows live in persistent buffers
filled from host staging (pinned on CUDA, fenced by an event: layers/staging.py) with one copy per
step, and the forward itself never reads back from the device. With a paged backend (flash or
Triton) on CUDA, pure-decode steps replay CUDA graphs captured at start-up for a few batch-size
buckets (padded up to the bucket); the padded path is the same code eagerly on CPU, which is how
tests check it."""
from __future__ import annotations

import contextlib
import gc
import logging
from dataclasses import dataclass, field, replace
from typing import Callable, ContextManager, Protocol

import torch

from nanoserve.layers.attention import AttentionBackend, AttentionBatch, TorchAttention
from nanoserve.layers.flash_attention import FlashAttention
from nanoserve.layers.sampler import Sampler
from nanoserve.layers.staging import Staging
from nanoserve.models.llama import LlamaModel
from nanoserve.scheduler import ScheduledSeq
from nanoserve.sequence import Sequence

log = logging.getLogger("nanoserve")


@dataclass
class PromptLogitRows:
    """Rows of the step's logits that score prompt tokens: row i predicts token first_target + i."""
    seq: Sequence
    first_target: int
    count: int


@dataclass
class StepPlan:
    """One step's forward, as plain data (it crosses to the other tensor-parallel ranks): per-token
    rows (ids, positions, KV slots), the rows whose logits are wanted, and per-sequence attention
    metadata, decodes first. `bucket`: a pure-decode step padded to that batch size (graph replay)."""
    ids: list[int]
    positions: list[int]
    slot_blocks: list[int]
    slot_offsets: list[int]
    logits_rows: list[int]
    query_lens: list[int]
    context_lens: list[int]
    tables: list[list[int]]
    num_decodes: int
    bucket: int | None = None


class StepListener(Protocol):
    """Told about every step's plan before this rank runs it (the tensor-parallel leader sends it
    to the other ranks), and when the forward has returned."""
    def before(self, plan: StepPlan) -> None: ...
    def after(self) -> None: ...


@dataclass
class KVLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    backend: type[AttentionBackend] = TorchAttention

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        block = self.backend.block_shape(self.block_size, self.num_kv_heads, self.head_dim)
        return (num_blocks, self.num_layers, 2, *block)


@dataclass
class RunnerOptions:
    flash_module: object | None = None  # flash-attn (or its reference); used iff layout.backend is FlashAttention
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0              # sizes the graphs' block tables; 0 = the model's max positions
    cuda_graphs: bool = False           # capture pure-decode graphs (CUDA + a paged backend only)
    padded_decode: bool = False         # run pure-decode steps through the padded graph path even
                                        # without graphs (CPU tests of the replay path)
    graph_buckets: list[int] = field(default_factory=list)  # empty = default buckets up to max_num_seqs


def decode_buckets(max_num_seqs: int) -> list[int]:
    """nano-vLLM's buckets: 1, 2, 4, 8, then every 16, up to max_num_seqs (always included)."""
    b = [x for x in (1, 2, 4, 8) if x < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return b + [max_num_seqs]


_IDS, _POS, _BLK, _OFF, _LOGITS = range(5)


class ModelRunner:
    def __init__(self, model: LlamaModel, layout: KVLayout, num_blocks: int, device: torch.device,
                 opts: RunnerOptions | None = None) -> None:
        self.model = model
        self.layout = layout
        self.device = device
        self.opts = opts = opts or RunnerOptions()
        paged = issubclass(layout.backend, FlashAttention)  # flash or Triton: int32 paged metadata
        # paged: one extra block past those the KV manager hands out, where padded rows go
        self.kv_cache = torch.zeros(layout.shape(num_blocks + paged), dtype=layout.dtype, device=device)
        self.max_tokens = max(opts.max_num_batched_tokens, opts.max_num_seqs)
        self.staging = Staging(device)
        self.inputs = self.staging.buffer((5, self.max_tokens), torch.long)  # ids, positions, slots, logits rows
        if paged:
            # graphs bake the table width (and flash-attn its split count) in: size it from the
            # longest sequence this engine admits, not the model's own maximum
            width = -(-(opts.max_model_len or model.cfg.max_position_embeddings) // layout.block_size)
            self.attn: AttentionBackend = layout.backend(
                self.kv_cache, model.num_heads, model.scale, flash=opts.flash_module, max_seqs=opts.max_num_seqs,
                max_blocks_per_seq=width, scratch_block=num_blocks, staging=self.staging)
        else:
            self.attn = TorchAttention(self.kv_cache, model.num_heads, model.scale,
                                       model.kernels)
        self.buckets = sorted(opts.graph_buckets or decode_buckets(opts.max_num_seqs)) if paged else []
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_logits: torch.Tensor | None = None  # one static output, shared by every bucket's graph
        self.steps_graphed = self.steps_eager = self.steps_padded = 0
        self.listener: StepListener | None = None
        if paged and opts.cuda_graphs and device.type == "cuda":
            self.capture_graphs()

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[Sequence], list[PromptLogitRows]]:
        """Compute one step. Returns logits whose first S rows belong to the S sequences whose
        scheduled tokens reach their end (they sample next), in that order, followed by the rows
        that score prompt tokens for requests that asked for prompt logprobs."""
        plan, samplers, prompt_rows = self.plan(scheduled)
        if listener := self.listener:
            listener.before(plan)
        logits = self.execute(plan)
        if listener:
            listener.after()
        return logits, samplers, prompt_rows

    def plan(self, scheduled: list[ScheduledSeq]) -> tuple[StepPlan, list[Sequence], list[PromptLogitRows]]:
        # decodes first: both backends attend them together
        decodes = [s for s in scheduled if self._is_decode(s)]
        order = decodes + [s for s in scheduled if not self._is_decode(s)]
        bucket = self._bucket(len(decodes)) if len(decodes) == len(order) else None
        if bucket is not None and (bucket in self.graphs or self.opts.padded_decode):
            return self._plan_padded_decode(order, bucket), [s.seq for s in order], []
        bs = self.layout.block_size
        plan = StepPlan([], [], [], [], [], [], [], [], len(decodes))
        samplers: list[Sequence] = []
        prompt_idx: list[int] = []
        prompt_rows: list[PromptLogitRows] = []
        for s in order:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_tokens
            plan.ids.extend(seq.token_ids[start:start + n])
            pos = range(start, start + n)
            plan.positions.extend(pos)
            table = seq.block_table
            plan.slot_blocks.extend(table[p // bs] for p in pos)
            plan.slot_offsets.extend(p % bs for p in pos)
            plan.query_lens.append(n)
            plan.context_lens.append(start + n)
            plan.tables.append(table)
            if start + n == seq.num_tokens:
                plan.logits_rows.append(len(plan.ids) - 1)
                samplers.append(seq)
            if seq.wants_prompt_logprobs:  # position p scores token p + 1; skip ones already scored
                first = max(start, len(seq.prompt_logprobs) - 1)
                end = min(start + n, seq.num_prompt_tokens - 1)
                if end > first:
                    base = len(plan.ids) - n - start
                    prompt_idx.extend(range(base + first, base + end))
                    prompt_rows.append(PromptLogitRows(seq, first + 1, end - first))
        plan.logits_rows += prompt_idx
        return plan, samplers, prompt_rows

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """The forward of a plan (on every tensor-parallel rank); logits on rank 0, None elsewhere."""
        if plan.bucket is not None:
            return self._run_padded_decode(plan)
        n_tok, rows = len(plan.ids), plan.logits_rows
        buf = self._stage_rows(plan, n_tok)
        buf[_LOGITS, :len(rows)] = rows
        dev = self.inputs.upload(5)[:, :n_tok]
        self.attn.prepare(AttentionBatch(plan.query_lens, plan.context_lens, plan.tables, plan.num_decodes,
                                         dev[_BLK], dev[_OFF]))
        self.staging.end_uploads()
        logits = self.model(dev[_IDS], dev[_POS], self.attn, dev[_LOGITS, :len(rows)])
        self.steps_eager += 1
        return logits

    # ---- padded pure-decode steps (CUDA graph replay, or the same path eagerly) -----------------
    def _bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _plan_padded_decode(self, decodes: list[ScheduledSeq], bucket: int) -> StepPlan:
        bs = self.layout.block_size
        seqs = [s.seq for s in decodes]
        pos = [s.num_computed_tokens for s in seqs]
        return StepPlan([s.token_ids[p] for s, p in zip(seqs, pos)], pos,
                        [s.block_table[p // bs] for s, p in zip(seqs, pos)], [p % bs for p in pos],
                        [], [1] * len(seqs), [p + 1 for p in pos], [s.block_table for s in seqs], len(seqs), bucket)

    def _run_padded_decode(self, plan: StepPlan) -> torch.Tensor | None:
        n, bucket = len(plan.ids), plan.bucket
        self._pad_rows(self._stage_rows(plan, bucket), n, bucket)
        logits = self._padded_forward(bucket, plan.tables, plan.context_lens)
        if bucket in self.graphs:
            self.steps_graphed += 1
        else:
            self.steps_eager += 1
        self.steps_padded += 1
        if (total := self.steps_graphed + self.steps_eager) % 1000 == 0 and self.graphs:
            log.info("decode CUDA graphs: %d of %d steps graphed", self.steps_graphed, total)
        return logits[:n] if logits is not None else None

    def _pad_rows(self, buf, n: int, bucket: int) -> None:
        """Rows n..bucket: token 0, position 0, into the scratch block (unread); logits rows 0..bucket-1."""
        buf[_IDS:_OFF + 1, n:bucket] = 0
        buf[_BLK, n:bucket] = self.kv_cache.shape[0] - 1
        buf[_LOGITS, :bucket] = range(bucket)

    def _padded_forward(self, bucket: int, tables: list[list[int]], context_lens: list[int]) -> torch.Tensor:
        self._padded_upload(bucket, tables, context_lens)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            return self.graph_logits[:bucket] if self.graph_logits is not None else None
        return self._decode_forward(bucket)

    def _padded_upload(self, bucket: int, tables: list[list[int]], context_lens: list[int]) -> None:
        n = len(tables)
        dev = self.inputs.upload(5)[:, :bucket]
        batch = AttentionBatch([1] * n, context_lens, tables, n, dev[_BLK], dev[_OFF])
        self.attn.prepare(batch, pad_to=bucket)
        self.staging.end_uploads()

    def _decode_forward(self, bucket: int) -> torch.Tensor:
        """What a graph captures: reads only persistent device buffers."""
        dev = self.inputs.dev
        return self.model(dev[_IDS, :bucket], dev[_POS, :bucket], self.attn, dev[_LOGITS, :bucket])

    def _stage_rows(self, plan: StepPlan, rows: int):
        """Staging for `rows` token rows (padding included), the plan's tokens written."""
        buf, n = self._stage(rows), len(plan.ids)
        buf[_IDS, :n] = plan.ids
        buf[_POS, :n] = plan.positions
        buf[_BLK, :n] = plan.slot_blocks
        buf[_OFF, :n] = plan.slot_offsets
        return buf

    def _stage(self, n: int):
        if n > self.max_tokens:
            raise ValueError(f"a step of {n} tokens exceeds the runner's buffers ({self.max_tokens})")
        self.staging.begin_writes()  # the previous step's uploads have been read
        return self.inputs.np

    @torch.inference_mode()
    def warmup_prefill(self, n: int) -> torch.Tensor:
        """A fresh prefill of n tokens in which every row is a logits row (the most one step can
        ask for: prompt logprobs), for the memory profile; split into sequences no longer than
        max_model_len. Needs warmup_blocks(n) blocks."""
        bs, lens = self.layout.block_size, self._warmup_lens(n)
        buf = self._stage(n)
        buf[_IDS, :n] = 0
        buf[_POS, :n] = [p for m in lens for p in range(m)]
        tables, first = [], 0
        for m in lens:
            tables.append(list(range(first, first + -(-m // bs))))
            first += len(tables[-1])
        buf[_BLK, :n] = [t[p // bs] for t, m in zip(tables, lens) for p in range(m)]
        buf[_OFF, :n] = [p % bs for m in lens for p in range(m)]
        buf[_LOGITS, :n] = range(n)
        dev = self.inputs.upload(5)[:, :n]
        self.attn.prepare(AttentionBatch(lens, lens, tables, 0, dev[_BLK], dev[_OFF]))
        self.staging.end_uploads()
        return self.model(dev[_IDS], dev[_POS], self.attn, dev[_LOGITS])

    def _warmup_lens(self, n: int) -> list[int]:
        longest = self.opts.max_model_len or self.model.cfg.max_position_embeddings
        return [min(longest, n - a) for a in range(0, n, longest)]

    # ---- CUDA graphs ----------------------------------------------------------------------------
    def graph_blocker(self, bucket: int, sync_guard: Callable[[], ContextManager]) -> str | None:
        """Run one bucket's padded decode forward eagerly under `sync_guard` (CUDA:
        torch.cuda.set_sync_debug_mode("error")), which raises on any host sync: a sync inside a
        capture invalidates it, and on torch < 2.12 a failed capture leaves the caching allocator
        believing a capture is underway (pytorch#180395). -> None if capture is safe, else why not.
        Also the warm-up each bucket needs before its capture."""
        if not getattr(self.attn, "graph_safe", False):
            return f"the {type(self.attn).__name__} module declares its decode path not graph-safe"
        self._prepare_bucket(bucket)
        try:
            with sync_guard(), torch.inference_mode():
                self._decode_forward(bucket)
        except RuntimeError as e:
            return f"the decode forward syncs with the host ({e})"
        return None

    def capture_graphs(self) -> None:
        """CUDA: capture each bucket's padded decode forward, largest first into one pool, after a
        sync-checked eager warm-up; a capture is only attempted once nothing can make it fail."""
        buckets = sorted(self.buckets, reverse=True)
        for b in buckets:
            why = self.graph_blocker(b, _cuda_sync_errors)
            if why is not None:
                log.warning("decode steps run eager (no CUDA graphs): %s", why)
                return
        torch.cuda.synchronize(self.device)
        with torch.inference_mode():
            first = self._decode_forward(buckets[0])  # None on tensor-parallel ranks other than 0
            self.graph_logits = first.clone() if first is not None else None
        stream = torch.cuda.current_stream(self.device)
        pool = torch.cuda.graph_pool_handle()
        for b in buckets:
            graph = torch.cuda.CUDAGraph()
            self._prepare_bucket(b)  # the attention metadata views of this bucket's shape
            try:
                with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
                    out = self._decode_forward(b)
                    if self.graph_logits is not None:
                        self.graph_logits[:b].copy_(out)
            except Exception as e:  # noqa: BLE001 - should not happen after the check above
                self._abandon_capture(pool, stream, e)
                return
            self.graphs[b] = graph
        log.info("captured decode CUDA graphs for batch sizes %s (%s)", sorted(self.graphs), type(self.attn).__name__)

    def _prepare_bucket(self, bucket: int) -> None:
        self._pad_rows(self._stage(bucket), 0, bucket)
        self._padded_upload(bucket, [], [])

    def _abandon_capture(self, pool, stream, e: Exception) -> None:
        """Graphs off. No empty_cache or new capture after this: on torch < 2.12 the allocator may
        still route to the pool; end that (private API, where it exists) and restore the stream."""
        log.warning("CUDA graph capture failed (%s: %s): decode steps run eager", type(e).__name__, e)
        self.failed_graphs, self.graphs = self.graphs, {}  # kept alive: no pool release mid-failure
        with contextlib.suppress(Exception):
            torch._C._cuda_endAllocateToPool(self.device.index or torch.cuda.current_device(), pool)
        torch.cuda.set_stream(stream)

    @staticmethod
    def _is_decode(s: ScheduledSeq) -> bool:
        return s.num_tokens == 1 and s.seq.num_computed_tokens > 0


@contextlib.contextmanager
def _cuda_sync_errors():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@dataclass
class MemoryProfile:
    activation_bytes: int  # peak above the resident state during the largest step
    graph_bytes: int       # what the decode CUDA graphs take
    graphs_ok: bool        # False: capture is not possible here (the real runner should not try)


def profile_memory(model: LlamaModel, layout: KVLayout, device: torch.device, opts: RunnerOptions) -> MemoryProfile:
    """CUDA (as nano-vLLM's warmup_model): run a max_num_batched_tokens prefill whose every row
    is a logits row, plus the sampler's prompt-logprob pass over them, on a runner with a cache
    just big enough, and measure the peak; then capture the decode graphs and measure them. The
    real runner is built afterwards, against the real cache (graphs bake in its address)."""
    if device.type != "cuda":
        return MemoryProfile(0, 0, True)
    n = opts.max_num_batched_tokens
    longest = opts.max_model_len or model.cfg.max_position_embeddings
    blocks = -(-n // layout.block_size) + -(-n // longest)  # each warm-up sequence may end mid-block
    probe = ModelRunner(model, layout, blocks, device, replace(opts, cuda_graphs=False))
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    logits = probe.warmup_prefill(n)
    Sampler.prompt_logprobs(logits, [0] * n, 1)
    del logits
    torch.cuda.synchronize(device)
    activation = torch.cuda.max_memory_allocated(device) - base
    graph_bytes, ok = 0, True
    if opts.cuda_graphs and issubclass(layout.backend, FlashAttention):
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(device)[0]
        probe.capture_graphs()
        torch.cuda.synchronize(device)
        graph_bytes, ok = max(free_before - torch.cuda.mem_get_info(device)[0], 0), bool(probe.graphs)
    failed = hasattr(probe, "failed_graphs")
    del probe
    gc.collect()
    if not failed:  # after a failed capture, leave the allocator alone
        torch.cuda.empty_cache()
    return MemoryProfile(activation, graph_bytes, ok)
