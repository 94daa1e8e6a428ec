"""The engine-core process: loads the model and runs EngineLoop (schedule -> forward -> sample),
taking commands from the API process and sending outputs back over zmq (messages: wire.py).

Started by EngineClient as `python -m nanoserve.engine.core_process SPEC_JSON` (a fresh
interpreter: forking a process that holds torch threads or CUDA state is unsafe). It never
outlives the API process: the kernel kills it when its parent dies (PR_SET_PDEATHSIG), and an
idle loop also notices a changed parent pid. SIGINT/SIGTERM are ignored: a terminal's Ctrl-C or a
service manager signals the whole group, but the API process must be able to drain first; it
sends "stop" when it is done."""
from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from typing import Any

import zmq

from nanoserve.engine import wire
from nanoserve.engine.async_engine import EngineDead, EngineLoop, EngineSnapshot, MetricsObserver, _Track
from nanoserve.engine.placement import CpuPlacement, apply_engine_placement
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import InvalidRequest

log = logging.getLogger("nanoserve.engine_core")

IDLE_POLL_MS = 1000  # how often an idle engine checks that its parent is still there


class RecordingObserver(MetricsObserver):
    """Collects metric observations; they travel to the API process, whose Prometheus registry
    observes them (so /metrics is served without asking the engine for histograms)."""

    def __init__(self) -> None:
        self.records: list[list] = []

    def on_first_token(self, ttft: float) -> None:
        self.records.append(["ttft", ttft])

    def on_inter_token(self, itl: float) -> None:
        self.records.append(["itl", itl])

    def on_finished(self, e2e: float, out: RequestOutput | None) -> None:
        self.records.append(["e2e", out.request_id, e2e])

    def on_step(self, kind: str, seconds: float) -> None:
        self.records.append(["step", kind, seconds])


@dataclasses.dataclass
class _Sent:
    """Engine-side delta state of one request (the `sink` of its _Track)."""
    request_id: str
    choices: dict = dataclasses.field(default_factory=dict)
    first: bool = True


class EngineCore(EngineLoop):
    def __init__(self, engine, inp: zmq.Socket, out: zmq.Socket, parent_pid: int) -> None:
        self.recorder = RecordingObserver()
        super().__init__(engine, self.recorder)
        self.inp, self.out, self.parent_pid = inp, out, parent_pid
        self._outputs: list = []
        self._errors: list = []
        self._snapshots: list = []
        self._adds_seen = 0
        self._sent_counts: tuple[int, int, int] | None = None

    def _next(self, block: bool) -> tuple | None:
        while True:
            if not self.inp.poll(IDLE_POLL_MS if block else 0):
                if not block:
                    return None
                if os.getppid() != self.parent_pid:
                    log.error("the API process is gone; stopping")
                    return ("stop",)
                continue
            msg = wire.unpack(self.inp.recv())
            kind = msg[0]
            if kind != "add":
                return tuple(msg)
            _, rid, ids, params, arrival = msg
            track = _Track(_Sent(rid), arrival)
            try:
                req = self.engine.make_request(rid, ids, wire.params_from_wire(params))
            except Exception as e:  # validated by the API already; a mismatch is reported, not dropped
                self._add_seen()
                self._emit(track, e)
                self._flush()  # now: an idle loop may block on the next command for a long time
                continue
            return ("add", req, track)

    def _emit(self, track: _Track, item: RequestOutput | BaseException) -> None:
        sent: _Sent = track.sink
        if isinstance(item, BaseException):
            kind = "dead" if isinstance(item, EngineDead) else "invalid" if isinstance(item, InvalidRequest) else "engine"
            self._errors.append([sent.request_id, kind, str(item), getattr(item, "param", None),
                                 getattr(item, "code", None)])
            return
        self._outputs.append(wire.output_delta(item, sent.choices, sent.first))
        sent.first = False

    def _reply_snapshot(self, reply_to: Any, snap: EngineSnapshot) -> None:
        self._snapshots.append([reply_to, wire.snapshot_to_wire(snap)])

    def _add_seen(self) -> None:
        self._adds_seen += 1

    def _flush(self) -> None:
        counts = (self._adds_seen, self._num_running, self._num_waiting)
        if not (self._outputs or self._errors or self._snapshots or self.recorder.records) \
                and counts == self._sent_counts:
            return
        self.out.send(wire.pack(["batch", self._outputs, self._errors, self.recorder.records, self._snapshots,
                                 *counts]))
        self._outputs, self._errors, self._snapshots, self.recorder.records = [], [], [], []
        self._sent_counts = counts

    def _close_inbox(self, err: BaseException) -> None:
        while (item := self._next(False)) is not None:  # answer what is still queued
            if item[0] == "add":
                self._emit(item[2], err)
            elif item[0] == "snapshot":
                self._reply_snapshot(item[1], self._snapshot)


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the idle parent-pid check still stops it
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    parent = spec["parent_pid"]
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec["log_level"].upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s [engine-core]: %(message)s")
    placement = CpuPlacement(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["placement"].items()})
    apply_engine_placement(placement)

    from nanoserve.config import EngineConfig
    from nanoserve.engine.frontend import model_info
    from nanoserve.engine.llm_engine import LLMEngine

    ctx = zmq.Context()
    inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for s in (inp, out):
        s.setsockopt(zmq.LINGER, 5000)  # the last batch (shutdown errors) must reach the API process
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
    inp.connect(spec["input"])
    out.connect(spec["output"])
    try:
        t0 = time.monotonic()
        engine = LLMEngine(EngineConfig(**spec["config"]), detokenize=False)  # text is the API's job
    except Exception as e:
        log.error("cannot start the engine: %s", e, exc_info=not isinstance(e, (ValueError, OSError)))
        out.send(wire.pack(["failed", f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)]))
        out.close()
        ctx.term()
        return 2
    log.info("engine core ready in %.1fs (pid %d; %s)", time.monotonic() - t0, os.getpid(), placement.describe())
    out.send(wire.pack(["ready", dataclasses.asdict(model_info(engine))]))
    try:
        EngineCore(engine, inp, out, parent).run()
    finally:
        inp.close()
        out.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
