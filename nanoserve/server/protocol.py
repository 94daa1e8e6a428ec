"""OpenAI request bodies (pydantic), the error object, and the conversion to SamplingParams (with the
structured-output constraint a request asks for: response_format, vLLM's guided_* / structured_outputs,
or a tool_choice).

Unknown fields are accepted and ignored (`extra="ignore"`), except those that would change what the
client gets back and that nanoserve does not implement (NOT_IMPLEMENTED: refused); the known fields
ignored on purpose are listed in ACCEPTED_IGNORED (and the README); every validation
failure becomes an HTTP 400 OpenAI error object naming the parameter (never FastAPI's 422)."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, Union

# with the server, not in its first constrained request (~0.25 s holding the GIL)
import llguidance  # noqa: F401
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from nanoserve.sampling_params import InvalidRequest, SamplingParams
from nanoserve.server.api_error import APIError, error_from_validation
from nanoserve.server.tools import ToolMode
from nanoserve.structured import StructuredSpec, json_spec

MAX_LOGPROBS = 20


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Base):
    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Base):
    """vLLM's `structured_outputs` object: exactly one of these."""
    json_: Any = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(_Base):
    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: StrictInt = 1
    ignore_eos: bool = False
    min_tokens: StrictInt = 0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    cache_salt: str | None = None
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    def structured_spec(self, extra: StructuredSpec | None = None) -> StructuredSpec | None:
        """The one output constraint this request asks for (`extra`: the tool_choice's), validated (a
        400 naming the field), or None."""
        try:
            found = self._constraints() + ([extra] if extra else [])
            if len(found) > 1:
                raise APIError(f"'{found[1].param}' cannot be combined with '{found[0].param}': give one "
                               "output constraint", param=found[1].param)
            if found:
                found[0].validate()
        except InvalidRequest as e:
            raise APIError.from_invalid(e)
        return found[0] if found else None

    def _constraints(self) -> list[StructuredSpec]:
        found: list[StructuredSpec] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(json_spec({"type": "object"}, "response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError("response_format.json_schema.schema is required for type json_schema",
                               param="response_format")
            found.append(json_spec(rf.json_schema.schema_, "response_format"))
        so = self.structured_outputs
        for param, kind, value in (
                ("guided_json", "json", self.guided_json), ("guided_regex", "regex", self.guided_regex),
                ("guided_choice", "choice", self.guided_choice),
                ("guided_grammar", "grammar", self.guided_grammar),
                ("structured_outputs", "json", so and so.json_),
                ("structured_outputs", "regex", so and so.regex),
                ("structured_outputs", "choice", so and so.choice),
                ("structured_outputs", "grammar", so and so.grammar),
                ("structured_outputs", "json", {"type": "object"} if so and so.json_object else None)):
            if value is None:
                continue
            if kind == "json":
                found.append(json_spec(value, param))
            else:
                found.append(StructuredSpec(kind, json.dumps(value) if kind == "choice" else value, param))
        return found

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")

    def sampling(self, max_tokens: int | None, logprobs: int | None, vocab_size: int,
                 default_max_tokens: int | None, structured: StructuredSpec | None = None) -> SamplingParams:
        bias: dict[int, float] = {}
        for k, v in (self.logit_bias or {}).items():
            try:
                tid = int(k)
            except ValueError:
                raise APIError(f"logit_bias keys must be token ids, got {k!r}", param="logit_bias")
            if not 0 <= tid < vocab_size:
                raise APIError(f"logit_bias token id {tid} is out of vocabulary (valid: 0..{vocab_size - 1})",
                               param="logit_bias")
            if not -100 <= v <= 100:
                raise APIError(f"logit_bias values must be in [-100, 100], got {v}", param="logit_bias")
            bias[tid] = float(v)
        for tid in self.stop_token_ids or []:
            if not 0 <= tid < vocab_size:
                raise APIError(f"stop_token_ids: token id {tid} is out of vocabulary", param="stop_token_ids")
        if self.top_k is not None and self.top_k > vocab_size:
            raise APIError(f"top_k must be at most the vocabulary size {vocab_size} (or -1 / 0 for off), "
                           f"got {self.top_k}", param="top_k")
        if self.n > 16:
            raise APIError(f"n must be <= 16, got {self.n}", param="n")
        if max_tokens is not None and max_tokens < 1:
            raise APIError(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        kw: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            min_tokens=self.min_tokens, seed=self.seed, stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, logprobs=logprobs,
            logit_bias=bias, include_stop_str_in_output=self.include_stop_str_in_output,
            structured=structured, cache_salt=self.cache_salt)
        for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                              ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                              ("repetition_penalty", 1.0)):
            v = getattr(self, name)
            kw[name] = default if v is None else v
        try:
            return SamplingParams(**kw)
        except InvalidRequest as e:
            raise APIError.from_invalid(e)


