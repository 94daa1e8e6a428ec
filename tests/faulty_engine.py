"""An LLMEngine with faults on demand, for the fault tests in either engine placement (its own
process by default, so the test cannot reach into it): `EngineClient(..., make_engine=
"tests.faulty_engine:make")`, armed through the JSON file named by $NANOSERVE_FAULT_PLAN, which the
engine reads at every step."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from nanoserve.config import EngineConfig
from nanoserve.engine.llm_engine import LLMEngine

PLAN_ENV = "NANOSERVE_FAULT_PLAN"


@dataclass
class FaultPlan:
    path: Path
    generation: int = 0

    def arm(self, *fail_on: int, poison: str = "", max_num_seqs: int = 128) -> None:
        """Fail the step() calls `fail_on` (1-based, counted from now) with "injected fault", and
        any forward whose batch holds request `poison` with "poisoned batch"."""
        self.generation += 1
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"generation": self.generation, "fail_on": list(fail_on), "poison": poison,
                                   "max_num_seqs": max_num_seqs}))
        os.replace(tmp, self.path)  # the engine never reads half a plan


def make(config: EngineConfig) -> LLMEngine:
    engine = LLMEngine(config)
    path = Path(os.environ[PLAN_ENV])
    state = {"generation": None, "calls": 0, "plan": {}}
    real_step, real_plan = engine.step, engine.runner.plan

    def step():
        plan = json.loads(path.read_text()) if path.exists() else {}
        if plan.get("generation") != state["generation"]:
            state.update(generation=plan.get("generation"), calls=0, plan=plan)
        engine.scheduler.max_num_seqs = plan.get("max_num_seqs", config.max_num_seqs)
        state["calls"] += 1
        if state["calls"] in plan.get("fail_on", ()):
            raise RuntimeError("injected fault")
        return real_step()

    def plan(scheduled, *args):
        poison = state["plan"].get("poison")
        if poison and any(s.seq.request_id == poison for s in scheduled):
            raise RuntimeError("poisoned batch")
        return real_plan(scheduled, *args)

    engine.step, engine.runner.plan = step, plan
    return engine
