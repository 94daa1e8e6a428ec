"""A checkpoint's config.json and tokenizer files read without transformers (models/model_config.py,
models/tokenizer_facts.py) give what transformers gives, and an engine loads neither transformers nor
llguidance until something needs them."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import KV_GB, TINY_CONFIGS
from nanoserve.models.model_config import DEFAULTS, ModelConfig, read_model_config
from nanoserve.models.tokenizer_facts import TokenizerFacts, facts_of, read_tokenizer_facts
from nanoserve.sampling_params import InvalidRequest

FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "eos_token_id")


def _hf_class(model_type: str):
    import transformers
    return {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
            "qwen2": transformers.Qwen2Config}[model_type]


@pytest.mark.parametrize("model_type", sorted(DEFAULTS))
def test_missing_keys_take_transformers_defaults(model_type):
    hf = _hf_class(model_type)()
    ours = ModelConfig.from_dict({"model_type": model_type})
    assert {f: getattr(ours, f) for f in FIELDS} == {f: getattr(hf, f) for f in FIELDS}
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert ours.rope_theta == hf.rope_parameters["rope_theta"] and ours.rope_scaling is None
    assert not ours.attention_bias and not getattr(hf, "attention_bias", False)


def _model_facts(cfg) -> dict:
    """What our model code derives from a config, the RoPE table included."""
    from nanoserve.models.llama import LlamaModel
    m = LlamaModel(cfg, torch.float32, torch.device("cpu"))
    return dict(heads=(m.num_heads, m.num_kv_heads, m.head_dim), eps=m.eps, vocab=m.vocab_size, tied=m.tied,
                bias=m.layers[0].qkv_bias is not None, inter=m.inter, layers=m.num_layers,
                rope=[t.clone() for t in vars(m.rotary).values() if isinstance(t, torch.Tensor)])


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k])) if k == "rope" else a[k] == b[k]
        for k in a)


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_config_reads_as_transformers_reads_it(tiny_path, tmp_path, name):
    """Each tiny checkpoint's config.json (transformers 5's form, rope_parameters), and the same config in
    the legacy form hub checkpoints carry (rope_theta and rope_scaling at the top, defaults left out): the
    model built from our reading equals the one built from AutoConfig's, RoPE table included."""
    from transformers import AutoConfig
    folder = tiny_path(name)
    d = json.loads((folder / "config.json").read_text())
    hf_facts = _model_facts(AutoConfig.from_pretrained(folder))
    assert _same(_model_facts(read_model_config(folder)), hf_facts)
    params = d.pop("rope_parameters")
    d["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", "default") != "default":
        d["rope_scaling"] = params
    defaults = _hf_class(d["model_type"])()
    legacy = {k: v for k, v in d.items() if k not in FIELDS or v != getattr(defaults, k)}
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    assert _same(_model_facts(read_model_config(tmp_path)), hf_facts)
    assert _same(_model_facts(AutoConfig.from_pretrained(tmp_path)), hf_facts)  # the legacy form is right


def test_unsupported_or_missing_config_is_refused(tmp_path):
    with pytest.raises(InvalidRequest, match="has no config.json"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(InvalidRequest, match="MixtralForCausalLM.*not supported") as e:
        read_model_config(tmp_path)
    assert e.value.param == "model"


def _saved(tmp_path: Path, backend, name: str, **special) -> Path:
    from transformers import PreTrainedTokenizerFast
    out = tmp_path / name
    PreTrainedTokenizerFast(tokenizer_object=backend, **special).save_pretrained(out)
    return out


def test_tokenizer_facts_read_as_transformers_gives_them(embedded_dir, tmp_path):
    """EOS id and the longest token, from the files, against the loaded tokenizer: the embedded model's
    byte-level BPE, a Unigram and a WordPiece vocabulary, an EOS added by tokenizer_config.json only, an EOS
    named only in special_tokens_map.json, and none at all."""
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer
    unigram = Tokenizer(models.Unigram([("<unk>", 0.0), ("▁the", -1.0), ("▁a_rather_long_piece", -2.0), ("x", -3.0)], 0))
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "[SEP]": 1, "play": 2, "##ing": 3}, unk_token="[UNK]"))
    folders = [embedded_dir,
               _saved(tmp_path, unigram, "unigram", unk_token="<unk>", eos_token="</s_added_here_only>"),
               _saved(tmp_path, wordpiece, "wordpiece", unk_token="[UNK]", eos_token="[SEP]"),
               _saved(tmp_path, Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")), "no-eos")]
    legacy = tmp_path / "special-tokens-map"
    legacy.mkdir()
    (legacy / "tokenizer.json").write_text((folders[2] / "tokenizer.json").read_text())
    (legacy / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "[SEP]"}, "unk_token": "[UNK]"}))
    folders.append(legacy)
    seen = []
    for folder in folders:
        facts = read_tokenizer_facts(folder)
        assert facts == facts_of(AutoTokenizer.from_pretrained(folder)), folder.name
        seen.append(facts)
    assert seen[0] == TokenizerFacts(2, 81) and seen[1].eos_token_id == 4 and seen[3].eos_token_id is None
    assert seen[4].eos_token_id == 1
    assert read_tokenizer_facts(tmp_path) is None  # no tokenizer.json: the caller asks the tokenizer


ENGINE_SCRIPT = """
import sys
from nanoserve import LLM, SamplingParams
from nanoserve.structured import StructuredSpec
llm = LLM(None, dtype="float32", kv_cache_gb={kv}, enable_prefix_caching=False)
print(sorted(m for m in ("transformers", "llguidance") if m in sys.modules), llm.engine.info.eos_token_ids,
      llm.engine.info.max_token_chars)
out = llm.generate([[1, 9690, 198]], SamplingParams(max_tokens=8, temperature=0,
                   structured=StructuredSpec("choice", '["yes", "no"]')))
print(sorted(m for m in ("transformers", "llguidance") if m in sys.modules), repr(out[0].outputs[0].text))
"""


def test_engine_loads_transformers_and_llguidance_only_when_needed(embedded_dir):
    """A fresh engine (the engine process of a server loads the same way) reads its config and tokenizer
    facts without importing transformers or llguidance (~190 MB resident, bench/memory.py); the first
    constrained request brings in both, and is constrained."""
    from transformers import AutoTokenizer
    out = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT.format(kv=KV_GB)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = out.stdout.strip().splitlines()[-2:]
    tok = AutoTokenizer.from_pretrained(embedded_dir)
    assert before == f"[] {(tok.eos_token_id,)} {facts_of(tok).max_token_chars}"
    assert after.startswith("['llguidance', 'transformers'] ") and after.split(" ", 2)[2] in ("'yes'", "'no'")