PromptType = Union[str, list[StrictInt], list[str], list[list[StrictInt]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    echo: bool = False
    logprobs: StrictInt | None = None
    suffix: str | None = None
    best_of: StrictInt | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(_Base):
    type: str
    text: str | None = None


class FunctionIn(_Base):
    name: str
    arguments: str | dict = "{}"


class ToolCallIn(_Base):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionIn


class ChatMessage(_Base):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None             # a tool result answers this call

    def as_template_dict(self, i: int) -> dict:
        c = self.content
        if isinstance(c, list):
            texts = []
            for part in c:
                if part.type != "text" or part.text is None:
                    raise APIError(f"messages[{i}].content: only text parts are supported, got type "
                                   f"{part.type!r}", param="messages")
                texts.append(part.text)
            c = "\n".join(texts)
        d = {"role": self.role, "content": c if c is not None else ""}
        if self.name:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.tool_calls:  # templates expect arguments as an object (they serialize it themselves)
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments, i)}}
                for c in self.tool_calls]
        return d


def _arguments(args: str | dict, i: int) -> dict:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            args = None
    if not isinstance(args, dict):
        raise APIError(f"messages[{i}].tool_calls: arguments must be a JSON object", param="messages")
    return args


class FunctionDef(_Base):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(_Base):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(_Base):
    type: Literal["function"]
    function: FunctionIn  # its name


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # extra variables of the chat template (vLLM / SGLang), e.g. {"enable_thinking": false} for Qwen3;
    # a non-object is a 400 here, a key the server passes itself (chat.RESERVED_TEMPLATE_KWARGS) at render
    chat_template_kwargs: dict[str, Any] | None = None

    def tool_mode(self, auto_parser: str | None) -> ToolMode | None:
        """How the output relates to the tools (None: no tools, or tool_choice "none"). Without `auto_parser`
        (--enable-auto-tool-choice off) "auto", the default with tools, is a 400 as in vLLM."""
        choice = self.tool_choice if self.tool_choice is not None else "auto" if self.tools else "none"
        if choice == "none":
            return None
        if not self.tools:
            raise APIError("tool_choice needs a non-empty 'tools' list", param="tool_choice")
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t.function.name for t in self.tools}:
                raise APIError(f"tool_choice names the function {choice.function.name!r}, which is not in "
                               "'tools'", param="tool_choice")
            return ToolMode(tools, "named", choice.function.name, self.parallel_tool_calls)
        if choice == "auto" and auto_parser is None:
            raise APIError('"auto" tool choice (the default with tools) needs the server to run with '
                           '--enable-auto-tool-choice and --tool-call-parser; send "required", a named '
                           'function or "none"', param="tool_choice")
        return ToolMode(tools, choice, None, self.parallel_tool_calls, auto_parser)

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                               param="top_logprobs")
            if not self.logprobs:
                raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[ToolDef] | None = None                  # with messages: as a chat request renders them
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[StrictInt]


# Fields that change what the client gets back and that nanoserve does not implement: refused with a
# 400 naming the field instead of being ignored (the client would get something other than it asked for
# and not know). Each maps to what its harmless value looks like.
NOT_IMPLEMENTED = {
    "functions": lambda v: not v, "function_call": lambda v: v in (None, "none"),  # legacy: use tools
    "prediction": lambda v: v is None, "guided_whitespace_pattern": lambda v: v is None,
    "modalities": lambda v: v is None or "audio" not in v, "audio": lambda v: v is None,  # audio output
    "web_search_options": lambda v: v is None,  # a web search that would never happen
    "reasoning_effort": lambda v: v is None, "verbosity": lambda v: v is None,  # not a reasoning model
}
# Fields accepted and ignored on purpose: they do not change the completion the client receives.
ACCEPTED_IGNORED = {
    "user": "an end-user id for the provider's abuse monitoring", "safety_identifier": "the same, newer name",
    "metadata": "tags for stored completions", "store": "keep the completion for OpenAI's dashboards / evals",
    "service_tier": "a processing tier: there is one", "prompt_cache_key": "a hint for prefix-cache routing: "
    "the prefix cache needs none", "prompt_cache_retention": "the same cache's lifetime",
}


def parse(model_cls: type[BaseModel], obj: Any) -> Any:
    if not isinstance(obj, dict):
        raise APIError("the request body must be a JSON object", param=None)
    if issubclass(model_cls, _SamplingFields):
        for name, harmless in NOT_IMPLEMENTED.items():
            if name in obj and not harmless(obj[name]):
                raise APIError(f"'{name}' is not supported by this server; the request was not run",
                               param=name, code="unsupported_parameter")
    try:
        return model_cls.model_validate(obj)
    except ValidationError as e:
        raise error_from_validation(e)
    except RecursionError:
        raise APIError("the request body is nested too deeply", 400, code="invalid_json")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
