"""GGUF tensors as the model loads them when they stay quantized: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K
matrices as their raw blocks (memory-mapped by the gguf package's reader: nothing is converted, nothing
copied; the K-quants only where their kernels built: kernels/cpu_kernels.keeps), 1-D and float tensors
as fp32, every other quantized type dequantized here (logged once, by name).

A GGUF folder made by `loader.materialize(..., dequantize=False)` holds the config and tokenizer
and `model.gguf`, a link to the file itself."""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from nanoserve.kernels.cpu_kernels import keeps
from nanoserve.layers.quant_linear import TYPE_NAMES, QuantTensor

log = logging.getLogger("nanoserve")


def iter_gguf(path: Path, cfg, names: dict[str, str]) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """(HF name, weight) for every tensor of the file; `names` maps GGUF names to HF ones."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from nanoserve.models.gguf_reader import WeightsReader
    reader = WeightsReader(str(path), "c")  # copy-on-write map: writable for torch, never written
    reader.release(0, reader.data_offset)  # the metadata: parsed, not read again
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    converted: Counter[str] = Counter()
    for t in reader.tensors:
        if (name := names.get(t.name)) is None:
            raise ValueError(f"GGUF tensor {t.name!r} is not one this model loads")
        qtype = int(t.tensor_type)
        kept = t.data.ndim == 2 and keeps(qtype)
        if kept:  # [rows, row bytes]: the logical shape is GGUF's reversed
            w: torch.Tensor = torch.from_numpy(t.data)
        else:
            if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                                     GGMLQuantizationType.BF16):
                converted[t.tensor_type.name] += 1
            w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        # llama.cpp's converter permutes the rows of Q and K of *llama* models for its interleaved
        # rope; undo it for rotate-half (a permutation of whole rows: the same on blocks)
        permuted = cfg.model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight"))
        if permuted:
            n = heads if name.endswith("q_proj.weight") else kv_heads
            w = w.reshape(n, w.shape[0] // n // 2, 2,
                          *w.shape[1:]).transpose(2, 1).reshape(w.shape).contiguous()
        if permuted or not kept:  # copied out: the map's pages of it would stay resident unread
            reader.release(t.data_offset, t.data_offset + t.n_bytes)
        if kept:
            yield name, QuantTensor(w, qtype, (int(t.shape[1]), int(t.shape[0])))
        else:
            yield name, w
    if converted:
        kept_names = ", ".join(n for n in TYPE_NAMES.values() if n not in converted)
        log.info("GGUF %s: dequantized at load (kept quantized: %s): %s", path.name, kept_names,
                 ", ".join(f"{k} ({n} tensors)" for k, n in sorted(converted.items())))
