"""Model resolution: short names, the local store, .gguf paths, the embedded default."""
from __future__ import annotations

import json

import pytest

from nanoserve.models.loader import EMBEDDED_GGUF, materialize, resolve_model


def test_short_name_resolves_from_local_store(tiny_path, tmp_path, monkeypatch):
    tiny_model = tiny_path("llama-gqa-tied")  # any folder: resolution does not read it
    (tmp_path / "registry.json").write_text(json.dumps({"tiny-llama": {"repo": "example-org/tiny-llama"}}))
    (tmp_path / "tiny-llama").symlink_to(tiny_model, target_is_directory=True)
    monkeypatch.setenv("NANOSERVE_MODELS_DIR", str(tmp_path))
    src = resolve_model("tiny-llama")
    assert src.path == tmp_path / "tiny-llama" and src.gguf_file is None


def test_embedded_default_and_gguf_path(tmp_path, monkeypatch):
    default = resolve_model(None)
    assert default.gguf_file == EMBEDDED_GGUF
    by_path = resolve_model(str(default.path / default.gguf_file))
    assert (by_path.path, by_path.gguf_file) == (default.path, default.gguf_file)
    # nothing in the HF cache: the short name must fall back to the embedded GGUF
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))
    by_name = resolve_model("smollm2-135m-instruct")
    assert (by_name.path, by_name.gguf_file) == (default.path, EMBEDDED_GGUF)
    folder = materialize(default).path
    assert (folder / "config.json").exists() and (folder / "model.safetensors").exists()
    weights = folder / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert materialize(default).path == folder and weights.stat().st_mtime_ns == stamp  # converted once


def _write_gguf(path, arch: str, tensors: dict, heads: int, kv_heads: int) -> None:
    """A GGUF file as llama.cpp's converter lays it out: llama Q/K rows permuted for interleaved
    rope, qwen2 (NeoX rope) left as is."""
    import numpy as np
    from gguf import GGUFWriter
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_context_length(64)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(32)
    for name, t in tensors.items():
        a = t.numpy()
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            n = heads if kind == "attn_q" else kv_heads
            a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_qk_layout_restored_per_architecture(tmp_path, arch):
    import torch

    from nanoserve.models.loader import _gguf_config, _gguf_weights
    torch.manual_seed(0)
    heads, kv_heads, hd = 2, 1, 4
    shapes = {"token_embd.weight": (32, 8), "output_norm.weight": (8,), "output.weight": (32, 8),
              "blk.0.attn_norm.weight": (8,), "blk.0.ffn_norm.weight": (8,),
              "blk.0.attn_q.weight": (heads * hd, 8), "blk.0.attn_k.weight": (kv_heads * hd, 8),
              "blk.0.attn_v.weight": (kv_heads * hd, 8), "blk.0.attn_output.weight": (8, heads * hd),
              "blk.0.ffn_gate.weight": (16, 8), "blk.0.ffn_up.weight": (16, 8),
              "blk.0.ffn_down.weight": (8, 16)}
    if arch == "qwen2":
        shapes.update({"blk.0.attn_q.bias": (heads * hd,), "blk.0.attn_k.bias": (kv_heads * hd,),
                       "blk.0.attn_v.bias": (kv_heads * hd,)})
    original = {k: torch.randn(v) for k, v in shapes.items()}
    f = tmp_path / f"{arch}.gguf"
    _write_gguf(f, arch, original, heads, kv_heads)
    cfg = _gguf_config(f)
    assert cfg.model_type == arch and cfg.num_key_value_heads == kv_heads
    loaded = dict(_gguf_weights(f, cfg))
    hf = {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
          "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
          "blk.0.attn_q.bias": "model.layers.0.self_attn.q_proj.bias",
          "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
          "token_embd.weight": "model.embed_tokens.weight"}
    for g, name in hf.items():
        if g in original:
            assert torch.equal(loaded[name], original[g]), (arch, name)


