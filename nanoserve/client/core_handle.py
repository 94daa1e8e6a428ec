"""The engine core as the API side runs it: started in its own process (`ipc://`, the default) or in
a thread of this process (`inproc://`), the two zmq sockets to it, whether it still runs, and how it
is stopped. No request state: that is the client's (client.py)."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import zmq

from nanoserve.config import EngineConfig
from nanoserve.parallel.placement import (CpuPlacement, PlacementRequest, apply_engine_placement,
                                        compute_process_env, engine_placement)
from nanoserve.engine.protocol import EngineStartError, ModelInfo, Ready, decode_from_engine, encode

log = logging.getLogger("nanoserve.client")

POLL_MS = 100  # how quickly a dead engine core is noticed


class CoreHandle:
    def __init__(self, config: EngineConfig, placement: PlacementRequest | None, log_level: str,
                 in_process: bool, make_engine: str | None, lock: threading.Lock) -> None:
        """`lock`: the caller's, held around every send (zmq sockets are not thread-safe). `placement`: None
        leaves affinity and threads as they are."""
        self.config, self.asked, self.log_level = config, placement, log_level
        self.placement = CpuPlacement()  # what the engine planned: known once started
        self.in_process, self.make_engine, self.lock = in_process, make_engine, lock
        self.proc: subprocess.Popen | None = None
        self.thread: threading.Thread | None = None
        self.thread_exit = 1  # in-process core: its return code once it ended
        self.closed = False   # sockets closed, core ended

    @property
    def started(self) -> bool:
        return self.proc is not None or self.thread is not None

    @property
    def pid(self) -> int:
        """The engine core's process (this process when it runs in a thread)."""
        return self.proc.pid if self.proc is not None else os.getpid()

    def start(self) -> ModelInfo:
        """Bind the sockets, start the core and wait until its model is loaded; the handshake
        brings the model metadata. Raises EngineStartError (after killing what was started)."""
        self._ctx = zmq.Context()
        self._in, self._out = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        for s in (self._in, self._out):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
        if self.in_process:
            self._dir = None
            addrs = (f"inproc://engine-input-{id(self)}", f"inproc://engine-output-{id(self)}")
        else:
            self._dir = tempfile.mkdtemp(prefix="nanoserve-ipc-")
            addrs = (f"ipc://{self._dir}/input", f"ipc://{self._dir}/output")
        self._in.bind(addrs[0])
        self._out.bind(addrs[1])
        self._start_core(*addrs)
        try:
            return self._handshake()
        except BaseException:
            self.kill()
            self.close()
            raise

    def _start_core(self, input_addr: str, output_addr: str) -> None:
        if self.in_process:
            from nanoserve.engine.core import serve
            placement = engine_placement(self.config, self.asked, engine_process=False)
            apply_engine_placement(placement)

            def run() -> None:  # an exception leaves thread_exit at 1
                self.thread_exit = serve(self.config, self._ctx, input_addr, output_addr, None,
                                         self.make_engine, placement)

            self.thread = threading.Thread(target=run, name="nanoserve-engine-core", daemon=True)
            self.thread.start()
            log.info("engine core started in a thread of this process")
            return
        spec = {"config": dataclasses.asdict(self.config), "input": input_addr, "output": output_addr,
                "parent_pid": os.getpid(), "log_level": self.log_level, "make_engine": self.make_engine,
                "placement": self.asked and dataclasses.asdict(self.asked)}
        self.proc = subprocess.Popen([sys.executable, "-m", "nanoserve.engine.core", json.dumps(spec)],
                                     env=compute_process_env())
        log.info("engine process started (pid %d)", self.proc.pid)

    def exit_code(self) -> int | None:
        if self.proc is not None:
            return self.proc.poll()
        return None if self.thread.is_alive() else self.thread_exit

    def _handshake(self) -> ModelInfo:
        while True:
            if self._out.poll(POLL_MS):
                msg = decode_from_engine(self._out.recv())
                if isinstance(msg, Ready):
                    self.placement = msg.placement
                    return msg.info
                raise EngineStartError(msg.message)
            if (code := self.exit_code()) is not None:
                raise EngineStartError(f"the engine core exited with code {code} while loading the model")

    def send(self, msg) -> None:
        """Callers hold the lock. Never blocks: a PUSH socket with no peer (the engine process just
        died) would block forever; what is not delivered then is failed by the client's receiver
        thread when it sees the core gone."""
        if self.closed:
            return
        try:
            self._in.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("the engine core is not reachable; %s not delivered", type(msg).__name__)

    def poll(self) -> bool:
        """Wait up to POLL_MS for output from the core."""
        return bool(self._out.poll(POLL_MS))

    def recv_nowait(self) -> bytes | None:
        try:
            return self._out.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def wait(self, timeout: float) -> None:
        """Wait for a core that was asked to stop."""
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("the engine process did not stop in %.0fs; killing it", timeout)
        else:
            self.thread.join(timeout)

    def kill(self) -> None:
        self.closed = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        """After kill() and once nothing reads the output socket any more."""
        with self.lock:  # no send can race the close
            self._in.close()
        self._out.close()
        if self.thread is not None:
            self.thread.join(10)
        if self.thread is None or not self.thread.is_alive():
            self._ctx.term()  # (an in-process core that would not stop keeps the context: term() would hang)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
