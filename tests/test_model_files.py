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
          "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
          "eos_token_id")


def _hf_class(model_type: str):
    import transformers
    return {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
            "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
            "gemma3_text": transformers.Gemma3TextConfig}[model_type]


@pytest.mark.parametrize("model_type", sorted(DEFAULTS))
def test_missing_keys_take_transformers_defaults(model_type):
    hf = _hf_class(model_type)()
    ours = ModelConfig.from_dict({"model_type": model_type})
    assert {f: getattr(ours, f) for f in FIELDS} == {f: getattr(hf, f) for f in FIELDS}
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    rope = hf.rope_parameters.get("full_attention", hf.rope_parameters)  # Gemma 3: a dict per layer type
    assert ours.rope_theta == rope["rope_theta"] and ours.rope_scaling is None
    assert not ours.attention_bias and not getattr(hf, "attention_bias", False)
    # the sliding windows transformers masks with, per layer
    types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    # Qwen2 and Qwen3 have theirs off (use_sliding_window false); Llama has none
    window = 0 if model_type in ("llama", "qwen2", "qwen3") else hf.sliding_window
    expected = tuple(window if t == "sliding_attention" or model_type == "mistral" else 0 for t in types)
    assert ours.layer_windows == (expected if any(expected) else ())
    if model_type == "gemma3_text":
        assert ours.rope_local_theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
        assert ours.hidden_act == hf.hidden_activation
        assert ours.query_pre_attn_scalar == hf.query_pre_attn_scalar


def _model_facts(cfg) -> dict:
    """What our model code derives from a config, the RoPE table included."""
    from nanoserve.models.llama import LlamaModel
    m = LlamaModel(cfg, torch.float32, torch.device("cpu"))
    return dict(heads=(m.num_heads, m.num_kv_heads, m.head_dim), eps=m.eps, vocab=m.vocab_size, tied=m.tied,
                bias=m.layers[0].qkv_bias is not None, inter=m.inter, layers=m.num_layers,
                rope=[t.clone() for r in (m.rotary, m.local_rotary) if r is not None
                      for t in vars(r).values() if isinstance(t, torch.Tensor)],
                windows=m.windows, scale=m.scale)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k])) if k == "rope"
        else a[k] == b[k]
        for k in a)


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_config_reads_as_transformers_reads_it(tiny_path, tmp_path, name):
    """Each tiny checkpoint's config.json (transformers 5's form, rope_parameters), that form with another
    RoPE base, and the legacy form hub checkpoints carry (rope_theta and rope_scaling at the top, defaults
    left out) with that base: the model built from our reading equals the one built from AutoConfig's reading
    of the same file, RoPE table included (and the other base does change the table)."""
    from transformers import AutoConfig
    d = json.loads((tiny_path(name) / "config.json").read_text())
    other = json.loads(json.dumps(d))
    if d["model_type"] == "gemma3_text":  # a dict per layer type: other bases for both, no legacy form here
        other["rope_parameters"]["full_attention"]["rope_theta"] = 500000.0
        other["rope_parameters"]["sliding_attention"]["rope_theta"] = 20000.0
        forms = (d, other)
    else:
        other["rope_parameters"]["rope_theta"] = 500000.0
        forms = (d, other, *_legacy_forms(other))
    built = []
    for i, form in enumerate(forms):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "config.json").write_text(json.dumps(form))
        ours = _model_facts(read_model_config(tmp_path / str(i)))
        assert _same(ours, _model_facts(AutoConfig.from_pretrained(tmp_path / str(i)))), i
        built.append(ours)
    assert not _same(built[0], built[1])
    if len(built) > 2:
        assert _same(built[1], built[2]) and not _same(built[3], built[0])


def _legacy_forms(other: dict) -> tuple[dict, dict]:
    """`other` in the legacy form (rope_theta and rope_scaling at the top, defaults left out), and with both
    forms, as a hand-edited config can carry (the legacy scaling wins)."""
    params = dict(other["rope_parameters"])
    legacy = {k: v for k, v in other.items() if k != "rope_parameters"}
    legacy["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", "default") != "default":
        legacy["rope_scaling"] = params
    defaults = _hf_class(other["model_type"])()
    legacy = {k: v for k, v in legacy.items() if k not in FIELDS or v != getattr(defaults, k)}
    both = dict(other)
    both.update(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rope_theta=10000.0,
                rope_scaling={"type": "linear", "factor": 2.0})
    return legacy, both


