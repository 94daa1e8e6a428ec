"""The OpenAI-compatible FastAPI app: /v1/models, /v1/completions, /v1/chat/completions, /v1/responses
(server/responses_api.py), /tokenize, /detokenize, /health, /metrics, /version.

Bodies are parsed by hand (not by FastAPI's body injection) so that every invalid request becomes an
HTTP 400 OpenAI error object naming its parameter, never a 422."""
from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import aclosing, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import nanoserve
from nanoserve.chat import render_chat
from nanoserve.client.engine_client import EngineClient
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import InvalidRequest
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.response_store import ResponseStore
from nanoserve.server.render import ChatRender, CompletionRender, Render, sse, stream_chunks
from nanoserve.server.tools import ToolMode, render_tools_into_messages, template_renders_tools
from nanoserve.server.protocol import (MAX_LOGPROBS, APIError, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                       DetokenizeRequest, TokenizeRequest, new_id, now, parse)
from nanoserve.server.json_body import parse_json_body

log = logging.getLogger("nanoserve.server")

JSON_TYPES = ("application/json", "application/x-www-form-urlencoded")  # the latter: `curl -d` default
DEFAULT_MAX_REQUEST_BYTES = 16 << 20
OFF_LOOP_BYTES = 64 << 10  # bodies larger than this are parsed on a worker thread


class ClientGone(Exception):
    pass


class _Fanin:
    """Runs one engine request per prompt and merges their outputs as (prompt_index, output).
    close() cancels whatever is still running, which aborts it in the engine."""

    def __init__(self, engine: EngineClient, reqs: list) -> None:
        self.engine = engine
        self.q: asyncio.Queue = asyncio.Queue()
        self.left = len(reqs)
        self.tasks = [asyncio.create_task(self._pump(i, r)) for i, r in enumerate(reqs)]

    async def _pump(self, i: int, req) -> None:
        try:
            async with aclosing(self.engine.generate(req)) as gen:
                async for out in gen:
                    self.q.put_nowait((i, out))
        except Exception as e:
            self.q.put_nowait((i, e))

    async def __aiter__(self):
        while self.left:
            i, item = await self.q.get()
            if isinstance(item, Exception):
                raise item
            if item.finished:
                self.left -= 1
            yield i, item

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _usage_flags(body) -> tuple[bool, bool]:
    """(usage chunk at the end, usage in every chunk): vLLM's stream_options semantics."""
    opts = body.stream_options
    include = bool(opts and opts.include_usage)
    return include, include and bool(opts.continuous_usage_stats)


