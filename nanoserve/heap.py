"""The process heap (torch-free: the API process uses it too)."""
from __future__ import annotations

import ctypes


def trim_heap() -> None:
    """Hands the heap's free memory back to the kernel (glibc's malloc_trim), for after a load: glibc
    keeps freed heap chunks resident. Measured (bench/latency.py --load-stages): the storages
    relocate() moved out of kept the embedded model's engine 60 MB larger; parsing a tokenizer's files
    left ~20 MB in the engine and ~30 MB in the API process."""
    try:
        ctypes.CDLL(None).malloc_trim(0)  # the process's own symbols: libc's where it is glibc
    except (AttributeError, OSError):  # not glibc
        pass
