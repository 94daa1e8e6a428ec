"""The C++ `chain_digests` kernel (kernels/csrc/chain_hash.cpp): a prompt's chain of keyed BLAKE2b-256 block
digests, bit-exact with hashlib (the Python reference below, kvcache's chain_hash block after block) over
random tokens, block sizes, parents and keys (longer than 64 bytes: cut like the reference); the message
lengths at BLAKE2b's 128-byte block edges; a known answer; inputs with no full block; the argument errors;
and a 4 MB call that leaves another Python thread running (the GIL released while it hashes)."""
from __future__ import annotations

import ctypes
import hashlib
import sys
import threading
import time
from array import array

import pytest
from hypothesis import given, settings, strategies as st
from tests.test_cpu_kernels import kernels  # noqa: F401 - the module fixture (skips without a toolchain)



def chain_digests_ref(tokens: bytes, block_size: int, parent: bytes | None, key: bytes) -> bytes:
    out, step = [], 8 * block_size
    for off in range(0, len(tokens) - step + 1, step):
        h = hashlib.blake2b(digest_size=32, key=key[:64])
        h.update(parent if parent is not None else b"\0" * 32)
        h.update(tokens[off:off + step])
        parent = h.digest()
        out.append(parent)
    return b"".join(out)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 2 ** 40), max_size=200), block_size=st.sampled_from([1, 3, 16, 32]),
       parent=st.none() | st.binary(min_size=32, max_size=32), key=st.binary(max_size=80),
       split=st.integers(0, 8))
