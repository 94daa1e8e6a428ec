"""The tensor-parallel step messages on the wire (parallel/messages.py): typed msgpack, never
pickle. Every message round-trips; random bytes, a truncated message, another wire version and a
crafted pickle are refused with a clear error, by the codec and by a real worker process (over the
shared-memory channel of one node and over the gloo broadcasts between nodes), which exits 2 having
run nothing: the pickle's file is never created. The shared-memory segments are 0600 and never
reuse a file that already exists; rank 0 listens only on the address it is given."""
from __future__ import annotations

import json
import os
import pickle
import random
import socket
import stat
import subprocess
import sys
from dataclasses import asdict

import msgspec
import pytest
import torch

from nanoserve.distributed.parallel import Rendezvous, join, leave
from nanoserve.distributed.shm import ShmChannel, map_segment
from nanoserve.parallel.messages import (WIRE_VERSION, CopyCommand, MessageError, Setup, Step, Stop, decode,
                                         encode)
from nanoserve.kvcache.transfer import copy_block_async, copy_block_memmove
from nanoserve.parallel.leader import WorkerSpec
from nanoserve.parallel.worker import copies_for, run_copies
from nanoserve.runner.step_plan import StepPlan, plan_warmup_prefill
from server_fixture import free_port
from tests.test_cpu_kernels import kernels  # noqa: F401 - the module fixture (skips without a toolchain)

PLAN = StepPlan([5, 6, 7], [9, 3, 4], [2, 0, 0], [1, 3, 4], [0, 2], [1, 2], [10, 5], [[1, 2], [0]], 1, None)
STEP = Step(PLAN, [CopyCommand("save", [3, 4], [0, 1]), CopyCommand("load", [7], [2])])


class MakesAFile:
    """Unpickling this creates `path`: the payload an attacker would plant."""
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def bad_frames(tmp_path) -> dict[str, bytes]:
    return {"random": random.Random(0).randbytes(200), "truncated": encode(STEP)[:-7],
            "wrong version": msgspec.msgpack.encode((WIRE_VERSION + 1, "Step", STEP)),
            "pickle": pickle.dumps(MakesAFile(str(tmp_path / "pwned")))}


ERRORS = {"random": "malformed", "truncated": "malformed",
          "wrong version": f"wire version {WIRE_VERSION + 1}", "pickle": "malformed"}


def test_every_message_round_trips_typed():
    setup = Setup({"model": None, "max_num_seqs": 8, "kv_cache_gb": 0.5, "enforce_eager": True,
                   "dtype": "auto"},
                  "tiny", "/models/tiny", "bfloat16")
    for msg in (setup, STEP, Step(None, []), Step(plan_warmup_prefill([3, 20], 16), []), Stop()):
        assert decode(encode(msg)) == msg
    assert decode(encode(STEP)).copies[0] == CopyCommand("save", [3, 4], [0, 1])


def test_bad_bytes_are_refused_and_run_nothing(tmp_path):
    for name, frame in bad_frames(tmp_path).items():
        with pytest.raises(MessageError, match=ERRORS[name]):
            decode(frame)
    assert not (tmp_path / "pwned").exists()
    wrong_types = {"ids as text": msgspec.msgpack.encode((WIRE_VERSION, "Step", {
                       "plan": {**asdict(PLAN), "ids": "x"}, "copies": []})),
                   "unknown lane": msgspec.msgpack.encode((WIRE_VERSION, "Step", {"plan": None, "copies": [
                       {"lane": "exec", "src_ids": [1], "dst_ids": [2]}]})),
                   "a torch name not a dtype": msgspec.msgpack.encode((WIRE_VERSION, "Setup", {
                       "config": {}, "model_name": "m", "model_path": "/m", "dtype": "load"}))}
    for frame in wrong_types.values():  # msgspec says which field, and why
        with pytest.raises(MessageError,
                           match=r"malformed tensor-parallel (Step|Setup) message: .* at `\$\."):
            decode(frame)
    with pytest.raises(MessageError, match="unknown tensor-parallel message type 'Exec'"):
        decode(msgspec.msgpack.encode((WIRE_VERSION, "Exec", {})))
    with pytest.raises(MessageError, match="unexpected tensor-parallel message Stop"):
        decode(encode(Stop()), Setup)


