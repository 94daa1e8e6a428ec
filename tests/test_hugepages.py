"""layers/hugepages.py: the kept weights and the CPU KV cache on transparent huge pages."""
from __future__ import annotations

from pathlib import Path

import torch

from nanoserve.layers import hugepages

MB = 1 << 20


def thp_advised(ptr: int) -> bool | None:
    """Whether the mapping holding address `ptr` may take huge pages (None: this kernel has none)."""
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not enabled.exists() or "[never]" in enabled.read_text():
        return None
    vma = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            vma = lo <= ptr < hi
        elif vma and head == "VmFlags:":
            return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_relocate_moves_owners_in_place_and_leaves_views():
    a = torch.randn(600_000)                  # 2.4 MB
    b = torch.randint(0, 256, (1_000_003,), dtype=torch.uint8)
    b_again = b.view(torch.uint8)             # another tensor object on b's storage: must follow it
    big = torch.arange(1_000_000, dtype=torch.int64)
    view = big[100:200]                       # a view into a larger storage (like a mapped file's): stays
    want_a, want_b, old_view = a.clone(), b.clone(), view.data_ptr()
    moved = hugepages.relocate([a, b, b_again, view, a])
    assert moved == a.nbytes + b.nbytes
    assert torch.equal(a, want_a) and torch.equal(b, want_b) and torch.equal(b_again, want_b)
    assert b_again.data_ptr() == b.data_ptr() and \
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert a.data_ptr() % 64 == 0 and b.data_ptr() % 64 == 0 and view.data_ptr() == old_view
    a.add_(1)  # still an ordinary, writable tensor
    assert torch.equal(a, want_a + 1) and torch.equal(b, want_b)
    assert thp_advised(a.data_ptr()) in (True, None)
    small = torch.ones(1000)
    # under one huge page: not worth it
    assert hugepages.relocate([small]) == 0 and small.sum().item() == 1000


def test_zeros_advises_only_whole_huge_pages_and_reads_zero():
    z = hugepages.zeros(5 * MB + 123)
    assert z.dtype == torch.uint8 and z.numel() == 5 * MB + 123 and z.data_ptr() % (2 * MB) == 0
    assert not z.any()
    assert thp_advised(z.data_ptr()) in (True, None)
    z[-1] = 7  # the tail past the last whole huge page is ordinary memory in the same buffer
    assert z.sum().item() == 7
