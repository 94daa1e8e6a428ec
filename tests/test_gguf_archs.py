"""Tiny Qwen3 and Gemma 3 models written to GGUF as llama.cpp's convert_hf_to_gguf.py lays them out, read back
by nanoserve: greedy tokens equal transformers' on the same weights, the kept-quantized path agrees with the
dequantized one, and the config derived from the file's metadata is the model's.

What the writer follows of llama.cpp's converter (Qwen3Model / Gemma3Model): tensor names through the gguf
package's name map for the architecture; Q and K stored as HF holds them (only the llama family is permuted
for interleaved RoPE); Gemma's norm weights stored as 1 + w (every tensor whose name ends in norm.weight, the
q/k norms too); a tied head written as no output.weight; the keys `{arch}.block_count`, ... listed in
`_write_metadata`. The SmolLM2 tokenizer's `tokenizer.ggml.*` fields come from the embedded GGUF file.

A GGUF file has no layer_types: readers assume Gemma 3's pattern (every 6th layer global, the windowed
layers' RoPE base 10000, the query scale 1/sqrt(head_dim)), so the Gemma model here is built to follow it
(6 layers) rather than taken from conftest's 2-layer `gemma3-window`."""
from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.kernels import cpu_kernels
from nanoserve.layers.quant_linear import Q4_0, Q8_0, QuantLinear
from nanoserve.models.loader import embedded_source, load_config, materialize, resolve_model
from nanoserve.models.model_config import read_model_config
from tests.conftest import hf_greedy, random_prompts

ARCHS = ("qwen3", "gemma3")
WINDOW = 8            # the Gemma model's sliding window: every prompt is longer
GLOBAL_THETA = 1e6    # Gemma's global layers' RoPE base (rope.freq_base); its windowed layers take 10000
STEPS = 8
PROMPTS = random_prompts(3, 14, 30, seed=7)
KV_GB = 0.05          # ~16k tokens of these models' KV: plenty, and quick to zero
LOGPROB_TOL = 2e-3    # kept blocks vs dequantized: the same products, summed in another order
NEAR_TIE = 1e-3


def _qtype(name: str):
    """The GGUF type each HF tensor is stored as: norms and layer 0 F32, layer 1's v_proj F32 among Q8_0
    (a fused q/k/v group only partly kept: dequantized at load), gate/up Q4_0, the rest Q8_0."""
    from gguf import GGMLQuantizationType as T
    if name.endswith(("norm.weight", "layers.1.self_attn.v_proj.weight")) or ".layers.0." in name:
        return T.F32
    return T.Q4_0 if name.endswith(("gate_proj.weight", "up_proj.weight")) else T.Q8_0


def _write_metadata(w, arch: str, cfg: dict) -> None:
    """The hyperparameters llama.cpp's converter writes for these two architectures."""
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("full_attention", rope).get("rope_theta") or cfg.get("rope_theta")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(theta)
    if arch == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])


@functools.cache
def _tokenizer_fields() -> tuple[tuple, ...]:
    """The embedded SmolLM2 file's tokenizer.ggml.* fields: (key, value, type, element type). The gguf
    package's reader makes a numpy view per element of the 49k tokens and merges (seconds): WeightsReader
    finds the fields (scalars read by the stock code) and steps over the arrays, whose elements are read
    here from the map: each string a u64 length and its bytes, numbers packed."""
    from gguf import GGUFReader, GGUFValueType

    from nanoserve.models.gguf_reader import WeightsReader
    src = embedded_source()
    reader = WeightsReader(str(src.path / src.gguf_file), "r")
    out = []
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer.ggml."):
            continue
        if f.types[0] != GGUFValueType.ARRAY:
            out.append((key, f.contents(), f.types[0], None))
            continue
        sub, count = f.types[-1], int(f.parts[-1][0])
        at = f.offset + sum(int(p.nbytes) for p in f.parts)  # the elements follow type and count
        if sub == GGUFValueType.STRING:
            buf, items = memoryview(reader.data), []
            for _ in range(count):
                n = int.from_bytes(buf[at:at + 8], "little")
                items.append(str(buf[at + 8:at + 8 + n], "utf-8"))
                at += 8 + n
        else:
            items = np.frombuffer(reader.data, GGUFReader.gguf_scalar_to_np[sub], count, at).tolist()
        out.append((key, items, GGUFValueType.ARRAY, sub))
    return tuple(out)


