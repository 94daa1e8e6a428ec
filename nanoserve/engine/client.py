"""EngineClient: the API process's handle on the engine-core process, with AsyncEngine's interface
(generate / abort / fail_all / snapshot / alive / num_waiting / num_running / start / stop), so the
HTTP layer does not care where the engine runs.

One thread receives the engine's batches, turns their token ids into text and matches stop strings
(output_processor.py: the engine process never detokenizes), and fans the outputs out to
per-request asyncio queues (the event loop never blocks on zmq); sends are serialized by a lock because the DrainingServer's timer
and shutdown call in from other threads. The same thread watches the engine process: if it exits
without being asked to, every request in flight fails with EngineError (HTTP 500 / an SSE error
event), `alive` turns False (/health 503, new requests 503) and `on_dead` is called (the CLI then
shuts the server down with a non-zero exit code for a supervisor to restart it)."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from nanoserve.config import EngineConfig
from nanoserve.engine import wire
from nanoserve.engine.async_engine import EngineDead, EngineError, EngineSnapshot, MetricsObserver, stream_outputs
from nanoserve.engine.frontend import Frontend, ModelInfo, PromptRequest
from nanoserve.engine.output_processor import OutputProcessor
from nanoserve.engine.placement import CpuPlacement
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import InvalidRequest

log = logging.getLogger("nanoserve.client")

POLL_MS = 100  # how quickly a dead engine process is noticed


class EngineStartError(RuntimeError):
    """The engine process could not load the model (the message says why)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    q: asyncio.Queue
    processor: OutputProcessor


