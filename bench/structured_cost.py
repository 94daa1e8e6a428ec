"""What constrained decoding costs: decode-step time with 0%, 50% and 100% of a batch of 8 constrained
by a realistic JSON schema, the time spent filling the grammar masks, and the compile time of a schema.

    python bench/structured_cost.py                    # embedded model, --dtype auto, 3 rounds
    python bench/structured_cost.py --dtype float32 --repeats 5 --json out.json

Offline engine (LLM, max_num_seqs 8), 8 requests x ~64 prompt tokens x --output-len tokens
(ignore_eos; the schema is an array of at least 16 records, so no constrained output can end early:
every configuration decodes the same number of tokens). Rounds interleave the three mixes
(0 50 100 0 50 100 ...), fresh prompts per round; medians over rounds of each round's median decode
step ("decode" = no prompt work in the step: nanoserve.engine.core.step_kind). `fill` is the time in
GrammarMatchers.bitmask (llguidance computing the allowed-token bitmask of every constrained row);
the rest of the mask cost (unpacking the bitmask and masking the logits rows) is inside the step and
shows in the step-time difference."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RECORD = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "address"],
          "properties": {
              "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
              "email": {"type": "string", "format": "email"}, "role": {"enum": ["admin", "user", "guest"]},
              "address": {"type": "object", "required": ["street", "city"], "properties": {
                  "street": {"type": "string"}, "city": {"type": "string"},
                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
              "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
              "orders": {"type": "array", "items": {"type": "object", "required": ["id", "total"], "properties": {
                  "id": {"type": "integer"}, "total": {"type": "number"}, "paid": {"type": "boolean"}}}}}}
SCHEMA = {"type": "array", "minItems": 16, "items": RECORD}


def run_mix(llm, frac: float, args, seed: int) -> dict:
    import torch

    from nanoserve import SamplingParams
    from nanoserve.engine.core import step_kind
    from nanoserve.structured import json_spec
    eng = llm.engine
    spec = json_spec(SCHEMA, "response_format")
    n_constrained = round(frac * args.batch)
    for i in range(args.batch):
        words = " ".join(f"w{(seed * 7919 + i * 131 + k) % 1000}" for k in range(args.input_len // 2))
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                                structured=spec if i < n_constrained else None)
        eng.add_request(f"s{seed}-{frac}-{i}", f"Records for {words}:", params)
    fill = [0.0]
    inner = eng.grammars.bitmask

    def timed(seqs):
        t0 = time.perf_counter()
        out = inner(seqs)
        fill[0] += time.perf_counter() - t0
        return out
    eng.grammars.bitmask = timed
    steps = []
    with torch.inference_mode():
        while eng.has_unfinished():
            kind, t0 = step_kind(eng), time.perf_counter()
            fill[0] = 0.0
            eng.step()
            if kind == "decode":
                steps.append((time.perf_counter() - t0, fill[0]))
    del eng.grammars.bitmask
    return {"step_ms": statistics.median(s for s, _ in steps) * 1e3,
            "fill_ms": statistics.median(f for _, f in steps) * 1e3, "steps": len(steps)}


def compile_times(llm) -> dict:
    """First request's compile on a fresh matcher set (includes building llguidance's view of the
    vocabulary), a second distinct schema, a cached one, and the API side's validation."""
    from nanoserve.engine.grammar import GrammarMatchers
    from nanoserve.structured import json_spec
    g = GrammarMatchers(llm.engine.tokenizer, llm.engine.model.vocab_size)
    out = {}
    for name, schema in (("first_ms", SCHEMA), ("second_schema_ms", RECORD), ("cached_ms", SCHEMA)):
        t0 = time.perf_counter()
        g.check(json_spec(schema, "response_format"))
        out[name] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    json_spec(SCHEMA, "response_format").validate()
    out["api_validate_ms"] = (time.perf_counter() - t0) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu-threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    from nanoserve import LLM, SamplingParams
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    llm = LLM(args.model, dtype=args.dtype, kv_cache_gb=1.0, max_num_seqs=args.batch)
    llm.generate(["warm up"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    comp = compile_times(llm)
    mixes = (0.0, 0.5, 1.0)
    rounds: dict[float, list[dict]] = {f: [] for f in mixes}
    for r in range(args.repeats + 1):  # round 0 warms the grammar cache and the kernels: dropped
        for f in mixes:
            res = run_mix(llm, f, args, seed=r)
            if r:
                rounds[f].append(res)
    med = {f: {k: statistics.median(x[k] for x in rounds[f]) for k in ("step_ms", "fill_ms", "steps")} for f in mixes}
    base = med[0.0]["step_ms"]
    print(f"decode step, batch {args.batch}, {llm.engine.dtype}, {torch.get_num_threads()} thread(s), "
          f"medians of {args.repeats} rounds")
    print(f"{'constrained':<13}{'step ms':>9}{'vs 0%':>8}{'fill ms':>9}{'fill/step':>10}")
    for f in mixes:
        m = med[f]
        print(f"{f:>10.0%}   {m['step_ms']:>9.2f}{m['step_ms'] / base:>7.3f}x{m['fill_ms']:>9.3f}"
              f"{m['fill_ms'] / m['step_ms']:>9.1%}")
    print("compile: " + ", ".join(f"{k} {v:.1f}" for k, v in comp.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "dtype": str(llm.engine.dtype),
                                               "mixes": {str(f): med[f] for f in mixes}, "compile": comp,
                                               "rounds": {str(f): rounds[f] for f in mixes}}, indent=1))


if __name__ == "__main__":
    main()
