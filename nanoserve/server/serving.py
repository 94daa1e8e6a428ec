"""Running the app: uvicorn with a graceful SIGTERM drain, and the process's exit code.

On the first SIGTERM/SIGINT new requests get 503 while in-flight ones may finish for
--shutdown-timeout seconds; what is still running then gets a clean 503 (JSON, or an SSE error
event) so every client gets an answer. Exit code 0 after a drain, 1 if the HTTP server could not
start or the engine core died (so a supervisor restarts the server)."""
from __future__ import annotations

import logging
import signal
import threading

import uvicorn
from fastapi import FastAPI

from nanoserve.config import ServerConfig
from nanoserve.client.engine_client import EngineClient

log = logging.getLogger("nanoserve.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, engine: EngineClient, timeout: float) -> None:
        super().__init__(config)
        self.api, self.engine, self.timeout = app.state.server, engine, timeout
        self.deadline: threading.Timer | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.deadline is None:
            log.info("shutting down: draining in-flight requests for up to %.0fs", self.timeout)
            self.api.gate.draining = True
            self.deadline = threading.Timer(self.timeout, self.engine.fail_all, [
                f"the server is shutting down (--shutdown-timeout {self.timeout:g}s passed)"])
            self.deadline.daemon = True
            self.deadline.start()
        super().handle_exit(sig, frame)


def run_server(app: FastAPI, engine: EngineClient, opts: ServerConfig, serving: list) -> int:
    """Serve until shutdown; `serving` receives the uvicorn server (the engine's on_dead stops it)."""
    # uvicorn's own grace period is a little longer than ours, so that requests we fail at the
    # deadline still get to send their 503 / SSE error before connections are closed
    uv = DrainingServer(uvicorn.Config(app, host=opts.host, port=opts.port, log_level=opts.log_level,
                                       timeout_graceful_shutdown=opts.shutdown_timeout + 5),
                        app, engine, opts.shutdown_timeout)
    # uvicorn re-raises the signal it caught once it has shut down gracefully; with the default
    # handler that would kill the process (exit 143). A no-op handler makes a SIGTERM exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    serving.append(uv)
    if engine.exit_reason:  # it died before `serving` held the server
        uv.should_exit = True
    log.info("serving %s on http://%s:%d (api key %s, max queue %s)", app.state.server.model_name, opts.host,
             opts.port, "required" if opts.api_key else "off",
             opts.max_queue if opts.max_queue is not None else "unbounded")
    try:
        uv.run()
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop()
    if not uv.started:
        log.error("the HTTP server did not start (is port %d free?)", opts.port)
        return 1
    if engine.exit_reason:
        log.error("exiting because %s", engine.exit_reason)
        return 1
    log.info("stopped")
    return 0