def test_unsupported_or_missing_config_is_refused(tmp_path):
    with pytest.raises(InvalidRequest, match="has no config.json"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral",
                                                      "architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(InvalidRequest, match="MixtralForCausalLM.*not supported") as e:
        read_model_config(tmp_path)
    assert e.value.param == "model"
    # MoE and multimodal checkpoints of supported families: refused in one line naming what is supported
    for kind, arch in (("qwen3_moe", "Qwen3MoeForCausalLM"), ("gemma3", "Gemma3ForConditionalGeneration"),
                       ("qwen3", "Qwen3MoeForCausalLM")):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": kind, "architectures": [arch]}))
        with pytest.raises(InvalidRequest) as e:
            read_model_config(tmp_path)
        assert arch in str(e.value) and "Gemma3ForCausalLM" in str(e.value) and "\n" not in str(e.value)


def _saved(tmp_path: Path, backend, name: str, **special) -> Path:
    from transformers import PreTrainedTokenizerFast
    out = tmp_path / name
    PreTrainedTokenizerFast(tokenizer_object=backend, **special).save_pretrained(out)
    return out


def _edit(folder: Path, name: str, change) -> None:
    d = json.loads((folder / name).read_text()) if (folder / name).exists() else {}
    change(d)
    (folder / name).write_text(json.dumps(d))


def test_tokenizer_facts_read_as_transformers_gives_them(embedded_dir, tmp_path):
    """EOS id and the longest token from the files, against the loaded tokenizer (transformers 5), for: the
    embedded model's byte-level BPE, a Unigram vocabulary with a long additional special token, a WordPiece
    one (its config also carrying add_bos_token: true), none named, special_tokens_map.json naming another EOS
    than tokenizer_config.json (the map wins, unless the config has added_tokens_decoder).
    Where the files cannot say (no tokenizer.json, an EOS outside the vocabulary, a tokenizer class with
    a default of its own, a shape not foreseen) the reader says None and the engine asks the tokenizer."""
    import shutil

    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer

    from nanoserve.models.loader import GENERIC_TOKENIZERS
    unigram = Tokenizer(models.Unigram([("<unk>", 0.0), ("▁the", -1.0), ("▁a_rather_long_piece", -2.0),
                                        ("x", -3.0)], 0))
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "[SEP]": 1, "[CLS]": 2, "play": 3, "##ing": 4},
                                           unk_token="[UNK]"))
    folders = {"embedded": embedded_dir,
               "unigram": _saved(tmp_path, unigram, "unigram", unk_token="<unk>", eos_token="</s>",
                                 additional_special_tokens=["<|a_special_token_longer_than_any_piece|>"]),
               "wordpiece": _saved(tmp_path, wordpiece, "wordpiece", unk_token="[UNK]", eos_token="[SEP]"),
               "no-eos": _saved(tmp_path, Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1},
                                                                     unk_token="[UNK]")), "no-eos")}
    _edit(folders["wordpiece"], "tokenizer_config.json",
          lambda d: d.update(add_bos_token=True, add_eos_token=False))
    # a config with added_tokens_decoder: no map read
    shutil.copytree(folders["wordpiece"], tmp_path / "config-wins")
    _edit(tmp_path / "config-wins", "tokenizer_config.json", lambda d: d.update(added_tokens_decoder={
        "1": {"content": "[SEP]", "special": True, "lstrip": False, "rstrip": False, "normalized": False,
              "single_word": False}}))
    _edit(tmp_path / "config-wins", "special_tokens_map.json", lambda d: d.update(eos_token="[CLS]"))
    folders["config-wins"] = tmp_path / "config-wins"
    shutil.copytree(folders["wordpiece"], tmp_path / "map-wins")
    _edit(tmp_path / "map-wins", "special_tokens_map.json",
          lambda d: d.update(eos_token={"content": "[CLS]"}))
    folders["map-wins"] = tmp_path / "map-wins"
    unread = {"no-tokenizer.json": tmp_path / "empty"}
    unread["no-tokenizer.json"].mkdir()
    shutil.copytree(folders["wordpiece"], tmp_path / "eos-outside")
    _edit(tmp_path / "eos-outside", "tokenizer_config.json", lambda d: d.update(eos_token="[NEW_EOS]"))
    unread["eos-outside"] = tmp_path / "eos-outside"
    shutil.copytree(folders["no-eos"], tmp_path / "class-default")
    _edit(tmp_path / "class-default", "tokenizer_config.json",
          lambda d: d.update(tokenizer_class="LlamaTokenizerFast"))
    unread["class-default"] = tmp_path / "class-default"
    shutil.copytree(folders["wordpiece"], tmp_path / "odd-shape")
    _edit(tmp_path / "odd-shape", "tokenizer_config.json",
          lambda d: d.update(added_tokens_decoder={"one": {}}))
    unread["odd-shape"] = tmp_path / "odd-shape"
    seen = {}
    for name, folder in folders.items():
        seen[name] = read_tokenizer_facts(folder, GENERIC_TOKENIZERS)
        assert seen[name] == facts_of(AutoTokenizer.from_pretrained(folder)), name
    assert seen["embedded"] == TokenizerFacts(2, 81) and seen["no-eos"].eos_token_id is None
    assert seen["unigram"].max_token_chars == len("<|a_special_token_longer_than_any_piece|>")
    assert (seen["wordpiece"].eos_token_id, seen["map-wins"].eos_token_id,
            seen["config-wins"].eos_token_id) == (1, 2, 1)
    for name, folder in unread.items():
        assert read_tokenizer_facts(folder, GENERIC_TOKENIZERS) is None, name
    # what the engine then uses
    assert facts_of(AutoTokenizer.from_pretrained(unread["eos-outside"])).eos_token_id == 5


