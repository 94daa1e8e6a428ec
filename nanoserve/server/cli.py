"""`nanoserve`: serve a model over an OpenAI-compatible HTTP API.

    nanoserve                                      # embedded SmolLM2-135M-Instruct, 127.0.0.1:8000
    nanoserve --model llama-3-8b --host-cache-gb 48 --port 8000
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from nanoserve.config import EngineConfig, ServerConfig, add_flags, from_args

log = logging.getLogger("nanoserve.server")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, unless the help text already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return text if "default" in text else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nanoserve", formatter_class=_HelpFormatter,
        description="Serve an LLM over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics, /version).")
    add_flags(p, EngineConfig, ServerConfig)
    return p


def _start_engine(config: EngineConfig, opts: ServerConfig, on_dead):
    """The engine core in its own process (the API process then keeps one core), or in a thread."""
    from nanoserve.client.engine_client import EngineClient
    from nanoserve.parallel.placement import PlacementRequest, apply_api_placement
    client = EngineClient(config, placement=PlacementRequest(opts.cpu_threads), log_level=opts.log_level,
                          on_dead=on_dead, in_process=not opts.engine_process)
    client.start()
    log.info("CPU placement: %s", client.placement.describe())
    if opts.engine_process:
        apply_api_placement(client.placement)
    return client


def _check_port(host: str, port: int) -> None:
    """Refuse a port that is taken before the model loads: uvicorn finds out only once it is loaded.
    (Binds as uvicorn does: SO_REUSEADDR, so a port left in TIME_WAIT passes.)"""
    try:
        socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET).close()
    except OSError as e:  # a bind error's errno, or a resolver's (negative) and its text
        reason = os.strerror(e.errno) if (e.errno or 0) > 0 else e.strerror or str(e)
        raise OSError(f"cannot listen on {host}:{port} (--host, --port): {reason}") from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config, opts = from_args(EngineConfig, args), from_args(ServerConfig, args)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=opts.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)

    if config.node_rank > 0:  # this node only runs tensor-parallel workers; node 0 serves the API
        from nanoserve.parallel.leader import run_node_workers
        return run_node_workers(config)

    from nanoserve.engine.protocol import EngineStartError
    from nanoserve.server.app import create_app
    from nanoserve.server.metrics import ServerMetrics
    from nanoserve.server.serving import run_server

    serving: list = []  # the uvicorn server once it exists

    def stop_serving(reason: str) -> None:
        # the engine core died: its requests have been failed already; stop serving (exit 1)
        # so that a supervisor restarts the whole server
        for server in serving:
            server.should_exit = True

    try:
        _check_port(opts.host, opts.port)
        aengine = _start_engine(config, opts, stop_serving)
    except (ValueError, OSError, EngineStartError) as e:  # the one place a start-up error is printed
        log.error("cannot start: %s", e)
        return 2
    model_name = aengine.frontend.model_name
    name = opts.served_model_name or model_name
    aengine.observer = ServerMetrics(name)
    app = create_app(aengine, name, opts.api_key, opts.max_queue, opts.max_request_bytes,
                     opts.auto_tool_parser)
    return run_server(app, aengine, opts, serving)


if __name__ == "__main__":
    sys.exit(main())
