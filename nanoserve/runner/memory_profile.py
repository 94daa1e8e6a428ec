"""CUDA start-up measurement of what the KV cache must leave free: the largest step's activations
and the decode CUDA graphs, measured on a throw-away runner (as nano-vLLM's warmup_model)."""
from __future__ import annotations

import gc
from dataclasses import dataclass, replace

import torch

from nanoserve.layers.flash_attention import FlashAttention
from nanoserve.layers.sampler import Sampler
from nanoserve.models.llama import LlamaModel
from nanoserve.runner.model_runner import KVLayout, ModelRunner, RunnerOptions


@dataclass
class MemoryProfile:
    activation_bytes: int  # peak above the resident state during the largest step
    graph_bytes: int       # what the decode CUDA graphs take
    graphs_ok: bool        # False: capture is not possible here (the real runner should not try)


def profile_memory(model: LlamaModel, layout: KVLayout, device: torch.device,
                   opts: RunnerOptions) -> MemoryProfile:
    """CUDA: run a max_num_batched_tokens prefill whose every row is a logits row, plus the
    sampler's prompt-logprob pass over them, on a runner with a cache just big enough, and measure
    the peak; then capture the decode graphs and measure them. The real runner is built
    afterwards, against the real cache (graphs bake in its address)."""
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
    failed = probe.decode_graphs.failed is not None
    del probe
    gc.collect()
    if not failed:  # after a failed capture, leave the allocator alone
        torch.cuda.empty_cache()
    return MemoryProfile(activation, graph_bytes, ok)