def test_weight_table_refuses_incomplete_unknown_and_misshapen_checkpoints():
    import torch
    import transformers
    from nanoserve.models.llama import LlamaModel
    cfg = transformers.Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaModel(cfg, torch.float32, torch.device("cpu"))
    state = transformers.Qwen2ForCausalLM(cfg).state_dict()
    model.load_weights(state.items())  # complete: biases, fused q/k/v and gate/up slices, untied head
    assert torch.equal(model.layers[1].qkv_bias[64:96], state["model.layers.1.self_attn.k_proj.bias"])
    with pytest.raises(ValueError, match="incomplete: 2 of 27"):
        model.load_weights((k, v) for k, v in state.items() if "down_proj" not in k)
    with pytest.raises(ValueError, match="unexpected weight"):
        model.load_weights([("model.layers.0.mlp.extra.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="has shape"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])


def test_generic_tokenizer_loads_as_autotokenizer_would(embedded_dir):
    """load_tokenizer skips AutoTokenizer (it imports torch) where the folder names the generic fast
    class: the result must be the tokenizer AutoTokenizer gives, token for token and template for template."""
    from transformers import AutoTokenizer
    from nanoserve.models.loader import GENERIC_TOKENIZERS, ModelSource, load_tokenizer
    assert json.loads((embedded_dir / "tokenizer_config.json").read_text())["tokenizer_class"] in \
        GENERIC_TOKENIZERS
    ours, auto = (load_tokenizer(ModelSource("embedded", embedded_dir)),
                  AutoTokenizer.from_pretrained(embedded_dir))
    assert type(ours) is type(auto)
    for text in ("Hello, world!", "<|im_start|>user\nünïcode 😀 code:\n\tdef f(): pass<|im_end|>", ""):
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == \
        (auto.eos_token_id, auto.bos_token_id, len(auto))


def _gemma3_header(path, **extra) -> None:
    """A Gemma 3 GGUF file's metadata (no tensors: the config reads the header alone)."""
    from gguf import GGUFWriter
    w = GGUFWriter(str(path), "gemma3")
    for key, value in dict(block_count=12, embedding_length=64, feed_forward_length=128, context_length=512,
                           vocab_size=300, **{"attention.head_count": 4, "attention.head_count_kv": 2,
                                              "attention.key_length": 32, "attention.value_length": 32,
                                              "attention.layer_norm_rms_epsilon": 1e-6,
                                              "attention.sliding_window": 16, "rope.freq_base": 1e6},
                           **extra).items():
        (w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float)
         else w.add_uint32)(f"gemma3.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_gemma3_config_is_what_llama_cpp_completes(tmp_path):
    """Every 6th layer global, the local RoPE base 10000 unscaled while the global layers take the file's
    linear scaling (Gemma 3 4B-27B files carry one); a scaling type we do not apply is refused."""
    from nanoserve.models.loader import _gguf_config
    from nanoserve.models.model_config import ModelConfig
    from nanoserve.sampling_params import InvalidRequest
    _gemma3_header(tmp_path / "plain.gguf")
    plain = ModelConfig.from_dict(_gguf_config(tmp_path / "plain.gguf").to_dict())
    assert plain.layer_windows == (16,) * 5 + (0,) + (16,) * 5 + (0,)
    assert (plain.rope_theta, plain.rope_local_theta, plain.rope_scaling) == (1e6, 10000.0, None)
    assert plain.query_pre_attn_scalar == 32 and plain.gemma and plain.qk_norm
    _gemma3_header(tmp_path / "scaled.gguf", **{"rope.scaling.type": "linear", "rope.scaling.factor": 8.0})
    scaled = ModelConfig.from_dict(_gguf_config(tmp_path / "scaled.gguf").to_dict())
    assert scaled.rope_scaling["rope_type"] == "linear" and scaled.rope_scaling["factor"] == 8.0
    assert (scaled.rope_theta, scaled.rope_local_theta) == (1e6, 10000.0)
    _gemma3_header(tmp_path / "yarn.gguf", **{"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0})
    with pytest.raises(InvalidRequest, match="rope scaling 'yarn' is not supported"):
        _gguf_config(tmp_path / "yarn.gguf")
