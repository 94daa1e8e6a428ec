"""`nanoserve`: serve a model over an OpenAI-compatible HTTP API.

    nanoserve                                      # embedded SmolLM2-135M-Instruct, 127.0.0.1:8000
    nanoserve --model llama-3-8b --host-cache-gb 48 --port 8000
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading


log = logging.getLogger("nanoserve.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nanoserve", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Serve an LLM over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics, /version).")
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None,
                   help="model to serve: a short name from the local registry (models/), an HF folder, a "
                        "GGUF file, or a hub id; default: the embedded SmolLM2-135M-Instruct")
    m.add_argument("--tokenizer", default=None, help="tokenizer to use instead of the model's own")
    m.add_argument("--served-model-name", default=None,
                   help="model name reported by /v1/models and accepted in requests "
                        "(default: the model's own name)")
    m.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and activation dtype; auto = bf16 on CUDA and on CPUs with fast bf16, else fp32")
    m.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where to run the model; auto = cuda if torch sees a GPU, else cpu")
    m.add_argument("--attention-backend", default="auto", choices=["auto", "flash", "torch"],
                   help="flash = flash-attn 2.8 paged kernels (fp16/bf16, block size a multiple of 256); "
                        "torch = portable backend; auto = flash when flash_attn imports and the device is CUDA")
    m.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    m.add_argument("--max-model-len", type=int, default=None,
                   help="context length (prompt + completion) in tokens; default: the model's own, "
                        "capped by the KV cache capacity")
    m.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template file overriding the model's own")
    m.add_argument("--seed", type=int, default=0, help="global seed (per-request seeds override it)")
    kv = p.add_argument_group("KV cache")
    kv.add_argument("--block-size", type=int, default=0,
                    help="tokens per KV block; 0 = backend default (16 on CPU, 256 on CUDA); the flash "
                         "backend needs a multiple of 256")
    g = kv.add_mutually_exclusive_group()
    g.add_argument("--kv-cache-gb", type=float, default=None,
                   help="device KV cache budget in GiB (default: from free memory)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: fraction of GPU memory the server may use (weights + KV cache)")
    kv.add_argument("--host-cache-gb", type=float, default=0.0,
                    help="second prefix-cache tier in host memory, in GiB; 0 = off")
    kv.add_argument("--host-offload-watermark", type=int, default=0, metavar="BLOCKS",
                    help="override: device blocks the cleaner keeps reusable without losing cached KV "
                         "(cold blocks are copied to the host tier ahead of eviction); 0 = sized from "
                         "observed demand (the default)")
    kv.add_argument("--no-prefix-caching", action="store_true",
                    help="disable prefix caching (every prompt is computed in full)")
    s = p.add_argument_group("scheduling")
    s.add_argument("--max-num-seqs", type=int, default=128, help="most sequences in one batch")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one engine step (prefill chunks + decodes)")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine core (schedule -> forward -> sample) in its own process, talking to "
                        "this API process over zmq; --no-engine-process runs it in a thread of this process")
    s.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="engine compute threads on CPU; default: all cores but one when there are >= 2. With "
                        "--engine-process the API process is pinned to one core and the engine to the others "
                        "(unless N asks for every core: then they share them)")
    s.add_argument("--max-queue", type=int, default=None,
                   help="most requests allowed to wait for a batch slot; beyond it new requests get "
                        "HTTP 503 with Retry-After (default: unbounded)")
    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    h.add_argument("--port", type=int, default=8000, help="port to listen on")
    h.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
                        "(/health, /metrics and /version stay open); default: $NANOSERVE_API_KEY, or no key")
    h.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: new requests get 503 and in-flight ones may finish for this many "
                        "seconds; what is still running then gets a 503 error (JSON, or an SSE error event)")
    h.add_argument("--max-request-bytes", type=int, default=16 << 20,
                   help="largest request body accepted; larger ones get HTTP 413")
    h.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log level of the server and the engine")
    return p


def _draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """On the first SIGTERM/SIGINT: refuse new requests (503), let in-flight ones run for
        `timeout` seconds, then fail the rest with a clean 503 so every client gets an answer."""

        def __init__(self, config, server, aengine, timeout: float) -> None:
            super().__init__(config)
            self.api, self.aengine, self.timeout = server, aengine, timeout
            self.deadline: threading.Timer | None = None

        def handle_exit(self, sig, frame) -> None:
            if self.deadline is None:
                log.info("shutting down: draining in-flight requests for up to %.0fs", self.timeout)
                self.api.draining = True
                self.deadline = threading.Timer(self.timeout, self.aengine.fail_all, [
                    f"the server is shutting down (--shutdown-timeout {self.timeout:g}s passed)"])
                self.deadline.daemon = True
                self.deadline.start()
            super().handle_exit(sig, frame)

    return DrainingServer


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    for name, v in (("--max-queue", args.max_queue), ("--max-num-seqs", args.max_num_seqs),
                    ("--max-num-batched-tokens", args.max_num_batched_tokens)):
        if v is not None and v < (0 if name == "--max-queue" else 1):
            build_parser().error(f"{name} must be >= {0 if name == '--max-queue' else 1}, got {v}")

    import uvicorn

    from nanoserve.config import EngineConfig
    from nanoserve.engine.async_engine import AsyncEngine
    from nanoserve.engine.client import EngineClient, EngineStartError
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.engine.placement import apply_api_placement, apply_engine_placement, plan_placement
    from nanoserve.server.app import create_app
    from nanoserve.server.metrics import ServerMetrics
    DrainingServer = _draining_server_class()

    serving: list = []  # the uvicorn server once it exists

    def stop_serving(reason: str) -> None:
        # the engine process died: its requests have been failed already; stop serving (exit 1)
        # so that a supervisor restarts the whole server
        for server in serving:
            server.should_exit = True

    try:
        config = EngineConfig(
            model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
            block_size=args.block_size, kv_cache_gb=args.kv_cache_gb,
            gpu_memory_utilization=args.gpu_memory_utilization, host_cache_gb=args.host_cache_gb,
            host_offload_watermark=args.host_offload_watermark,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
            chat_template=args.chat_template, seed=args.seed,
            attention_backend=args.attention_backend, enforce_eager=args.enforce_eager)
        placement = plan_placement(config.resolved_device().type, args.cpu_threads, args.engine_process)
        log.info("CPU placement: %s", placement.describe())
        if args.engine_process:
            aengine = EngineClient(config, placement=placement, log_level=args.log_level,
                                   on_dead=stop_serving)
            aengine.start()
            apply_api_placement(placement)
            model_name = aengine.frontend.model_name
        else:
            apply_engine_placement(placement)
            engine = LLMEngine(config)
            aengine = AsyncEngine(engine)
            model_name = engine.model_name
    except (ValueError, FileNotFoundError, OSError, EngineStartError) as e:
        log.error("cannot start: %s", e)
        return 2
    name = args.served_model_name or model_name
    aengine.observer = ServerMetrics(name)
    app = create_app(aengine, name, args.api_key, args.max_queue, args.max_request_bytes)

    # uvicorn's own grace period is a little longer than ours, so that requests we fail at the
    # deadline still get to send their 503 / SSE error before connections are closed
    uv = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                       timeout_graceful_shutdown=args.shutdown_timeout + 5),
                        app.state.server, aengine, args.shutdown_timeout)
    # uvicorn re-raises the signal it caught once it has shut down gracefully; with the default
    # handler that would kill the process (exit 143). A no-op handler makes a SIGTERM exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    serving.append(uv)
    if getattr(aengine, "exit_reason", None):  # it died before `serving` held the server
        uv.should_exit = True
    log.info("serving %s on http://%s:%d (api key %s, max queue %s)", name, args.host, args.port,
             "required" if args.api_key else "off", args.max_queue if args.max_queue is not None else "unbounded")
    try:
        uv.run()
    except KeyboardInterrupt:
        pass
    finally:
        aengine.stop()
    if not uv.started:
        log.error("the HTTP server did not start (is port %d free?)", args.port)
        return 1
    if getattr(aengine, "exit_reason", None):
        log.error("exiting because %s", aengine.exit_reason)
        return 1
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
