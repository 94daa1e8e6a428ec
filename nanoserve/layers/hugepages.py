"""CPU memory on transparent huge pages (2 MiB) for what the steps stream: the weights kept in
quantized blocks and the KV cache.

With 4 KiB pages, a decode step that streams 100 MB of weights walks the page tables ~24k times, and
the first write to each fresh KV page traps. Measured on a 2-core EPYC VM (kernel 6.18, THP
"madvise"): a first write costs 7.5 us a 4 KiB page, 0.35 us a 4 KiB share of a huge page; the
embedded model's batch-1 decode step took 13% less time with every allocation on huge pages
(`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, bench/latency.py). oneDNN's prepacked weights (the
dense path) are opaque tensors and stay where oneDNN put them.

The memory is an anonymous mapping advised MADV_HUGEPAGE over its whole 2 MiB pages only, so a
tensor's tail and the alignment slack never make a huge page resident for a few bytes. Zeros until
written and resident only once written, as calloc's were. Where the kernel has no transparent huge
pages, the advice fails quietly and the pages are 4 KiB ones.
"""
from __future__ import annotations

import mmap
from typing import Iterable

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each relocated tensor starts on a cache line (and on any element size)


def zeros(nbytes: int) -> torch.Tensor:
    """`nbytes` zero bytes (uint8), their huge-page-aligned whole 2 MiB spans advised MADV_HUGEPAGE."""
    # private: a shared anonymous mapping is shmem, which has its own (usually off) huge-page setting
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(buf, dtype=torch.uint8)  # the tensor's storage keeps `buf` mapped
    start = -whole.data_ptr() % HUGE_PAGE
    if nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
        except OSError:  # no transparent huge pages in this kernel
            pass
    return whole[start:start + nbytes]


def owns_storage(t: torch.Tensor) -> bool:
    """Whether `t` is all of its storage (not a view into a larger one, such as a memory-mapped file)."""
    return (t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous()
            and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes)


def relocate(tensors: Iterable[torch.Tensor]) -> int:
    """Moves each CPU tensor that owns its storage into one huge-page mapping, in place (`set_`: every
    holder of the tensor sees the new memory, the values unchanged), and returns the bytes moved.
    Views into larger storages (memory-mapped checkpoint tensors) stay where they are: copying them
    would add resident memory instead of moving it."""
    todo: dict[int, list[torch.Tensor]] = {}  # by address: distinct tensor objects may share a storage
    for t in tensors:
        if owns_storage(t) and t.nbytes:
            todo.setdefault(t.data_ptr(), []).append(t)
    offsets, total = [], 0
    for same in todo.values():
        offsets.append(total)
        total += -(-same[0].nbytes // ALIGN) * ALIGN
    if total < HUGE_PAGE:
        return 0
    arena = zeros(total)
    storage = arena.untyped_storage()
    base = arena.storage_offset()  # bytes: the arena is a uint8 view past the alignment slack
    with torch.no_grad():
        for same, off in zip(todo.values(), offsets):
            arena[off:off + same[0].nbytes].copy_(same[0].view(-1).view(torch.uint8))
            for t in same:
                t.set_(storage, (base + off) // t.element_size(), t.shape, t.stride())
    return sum(same[0].nbytes for same in todo.values())
