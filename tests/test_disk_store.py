"""Disk KV store, file level: exact round trips through a real file, a checksum verified on every read,
files only their owner can open, and an index that a SIGKILL at any moment leaves whole (old or new).
Slow or failing I/O is injected by replacing os.pwritev / os.preadv, never by sleeping; nothing here
depends on the machine's speed."""
from __future__ import annotations

import hashlib
import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from nanoserve.kvcache.disk_store import (
    CHECKSUM_BYTES,
    DiskStore,
    IndexEntry,
    checksum,
    load_or_create_key,
)

REPO = Path(__file__).resolve().parent.parent
SHAPE = (3, 5, 7)  # 105 elements: 210 bytes in bf16, 420 in fp32, neither a multiple of 4096
BLOCKS = [(SHAPE, torch.bfloat16), (SHAPE, torch.float32), ((2, 1024), torch.float32),  # exactly one page
          ((5001,), torch.bfloat16)]  # over a page: padded to two


def chain(i: int) -> bytes:
    return hashlib.sha256(b"chain %d" % i).digest()


def make_pool(n: int, shape=SHAPE, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    return (torch.randn((n, *shape), generator=torch.Generator().manual_seed(seed)) * 100).to(dtype)


def block_bytes(pool: torch.Tensor) -> int:
    return pool[0].numel() * pool.element_size()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def write_ok(store: DiskStore, src: torch.Tensor, ids: list[int], slots: list[int]) -> list[bytes]:
    io = store.write(src, ids, slots, [chain(s) for s in slots])
    assert io.wait(30) and io.error is None and io.ok == [True] * len(ids)
    assert io.seconds >= 0
    return io.checksums


def read(store: DiskStore, dst: torch.Tensor, ids: list[int], slots: list[int], sums: list[bytes],
         chains: list[bytes] | None = None) -> list[bool]:
    io = store.read(dst, ids, slots, chains or [chain(s) for s in slots], sums)
    assert io.wait(30)
    return io.ok


@pytest.fixture
def store_of(tmp_path):
    opened: list[DiskStore] = []

    def make(num_slots: int, nbytes: int, name: str = "cache") -> DiskStore:
        opened.append(DiskStore(tmp_path / name, num_slots, nbytes))
        return opened[-1]
    yield make
    for s in opened:
        s.close()


# ---- round trips ---------------------------------------------------------------------------------
WRITES = {  # (source block ids, slots)
    "consecutive": (list(range(8)), list(range(2, 10))),
    "shuffled": (random.Random(1).sample(range(10), 8), random.Random(2).sample(range(12), 8)),
    "src runs, slots apart": ([2, 3, 4, 5, 6, 7], [9, 1, 6, 3, 0, 11]),
    "slots run, src apart": ([7, 0, 5, 2, 9, 4], [4, 5, 6, 7, 8, 9]),
}


@pytest.mark.parametrize("shape,dtype", BLOCKS)
@pytest.mark.parametrize("case", list(WRITES))
def test_round_trip_is_exact(store_of, case, shape, dtype):
    src = make_pool(10, shape, dtype)
    ids, slots = WRITES[case]
    store = store_of(12, block_bytes(src))
    assert store.slot_bytes % 4096 == 0 and store.slot_bytes - 4096 < block_bytes(src) <= store.slot_bytes
    sums = write_ok(store, src, ids, slots)
    assert sums == [checksum(chain(s), src[i]) for i, s in zip(ids, slots)]
    assert all(len(c) == CHECKSUM_BYTES for c in sums)
    # read back in another order, into other rows: consecutive slots into scattered rows and the reverse
    order = sorted(range(len(ids)), key=lambda k: slots[k])
    dst = torch.zeros((20, *shape), dtype=dtype)
    dst_ids = random.Random(3).sample(range(20), len(ids))
    assert read(store, dst, dst_ids, [slots[k] for k in order], [sums[k] for k in order]) == [True] * len(ids)
    for d, k in zip(dst_ids, order):
        assert torch.equal(dst[d], src[ids[k]])
    untouched = sorted(set(range(20)) - set(dst_ids))
    assert not dst[untouched].any()
    assert store.bytes_written == store.bytes_read == len(ids) * block_bytes(src)
    assert store.num_checksum_failures == store.num_read_errors == 0


def test_a_run_consecutive_on_both_sides_is_one_call(store_of, monkeypatch):
    calls: list[tuple[str, int]] = []
    for name in ("pwritev", "preadv"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda fd, bufs, off, real=real, name=name:
                            calls.append((name, len(bufs))) or real(fd, bufs, off))
    src = make_pool(600, (5,), torch.float32)
    store = store_of(600, block_bytes(src))
    sums = write_ok(store, src, [0, 1, 2, 9], [4, 5, 6, 7])
    assert calls == [("pwritev", 5), ("pwritev", 1)]  # block, padding, block, padding, block; then one
    calls.clear()
    ids = list(range(600))  # more blocks than one call takes buffers: two calls
    sums = write_ok(store, src, ids, ids)
    dst = torch.zeros_like(src)
    assert read(store, dst, ids[::-1], ids[::-1], sums[::-1]) == [True] * 600  # descending: a call each
    assert torch.equal(dst, src)
    assert calls[:2] == [("pwritev", 1023), ("pwritev", 175)] and len(calls) == 602


# ---- a checksum on every read --------------------------------------------------------------------
def test_a_flipped_byte_fails_that_block_only(store_of, tmp_path, caplog):
    src = make_pool(4)
    store = store_of(4, block_bytes(src))
    sums = write_ok(store, src, [0, 1, 2, 3], [0, 1, 2, 3])
    with open(tmp_path / "cache" / "blocks.dat", "r+b") as f:
        f.seek(2 * store.slot_bytes + 17)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    dst = torch.zeros_like(src)
    with caplog.at_level("WARNING", logger="nanoserve"):
        assert read(store, dst, [0, 1, 2, 3], [0, 1, 2, 3], sums) == [True, True, False, True]
    assert store.num_checksum_failures == 1 and store.num_read_errors == 0
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1  # one per failing batch
    assert torch.equal(dst[[0, 1, 3]], src[[0, 1, 3]])


def test_a_checksum_is_bound_to_its_chain(store_of):
    src = make_pool(2)
    store = store_of(2, block_bytes(src))
    sums = write_ok(store, src, [0, 1], [0, 1])
    dst = torch.zeros_like(src)
    # the same bytes, asked for as another chain's block (a slot reused after the index was saved)
    assert read(store, dst, [0, 1], [0, 1], sums, [chain(0), chain(7)]) == [True, False]
    assert checksum(chain(0), src[0]) != checksum(chain(7), src[0])
    assert store.num_checksum_failures == 1


def test_a_truncated_data_file_fails_the_lost_slots_without_raising(store_of, tmp_path):
    src = make_pool(6, SHAPE, torch.float32)
    store = store_of(6, block_bytes(src))
    sums = write_ok(store, src, list(range(6)), list(range(6)))
    os.truncate(tmp_path / "cache" / "blocks.dat", 3 * store.slot_bytes + 100)  # slot 3 cut short
    dst = torch.zeros_like(src)
    assert read(store, dst, list(range(6)), list(range(6)), sums) == [True] * 3 + [False] * 3
    assert store.num_read_errors == 3 and store.num_checksum_failures == 0
    assert torch.equal(dst[:3], src[:3])


def test_an_io_error_fails_only_its_block(store_of, monkeypatch):
    src = make_pool(6)
    store = store_of(6, block_bytes(src))
    bad = 3 * store.slot_bytes
    real_pwritev, real_preadv = os.pwritev, os.preadv

    def failing(real):
        def call(fd, bufs, offset):
            if offset <= bad < offset + sum(len(b) for b in bufs):
                raise OSError(28 if real is real_pwritev else 5, "injected")
            return real(fd, bufs, offset)
        return call
    monkeypatch.setattr(os, "pwritev", failing(real_pwritev))
    io = store.write(src, list(range(6)), list(range(6)), [chain(s) for s in range(6)])
    assert io.wait(30) and io.ok == [True, True, True, False, True, True] and isinstance(io.error, OSError)
    assert io.checksums[3] == b"" and all(io.checksums[k] for k in (0, 1, 2, 4, 5))
    monkeypatch.setattr(os, "pwritev", real_pwritev)
    sums = write_ok(store, src, list(range(6)), list(range(6)))
    monkeypatch.setattr(os, "preadv", failing(real_preadv))
    dst = torch.zeros_like(src)
    assert read(store, dst, list(range(6)), list(range(6)), sums) == [True, True, True, False, True, True]
    assert store.num_read_errors == 1 and store.num_checksum_failures == 0


def test_reads_do_not_queue_behind_writes(store_of, monkeypatch):
    src = make_pool(4)
    store = store_of(4, block_bytes(src))
    sums = write_ok(store, src, [0], [0])
    gate, real = threading.Event(), os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda *a: gate.wait(30) and real(*a))
    slow = store.write(src, [1, 2], [1, 2], [chain(1), chain(2)])
    dst = torch.zeros_like(src)
    assert read(store, dst, [3], [0], sums) == [True] and not slow.done()
    gate.set()
    store.drain()
    assert slow.done() and slow.ok == [True, True]


