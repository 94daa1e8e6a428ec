"""EngineClient: the API side's one handle on the engine core (core.py), in its own process (`ipc://`,
the default) or in a thread of this process (`inproc://`; starting, sockets and stopping: core_handle.py):
same messages, same output processing.

A receiver thread takes the core's batches, turns token ids into text and stop strings
(output_processor.py), observes latency metrics, and fans outputs out to per-request asyncio queues
(the event loop never blocks on zmq). Sends are serialized by a lock (the drain timer and shutdown
call in from other threads). If the core exits unasked, every request in flight fails with
EngineError, `alive` turns False (/health 503) and `on_dead` is called (the CLI exits non-zero)."""
from __future__ import annotations

import asyncio
import itertools
import logging
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanoserve.config import EngineConfig
from nanoserve.client.core_handle import CoreHandle
from nanoserve.client.output_processor import OutputProcessor
from nanoserve.parallel.placement import CpuPlacement, PlacementRequest
from nanoserve.engine.protocol import (Abort, Add, Batch, EngineDead, EngineError, EngineSnapshot, FailAll,
                                       Finish, MetricsObserver, ModelInfo, PromptRequest, SnapshotAsk, Stop,
                                       decode_from_engine, make_prompt_request)
from nanoserve.heap import trim_heap
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import SamplingParams

log = logging.getLogger("nanoserve.client")


class Frontend:
    """What the HTTP layer needs of the model: tokenizer, config and metadata, never the weights."""

    def __init__(self, config: EngineConfig, tokenizer: Any, info: ModelInfo) -> None:
        self.config, self.tokenizer, self.info = config, tokenizer, info
        self.model_name = info.model_name
        self.vocab_size = info.vocab_size
        self.max_model_len = info.max_model_len
        self.max_token_chars = info.max_token_chars

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     add_special_tokens: bool = True) -> PromptRequest:
        return make_prompt_request(self.info, self.tokenize, request_id, prompt, params, add_special_tokens)


@dataclass
class _Stream:
    """One request's way back to its caller: the asyncio queue it reads, and its latency so far."""
    loop: asyncio.AbstractEventLoop
    q: asyncio.Queue
    processor: OutputProcessor
    arrival: float
    last_token: float | None = None
    num_tokens: int = 0

    def put(self, item: RequestOutput | BaseException) -> None:  # from the receiver thread
        self.loop.call_soon_threadsafe(self.q.put_nowait, item)

    def observe(self, obs: MetricsObserver, out: RequestOutput, now: float) -> None:
        """Latency metrics as the client sees them: from arrival at the API to outputs leaving it."""
        try:
            ntok = sum(len(c.token_ids) for c in out.outputs)
            if ntok > self.num_tokens:
                if self.last_token is None:
                    obs.on_first_token(now - self.arrival)
                else:
                    obs.on_inter_token(now - self.last_token)
                self.last_token, self.num_tokens = now, ntok
            if out.finished:
                obs.on_finished(now - self.arrival)
        except Exception:
            log.exception("metrics observer failed")