ENGINE_SCRIPT = """
import sys
from nanoserve import LLM, SamplingParams
from nanoserve.structured import StructuredSpec
llm = LLM(None, dtype="float32", kv_cache_gb={kv}, enable_prefix_caching=False)
eng = llm.engine  # driven as the engine core drives it: token ids in and out, no text
print("transformers" in sys.modules, eng._tokenizer is not None, eng.info.eos_token_ids,
      eng.info.max_token_chars)
eng.add_request("plain", [1, 9690, 198], SamplingParams(max_tokens=4, temperature=0))
while eng.has_unfinished():
    eng.step()
print("transformers" in sys.modules, eng._tokenizer is not None)
eng.add_request("choice", [1, 9690, 198], SamplingParams(max_tokens=8, temperature=0,
                structured=StructuredSpec("choice", '["yes", "no"]')))
out = []
while eng.has_unfinished():
    out += [o for o in eng.step() if o.finished]
print("transformers" in sys.modules, eng._tokenizer is not None,
      repr(eng.tokenizer.decode(out[0].outputs[0].token_ids, skip_special_tokens=True)))
"""


def test_engine_loads_transformers_and_llguidance_only_when_needed(embedded_dir):
    """A fresh engine driven on token ids, as the engine process of a server drives it, reads its config and
    tokenizer facts without importing transformers or loading a tokenizer (with llguidance's vocabulary
    ~190 MB resident, bench/latency.py --load-stages), serves unconstrained requests without them, and
    its first constrained request loads them on the grammar thread and is constrained."""
    from transformers import AutoTokenizer
    out = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT.format(kv=KV_GB)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    start, plain, constrained = out.stdout.strip().splitlines()[-3:]
    tok = AutoTokenizer.from_pretrained(embedded_dir)
    assert start == f"False False {(tok.eos_token_id,)} {facts_of(tok).max_token_chars}"
    assert plain == "False False"
    assert constrained in ("True True 'yes'", "True True 'no'")


def test_sliding_windows_as_transformers_reads_them():
    """Mistral v0.2 on says `"sliding_window": null` (no window, not the 4096 default); Qwen's window starts
    at max_window_layers (default 28) where use_sliding_window is on."""
    from transformers import MistralConfig, Qwen2Config
    assert ModelConfig.from_dict({"model_type": "mistral", "sliding_window": None}).layer_windows == ()
    assert MistralConfig(sliding_window=None).sliding_window is None
    assert set(ModelConfig.from_dict({"model_type": "mistral"}).layer_windows) == {4096}
    qwen = {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "num_hidden_layers": 30}
    hf = Qwen2Config(**{k: v for k, v in qwen.items() if k != "model_type"})
    assert ModelConfig.from_dict(qwen).layer_windows == tuple(
        64 if t == "sliding_attention" else 0 for t in hf.layer_types)
