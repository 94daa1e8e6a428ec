"""The FastAPI app: the OpenAI-compatible routes (server/endpoints.py, server/responses_api.py) and the
error handlers that make every failure an OpenAI error object."""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import nanoserve
from nanoserve.client.engine_client import EngineClient
from nanoserve.server.endpoints import Server
from nanoserve.server.gate import DEFAULT_MAX_REQUEST_BYTES, RequestGate
from nanoserve.server.api_error import APIError
from nanoserve.server.response_store import ResponseStore
from nanoserve.server.responses_api import ResponsesAPI

log = logging.getLogger("nanoserve.server")


def create_app(engine: EngineClient, served_model_name: str | None = None, api_key: str | None = None,
               max_queue: int | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               tool_parser: str | None = None) -> FastAPI:
    gate = RequestGate(engine, api_key=api_key, max_queue=max_queue, max_request_bytes=max_request_bytes)
    srv = Server(engine, gate, served_model_name, tool_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            log.info("shutting down: aborting what is still running and stopping the engine")
            await asyncio.to_thread(engine.stop)

    app = FastAPI(title="nanoserve", version=nanoserve.__version__, lifespan=lifespan)
    app.state.server = srv

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        if e.status >= 500:
            log.warning("%s %s -> %d: %s", request.method, request.url.path, e.status, e.message)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(APIError(str(e.detail), e.status_code, "invalid_request_error", code=code).body(),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(APIError(f"internal error: {type(e).__name__}: {e}", 500, "server_error",
                                     code="internal_error").body(), status_code=500)

    responses = ResponsesAPI(srv, ResponseStore())
    for path, endpoint, method in (
            ("/health", srv.health, "GET"), ("/version", srv.version, "GET"),
            ("/metrics", srv.render_metrics, "GET"),
            ("/v1/models", srv.models, "GET"), ("/v1/models/{model_id:path}", srv.model, "GET"),
            ("/v1/completions", srv.completions, "POST"), ("/v1/chat/completions", srv.chat, "POST"),
            ("/tokenize", srv.tokenize, "POST"), ("/detokenize", srv.detokenize, "POST"),
            ("/v1/responses", responses.create, "POST"),
            ("/v1/responses/{response_id}", responses.retrieve, "GET"),
            ("/v1/responses/{response_id}", responses.delete, "DELETE")):
        app.add_api_route(path, endpoint, methods=[method])
    return app
