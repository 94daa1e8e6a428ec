"""Model runner: owns the model, the device KV cache tensor and the attention backend; turns a
scheduler step into a plan (step_plan.py), stages its inputs (step_inputs.py), runs the forward
and returns the logits of the sequences that sample.

Graph-ready: the step's token ids, positions, slots and logits rows live in persistent buffers
filled from host staging (pinned on CUDA, fenced by an event: layers/staging.py) with one copy per
step, and the forward itself never reads back from the device. With a paged backend (flash or
Triton) on CUDA, pure-decode steps replay CUDA graphs captured at start-up for a few batch-size
buckets (padded up to the bucket: decode_graphs.py); the padded path is the same code eagerly on
CPU, which is how tests check it."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch

from nanoserve.layers import hugepages
from nanoserve.layers.attention import AttentionBackend, AttentionBatch, TorchAttention
from nanoserve.layers.flash_attention import FlashAttention
from nanoserve.layers.staging import Staging
from nanoserve.models.llama import LlamaModel
from nanoserve.runner.decode_graphs import DecodeGraphs, decode_buckets
from nanoserve.runner.step_inputs import BLK, IDS, LOGITS, OFF, POS, StepInputs
from nanoserve.runner.step_plan import (PromptLogitRows, ScheduledTokens, StepListener, StepPlan, is_decode,
                                        plan_padded_decode, plan_padding, plan_step, plan_warmup_prefill)
from nanoserve.sequence import Sequence

log = logging.getLogger("nanoserve")


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
    flash_module: object | None = None  # flash-attn (or its reference); used iff layout.backend is
                                        # FlashAttention
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0              # sizes the graphs' block tables; 0 = the model's max positions
    cuda_graphs: bool = False           # capture pure-decode graphs (CUDA + a paged backend only)
    padded_decode: bool = False         # run pure-decode steps through the padded graph path even
                                        # without graphs (CPU tests of the replay path)
    graph_buckets: list[int] = field(default_factory=list)  # empty = default buckets up to max_num_seqs


def zeros_untouched(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros. On the CPU from an anonymous mapping on huge pages (layers/hugepages.py): resident only
    once written, where torch.zeros writes every byte (a 4 GiB KV budget would be 4 GiB of memory from
    start-up whatever the load), and a fresh block's first write costs one fault per 2 MiB, not per 4 KiB."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return hugepages.zeros(n).view(dtype).view(shape)


class ModelRunner:
    def __init__(self, model: LlamaModel, layout: KVLayout, num_blocks: int, device: torch.device,
                 opts: RunnerOptions | None = None) -> None:
        self.model = model
        self.layout = layout
        self.device = device
        self.opts = opts = opts or RunnerOptions()
        paged = issubclass(layout.backend, FlashAttention)  # flash or Triton: int32 paged metadata
        # paged: one extra block past those the KV manager hands out, where padded rows go
        self.kv_cache = zeros_untouched(layout.shape(num_blocks + paged), layout.dtype, device)
        self.max_tokens = max(opts.max_num_batched_tokens, opts.max_num_seqs)
        self.staging = Staging(device)
        self.inputs = StepInputs(self.staging, self.max_tokens, scratch_block=self.kv_cache.shape[0] - 1)
        windows = getattr(model, "windows", ())  # each layer's sliding window (Gemma 3); older models: none
        if paged:
            # graphs bake the table width (and flash-attn its split count) in: size it from the
            # longest sequence this engine admits, not the model's own maximum
            width = -(-(opts.max_model_len or model.cfg.max_position_embeddings) // layout.block_size)
            self.attn: AttentionBackend = layout.backend(
                self.kv_cache, model.num_heads, model.scale, flash=opts.flash_module,
                max_seqs=opts.max_num_seqs, max_blocks_per_seq=width, scratch_block=num_blocks,
                staging=self.staging, windows=windows)
        else:
            self.attn = TorchAttention(self.kv_cache, model.num_heads, model.scale,
                                       model.kernels, windows=windows)
        self.buckets = sorted(opts.graph_buckets or decode_buckets(opts.max_num_seqs)) if paged else []
        self.decode_graphs = DecodeGraphs(device, self.attn, self._prepare_bucket, self._decode_forward)
        self.steps_graphed = self.steps_eager = self.steps_padded = 0
        self.listener: StepListener | None = None
        if paged and opts.cuda_graphs and device.type == "cuda":
            self.capture_graphs()

    @property
    def graphs(self) -> dict[int, torch.cuda.CUDAGraph]:
        """The captured buckets (bench/gpu_check.py swaps in {} to time eager decode steps)."""
        return self.decode_graphs.graphs

    @graphs.setter
    def graphs(self, graphs: dict[int, torch.cuda.CUDAGraph]) -> None:
        self.decode_graphs.graphs = graphs

    def plan(self, scheduled: list[ScheduledTokens], sample_rows: dict[int, int] | None = None
             ) -> tuple[StepPlan, list[Sequence], list[PromptLogitRows]]:
        """`sample_rows`: where the tokens still being sampled come from (runner/step_plan.py)."""
        # decodes first: both backends attend them together
        decodes = [s for s in scheduled if is_decode(s)]
        order = decodes + [s for s in scheduled if not is_decode(s)]
        bucket = self._bucket(len(decodes)) if len(decodes) == len(order) else None
        if bucket is not None and (bucket in self.graphs or self.opts.padded_decode):
            plan = plan_padded_decode(order, bucket, self.layout.block_size, sample_rows)
            return plan, [s.seq for s in order], []
        return plan_step(order, len(decodes), self.layout.block_size, sample_rows)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, sampled: torch.Tensor | None = None) -> torch.Tensor | None:
        """The forward of a plan (on every tensor-parallel rank); logits on rank 0, None elsewhere.
        `sampled`: the tokens the step before sampled, on the device, for the plan's placeholder rows
        (a step launched before that one's tokens reached the host)."""
        if plan.bucket is not None:
            return self._run_padded_decode(plan, sampled)
        logits = self._forward(plan, sampled)
        self.steps_eager += 1
        return logits

    def _fill_placeholders(self, plan: StepPlan, dev: torch.Tensor, sampled: torch.Tensor | None) -> None:
        """The placeholder rows' token ids from the device-resident sampled tokens (no host round trip)."""
        if plan.placeholder_rows:
            assert sampled is not None, "a plan with placeholders needs the step before's sampled tokens"
            rows = torch.tensor(plan.placeholder_rows, dtype=torch.long).to(dev.device, non_blocking=True)
            src = torch.tensor(plan.placeholder_from, dtype=torch.long).to(sampled.device, non_blocking=True)
            dev[IDS].index_copy_(0, rows, sampled.index_select(0, src).to(dev.dtype))

    def _forward(self, plan: StepPlan, sampled: torch.Tensor | None = None) -> torch.Tensor | None:
        self.inputs.write(plan)
        dev = self.inputs.upload(len(plan.ids))
        self._fill_placeholders(plan, dev, sampled)
        self.attn.prepare(AttentionBatch(plan.query_lens, plan.context_lens, plan.tables, plan.num_decodes,
                                         dev[BLK], dev[OFF]))
        self.staging.end_uploads()
        return self.model(dev[IDS], dev[POS], self.attn, dev[LOGITS, :len(plan.logits_rows)])

    # ---- padded pure-decode steps (CUDA graph replay, or the same path eagerly) -----------------
    def _bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _run_padded_decode(self, plan: StepPlan, sampled: torch.Tensor | None = None) -> torch.Tensor | None:
        n, bucket = len(plan.ids), plan.bucket
        self.inputs.write(plan)
        self._padded_upload(bucket, plan.tables, plan.context_lens)
        self._fill_placeholders(plan, self.inputs.dev, sampled)
        if bucket in self.graphs:
            logits = self.decode_graphs.replay(bucket)
            self.steps_graphed += 1
        else:
            logits = self._decode_forward(bucket)
            self.steps_eager += 1
        self.steps_padded += 1
        if (total := self.steps_graphed + self.steps_eager) % 1000 == 0 and self.graphs:
            log.info("decode CUDA graphs: %d of %d steps graphed", self.steps_graphed, total)
        return logits[:n] if logits is not None else None

    def _padded_upload(self, bucket: int, tables: list[list[int]], context_lens: list[int]) -> None:
        n = len(tables)
        dev = self.inputs.upload(bucket)
        self.attn.prepare(AttentionBatch([1] * n, context_lens, tables, n, dev[BLK], dev[OFF]), pad_to=bucket)
        self.staging.end_uploads()

    def _prepare_bucket(self, bucket: int) -> None:
        self.inputs.write(plan_padding(bucket))
        self._padded_upload(bucket, [], [])

    def _decode_forward(self, bucket: int) -> torch.Tensor | None:
        """What a graph captures: reads only persistent device buffers."""
        dev = self.inputs.dev
        return self.model(dev[IDS, :bucket], dev[POS, :bucket], self.attn, dev[LOGITS, :bucket])

    # ---- start-up: memory profile and CUDA graphs -----------------------------------------------
    @torch.inference_mode()
    def warmup_prefill(self, n: int) -> torch.Tensor:
        """A fresh prefill of n tokens in which every row is a logits row (the most one step can
        ask for: prompt logprobs), for the memory profile; split into sequences no longer than
        max_model_len, in consecutive blocks from block 0 (memory_profile.py sizes a runner for it)."""
        return self._forward(plan_warmup_prefill(self._warmup_lens(n), self.layout.block_size))

    def _warmup_lens(self, n: int) -> list[int]:
        longest = self.opts.max_model_len or self.model.cfg.max_position_embeddings
        return [min(longest, n - a) for a in range(0, n, longest)]

    def graph_blocker(self, bucket: int, sync_guard: Callable[[], ContextManager]) -> str | None:
        """None if a bucket's decode forward can be captured, else why not (DecodeGraphs.blocker)."""
        return self.decode_graphs.blocker(bucket, sync_guard)

    def capture_graphs(self) -> None:
        self.decode_graphs.capture(self.buckets)
