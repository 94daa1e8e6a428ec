"""The engine core's input, read on a thread of its own: commands are received and decoded, and a new
request is built there (validated again, its sequences made, its prompt's chain of block digests
computed: RequestBuilder.build) while the loop runs a step, so hashing a long prompt (~2 ms for 32k
tokens in Python) is not time the running requests wait. The loop takes the commands in arrival order
from a queue. Only this thread reads the socket until `close`; after it, the caller may."""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from nanoserve.engine.protocol import Add, PromptRequest, Stop, ToEngine, decode_to_engine
from nanoserve.engine.requests import Request

POLL_MS = 100  # how often a reader with nothing to read checks that it should stop


@dataclass
class Received:
    """A command; for an Add, the request built from it (or why it could not be). `msg` None: reading
    itself failed with `built` (the loop raises it)."""
    msg: ToEngine | None
    built: Request | BaseException | None = None


class Intake:
    def __init__(self, inp: zmq.Socket, build: Callable[[PromptRequest], Request]) -> None:
        self.inp, self.build = inp, build
        self._queue: queue.SimpleQueue[Received] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nanoserve-intake", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.inp.poll(POLL_MS):
                    continue
                msg = decode_to_engine(self.inp.recv())
                built: Request | BaseException | None = None
                if isinstance(msg, Add):
                    try:  # validated by the API already; a mismatch is reported, not dropped
                        built = self.build(msg.request)
                    except Exception as e:
                        built = e
                self._queue.put(Received(msg, built))
                if isinstance(msg, Stop):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the loop, which fails what it tracks
            self._queue.put(Received(None, e))

    def next(self, timeout: float) -> Received | None:
        """The next command, waiting up to `timeout` seconds for one (0: not at all); None if none."""
        try:
            return self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> list[Received]:
        """Stop reading; the commands read but not taken yet, in order (the rest stay in the socket)."""
        self._stop.set()
        self._thread.join()
        left = []
        while (r := self.next(0)) is not None:
            left.append(r)
        return left
