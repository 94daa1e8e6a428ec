"""AsyncEngine: LLMEngine.step() looping in one background thread, outputs streamed to asyncio.

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
    """Per-request state kept by the engine thread: where to send outputs, timing for metrics."""
    loop: asyncio.AbstractEventLoop
    q: asyncio.Queue
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0


class MetricsObserver:
    """Hooks called on the engine thread; the server plugs Prometheus histograms in here."""

    def on_first_token(self, ttft: float) -> None: ...
    def on_inter_token(self, itl: float) -> None: ...
    def on_finished(self, e2e: float, out: RequestOutput) -> None: ...


class AsyncEngine:
    def __init__(self, engine: LLMEngine, observer: MetricsObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer or MetricsObserver()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tracks: dict[str, _Track] = {}           # engine thread only
        self._pending_adds = 0                          # queued adds not yet seen by the engine thread
        self._lock = threading.Lock()
        self._num_waiting = 0                           # scheduler-waiting requests after the last step
        self._num_running = 0
        self._stopping = False
        self._closed = False                            # set once the engine thread stops taking work
        self._thread: threading.Thread | None = None
        self.step_errors = 0
        self.invariant_violations = 0
        self.last_error: str | None = None
        self._snapshot = EngineSnapshot()

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)
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
        return self._pending_adds + self._num_waiting

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
            self._pending_adds += 1
            self._inbox.put(("add", req, _Track(loop, q, time.monotonic())))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(req.request_id)

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
        self._inbox.put(("snapshot", loop, fut))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return self._snapshot

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        # The engine thread only ever runs inference: inference mode (thread-local) makes every
        # tensor the step creates an inference tensor, so in-place sampler updates on them are legal.
        with torch.inference_mode():
            self._loop()

    def _loop(self) -> None:
        eng = self.engine
        try:
            while True:
                block = not eng.has_unfinished()
                if not self._drain(block):
                    break
                if not eng.has_unfinished():
                    self._check_invariants()
                    continue
                try:
                    outs = eng.step()
                except Exception as e:  # fail what was in that step, keep serving
                    self._fail_step(e)
                    continue
                self._deliver(outs)
                self._count()
        except BaseException as e:  # pragma: no cover - a bug in this loop itself
            log.exception("engine thread crashed")
            self.last_error = repr(e)
            self._fail_all(e)
            raise
        finally:
            self._shutdown()

    def _drain(self, block: bool) -> bool:
        """Apply queued adds / aborts / snapshot requests. Returns False on stop."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            kind = item[0]
            if kind == "stop":
                return False
            if kind == "add":
                _, req, track = item
                with self._lock:
                    self._pending_adds -= 1
                try:
                    self.engine.add(req)
                except Exception as e:
                    track.loop.call_soon_threadsafe(track.q.put_nowait, e)
                    continue
                self._tracks[req.request_id] = track
                self._count()
            elif kind == "abort":
                rid = item[1]
                track = self._tracks.pop(rid, None)
                try:
                    out = self.engine.abort(rid)
                except Exception:
                    log.exception("abort of %s failed", rid)
                    out = None
                if out is not None and track is not None:
                    self._finished(track, out, time.monotonic())
                    track.loop.call_soon_threadsafe(track.q.put_nowait, out)
                self._count()
            elif kind == "fail_all":
                err = EngineDead(item[1])
                for rid, track in list(self._tracks.items()):
                    self._force_abort(rid)
                    track.loop.call_soon_threadsafe(track.q.put_nowait, err)
                self._tracks.clear()
                self._count()
            elif kind == "snapshot":
                _, loop, fut = item
                snap = self._take_snapshot()
                loop.call_soon_threadsafe(_set_result, fut, snap)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        now = time.monotonic()
        obs = self.observer
        for out in outs:
            track = self._tracks.get(out.request_id)
            if track is None:
                continue
            ntok = sum(len(c.token_ids) for c in out.outputs)
            if ntok > track.num_tokens:
                try:
                    if track.first_token is None:
                        track.first_token = now
                        obs.on_first_token(now - track.arrival)
                    elif track.last_token is not None:
                        obs.on_inter_token(now - track.last_token)
                except Exception:
                    log.exception("metrics observer failed")
                track.last_token = now
                track.num_tokens = ntok
            if out.finished:
                del self._tracks[out.request_id]
                self._finished(track, out, now)
            track.loop.call_soon_threadsafe(track.q.put_nowait, out)

    def _finished(self, track: _Track, out: RequestOutput, now: float) -> None:
        out.metrics = dict(out.metrics, server_arrival=track.arrival, finished=now)
        try:
            self.observer.on_finished(now - track.arrival, out)
        except Exception:
            log.exception("metrics observer failed")

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
                track.loop.call_soon_threadsafe(track.q.put_nowait, err)
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
            track.loop.call_soon_threadsafe(track.q.put_nowait, err)
        self._tracks.clear()

    def _force_abort(self, rid: str) -> None:
        try:
            self.engine.abort(rid)
        except Exception:
            log.exception("abort of %s after a failed step failed; dropping it", rid)
            self.engine.requests.pop(rid, None)  # never let one broken request fail every step

    def _shutdown(self) -> None:
        self._stopping = True
        with self._lock:
            self._closed = True  # from here on generate() refuses; everything queued before is failed below
        err = EngineDead("the server is shutting down")
        for rid, track in list(self._tracks.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                pass
            track.loop.call_soon_threadsafe(track.q.put_nowait, err)
        self._tracks.clear()
        while True:  # adds that never reached the engine
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item[0] == "add":
                item[2].loop.call_soon_threadsafe(item[2].q.put_nowait, err)
            elif item[0] == "snapshot":
                item[1].call_soon_threadsafe(_set_result, item[2], self._snapshot)
        with self._lock:
            self._pending_adds = 0

    def _count(self) -> None:
        sch = self.engine.scheduler
        self._num_running = len({s.request_id for s in sch.running})
        self._num_waiting = len({s.request_id for s in sch.waiting})

    def _take_snapshot(self) -> EngineSnapshot:
        eng = self.engine
        self._count()
        st = eng.stats
        self._snapshot = EngineSnapshot(
            num_running=self._num_running, num_waiting=self.num_waiting,
            num_preemptions=eng.scheduler.num_preemptions, prompt_tokens=st.prompt_tokens,
            generation_tokens=st.generation_tokens, finished=dict(st.finished), steps=st.steps,
            step_errors=self.step_errors, invariant_violations=self.invariant_violations, tiers=[dataclasses.replace(r) for r in eng.kv.reports()],
            time=time.time())
        return self._snapshot


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)

