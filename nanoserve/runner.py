"""Model runner: owns the model, the device KV cache tensor and the attention backend; turns a
scheduler step into flat batch tensors and returns the logits of the sequences that sample."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.layers.attention import AttentionBackend, AttentionBatch, TorchAttention
from nanoserve.models.llama import LlamaModel
from nanoserve.scheduler import ScheduledSeq
from nanoserve.sequence import Sequence


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


class ModelRunner:
    def __init__(self, model: LlamaModel, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        self.model = model
        self.layout = layout
        self.device = device
        self.kv_cache = torch.zeros(layout.shape(num_blocks), dtype=layout.dtype, device=device)
        self.attn: AttentionBackend = layout.backend(self.kv_cache, model.num_heads, model.scale)

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[Sequence], list[PromptLogitRows]]:
        """Compute one step. Returns logits whose first S rows belong to the S sequences whose
        scheduled tokens reach their end (they sample next), in that order, followed by the rows
        that score prompt tokens for requests that asked for prompt logprobs."""
        # decodes first: the torch backend attends them with one batched call
        decodes = [s for s in scheduled if self._is_decode(s)]
        order = decodes + [s for s in scheduled if not self._is_decode(s)]
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
        dev = self.device
        batch = AttentionBatch(query_lens, context_lens, tables, len(decodes),
                               torch.tensor(slot_blocks, dtype=torch.long, device=dev),
                               torch.tensor(slot_offsets, dtype=torch.long, device=dev))
        self.attn.prepare(batch)
        logits = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), self.attn,
                            torch.tensor(logits_idx + prompt_idx, dtype=torch.long, device=dev))
        return logits, samplers, prompt_rows

    @staticmethod
    def _is_decode(s: ScheduledSeq) -> bool:
        return s.num_tokens == 1 and s.seq.num_computed_tokens > 0
