"""The engine loop (EngineLoop) and its in-process driver AsyncEngine: LLMEngine.step() looping in one
background thread, outputs streamed to asyncio. The engine-core process (core_process.py) runs the
same EngineLoop with zmq in place of the thread-safe queues.

The asyncio side validates and tokenizes (`LLMEngine.make_request` only reads immutable state),
then hands requests and aborts to the engine thread through a thread-safe queue; the engine
thread drains that queue before every step and blocks on it when there is nothing to run (no busy
spin). Each step's outputs go back through `loop.call_soon_threadsafe` into a per-request
asyncio.Queue. A request whose consumer goes away (client disconnect, cancellation) is aborted,
which frees its KV blocks at once. An exception inside step() fails every request that was in the
step with an error (queued requests are untouched), the KV invariants are checked, and the thread
keeps serving. When the engine goes idle it checks the KV invariants too (`invariant_violations`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from nanoserve.engine.frontend import Frontend
from nanoserve.engine.llm_engine import LLMEngine, Request
from nanoserve.outputs import RequestOutput

log = logging.getLogger("nanoserve.async")


class EngineError(RuntimeError):
    """The engine failed while running a request (not the request's fault)."""


class EngineDead(RuntimeError):
    """The engine thread is not running (stopped or crashed)."""


@dataclass
class EngineSnapshot:
    """A consistent view of the engine, taken on the engine thread (for /metrics)."""
    num_running: int = 0            # requests with a sequence in the running set
    num_waiting: int = 0            # requests waiting in the scheduler (+ queued, not yet added)
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    step_errors: int = 0
    invariant_violations: int = 0
    tiers: list[Any] = field(default_factory=list)  # kvcache TierReport per tier
    time: float = 0.0


@dataclass
class _Track:
    """Per-request state kept by the engine loop: where outputs go (`sink`), timing for metrics."""
    sink: Any                  # in-process: (asyncio loop, asyncio.Queue); engine-core process: delta state
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0


class MetricsObserver:
    """Hooks called on the engine loop; the server plugs Prometheus histograms in here."""

    def on_first_token(self, ttft: float) -> None: ...
    def on_inter_token(self, itl: float) -> None: ...
    def on_finished(self, e2e: float, out: RequestOutput | None) -> None: ...
    def on_step(self, kind: str, seconds: float) -> None: ...


def step_kind(engine: LLMEngine) -> str:
    """'decode' when the coming step can only be one token per running sequence; 'mixed' when some
    prompt work may run in it (a running prefill, a prefix load in flight, or a waiting request
    with a free batch slot; the scheduler may still defer it). Decided before the step, so a
    'decode' step is never one that did prefill work."""
    sch = engine.scheduler
    loading = getattr(sch, "loading", ())
    if loading or (sch.waiting and len(sch.running) < sch.max_num_seqs):
        return "mixed"
    return "decode" if all(s.num_tokens - s.num_computed_tokens <= 1 for s in sch.running) else "mixed"


class EngineLoop:
    """The engine side of serving: apply commands (add / abort / finish / fail_all / snapshot / stop), step,
    deliver outputs. An exception inside step() fails only the requests that were in that step; the
    KV invariants are checked after it and whenever the engine goes idle. Subclasses say where
    commands come from (`_next`) and where outputs and errors go (`_emit`, `_reply_snapshot`,
    `_flush`)."""

    def __init__(self, engine: LLMEngine, observer: MetricsObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer or MetricsObserver()
        self._tracks: dict[str, _Track] = {}           # engine loop only
        self._num_waiting = 0                           # scheduler-waiting requests after the last step
        self._num_running = 0
        self.step_errors = 0
        self.invariant_violations = 0
        self.last_error: str | None = None
        self._snapshot = EngineSnapshot()

    # ---- hooks ---------------------------------------------------------------------------
    def _next(self, block: bool) -> tuple | None:
        """The next command, None when there is none (and not `block`)."""
        raise NotImplementedError

    def _emit(self, track: _Track, item: RequestOutput | BaseException) -> None:
        raise NotImplementedError

    def _reply_snapshot(self, reply_to: Any, snap: EngineSnapshot) -> None:
        raise NotImplementedError

    def _flush(self) -> None:
        """Called after each batch of commands and after each step (batched transports send here)."""

    def _add_seen(self) -> None:
        """An add command left the queue (counted for num_waiting)."""

    def _close_inbox(self, err: BaseException) -> None:
        """The loop stopped: refuse what is still queued (adds get `err`, snapshots the last one)."""

    # ---- the loop ------------------------------------------------------------------------
    def run(self) -> None:
        # The loop only ever runs inference: inference mode (thread-local) makes every tensor the
        # step creates an inference tensor, so in-place sampler updates on them are legal.
        with torch.inference_mode():
            self._loop()

    def _loop(self) -> None:
        eng = self.engine
        try:
            while True:
                block = not eng.has_unfinished()
                if not self._drain(block):
                    break
                self._flush()
                if not eng.has_unfinished():
                    self._check_invariants()
                    continue
                kind = step_kind(eng)
                t0 = time.perf_counter()
                try:
                    outs = eng.step()
                except Exception as e:  # fail what was in that step, keep serving
                    self._fail_step(e)
                    self._flush()
                    continue
                seconds = time.perf_counter() - t0
                if getattr(eng, "step_request_ids", None):  # not the empty steps that wait for host loads
                    self._observe(self.observer.on_step, kind, seconds)
                self._deliver(outs)
                self._count()
                self._flush()
        except BaseException as e:  # pragma: no cover - a bug in this loop itself
            log.exception("engine loop crashed")
            self.last_error = repr(e)
            self._fail_all(e)
            raise
        finally:
            self._shutdown()
            self._flush()

    def _drain(self, block: bool) -> bool:
        """Apply queued commands. Returns False on stop."""
        while True:
            item = self._next(block)
            if item is None:
                return True
            block = False
            kind = item[0]
            if kind == "stop":
                return False
            if kind == "add":
                _, req, track = item
                self._add_seen()
                try:
                    self.engine.add(req)
                except Exception as e:
                    self._emit(track, e)
                    continue
                self._tracks[req.request_id] = track
                self._count()
            elif kind == "abort":
                rid = item[1]
                try:
                    self._send_now(rid, self.engine.abort(rid))
                except Exception:
                    log.exception("abort of %s failed", rid)
                finally:
                    self._tracks.pop(rid, None)  # aborted is done, whatever the engine answered
                self._count()
            elif kind == "finish":
                _, rid, indices, stop_reason = item
                self._send_now(rid, self.engine.finish(rid, indices, stop_reason))
                self._count()
            elif kind == "fail_all":
                err = EngineDead(item[1])
                for rid, track in list(self._tracks.items()):
                    self._force_abort(rid)
                    self._emit(track, err)
                self._tracks.clear()
                self._count()
            elif kind == "snapshot":
                self._reply_snapshot(item[1], self._take_snapshot())

    def _send_now(self, rid: str, out: RequestOutput | None) -> None:
        """Deliver an output a command produced outside a step (abort, finish)."""
        track = self._tracks.get(rid)
        if out is None or track is None:
            return
        if out.finished:
            del self._tracks[rid]
            self._finished(track, out, time.monotonic())
        self._emit(track, out)

    def _observe(self, hook, *args) -> None:
        try:
            hook(*args)
        except Exception:
            log.exception("metrics observer failed")

    def _deliver(self, outs: list[RequestOutput]) -> None:
        now = time.monotonic()
        obs = self.observer
        for out in outs:
            track = self._tracks.get(out.request_id)
            if track is None:
                continue
            ntok = sum(len(c.token_ids) for c in out.outputs)
            if ntok > track.num_tokens:
                if track.first_token is None:
                    track.first_token = now
                    self._observe(obs.on_first_token, now - track.arrival)
                elif track.last_token is not None:
                    self._observe(obs.on_inter_token, now - track.last_token)
                track.last_token = now
                track.num_tokens = ntok
            if out.finished:
                del self._tracks[out.request_id]
                self._finished(track, out, now)
            self._emit(track, out)

    def _finished(self, track: _Track, out: RequestOutput, now: float) -> None:
        out.metrics = dict(out.metrics, server_arrival=track.arrival, finished=now)
        self._observe(self.observer.on_finished, now - track.arrival, out)

    def _fail_step(self, exc: Exception) -> None:
        """One step raised: fail only the requests it concerned (when scheduling itself failed, the
        running ones and the one it was admitting), then verify the KV state is still sound."""
        eng = self.engine
        self.step_errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        ids = getattr(eng, "step_request_ids", None)
        if ids is None:
            sch = eng.scheduler
            ids = {s.request_id for s in sch.running} | ({sch.waiting[0].request_id} if sch.waiting else set())
        log.error("engine step failed; failing the %d request(s) in it", len(ids), exc_info=exc)
        err = EngineError(f"the engine failed while running this request: {self.last_error}")
        for rid in ids:
            self._force_abort(rid)
            track = self._tracks.pop(rid, None)
            if track is not None:
                self._emit(track, err)
        self._count()
        self._check_invariants()

    def _check_invariants(self) -> None:
        try:
            self.engine.check_invariants()
        except AssertionError:
            self.invariant_violations += 1
            log.exception("KV cache invariant violated")

    def _fail_all(self, exc: BaseException) -> None:
        """The loop itself crashed: fail every tracked request (the engine is not touched again)."""
        self.last_error = f"{type(exc).__name__}: {exc}"
        err = EngineError(f"the engine failed while running this request: {self.last_error}")
        for track in self._tracks.values():
            self._emit(track, err)
        self._tracks.clear()

    def _force_abort(self, rid: str) -> None:
        try:
            self.engine.abort(rid)
        except Exception:
            log.exception("abort of %s after a failed step failed; dropping it", rid)
            self.engine.requests.pop(rid, None)  # never let one broken request fail every step

    def _shutdown(self) -> None:
        err = EngineDead("the server is shutting down")
        self._close_inbox(err)
        for rid, track in list(self._tracks.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                pass
            self._emit(track, err)
        self._tracks.clear()
        try:  # KV copies end before the host pool is released (unpinned on CUDA)
            self.engine.close()
        except BaseException:
            log.exception("engine close failed")

    def _count(self) -> None:
        sch = self.engine.scheduler
        self._num_running = len({s.request_id for s in sch.running})
        self._num_waiting = len({s.request_id for s in sch.waiting})

    def _pending_adds(self) -> int:
        return 0

    def _take_snapshot(self) -> EngineSnapshot:
        eng = self.engine
        self._count()
        st = eng.stats
        self._snapshot = EngineSnapshot(
            num_running=self._num_running, num_waiting=self._num_waiting + self._pending_adds(),
            num_preemptions=eng.scheduler.num_preemptions, prompt_tokens=st.prompt_tokens,
            generation_tokens=st.generation_tokens, finished=dict(st.finished), steps=st.steps,
            step_errors=self.step_errors, invariant_violations=self.invariant_violations,
            tiers=[dataclasses.replace(r) for r in eng.kv.reports()], time=time.time())
        return self._snapshot


class AsyncEngine(EngineLoop):
    """EngineLoop in a background thread of this process. The asyncio side validates and tokenizes
    (`LLMEngine.make_request` only reads immutable state), then hands requests and aborts to the
    engine thread through a thread-safe queue; the thread blocks on it when there is nothing to run
    (no busy spin). Outputs go back through `loop.call_soon_threadsafe` into a per-request
    asyncio.Queue. A request whose consumer goes away (client disconnect, cancellation) is aborted,
    which frees its KV blocks at once."""

    def __init__(self, engine: LLMEngine, observer: MetricsObserver | None = None) -> None:
        super().__init__(engine, observer)
        self.frontend = Frontend.of_engine(engine)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0                               # queued adds not yet seen by the engine thread
        self._lock = threading.Lock()
        self._stopping = False
        self._closed = False                            # set once the engine thread stops taking work
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self.run, name="nanoserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything still in flight and stop the engine thread."""
        if self._thread is None:
            return
        self._stopping = True
        self._inbox.put(("stop",))
        self._thread.join(timeout)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # ---- asyncio side ----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests not yet running: queued for the engine thread plus waiting in the scheduler."""
        return self._pending + self._num_waiting

    @property
    def num_running(self) -> int:
        return self._num_running

    async def generate(self, req: Request) -> AsyncIterator[RequestOutput]:
        """Add `req` and yield its outputs until the finished one. Leaving early (break, cancel,
        client gone) aborts the request. Raises EngineError if the engine failed it."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:  # either the engine thread will see this add, or we refuse it here
            if self._closed or not self.alive:
                raise EngineDead("the engine is not running")
            self._pending += 1
            self._inbox.put(("add", req, _Track((loop, q), time.monotonic())))
        async for out in stream_outputs(q, lambda: self.abort(req.request_id)):
            yield out

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def fail_all(self, reason: str) -> None:
        """Abort every request in flight or queued; each gets EngineDead(reason) (shutdown timeout)."""
        self._inbox.put(("fail_all", reason))

    async def snapshot(self, timeout: float = 5.0) -> EngineSnapshot:
        """A fresh snapshot from the engine thread (within one step); the last one if it is busy."""
        if not self.alive:
            return self._snapshot
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._inbox.put(("snapshot", (loop, fut)))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return self._snapshot

    # ---- EngineLoop hooks (engine thread) --------------------------------------------------
    def _next(self, block: bool) -> tuple | None:
        try:
            return self._inbox.get(block=block)
        except queue.Empty:
            return None

    def _emit(self, track: _Track, item: RequestOutput | BaseException) -> None:
        loop, q = track.sink
        loop.call_soon_threadsafe(q.put_nowait, item)

    def _reply_snapshot(self, reply_to: Any, snap: EngineSnapshot) -> None:
        loop, fut = reply_to
        loop.call_soon_threadsafe(_set_result, fut, snap)

    def _add_seen(self) -> None:
        with self._lock:
            self._pending -= 1

    def _pending_adds(self) -> int:
        return self._pending

    def _close_inbox(self, err: BaseException) -> None:
        self._stopping = True
        with self._lock:
            self._closed = True  # from here on generate() refuses; everything queued before is failed below
        while True:  # adds that never reached the engine
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item[0] == "add":
                self._emit(item[2], err)
            elif item[0] == "snapshot":
                self._reply_snapshot(item[1], self._snapshot)
        with self._lock:
            self._pending = 0


async def stream_outputs(q: asyncio.Queue, abort) -> AsyncIterator[RequestOutput]:
    """Yield a request's outputs from `q` until the finished one; an exception put in `q` is raised.
    Leaving early (break, cancel, client gone) calls `abort()`."""
    finished = False
    try:
        while True:
            item = await q.get()
            if isinstance(item, BaseException):
                finished = True
                raise item
            finished = item.finished
            yield item
            if finished:
                return
    finally:
        if not finished:
            abort()


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)
