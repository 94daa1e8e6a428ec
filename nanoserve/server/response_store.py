"""Stored Responses API responses (`store`, `previous_response_id`, GET / DELETE /v1/responses/{id}):
in memory, bounded by count and by bytes, the oldest evicted first. Each entry keeps the response as
sent and the conversation that led to it, so a follow-up needs no other entry (evicting an older one
never breaks a chain that is still stored)."""
from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from nanoserve.server.api_error import APIError

log = logging.getLogger("nanoserve.server")


@dataclass(frozen=True)
class StoredResponse:
    body: str                 # the response object's JSON, as GET returns it
    conversation: list[dict]  # chat messages before this response's output (instructions excluded)

    @property
    def size(self) -> int:
        return len(self.body) + len(json.dumps(self.conversation, ensure_ascii=False))

    def output(self) -> list[dict]:
        return json.loads(self.body)["output"]


@dataclass
class ResponseStore:
    max_count: int = 1024
    max_bytes: int = 64 << 20
    entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    sizes: dict[str, int] = field(default_factory=dict)
    bytes: int = 0

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Store `entry`, evicting the oldest ones past the bounds. False (not stored) when it alone is
        larger than the byte bound."""
        size = entry.size
        if size > self.max_bytes:
            log.warning("response %s (%d bytes) is larger than the response store (%d bytes): not stored",
                        response_id, size, self.max_bytes)
            return False
        self.delete(response_id, missing_ok=True)
        while self.entries and (len(self.entries) >= self.max_count or self.bytes + size > self.max_bytes):
            self.delete(next(iter(self.entries)))
        self.entries[response_id], self.sizes[response_id] = entry, size
        self.bytes += size
        return True

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        entry = self.entries.get(response_id)
        if entry is None:
            raise APIError(f"Response with id '{response_id}' not found.", 404, param=param,
                           code="response_not_found")
        return entry

    def delete(self, response_id: str, missing_ok: bool = False) -> None:
        if response_id not in self.entries:
            if missing_ok:
                return
            self.get(response_id)  # the 404
        del self.entries[response_id]
        self.bytes -= self.sizes.pop(response_id)
