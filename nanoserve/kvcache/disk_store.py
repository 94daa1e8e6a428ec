"""Disk tier, file level: KV blocks in the slots of one preallocated file, checked on every read, and an
index of them kept across restarts. Which block goes to which slot is the caller's (DiskTier's) choice.

One directory only its owner may open (0700: the cached KV is other tenants' prompts); files 0600:
  blocks.dat  slot i at i * slot_bytes (a block rounded up to 4096: page-aligned for the page cache and
              a later O_DIRECT). Reserved whole at start (posix_fallocate), never shrunk; flock'ed while
              open (two servers would clobber it).
  index.bin   little-endian: b"NSKVIDX1", u32 fingerprint length, fingerprint, u64 slot_bytes, u64 count;
              per entry u32 slot, u8 has_parent, 32-byte chain, 32-byte parent (zeros if none), 16-byte
              checksum, u32 token count, the tokens as u32; then the sha256 of all that.
  hash_key    the 32 random bytes keying the chain digests, so a restarted server computes the same.

Crash safety. A block's checksum, sha256(chain || bytes)[:16], comes back from its write, is kept in the
index and is checked on every read: a slot torn by a crash, or rewritten with another chain's block since
the index was saved, fails its read (ok False: recomputed), whatever the index says. The index is replaced
atomically: written whole to index.tmp, fsynced, renamed over index.bin, the directory fsynced; the data
file is fsynced first, so even after a power loss no index names a block only the page cache held. A
SIGKILL at any moment leaves the previous index.bin or the new one, whole (its sha256 rejects the rest).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import stat
import struct
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoserve.kvcache.transfer import MAX_COPY_BYTES, Transfer, runs

log = logging.getLogger("nanoserve")
CHECKSUM_BYTES, KEY_BYTES, DIGEST_BYTES, SLOT_ALIGN, MAGIC = 16, 32, 32, 4096, b"NSKVIDX1"
_HEAD, _SIZES, _ENTRY = struct.Struct("<8sI"), struct.Struct("<QQ"), struct.Struct("<IB32s32s16sI")
_IOV_MAX = 1024  # Linux's most buffers for a preadv/pwritev; a run of n blocks is 2n - 1 (block, pad, ...)


@dataclass(frozen=True)
class IndexEntry:
    slot: int
    chain: bytes            # 32-byte chain digest of the block (keyed blake2b, the caller's)
    parent: bytes | None    # the parent's chain digest, None for a chain's first block
    tokens: tuple[int, ...]
    checksum: bytes         # CHECKSUM_BYTES, as the write returned it


class DiskIO(Transfer):
    """One batch of block reads or writes; once done, `ok[i]`: block i written / read and verified, and
    (writes) `checksums[i]` what it was written with, b"" where not ok. `error`: the first OSError."""

    def __init__(self, n: int) -> None:
        self.ok, self.checksums = [False] * n, [b""] * n
        self._event = threading.Event()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


def checksum(chain: bytes, data: bytes | memoryview | torch.Tensor) -> bytes:
    """Binds the bytes to their chain: a slot rewritten with another chain's block never verifies as the
    old one. sha256 releases the GIL on buffers over 2 KiB: I/O threads hash alongside the model."""
    h = hashlib.sha256(chain)
    h.update(_byte_view(data) if isinstance(data, torch.Tensor) else data)
    return h.digest()[:CHECKSUM_BYTES]


def _byte_view(t: torch.Tensor) -> memoryview:
    """The tensor's own memory (view raises where it would copy); numpy has no bf16: viewed as uint8."""
    return memoryview(t.view(-1).view(torch.uint8).numpy())


def _private_dir(directory: Path) -> Path:
    """Ours alone: a real directory (not a symlink), owned by this user, mode 0700. Another user's directory,
    even 0700, is refused: whoever owns it could plant a key and an index, and read every tenant's KV."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
        os.chmod(directory, 0o700)  # a umask may have taken the owner's own bits
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise ValueError(f"--disk-cache-dir {directory} is not a directory of this user's (a symlink, or "
                         "owned by another user)")
    if (mode := stat.S_IMODE(st.st_mode)) & 0o077:
        raise ValueError(f"--disk-cache-dir {directory} is accessible by other users (mode {mode:04o}); "
                         "chmod 700 it")
    return directory


def _open_private(path: Path, flags: int) -> int:
    """A regular file of this user's, 0600, never through a symlink."""
    fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        os.close(fd)
        raise ValueError(f"{path} is not a private file of this user's (mode {stat.S_IMODE(st.st_mode):04o}, "
                         f"owner {st.st_uid}); remove it or chmod 600 it")
    return fd