class EngineClient:
    def __init__(self, config: EngineConfig, observer: MetricsObserver | None = None,
                 placement: CpuPlacement | None = None, log_level: str = "info",
                 on_dead: Callable[[str], None] | None = None) -> None:
        if config.flash_module is not None:
            raise ValueError("flash_module (a Python object) cannot be sent to the engine process; "
                             "run the engine in-process")
        self.config = config
        self.observer = observer or MetricsObserver()
        self.placement = placement or CpuPlacement()
        self.log_level = log_level
        self.on_dead = on_dead
        self.frontend: Frontend | None = None
        self.proc: subprocess.Popen | None = None
        self.exit_reason: str | None = None         # set when the engine process died unasked
        self._lock = threading.Lock()               # guards the input socket and the fields below
        self._streams: dict[str, _Stream] = {}
        self._snap_waiters: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._tokens = itertools.count()
        self._adds_sent = self._adds_seen = 0
        self._num_running = self._num_waiting = 0
        self._snapshot = EngineSnapshot()
        self._stopping = False
        self._dead = False
        self._closed = False                        # sockets closed, process reaped
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine process and wait until its model is loaded (the handshake brings the
        model metadata; the tokenizer is then read here). Raises EngineStartError. Call it from a
        thread that lives as long as the engine should: the engine is killed when it exits
        (PR_SET_PDEATHSIG follows the thread that started it)."""
        if self.proc is not None:
            return
        self._dir = tempfile.mkdtemp(prefix="nanoserve-ipc-")
        self._ctx = zmq.Context()
        self._in, self._out = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        for s in (self._in, self._out):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
        self._in.bind(f"ipc://{self._dir}/input")
        self._out.bind(f"ipc://{self._dir}/output")
        spec = {"config": dataclasses.asdict(self.config), "input": f"ipc://{self._dir}/input",
                "output": f"ipc://{self._dir}/output", "parent_pid": os.getpid(), "log_level": self.log_level,
                "placement": dataclasses.asdict(self.placement)}
        self.proc = subprocess.Popen([sys.executable, "-m", "nanoserve.engine.core_process", json.dumps(spec)])
        log.info("engine process started (pid %d)", self.proc.pid)
        try:
            info = self._handshake()
            from nanoserve.models.loader import ModelSource, load_tokenizer
            tok = load_tokenizer(ModelSource(info.model_name, Path(info.source_path)), self.config.tokenizer)
        except BaseException:
            self._kill()
            raise
        self.frontend = Frontend(self.config, tok, info)
        self._thread = threading.Thread(target=self._receive, name="nanoserve-engine-client", daemon=True)
        self._thread.start()

    def _handshake(self) -> ModelInfo:
        while True:
            if self._out.poll(POLL_MS):
                msg = wire.unpack(self._out.recv())
                if msg[0] == "ready":
                    d = msg[1]
                    return ModelInfo(**dict(d, eos_token_ids=tuple(d["eos_token_ids"])))
                raise EngineStartError(msg[1])
            if self.proc.poll() is not None:
                raise EngineStartError(f"the engine process exited with code {self.proc.returncode} "
                                       "while loading the model")

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything still in flight and stop the engine process (idempotent)."""
        if self.proc is None or self._closed:
            return
        with self._lock:
            self._stopping = True
            if not self._dead:
                self._send(["stop"])
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not stop in %.0fs; killing it", timeout)
        self._kill()

    def _kill(self) -> None:
        self._closed = True
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)
        with self._lock:  # no send can race the close
            self._in.close()
        self._out.close()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.frontend is not None and not self._dead and not self._stopping

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    # ---- asyncio side ----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests not yet running: sent but not yet seen by the engine, plus waiting in its scheduler."""
        return max(0, self._adds_sent - self._adds_seen) + self._num_waiting

    @property
    def num_running(self) -> int:
        return self._num_running

    async def generate(self, req: PromptRequest) -> AsyncIterator[RequestOutput]:
        """Add `req` and yield its outputs until the finished one. Leaving early (break, cancel,
        client gone) aborts the request. Raises EngineError if the engine failed it."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        processor = OutputProcessor(self.frontend.tokenizer, req.prompt, req.prompt_token_ids, req.params)
        with self._lock:  # either the receiver will see this request end, or we refuse it here
            if not self.alive:
                raise EngineDead("the engine is not running")
            self._streams[req.request_id] = _Stream(loop, q, processor)
            self._adds_sent += 1
            self._send(["add", req.request_id, req.prompt_token_ids, wire.params_to_wire(req.params),
                        req.arrival_time])
        async for out in stream_outputs(q, lambda: self.abort(req.request_id)):
            yield out

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._streams.pop(request_id, None) is not None and not self._dead:
                self._send(["abort", request_id])

    def fail_all(self, reason: str) -> None:
        """Abort every request in flight or queued; each gets EngineDead(reason) (shutdown timeout)."""
        with self._lock:
            if not self._dead:
                self._send(["fail_all", reason])

    async def snapshot(self, timeout: float = 5.0) -> EngineSnapshot:
        """A fresh snapshot from the engine process (within one step); the last one if it is busy."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._lock:
            if not self.alive:
                return self._snapshot
            token = next(self._tokens)
            self._snap_waiters[token] = (loop, fut)
            self._send(["snapshot", token])
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return self._snapshot
        finally:
            with self._lock:
                self._snap_waiters.pop(token, None)

    def _send(self, msg: list) -> None:
        """Callers hold self._lock (zmq sockets are not thread-safe). Never blocks: a PUSH socket
        with no peer (the engine process just died) would block forever; what is not delivered
        then is failed by the receiver thread when it sees the process gone."""
        if self._closed:
            return
        try:
            self._in.send(wire.pack(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("the engine process is not reachable; %r not delivered", msg[0])

    # ---- receiver thread -------------------------------------------------------------------
    def _receive(self) -> None:
        while True:
            if self._out.poll(POLL_MS):
                self._receive_pending()
            code = self.proc.poll()
            if code is not None:
                self._receive_pending()  # what it sent before exiting still counts
                self._engine_exited(code)
                return

    def _receive_pending(self) -> None:
        while True:
            try:
                data = self._out.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(wire.unpack(data))
            except Exception:
                log.exception("bad message from the engine process")

    def _handle(self, msg: list) -> None:
        if msg[0] != "batch":
            return
        _, outputs, errors, records, snapshots, adds_seen, running, waiting = msg
        with self._lock:
            self._adds_seen, self._num_running, self._num_waiting = adds_seen, running, waiting
            work = [(self._streams.get(d[0]), d) for d in outputs]
        # Detokenizing runs outside the lock, so generate() and abort() on the event loop never wait
        # for it; only this thread touches a stream's processor.
        done: list[str] = []
        stops: list[list] = []
        for st, d in work:
            if st is None:  # aborted here already, or finished by a stop string
                continue
            out, stopped = st.processor.apply(d)
            if not d[1]:  # the engine still runs the stopped choices: free their KV now
                stops += [["finish", d[0], [i], out.outputs[i].stop_reason] for i in stopped]
            if out.finished:
                done.append(d[0])
            st.loop.call_soon_threadsafe(st.q.put_nowait, out)
        with self._lock:
            for rid in done:
                self._streams.pop(rid, None)
            if not self._dead:
                for m in stops:
                    self._send(m)
            for rid, kind, message, param, code in errors:
                st = self._streams.pop(rid, None)
                if st is not None:
                    err = (EngineDead(message) if kind == "dead" else InvalidRequest(message, param, code)
                           if kind == "invalid" else EngineError(message))
                    st.loop.call_soon_threadsafe(st.q.put_nowait, err)
            for token, snap in snapshots:
                self._snapshot = wire.snapshot_from_wire(snap)
                waiter = self._snap_waiters.pop(token, None)
                if waiter is not None:
                    waiter[0].call_soon_threadsafe(_set_result, waiter[1], self._snapshot)
        self._replay(records)

    def _replay(self, records: list) -> None:
        obs = self.observer
        try:
            for r in records:
                if r[0] == "ttft":
                    obs.on_first_token(r[1])
                elif r[0] == "itl":
                    obs.on_inter_token(r[1])
                elif r[0] == "step":
                    obs.on_step(r[1], r[2])
                elif r[0] == "e2e":  # the engine's own end of the request, whoever finished it
                    obs.on_finished(r[2], None)
        except Exception:
            log.exception("metrics observer failed")

    def _engine_exited(self, code: int) -> None:
        with self._lock:
            self._dead = True
            if self._stopping:
                err: Exception = EngineDead("the server is shutting down")
            else:
                self.exit_reason = f"the engine process died unexpectedly (exit code {code})"
                err = EngineError(f"{self.exit_reason}; this request was lost")
            streams, self._streams = self._streams, {}
            waiters, self._snap_waiters = self._snap_waiters, {}
        for st in streams.values():
            st.loop.call_soon_threadsafe(st.q.put_nowait, err)
        for loop, fut in waiters.values():
            loop.call_soon_threadsafe(_set_result, fut, self._snapshot)
        if self.exit_reason is not None:
            log.error("%s; failed %d request(s) in flight", self.exit_reason, len(streams))
            if self.on_dead is not None:
                self.on_dead(self.exit_reason)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)
