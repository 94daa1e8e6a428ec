"""Scheduling one step ahead (`async_scheduling`: the default with CUDA, off on CPU) changes when the host
works, never what a client receives: every case here runs both ways in fp32 on CPU (the one-ahead
bookkeeping is the same code on both devices) and must give the same tokens, logprobs and finish reasons,
and HF's greedy tokens where there is an HF oracle. The rest of the suite runs with the device's default;
`NANOSERVE_ASYNC_SCHEDULING=1 make test` runs all of it one step ahead."""
from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.structured import StructuredSpec
from tests.conftest import KV_GB, hf_greedy, random_prompts

TINY = "llama-gqa-tied"
MODES = {"ahead": True, "serial": False}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tiny_path):
    path = tiny_path(TINY)
    prompts = random_prompts(6, 3, 70, seed=11)
    return path, prompts, hf_greedy(path, prompts, GREEDY.max_tokens)


def tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def summary(outs) -> list[tuple]:
    """What a client sees of each choice; logprob values apart (`logprob_values`): a batch of another
    shape may move fp32's last bits."""
    return [(c.token_ids, c.text, c.finish_reason,
             [(lp.token_id, [t for t, _ in lp.top]) for lp in c.logprobs or []])
            for o in outs for c in o.outputs]


def logprob_values(outs) -> list[float]:
    return [v for o in outs for c in o.outputs for lp in c.logprobs or []
            for v in (lp.logprob, *(x for _, x in lp.top))]


def check_clean(llm: LLM) -> None:
    llm.engine.check_invariants()
    assert llm.engine.inflight is None and not llm.engine.requests
    assert llm.engine.kv.pool.stats().in_use == 0


@pytest.mark.parametrize("mode", MODES)
def test_greedy_equals_hf_chunked_cached_and_alone(case, mode):
    """Chunked prefills beside decodes, the same prompts again from the prefix cache, and each alone."""
    path, prompts, expected = case
    with LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=7, kv_cache_gb=KV_GB,
             async_scheduling=MODES[mode]) as llm:
        assert llm.engine.pipeline.one_ahead is MODES[mode]
        assert tokens(llm.generate(prompts, GREEDY)) == expected
        again = llm.generate(prompts, GREEDY)
        assert tokens(again) == expected and sum(o.num_cached_tokens for o in again) > 0
        assert [tokens(llm.generate([p], GREEDY))[0] for p in prompts[:3]] == expected[:3]
        check_clean(llm)


@pytest.mark.parametrize("mode", MODES)
def test_greedy_equals_hf_under_preemption_and_host_tier_hits(case, mode):
    """Preempted sequences recomputed, their pending token dropped with them; the second round's prefixes
    come back from the host tier."""
    path, prompts, expected = case
    with LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=30, host_cache_gb=0.01,
             async_scheduling=MODES[mode]) as llm:
        assert tokens(llm.generate(prompts, GREEDY)) == expected
        assert llm.engine.scheduler.num_preemptions > 0
        again = llm.generate(prompts, GREEDY)
        assert tokens(again) == expected
        assert sum(r.hit_tokens for r in llm.engine.kv.reports() if r.tier == "host") > 0
        check_clean(llm)


def test_stops_limits_forks_logprobs_and_grammars_are_the_same_both_ways(case):
    """max_tokens of 1 (finished by the prefill's own sample), stop tokens, stop strings, n > 1 with a
    seed, logprobs, a grammar: every choice the same one step ahead as serially."""
    path, prompts, expected = case
    stop_tok = expected[1][4]
    params = [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_tok]),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["e"]),
              SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=9, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0.8, seed=5, max_tokens=20,
                             structured=StructuredSpec("regex", r"[a-z]{2,6} \d{1,3}"))]
    seen, values = {}, {}
    for mode, ahead in MODES.items():
        with LLM(str(path), dtype="float32", block_size=4, kv_cache_gb=KV_GB, async_scheduling=ahead) as llm:
            outs = llm.generate(prompts, params)
            seen[mode], values[mode] = summary(outs), logprob_values(outs)
            check_clean(llm)
    assert seen["ahead"] == seen["serial"]
    assert values["ahead"] == pytest.approx(values["serial"], abs=1e-4) and len(values["ahead"]) > 0
    first, stopped = seen["ahead"][0], seen["ahead"][1]
    assert first[0] == expected[0][:1] and first[2] == "length"
    assert stopped[0] == expected[1][:expected[1].index(stop_tok) + 1] and stopped[2] == "stop"
    assert len(seen["ahead"]) == 8  # n=3 gave three choices


