"""Engine and server configuration: dataclasses validated once (`__post_init__`), passed down
explicitly. The command line is generated from their fields: help text, choices and flag spelling
live in each field's metadata, so a setting is declared in exactly one place."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import typing
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a device or dtype is resolved: the API process never does
    import torch

DTYPES = ("auto", "float32", "bfloat16", "float16")
TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # formats server/tools.py reads tool calls in


def opt(default, help: str, **cli) -> typing.Any:
    """A field that is also a command-line flag. `cli` keys: choices, metavar, group, flag (spelling
    other than --field-name; for a bool defaulting to True, a flag that turns it off), aliases (more
    spellings), negatable (--x/--no-x), off_aliases (more spellings of --no-x, kept out of --help), mutex
    (name of a mutually exclusive set)."""
    return field(default=default, metadata={"help": help, **cli})


STEP_TOKENS = {"cpu": 1024, "cuda": 2048}  # default token budget of an engine step, by device
ZMQ_TRANSPORTS = ("tcp://", "ipc://", "inproc://")
JSON_KINDS = {bool: "true or false", int: "an integer", str: "a string", type(None): "null"}


@dataclass
class KVEventsConfig:
    """vLLM's KVEventsConfig (--kv-events-config JSON), field for field, with its defaults."""
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" when enabled, else "null" (as vLLM resolves it)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000    # batches kept for replay
    hwm: int = 100_000            # batches PUB queues for a slow subscriber before dropping
    max_queue_size: int = 100_000  # batches waiting for the publisher thread before dropping
    topic: str = ""

    def __post_init__(self) -> None:
        def refuse(name: str, what: str) -> typing.NoReturn:
            raise ValueError(f"--kv-events-config {name} {what}, got {json.dumps(getattr(self, name), default=repr)}")
        hints = typing.get_type_hints(KVEventsConfig)
        for f in fields(self):
            value, kinds = getattr(self, f.name), typing.get_args(hints[f.name]) or (hints[f.name],)
            if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
                refuse(f.name, "must be " + " or ".join(JSON_KINDS[k] for k in kinds))
        self.publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("null", "zmq"):
            refuse("publisher", 'must be "null" or "zmq"')
        for name in ("endpoint", "replay_endpoint"):
            if getattr(self, name) is not None and not getattr(self, name).startswith(ZMQ_TRANSPORTS):
                refuse(name, "must be tcp://HOST:PORT (or ipc://PATH)")
        for name, least in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            if getattr(self, name) < least:
                refuse(name, f"must be >= {least}")

    @classmethod
    def of(cls, value: str | dict | KVEventsConfig | None, endpoint: str | None) -> KVEventsConfig | None:
        """The flag's JSON (or a dict, or one), with --kv-events-endpoint's shorthand applied: it turns
        events on at that endpoint. None when events are off."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--kv-events-config is not JSON: {e}") from None
        if isinstance(value, dict):
            if not_vllms := set(value) - {f.name for f in fields(cls)}:
                raise ValueError(f"--kv-events-config: unknown field {sorted(not_vllms)[0]!r} (vLLM's are "
                                 f"{', '.join(f.name for f in fields(cls))})")
            value = cls(**value)
        if value is not None and not isinstance(value, cls):
            raise ValueError(f"--kv-events-config must be a JSON object, got {value!r}")
        if endpoint:
            if not endpoint.startswith(ZMQ_TRANSPORTS):
                raise ValueError(f"--kv-events-endpoint must be tcp://HOST:PORT (or ipc://PATH), got "
                                 f"{endpoint!r}")
            value = replace(value or cls(), enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
        return value if value is not None and value.enable_kv_cache_events and value.publisher == "zmq" else None


@dataclass
class EngineConfig:
    model: str | None = opt(None, "model to serve: a short name from the local registry (models/), an HF "
                            "folder, a GGUF file, or a hub id (owner/name, or owner/name:QUANT for one .gguf "
                            "of a GGUF repo: found in the HF cache, else downloaded unless HF_HUB_OFFLINE is "
                            "set; HF_TOKEN for private and gated repos); default: the embedded "
                            "SmolLM2-135M-Instruct", group="model")
    revision: str | None = opt(None, "branch, tag or commit of a hub --model (default: main)", group="model")
    download_dir: str | None = opt(None, "Hugging Face cache folder where hub models are looked up and "
                                   "downloaded (default: $HF_HUB_CACHE, i.e. ~/.cache/huggingface/hub)",
                                   metavar="DIR", group="model")
    gguf_file: str | None = opt(None, "the .gguf file to serve from a hub --model repo (or a local folder) "
                                "holding several; default: the one owner/name:QUANT tags, the only one, or "
                                "the Q4_K_M one", metavar="NAME", group="model")
    tokenizer: str | None = opt(None, "tokenizer to use instead of the model's own", group="model")
    dtype: str = opt("auto", "weight and activation dtype; auto = bf16 on CUDA and on CPUs with fast bf16, "
                     "else fp32 ($NANOSERVE_DTYPE overrides auto)", choices=DTYPES, group="model")
    device: str = opt("auto", "where to run the model; auto = cuda if torch sees a GPU, else cpu",
                      choices=("auto", "cpu", "cuda"), group="model")
    attention_backend: str = opt("auto", "flash = flash-attn 2.8 paged kernels (fp16/bf16, block size a "
                                 "multiple of 256); triton = Triton paged kernels (CUDA, any block size, "
                                 "CUDA graphs, no extra package); torch = portable backend; auto = flash "
                                 "when flash_attn imports and runs, else triton on CUDA, else torch",
                                 choices=("auto", "flash", "triton", "torch"), group="model")
    enforce_eager: bool = opt(False, "CUDA: run decode steps eagerly instead of replaying CUDA graphs",
                              group="model")
    max_model_len: int | None = opt(None, "context length (prompt + completion) in tokens; default: the "
                                    "model's own, capped by the KV cache capacity", group="model")
    chat_template: str | None = opt(None, "Jinja chat template file overriding the model's own",
                                    metavar="FILE", group="model")
    seed: int = opt(0, "global seed (per-request seeds override it)", group="model")
    load_format: str = opt("auto", "auto = read the weights; dummy = random weights made on the device "
                           "(benchmarks, as vLLM's --load-format dummy)", choices=("auto", "dummy"),
                           group="model")
    gguf_dequantize: bool = opt(False, "GGUF: dequantize every tensor at load (to an fp32 HF folder in the "
                                "cache, then --dtype) instead of keeping Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K "
                                "tensors in their blocks", group="model")
    quantization: str | None = opt(None, "fp8 = CUDA: cast bf16/fp16 projection weights to fp8 e4m3 at load, "
                                   "per-channel scales (fp8 GEMMs with per-token activation scales on "
                                   "compute capability >= 8.9, else a weight-only Triton kernel); GGUF "
                                   "Q8_0/Q4_0/Q4_1 stay quantized without it",
                                   choices=("fp8",), group="model")
    block_size: int = opt(0, "tokens per KV block; 0 = backend default (flash 256, triton 16, torch: 16 on "
                          "CPU, 256 on CUDA); the flash backend needs a multiple of 256", group="KV cache")
    kv_cache_gb: float | None = opt(None, "device KV cache budget in GiB (default: from free memory)",
                                    group="KV cache", mutex="kv budget")
    gpu_memory_utilization: float = opt(0.9, "CUDA: fraction of GPU memory the server may use (weights + "
                                        "KV cache)", group="KV cache", mutex="kv budget")
    num_kv_blocks: int | None = opt(None, "exact device KV block count (tests); overrides --kv-cache-gb",
                                    group="KV cache")
    host_cache_gb: float = opt(0.0, "second prefix-cache tier in host memory, in GiB; 0 = off",
                               group="KV cache")
    disk_cache_gb: float = opt(0.0, "third prefix-cache tier on local disk, in GiB, below the host tier "
                               "(needs --host-cache-gb): host blocks are written through to it, and it is "
                               "kept across restarts; 0 = off", group="KV cache")
    disk_cache_dir: str | None = opt(None, "directory of the disk tier (created 0700; default: "
                                     "$NANOSERVE_CACHE_DIR/kv/MODEL, else ~/.cache/nanoserve/kv/MODEL)",
                                     metavar="DIR", group="KV cache")
    host_offload_watermark: int = opt(0, "override: device blocks the cleaner keeps reusable without losing "
                                      "cached KV (cold blocks are copied to the host tier ahead of "
                                      "eviction); 0 = sized from observed demand (the default)",
                                      metavar="BLOCKS", group="KV cache")
    enable_prefix_caching: bool = opt(True, "reuse the KV cache of prompt prefixes computed before; "
                                      "--no-enable-prefix-caching (or --no-prefix-caching) computes every "
                                      "prompt in full", negatable=True, off_aliases=("--no-prefix-caching",),
                                      group="KV cache")
    kv_events_config: str | KVEventsConfig | None = opt(
        None, "publish which KV blocks each tier stores and drops, for a prefix-aware router, as vLLM does: "
        "its KVEventsConfig JSON, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
        "\"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv\"}' (ZMQ; tcp://*:PORT binds, tcp://HOST:PORT "
        "connects to a subscriber that binds; no authentication: a trusted network only); block hashes are "
        "64-bit ints unless $VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0", metavar="JSON", group="KV cache")
    kv_events_endpoint: str | None = opt(None, "shorthand for --kv-events-config '{\"enable_kv_cache_events\": "
                                         "true, \"endpoint\": ENDPOINT}' (with it: sets its endpoint)",
                                         metavar="ENDPOINT", group="KV cache")
    # Python API only: KV events' block hashes, as vLLM's $VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES says (read
    # once, here): 64-bit ints (its default), or the 32-byte digests
    kv_events_int_hashes: bool | None = None
    async_scheduling: bool | None = opt(None, "schedule step N+1 while step N's kernels run, its sampled "
                                        "tokens fed to N+1 on the device; default: on with CUDA, off on CPU, "
                                        "where the host's work would take cores from the forward "
                                        "($NANOSERVE_ASYNC_SCHEDULING=1|0 sets the default)",
                                        negatable=True, group="scheduling")
    max_num_seqs: int = opt(128, "most sequences in one batch", group="scheduling")
    max_num_batched_tokens: int | None = opt(None, "token budget of one engine step (prefill chunks + "
                                             "decodes); default: 1024 on CPU, 2048 on CUDA",
                                             group="scheduling")
    tensor_parallel_size: int = opt(1, "shard the model over N ranks (Megatron-style tensor parallelism: one "
                                    "scheduler, N workers; NCCL on CUDA; on CPU shared memory within a node, "
                                    "gloo between nodes)", metavar="N",
                                    aliases=("-tp",), group="distributed")
    nnodes: int = opt(1, "nodes the tensor-parallel ranks span (each holds N / nnodes of them)",
                      group="distributed")
    node_rank: int = opt(0, "this node's index; node 0 serves the API, the others only run workers",
                         group="distributed")
    master_addr: str | None = opt(None, "address of node 0, where the ranks "
                           "meet (default: $MASTER_ADDR, else 127.0.0.1)", group="distributed")
    master_port: int | None = opt(None, "port on node 0 where the ranks meet "
                           "(default: $MASTER_PORT, else a free port; needed with --nnodes > 1)",
                           group="distributed")
    distributed_timeout: float = opt(120.0, "seconds a rank waits for the others (start-up, and a collective "
                                     "inside a step) before the engine gives up with an error",
                                     group="distributed")
    # Python API only: where flash-attn's functions come from, "module" or "module:attribute" (tests
    # name a pure-torch stand-in, tests.flash_ref); a name, so it crosses to the engine process
    flash_attn_module: str = "flash_attn"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "flash", "triton", "torch"):
            raise ValueError("attention_backend must be auto|flash|triton|torch, got "
                             f"{self.attention_backend!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto|dummy, got {self.load_format!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto|cpu|cuda, got {self.device!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if (getattr(self, name) or 1) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.host_cache_gb < 0:
            raise ValueError("host_cache_gb must be >= 0")
        self.kv_events_config = KVEventsConfig.of(self.kv_events_config, self.kv_events_endpoint)
        if self.kv_events_int_hashes is None:
            flag = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
            if not flag.lstrip("-").isdigit():
                raise ValueError(f"$VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES must be 0 or 1, got {flag!r}")
            self.kv_events_int_hashes = bool(int(flag))
        self.master_addr = self.master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.master_port = self.master_port or int(os.environ.get("MASTER_PORT", "0"))
        tp, nodes = self.tensor_parallel_size, self.nnodes
        if tp < 1 or nodes < 1 or tp % nodes:
            raise ValueError(f"--tensor-parallel-size ({tp}) must be >= 1 and a multiple of --nnodes "
                             f"({nodes})")
        if not 0 <= self.node_rank < nodes:
            raise ValueError(f"--node-rank must be in [0, {nodes}), got {self.node_rank}")
        if nodes > 1 and not self.master_port:
            raise ValueError("--nnodes > 1 needs --master-port (or $MASTER_PORT) and --master-addr on every "
                             "node")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 or unset, got {self.quantization!r}")
        if self.quantization == "fp8":
            import torch
            if (device := self.resolved_device()).type != "cuda":
                raise ValueError("--quantization fp8 needs a CUDA GPU: this run is on the CPU (GGUF "
                                 "Q8_0/Q4_0/Q4_1 weights stay quantized there)")
            if self.resolved_dtype(device) == torch.float32:
                raise ValueError("--quantization fp8 computes in bf16 or fp16: drop --dtype float32")
        if self.disk_cache_gb < 0:
            raise ValueError("disk_cache_gb must be >= 0")
        if self.disk_cache_gb and not self.host_cache_gb:
            raise ValueError("--disk-cache-gb needs --host-cache-gb: disk blocks are read through the host "
                             "tier")
        if self.disk_cache_dir and not self.disk_cache_gb:
            raise ValueError("--disk-cache-dir needs --disk-cache-gb (the size of the disk tier)")
        if self.disk_cache_gb and self.tensor_parallel_size > 1:
            raise ValueError("--disk-cache-gb is not supported with --tensor-parallel-size > 1 yet")
        if self.host_cache_gb and not self.enable_prefix_caching:
            raise ValueError("--host-cache-gb needs prefix caching; drop --no-enable-prefix-caching")

    @property
    def step_tokens(self) -> int:
        """max_num_batched_tokens, or the device's default. CPU, serving the embedded model (2 cores): 1024
        against 2048 cut the mean TTFT to ~0.7x at concurrency 8 and 32 at the same or better output tok/s,
        and left cold prefill unchanged. Resolved on use: the API process never decides the device."""
        return self.max_num_batched_tokens or STEP_TOKENS[self.resolved_device().type]

    def resolved_device(self) -> torch.device:
        import torch
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch sees no CUDA device")
        return torch.device(self.device)

    def resolved_async_scheduling(self, device: torch.device) -> bool:
        """The flag, else $NANOSERVE_ASYNC_SCHEDULING (a whole test suite one way), else by device."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        env = os.environ.get("NANOSERVE_ASYNC_SCHEDULING", "")
        if env not in ("", "0", "1"):
            raise ValueError(f"$NANOSERVE_ASYNC_SCHEDULING must be 0 or 1, got {env!r}")
        return env == "1" if env else device.type == "cuda"

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        """An explicit dtype wins; `auto` honours $NANOSERVE_DTYPE (so a whole test suite or a
        deployment can force one), else picks by hardware."""
        import torch
        dtype = self.dtype if self.dtype != "auto" else os.environ.get("NANOSERVE_DTYPE", "auto")
        if dtype not in DTYPES:
            raise ValueError(f"$NANOSERVE_DTYPE must be auto|float32|bfloat16|float16, got {dtype!r}")
        if dtype != "auto":
            return getattr(torch, dtype)
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def import_by_name(name: str) -> typing.Any:
    """"module" or "module:attribute": how code is named where it must cross a process boundary."""
    module_name, _, attr = name.partition(":")
    obj = importlib.import_module(module_name)
    return getattr(obj, attr) if attr else obj