def test_chain_digests_matches_hashlib(kernels, ids, block_size, parent, key, split) -> None:
    """Equal to the reference; and a chain cut after `split` blocks, its second part started from the first
    part's last digest, is the same chain."""
    tokens = array("q", ids).tobytes()
    got = kernels.chain_digests(tokens, block_size, parent, key)
    assert got == chain_digests_ref(tokens, block_size, parent, key)
    assert len(got) == 32 * (len(ids) // block_size)
    cut = min(split, len(ids) // block_size) * 8 * block_size
    head = kernels.chain_digests(tokens[:cut], block_size, parent, key)
    tail = kernels.chain_digests(tokens[cut:], block_size, head[-32:] if head else parent, key)
    assert head + tail == got


# 32 digest bytes + the block's: 12 tokens fill one 128-byte BLAKE2b block exactly, 28 two, 44 three (the last
# block full, not padded); their neighbours end one token into, or short of, a block. Keys of 64 bytes and
# over are cut to 64 (the key block full)
@pytest.mark.parametrize("block_size", [2, 11, 12, 13, 27, 28, 29, 44, 45, 64, 256])
@pytest.mark.parametrize("key_len", [0, 1, 63, 64, 65, 128])
def test_chain_digests_at_blake2b_block_edges(kernels, block_size, key_len) -> None:
    tokens = array("q", [(i * 2654435761) % 2 ** 63 - 2 ** 62 for i in range(5 * block_size + 3)]).tobytes()
    key = bytes(range(key_len))
    for parent in (None, bytes(range(100, 132))):
        assert kernels.chain_digests(tokens, block_size, parent, key) == \
            chain_digests_ref(tokens, block_size, parent, key)


def test_chain_digests_known_answer(kernels) -> None:
    """48 tokens 0..47 in blocks of 16, keyed b'nanoserve', no parent: three digests, each hashlib's of the
    previous one and its block (hex pinned, so the test also stands without the reference)."""
    tokens = array("q", range(48)).tobytes()
    got = kernels.chain_digests(tokens, 16, None, b"nanoserve")
    prev, want = b"\0" * 32, []
    for i in range(3):
        block = tokens[128 * i:128 * (i + 1)]
        prev = hashlib.blake2b(prev + block, digest_size=32, key=b"nanoserve").digest()
        want.append(prev)
    assert got == b"".join(want)
    assert got[:32].hex() == "f75d12a1946af1a5eb59fe11ddaacdffd170049118ba9ad2ee60056e03337eda"
    assert got[-32:].hex() == "0df0d0d9d345646810c3122cba4a86c7984e2e89e6027322af65e9af5c62db0f"
    # a trailing partial block, and trailing bytes short of a token, are not hashed
    longer = tokens + array("q", [7] * 15).tobytes() + b"xyz"
    assert kernels.chain_digests(longer, 16, None, b"nanoserve") == got


def test_chain_digests_of_no_full_block_is_empty(kernels) -> None:
    assert kernels.chain_digests(b"", 1, None, b"") == b""
    assert kernels.chain_digests(b"", 16, bytes(32), b"key") == b""
    assert kernels.chain_digests(b"1234567", 1, None, b"") == b""  # not one whole token
    assert kernels.chain_digests(array("q", range(15)).tobytes(), 16, None, b"k") == b""
    assert kernels.chain_digests(array("q", range(16)).tobytes(), 2 ** 62, None, b"k") == b""


def test_chain_digests_argument_errors(kernels) -> None:
    tokens = array("q", range(32)).tobytes()
    for block_size in (0, -1, -(2 ** 40)):
        with pytest.raises(ValueError, match="block_size must be >= 1"):
            kernels.chain_digests(tokens, block_size, None, b"")
    for parent in (b"", bytes(31), bytes(33), bytes(64)):
        with pytest.raises(ValueError, match="parent must be a 32-byte digest"):
            kernels.chain_digests(tokens, 16, parent, b"")
    for parent in ("x" * 32, bytearray(32), memoryview(bytes(32)), 0):
        with pytest.raises(TypeError, match="parent must be bytes or None"):
            kernels.chain_digests(tokens, 16, parent, b"")
    for bad in ((list(range(32)), 16, None, b""), ("tokens", 16, None, b""), (tokens, 16, None, "key"),
                (tokens, 16, None, None), (tokens, 2 ** 64, None, b"")):
        with pytest.raises(TypeError):
            kernels.chain_digests(*bad)


def _counted_during(call, times: int = 6) -> list[int]:
    """How far another thread's counter moves during each of `times` calls. It sleeps briefly between counts
    (the GIL is free to take back); the switch interval is made longer than the whole loop, so a call that
    held the GIL would leave the counter where it was (this thread never blocks or yields in the loop),
    however slow the machine."""
    count, started, stop = [0], threading.Event(), threading.Event()

    def counter() -> None:
        started.set()
        while not stop.is_set():
            count[0] += 1
            time.sleep(0.0002)

    interval = sys.getswitchinterval()
    thread = threading.Thread(target=counter, daemon=True)
    sys.setswitchinterval(5.0)
    try:
        thread.start()
        started.wait()
        progressed = []
        for _ in range(times):
            before = count[0]
            call()
            progressed.append(count[0] - before)
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        thread.join()
    return progressed


def test_chain_digests_releases_the_gil_while_hashing(kernels) -> None:
    """Another thread keeps counting while this one hashes 4 MB of tokens (~10-40 ms a call: tens of counts
    each); the control, a C call as long that holds the GIL (usleep through ctypes.PyDLL), sees none."""
    tokens = array("q", range(4 << 20 >> 3)).tobytes()  # 4 MB: 32768 blocks of 16 tokens
    key = b"salt"
    assert kernels.chain_digests(tokens, 16, None, key) == chain_digests_ref(tokens, 16, None, key)
    progressed = _counted_during(lambda: kernels.chain_digests(tokens, 16, None, key))
    assert sum(progressed) >= 12 and sum(p > 0 for p in progressed) >= 3, progressed
    if sys.platform.startswith("linux"):
        usleep = ctypes.PyDLL(None).usleep  # PyDLL: the call keeps the GIL
        assert _counted_during(lambda: usleep(20000)) == [0] * 6
