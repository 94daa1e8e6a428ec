"""Reading a request body as JSON: the JSON constants Python accepts (NaN, Infinity) and strings that
are not valid Unicode (lone UTF-16 surrogates, which JSON escapes can express) are 400s naming the field,
as is a body nested too deeply to parse."""
from __future__ import annotations

import json
from typing import Any

from nanoserve.server.api_error import APIError


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _find_lone_surrogate(obj: Any) -> str | None:
    """The top-level field holding a string that is not valid Unicode (a lone UTF-16 surrogate,
    which JSON escapes can express), or None. One C-speed encode per field."""
    for key, value in obj.items():
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
            key.encode("utf-8")
        except UnicodeEncodeError:
            return key.encode("utf-8", "backslashreplace").decode()
    return None


def parse_json_body(raw: bytes) -> Any:
    try:
        obj = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError("the request body is nested too deeply", 400, code="invalid_json")
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise APIError(f"the request body is not valid JSON: {e}", 400, code="invalid_json")
    if isinstance(obj, dict) and (bad := _find_lone_surrogate(obj)) is not None:
        raise APIError(f"'{bad}' contains a string that is not valid Unicode (a lone UTF-16 surrogate)",
                       400, param=bad, code="invalid_unicode")
    return obj