# ---- files and their owner -----------------------------------------------------------------------
def test_files_are_private_and_a_shared_directory_is_refused(tmp_path):
    directory = tmp_path / "a" / "b" / "cache"
    store = DiskStore(directory, 4, 100)
    store.save_index([], b"fp")
    store.close()
    store.close()  # idempotent
    key = load_or_create_key(directory)
    assert mode(directory) == 0o700
    assert {mode(directory / f) for f in ("blocks.dat", "index.bin", "hash_key")} == {0o600}
    assert len(key) == 32 and load_or_create_key(directory) == key
    assert load_or_create_key(tmp_path / "other") != key
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(ValueError, match=r"accessible by other users \(mode 0755\); chmod 700"):
        DiskStore(shared, 4, 100)
    with pytest.raises(ValueError, match="chmod 700"):
        load_or_create_key(shared)
    os.chmod(directory / "blocks.dat", 0o644)
    with pytest.raises(ValueError, match="blocks.dat is not a private file"):
        DiskStore(directory, 4, 100)
    os.chmod(directory / "hash_key", 0o640)
    with pytest.raises(ValueError, match="hash_key"):
        load_or_create_key(directory)
    os.chmod(directory / "hash_key", 0o600)
    (directory / "hash_key").write_bytes(b"short")
    with pytest.raises(ValueError, match="hash_key"):
        load_or_create_key(directory)


