"""Where an offline engine's time goes, per round (bench/tier.py, offline target): wall time on the engine
thread inside each stage of its steps, and counts, so that two configs at equal cache hits (the host tier
and its device-big control) can be told apart by stage rather than guessed at.

Stages (inclusive, wall clock; a stage inside another counts in both): `step` (all of it), `schedule`,
`admit` (matching, taking blocks, starting loads), `wait loads` / `wait saves` / `wait disk` (the
CPU scheduler's inline waits for a new admission's copies), `idle wait` (nothing to run: blocked on a
copy), `cleaner` (saves of cold device blocks), `forward` (the step's launch and collect: model,
sampling). Counts: steps, deferred admissions (saves awaited), host blocks loaded and saved.
"""
from __future__ import annotations

import time
from collections import defaultdict

STAGES = (("schedule", "scheduler", "schedule"), ("admit", "kv", "admit"),
          ("wait loads", "kv", "complete_loads"), ("wait saves", "kv", "complete_saves"),
          ("wait disk", "kv", "complete_reads"), ("idle wait", "kv", "wait_for_transfer"),
          ("cleaner", "kv", "offload_cold_blocks"), ("forward", "pipeline", "launch"),
          ("forward", "pipeline", "collect"))


class Breakdown:
    """Wraps the engine's stage methods (on the instances: nothing else changes) and keeps seconds per
    stage; `take()` returns what accumulated since the last call."""

    def __init__(self, eng) -> None:
        self.eng = eng
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        for stage, owner, method in STAGES:
            self._wrap(getattr(eng, owner), method, stage)
        self._wrap(eng, "step", "step")
        self._last = self._counts()

    def _wrap(self, obj, method: str, stage: str) -> None:
        inner = getattr(obj, method)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.seconds[stage] += time.perf_counter() - t0
                self.steps += stage == "step"
        setattr(obj, method, timed)

    def _counts(self) -> dict[str, float]:
        kv, host = self.eng.kv, self.eng.kv.host
        t = host.transfers if host is not None else None
        return {"steps": self.steps, "deferred": kv.num_deferred,
                "blocks loaded": t.blocks_out if t else 0, "blocks saved": t.blocks_in if t else 0}

    def take(self) -> dict[str, float]:
        now = self._counts()
        out = {k: round(v, 4) for k, v in self.seconds.items()}
        out.update({k: now[k] - self._last[k] for k in now})
        self.seconds.clear()
        self._last = now
        return out


def show(name: str, rnd: int, b: dict[str, float]) -> None:
    names = ("step", "forward", "schedule", "admit", "wait loads", "wait saves", "wait disk", "idle wait",
             "cleaner")
    stages = "  ".join(f"{k} {b[k]:.2f}s" for k in names if b.get(k))
    counts = "  ".join(f"{k} {int(b[k])}" for k in ("steps", "deferred", "blocks loaded", "blocks saved"))
    print(f"{'':14s} round {rnd} breakdown: {stages}  |  {counts}", flush=True)
