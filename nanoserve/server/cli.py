"""`nanoserve`: serve a model over an OpenAI-compatible HTTP API.

    nanoserve                                      # embedded SmolLM2-135M-Instruct, 127.0.0.1:8000
    nanoserve --model llama-3-8b --host-cache-gb 48 --port 8000
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

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


def _start_engine(config: EngineConfig, opts: ServerConfig, on_dead):
    """The engine core in its own process (the API process then keeps one core), or in a thread."""
    from nanoserve.engine.client import EngineClient
    from nanoserve.engine.placement import apply_api_placement, plan_placement
    placement = plan_placement(config.resolved_device().type, opts.cpu_threads, opts.engine_process)
    log.info("CPU placement: %s", placement.describe())
    client = EngineClient(config, placement=placement, log_level=opts.log_level, on_dead=on_dead,
                          in_process=not opts.engine_process)
    client.start()
    if opts.engine_process:
        apply_api_placement(placement)
    return client


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config, opts = from_args(EngineConfig, args), from_args(ServerConfig, args)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=opts.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)

    import uvicorn

    from nanoserve.engine.protocol import EngineStartError
    from nanoserve.server.app import create_app
    from nanoserve.server.metrics import ServerMetrics

    serving: list = []  # the uvicorn server once it exists

    def stop_serving(reason: str) -> None:
        # the engine core died: its requests have been failed already; stop serving (exit 1)
        # so that a supervisor restarts the whole server
        for server in serving:
            server.should_exit = True

    try:
        aengine = _start_engine(config, opts, stop_serving)
    except (ValueError, FileNotFoundError, OSError, EngineStartError) as e:
        log.error("cannot start: %s", e)
        return 2
    model_name = aengine.frontend.model_name
    name = opts.served_model_name or model_name
    aengine.observer = ServerMetrics(name)
    app = create_app(aengine, name, opts.api_key, opts.max_queue, opts.max_request_bytes)

    # uvicorn's own grace period is a little longer than ours, so that requests we fail at the
    # deadline still get to send their 503 / SSE error before connections are closed
    uv = _draining_server_class()(uvicorn.Config(app, host=opts.host, port=opts.port, log_level=opts.log_level,
                                       timeout_graceful_shutdown=opts.shutdown_timeout + 5),
                        app.state.server, aengine, opts.shutdown_timeout)
    # uvicorn re-raises the signal it caught once it has shut down gracefully; with the default
    # handler that would kill the process (exit 143). A no-op handler makes a SIGTERM exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    serving.append(uv)
    if aengine.exit_reason:  # it died before `serving` held the server
        uv.should_exit = True
    log.info("serving %s on http://%s:%d (api key %s, max queue %s)", name, opts.host, opts.port,
             "required" if opts.api_key else "off", opts.max_queue if opts.max_queue is not None else "unbounded")
    try:
        uv.run()
    except KeyboardInterrupt:
        pass
    finally:
        aengine.stop()
    if not uv.started:
        log.error("the HTTP server did not start (is port %d free?)", opts.port)
        return 1
    if aengine.exit_reason:
        log.error("exiting because %s", aengine.exit_reason)
        return 1
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