def _copy_tokenizer(w) -> None:
    for key, value, kind, sub in _tokenizer_fields():
        w.add_key_value(key, value, kind, sub_type=sub)


def write_gguf(hf_dir: Path, out: Path, arch: str) -> dict[str, torch.Tensor]:
    """`hf_dir`'s model as a GGUF file at `out`; returns the file's weights as HF names and holds them
    (quantized ones dequantized by the gguf package), for the reference model to load."""
    from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file
    cfg = json.loads((hf_dir / "config.json").read_text())
    tmap = get_tensor_name_map(MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])
    w = GGUFWriter(str(out), arch)
    _write_metadata(w, arch, cfg)
    _copy_tokenizer(w)
    weights = {}
    for name, t in sorted(load_file(hf_dir / "model.safetensors").items()):
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue  # tied: the converter writes no output.weight
        a = t.float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            a = a + np.float32(1)  # Gemma3RMSNorm scales by 1 + w; llama.cpp stores that sum
        qtype = _qtype(name)
        stored = quantize(a, qtype)
        w.add_tensor(tmap.get_name(name, try_suffixes=(".weight", ".bias")), stored,
                     raw_dtype=None if qtype == GGMLQuantizationType.F32 else qtype)
        dense = qtype == GGMLQuantizationType.F32
        weights[name] = t if dense else torch.from_numpy(dequantize(stored, qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def tiny_gemma3(out: Path, tokenizer_dir: Path) -> Path:
    """A 6-layer Gemma 3 in the pattern a GGUF reader assumes: 5 windowed layers (base 10000), 1 global
    (GLOBAL_THETA), query_pre_attn_scalar = head_dim (32, apart from hidden / heads = 16)."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=WINDOW, layer_types=["sliding_attention"] * 5 + ["full_attention"],
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": GLOBAL_THETA}})
    torch.manual_seed(3)
    model = transformers.Gemma3ForCausalLM(cfg).float()
    with torch.no_grad():  # as conftest's tiny models: peaked logits, norms away from their identity
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08 if p.dim() == 2 else 0.05)
            else:
                p.add_(torch.randn_like(p), alpha=0.1)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@dataclass
class Case:
    arch: str
    hf_dir: Path
    gguf: Path
    expected: list[list[int]]  # transformers' greedy tokens on the file's weights


@pytest.fixture(scope="module")
def own_cache(tmp_path_factory, embedded_dir) -> Iterator[None]:
    """materialize()'s folders of these throw-away files in a temporary cache (after the embedded model's
    own conversion, which stays in the shared one)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module", params=ARCHS)
def case(request, own_cache, tiny_path, embedded_dir, tmp_path_factory) -> Case:
    from transformers import AutoModelForCausalLM
    arch = request.param
    hf_dir = (tiny_path("qwen3-qk-norm") if arch == "qwen3"
              else tiny_gemma3(tmp_path_factory.mktemp("gemma3-6"), embedded_dir))
    f = tmp_path_factory.mktemp(f"{arch}-gguf") / f"tiny-{arch}.gguf"
    weights = write_gguf(hf_dir, f, arch)
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    missing, unexpected = ref.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    state = ref.state_dict()
    assert all(torch.equal(state[n], t) for n, t in weights.items())
    return Case(arch, hf_dir, f, hf_greedy(ref, PROMPTS, STEPS))


@pytest.fixture(scope="module")
def dense(case) -> LLM:
    return LLM(str(case.gguf), dtype="float32", gguf_dequantize=True, kv_cache_gb=KV_GB)


def tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def test_dequantized_file_greedy_equals_transformers(case, dense, embedded_dir):
    """fp32, the file dequantized: transformers' greedy tokens on the same weights, the prompts longer
    than Gemma's window (which the attention backend must apply: without it Gemma's tokens part from
    transformers' once a prompt outgrows the window)."""
    from transformers import AutoTokenizer
    assert min(map(len, PROMPTS)) > 1.5 * WINDOW
    greedy = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    assert tokens(dense, greedy) == case.expected
    assert tokens(dense, greedy) == case.expected  # again, from the prefix cache
    if case.arch == "qwen3":  # the tokenizer built from the file's tokenizer.ggml.* fields is SmolLM2's
        # (not for gemma3: transformers picks GemmaTokenizer by architecture, whose sentencepiece-style
        # pipeline over this byte-level vocabulary is another tokenizer; real Gemma files are sentencepiece)
        text = "GGUF round trip: Qwen3 and Gemma 3, 12345 tokens!"
        assert dense.tokenizer.encode(text) == AutoTokenizer.from_pretrained(embedded_dir).encode(text)


def _kept_layout(model, layers: int) -> None:
    """Which projections the file's blocks serve: none of layer 0 (F32), layer 1's all but q/k/v (its v_proj
    F32), every later layer's; the Q8_0 embedding, which the tied head reads too."""
    for i, layer in enumerate(model.layers):
        kept = {a: isinstance(getattr(layer, f"{a}_lin"), QuantLinear)
                for a in ("qkv", "o", "gate_up", "down")}
        assert kept == {a: i > 1 or (i == 1 and a != "qkv") for a in kept}, (i, kept)
        if i > 0:
            assert {p.qtype for p in layer.gate_up_lin.parts} == {Q4_0}
            assert {p.qtype for p in layer.down_lin.parts} == {Q8_0}
    assert len(model.layers) == layers
    assert model.embed_rows is not None and model.embed_rows.table.qtype == Q8_0
    assert model.lm_head_lin.parts[0] is model.embed_rows.table


def test_kept_quantized_agrees_with_dequantized(case, dense):
    """The default load serves the Q8_0 / Q4_0 tensors from their blocks: with fp32 activations the same
    products as the dequantized weights', summed in another order, so teacher-forced logprobs agree to
    that rounding (measured: at most 2e-6 on both files) and greedy tokens are the same unless the two
    sides part at a near-tie (then shown)."""
    if cpu_kernels.quant() is None:
        pytest.skip("no C++ toolchain: GGUF weights are dequantized at load")
    kept = LLM(str(case.gguf), dtype="float32", kv_cache_gb=KV_GB)
    _kept_layout(kept.engine.model, kept.engine.hf_config.num_hidden_layers)
    forced = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    worst = 0.0
    for x, y in zip(kept.generate(PROMPTS, forced), dense.generate(PROMPTS, forced)):
        for lx, ly in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            assert lx.token_id == ly.token_id
            worst = max(worst, abs(lx.logprob - ly.logprob))
    assert worst < LOGPROB_TOL, worst
    greedy = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=2)
    for x, y in zip(kept.generate(PROMPTS, greedy), dense.generate(PROMPTS, greedy)):
        tx, ty = x.outputs[0].token_ids, y.outputs[0].token_ids
        if tx != ty:
            i = next(i for i, (u, v) in enumerate(zip(tx, ty)) if u != v)
            top = sorted((c.logprob for c in y.outputs[0].logprobs[i].top), reverse=True)
            assert top[0] - top[1] < NEAR_TIE, f"token {i}: {tx[i]} vs {ty[i]}, margin {top[0] - top[1]:.2e}"


def test_config_from_file_metadata(case):
    """What nanoserve derives from the file's metadata: the HF folder's own config (Gemma's layer windows,
    local RoPE base and query scale as llama.cpp completes them), eps as the file's float32 holds it."""
    cfg = load_config(materialize(resolve_model(str(case.gguf))))
    expected = (dict(model_type="qwen3", head_dim=64, layer_windows=(), rope_theta=10000.0,
                     rope_local_theta=None, query_pre_attn_scalar=None, hidden_act="silu")
                if case.arch == "qwen3" else
                dict(model_type="gemma3_text", head_dim=32, layer_windows=(WINDOW,) * 5 + (0,),
                     rope_theta=GLOBAL_THETA, rope_local_theta=10000.0, query_pre_attn_scalar=32,
                     hidden_act="gelu_pytorch_tanh"))
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.gemma == (case.arch == "gemma3")
    hf = read_model_config(case.hf_dir)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                  "rope_theta", "rope_scaling", "tie_word_embeddings", "attention_bias", "hidden_act",
                  "query_pre_attn_scalar", "layer_windows", "rope_local_theta", "eos_token_id"):
        assert getattr(cfg, field) == getattr(hf, field), field
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-7)