def test_a_request_stopping_at_step_n_never_emits_the_token_computed_for_it_at_n_plus_1(case):
    """One step ahead, the sequence is already in step N+1 when step N's stop token is sampled: that row is
    computed (recorded below) and dropped; the client's last token is the stop token, and nothing more
    reaches it, in the outputs nor in the counters."""
    path, prompts, expected = case
    stop_tok = expected[0][5]
    stop_at = expected[0].index(stop_tok)
    with LLM(str(path), dtype="float32", kv_cache_gb=KV_GB, async_scheduling=True) as llm:
        pipeline, sampled = llm.engine.pipeline, []
        launch = pipeline.launch

        def recording(scheduled, prev):
            launched = launch(scheduled, prev)
            sampled.append([s.seq_id for s in launched.samplers])
            return launched
        pipeline.launch = recording
        eng = llm.engine
        eng.add_request("stops", prompts[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                             stop_token_ids=[stop_tok]))
        eng.add_request("runs", prompts[2], GREEDY)
        seq_id = eng.requests["stops"].seqs[0].seq_id
        streamed: list[int] = []
        finals = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.request_id == "stops":
                    assert "stops" not in finals, "an output after the final one"
                    streamed = out.outputs[0].token_ids
                if out.finished:
                    finals[out.request_id] = out
        eng.drain()
        assert streamed == expected[0][:stop_at + 1] and finals["stops"].outputs[0].finish_reason == "stop"
        assert finals["runs"].outputs[0].token_ids == expected[2]
        # sampled once in its prefill and at each decode: the last time for the token after the stop
        assert sum(seq_id in ids for ids in sampled) == stop_at + 2
        assert eng.stats.generation_tokens == stop_at + 1 + len(expected[2])
        check_clean(llm)


@pytest.mark.parametrize("mode", MODES)
def test_abort_mid_stream_leaves_the_others_exact_and_nothing_held(case, mode):
    path, prompts, expected = case
    with LLM(str(path), dtype="float32", block_size=4, kv_cache_gb=KV_GB,
             async_scheduling=MODES[mode]) as llm:
        eng = llm.engine
        for i, p in enumerate(prompts[:4]):
            eng.add_request(str(i), p, GREEDY)
        finals, after_abort = {}, []
        for step in range(200):
            if not eng.has_unfinished():
                break
            if step == 4:  # request 1 is decoding, one of its steps in flight
                final = eng.abort("1")
                assert final.finished and final.outputs[0].finish_reason == "abort"
                assert 0 < len(final.outputs[0].token_ids) < GREEDY.max_tokens
                assert final.outputs[0].token_ids == expected[1][:len(final.outputs[0].token_ids)]
            for out in eng.step():
                if step >= 4 and out.request_id == "1":
                    after_abort.append(out)
                if out.finished:
                    finals[out.request_id] = out
        eng.drain()
        assert after_abort == []  # the abort's own output was the last
        assert [finals[str(i)].outputs[0].token_ids for i in (0, 2, 3)] == [expected[i] for i in (0, 2, 3)]
        check_clean(llm)