def test_segments_are_private_and_never_reused(tmp_path):
    path = tmp_path / "seg"
    old = os.umask(0)
    try:
        map_segment(path, 4096, create=True)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(FileExistsError):  # pre-created by someone: never mapped
        map_segment(path, 4096, create=True)


def test_a_corrupt_frame_length_fails_the_reader(tmp_path):
    path = tmp_path / "msgs"
    sender = ShmChannel(path, 0, 2, 256, 30.0, True, None)
    reader = ShmChannel(path, 1, 2, 256, 30.0, False, None)
    sender.send(b"x" * 10)
    sender.frames[1, :8].view("int64")[0] = 1 << 40  # past the frame
    with pytest.raises(ValueError, match="corrupt tensor-parallel message frame: length 1099511627776"):
        reader.recv()


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_worker_refuses_bad_frames_and_runs_nothing(transport, tmp_path):
    """A real worker process per frame, joined to this process as rank 0: it exits 2 with the reason,
    and the pickle, which would create a file when loaded, creates none. Both transports hand the
    worker the same bytes to decode, so shared memory gets the pickle only (a worker start is ~3 CPU-s)."""
    frames = bad_frames(tmp_path)
    if transport == "shm":
        frames = {name: frame for name, frame in frames.items() if "pickle" in name}
        assert frames

    def one(name: str) -> tuple[int, str]:
        port = free_port()
        rv = Rendezvous("127.0.0.1", port, 2, timeout_s=60, shm_slot_bytes=4096 if transport == "shm" else 0)
        spec = WorkerSpec(1, rv, None, 1, None, None, "info")
        worker = subprocess.Popen([sys.executable, "-m", "nanoserve.parallel.worker",
                                   json.dumps(asdict(spec))], stderr=subprocess.PIPE, text=True)
        try:
            tp, channel = join(rv, 0, torch.device("cpu"))
            assert (tp.shm is not None) == (transport == "shm")
            channel.send(frames[name])
            code = worker.wait(60)
        finally:
            if worker.poll() is None:
                worker.kill()
            leave()
        return code, worker.stderr.read()

    results = {name: one(name) for name in frames}
    for name, (code, err) in results.items():
        assert code == 2, (name, err)
        assert "tensor-parallel rank 1 stops: " in err and ERRORS[name] in err, (name, err)
    assert not (tmp_path / "pwned").exists()


def test_rank_zero_listens_only_on_the_address_given():
    """torch's own store would listen on every interface; 127.0.0.2 is this machine too, another address."""
    port = free_port()
    join(Rendezvous("127.0.0.1", port, 1, timeout_s=30), 0, torch.device("cpu"))
    try:
        for host, reached in (("127.0.0.1", True), ("127.0.0.2", False)):
            with socket.socket() as s:
                assert (s.connect_ex((host, port)) == 0) is reached, host
    finally:
        leave()


@pytest.mark.parametrize("how", ["cpu", "cuda", "per run"])
def test_a_follower_runs_rank_zeros_copies_as_its_copier_would(how, request):
    """A follower's copies (worker.run_copies) as `copies_for` gives them: memmoves on CPU; on CUDA (run
    here on CPU tensors) the C++ batch where built, else a `copy_` per run (also run on its own); a copy
    past the pool fails alone (its flag 1), the ones after it still run, nothing else is written."""
    if how == "cuda":
        request.getfixturevalue("kernels")  # (built, so that `copies_for` finds them)
    copy, batch = (copy_block_async, None) if how == "per run" else copies_for(torch.device(how))
    if how == "cpu":
        assert (copy, batch) == (copy_block_memmove, None)
    else:
        assert copy is copy_block_async and (batch is None) is (how == "per run")
    device, host = torch.zeros(8, 2, 3), torch.arange(48.0).reshape(8, 2, 3)
    cmds = [CopyCommand("load", [0, 1, 2, 6], [4, 5, 6, 0]), CopyCommand("load", [7], [8]),
            CopyCommand("save", [4, 0], [1, 3])]
    assert run_copies(cmds, device, host, copy, batch) == [0, 1, 0]
    expected_host = torch.arange(48.0).reshape(8, 2, 3)
    assert torch.equal(device[[4, 5, 6, 0]], expected_host[[0, 1, 2, 6]])
    assert not device[[1, 2, 3, 7]].any()
    expected_host[[1, 3]] = device[[4, 0]]
    assert torch.equal(host, expected_host)
