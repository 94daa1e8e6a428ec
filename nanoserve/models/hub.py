"""Hugging Face hub repos as models: `owner/name` (or `owner/name:QUANT` for one .gguf of a GGUF repo)
found in the local HF cache with no network, else downloaded into it by huggingface_hub (its progress
bars, resume and HF_TOKEN) unless HF_HUB_OFFLINE is set. Only the files the loader reads are fetched."""
from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from nanoserve.errors import InvalidRequest

# What the loader reads from an HF folder: config, generation defaults, tokenizer (fast or sentencepiece),
# chat templates, and safetensors weights. Pickled *.bin / *.pt, original/ (Meta's checkpoints) and
# consolidated* (Mistral's) are other copies of the same weights, often as large as the model itself.
HF_FOLDER_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json",
                   "merges.txt", "chat_template.json", "chat_template.jinja",
                   "additional_chat_templates/*.jinja", "*.safetensors", "model.safetensors.index.json"]
NOT_LOADED = ["*/*.safetensors", "original/*", "consolidated*"]
DEFAULT_QUANT = "Q4_K_M"  # what llama.cpp's `-hf user/repo` picks when no tag is given
REPO_ID = re.compile(r"([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::([A-Za-z0-9][\w.-]*))?")
COMMIT = re.compile(r"[0-9a-f]{40}")
SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


@dataclass(frozen=True)
class HubOptions:
    revision: str | None = None      # branch, tag or commit (vLLM's --revision); None = main
    download_dir: str | None = None  # HF cache folder to use instead of $HF_HUB_CACHE (vLLM's --download-dir)
    gguf_file: str | None = None     # the one .gguf of a GGUF repo to serve
    endpoint: str | None = None      # None = $HF_ENDPOINT, else huggingface.co


@dataclass(frozen=True)
class RepoRef:
    repo: str
    quant: str | None  # the :TAG of owner/name:TAG


@dataclass(frozen=True)
class HubModel:
    path: Path                # the snapshot folder in the HF cache
    gguf_file: str | None = None


class HubUnreachable(Exception):
    """The hub could not be asked (no network, DNS, refused): the caller reports it beside what it
    looked for locally, since nothing was said about the repo itself."""


def parse_repo(name: str) -> RepoRef | None:
    m = REPO_ID.fullmatch(name)
    return RepoRef(m[1], m[2]) if m else None


def offline() -> bool:
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE)


def find_cached(ref: RepoRef, opts: HubOptions) -> HubModel | None:
    """The repo at the revision asked for, complete in the local cache; no network. The cache layout
    (models--owner--name/refs/<rev> -> snapshots/<commit>/) is huggingface_hub's documented one."""
    from huggingface_hub import constants
    root = (Path(opts.download_dir or constants.HF_HUB_CACHE).expanduser()
            / f"models--{ref.repo.replace('/', '--')}")
    rev = opts.revision or "main"
    ref_file = root / "refs" / rev
    commit = rev if COMMIT.fullmatch(rev) else ref_file.read_text().strip() if ref_file.is_file() else None
    snap = root / "snapshots" / commit if commit else None
    if snap is None or not snap.is_dir():
        return None
    files = [p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file()]  # is_file: blob present
    if opts.gguf_file or ref.quant or not (snap / "config.json").is_file():
        gguf = _pick_gguf(ref, opts, files, strict=False)
        return HubModel(snap, gguf) if gguf else None
    return HubModel(snap) if _weights_complete(snap) else None


def _weights_complete(snap: Path) -> bool:
    index = snap / "model.safetensors.index.json"
    if index.is_file():
        return all((snap / f).is_file() for f in set(json.loads(index.read_text())["weight_map"].values()))
    return any(p.is_file() for p in snap.glob("*.safetensors"))