def test_async_scheduling_switch(monkeypatch):
    """On with CUDA, off on CPU; $NANOSERVE_ASYNC_SCHEDULING sets the default, the flag wins over both."""
    import torch

    from nanoserve.config import EngineConfig
    from nanoserve.server.cli import build_parser
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("NANOSERVE_ASYNC_SCHEDULING", raising=False)
    assert [EngineConfig().resolved_async_scheduling(d) for d in (cpu, cuda)] == [False, True]
    monkeypatch.setenv("NANOSERVE_ASYNC_SCHEDULING", "1")
    assert EngineConfig().resolved_async_scheduling(cpu) is True
    assert EngineConfig(async_scheduling=False).resolved_async_scheduling(cpu) is False
    monkeypatch.setenv("NANOSERVE_ASYNC_SCHEDULING", "0")
    assert EngineConfig().resolved_async_scheduling(cuda) is False
    assert EngineConfig(async_scheduling=True).resolved_async_scheduling(cuda) is True
    monkeypatch.setenv("NANOSERVE_ASYNC_SCHEDULING", "yes")
    with pytest.raises(ValueError, match="NANOSERVE_ASYNC_SCHEDULING"):
        EngineConfig().resolved_async_scheduling(cpu)
    flags = {a: vars(build_parser().parse_args(a.split()))["async_scheduling"] for a in
             ("", "--async-scheduling", "--no-async-scheduling")}
    assert flags == {"": None, "--async-scheduling": True, "--no-async-scheduling": False}


def test_a_failure_completing_step_n_leaves_step_n_plus_1_in_flight(case):
    """Completing N raises for one request (its token refused) after N+1 was launched: that request
    fails, and a request whose prefill is only in N+1 still gets HF's tokens; nothing is held after."""
    from nanoserve.engine.protocol import StepFailed
    path, prompts, expected = case
    with LLM(str(path), dtype="float32", kv_cache_gb=KV_GB, async_scheduling=True) as llm:
        eng = llm.engine
        eng.add_request("a", prompts[0], GREEDY)
        while len(eng.requests["a"].seqs[0].output_token_ids) < 3:
            eng.step()
        eng.add_request("b", prompts[1], GREEDY)  # its prefill goes into the step launched next
        append = eng.table.append

        def refusing(seq, tok, lp, now):
            if seq.request_id == "a":
                raise RuntimeError("refused")
            return append(seq, tok, lp, now)
        eng.table.append = refusing
        with pytest.raises(StepFailed) as failed:
            eng.step()
        eng.table.append = append
        assert failed.value.request_ids == {"a"} and eng.inflight is not None
        eng.abort("a")  # what the engine core does with the requests a failure names
        final = None
        while eng.has_unfinished():
            for out in eng.step():
                final = out if out.finished else final
        eng.drain()
        assert final.request_id == "b" and final.outputs[0].token_ids == expected[1]
        check_clean(llm)


def test_a_launch_failure_carries_the_final_output_of_a_request_step_n_finished(case):
    """One step ahead, a request whose stop token step N samples is already in N+1; N+1's launch fails: the
    error names it (its row was in N+1) and carries its final output from N, which the engine core emits
    instead of failing it (engine/core.py)."""
    from nanoserve.engine.protocol import StepFailed
    path, prompts, expected = case
    stop_tok = expected[0][4]
    stop_at = expected[0].index(stop_tok)
    with LLM(str(path), dtype="float32", kv_cache_gb=KV_GB, async_scheduling=True) as llm:
        eng = llm.engine
        eng.add_request("r", prompts[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                         stop_token_ids=[stop_tok]))
        seq, plan = eng.requests["r"].seqs[0], eng.runner.plan

        def failing(scheduled, *args):
            if seq.num_output_tokens == stop_at and seq.num_pending == 1:  # the stop token is being sampled
                raise RuntimeError("launch failed")
            return plan(scheduled, *args)
        eng.runner.plan = failing
        with pytest.raises(StepFailed) as failed:
            while eng.has_unfinished():
                eng.step()
        assert failed.value.request_ids == {"r"}
        (out,) = failed.value.outputs
        assert out.finished and out.outputs[0].token_ids == expected[0][:stop_at + 1]
        assert out.outputs[0].finish_reason == "stop" and not eng.has_unfinished()
        check_clean(llm)
