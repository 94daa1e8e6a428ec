"""Shared fixtures: tiny random Llama-family checkpoints written to disk, the embedded model, and
an HF transformers reference for greedy decoding."""
from __future__ import annotations

import os
import random
import zlib
from pathlib import Path

import pytest
import torch

from nanoserve.models.loader import embedded_source, materialize

# The KV budget of in-process engines whose test does not size the cache itself, as the test servers'
# --kv-cache-gb: the CPU default (up to 4 GiB, zeroed at start) costs seconds of CPU per engine.
KV_GB = 0.25

TINY_CONFIGS = {
    # name: (model class name, config overrides)
    "llama-gqa-tied": ("LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                tie_word_embeddings=True)),
    "llama-mha-untied": ("LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=4,
                                                  tie_word_embeddings=False)),
    "qwen2-bias": ("Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                            tie_word_embeddings=False)),
    "llama3-rope-scaling": ("LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1,
                            tie_word_embeddings=False,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # q/k norms, head_dim apart from hidden / heads
    "qwen3-qk-norm": ("Qwen3ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                               tie_word_embeddings=True)),
    # a window shorter than most test prompts on the first layer, a global second layer with another RoPE
    # base, a query scale apart from head_dim's, Gemma's norms and GELU
    "gemma3-window": ("Gemma3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=8, query_pre_attn_scalar=48,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
}
CONFIG_CLASSES = {"LlamaForCausalLM": "LlamaConfig", "Qwen2ForCausalLM": "Qwen2Config",
                  "Qwen3ForCausalLM": "Qwen3Config", "Gemma3ForCausalLM": "Gemma3TextConfig"}


# The servers and engine processes the tests start check the KV invariants whenever their engine goes
# idle (a served engine checks them only after a failed step).
os.environ.setdefault("NANOSERVE_CHECK_INVARIANTS", "1")

# Under pytest-xdist (`make test`: 2 workers on 2 cores) each worker's in-process torch gets its share
# of the cores: two workers' OpenMP pools of every core each would spin against each other.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))
                              // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(autouse=True)
def _keep_cpu_placement():
    """An in-process tensor-parallel engine pins this process to rank 0's cores and cuts torch's
    threads; put both back so later tests (and the servers they start, which inherit the
    affinity) keep every core."""
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    yield
    if os.sched_getaffinity(0) != cpus:
        os.sched_setaffinity(0, cpus)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


# The files that take longest, longest first: `make test` hands whole files to its two workers in this
# order (--dist loadfile --no-loadscope-reorder), so none of them starts last and runs alone. The
# tensor-parallel file's rank processes want cores of their own: it starts beside test_gpu_check.py, whose
# work is one single-threaded subprocess (beside test_correctness.py instead, one run took ~20 s longer).
HEAVY_FIRST = ["test_gpu_check.py", "test_tensor_parallel.py", "test_flash_attention.py",
               "test_triton_attention.py", "test_correctness.py", "test_host_tier.py",
               "test_server_host_tier.py", "test_kernel_build.py", "test_triton_fused.py",
               "test_server_options.py", "test_engine_process.py", "test_server_api.py", "test_hub.py",
               "test_chat_templates.py", "test_kvcache.py"]


def pytest_collection_modifyitems(items) -> None:
    """`server`: the test starts a real server or an engine core (seconds each); `make test-fast`
    (pytest -m "not server") leaves them out while developing. CI runs everything but `model_file` tests,
    which read a real model file for minutes: `make test-models` (NANOSERVE_MODEL_FILE_TESTS=1) runs them."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    for item in items:
        if ("server" in item.fixturenames
                or any(hasattr(item.module, n) for n in ("ServerProcess", "EngineClient"))):
            item.add_marker(pytest.mark.server)
        if "model_file" in item.keywords and os.environ.get("NANOSERVE_MODEL_FILE_TESTS") != "1":
            item.add_marker(pytest.mark.skip(reason="a real model file's check: `make test-models` runs it"))


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    """The embedded model as an HF folder (converted from its GGUF once, then cached)."""
    return materialize(embedded_source()).path


def make_tiny_model(out: Path, name: str, tokenizer_dir: Path) -> Path:
    import transformers
    from transformers import AutoTokenizer
    cls_name, overrides = TINY_CONFIGS[name]
    cfg_cls = getattr(transformers, CONFIG_CLASSES[cls_name])
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    overrides = {"rope_theta": 10000.0, **overrides}
    cfg = cfg_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **overrides)
    torch.manual_seed(zlib.crc32(name.encode()))  # not hash(): salted per process, so not replayable
    model = getattr(transformers, cls_name)(cfg).float()
    with torch.no_grad():  # larger weights than the init default give peaked, tie-free logits
        for pname, p in model.named_parameters():
            if "norm" not in pname:
                p.normal_(0, 0.08 if p.dim() == 2 else 0.05)
            elif not name.startswith("llama"):  # norms away from their identity, so each is seen to count
                p.add_(torch.randn_like(p), alpha=0.1)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory, embedded_dir):
    """tiny_path(name): that tiny model, written once per session (it is the same for a name)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_tiny_model(tmp_path_factory.mktemp(name), name, embedded_dir)
        return made[name]
    return get


@pytest.fixture(scope="session", params=list(TINY_CONFIGS))
def tiny_model(request, tiny_path) -> Path:
    return tiny_path(request.param)


def hf_greedy(model_dir_or_model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation with HF transformers' own forward (fp32), recomputing from scratch."""
    from transformers import AutoModelForCausalLM
    model = model_dir_or_model
    if isinstance(model, (str, Path)):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(max_new_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            outs.append(ids[len(p):])
    return outs


def random_prompts(n: int, lo: int, hi: int, vocab: int = 49152, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# One server with the default options for every module that does not start its own (a module-level
# `server` fixture with other options overrides this one), plus auto tool choice (the structured tests
# send tools with tool_choice "auto"); the embedded model gets the Hermes-style tool prompt.
@pytest.fixture(scope="session")
def server():
    from server_fixture import ServerProcess
    s = ServerProcess("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    return server.client()


@pytest.fixture(scope="session")
def model(client):
    return client.models.list().data[0].id
