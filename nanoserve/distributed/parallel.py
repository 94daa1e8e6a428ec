"""Tensor parallelism: the process group one engine's ranks share, and how a Llama model's
heads, MLP columns and vocabulary split across them (Megatron style).

Every rank runs the same forward on its slice; the collectives here are the only points where
ranks meet inside a step: one all-reduce after each row-parallel projection (o_proj, down_proj),
one after the vocab-parallel embedding, and a gather of the vocab-parallel logits to rank 0,
which samples. gloo on CPU (so CI runs it), NCCL on CUDA."""
from __future__ import annotations

import datetime
import logging
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from nanoserve.distributed.channel import MessageChannel
from nanoserve.distributed.shm import ShmChannel, ShmCollectives, shm_supported

log = logging.getLogger("nanoserve")
MESSAGE_FRAME_BYTES = 4 << 20  # a step plan larger than this (rare: huge block tables) goes through gloo


class ParallelFault(BaseException):
    """A rank failed or vanished mid-step: the other ranks cannot know where it stopped, so no
    request can continue. A BaseException, as a device fault: the engine loop stops on it
    (its requests get an error, the process exits non-zero) instead of failing one step."""


@dataclass(frozen=True)
class HeadShard:
    """What one rank holds of an attention layer: q heads [q_start, q_start + num_heads) and kv
    heads [kv_start, kv_start + num_kv_heads) (one replicated kv head when ranks outnumber them)."""
    num_heads: int
    q_start: int
    num_kv_heads: int
    kv_start: int


