"""The OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models, /tokenize,
/detokenize, /health, /metrics, /version (the Responses API builds on them: server/responses_api.py), and
what they share: running a request's prompts through the engine client, whole or streamed, with a client
disconnect aborting them."""
from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import nanoserve
from nanoserve.client.engine_client import EngineClient
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import InvalidRequest
from nanoserve.server.gate import RequestGate
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.render import ChatRender, CompletionRender, Render, sse, stream_chunks
from nanoserve.server.chat_prompt import chat_prompt
from nanoserve.server.tools import ToolMode
from nanoserve.server.api_error import APIError
from nanoserve.server.protocol import (MAX_LOGPROBS, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                       DetokenizeRequest, TokenizeRequest, new_id, now, parse)

log = logging.getLogger("nanoserve.server")


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
    def __init__(self, engine: EngineClient, gate: RequestGate, served_model_name: str | None = None,
                 tool_parser: str | None = None) -> None:
        self.engine, self.gate = engine, gate
        self.llm = engine.frontend  # tokenizer, config and model metadata; never the weights
        self.tok = self.llm.tokenizer
        self.model_name = served_model_name or self.llm.model_name
        gate.model_aliases |= {self.model_name, self.llm.model_name}
        self.tool_parser = tool_parser  # auto tool choice's parser; None: auto tool choice is off
        self.metrics: ServerMetrics = engine.observer  # type: ignore[assignment]
        self.created = now()
        self._token_str: dict[int, str] = {}
        self.vocab_size = self.llm.vocab_size

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
        self.gate.check_auth(request)
        body = parse(CompletionRequest, await self.gate.read_json(request))
        self.gate.check_model(body.model)
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
        self.gate.check_capacity(len(reqs))
        render = CompletionRender(cid, now(), self.model_name, params.n, body.logprobs is not None,
                                  self.token_str, echo=bool(body.echo), prompt_text=self._prompt_text)
        return await self.respond(request, reqs, render, body)

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tok.decode(out.prompt_token_ids)

    # ---- /v1/chat/completions -----------------------------------------------------------------
    async def chat(self, request: Request):
        self.gate.check_auth(request)
        body = parse(ChatCompletionRequest, await self.gate.read_json(request))
        self.gate.check_model(body.model)
        body.check_stream_options()
        tools = body.tool_mode(self.tool_parser)
        prompt = await asyncio.to_thread(self._chat_prompt, body.messages, tools, body.add_generation_prompt,
                                         body.continue_final_message, body.chat_template_kwargs)
        spec = await asyncio.to_thread(body.structured_spec, tools.constraint() if tools else None)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling(max_tokens, body.num_logprobs(), self.vocab_size, default_max_tokens=None,
                               structured=spec)
        cid = new_id("chatcmpl")
        reqs = await asyncio.to_thread(self.make_requests, cid, [prompt], params, False)
        self.gate.check_capacity(1)
        render = ChatRender(cid, now(), self.model_name, params.n, bool(body.logprobs), self.token_str, tools)
        return await self.respond(request, reqs, render, body)

    def _chat_prompt(self, msgs: list[ChatMessage], tools: ToolMode | None, add_generation_prompt: bool,
                     continue_final_message: bool = False, template_kwargs: dict | None = None) -> str:
        """The prompt text (server/chat_prompt.py: how tools reach a template that does not render
        them); `template_kwargs`: the request's chat_template_kwargs."""
        messages = [m.as_template_dict(i) for i, m in enumerate(msgs)]
        try:
            return chat_prompt(self.llm, messages, tools.tools if tools else None, add_generation_prompt,
                               continue_final_message, template_kwargs)
        except InvalidRequest as e:
            raise APIError.from_invalid(e)

    # ---- the rest -----------------------------------------------------------------------------
    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "nanoserve",
                "root": self.llm.model_name, "parent": None, "max_model_len": self.llm.max_model_len}

    async def tokenize(self, request: Request):
        self.gate.check_auth(request)
        body = parse(TokenizeRequest, await self.gate.read_json(request))
        self.gate.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of 'prompt' or 'messages'", param="prompt")
        if body.messages is not None:  # the prompt a chat request with these messages gets
            # with its tools, the prompt a chat request with tool_choice "auto" gets
            tools = ToolMode([t.model_dump(exclude_none=True) for t in body.tools], "auto") if body.tools \
                else None
            text = await asyncio.to_thread(self._chat_prompt, body.messages, tools,
                                           body.add_generation_prompt, False, body.chat_template_kwargs)
            add_special = False
        else:  # what only renders messages is refused, not dropped
            if (field := "tools" if body.tools else "chat_template_kwargs" if body.chat_template_kwargs
                    else None) is not None:
                raise APIError(f"'{field}' applies to 'messages' only, not to 'prompt'", param=field)
            text, add_special = body.prompt, body.add_special_tokens
        limit = self.llm.max_model_len * self.llm.max_token_chars
        if len(text) > limit:
            raise APIError(f"the text is longer than any prompt this model accepts ({len(text)} > {limit} "
                           "characters)", param="prompt", code="context_length_exceeded")
        ids = await asyncio.to_thread(self.llm.tokenize, text, add_special)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.llm.max_model_len}

    async def detokenize(self, request: Request):
        self.gate.check_auth(request)
        body = parse(DetokenizeRequest, await self.gate.read_json(request))
        self.gate.check_model(body.model)
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
            return JSONResponse(APIError("the engine is not running", 503, "server_error").body(),
                                status_code=503)
        return Response(status_code=200)

    async def version(self) -> dict:
        return {"version": nanoserve.__version__}

    async def models(self, request: Request) -> dict:
        self.gate.check_auth(request)
        return {"object": "list", "data": [self.model_card()]}

    async def model(self, model_id: str, request: Request) -> dict:
        self.gate.check_auth(request)
        self.gate.check_model(model_id)
        return self.model_card()