def _pick_gguf(ref: RepoRef, opts: HubOptions, files: list[str], strict: bool) -> str | None:
    """The .gguf to serve among `files`: --gguf-file, else the one whose name carries the quant tag
    (bounded: Q4_K is not Q4_K_M), else the only one, else llama.cpp's default Q4_K_M. `strict`: the
    full repo listing, where no match is the user's error; else a partial cache, where it is a miss."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if opts.gguf_file:
        if opts.gguf_file in ggufs:
            return opts.gguf_file
        if strict:
            raise _choose(ref, ggufs, f"has no file {opts.gguf_file!r} (--gguf-file)")
        return None
    tag = ref.quant or DEFAULT_QUANT
    bounded = re.compile(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9]|_[A-Za-z0-9])", re.IGNORECASE)
    hits = [f for f in ggufs if bounded.search(f.rsplit("/", 1)[-1])]
    if not ref.quant and not hits and len(ggufs) == 1:
        hits = ggufs
    if len(hits) == 1 and SPLIT_GGUF.search(hits[0]) is None:
        return hits[0]
    if not strict and (not hits or not ref.quant):
        return None
    if hits and all(SPLIT_GGUF.search(f) for f in hits):
        raise _choose(ref, ggufs, f"splits {tag} over {len(hits)} files, which nanoserve does not load; "
                      "merge them with `llama-gguf-split --merge` and pass the file")
    if hits:
        raise _choose(ref, ggufs, f"has {len(hits)} .gguf files tagged {tag}")
    if not ggufs:
        raise InvalidRequest(f"{ref.repo} has no config.json with *.safetensors weights and no .gguf file; "
                             f"its files: {', '.join(sorted(files)) or 'none'}", param="model",
                             code="model_not_found")
    raise _choose(ref, ggufs,
                  f"has no .gguf file tagged {tag}" if ref.quant else f"has {len(ggufs)} .gguf files")


def _choose(ref: RepoRef, ggufs: list[str], what: str) -> InvalidRequest:
    return InvalidRequest(f"{ref.repo} {what}; its .gguf files: {', '.join(ggufs) or 'none'}. Pick one with "
                          f"--model {ref.repo}:QUANT (a tag in the file name, e.g. {DEFAULT_QUANT}) or "
                          "--gguf-file NAME", param="model", code="model_not_found")


def download(ref: RepoRef, opts: HubOptions) -> HubModel:
    """Fetch what the loader needs into the HF cache (resuming a partial download) and return it.
    Raises InvalidRequest with one line saying what to do (token, gated terms, id, revision, file),
    or HubUnreachable."""
    from huggingface_hub import HfApi, snapshot_download
    with _hub_errors(ref, opts):
        info = HfApi(endpoint=opts.endpoint).model_info(ref.repo, revision=opts.revision)
        files = [s.rfilename for s in info.siblings or []]
        gguf = None
        if opts.gguf_file or ref.quant or "config.json" not in files:
            gguf = _pick_gguf(ref, opts, files, strict=True)
        elif not any(fnmatch(f, "*.safetensors") and not _ignored(f) for f in files):
            raise InvalidRequest(f"{ref.repo} has no *.safetensors weights (nanoserve loads safetensors or "
                                 "GGUF, not pickled .bin/.pt checkpoints); its files: "
                                 f"{', '.join(sorted(files))}", param="model", code="model_not_found")
        path = snapshot_download(ref.repo, revision=opts.revision, cache_dir=opts.download_dir,
                                 endpoint=opts.endpoint, allow_patterns=[gguf] if gguf else HF_FOLDER_FILES,
                                 ignore_patterns=None if gguf else NOT_LOADED)
    return HubModel(Path(path), gguf)


def download_command(ref: RepoRef, opts: HubOptions) -> str:
    """The command of huggingface_hub's own CLI (`hf`, 1.x and later) that fetches the repo (the one .gguf
    of a tagged GGUF repo) into the cache `find_cached` reads."""
    words = ["hf", "download", ref.repo]
    if opts.gguf_file or ref.quant:
        words += [opts.gguf_file] if opts.gguf_file else ["--include", f"*{ref.quant}*.gguf"]
    words += ["--revision", opts.revision] if opts.revision else []
    words += ["--cache-dir", opts.download_dir] if opts.download_dir else []
    return shlex.join(words)


def _ignored(f: str) -> bool:
    return any(fnmatch(f, p) for p in NOT_LOADED)


@contextmanager
def _hub_errors(ref: RepoRef, opts: HubOptions) -> Iterator[None]:
    """huggingface_hub's exceptions (multi-line, with a traceback) as one line saying what to do."""
    from huggingface_hub import constants, errors, get_token
    host = (opts.endpoint or constants.ENDPOINT).rstrip("/")
    has_token = get_token() is not None
    token_hint = ("the token in HF_TOKEN (or from `hf auth login`) has no access to it" if has_token
                  else f"set HF_TOKEN to a read token ({host}/settings/tokens)")
    say = lambda msg, code="model_not_found": InvalidRequest(msg, param="model", code=code)  # noqa: E731
    try:
        yield
    except errors.GatedRepoError as e:
        if has_token:
            raise say(f"{ref.repo} is gated and the account of the token in HF_TOKEN has no access yet: "
                      f"accept its conditions at {host}/{ref.repo} (some repos also wait for approval)",
                      "model_gated") from e
        raise say(f"{ref.repo} is gated: accept its conditions at {host}/{ref.repo} while logged in, then "
                  f"set HF_TOKEN to a read token of that account ({host}/settings/tokens)",
                  "model_gated") from e
    except errors.RepositoryNotFoundError as e:
        raise say(f"{host} answered 401 for {ref.repo}: it does not exist, or it is private or gated and "
                  f"needs a token; check the id, or {token_hint}" if _status(e) == 401
                  else f"{ref.repo} does not exist on {host}: check the repo id (owner/name)") from e
    except errors.RevisionNotFoundError as e:
        raise say(f"{ref.repo} has no revision {opts.revision!r} (--revision): give a branch, tag or commit "
                  "of the repo") from e
    except errors.HfHubHTTPError as e:
        raise say(f"{host} refused the token in HF_TOKEN (401): set a valid read token "
                  f"({host}/settings/tokens)" if _status(e) == 401
                  else f"{host} answered {_status(e)} for {ref.repo}: "
                       f"{str(e).strip().splitlines()[0]}") from e
    except errors.LocalEntryNotFoundError as e:  # snapshot_download: the hub went away, nothing cached
        raise HubUnreachable(f"{host} could not be reached ({_reason(e.__cause__ or e)})") from e
    except Exception as e:
        if not isinstance(e, (OSError, ConnectionError)) and not type(e).__module__.startswith(
                ("httpx", "requests", "urllib3")):
            raise
        raise HubUnreachable(f"{host} could not be reached ({_reason(e)})") from e


def _status(e: Exception) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'no detail'}"
