"""`POST /v1/responses`, `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`: the OpenAI Responses API
on top of the chat path. A request becomes a chat-completions body (responses_api_protocol.py), which
goes through the chat endpoint's own steps (tool mode, chat template, output constraint, sampling) and
the same engine client; the outputs become a response object or its stream events
(responses_api_render.py); stored responses live in a bounded in-memory store (response_store.py)."""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from nanoserve.errors import InvalidRequest
from nanoserve.server.endpoints import Server
from nanoserve.server.api_error import APIError
from nanoserve.server.protocol import ChatCompletionRequest, parse
from nanoserve.server.response_store import ResponseStore, StoredResponse
from nanoserve.server.responses_api_objects import ResponseObject
from nanoserve.server.responses_api_protocol import (ResponsesRequest, chat_body, input_messages,
                                                     parse_responses_request, renamed)
from nanoserve.server.responses_api_render import ResponseBuilder, item_id
from nanoserve.structured import json_spec


def _check_tool_schemas(body: ChatCompletionRequest) -> None:
    """Every function's parameters must compile as a JSON schema, whatever the tool_choice (auto does not
    constrain the output, but a malformed schema is still the client's error, not silently ignored)."""
    try:
        for t in body.tools or []:
            if t.function.parameters is not None:
                json_spec(t.function.parameters, "tools").validate()
    except InvalidRequest as e:
        raise APIError.from_invalid(e)


class ResponsesAPI:
    def __init__(self, server: Server, store: ResponseStore) -> None:
        self.srv, self.store = server, store

    def _conversation(self, req: ResponsesRequest) -> list[dict]:
        """The chat messages before the answer: a previous response's conversation and output, then this
        input (`instructions` are not carried over from a previous response, as OpenAI does)."""
        prior: list[dict] = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id, param="previous_response_id")
            prior = prev.conversation + input_messages(prev.output())
        return prior + input_messages(req.input)

    def _skeleton(self, rid: str, req: ResponsesRequest) -> ResponseObject:
        fmt = req.format().model_dump(by_alias=True, exclude_none=True)
        return ResponseObject(
            id=rid, created_at=int(time.time()), status="in_progress", model=self.srv.model_name,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            temperature=req.temperature, top_p=req.top_p, tools=req.tools or [],
            tool_choice=req.echo_tool_choice(),
            parallel_tool_calls=req.parallel_tool_calls is not False, text={"format": fmt},
            previous_response_id=req.previous_response_id, store=req.store is not False,
            metadata=req.metadata or {})

    async def create(self, request: Request):
        srv = self.srv
        srv.gate.check_auth(request)
        req = parse_responses_request(await srv.gate.read_json(request))
        srv.gate.check_model(req.model)
        conversation = self._conversation(req)
        try:
            body = parse(ChatCompletionRequest, chat_body(req, conversation))
            tools = body.tool_mode(srv.tool_parser)
            await asyncio.to_thread(_check_tool_schemas, body)
            prompt = await asyncio.to_thread(srv._chat_prompt, body.messages, tools, True)
            spec = await asyncio.to_thread(body.structured_spec, tools.constraint() if tools else None)
            params = body.sampling(body.max_completion_tokens, None, srv.vocab_size, default_max_tokens=None,
                                   structured=spec)
            rid = item_id("resp")
            reqs = await asyncio.to_thread(srv.make_requests, rid, [prompt], params, False)
        except APIError as e:
            raise renamed(e)
        srv.gate.check_capacity(1)
        builder = ResponseBuilder(self._skeleton(rid, req), tools, lambda r: self._keep(r, conversation))
        if req.stream:
            return StreamingResponse(self._stream(reqs[0], builder), media_type="text/event-stream")
        return await srv.respond(request, reqs, builder, req)  # type: ignore[arg-type]

    async def _stream(self, req, builder: ResponseBuilder):
        for event in builder.opening():
            yield event
        try:
            async with aclosing(self.srv.engine.generate(req)) as outputs:
                async for out in outputs:
                    for event in builder.update(out):
                        yield event
        except Exception as e:
            err = APIError.from_engine(e)
            for event in builder.fail(err.message, err.code):
                yield event

    def _keep(self, response: ResponseObject, conversation: list[dict]) -> None:
        if response.store:
            self.store.put(response.id, StoredResponse(response.model_dump_json(), conversation))

    async def retrieve(self, response_id: str, request: Request):
        self.srv.gate.check_auth(request)
        for name in ("stream", "include"):  # both would change the answer; neither is implemented
            if request.query_params.get(name, "false").lower() not in ("false", "0", ""):
                raise APIError(f"'{name}' is not supported when retrieving a response", param=name,
                               code="unsupported_parameter")
        return Response(self.store.get(response_id).body, media_type="application/json")

    async def delete(self, response_id: str, request: Request) -> dict:
        self.srv.gate.check_auth(request)
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
