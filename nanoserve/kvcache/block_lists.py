"""A pool's lists of unreferenced blocks (free, clean, dirty), each an ordered set with lazy removal.

One byte per block, `where[b]`, says which list holds block b (0: none: in use or held by a copy).
Each list keeps its order in an OrderedDict whose entries may be stale: an entry is live only while
`where` still names that list. So a load takes thousands of blocks out of their lists with one slice
assignment of `where` per run of consecutive blocks (extents.allocate_spans, block_pool.pin_fresh)
instead of a dict deletion per block; a stale entry is dropped when the list's end reaches it, or
replaced when its block rejoins the list. Each list has at most one entry per block, so stale ones
never outnumber the pool.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

NONE, FREE, CLEAN, DIRTY = 0, 1, 2, 3


class BlockList:
    """Blocks in one state, oldest first; `len`, `in` and iteration see live entries only."""

    def __init__(self, where: bytearray, code: int, blocks: Iterable[int] = ()) -> None:
        self.where, self.code = where, code
        self._order: OrderedDict[int, None] = OrderedDict.fromkeys(blocks)
        for b in self._order:
            where[b] = code
        self._len = len(self._order)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __contains__(self, block: int) -> bool:
        return self.where[block] == self.code

    def __iter__(self) -> Iterator[int]:
        where, code = self.where, self.code
        return (b for b in self._order if where[b] == code)

    def add(self, block: int) -> None:
        """Join as the newest (a stale entry of the block is moved, not duplicated)."""
        assert self.where[block] == NONE, f"block {block} is already on a list"
        self.where[block] = self.code
        self._len += 1
        self._order[block] = None
        self._order.move_to_end(block)

    def remove(self, block: int) -> None:
        assert self.where[block] == self.code, f"block {block} is not on this list"
        self.where[block] = NONE
        self._len -= 1
        del self._order[block]

    def pop(self, oldest: bool) -> int:
        """Take the oldest (else the newest) live block."""
        where, code, order = self.where, self.code, self._order
        while True:
            block, _ = order.popitem(last=not oldest)
            if where[block] == code:
                where[block] = NONE
                self._len -= 1
                return block

    def move_to_end(self, block: int) -> None:
        """A live block becomes the newest."""
        self._order.move_to_end(block)

    def dropped(self, n: int) -> None:
        """`n` live blocks left the list through `where` (their entries are stale now)."""
        self._len -= n
