"""What the engine needs to know of a tokenizer without holding one: its EOS token and the longest
text one token stands for. A served engine never tokenizes (the API process does), and transformers'
tokenizer classes cost a process ~125 MB resident with the config machinery they import
(bench/latency.py --load-stages); so these are read from the tokenizer's files, as transformers
resolves them (tests/test_model_files.py compares the two)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TokenizerFacts:
    eos_token_id: int | None
    max_token_chars: int  # longest text one token stands for: a cheap bound on a prompt's token count


def facts_of(tokenizer: Any) -> TokenizerFacts:
    """From a loaded transformers tokenizer."""
    longest = max((len(t or "") for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))),
                  default=1)
    return TokenizerFacts(tokenizer.eos_token_id, longest or 1)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or a serialized AddedToken."""
    return token.get("content") if isinstance(token, dict) else token


def read_tokenizer_facts(folder: Path, generic_classes: tuple[str, ...]) -> TokenizerFacts | None:
    """From a fast tokenizer's files; None where the files cannot say what transformers would: no readable
    tokenizer.json (a slow-only tokenizer, a remote name), an EOS named but not in the vocabulary
    (transformers adds it as a new id), or none named by a tokenizer class not in `generic_classes` (its class
    may have a default), or files of a shape not foreseen here. The caller then loads the tokenizer and asks
    it (`facts_of`)."""
    try:
        return _facts(folder, generic_classes)
    except (AttributeError, KeyError, TypeError, ValueError):  # files of a shape not foreseen here
        return None


def _facts(folder: Path, generic_classes: tuple[str, ...]) -> TokenizerFacts | None:
    tok = _read_json(folder / "tokenizer.json")
    vocab = tok.get("model", {}).get("vocab")
    if isinstance(vocab, dict):    # BPE, WordPiece, WordLevel: piece -> id
        ids = dict(vocab)
    elif isinstance(vocab, list):  # Unigram: [piece, score] by id
        ids = {piece: i for i, (piece, _) in enumerate(vocab)}
    else:
        return None
    ids.update((t["content"], t["id"]) for t in tok.get("added_tokens", []))
    config = _read_json(folder / "tokenizer_config.json")
    # transformers 5 reads special_tokens_map.json (and lets it win) only where the config has no
    # added_tokens_decoder
    special = (config if config.get("added_tokens_decoder")
               else {**config, **_read_json(folder / "special_tokens_map.json")})
    ids.update((_content(t), int(i)) for i, t in (config.get("added_tokens_decoder") or {}).items())
    eos = _content(special.get("eos_token"))
    if ((eos is not None and eos not in ids)
            or (eos is None and config.get("tokenizer_class") not in generic_classes)):
        return None
    tokens = ([t for k, t in special.items() if k.endswith("_token")]
              + list(special.get("additional_special_tokens") or []))
    declared = [c for c in map(_content, tokens) if isinstance(c, str)]  # not add_bos_token's true
    longest = max(map(len, [*ids, *declared]), default=1)
    return TokenizerFacts(ids.get(eos) if eos else None, longest or 1)
