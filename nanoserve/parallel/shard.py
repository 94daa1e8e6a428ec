"""What every tensor-parallel rank builds the same way, rank 0 (the engine) and the others alike:
its shard of the model, the attention backend, the device KV cache (the same block count on
every rank: the smallest any rank can hold) and the runner. One function, so the ranks cannot
drift apart, and the collectives inside it (the block count, CUDA's memory profile) line up."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from nanoserve.config import EngineConfig
from nanoserve.distributed.parallel import TensorParallel
from nanoserve.kvcache.host_tier import host_memory_available
from nanoserve.kernels import cpu_kernels
from nanoserve.layers.backend_choice import resolve_attention
from nanoserve.models.llama import LlamaModel
from nanoserve.models.loader import ModelSource, iter_weights
from nanoserve.models.weight_layers import replace_linears
from nanoserve.runner.memory_profile import profile_memory
from nanoserve.runner.model_runner import KVLayout, ModelRunner, RunnerOptions

log = logging.getLogger("nanoserve")
GiB = 1 << 30


@dataclass
class ModelShard:
    model: LlamaModel
    layout: KVLayout
    runner: ModelRunner
    num_blocks: int
    max_model_len: int


@dataclass
class Phase:
    what: str = ""  # said in the phase's log line, set by its body


@contextmanager
def startup_phase(name: str, quiet: bool = False) -> Iterator[Phase]:
    """One log line for a start-up phase, with its time (`quiet` for the tensor-parallel ranks but
    rank 0: they build the same); a phase that raises logs nothing, its error says enough."""
    phase, t0 = Phase(), time.monotonic()
    yield phase
    if not quiet:
        log.info("%s: %s in %.1fs", name, phase.what, time.monotonic() - t0)


def build_shard(config: EngineConfig, source: ModelSource, hf_config, device: torch.device,
                dtype: torch.dtype, tp: TensorParallel) -> ModelShard:
    quiet = tp.rank != 0
    # a missing build is made (and announced) before the weights' wait, not inside it
    if device.type == "cpu":
        cpu_kernels.prepare()
    with startup_phase("weights", quiet) as phase:
        model = LlamaModel(hf_config, dtype, device, tp)
        if config.load_format == "dummy":  # benchmarks: random weights made on the device, nothing read
            model.init_dummy(config.seed + tp.rank)
            phase.what = f"{source.name}, random (--load-format dummy)"
        else:
            model.load_weights(iter_weights(source, progress=tp.rank == 0))
            phase.what = f"{source.name} read from {source.path}"
    with startup_phase("kernels", quiet) as phase:
        kernels = cpu_kernels.load() if device.type == "cpu" else None
        quant = _quant_kernels(device) if model.quantized else None
        model.finalize(kernels, quant)
        if config.quantization == "fp8":
            from nanoserve.layers.triton_quant import fp8_maker
            replace_linears(model, fp8_maker(device))
        backend, flash, block_size = resolve_attention(config.attention_backend, device, dtype,
                                                       config.block_size, config.flash_attn_module)
        phase.what = _kernels_chosen(config, device, backend.__name__, quant is not None)
    with startup_phase("KV cache", quiet) as phase:
        layout = KVLayout(model.num_layers, block_size, model.num_kv_heads, model.head_dim, dtype, backend)
        opts = RunnerOptions(flash, config.max_num_seqs, config.step_tokens,
                             max_model_len=config.max_model_len or 0, cuda_graphs=not config.enforce_eager)
        num_blocks = tp.min_over_ranks(_num_device_blocks(config, model, layout, device, opts, tp.size))
        max_model_len = _max_model_len(config, hf_config.max_position_embeddings, num_blocks * block_size)
        opts.max_model_len = max_model_len
        runner = ModelRunner(model, layout, num_blocks, device, opts)
        phase.what = (f"{num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} tokens, "
                      f"{num_blocks * layout.bytes_per_block * tp.size / GiB:.2f} GiB on {device.type}, "
                      f"max_model_len {max_model_len}{'' if config.host_cache_gb else ', host tier off'}")
    return ModelShard(model, layout, runner, num_blocks, max_model_len)


def _kernels_chosen(config: EngineConfig, device: torch.device, attention: str, quant: bool) -> str:
    """What computes: on CPU the kernels kernels/cpu_kernels.py chose for this CPU (the attention backend
    class runs them), on CUDA the attention backend and what GGUF blocks and fp8 weights run on."""
    if device.type == "cpu":
        return cpu_kernels.describe()  # what the attention backend and the linear layers call on CPU
    linear = "fp8 Triton" if config.quantization == "fp8" else "GGUF blocks Triton" if quant else "torch"
    return f"attention {attention}, linear {linear}"


def _quant_kernels(device: torch.device):
    """The kernels GGUF blocks stay quantized with: C++ on CPU, Triton on CUDA (layers/triton_quant.py);
    None (the blocks dequantized at load) where they are missing."""
    if device.type == "cpu":
        return cpu_kernels.quant()
    try:
        from nanoserve.layers.triton_quant import triton_quant
    except ImportError as e:
        log.warning("no Triton (%s): GGUF blocks are dequantized at load", e)
        return None
    return triton_quant(device)


def _num_device_blocks(config: EngineConfig, model: LlamaModel, layout: KVLayout, device: torch.device,
                       opts: RunnerOptions, ranks: int) -> int:
    """This rank's block count. Budgets given in GiB are for all ranks together: each holds its
    heads' slice of every block."""
    per_block = layout.bytes_per_block
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if config.kv_cache_gb is not None:
        budget = config.kv_cache_gb * GiB / ranks
    elif device.type == "cuda":
        # the largest step's activations and the decode graphs, measured (runner/memory_profile.py)
        prof = profile_memory(model, layout, device, opts)
        opts.cuda_graphs = opts.cuda_graphs and prof.graphs_ok  # the real runner would fail the same way
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - config.gpu_memory_utilization) * total - prof.activation_bytes - prof.graph_bytes
        log.info("profiled: %.2f GiB activations at %d tokens per step, %.2f GiB decode graphs",
                 prof.activation_bytes / GiB, opts.max_num_batched_tokens, prof.graph_bytes / GiB)
    else:
        budget = min(4 * GiB, 0.2 * host_memory_available()) / ranks
    blocks = int(budget // per_block)
    if blocks < 1:
        raise ValueError(f"KV cache budget {budget / GiB:.3f} GiB holds no block "
                         f"({per_block / GiB:.4f} GiB each); raise --kv-cache-gb")
    return blocks


def _max_model_len(config: EngineConfig, model_max: int, kv_tokens: int) -> int:
    """An explicit length the model or the KV cache cannot hold refuses to start (as vLLM
    does); the model's own length is capped by the KV capacity with a warning."""
    asked = config.max_model_len
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


def host_blocks(config: EngineConfig, layout: KVLayout, ranks: int) -> int:
    """Blocks of the host tier (0 = off): --host-cache-gb is for all ranks together, each rank
    pinning its slice of every block."""
    gb = config.host_cache_gb
    if not gb:
        return 0
    available = host_memory_available()
    if gb * GiB / ranks > available:
        raise ValueError(f"--host-cache-gb {gb} asks for more than this machine has available "
                         f"({available / GiB:.1f} GiB)")
    blocks = int(gb * GiB / ranks // layout.bytes_per_block)
    if blocks < 1:
        raise ValueError(f"--host-cache-gb {gb} holds no block "
                         f"({layout.bytes_per_block * ranks / GiB:.4f} GiB each)")
    return blocks


def check_memory(config: EngineConfig, device: torch.device) -> None:
    """Refuse budgets that cannot fit before a weight is read (on CPU the device KV cache and the host
    tier are both host memory). The budgets are for all ranks: each node holds its share of them."""
    kv = 0.0 if config.num_kv_blocks else config.kv_cache_gb or 0.0
    asked = {"--kv-cache-gb": kv if device.type == "cpu" else 0.0, "--host-cache-gb": config.host_cache_gb}
    asked = {flag: gb for flag, gb in asked.items() if gb}
    need, available = sum(asked.values()) * GiB / config.nnodes, host_memory_available()
    if need > available:
        raise ValueError(f"{' + '.join(f'{flag} {gb:g}' for flag, gb in asked.items())} "
                         f"ask{'' if len(asked) > 1 else 's'} for {need / GiB:.1f} GiB of host memory"
                         f"{' per node' if config.nnodes > 1 else ''}, more than this machine has available "
                         f"({available / GiB:.1f} GiB)")
    per_gpu = kv / config.tensor_parallel_size
    if device.type == "cuda" and kv and per_gpu * GiB > (free := torch.cuda.mem_get_info(device)[0]):
        raise ValueError(f"--kv-cache-gb {kv:g} asks for {per_gpu:.1f} GiB per GPU; this GPU has "
                         f"{free / GiB:.1f} GiB free")
