"""The error every refused or failed API request answers (an OpenAI error object), and how a pydantic
validation error becomes one naming the offending field."""
from __future__ import annotations

from pydantic import ValidationError

from nanoserve.engine.protocol import EngineDead
from nanoserve.sampling_params import InvalidRequest


class APIError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    @classmethod
    def from_invalid(cls, e: InvalidRequest) -> "APIError":
        return cls(str(e), 400, "invalid_request_error", e.param, e.code)

    @classmethod
    def from_engine(cls, e: Exception) -> "APIError":
        """What a failed generation answers: 503 when the engine is gone, 400 for a request it refused."""
        if isinstance(e, EngineDead):
            return cls(str(e), 503, "server_error", code="service_unavailable")
        if isinstance(e, InvalidRequest):
            return cls.from_invalid(e)
        return e if isinstance(e, APIError) else cls(str(e) or type(e).__name__, 500, "server_error",
                                                     code="internal_error")


def error_from_validation(e: ValidationError) -> APIError:
    err = e.errors()[0]
    loc = [x for x in err.get("loc", ()) if isinstance(x, int)
           or not any(c in x for c in "[]-") and x not in ("str", "int", "float", "bool")]
    where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")
    param = next((x for x in loc if isinstance(x, str)), None)
    if err.get("type") == "missing":
        return APIError(f"'{where}' is a required property", param=param)
    return APIError(f"Invalid value for '{where}': {err.get('msg', 'invalid value')}", param=param)