def shard_heads(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadShard:
    """Refuses (ValueError, saying why and what would work) a split that would leave a rank's q
    heads attending to kv heads it does not hold."""
    if num_heads % size:
        ok = [n for n in range(1, num_heads + 1) if num_heads % n == 0]
        raise ValueError(f"--tensor-parallel-size {size} does not divide the model's {num_heads} attention "
                         f"heads; sizes that do: {ok}")
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise ValueError(f"--tensor-parallel-size {size} does not divide the model's {num_kv_heads} KV "
                             f"heads (and is not a multiple of them, which would replicate them)")
        per = num_kv_heads // size
        return HeadShard(num_heads // size, rank * num_heads // size, per, rank * per)
    if size % num_kv_heads:
        raise ValueError(f"--tensor-parallel-size {size} exceeds the model's {num_kv_heads} KV heads without "
                         f"being a multiple of them, so they cannot be replicated evenly")
    return HeadShard(num_heads // size, rank * num_heads // size, 1, rank // (size // num_kv_heads))


def split(n: int, size: int, rank: int, what: str) -> tuple[int, int]:
    """[start, end) of an evenly divided dimension."""
    if n % size:
        raise ValueError(f"--tensor-parallel-size {size} does not divide the model's {what} ({n})")
    return rank * n // size, (rank + 1) * n // size


def vocab_rows(vocab: int, size: int, rank: int) -> tuple[int, int, int]:
    """(start, end, padded rows per rank) of a vocab-parallel table: ceil(vocab / size) rows per
    rank, the last rank's tail padded with zero rows (their logits are cut after the gather)."""
    per = -(-vocab // size)
    start = min(rank * per, vocab)
    return start, min(start + per, vocab), per


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object | None = None      # the compute group (gloo / NCCL); None on one rank
    cpu_group: object | None = None  # gloo, same timeout: small host-side exchanges (copy acks)
    shm: ShmCollectives | None = None  # one CPU node: all-reduce and gather through shared memory

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.shm is not None and self.shm.fits(t):
            return self.shm.all_reduce(t)
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def gather_logits(self, local: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """[rows, vocab / size] on each rank -> [rows, vocab] on rank 0 (None elsewhere)."""
        if self.size == 1:
            return local
        if self.shm is not None and self.shm.fits(local):
            parts = self.shm.gather(local)
        else:
            parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
            dist.gather(local.contiguous(), parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab] if parts is not None else None

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (KV blocks: each rank's memory may differ)."""
        return int(self.reduce_flags([value], dist.ReduceOp.MIN)[0])

    def reduce_flags(self, values: list[int], op=dist.ReduceOp.MAX) -> list[int]:
        """Element-wise `op` of small host-side integer lists over ranks."""
        if self.size == 1 or not values:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=op, group=self.cpu_group)
        return t.tolist()


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one engine meet: torch.distributed's TCP store on rank 0's node."""
    master_addr: str
    master_port: int
    world_size: int
    timeout_s: float = 120.0
    shm_slot_bytes: int = 0  # > 0: every rank is on one CPU node; collectives through /dev/shm


def join(rv: Rendezvous, rank: int,
         device: torch.device) -> tuple[TensorParallel, MessageChannel | ShmChannel]:
    """Init torch.distributed for this rank. Returns the collectives and the channel of the step
    messages: shared memory on one CPU node, else broadcasts on a gloo group that never times out
    (an idle server sends nothing for hours; a dead peer is still noticed, as a closed connection)."""
    cuda = device.type == "cuda"
    timeout = datetime.timedelta(seconds=rv.timeout_s)
    dist.init_process_group("nccl" if cuda else "gloo", store=_store(rv, rank, timeout), rank=rank,
                            world_size=rv.world_size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if cuda else dist.group.WORLD
    channel = MessageChannel(dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365)))
    tp = TensorParallel(rank, rv.world_size, dist.group.WORLD, cpu_group)
    if rv.shm_slot_bytes and not cuda and shm_supported() and (opened := _open_shm(tp, rv, channel)):
        tp.shm, channel = opened
    return tp, channel


def _store(rv: Rendezvous, rank: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous store. torch's own listens on every interface whatever address it is given;
    rank 0's listens on --master-addr only (a socket bound there, handed to it: the store closes it)."""
    if rank != 0:
        return dist.TCPStore(rv.master_addr, rv.master_port, rv.world_size, is_master=False, timeout=timeout)
    family, kind, proto, _, addr = socket.getaddrinfo(rv.master_addr, rv.master_port,
                                                      type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            raise OSError(e.errno,
                          f"rank 0 cannot listen on --master-addr {rv.master_addr} port {rv.master_port} "
                          f"({e.strerror}): give an address of node 0 itself") from None
        sock.listen(128)
        store = dist.TCPStore(rv.master_addr, rv.master_port, rv.world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()
    return store


def _open_shm(tp: TensorParallel, rv: Rendezvous,
              gloo: MessageChannel) -> tuple[ShmCollectives, ShmChannel] | None:
    """Rank 0 creates the segments (mode 0600, O_EXCL) under a random name that it then sends the
    others over gloo: no local user can predict it, pre-create it or read it from a command line.
    Once mapped everywhere they are unlinked (the mappings stay): no file outlives the ranks,
    however they end. A name already taken stops start-up on every rank (someone made it: never
    map it); any other failure on any rank: gloo for everyone."""
    token = torch.zeros(16, dtype=torch.uint8)
    if tp.rank == 0:
        token = torch.frombuffer(bytearray(secrets.token_bytes(16)), dtype=torch.uint8)
    dist.broadcast(token, src=0, group=tp.cpu_group)
    name = bytes(token.tolist()).hex()
    paths = [Path("/dev/shm") / f"nanoserve-tp-{name}-{what}" for what in ("collectives", "messages")]
    opened, state, why, made = None, 0, "", []  # state: 0 ok, 1 unavailable (gloo), 2 name taken (stop)
    for creating in (True, False):  # every rank takes part in both votes
        if creating == (tp.rank == 0) and not state:
            try:
                coll = ShmCollectives(paths[0], tp.rank, tp.size, rv.shm_slot_bytes, rv.timeout_s, creating)
                made += paths[:1] if creating else []
                msgs = ShmChannel(paths[1], tp.rank, tp.size, MESSAGE_FRAME_BYTES, rv.timeout_s, creating,
                                  gloo)
                made += paths[1:] if creating else []
                opened = (coll, msgs)
            except FileExistsError as e:
                state, why = 2, str(e)
            except (OSError, RuntimeError) as e:
                state, why = 1, str(e)
        state = tp.reduce_flags([state])[0]
    for p in made:
        p.unlink(missing_ok=True)
    if state == 2:
        raise RuntimeError(f"tensor-parallel shared-memory segment already exists before rank 0 created it "
                           f"({why or 'seen by rank 0'}): another local user may be interfering; "
                           "not starting")
    if state:
        if tp.rank == 0:
            log.warning("shared-memory collectives unavailable (%s); using gloo",
                        why or "a rank could not map them")
        return None
    return opened


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
