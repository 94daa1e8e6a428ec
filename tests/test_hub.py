"""`--model owner/name` from a Hugging Face hub: found in the cache with no network, else downloaded
by huggingface_hub, only the files the loader reads; errors as one line. The hub is LocalHub, a
stand-in on 127.0.0.1 serving the endpoints huggingface_hub calls (reached through HF_ENDPOINT, or
the endpoint option in-process) for repos whose files the tests write."""
from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from nanoserve.errors import InvalidRequest
from nanoserve.models.hub import HubOptions
from nanoserve.models.loader import EMBEDDED_GGUF, load_config, models_dir, resolve_model

TOKEN = "hf_fixture_token"
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pth")  # stored in LFS on the hub: served from its CDN


@dataclass
class Commit:
    sha: str
    files: dict[str, bytes]


@dataclass
class Repo:
    revisions: dict[str, Commit] = field(default_factory=dict)  # branch/tag name and commit sha -> commit
    token: str | None = None                                   # a private repo: the token it needs
    gated: bool = False                                        # files need accepted conditions


def git_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class LocalHub:
    """The hub's API and file endpoints with the headers huggingface_hub checks: model info (sha,
    siblings), the tree listing, HEAD/GET resolve with X-Repo-Commit, ETag, Content-Length; LFS files
    answer 302 with X-Linked-Etag / X-Linked-Size and a Location on a second origin (the CDN), as the
    real hub does; errors carry X-Error-Code. Every request's path is recorded."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[str] = []
        self.ranges: list[str] = []  # "<cdn path> from <offset>" of each Range request
        self.cut_once: set[str] = set()  # LFS files whose next download breaks off halfway
        self.servers = [ThreadingHTTPServer(("127.0.0.1", 0), HubHandler) for _ in range(2)]
        for s in self.servers:
            s.hub = self
            threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url, self.cdn_url = (f"http://127.0.0.1:{s.server_address[1]}" for s in self.servers)

    def add(self, repo: str, files: dict[str, bytes], revision: str = "main", **kw) -> str:
        sha = hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()
        r = self.repos.setdefault(repo, Repo(**kw))
        r.revisions[revision] = r.revisions[sha] = Commit(sha, files)
        return sha

    def blob(self, sha256: str) -> bytes | None:
        return next((d for r in self.repos.values() for c in r.revisions.values() for d in c.files.values()
                     if hashlib.sha256(d).hexdigest() == sha256), None)

    def files_fetched(self) -> set[str]:
        """Repo files whose content was asked for (GET of a small file, or of an LFS file's CDN blob)."""
        out = set()
        for line in self.requests:
            method, path = line.split(" ", 1)
            if method == "GET" and (m := re.fullmatch(r"/[^/]+/[^/]+/resolve/[^/]+/(.+)", path)):
                out.add(m[1])
            elif method == "GET" and path.startswith("/cdn/"):
                out.add(path.split("/", 3)[3])
        return out

    def stop(self) -> None:
        for s in self.servers:
            if s.socket.fileno() != -1:
                s.shutdown()
                s.server_close()


class HubHandler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self.route(body=False)

    def do_GET(self) -> None:
        self.route(body=True)

    def send(self, status: int, data: bytes = b"", headers: dict | None = None, body: bool = True) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def error(self, status: int, code: str, headers: dict | None = None, body: bool = True) -> None:
        self.send(status, json.dumps({"error": code}).encode(), {"X-Error-Code": code, **(headers or {})},
                  body)

    def route(self, body: bool) -> None:
        hub: LocalHub = self.server.hub
        path = unquote(urlsplit(self.path).path)
        hub.requests.append(f"{self.command} {path}")
        if path.startswith("/cdn/"):  # /cdn/<sha256>/<file name, for the record>
            data = hub.blob(path.split("/")[2])
            if data is None:
                return self.error(404, "EntryNotFound", body=body)
            if m := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "")):  # a resumed download
                hub.ranges.append(f"{path} from {m[1]}")
                return self.send(206, data[int(m[1]):],
                                 {"Content-Range": f"bytes {m[1]}-{len(data) - 1}/{len(data)}"}, body)
            if body and path.split("/", 3)[3] in hub.cut_once:  # the connection drops mid-file, once
                hub.cut_once.discard(path.split("/", 3)[3])
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[:len(data) // 2])
                self.close_connection = True
                return
            return self.send(200, data, {"ETag": f'"{path.split("/")[2]}"'}, body)
        m = (re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?(?:/.*)?", path)
             or re.fullmatch(r"/([^/]+/[^/]+)/(resolve)/([^/]+)/(.+)", path))
        if not m:
            return self.error(404, "NotFound", body=body)
        repo = hub.repos.get(m[1])
        if repo is None:
            return self.error(404, "RepoNotFound", body=body)
        if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
            return self.error(401, "RepoNotFound", {"X-Error-Message": "Invalid username or password."}, body)
        commit = repo.revisions.get(m[3] or "main")
        if commit is None:
            return self.error(404, "RevisionNotFound", body=body)
        if m[2] in (None, "revision"):
            info = {"id": m[1], "modelId": m[1], "sha": commit.sha, "private": bool(repo.token),
                    "gated": "manual" if repo.gated else False,
                    "siblings": [{"rfilename": f} for f in commit.files]}
            return self.send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if m[2] == "tree":
            tree = [{"type": "file", "path": f, "size": len(d), "oid": git_sha(d)}
                    | ({"lfs": {"oid": hashlib.sha256(d).hexdigest(), "size": len(d), "pointerSize": 134}}
                       if f.endswith(LFS_SUFFIXES) else {}) for f, d in commit.files.items()]
            return self.send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
        name = m[4]
        if name not in commit.files:
            return self.error(404, "EntryNotFound", {"X-Repo-Commit": commit.sha}, body)
        if repo.gated and self.headers.get("Authorization") is None:
            return self.error(403, "GatedRepo", {"X-Error-Message": "Access to this model is restricted."},
                              body)
        data = commit.files[name]
        if name.endswith(LFS_SUFFIXES):
            sha256 = hashlib.sha256(data).hexdigest()
            return self.send(302, b"", {"Location": f"{hub.cdn_url}/cdn/{sha256}/{name}",
                                        "X-Repo-Commit": commit.sha, "X-Linked-Etag": f'"{sha256}"',
                                        "X-Linked-Size": len(data), "ETag": f'"{git_sha(data)}"'}, body)
        self.send(200, data, {"X-Repo-Commit": commit.sha, "ETag": f'"{git_sha(data)}"'}, body)


def repo_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


NOT_NEEDED = {"pytorch_model.bin": b"pickled weights", "original/consolidated.00.pth": b"meta checkpoint",
              "consolidated.safetensors": b"mistral checkpoint", "README.md": b"# tiny"}


@pytest.fixture(scope="module")
def tiny_files(tiny_path) -> dict[str, bytes]:
    return repo_files(tiny_path("llama-gqa-tied"))


@pytest.fixture(scope="module")
def hub(tiny_files):
    h = LocalHub()
    h.add("tiny-org/tiny-llama", tiny_files | NOT_NEEDED)
    v1 = dict(tiny_files, **{"generation_config.json": b'{"temperature": 0.25}'})
    h.add("tiny-org/tiny-llama", v1, revision="v1")
    h.add("tiny-org/private-llama", tiny_files, token=TOKEN)
    h.add("tiny-org/gated-llama", tiny_files, gated=True)
    h.add("tiny-org/bin-only", {"config.json": tiny_files["config.json"], "pytorch_model.bin": b"pickled"})
    h.add("tiny-org/tiny-gguf", {"tiny-Q4_K_M.gguf": b"GGUF q4_k_m", "tiny-Q8_0.gguf": b"GGUF q8_0",
                                 "README.md": b"# gguf"})
    yield h
    h.stop()


@pytest.fixture(autouse=True)
def online_without_token(monkeypatch, tmp_path):
    """Online (whatever the machine's environment says), no token, and the default HF cache in tmp."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "default-cache"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)


def opts(hub: LocalHub, cache: Path, **kw) -> HubOptions:
    return HubOptions(download_dir=str(cache), endpoint=hub.url, **kw)


def one_line_error(name: str, options: HubOptions) -> str:
    with pytest.raises(InvalidRequest) as ei:
        resolve_model(name, options)
    msg = str(ei.value)
    assert "\n" not in msg and ei.value.param == "model"
    return msg


def not_found_error(name: str, options: HubOptions) -> str:
    """Two lines: where the model was looked for, and how to get it."""
    with pytest.raises(InvalidRequest) as ei:
        resolve_model(name, options)
    msg = str(ei.value)
    assert msg.count("\n") == 1 and ei.value.code == "model_not_found"
    return msg


def test_first_download_fetches_only_what_the_loader_reads_into_download_dir(hub, tiny_files, tmp_path):
    hub.requests.clear()
    src = resolve_model("tiny-org/tiny-llama", opts(hub, tmp_path / "dl"))
    sha = hub.repos["tiny-org/tiny-llama"].revisions["main"].sha
    assert src.path == tmp_path / "dl" / "models--tiny-org--tiny-llama" / "snapshots" / sha
    assert src.gguf_file is None and repo_files(src.path) == tiny_files  # byte for byte, nothing else
    assert hub.files_fetched() == set(tiny_files)  # no .bin, original/, consolidated*, README
    assert any(r.startswith("HEAD /tiny-org/tiny-llama/resolve/") for r in hub.requests)
    assert not (tmp_path / "default-cache").exists()  # --download-dir replaced the HF cache
    assert load_config(src).model_type == "llama"


def test_cache_is_used_with_the_hub_stopped_and_offline_keeps_todays_error(tiny_files, tmp_path, monkeypatch):
    own = LocalHub()
    own.add("tiny-org/tiny-llama", tiny_files)
    own.add("tiny-org/tiny-gguf", {"tiny-Q4_K_M.gguf": b"GGUF q4", "tiny-Q8_0.gguf": b"GGUF q8"})
    first = resolve_model("tiny-org/tiny-llama", opts(own, tmp_path))
    gguf = resolve_model("tiny-org/tiny-gguf:q8_0", opts(own, tmp_path))
    own.stop()  # HF_HUB_OFFLINE stays unset: any request now would fail
    assert resolve_model("tiny-org/tiny-llama", opts(own, tmp_path)) == first
    assert resolve_model("tiny-org/tiny-gguf:q8_0", opts(own, tmp_path)) == gguf
    # a repo not in the cache, hub unreachable: today's error, saying what was tried
    msg = not_found_error("tiny-org/other", opts(own, tmp_path))
    assert "could not be reached" in msg and \
        f"`hf download tiny-org/other --cache-dir {tmp_path}` on a" in msg
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert resolve_model("tiny-org/tiny-llama", opts(own, tmp_path)) == first
    msg = not_found_error("tiny-org/other", opts(own, tmp_path))
    local = models_dir() / "tiny-org/other"
    assert msg == ("model 'tiny-org/other' not found; looked in: path 'tiny-org/other'; local store "
                   f"{local}; HF cache for tiny-org/other (HF_HUB_OFFLINE: no download)\nTo get it: `hf "
                   f"download tiny-org/other --cache-dir {tmp_path}` on a machine with network, then copy "
                   f"{tmp_path} here; or put an HF folder / .gguf file in the local store")
    msg = not_found_error("tiny-org/other-gguf:Q8_0", HubOptions(revision="v2"))  # the one file, the revision
    assert "`hf download tiny-org/other-gguf --include '*Q8_0*.gguf' --revision v2` on a machine" in msg
    assert "then copy ~/.cache/huggingface here" in msg


def test_401_404_gated_revision_and_bin_only_are_one_line_each(hub, tmp_path, monkeypatch):
    o = opts(hub, tmp_path)
    msg = one_line_error("tiny-org/private-llama", o)
    assert "401" in msg and "set HF_TOKEN" in msg
    assert "does not exist on " + hub.url in one_line_error("tiny-org/nope", o)
    msg = one_line_error("tiny-org/gated-llama", o)
    assert "is gated" in msg and f"{hub.url}/tiny-org/gated-llama" in msg and "HF_TOKEN" in msg
    assert "no revision 'v9'" in one_line_error("tiny-org/tiny-llama", opts(hub, tmp_path, revision="v9"))
    assert "no *.safetensors weights" in one_line_error("tiny-org/bin-only", o)
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    assert "has no access" in one_line_error("tiny-org/private-llama", o)
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # huggingface_hub sends it: the private repo downloads
    assert (resolve_model("tiny-org/private-llama", o).path / "model.safetensors").is_file()


def test_a_dropped_download_resumes_where_it_broke_off(hub, tiny_files, tmp_path, monkeypatch):
    """huggingface_hub continues a file whose connection dropped with a Range request from the bytes it
    kept (whole chunks: 1 MiB here), after its own 1 s back-off, rather than fetching it again."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 20)
    data = tiny_files["model.safetensors"]
    hub.ranges.clear()
    hub.cut_once.add("model.safetensors")
    src = resolve_model("tiny-org/tiny-llama", opts(hub, tmp_path))
    assert (src.path / "model.safetensors").read_bytes() == data
    [resumed] = hub.ranges
    path, offset = resumed.split(" from ")
    assert path == f"/cdn/{hashlib.sha256(data).hexdigest()}/model.safetensors" and \
        0 < int(offset) <= len(data) // 2


def test_short_names_resolve_to_their_repo_and_an_embedded_one_never_downloads(hub, tiny_files, tmp_path,
                                                                                monkeypatch):
    (tmp_path / "registry.json").write_text(json.dumps({
        "tiny": {"repo": "tiny-org/tiny-llama"},
        "tiny-embedded": {"repo": "tiny-org/tiny-llama", "embedded": True}}))
    monkeypatch.setenv("NANOSERVE_MODELS_DIR", str(tmp_path))
    hub.requests.clear()
    assert resolve_model("tiny-embedded", opts(hub, tmp_path / "dl")).gguf_file == EMBEDDED_GGUF
    assert hub.requests == []  # not cached: the embedded copy, no download
    src = resolve_model("tiny", opts(hub, tmp_path / "dl"))
    assert src.name == "tiny" and repo_files(src.path) == tiny_files
    assert resolve_model("tiny-embedded", opts(hub, tmp_path / "dl")).path == src.path  # now cached: the repo


def test_revision_is_its_own_snapshot(hub, tmp_path):
    v1 = resolve_model("tiny-org/tiny-llama", opts(hub, tmp_path, revision="v1"))
    main = resolve_model("tiny-org/tiny-llama", opts(hub, tmp_path))
    revs = hub.repos["tiny-org/tiny-llama"].revisions
    assert (v1.path.name, main.path.name) == (revs["v1"].sha, revs["main"].sha)
    assert json.loads((v1.path / "generation_config.json").read_text()) == {"temperature": 0.25}
    by_commit = resolve_model("tiny-org/tiny-llama", opts(hub, tmp_path, revision=revs["v1"].sha))
    assert by_commit.path == v1.path


def test_gguf_by_quant_tag_or_file_name_downloads_that_file_only(hub, tmp_path):
    hub.requests.clear()
    src = resolve_model("tiny-org/tiny-gguf:Q8_0", opts(hub, tmp_path))
    assert src.gguf_file == "tiny-Q8_0.gguf" and (src.path / src.gguf_file).read_bytes() == b"GGUF q8_0"
    assert hub.files_fetched() == {"tiny-Q8_0.gguf"}
    named = resolve_model("tiny-org/tiny-gguf", opts(hub, tmp_path, gguf_file="tiny-Q4_K_M.gguf"))
    assert named.gguf_file == "tiny-Q4_K_M.gguf" and named.path == src.path
    # llama.cpp's default
    assert resolve_model("tiny-org/tiny-gguf", opts(hub, tmp_path)).gguf_file == "tiny-Q4_K_M.gguf"
    msg = one_line_error("tiny-org/tiny-gguf:Q5_K", opts(hub, tmp_path / "other"))
    assert "no .gguf file tagged Q5_K" in msg and "tiny-Q4_K_M.gguf, tiny-Q8_0.gguf" in msg
    assert "has no file 'x.gguf'" in one_line_error("tiny-org/tiny-gguf",
                                                    opts(hub, tmp_path, gguf_file="x.gguf"))
    local = tmp_path / "two-ggufs"  # --gguf-file also picks one .gguf of a local folder
    local.mkdir()
    for f in ("a-Q4_0.gguf", "a-Q8_0.gguf"):
        (local / f).write_bytes(b"GGUF")
    assert resolve_model(str(local), HubOptions(gguf_file="a-Q8_0.gguf")).gguf_file == "a-Q8_0.gguf"


@pytest.mark.server  # (imported here, so that the in-process tests above stay in `make test-fast`)
def test_server_downloads_and_serves_then_the_engine_starts_from_the_cache_with_the_hub_stopped(tiny_files,
                                                                                                 tmp_path):
    """The issue's check. One real server start (seconds): `nanoserve --model tiny-org/tiny-llama
    --download-dir DIR` against the hub through HF_ENDPOINT downloads into DIR and serves; then, the hub
    stopped, an engine starts from that cache and generates the same text (in-process: LLM() runs the
    engine core's own resolve_model, which saves a second server start)."""
    from server_fixture import ServerProcess
    from nanoserve.llm import LLM
    from nanoserve.sampling_params import SamplingParams
    own = LocalHub()
    own.add("tiny-org/tiny-llama", tiny_files | NOT_NEEDED)
    hf_home, cache = tmp_path / "hf", tmp_path / "dl"
    env = {"HF_ENDPOINT": own.url, "HF_HOME": str(hf_home), "HF_HUB_CACHE": str(hf_home / "hub"),
           "HF_HUB_OFFLINE": "0", "HF_TOKEN": ""}
    try:
        srv = ServerProcess("--model", "tiny-org/tiny-llama", "--download-dir", str(cache),
                            "--dtype", "float32", "--no-engine-process", env=env)
        try:
            client = srv.client()
            assert [m.id for m in client.models.list().data] == ["tiny-org/tiny-llama"]
            out = client.completions.create(model="tiny-org/tiny-llama", prompt="Hello", max_tokens=4,
                                            temperature=0, extra_body={"ignore_eos": True})
            served = out.choices[0].text
            assert out.usage.completion_tokens == 4
        finally:
            srv.stop()
        assert own.files_fetched() == set(tiny_files)
        assert (cache / "models--tiny-org--tiny-llama").is_dir() and not (hf_home / "hub").exists()
    finally:
        own.stop()
    own.requests.clear()
    with LLM("tiny-org/tiny-llama", download_dir=str(cache), dtype="float32", kv_cache_gb=0.05) as llm:
        again = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert own.requests == []  # nothing was asked of the (stopped) hub
    assert again.outputs[0].text == served  # the same weights, greedy


@pytest.mark.parametrize("placement", ["--engine-process", "--no-engine-process"])
def test_the_server_prints_a_model_not_found_once_in_at_most_three_lines(tmp_path, placement):
    """The real CLI, offline, asked for a repo its (empty) HF cache lacks: exit code 2 and the error once,
    whichever side found it, with a download command that exists in huggingface_hub 1.x/2.x."""
    from server_fixture import start_errors
    code, stderr, errors = start_errors("--model", "tiny-org/not-cached", placement,
                                        env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)})
    assert code == 2, stderr
    [error] = errors
    assert len(error) <= 3 and len("\n".join(error)) < 500, error
    assert stderr.count("not found") == 1 and "`hf download tiny-org/not-cached` on a machine" in error[-1]
    assert "huggingface-cli" not in stderr
