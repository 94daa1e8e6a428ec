"""Input staging: a step plan's per-token rows (token ids, positions, KV slot block and offset,
logits rows) written into one persistent device buffer from its host twin (layers/staging.py), one
copy per step, so a captured CUDA graph reads new inputs at fixed addresses."""
from __future__ import annotations

import torch

from nanoserve.layers.staging import Staging
from nanoserve.runner.step_plan import StepPlan

IDS, POS, BLK, OFF, LOGITS = range(5)  # the buffer's rows


class StepInputs:
    def __init__(self, staging: Staging, max_tokens: int, scratch_block: int) -> None:
        """`scratch_block`: where padding rows write their (never read) KV."""
        self.staging, self.max_tokens, self.scratch_block = staging, max_tokens, scratch_block
        self.rows = staging.buffer((5, max_tokens), torch.long)

    @property
    def dev(self) -> torch.Tensor:
        """The persistent device buffer (what a graph reads)."""
        return self.rows.dev

    def write(self, plan: StepPlan) -> None:
        """Stage the plan's rows; a padded plan (bucket set) gets rows up to its bucket: token 0,
        position 0, into the scratch block, and every row a logits row."""
        n, width = len(plan.ids), plan.bucket or len(plan.ids)
        if width > self.max_tokens:
            raise ValueError(f"a step of {width} tokens exceeds the runner's buffers ({self.max_tokens})")
        self.staging.begin_writes()  # the previous step's uploads have been read
        buf = self.rows.np
        buf[IDS, :n] = plan.ids
        buf[POS, :n] = plan.positions
        buf[BLK, :n] = plan.slot_blocks
        buf[OFF, :n] = plan.slot_offsets
        if plan.bucket is None:
            buf[LOGITS, :len(plan.logits_rows)] = plan.logits_rows
        else:
            buf[IDS:OFF + 1, n:width] = 0
            buf[BLK, n:width] = self.scratch_block
            buf[LOGITS, :width] = range(width)

    def upload(self, width: int) -> torch.Tensor:
        """Copy the staged rows to the device (async); the device view of the first `width` columns."""
        return self.rows.upload(5)[:, :width]