def test_one_directory_one_store_and_closing_ends_its_threads(tmp_path):
    def disk_threads() -> int:
        return sum(t.name.startswith("nanoserve-disk") for t in threading.enumerate())
    before, src = disk_threads(), make_pool(1)
    store = DiskStore(tmp_path / "c", 4, block_bytes(src))
    sums = write_ok(store, src, [0], [0])
    assert read(store, src, [0], [0], sums) == [True]
    lanes = {t.name.rsplit("_", 1)[0] for t in threading.enumerate() if t.name.startswith("nanoserve-disk")}
    # one thread per direction, and the reads' checksums
    assert lanes == {"nanoserve-disk-read", "nanoserve-disk-write", "nanoserve-disk-verify"}
    with pytest.raises(ValueError, match="in use by another process"):
        DiskStore(tmp_path / "c", 4, block_bytes(src))
    del store  # collected: its finalizer stops the threads and frees the file
    assert disk_threads() == before
    store = DiskStore(tmp_path / "c", 2, block_bytes(src))  # fewer slots: the file is not shrunk
    assert (tmp_path / "c" / "blocks.dat").stat().st_size == 4 * 4096
    store.close()
    with pytest.raises(ValueError, match="closed"):
        store.write(make_pool(1), [0], [0], [chain(0)])


# ---- the index -----------------------------------------------------------------------------------
def entries_for(n: int) -> list[IndexEntry]:
    """Chains of three (parent None at each start), token lists of 1-4 ids up to 2**31 + n."""
    return [IndexEntry(s, chain(s), None if s % 3 == 0 else chain(s - 1), (*range(s, s + s % 4), 2**31 + s),
                       bytes(range(s, s + CHECKSUM_BYTES))) for s in range(n)]


def test_index_round_trip_and_fingerprint(store_of, tmp_path, caplog):
    store = store_of(8, 420)
    assert store.load_index(b"fp") is None  # no index yet: silently
    entries = entries_for(8)
    store.save_index(entries, b"model-a")
    with caplog.at_level("WARNING", logger="nanoserve"):
        assert store.load_index(b"model-a") == entries
        assert not caplog.records
        assert store.load_index(b"model-b") is None
    [record] = caplog.records
    assert "another model/dtype/layout/key" in record.getMessage()
    store.close()
    assert DiskStore(tmp_path / "cache", 5, 420).load_index(b"model-a") == entries[:5]  # slots >= 5 dropped
    with pytest.raises(ValueError):
        store_of(1, 420, "other").save_index([IndexEntry(0, b"short", None, (), bytes(16))], b"fp")


