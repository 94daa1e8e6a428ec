"""models/gguf_reader.WeightsReader: the same tensors as the gguf package's reader without parsing the
metadata arrays, and `release` hands the mapped pages back."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from nanoserve.models.gguf_reader import WeightsReader
from nanoserve.models.loader import embedded_source


@pytest.fixture(scope="module")
def path() -> str:
    src = embedded_source()
    return str(src.path / src.gguf_file)


def test_same_tensors_and_fields_as_the_stock_reader(path):
    stock, slim = GGUFReader(path), WeightsReader(path, "c")
    assert (slim.data_offset, slim.alignment) == (stock.data_offset, stock.alignment)
    assert list(slim.fields) == list(stock.fields)
    assert len(slim.tensors) == len(stock.tensors) == 272
    for a, b in zip(stock.tensors, slim.tensors):
        assert (a.name, a.tensor_type, a.data_offset, a.n_bytes, a.data.shape) == \
               (b.name, b.tensor_type, b.data_offset, b.n_bytes, b.data.shape)
        assert np.array_equal(a.data[:4], b.data[:4]) and np.array_equal(a.data[-4:], b.data[-4:])
    for key, a in stock.fields.items():
        b = slim.fields[key]
        assert b.types == a.types, key
        if a.types[0] == GGUFValueType.ARRAY:  # type and length kept, elements not parsed
            assert int(b.parts[-1][0]) == len(a.data) and b.contents() == [], key
        else:
            assert b.contents() == a.contents(), key
    assert len(stock.fields["tokenizer.ggml.tokens"].data) == 49152


def _mapped_kb(start: int, end: int) -> int:
    """Resident kB of this process's mappings overlapping [start, end) of the address space."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and hi > start
            elif inside and head == "Rss:":
                total += int(line.split()[1])
    return total


def test_release_drops_the_pages_and_a_later_read_gets_the_same_bytes(path):
    r = WeightsReader(path, "c")
    t = next(t for t in r.tensors if t.name == "token_embd.weight")  # 30 MB
    before = t.data.copy()
    addr = r.data.ctypes.data
    assert int(t.data.sum(dtype=np.uint64)) > 0  # touch every page
    touched = _mapped_kb(addr, addr + r.data.nbytes)
    r.release(t.data_offset, t.data_offset + t.n_bytes)
    dropped = touched - _mapped_kb(addr, addr + r.data.nbytes)
    assert dropped > 0.9 * t.n_bytes / 1024, (touched, dropped, t.n_bytes)
    assert np.array_equal(t.data, before)  # faulted in again from the file