def cpu_has_fast_bf16() -> bool:
    """AVX-512 BF16 or AMX makes bf16 matmuls faster than fp32 on CPU; without them bf16 is emulated."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return any(f in flags for f in (" avx512_bf16", " amx_bf16"))


@dataclass
class ServerConfig:
    """The API process: HTTP, and where the engine core runs."""
    host: str = opt("127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)", group="HTTP")
    port: int = opt(8000, "port to listen on", group="HTTP")
    served_model_name: str | None = opt(None, "model name reported by /v1/models and accepted in requests "
                                        "(default: the model's own name)", group="HTTP")
    api_key: str | None = opt(None, "require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
                              "(/health, /metrics and /version stay open); default: $NANOSERVE_API_KEY, or "
                              "no key", group="HTTP")
    max_queue: int | None = opt(None, "most requests allowed to wait for a batch slot; beyond it new "
                                "requests get HTTP 503 with Retry-After (default: unbounded)",
                                group="scheduling")
    engine_process: bool = opt(True, "run the engine core (schedule -> forward -> sample) in its own "
                               "process, talking to this API process over zmq; --no-engine-process runs it "
                               "in a thread of this process", negatable=True, group="scheduling")
    cpu_threads: int | None = opt(None, "engine compute threads on CPU; default: all cores but one when "
                                  "there are >= 3 (the API process is then pinned to one core and the engine "
                                  "to the others), both on 2 cores (shared with the API process; 1 with "
                                  "--no-engine-process). N asking for every core shares them", metavar="N",
                                  group="scheduling")
    shutdown_timeout: float = opt(30.0, "on SIGTERM/SIGINT: new requests get 503 and in-flight ones may "
                                  "finish for this many seconds; what is still running then gets a 503 error "
                                  "(JSON, or an SSE error event)", group="HTTP")
    max_request_bytes: int = opt(16 << 20, "largest request body accepted; larger ones get HTTP 413",
                                 group="HTTP")
    log_level: str = opt("info", "log level of the server and the engine",
                         choices=("debug", "info", "warning", "error"), group="HTTP")
    enable_auto_tool_choice: bool = opt(False, "let the model decide whether to call a tool (tool_choice "
                                        "\"auto\", the default when a request has tools): its output is "
                                        "parsed for calls in the --tool-call-parser format; without it such "
                                        "requests get HTTP 400, as vLLM answers them", group="tools")
    tool_call_parser: str | None = opt(None, "the format auto tool choice reads calls in: hermes "
                                       "(<tool_call>{...}</tool_call>, Hermes / Qwen, and the embedded "
                                       "model's fallback tool prompt) or llama3_json ({\"name\", "
                                       "\"parameters\"} objects, Llama 3.x)", choices=TOOL_CALL_PARSERS,
                                       group="tools")

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get("NANOSERVE_API_KEY") or None
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"--cpu-threads must be >= 1, got {self.cpu_threads}")
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}")

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser auto tool choice uses, or None when it is off."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None


def add_flags(parser: argparse.ArgumentParser, *classes: type) -> None:
    """One flag per field of the config classes that carries help text, grouped as the fields say."""
    groups: dict[str, typing.Any] = {}
    for cls in classes:
        _add_class_flags(parser, cls, groups)


def _add_class_flags(parser: argparse.ArgumentParser, cls: type, groups: dict[str, typing.Any]) -> None:
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        meta = f.metadata
        if "help" not in meta:
            continue
        title = meta.get("group", "options")
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        group = groups[title]
        if "mutex" in meta:
            key = "mutex:" + meta["mutex"]
            if key not in groups:
                groups[key] = group.add_mutually_exclusive_group()
            group = groups[key]
        kw: dict[str, typing.Any] = {"dest": f.name, "help": meta["help"], "default": f.default}
        typ = hints[f.name]
        if typ is bool or meta.get("negatable"):
            kw["action"] = (argparse.BooleanOptionalAction if meta.get("negatable")
                            else "store_false" if f.default else "store_true")
        else:
            kw["type"] = next(t for t in typing.get_args(typ) or (typ,) if t is not type(None))
            kw.update({k: meta[k] for k in ("choices", "metavar") if k in meta})
        group.add_argument(meta.get("flag") or "--" + f.name.replace("_", "-"), *meta.get("aliases", ()),
                           **kw)
        for alias in meta.get("off_aliases", ()):  # an older spelling, still accepted
            group.add_argument(alias, dest=f.name, action="store_false", help=argparse.SUPPRESS)


def from_args(cls: type, args: argparse.Namespace):
    """`cls` from the parsed flags (fields without a flag keep their defaults)."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
