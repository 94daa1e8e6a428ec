"""Structured-output constraints as they travel with a request: a small serialisable spec (what the
client asked for, as text), its translation into an llguidance grammar, and its validation.

The spec, not a compiled grammar, crosses the API -> engine boundary: a compiled matcher is a native
object that cannot be sent over zmq. The API side validates the grammar (no tokenizer needed, ~0.5 ms
for a realistic schema; one that takes longer than COMPILE_TIMEOUT_S is refused too) so that a bad
schema is an HTTP 400 before any stream starts; the engine compiles each distinct grammar once, on a
thread of its own while its steps go on (engine/grammar.py)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from nanoserve.errors import InvalidRequest

KINDS = ("json", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 256 << 10  # a grammar is compiled and matched per token: bounded like other lists
COMPILE_TIMEOUT_S = 10.0  # a grammar that takes longer to check (API) or compile (engine) is refused


@dataclass(frozen=True)
class StructuredSpec:
    """`kind` "json": `value` is a JSON schema (JSON text); "regex": a regular expression; "choice": a
    JSON list of strings; "grammar": a Lark grammar (llguidance's syntax, as vLLM's guided_grammar).
    `param` is the request field it came from (named in errors)."""
    kind: str
    value: str
    param: str = "response_format"

    def grammar(self) -> str:
        """The llguidance grammar (a string) for this spec. Raises InvalidRequest naming `param`."""
        from llguidance import LLMatcher
        try:
            if self.kind == "json":
                # flexible whitespace would let a small model pad forever; compact JSON as OpenAI emits it
                return LLMatcher.grammar_from_json_schema(self.value, defaults={"whitespace_flexible": False})
            if self.kind == "regex":
                return LLMatcher.grammar_from_regex(self.value)
            if self.kind == "grammar":
                return LLMatcher.grammar_from_lark(self.value)
            if self.kind == "choice":
                choices = json.loads(self.value)
                if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                    raise ValueError("must be a non-empty list of strings")
                return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        except (ValueError, TypeError) as e:
            raise _invalid(f"{self.param}: invalid {self.kind} constraint: {e}", self.param) from e
        raise _invalid(f"{self.param}: unknown constraint kind {self.kind!r}", self.param)

    def validate(self, timeout: float = COMPILE_TIMEOUT_S) -> None:
        """Raises InvalidRequest naming `param` if the grammar cannot be compiled, or took longer than
        `timeout` seconds to check (the engine's compile would cost as much again)."""
        if len(self.value) > MAX_SPEC_CHARS:
            raise _invalid(f"{self.param}: the constraint is longer than {MAX_SPEC_CHARS} characters",
                           self.param)
        from llguidance import LLMatcher
        t0 = time.monotonic()
        err = LLMatcher.validate_grammar(self.grammar())
        if err:
            raise _invalid(f"{self.param}: the {self.kind} constraint cannot be compiled: {err}", self.param)
        if (took := time.monotonic() - t0) > timeout:
            raise _invalid(f"{self.param}: the {self.kind} constraint took {took:.1f}s to check, longer than "
                           f"the {timeout:g}s allowed", self.param)


def json_spec(schema: object, param: str) -> StructuredSpec:
    """A JSON-schema spec from a schema given as an object (or JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise _invalid(f"{param}: the schema is not valid JSON: {e}", param) from e
    if not isinstance(schema, (dict, bool)):
        raise _invalid(f"{param}: a JSON schema must be an object", param)
    return StructuredSpec("json", json.dumps(schema, sort_keys=True), param)


def _invalid(message: str, param: str) -> Exception:
    return InvalidRequest(message, param=param)