def _install(tmp: Path, path: Path, data: bytes, replace: bool) -> None:
    """`data` written whole to the private file `tmp` and synced, then put at `path` in one step: over
    it (rename) or only where nothing is yet (link never replaces); the directory synced after."""
    tmp.unlink(missing_ok=True)  # a crashed writer's leftover
    with open(_open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if replace:
        os.replace(tmp, path)
    else:
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
        tmp.unlink()
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)


def load_or_create_key(directory: Path) -> bytes:
    """The key in DIRECTORY/hash_key, made on first use. Of two processes starting at once the first
    link wins and both read its key; nobody ever reads half of one."""
    path = _private_dir(Path(directory)) / "hash_key"
    if not path.exists():
        _install(path.with_name(f"hash_key.{os.getpid()}.tmp"), path, os.urandom(KEY_BYTES), replace=False)
    with open(_open_private(path, os.O_RDONLY), "rb") as f:
        key = f.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise ValueError(f"{path} holds {len(key)} bytes, not a {KEY_BYTES}-byte key; remove it")
    return key


class _SlotFile:
    """The data file, its counters, and one I/O thread per direction (a read a request waits for never
    queues behind a long write-back). The threads hold this, never the DiskStore: its finalizer ends them."""

    def __init__(self, fd: int, block_bytes: int, slot_bytes: int) -> None:
        self.fd, self.block_bytes, self.slot_bytes = fd, block_bytes, slot_bytes
        self.zeros = memoryview(bytes(slot_bytes - block_bytes))  # written between the blocks of a run
        self.scratch = memoryview(bytearray(slot_bytes - block_bytes))  # read into, ignored (reader only)
        self.span = max(1, min(_IOV_MAX // 2, MAX_COPY_BYTES // slot_bytes))
        self.num_checksum_failures = self.num_read_errors = self.bytes_written = self.bytes_read = 0
        self.lanes = {lane: ThreadPoolExecutor(1, f"nanoserve-disk-{lane}") for lane in ("read", "write")}
        # a read's checksums on two threads (hashlib releases the GIL): a request waits for them, while
        # writes are nobody's wait and keep to their one thread, off the cores the model computes on
        self.hashers = ThreadPoolExecutor(2, "nanoserve-disk-verify")

    def shutdown(self) -> None:
        for lane in self.lanes.values():
            lane.shutdown()  # after the batches already queued: nothing uses the fd once it is closed
        self.hashers.shutdown()
        os.close(self.fd)  # releases the flock too

    def run(self, io: DiskIO, body: Callable, rows: memoryview, block_ids: list[int], slots: list[int],
            *per_block: list[bytes]) -> None:
        """`body` per run consecutive on both sides; a run an OSError stops is redone block by block, so
        only the blocks that really fail are lost. The handle completes whatever happens."""
        t0, i, mismatches = time.perf_counter(), 0, self.num_checksum_failures
        try:
            for b, s, n in runs(block_ids, slots, self.span):
                try:
                    body(io, rows, i, b, s, n, *per_block)
                except OSError as e:
                    io.error = io.error or e
                    for k in range(n if n > 1 else 0):
                        with contextlib.suppress(OSError):
                            body(io, rows, i + k, b + k, s + k, 1, *per_block)
                i += n
        except BaseException as e:  # noqa: BLE001 - whatever it is, the handle completes: its caller waits
            io.error = io.error or e
        io.seconds = time.perf_counter() - t0
        if body == self.reads:  # what failed without a mismatch was not read: an OSError or a truncated file
            self.num_read_errors += io.ok.count(False) - (self.num_checksum_failures - mismatches)
        if not all(io.ok):
            log.warning("disk KV cache: %d of %d block %s failed (%s)", io.ok.count(False), len(io.ok),
                        body.__name__, io.error or "checksum mismatch or short read: recomputed")
        io._event.set()

    def _iov(self, rows: memoryview, b: int, n: int, gap: memoryview) -> list[memoryview]:
        """Blocks b.. of `rows` as one preadv/pwritev's buffers: the slots' padding goes through `gap`."""
        bb, pad = self.block_bytes, [gap] if len(gap) else []
        return [m for k in range(b, b + n) for m in (pad if k > b else []) + [rows[k * bb:(k + 1) * bb]]]

    def writes(self, io: DiskIO, rows: memoryview, i: int, b: int, s: int, n: int,
               chains: list[bytes]) -> None:
        bb, want = self.block_bytes, n * self.slot_bytes - len(self.zeros)
        sums = [checksum(chains[i + k], rows[(b + k) * bb:(b + k + 1) * bb]) for k in range(n)]
        if os.pwritev(self.fd, self._iov(rows, b, n, self.zeros), s * self.slot_bytes) < want:
            raise OSError("short write to the disk KV cache (full?)")  # redone block by block
        io.ok[i:i + n], io.checksums[i:i + n] = [True] * n, sums
        self.bytes_written += n * bb

    def reads(self, io: DiskIO, rows: memoryview, i: int, b: int, s: int, n: int, chains: list[bytes],
              sums: list[bytes]) -> None:
        bb = self.block_bytes
        got = os.preadv(self.fd, self._iov(rows, b, n, self.scratch), s * self.slot_bytes)
        whole = range(min(n, (got - bb) // self.slot_bytes + 1))  # those wholly read (a truncated file)
        found = self.hashers.map(lambda k: checksum(chains[i + k], rows[(b + k) * bb:(b + k + 1) * bb]),
                                 whole)
        for k, got_sum in zip(whole, found):
            if got_sum != sums[i + k]:
                self.num_checksum_failures += 1
            else:
                io.ok[i + k] = True
                self.bytes_read += bb


def slot_size(block_bytes: int) -> int:
    """Bytes a block takes in the data file: rounded up to a page."""
    return -(-block_bytes // SLOT_ALIGN) * SLOT_ALIGN


class DiskStore:
    """The slots of DIRECTORY/blocks.dat, read and written asynchronously, and their index."""

    def __init__(self, directory: Path, num_slots: int, block_bytes: int) -> None:
        self.directory = _private_dir(Path(directory))
        self.num_slots, self.block_bytes = num_slots, block_bytes
        self.slot_bytes = slot_size(block_bytes)
        fd = _open_private(self.directory / "blocks.dat", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when its holder dies
        except BlockingIOError:
            os.close(fd)
            raise ValueError(f"--disk-cache-dir {self.directory} is in use by another process") from None
        if num_slots < 1:
            os.close(fd)
            raise ValueError(f"--disk-cache-gb is smaller than one KV block ({self.slot_bytes} bytes)")
        try:  # the space reserved now: a disk too small is a start-up error, not failed writes later
            os.posix_fallocate(fd, 0, num_slots * self.slot_bytes)  # never shrunk
        except OSError as e:
            os.close(fd)
            raise ValueError(f"--disk-cache-dir {self.directory}: cannot reserve "
                             f"{num_slots * self.slot_bytes / 2**30:.2f} GiB ({e.strerror})") from None
        self._file = _SlotFile(fd, block_bytes, self.slot_bytes)
        self._last: dict[str, DiskIO] = {}  # lanes are FIFO: the last one done means all are
        self._close = weakref.finalize(self, self._file.shutdown)

    num_checksum_failures = property(lambda self: self._file.num_checksum_failures)
    num_read_errors = property(lambda self: self._file.num_read_errors)
    bytes_written = property(lambda self: self._file.bytes_written)
    bytes_read = property(lambda self: self._file.bytes_read)

    def _submit(self, lane: str, body: Callable, t: torch.Tensor, block_ids: list[int], slots: list[int],
                *per_block: list[bytes]) -> DiskIO:
        """Queue a batch known to stay inside the pool and the file (past either, a slice is just short)."""
        if not self._close.alive:
            raise ValueError("disk KV cache is closed")
        if t.dim() == 0 or t[0].numel() * t.element_size() != self.block_bytes:
            raise ValueError(f"disk KV cache: {tuple(t.shape)} {t.dtype} rows are not {self.block_bytes} B")
        if any(len(x) != len(block_ids) for x in (slots, *per_block)) or not all(
                0 <= b < len(t) for b in block_ids) or not all(0 <= s < self.num_slots for s in slots):
            raise IndexError(f"disk KV cache: a batch outside {len(t)} rows and {self.num_slots} slots")
        io = self._last[lane] = DiskIO(len(block_ids))
        self._file.lanes[lane].submit(self._file.run, io, body, _byte_view(t), list(block_ids), list(slots),
                                      *map(list, per_block))
        return io

    def write(self, src: torch.Tensor, block_ids: list[int], slots: list[int], chains: list[bytes]) -> DiskIO:
        """Write src[block_ids[i]] to slot slots[i], straight from the pool's memory (a pwritev per run
        consecutive on both sides). The caller keeps those rows unchanged until done()."""
        return self._submit("write", self._file.writes, src, block_ids, slots, chains)

    def read(self, dst: torch.Tensor, block_ids: list[int], slots: list[int], chains: list[bytes],
             checksums: list[bytes]) -> DiskIO:
        """Read slot slots[i] into dst[block_ids[i]] (a preadv per run) and verify it. A row whose `ok`
        is False holds garbage: the caller does not publish it."""
        return self._submit("read", self._file.reads, dst, block_ids, slots, chains, checksums)

    def drain(self) -> None:
        for io in list(self._last.values()):
            io.wait()

    def close(self) -> None:
        self.drain()
        self._close()

    def save_index(self, entries: list[IndexEntry], fingerprint: bytes) -> None:
        """Shutdown only (synchronous); atomic, as the module's docstring says."""
        self.drain()
        os.fsync(self._file.fd)  # the blocks the entries name reach the disk before the entries do
        parts = [_HEAD.pack(MAGIC, len(fingerprint)), fingerprint, _SIZES.pack(self.slot_bytes, len(entries))]
        for e in entries:  # struct pads or cuts a bytes field silently: a digest of the wrong size is refused
            if len(e.chain) != 32 or len(e.parent or bytes(32)) != 32 or len(e.checksum) != CHECKSUM_BYTES:
                raise ValueError(f"index entry of slot {e.slot}: a digest of the wrong size")
            parts += [_ENTRY.pack(e.slot, e.parent is not None, e.chain, e.parent or b"", e.checksum,
                                  len(e.tokens)), struct.pack(f"<{len(e.tokens)}I", *e.tokens)]
        body = b"".join(parts)
        digest = hashlib.sha256(body).digest()
        _install(self.directory / "index.tmp", self.directory / "index.bin", body + digest, replace=True)

    def load_index(self, fingerprint: bytes) -> list[IndexEntry] | None:
        """The saved entries whose slot this cache still has, or None: no index (silently), or one
        warning saying why it is not used. Never raises on the file's content."""
        path = self.directory / "index.bin"
        try:
            data = path.read_bytes()
            body = data[:-DIGEST_BYTES]
            if data[:len(MAGIC)] != MAGIC or hashlib.sha256(body).digest() != data[-DIGEST_BYTES:]:
                raise ValueError("truncated or corrupt: not a whole index")
            n = _HEAD.unpack_from(body, 0)[1]
            slot_bytes, count = _SIZES.unpack_from(body, _HEAD.size + n)
            if body[_HEAD.size:_HEAD.size + n] != fingerprint or slot_bytes != self.slot_bytes:
                log.warning("disk KV cache in %s was written for another model/dtype/layout/key; "
                            "starting it empty", self.directory)
                return None
            entries, off = [], _HEAD.size + n + _SIZES.size
            for _ in range(count):
                slot, has_parent, chain, parent, cs, n = _ENTRY.unpack_from(body, off)
                entries.append(IndexEntry(slot, chain, parent if has_parent else None,
                                          struct.unpack_from(f"<{n}I", body, off + _ENTRY.size), cs))
                off += _ENTRY.size + 4 * n
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - a bad index is a cold start, never a failed one
            log.warning("disk KV cache index %s is unusable (%s); starting it empty", path, e)
            return None
        return [e for e in entries if e.slot < self.num_slots]
