"""Model runner: owns the model, the device KV cache tensor and the attention backend; turns a
scheduler step into flat batch tensors and returns the logits of the sequences that sample.

Graph-ready: the step's token ids, positions, slots and logits rows live in persistent buffers
filled from host staging (pinned on CUDA) with one copy per step, and the forward itself never
reads back from the device. With the flash backend on CUDA, pure-decode steps replay CUDA graphs
captured at start-up for a few batch-size buckets (padded up to the bucket); the padded path is
the same code eagerly on CPU, which is how tests check it."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from nanoserve.layers.attention import AttentionBackend, AttentionBatch, TorchAttention
from nanoserve.layers.flash_attention import FlashAttention, Staged
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
    cuda_graphs: bool = False           # capture pure-decode graphs (CUDA + flash backend only)
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
        flash = layout.backend is FlashAttention
        # flash: one extra block past those the KV manager hands out, where padded rows go
        self.kv_cache = torch.zeros(layout.shape(num_blocks + flash), dtype=layout.dtype, device=device)
        self.max_tokens = max(opts.max_num_batched_tokens, opts.max_num_seqs)
        self.inputs = Staged((5, self.max_tokens), torch.long, device)  # ids, positions, slots, logits rows
        if flash:
            width = -(-model.cfg.max_position_embeddings // layout.block_size)
            self.attn: AttentionBackend = FlashAttention(
                self.kv_cache, model.num_heads, model.scale, flash=opts.flash_module,
                max_seqs=opts.max_num_seqs, max_blocks_per_seq=min(width, num_blocks), scratch_block=num_blocks)
        else:
            self.attn = TorchAttention(self.kv_cache, model.num_heads, model.scale,
                                       model.kernels)
        self.buckets = sorted(opts.graph_buckets or decode_buckets(opts.max_num_seqs)) if flash else []
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.steps_graphed = self.steps_eager = self.steps_padded = 0
        if flash and opts.cuda_graphs and device.type == "cuda":
            self._capture_graphs()

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[Sequence], list[PromptLogitRows]]:
        """Compute one step. Returns logits whose first S rows belong to the S sequences whose
        scheduled tokens reach their end (they sample next), in that order, followed by the rows
        that score prompt tokens for requests that asked for prompt logprobs."""
        # decodes first: both backends attend them together
        decodes = [s for s in scheduled if self._is_decode(s)]
        order = decodes + [s for s in scheduled if not self._is_decode(s)]
        bucket = self._bucket(len(decodes)) if len(decodes) == len(order) else None
        if bucket is not None and (bucket in self.graphs or self.opts.padded_decode):
            return self._run_padded_decode(order, bucket)
        bs = self.layout.block_size
        ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        query_lens, context_lens, tables = [], [], []
        logits_idx: list[int] = []
        samplers: list[Sequence] = []
        prompt_idx: list[int] = []
        prompt_rows: list[PromptLogitRows] = []
        for s in order:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_tokens
            ids.extend(seq.token_ids[start:start + n])
            pos = range(start, start + n)
            positions.extend(pos)
            table = seq.block_table
            slot_blocks.extend(table[p // bs] for p in pos)
            slot_offsets.extend(p % bs for p in pos)
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(table)
            if start + n == seq.num_tokens:
                logits_idx.append(len(ids) - 1)
                samplers.append(seq)
            if seq.wants_prompt_logprobs:  # position p scores token p + 1; skip ones already scored
                first = max(start, len(seq.prompt_logprobs) - 1)
                end = min(start + n, seq.num_prompt_tokens - 1)
                if end > first:
                    base = len(ids) - n - start
                    prompt_idx.extend(range(base + first, base + end))
                    prompt_rows.append(PromptLogitRows(seq, first + 1, end - first))
        n_tok, rows = len(ids), logits_idx + prompt_idx
        buf = self._stage(n_tok)
        buf[_IDS, :n_tok] = ids
        buf[_POS, :n_tok] = positions
        buf[_BLK, :n_tok] = slot_blocks
        buf[_OFF, :n_tok] = slot_offsets
        buf[_LOGITS, :len(rows)] = rows
        dev = self.inputs.upload(5)[:, :n_tok]
        self.attn.prepare(AttentionBatch(query_lens, context_lens, tables, len(decodes), dev[_BLK], dev[_OFF]))
        logits = self.model(dev[_IDS], dev[_POS], self.attn, dev[_LOGITS, :len(rows)])
        self.steps_eager += 1
        return logits, samplers, prompt_rows

    # ---- padded pure-decode steps (CUDA graph replay, or the same path eagerly) -----------------
    def _bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _run_padded_decode(self, decodes: list[ScheduledSeq], bucket: int):
        bs, n = self.layout.block_size, len(decodes)
        buf = self._stage(bucket)
        seqs = [s.seq for s in decodes]
        pos = [s.num_computed_tokens for s in seqs]
        buf[_IDS, :n] = [s.token_ids[p] for s, p in zip(seqs, pos)]
        buf[_POS, :n] = pos
        buf[_BLK, :n] = [s.block_table[p // bs] for s, p in zip(seqs, pos)]
        buf[_OFF, :n] = [p % bs for p in pos]
        self._pad_rows(buf, n, bucket)
        logits = self._padded_forward(bucket, [s.block_table for s in seqs], [p + 1 for p in pos])
        if bucket in self.graphs:
            self.steps_graphed += 1
        else:
            self.steps_eager += 1
        self.steps_padded += 1
        if (self.steps_graphed + self.steps_eager) % 1000 == 0 and self.graphs:
            log.info("decode CUDA graphs: %d of %d steps graphed", self.steps_graphed,
                     self.steps_graphed + self.steps_eager)
        return logits[:n], seqs, []

    def _pad_rows(self, buf, n: int, bucket: int) -> None:
        """Rows n..bucket: token 0 at position 0, written to the scratch block (never read by a
        real sequence); logits rows are 0..bucket-1, fixed."""
        buf[_IDS:_OFF + 1, n:bucket] = 0
        buf[_BLK, n:bucket] = self.kv_cache.shape[0] - 1
        buf[_LOGITS, :bucket] = range(bucket)

    def _padded_forward(self, bucket: int, tables: list[list[int]], context_lens: list[int]) -> torch.Tensor:
        n = len(tables)
        dev = self.inputs.upload(5)[:, :bucket]
        batch = AttentionBatch([1] * n, context_lens, tables, n, dev[_BLK], dev[_OFF])
        self.attn.prepare(batch, pad_to=bucket)
        if bucket in self.graphs:
            graph, out = self.graphs[bucket]
            graph.replay()
            return out
        return self.model(dev[_IDS], dev[_POS], self.attn, dev[_LOGITS])

    def _stage(self, n: int):
        if n > self.max_tokens:
            raise ValueError(f"a step of {n} tokens exceeds the runner's buffers ({self.max_tokens})")
        return self.inputs.np

    # ---- CUDA graphs (CUDA only: nothing below runs on CPU) -------------------------------------
    def _capture_graphs(self) -> None:
        """Capture each bucket's padded decode forward, largest first so smaller ones reuse its
        memory pool. If the installed flash-attn syncs inside flash_attn_with_kvcache (capture
        fails), decode through flash_attn_varlen_func instead; if that fails too, run eager."""
        for varlen in (False, True):
            self.attn.decode_with_varlen = varlen
            try:
                pool = None
                for b in sorted(self.buckets, reverse=True):
                    buf = self._stage(b)
                    self._pad_rows(buf, 0, b)
                    self._padded_forward(b, [], [])          # warm-up, eager
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
                        out = self.model(self.inputs.dev[_IDS, :b], self.inputs.dev[_POS, :b], self.attn,
                                         self.inputs.dev[_LOGITS, :b])
                    pool = graph.pool()
                    self.graphs[b] = (graph, out)
                log.info("captured decode CUDA graphs for batch sizes %s%s", sorted(self.graphs),
                         " (decode via flash_attn_varlen_func)" if varlen else "")
                return
            except RuntimeError as e:
                log.warning("CUDA graph capture failed%s: %s", " with flash_attn_varlen_func" if varlen else "", e)
                self.graphs.clear()
                torch.cuda.synchronize(self.device)
        self.attn.decode_with_varlen = False
        log.warning("decode steps run eager (no CUDA graphs)")

    @staticmethod
    def _is_decode(s: ScheduledSeq) -> bool:
        return s.num_tokens == 1 and s.seq.num_computed_tokens > 0


def probe_graph_memory(model: LlamaModel, layout: KVLayout, device: torch.device, opts: RunnerOptions) -> int:
    """CUDA: bytes the decode graphs take, measured by capturing them against a one-block cache
    and releasing them, so the KV cache is sized with that memory already counted. The real
    graphs are then captured against the real cache (the graphs bake in its address)."""
    if not (opts.cuda_graphs and device.type == "cuda" and layout.backend is FlashAttention):
        return 0
    torch.cuda.synchronize(device)
    free_before = torch.cuda.mem_get_info(device)[0]
    probe = ModelRunner(model, layout, 1, device, opts)
    torch.cuda.synchronize(device)
    used = free_before - torch.cuda.mem_get_info(device)[0]
    del probe
    torch.cuda.empty_cache()
    return max(used, 0)
