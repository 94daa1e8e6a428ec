"""A scheduler step as plain data: per-token rows (ids, positions, KV slots), the rows whose logits
are wanted, and per-sequence attention metadata, decodes first. Pure Python, no tensors: a plan
crosses to the other tensor-parallel ranks, and each rank's runner stages and runs it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from nanoserve.sequence import Sequence


class ScheduledTokens(Protocol):
    """What the runner reads of a scheduled sequence: scheduler.ScheduledSeq, named structurally
    because the scheduler is a layer above the runner."""
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens


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
    # rows whose token a step still in flight is sampling (ids -1 there): from that step's sampled tokens,
    # row placeholder_rows[i] <- sampled[placeholder_from[i]]; empty once resolved on the host
    placeholder_rows: list[int] = field(default_factory=list)
    placeholder_from: list[int] = field(default_factory=list)

    def resolve(self, sampled: list[int]) -> None:
        """Put the sampled tokens in their rows (on the host: CPU, or a plan other ranks receive)."""
        for row, src in zip(self.placeholder_rows, self.placeholder_from):
            self.ids[row] = sampled[src]
        self.placeholder_rows, self.placeholder_from = [], []


class StepListener(Protocol):
    """Told about every step's plan before this rank runs it (the tensor-parallel leader sends it
    to the other ranks), and when the forward has returned."""
    def before(self, plan: StepPlan) -> None: ...
    def after(self) -> None: ...


def is_decode(s: ScheduledTokens) -> bool:
    """One token that samples, after others: not a prompt's one-token chunk cut short by the budget (a
    padded decode step samples every row)."""
    return s.num_tokens == 1 and 0 < s.seq.num_computed_tokens == s.seq.num_tokens - 1


def plan_step(order: list[ScheduledTokens], num_decodes: int, block_size: int,
              sample_rows: dict[int, int] | None = None
              ) -> tuple[StepPlan, list[Sequence], list[PromptLogitRows]]:
    """The plan of a step (`order`: decodes first), the sequences that sample (their logits rows
    come first, in this order), and the rows after those that score prompt tokens. `sample_rows`: seq id
    -> its row among the sampled tokens of the step in flight, for the tokens still being sampled."""
    bs = block_size
    plan = StepPlan([], [], [], [], [], [], [], [], num_decodes)
    samplers: list[Sequence] = []
    prompt_idx: list[int] = []
    prompt_rows: list[PromptLogitRows] = []
    for s in order:
        seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_tokens
        plan.ids.extend(seq.token_ids[start:start + n])
        if start + n > len(seq.token_ids):  # its last token is still being sampled
            plan.placeholder_rows.append(len(plan.ids))
            plan.placeholder_from.append((sample_rows or {})[seq.seq_id])
            plan.ids.append(-1)
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


def plan_padded_decode(decodes: list[ScheduledTokens], bucket: int, block_size: int,
                       sample_rows: dict[int, int] | None = None) -> StepPlan:
    """A pure-decode step padded to `bucket` rows (the runner's input staging fills the padding)."""
    bs = block_size
    seqs = [s.seq for s in decodes]
    pos = [s.num_computed_tokens for s in seqs]
    pending = [i for i, (s, p) in enumerate(zip(seqs, pos)) if p >= len(s.token_ids)]
    ids = [s.token_ids[p] if p < len(s.token_ids) else -1 for s, p in zip(seqs, pos)]
    return StepPlan(ids, pos, [s.block_table[p // bs] for s, p in zip(seqs, pos)], [p % bs for p in pos],
                    [], [1] * len(seqs), [p + 1 for p in pos], [s.block_table for s in seqs], len(seqs),
                    bucket, pending, [(sample_rows or {})[seqs[i].seq_id] for i in pending])


def plan_padding(bucket: int) -> StepPlan:
    """A padded decode step with no sequence in it: what graph capture and its warm-up run."""
    return StepPlan([], [], [], [], [], [], [], [], 0, bucket)


def plan_warmup_prefill(lens: list[int], block_size: int) -> StepPlan:
    """Fresh prefills of token 0 with these lengths in consecutive blocks from block 0, every row a
    logits row (the most one step can ask for: prompt logprobs)."""
    bs, tables, first = block_size, [], 0
    for m in lens:
        tables.append(list(range(first, first + -(-m // bs))))
        first += len(tables[-1])
    n = sum(lens)
    return StepPlan([0] * n, [p for m in lens for p in range(m)],
                    [t[p // bs] for t, m in zip(tables, lens) for p in range(m)],
                    [p % bs for m in lens for p in range(m)], list(range(n)), lens, lens, tables, 0)
