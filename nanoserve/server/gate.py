"""What every API request passes before it reaches the engine: the API key, the model name, the engine's
state and queue (503s), and its body (size-limited as it arrives, parsed as JSON by hand so that every
invalid body is an HTTP 400 OpenAI error object, never FastAPI's 422)."""
from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from nanoserve.client.engine_client import EngineClient
from nanoserve.server.json_body import parse_json_body
from nanoserve.server.api_error import APIError

JSON_TYPES = ("application/json", "application/x-www-form-urlencoded")  # the latter: `curl -d` default
DEFAULT_MAX_REQUEST_BYTES = 16 << 20
OFF_LOOP_BYTES = 64 << 10  # bodies larger than this are parsed on a worker thread


@dataclass
class RequestGate:
    engine: EngineClient
    model_aliases: set[str] = field(default_factory=set)
    api_key: str | None = None
    max_queue: int | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    draining: bool = False  # set on SIGTERM: new requests get 503 while in-flight ones finish

    def check_auth(self, request: Request) -> None:
        if not self.api_key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if (scheme.lower() != "bearer"
                or not hmac.compare_digest(token.strip().encode(), self.api_key.encode())):
            raise APIError("Incorrect API key provided." if auth else
                           "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                           401, "invalid_request_error", code="invalid_api_key")

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_aliases:
            raise APIError(f"The model `{model}` does not exist.", 404, "invalid_request_error",
                           param="model", code="model_not_found")

    def check_capacity(self, num: int) -> None:
        if not self.engine.alive:
            raise APIError("the engine is not running", 503, "server_error", code="service_unavailable")
        if self.draining:
            raise APIError("the server is shutting down", 503, "server_error", code="service_unavailable")
        if self.max_queue is not None and self.engine.num_waiting + num > self.max_queue:
            raise APIError(f"the server is overloaded: {self.engine.num_waiting} requests are waiting "
                           f"(--max-queue {self.max_queue}); retry later", 503, "server_error",
                           code="server_overloaded", headers={"Retry-After": "1"})

    async def read_json(self, request: Request) -> Any:
        ct = request.headers.get("content-type", "")
        mt = ct.split(";")[0].strip().lower()
        if mt and mt not in JSON_TYPES and not mt.endswith("+json"):
            raise APIError(f"Content-Type must be application/json, got {ct!r}", 400,
                           code="unsupported_content_type")
        limit = self.max_request_bytes
        too_big = APIError(f"the request body is larger than {limit} bytes (--max-request-bytes)", 413,
                           code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():  # counted as it arrives: no huge body is ever held
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        raw = b"".join(chunks)
        if size > OFF_LOOP_BYTES:
            return await asyncio.to_thread(parse_json_body, raw)
        return parse_json_body(raw)