class Server:
    def __init__(self, engine: EngineClient, served_model_name: str | None = None,
                 api_key: str | None = None, max_queue: int | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, tool_parser: str | None = None) -> None:
        self.engine = engine
        self.llm = engine.frontend  # tokenizer, config and model metadata; never the weights
        self.tok = self.llm.tokenizer
        self.model_name = served_model_name or self.llm.model_name
        self.model_aliases = {self.model_name, self.llm.model_name}
        self.api_key = api_key
        self.max_queue = max_queue
        self.max_request_bytes = max_request_bytes
        self.tool_parser = tool_parser  # auto tool choice's parser; None: auto tool choice is off
        self.draining = False  # set on SIGTERM: new requests get 503 while in-flight ones finish
        self.metrics: ServerMetrics = engine.observer  # type: ignore[assignment]
        self.created = now()
        self._token_str: dict[int, str] = {}
        self.vocab_size = self.llm.vocab_size

    # ---- helpers ------------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if not self.api_key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
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

    def token_str(self, tid: int) -> str:
        s = self._token_str.get(tid)
        if s is None:
            s = self._token_str[tid] = self.tok.decode([tid])
        return s

    def make_requests(self, rid: str, prompts: list, params, add_special_tokens: bool = True) -> list:
        reqs = []
        for i, p in enumerate(prompts):
            try:
                reqs.append(self.llm.make_request(f"{rid}-{i}", p, params, add_special_tokens))
            except InvalidRequest as e:
                if len(prompts) > 1 and e.param == "prompt":
                    raise APIError(f"prompt[{i}]: {e}", 400, param="prompt", code=e.code)
                raise APIError.from_invalid(e)
        return reqs

    async def run_to_end(self, request: Request, reqs: list) -> list[RequestOutput]:
        """Final outputs of every request; a client disconnect aborts them all (ClientGone)."""
        fan = _Fanin(self.engine, reqs)
        finals: list[RequestOutput | None] = [None] * len(reqs)

        async def collect():
            async for i, out in fan:
                finals[i] = out

        consume = asyncio.create_task(collect())
        disc = asyncio.create_task(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({consume, disc}, return_when=asyncio.FIRST_COMPLETED)
            if consume in done:
                consume.result()
                return finals  # type: ignore[return-value]
            consume.cancel()
            raise ClientGone()
        finally:
            disc.cancel()
            await fan.close()

    async def respond(self, request: Request, reqs: list, render: Render, body):
        """The whole response (or a 499 when the client left), or an SSE stream of chunks."""
        if body.stream:
            return StreamingResponse(self._stream(reqs, render, body), media_type="text/event-stream")
        try:
            finals = await self.run_to_end(request, reqs)
        except ClientGone:
            return Response(status_code=499)
        except Exception as e:
            raise APIError.from_engine(e)
        return Response(render.response(finals).model_dump_json(), media_type="application/json")

    async def _stream(self, reqs: list, render: Render, body):
        fan = _Fanin(self.engine, reqs)
        try:
            async for chunk in stream_chunks(fan, len(reqs), render, *_usage_flags(body)):
                yield chunk
        except Exception as e:
            yield sse(APIError.from_engine(e).body())
        finally:
            await fan.close()
        yield "data: [DONE]\n\n"

    # ---- /v1/completions ----------------------------------------------------------------------
    async def completions(self, request: Request):
        self.check_auth(request)
        body = parse(CompletionRequest, await self.read_json(request))
        self.check_model(body.model)
        body.check_stream_options()
        if body.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError("best_of must equal n (beam/best-of search is not supported)", param="best_of")
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
            raise APIError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {body.logprobs}", param="logprobs")
        prompts = body.prompts()
        params = body.sampling(body.max_tokens, body.logprobs, self.vocab_size, default_max_tokens=16,
                               structured=await asyncio.to_thread(body.structured_spec))
        if body.echo and body.logprobs is not None:
            params.prompt_logprobs = body.logprobs
        cid = new_id("cmpl")
        reqs = await asyncio.to_thread(self.make_requests, cid, prompts, params)
        self.check_capacity(len(reqs))
        render = CompletionRender(cid, now(), self.model_name, params.n, body.logprobs is not None, self.token_str,
                                  echo=bool(body.echo), prompt_text=self._prompt_text)
        return await self.respond(request, reqs, render, body)

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tok.decode(out.prompt_token_ids)

    # ---- /v1/chat/completions -----------------------------------------------------------------
    async def chat(self, request: Request):
        self.check_auth(request)
        body = parse(ChatCompletionRequest, await self.read_json(request))
        self.check_model(body.model)
        body.check_stream_options()
        tools = body.tool_mode(self.tool_parser)
        prompt = await asyncio.to_thread(self._chat_prompt, body.messages, tools, body.add_generation_prompt,
                                         body.continue_final_message)
        spec = await asyncio.to_thread(body.structured_spec, tools.constraint() if tools else None)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling(max_tokens, body.num_logprobs(), self.vocab_size, default_max_tokens=None,
                               structured=spec)
        cid = new_id("chatcmpl")
        reqs = await asyncio.to_thread(self.make_requests, cid, [prompt], params, False)
        self.check_capacity(1)
        render = ChatRender(cid, now(), self.model_name, params.n, bool(body.logprobs), self.token_str, tools)
        return await self.respond(request, reqs, render, body)

    def _chat_prompt(self, msgs: list[ChatMessage], tools: ToolMode | None, add_generation_prompt: bool,
                     continue_final_message: bool = False) -> str:
        """The prompt text: the model's template renders the tools (and tool messages) when it knows
        them; otherwise they are written into the messages (tools.render_tools_into_messages)."""
        messages = [m.as_template_dict(i) for i, m in enumerate(msgs)]
        tool_list = tools.tools if tools else None
        if not template_renders_tools(self.llm):
            messages, tool_list = render_tools_into_messages(messages, tool_list), None
        try:
            return render_chat(self.llm, messages, add_generation_prompt, continue_final_message, tool_list)
        except InvalidRequest as e:
            raise APIError.from_invalid(e)

    # ---- the rest -----------------------------------------------------------------------------
    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "nanoserve",
                "root": self.llm.model_name, "parent": None, "max_model_len": self.llm.max_model_len}

    async def tokenize(self, request: Request):
        self.check_auth(request)
        body = parse(TokenizeRequest, await self.read_json(request))
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of 'prompt' or 'messages'", param="prompt")
        if body.messages is not None:  # the prompt a chat request with these messages gets
            text = await asyncio.to_thread(self._chat_prompt, body.messages, None, body.add_generation_prompt)
            add_special = False
        else:
            text, add_special = body.prompt, body.add_special_tokens
        limit = self.llm.max_model_len * self.llm.max_token_chars
        if len(text) > limit:
            raise APIError(f"the text is longer than any prompt this model accepts ({len(text)} > {limit} "
                           "characters)", param="prompt", code="context_length_exceeded")
        ids = await asyncio.to_thread(self.llm.tokenize, text, add_special)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.llm.max_model_len}

    async def detokenize(self, request: Request):
        self.check_auth(request)
        body = parse(DetokenizeRequest, await self.read_json(request))
        self.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(f"token id {bad[0]} is out of vocabulary (valid: 0..{self.vocab_size - 1})",
                           param="tokens")
        return {"prompt": await asyncio.to_thread(self.tok.decode, body.tokens)}

    async def render_metrics(self) -> Response:
        snap = await self.engine.snapshot()
        return Response(self.metrics.render(snap), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def health(self) -> Response:
        if not self.engine.alive:
            return JSONResponse(APIError("the engine is not running", 503, "server_error").body(), status_code=503)
        return Response(status_code=200)

    async def version(self) -> dict:
        return {"version": nanoserve.__version__}

    async def models(self, request: Request) -> dict:
        self.check_auth(request)
        return {"object": "list", "data": [self.model_card()]}

    async def model(self, model_id: str, request: Request) -> dict:
        self.check_auth(request)
        self.check_model(model_id)
        return self.model_card()


def create_app(engine: EngineClient, served_model_name: str | None = None, api_key: str | None = None,
               max_queue: int | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               tool_parser: str | None = None) -> FastAPI:
    srv = Server(engine, served_model_name, api_key, max_queue, max_request_bytes, tool_parser)

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

    from nanoserve.server.responses_api import ResponsesAPI  # it builds on this module's Server
    responses = ResponsesAPI(srv, ResponseStore())
    for path, endpoint, method in (
            ("/health", srv.health, "GET"), ("/version", srv.version, "GET"), ("/metrics", srv.render_metrics, "GET"),
            ("/v1/models", srv.models, "GET"), ("/v1/models/{model_id:path}", srv.model, "GET"),
            ("/v1/completions", srv.completions, "POST"), ("/v1/chat/completions", srv.chat, "POST"),
            ("/tokenize", srv.tokenize, "POST"), ("/detokenize", srv.detokenize, "POST"),
            ("/v1/responses", responses.create, "POST"), ("/v1/responses/{response_id}", responses.retrieve, "GET"),
            ("/v1/responses/{response_id}", responses.delete, "DELETE")):
        app.add_api_route(path, endpoint, methods=[method])
    return app
