"""The C++ kernels the KV cache's bookkeeping uses where the install built them (kernels/cpu_kernels.py:
`make install` and the Docker image build them, for a CUDA engine too). Each replaces a Python function
that runs without them and that the tests compare it with; on the step path, where a forward has left
the caches cold, one call replaces a dozen numpy or tensor-slicing calls of ~5-10 us apiece. A pool
carries them (`BlockPool.kernels`), so the functions given a pool (matching its runs, choosing its extents)
find them there; the hashing and the copier are handed theirs."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

ChainDigests = Callable[[bytes, int, "bytes | None", bytes], bytes]        # prefix.chain_links
FreeExtents = Callable[[bytearray, int, int], list[tuple[int, int]]]     # extents.allocate_spans
CopyRuns = Callable[[torch.Tensor, torch.Tensor, list[tuple[int, int, int]], int, bool], None]  # copy_blocks
StoredRuns = Callable[[dict, list, list, list, int], list[tuple[int, int]]]  # chain_runs.stored_runs


@dataclass(frozen=True)
class KVKernels:
    chain_digests: ChainDigests | None = None
    free_extents: FreeExtents | None = None
    copy_runs: CopyRuns | None = None
    stored_runs: StoredRuns | None = None

    @classmethod
    def of(cls, module: Any | None) -> KVKernels:
        """The kernels of a built module (cpu_kernels.built()), none for None."""
        if module is None:
            return cls()
        return cls(module.chain_digests, module.free_extents, module.copy_runs, module.stored_runs)
