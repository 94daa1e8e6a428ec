"""The gguf package's reader for loading weights only: metadata arrays (the vocabulary, merges, token
types) are stepped over instead of parsed, and pages of the mapped file that nothing reads again are
handed back.

The stock `GGUFReader` makes a numpy view for every element of every metadata array, two for each
string: 245k views for the embedded model's 49k-token vocabulary, 2.4 s and 157 MB at the peak, of
which ~20 MB stay in the process after the reader is gone (freed small objects whose pages the
allocator keeps). Loading weights needs none of them: the tensor table and `general.alignment` only.
"""
from __future__ import annotations

import mmap
import struct

import numpy as np
from gguf import GGUFReader, GGUFValueType

_SCALAR_BYTES = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
                 GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2, GGUFValueType.UINT32: 4,
                 GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4, GGUFValueType.UINT64: 8,
                 GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}


class WeightsReader(GGUFReader):
    """`GGUFReader` whose array fields keep only their element type and length (`field.parts[-2:]`;
    `contents()` reads them as empty): scalars, strings and the tensors are the stock reader's."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":  # byte-swapped files: the stock walk
            return super()._get_field_parts(orig_offs, raw_type)
        itype, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        sub = GGUFValueType(int(itype[0]))
        offs = orig_offs + 12
        if sub == GGUFValueType.STRING:  # each a u64 length, then its bytes
            buf = memoryview(self.data)
            for _ in range(int(count[0])):
                offs += 8 + struct.unpack_from("=Q", buf, offs)[0]
        elif sub in _SCALAR_BYTES:
            offs += int(count[0]) * _SCALAR_BYTES[sub]
        else:  # arrays of arrays: not in any file we load, left to the stock walk
            return super()._get_field_parts(orig_offs, raw_type)
        return offs - orig_offs, [itype, count], [], [GGUFValueType.ARRAY, sub]

    def release(self, start: int, end: int) -> None:
        """Drop this process's pages of bytes [start, end) of the file (whole pages inside it only):
        bytes copied out at load (the permuted Q/K rows, the metadata) that the map would otherwise
        keep resident. The map is copy-on-write and never written, so nothing is lost: a later read
        faults the page in from the file again."""
        m = getattr(self.data, "_mmap", None)  # np.memmap's mmap.mmap
        page = mmap.PAGESIZE
        lo, hi = -(-start // page) * page, end // page * page
        if m is not None and hi > lo and hasattr(m, "madvise"):
            m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
