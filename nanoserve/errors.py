"""The error a refused request raises, shared by every layer that validates one."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine refuses; `param` names the offending field (OpenAI's error.param)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
