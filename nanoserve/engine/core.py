"""The engine core: loads the model and loops schedule -> forward -> sample (LLMEngine.step), taking
commands from its client and sending each turn's outputs back as one Batch (messages: protocol.py)
over zmq -- `ipc://` when it runs in its own process (`python -m nanoserve.engine.core SPEC_JSON`, the
default), `inproc://` when it runs in a thread of the API process (--no-engine-process, tests). The same
loop and the same messages either way.

An exception inside step() fails only the requests that were in that step (queued ones are
untouched); the KV invariants are checked after it, and the loop keeps serving. With
NANOSERVE_CHECK_INVARIANTS=1 (the test suite's servers) they are also checked each time the engine goes
idle: a served engine does not walk its pools between bursts of traffic. In its own process the core
never outlives the API process: the kernel kills it when its parent dies (PR_SET_PDEATHSIG), and an
idle loop also notices a changed parent pid. SIGINT/SIGTERM are ignored there: a terminal's Ctrl-C or a
service manager signals the whole group, but the API process must be able to drain first; it sends Stop
when it is done."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import time
from concurrent.futures import FIRST_COMPLETED, wait

import zmq

from nanoserve.config import EngineConfig, import_by_name
from nanoserve.parallel.placement import (CpuPlacement, PlacementRequest, apply_engine_placement,
                                       die_with_parent, engine_placement)
from nanoserve.engine.intake import Intake, Received
from nanoserve.engine.requests import Request
from nanoserve.engine.protocol import (Abort, Add, Batch, DeltaEncoder, EngineDead, EngineSnapshot, FailAll,
                                       Finish, OutputDelta, Ready, RequestError, SnapshotAsk, SnapshotReply,
                                       StartFailed, StepFailed, StepTime, Stop, decode_to_engine,
                                       encode)
from nanoserve.outputs import RequestOutput

log = logging.getLogger("nanoserve.engine_core")

IDLE_POLL_MS = 1000  # how often an idle engine in its own process checks that its parent is still there


class EngineCore:
    def __init__(self, engine, inp: zmq.Socket, out: zmq.Socket, parent_pid: int | None = None) -> None:
        self.engine = engine
        self.inp, self.out, self.parent_pid = inp, out, parent_pid
        self.encoders: dict[str, DeltaEncoder] = {}  # the requests in the engine, by id
        self.compiling: dict[str, Request] = {}      # requests waiting for their grammar, not in the
                                                     # engine yet
        self.step_errors = 0
        self.invariant_violations = 0
        self.check_when_idle = os.environ.get("NANOSERVE_CHECK_INVARIANTS") == "1"
        self.adds_seen = 0
        self.snapshot = EngineSnapshot()
        self._outputs: list[OutputDelta] = []
        self._errors: list[RequestError] = []
        self._steps: list[StepTime] = []
        self._snapshots: list[SnapshotReply] = []
        self._sent_counts: tuple[int, int, int] | None = None
        self.intake = Intake(inp, engine.request_from)  # reads `inp` until the loop ends

    def run(self) -> None:
        import torch
        # The loop only ever runs inference: inference mode (thread-local) makes every tensor the
        # step creates an inference tensor, so in-place sampler updates on them are legal.
        with torch.inference_mode():
            try:
                self._loop()
            except BaseException as e:  # pragma: no cover - a bug in this loop itself
                log.exception("engine loop crashed")
                self._fail_tracked(f"the engine failed while running this request: {type(e).__name__}: {e}",
                                   "engine")
                self._flush()  # before the shutdown, which may wait on what failed
                raise
            finally:
                self._shutdown()
                self._flush()

    def _loop(self) -> None:
        eng, busy = self.engine, False
        while self._drain(block=not eng.has_unfinished() and not self.compiling):
            self._admit_compiled()
            self._flush()
            if not eng.has_unfinished():
                if busy and self.check_when_idle:
                    self._check_invariants()
                busy = False
                continue
            busy = True
            kind, steps, t0 = eng.next_step_kind(), eng.stats.steps, time.perf_counter()
            try:
                outs = eng.step()
            except Exception as e:  # fail what was in that step, keep serving
                self._fail_step(e)
            else:
                if eng.stats.steps > steps:  # not the empty steps that wait for host copies
                    self._steps.append(StepTime(kind, time.perf_counter() - t0))
                for out in outs:
                    self._emit(out)
            self._flush()

    # ---- commands ----------------------------------------------------------------------------
    def _next(self, block: bool) -> Received | None:
        while (received := self.intake.next(IDLE_POLL_MS / 1000 if block else 0)) is None:
            if not block:
                return None
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.error("the API process is gone; stopping")
                return Received(Stop())
            self.engine.idle()  # (a tensor-parallel worker that died raises ParallelFault here)
        if received.msg is None:  # reading the socket failed
            raise received.built
        return received

    def _drain(self, block: bool) -> bool:
        """Apply queued commands. Returns False on Stop."""
        eng = self.engine
        while (received := self._next(block)) is not None:
            block = False
            match received.msg:
                case Stop():
                    return False
                case Add(request=preq):  # built on the intake thread (intake.py)
                    self.adds_seen += 1
                    if isinstance(received.built, Request):
                        self.compiling[preq.request_id] = received.built
                    else:
                        self._errors.append(RequestError.of(preq.request_id, received.built))
                case Abort(request_id=rid) if rid in self.compiling:
                    del self.compiling[rid]
                case Abort(request_id=rid):
                    try:
                        self._emit(eng.abort(rid))
                    except Exception:
                        log.exception("abort of %s failed", rid)
                    self.encoders.pop(rid, None)  # aborted is done, whatever the engine answered
                case Finish(request_id=rid, indices=indices, stop_reason=stop):
                    self._emit(eng.finish(rid, indices, stop))
                case FailAll(reason=reason):
                    self._fail_tracked(reason, "dead")
                case SnapshotAsk(token=token):
                    self._snapshots.append(SnapshotReply(token, self._take_snapshot()))
        return True

    def _admit_compiled(self) -> None:
        """Requests whose grammar is compiled (or that have none) go into the engine; one whose compile
        failed or took too long is answered with the error. The step never waits for a compile: with
        nothing else to run, the loop waits here briefly for one."""
        if not self.compiling:
            return
        if not self.engine.has_unfinished():
            wait([r.grammar.future for r in self.compiling.values() if r.grammar is not None], timeout=0.01,
                 return_when=FIRST_COMPLETED)
        for rid, req in list(self.compiling.items()):
            try:
                if req.grammar is not None and not self.engine.grammars.ready(req.grammar):
                    continue
                del self.compiling[rid]
                self.engine.add(req)
            except Exception as e:
                self.compiling.pop(rid, None)
                self._errors.append(RequestError.of(rid, e))
                continue
            self.encoders[rid] = DeltaEncoder()

    # ---- outputs -----------------------------------------------------------------------------
    def _emit(self, out: RequestOutput | None) -> None:
        enc = None if out is None else self.encoders.get(out.request_id)
        if enc is None:
            return
        self._outputs.append(enc.delta(out))
        if out.finished:
            del self.encoders[out.request_id]

    def _flush(self) -> None:
        running, waiting = self.engine.request_counts()
        counts = (self.adds_seen, running, waiting + len(self.compiling))
        if (not (self._outputs or self._errors or self._steps or self._snapshots)
                and counts == self._sent_counts):
            return
        self.out.send(encode(Batch(self._outputs, self._errors, self._steps, self._snapshots, *counts)))
        self._outputs, self._errors, self._steps, self._snapshots = [], [], [], []
        self._sent_counts = counts

    # ---- failures ----------------------------------------------------------------------------
    def _fail_step(self, exc: Exception) -> None:
        """One step raised: fail only the requests it concerned (when scheduling itself failed, the
        running ones and the one it was admitting), then verify the KV state is still sound."""
        self.step_errors += 1
        ids = exc.request_ids if isinstance(exc, StepFailed) else self.engine.active_request_ids()
        for out in exc.outputs if isinstance(exc, StepFailed) else ():  # the step completed beside it
            self._emit(out)
            if out.finished:  # finished cleanly there (one step ahead, its row in the failed step was extra)
                ids = ids - {out.request_id}
        cause = exc.cause if isinstance(exc, StepFailed) else exc
        log.error("engine step failed; failing the %d request(s) in it", len(ids), exc_info=cause)
        message = f"the engine failed while running this request: {type(cause).__name__}: {cause}"
        for rid in ids:
            self._force_abort(rid)
            if self.encoders.pop(rid, None) is not None:
                self._errors.append(RequestError(rid, "engine", message))
        self._check_invariants()

    def _fail_tracked(self, message: str, kind: str) -> None:
        for rid in list(self.encoders):
            self._force_abort(rid)
            self._errors.append(RequestError(rid, kind, message))
        self._errors += [RequestError(rid, kind, message) for rid in self.compiling]
        self.encoders.clear()
        self.compiling.clear()

    def _force_abort(self, rid: str) -> None:
        try:
            self.engine.abort(rid)
        except Exception:
            log.exception("abort of %s after a failure failed; dropping it", rid)
            self.engine.discard(rid)  # never let one broken request fail every step

    def _check_invariants(self) -> None:
        try:
            self.engine.check_invariants()
        except AssertionError:
            self.invariant_violations += 1
            log.exception("KV cache invariant violated")

    def _shutdown(self) -> None:
        """Answer whatever is still queued, fail what is still running, end the KV copies."""
        err = EngineDead("the server is shutting down")
        left = []
        for r in self.intake.close():
            if r.msg is None:
                log.error("reading the engine's input failed", exc_info=r.built)
            left.append(r.msg)
        while self.inp.poll(0):  # the intake has stopped: what it had not read yet
            left.append(decode_to_engine(self.inp.recv()))
        for msg in left:
            if isinstance(msg, Add):
                self._errors.append(RequestError.of(msg.request.request_id, err))
            elif isinstance(msg, SnapshotAsk):
                self._snapshots.append(SnapshotReply(msg.token, self.snapshot))
        self._fail_tracked(str(err), "dead")
        try:
            self.engine.close()
        except Exception:
            log.exception("engine close failed")

    def _take_snapshot(self) -> EngineSnapshot:
        self.snapshot = dataclasses.replace(self.engine.snapshot(), step_errors=self.step_errors,
                                            invariant_violations=self.invariant_violations)
        return self.snapshot


def serve(config: EngineConfig, ctx: zmq.Context, input_addr: str, output_addr: str, parent_pid: int | None,
          make_engine: str | None = None, placement: CpuPlacement = CpuPlacement()) -> int:
    """Load the model, answer the handshake (Ready or StartFailed), then run the loop until Stop."""
    inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for s in (inp, out):
        s.setsockopt(zmq.LINGER, 5000)  # the last batch (shutdown errors) must reach the API side
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
    inp.connect(input_addr)
    out.connect(output_addr)
    try:
        t0 = time.monotonic()
        try:
            engine = import_by_name(make_engine or "nanoserve.engine.llm_engine:LLMEngine")(config)
        except Exception as e:
            # the API side prints the error (once); only a bug's traceback, which stays here, is logged here
            if not isinstance(e, (ValueError, OSError)):
                log.exception("the engine failed to start")
            out.send(encode(StartFailed(str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")))
            return 2
        log.info("engine core ready in %.1fs (pid %d)", time.monotonic() - t0, os.getpid())
        out.send(encode(Ready(engine.info, placement)))
        EngineCore(engine, inp, out, parent_pid).run()
        return 0
    finally:
        inp.close()
        out.close()


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    die_with_parent(spec["parent_pid"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec["log_level"].upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s [engine-core]: %(message)s")
    config = EngineConfig(**spec["config"])
    asked = spec["placement"] and PlacementRequest(**spec["placement"])
    placement = engine_placement(config, asked, engine_process=True)
    apply_engine_placement(placement)
    log.info("CPU placement: %s", placement.describe())
    ctx = zmq.Context()
    try:
        return serve(config, ctx, spec["input"], spec["output"], spec["parent_pid"], spec["make_engine"],
                     placement)
    finally:
        ctx.term()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