class EngineClient:
    def __init__(self, config: EngineConfig, observer: MetricsObserver | None = None,
                 placement: PlacementRequest | None = None, log_level: str = "info",
                 on_dead: Callable[[str], None] | None = None, in_process: bool = False,
                 make_engine: str | None = None) -> None:
        """`in_process`: the core runs in a thread of this process, else in its own process.
        `make_engine`: "module:function" building the LLMEngine from the config (fault tests wrap it)."""
        self.config = config
        self.observer = observer or MetricsObserver()
        self.on_dead = on_dead
        self.frontend: Frontend | None = None
        self.exit_reason: str | None = None         # set when the engine core died unasked
        self._lock = threading.Lock()               # guards the input socket and the fields below
        self.core = CoreHandle(config, placement, log_level, in_process, make_engine, self._lock)
        self._streams: dict[str, _Stream] = {}
        self._snap_waiters: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._tokens = itertools.count()
        self._adds_sent = self._adds_seen = 0
        self._num_running = self._num_waiting = 0
        self._snapshot = EngineSnapshot()
        self._stopping = False
        self._dead = False
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine core and wait until its model is loaded (the handshake brings the model
        metadata; the tokenizer is then read here). Raises EngineStartError. With a process, call it
        from a thread that lives as long as the engine should: the process is killed when that
        thread exits (PR_SET_PDEATHSIG follows the thread that started it)."""
        if self.core.started:
            return
        info = self.core.start()
        try:
            from nanoserve.models.loader import ModelSource, load_tokenizer
            tok = load_tokenizer(ModelSource(info.model_name, Path(info.source_path)), self.config.tokenizer)
            trim_heap()  # what parsing its files left
        except BaseException:
            self._kill()
            raise
        self.frontend = Frontend(self.config, tok, info)
        self._thread = threading.Thread(target=self._receive, name="nanoserve-engine-client", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Abort everything still in flight and stop the engine core (idempotent). Default wait: 10 s,
        and 5 minutes with a disk tier, which writes what it does not hold yet and its index first."""
        if not self.core.started or self.core.closed:
            return
        if timeout is None:
            timeout = 300.0 if self.config.disk_cache_gb else 10.0
        with self._lock:
            self._stopping = True
            if not self._dead:
                self._send(Stop())
        self.core.wait(timeout)
        self._kill()

    def _kill(self) -> None:
        self.core.kill()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)
        self.core.close()

    @property
    def alive(self) -> bool:
        return self.core.started and self.frontend is not None and not self._dead and not self._stopping

    @property
    def placement(self) -> CpuPlacement:
        """Where the engine computes, as it planned that (known once started)."""
        return self.core.placement

    @property
    def pid(self) -> int:
        """The engine core's process (this process when it runs in a thread)."""
        return self.core.pid

    @property
    def proc(self) -> subprocess.Popen | None:
        """The engine core's process; None when it runs in a thread."""
        return self.core.proc

    @property
    def _core_thread(self) -> threading.Thread | None:
        # the in-process core (tests/test_server_faults.py reads it)
        return self.core.thread

    # ---- asyncio side ----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests not yet running: sent but not yet seen by the core, plus waiting in its scheduler."""
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
            self._streams[req.request_id] = _Stream(loop, q, processor, req.arrival_time)
            self._adds_sent += 1
            self._send(Add(req))
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(req.request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._streams.pop(request_id, None) is not None and not self._dead:
                self._send(Abort(request_id))

    def fail_all(self, reason: str) -> None:
        """Abort every request in flight or queued; each gets EngineDead(reason) (shutdown timeout)."""
        with self._lock:
            if not self._dead:
                self._send(FailAll(reason))

    async def snapshot(self, timeout: float = 5.0) -> EngineSnapshot:
        """A fresh snapshot from the engine core (within one step); the last one if it is busy."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._lock:
            if not self.alive:
                return self._snapshot
            token = next(self._tokens)
            self._snap_waiters[token] = (loop, fut)
            self._send(SnapshotAsk(token))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return self._snapshot
        finally:
            with self._lock:
                self._snap_waiters.pop(token, None)

    def _send(self, msg) -> None:
        """Callers hold self._lock (zmq sockets are not thread-safe); never blocks (CoreHandle.send)."""
        self.core.send(msg)

    # ---- receiver thread -------------------------------------------------------------------
    def _receive(self) -> None:
        while True:
            if self.core.poll():
                self._receive_pending()
            code = self.core.exit_code()
            if code is not None:
                self._receive_pending()  # what it sent before exiting still counts
                self._core_exited(code)
                return

    def _receive_pending(self) -> None:
        while (data := self.core.recv_nowait()) is not None:
            try:
                msg = decode_from_engine(data)
                if isinstance(msg, Batch):
                    self._handle(msg)
            except Exception:
                log.exception("bad message from the engine core")

    def _handle(self, batch: Batch) -> None:
        with self._lock:
            self._adds_seen, self._num_running, self._num_waiting = (batch.adds_seen, batch.num_running,
                                                                     batch.num_waiting)
            work = [(self._streams.get(d.request_id), d) for d in batch.outputs]
        # Detokenizing runs outside the lock, so generate() and abort() on the event loop never wait
        # for it; only this thread touches a stream's processor.
        now = time.monotonic()
        done: list[str] = []
        stops: list[Finish] = []
        for st, d in work:
            if st is None:  # aborted here already, or finished by a stop string
                continue
            out, stopped = st.processor.apply(d)
            if not d.finished:  # the engine still runs the stopped choices: free their KV now
                stops += [Finish(d.request_id, [i], out.outputs[i].stop_reason) for i in stopped]
            st.observe(self.observer, out, now)
            if out.finished:
                done.append(d.request_id)
            st.put(out)
        with self._lock:
            for rid in done:
                self._streams.pop(rid, None)
            if not self._dead:
                for m in stops:
                    self._send(m)
            for e in batch.errors:
                st = self._streams.pop(e.request_id, None)
                if st is not None:
                    st.put(e.exception())
            for reply in batch.snapshots:
                self._snapshot = reply.snapshot
                waiter = self._snap_waiters.pop(reply.token, None)
                if waiter is not None:
                    waiter[0].call_soon_threadsafe(_set_result, waiter[1], self._snapshot)
        try:
            for s in batch.steps:
                self.observer.on_step(s.kind, s.seconds)
        except Exception:
            log.exception("metrics observer failed")

    def _core_exited(self, code: int) -> None:
        with self._lock:
            self._dead = True
            if self._stopping:
                err: Exception = EngineDead("the server is shutting down")
            else:
                where = "engine process" if self.core.proc is not None else "engine core thread"
                self.exit_reason = f"the {where} died unexpectedly (exit code {code})"
                err = EngineError(f"{self.exit_reason}; this request was lost")
            streams, self._streams = self._streams, {}
            waiters, self._snap_waiters = self._snap_waiters, {}
        for st in streams.values():
            st.put(err)
        for loop, fut in waiters.values():
            loop.call_soon_threadsafe(_set_result, fut, self._snapshot)
        if self.exit_reason is not None:
            log.error("%s; failed %d request(s) in flight", self.exit_reason, len(streams))
            if self.on_dead is not None:
                self.on_dead(self.exit_reason)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)
