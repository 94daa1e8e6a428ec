"""Model resolution: short names, the local store, .gguf paths, the embedded default."""
from __future__ import annotations

import json

from nanoserve.models.loader import EMBEDDED_GGUF, materialize, resolve_model


def test_short_name_resolves_from_local_store(tiny_model, tmp_path, monkeypatch):
    (tmp_path / "registry.json").write_text(json.dumps({"tiny-llama": {"repo": "example-org/tiny-llama"}}))
    (tmp_path / "tiny-llama").symlink_to(tiny_model, target_is_directory=True)
    monkeypatch.setenv("NANOSERVE_MODELS_DIR", str(tmp_path))
    src = resolve_model("tiny-llama")
    assert src.path == tmp_path / "tiny-llama" and src.gguf_file is None


def test_embedded_default_and_gguf_path():
    default = resolve_model(None)
    assert default.gguf_file == EMBEDDED_GGUF
    by_path = resolve_model(str(default.path / default.gguf_file))
    assert (by_path.path, by_path.gguf_file) == (default.path, default.gguf_file)
    by_name = resolve_model("smollm2-135m-instruct")  # the HF cache first, else the embedded GGUF
    assert by_name.gguf_file == EMBEDDED_GGUF or (by_name.path / "config.json").exists()
    folder = materialize(default).path
    assert (folder / "config.json").exists() and (folder / "model.safetensors").exists()
    assert materialize(default).path == folder  # converted once, then reused