def test_a_damaged_index_is_refused_without_raising(store_of, tmp_path, caplog):
    store = store_of(8, 420)
    store.save_index(entries_for(8), b"fp")
    path = tmp_path / "cache" / "index.bin"
    good = path.read_bytes()
    rng = random.Random(4)
    damaged = [good[:n] for n in (0, 5, 30, len(good) // 2, len(good) - 1)]
    damaged += [good[:k] + bytes([good[k] ^ 1 << rng.randrange(8)]) + good[k + 1:]
                for k in [0, 9, 20, len(good) - 1] + rng.sample(range(len(good)), 20)]
    for data in damaged:
        path.write_bytes(data)
        caplog.clear()
        with caplog.at_level("WARNING", logger="nanoserve"):
            assert store.load_index(b"fp") is None
        assert len(caplog.records) == 1


def test_a_crash_mid_save_leaves_the_previous_index(store_of, tmp_path):
    store = store_of(8, 420)
    store.save_index(entries_for(4), b"fp")
    (tmp_path / "cache" / "index.tmp").write_bytes(b"NSKVIDX1 half of an index")  # a SIGKILL mid-save
    assert store.load_index(b"fp") == entries_for(4)
    store.save_index(entries_for(6), b"fp")
    assert store.load_index(b"fp") == entries_for(6) and not (tmp_path / "cache" / "index.tmp").exists()


# ---- SIGKILL at a random moment --------------------------------------------------------------------
ROUNDS, PER = 40, 6


def round_blocks(k: int) -> torch.Tensor:
    return make_pool(PER, SHAPE, torch.bfloat16, seed=k)


# One interpreter imports torch once, then forks a writer per directory (while it is single-threaded);
# each writer loops writing a round of blocks into fresh slots and saving the index of all rounds so far,
# and says which round it has saved, so that the test kills it mid-loop however fast the machine is.
WRITER = f"""
import hashlib, os, sys, torch
from pathlib import Path
from nanoserve.kvcache.disk_store import DiskStore, IndexEntry
def round_blocks(k):  # the test's own, for the same blocks
    g = torch.Generator().manual_seed(k)
    return (torch.randn(({PER}, *{SHAPE}), generator=g) * 100).to(torch.bfloat16)
root, n = Path(sys.argv[1]), int(sys.argv[2])
for child in range(n):
    if os.fork() == 0:
        store = DiskStore(root / str(child), {ROUNDS * PER}, {2 * 105})
        entries = []
        for k in range({ROUNDS}):
            src = round_blocks(k)
            slots = list(range(k * {PER}, (k + 1) * {PER}))
            chains = [hashlib.sha256(b"chain %d" % s).digest() for s in slots]
            io = store.write(src, list(range({PER})), slots, chains)
            assert io.wait(60) and all(io.ok)
            entries += [IndexEntry(s, c, chains[i - 1] if i else None, (k, i), cs)
                        for i, (s, c, cs) in enumerate(zip(slots, chains, io.checksums))]
            store.save_index(entries, b"fp")
            os.write(1, b"%d %d %d\\n" % (child, os.getpid(), k))  # one write: lines never interleave
        store.close()
        os._exit(0)
for _ in range(n):
    os.wait()
"""


def test_sigkill_at_any_moment_leaves_no_index_or_a_whole_one(tmp_path, caplog):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), "3"], stdout=subprocess.PIPE,
                            env=env, text=True)
    kill_after = [random.randrange(ROUNDS - 10) for _ in range(3)]  # then a random moment in a round
    try:
        while any(k is not None for k in kill_after) and (line := proc.stdout.readline()):
            child, pid, k = map(int, line.split())
            if kill_after[child] is not None and k >= kill_after[child]:
                kill_after[child] = None
                time.sleep(random.uniform(0, 0.004))
                os.kill(pid, signal.SIGKILL)  # not reaped until the parent's os.wait: the pid is still its
        proc.communicate(timeout=60)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for child in range(3):
        directory = tmp_path / str(child)
        store = DiskStore(directory, ROUNDS * PER, 2 * 105)
        with caplog.at_level("WARNING", logger="nanoserve"):
            entries = store.load_index(b"fp")
        assert not caplog.records  # never a torn index.bin: none yet, or a whole one
        if entries is None:
            assert not (directory / "index.bin").exists()
            continue
        assert len(entries) % PER == 0 and [e.slot for e in entries] == list(range(len(entries)))
        dst = torch.zeros((len(entries), *SHAPE), dtype=torch.bfloat16)
        io = store.read(dst, list(range(len(entries))), [e.slot for e in entries], [e.chain for e in entries],
                        [e.checksum for e in entries])
        assert io.wait(30) and all(io.ok)
        for e in entries:
            k, i = e.tokens
            assert torch.equal(dst[e.slot], round_blocks(k)[i])
        store.close()


def test_symlinks_and_other_users_directories_are_refused(tmp_path):
    """A symlinked directory, a blocks.dat that is a symlink (to a file the server could overwrite), and a
    directory another user owns (who could plant a key and an index) are refused; a cache too small for
    one block is a start-up error."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ValueError, match="not a directory of this user's"):
        DiskStore(tmp_path / "link", 4, 100)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    os.chmod(victim, 0o600)
    (real / "blocks.dat").symlink_to(victim)
    with pytest.raises(OSError):  # O_NOFOLLOW: never opened through the link
        DiskStore(real, 4, 100)
    assert victim.read_bytes() == b"keep me"
    with pytest.raises(ValueError, match="smaller than one KV block"):
        DiskStore(tmp_path / "tiny", 0, 100)
    if os.geteuid() == 0:  # only root can hand a directory to another user
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(ValueError, match="owned by another user"):
            DiskStore(theirs, 4, 100)
