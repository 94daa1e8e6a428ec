"""Batched sampling with per-request parameters. Logprobs are the model's raw distribution
(before penalties and temperature), as vLLM returns them by default."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.sequence import Sequence, TokenLogprob


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> None:
    """In place on one row [V]: repetition (prompt + output), frequency and presence (output)."""
    p = seq.params
    vocab = logits.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(t for t in seq.token_ids if t < vocab)), dtype=torch.long,
                            device=logits.device)
        vals = logits[seen]
        # a tiny penalty would push logits to +-inf and softmax to NaN: keep them finite
        big = torch.finfo(logits.dtype).max
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                   vals * p.repetition_penalty).clamp(-big, big)
    if (p.frequency_penalty or p.presence_penalty) and seq.num_output_tokens:
        out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        # generators live on the logits' device: exponential_() refuses a generator from another
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @torch.inference_mode()  # penalties and biases edit the runner's (inference) logits in place
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        logits = logits.float()
        want_lp = [s.params.logprobs is not None for s in seqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        logits = self._process(logits, seqs)
        tokens = self._choose(logits, seqs)
        lps: list[TokenLogprob | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            for i, s in enumerate(seqs):
                if want_lp[i]:
                    lps[i] = self._logprob(raw_logprobs[i], tokens[i], s.params.logprobs)
        return SampleResult(tokens, lps)

    @staticmethod
    @torch.inference_mode()
    def prompt_logprobs(logits: torch.Tensor, targets: list[int], top_n: int) -> list[TokenLogprob]:
        """Logprob of each target token under its row of logits, with the top-N alternatives."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        return [Sampler._logprob(row, t, top_n) for row, t in zip(lp, targets)]

    @staticmethod
    def _logprob(row: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
        top: list[tuple[int, float]] = []
        if top_n:
            vals, idx = row.topk(top_n)
            top = list(zip(idx.tolist(), vals.tolist()))
        return TokenLogprob(token, float(row[token]), top)

    def _process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        for i, s in enumerate(seqs):
            p = s.params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long, device=logits.device)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype,
                                               device=logits.device)
            if s.num_output_tokens < p.min_tokens:
                banned = [t for t in set(p.stop_token_ids) | (set() if p.ignore_eos else s.eos_token_ids)
                          if t < logits.shape[-1]]
                if banned:
                    logits[i, banned] = float("-inf")
            if p.needs_penalties:
                apply_penalties(logits[i], s)
        return logits

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        greedy = [s.params.greedy for s in seqs]
        if all(greedy):
            return logits.max(dim=-1).indices.tolist()  # first maximum, like argmax, ~3x faster on CPU
        dev = logits.device
        temps = torch.tensor([1.0 if g else s.params.temperature for g, s in zip(greedy, seqs)],
                             device=dev).unsqueeze(1)
        logits = logits / temps
        top_k = [s.params.top_k for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            vocab = logits.shape[-1]
            ks = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=dev).unsqueeze(1)
            ranks = torch.arange(vocab, device=dev).unsqueeze(0)
            drop = ranks >= ks
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # drop a token if the tokens ranked above it already reach top_p (the best is always kept)
            ps = torch.tensor(top_p, device=dev).unsqueeze(1)
            drop |= (probs.cumsum(dim=-1) - probs) >= ps
            drop[:, 0] = False  # a top_p that underflows to 0 must still keep the best token
            logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([s.params.min_p for s in seqs], device=dev).unsqueeze(1)
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        # Sampling by exponential race: argmax(p / E), E ~ Exp(1), one draw per row; seeded rows
        # draw from their own generator so their outputs do not depend on the rest of the batch.
        noise = torch.empty_like(probs)
        for i, s in enumerate(seqs):
            noise[i].exponential_(generator=s.generator or self.generator)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # p / 0 would let a masked (p = 0) token win
        sampled = (probs / noise).argmax(dim=-1)
        greedy_t = torch.tensor(greedy, device=dev)
        return torch.where(greedy_t, logits.max(dim=-1).indices, sampled).tolist()
