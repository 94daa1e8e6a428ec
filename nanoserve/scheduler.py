"""Continuous batching: each step gives every running sequence its next tokens (a decode token or
the next prefill chunk) within a token budget, then admits waiting sequences FCFS. When blocks
run out, the most recently admitted sequence is preempted: its blocks go back to the cache and it
waits again at the head of the queue, so resuming it is a prefix hit rather than a full recompute.

A sequence whose prefix is (partly) on host is admitted into `loading`: it holds its blocks while
the copy runs and joins the running batch in the first step after the copy completes; meanwhile
every other sequence keeps being scheduled (no convoy behind a load). If the copy failed, it goes
back to the head of the queue and recomputes.

With a host tier nothing here drops uncopied KV while saves can avoid it (kvcache/manager.py): a
running sequence whose blocks would have to come from dirty cached blocks sits out the step while
their saves run, and admission stops at the first request that would need them (FCFS), leaving
the running sequences one block each. Nothing here waits for a copy, except on CPU (`inline_loads`)
a bounded wait for a memcpy that lets an admission run in this step rather than the next.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanoserve.kvcache.manager import Admission, KVCacheManager, LoadState, Supply
from nanoserve.sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_preempted: int = 0


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 inline_loads: bool = False) -> None:
        """`inline_loads` (CPU): wait up to `inline_load_wait` for a new admission's host copy, or for
        the saves an admission was deferred for, and admit and run it in the same step; the copies
        are memcpys of a few ms on a worker thread, a step is tens of ms, and a copy slower than the
        wait joins a later step, so it costs the running requests that much once. On CUDA the copies
        overlap the step instead (no host-side wait in the step)."""
        self.kv = kv
        self.inline_loads = inline_loads
        self.inline_load_wait = 0.05
        self.inline_disk_wait = 0.1
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.kv.hash_prompt(seq)
        self.waiting.append(seq)

    def _promote_loaded(self) -> None:
        self.kv.poll_transfers()
        still: list[Sequence] = []
        for seq in self.loading:
            state = self.kv.load_state(seq)
            if state is LoadState.LOADING:
                still.append(seq)
            elif state is LoadState.READY:
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
            else:  # its prefix could not be loaded: recompute it
                self.kv.free(seq)
                seq.status = SeqStatus.WAITING
                self.waiting.appendleft(seq)
        self.loading = still

    def wait_for_transfers(self, timeout: float) -> None:
        """Nothing could be scheduled: block (up to `timeout`) on the oldest copy instead of
        spinning (a load someone waits for, or a save a deferred sequence needs)."""
        self.kv.wait_for_transfer(timeout)

    def next_step_kind(self) -> str:
        """'decode' when the coming step can only be one token per running sequence; 'mixed' when some
        prompt work may run in it (a running prefill, a prefix load in flight, or a waiting request
        with a free batch slot; scheduling may still defer it). Decided before the step, so a
        'decode' step is never one that did prefill work."""
        if self.loading or (self.waiting and len(self.running) < self.max_num_seqs):
            return "mixed"
        return "decode" if all(s.num_tokens - s.num_computed_tokens <= 1 for s in self.running) else "mixed"

    def kv_demand(self, lookahead: int = 8) -> int:
        """Device blocks the next step is expected to take beyond recent allocations: a block per
        running sequence, and what the next admissible waiting requests need (their host hits
        are allocated whole at admission)."""
        seats = min(lookahead, self.max_num_seqs - len(self.running) - len(self.loading))
        waiting = [self.waiting[i] for i in range(min(max(0, seats), len(self.waiting)))]
        return len(self.running) + sum(self.kv.demand_of(s, self.max_num_batched_tokens) for s in waiting)

    def schedule(self) -> SchedulerOutput:
        self._promote_loaded()
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        deferred = False
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending and seq.num_output_tokens + seq.num_pending >= seq.max_tokens:
                i += 1  # its last token is being sampled: nothing more to compute for it
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while (supply := self.kv.allocate_slots(seq, n)) is Supply.SHORT:
                victim = self.running.pop()
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                if supply is Supply.DEFER:  # its blocks are being saved: next step, without loss
                    deferred = True
                else:
                    out.scheduled.append(ScheduledSeq(seq, n))
                    budget -= n
                i += 1
        if out.num_preempted or deferred:
            return out  # memory is tight: admit nobody until the running set drains
        for second in (False, True):
            budget, reading = self._admit_waiting(out, budget)
            # CPU: every waiting prefix on disk is being read now; wait (briefly: the running requests wait
            # too) for the first read and admit what has landed in this step rather than the next
            if second or not (reading and self.inline_loads and budget > 0):
                break
            self.kv.complete_reads(self.inline_disk_wait)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """Admit waiting sequences in order while the budget and seats last; returns the budget left and
        whether any was passed over for its prefix being read from disk (the next ones may go first) while
        the rest fitted."""
        skipped: list[Sequence] = []
        reading = False
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.parent is not None and not (seq.parent.prompt_done or seq.parent.is_finished):
                skipped.append(self.waiting.popleft())  # n > 1: wait for the shared prompt's KV
                continue
            if seq.num_pending:  # preempted while a token was being sampled: back once it is known
                skipped.append(self.waiting.popleft())
                continue
            admission = self._admit(seq, budget)
            if admission is Admission.WAIT_FOR_DISK:
                skipped.append(self.waiting.popleft())
                reading = True
                continue
            if not admission:
                reading = False  # no room: waiting for a read would not admit anyone this step
                break
            self.waiting.popleft()
            if self.inline_loads and self.kv.load_state(seq) is LoadState.LOADING:
                self.kv.complete_loads(seq, self.inline_load_wait)
            if self.kv.load_state(seq) is not LoadState.READY:
                seq.status = SeqStatus.LOADING  # holds its blocks, takes no budget this step
                self.loading.append(seq)
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return budget, reading

    def _admit(self, seq: Sequence, budget: int) -> Admission:
        admission = self.kv.admit(seq, budget, reserve=len(self.running))
        if admission is Admission.WAIT_FOR_SAVES and self.inline_loads:
            # CPU: the saves it waits for are memcpys of a few ms; deferring costs it (and everyone queued
            # behind it) a whole step. Measured on docqa: 3 of 16 round-2 admissions deferred a step each.
            self.kv.complete_saves(self.inline_load_wait)
        else:
            return admission
        return self.kv.admit(seq, budget, reserve=len(self.running))

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence wherever it is and release its blocks (finished, aborted or failed)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.loading:
            self.loading.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SeqStatus.FINISHED

    def check_invariants(self) -> None:
        """KV accounting, and every block reference held by exactly one table entry."""
        self.kv.check_invariants()
        holders = self.running + self.loading
        in_tables = sum(len(s.block_table) for s in holders)
        refs = self.kv.held_references()
        assert refs == in_tables, f"ref counts {refs} != blocks held by running/loading sequences {in_tables}"
        assert all(not s.block_table for s in self.waiting), "waiting sequence holds blocks"
        assert all(self.kv.load_state(s) is LoadState.READY for s in self.running), "running before its load"
        assert all(s.status is SeqStatus.LOADING for s in self.loading)
