"""Tensor parallelism on CPU (gloo and shared-memory collectives), with real worker processes: greedy tokens
equal one rank's and HF transformers' in fp32 (the embedded model on 3 ranks: 9 heads, 3 KV heads; tiny random
Llamas on 2, one with its single KV head replicated), the host tier round-trips under it, a server with
`-tp 3` answers an OpenAI client, two "nodes" on this machine serve like one rank, and a killed worker fails
the request in flight and makes the server exit non-zero."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from hypothesis import given, strategies as st

from conftest import hf_greedy, random_prompts
from nanoserve.distributed.parallel import TensorParallel, shard_heads, vocab_rows
from nanoserve.distributed.shm import ShmChannel, ShmCollectives
from nanoserve.parallel.messages import decode
from nanoserve.parallel.leader import CopyCommand, Followers, ParallelCopier
from nanoserve.kvcache.host_tier import HostTier
from nanoserve.kvcache.transfer import ThreadCopier
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams
from server_fixture import ServerProcess, child_pids, free_port, m, wait_gone

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


# ---- how the model splits ---------------------------------------------------------------------------
@given(st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]))
def test_every_rank_holds_the_kv_heads_its_q_heads_read(group, kv, size):
    heads = group * kv
    if heads % size:
        return
    shards = [shard_heads(heads, kv, size, r) for r in range(size)]
    assert sorted(q for s in shards for q in range(s.q_start, s.q_start + s.num_heads)) == list(range(heads))
    for s in shards:
        held = range(s.kv_start, s.kv_start + s.num_kv_heads)
        assert all(q // group in held for q in range(s.q_start, s.q_start + s.num_heads))
    if kv >= size:  # divided: each KV head on exactly one rank
        assert sorted(k for s in shards for k in range(s.kv_start, s.kv_start + s.num_kv_heads)) == \
            list(range(kv))
    else:  # replicated: one head per rank, each on size // kv ranks
        assert all(s.num_kv_heads == 1 for s in shards)
        assert sorted(s.kv_start for s in shards) == sorted(k for k in range(kv) for _ in range(size // kv))


def test_splits_the_model_cannot_take_are_refused_with_the_reason():
    with pytest.raises(ValueError,
                       match="does not divide the model's 9 attention heads; sizes that do: \\[1, 3, 9\\]"):
        shard_heads(9, 3, 2, 0)
    with pytest.raises(ValueError, match="exceeds the model's 3 KV heads"):
        shard_heads(12, 3, 4, 0)
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        LLM(dtype="float32", tensor_parallel_size=2)  # the embedded model: 9 heads


def test_vocab_rows_cover_the_vocabulary_once():
    for vocab, size in [(49152, 3), (50257, 2), (10, 4)]:
        parts = [vocab_rows(vocab, size, r) for r in range(size)]
        assert [i for lo, hi, _ in parts for i in range(lo, hi)] == list(range(vocab))
        assert {per for _, _, per in parts} == {-(-vocab // size)}


def _ranks_in_threads(tmp_path, size: int, slot_bytes: int, fn, timeout_s: float = 30.0) -> list:
    path = tmp_path / "seg"
    shms = [ShmCollectives(path, 0, size, slot_bytes, timeout_s, create=True)]
    shms += [ShmCollectives(path, r, size, slot_bytes, timeout_s, create=False) for r in range(1, size)]
    with ThreadPoolExecutor(size) as ex:
        return list(ex.map(fn, shms))


def test_shared_memory_all_reduce_and_gather_over_many_operations(tmp_path):
    """Three ranks (threads over one segment), 50 operations of varying shapes through the two
    alternating slot sets: every rank gets the same sum, bit for bit; rank 0 gets every shard."""
    def rank(shm: ShmCollectives):
        sums, gathered = [], []
        for i in range(50):
            g = torch.Generator().manual_seed(1000 * shm.rank + i)
            t = torch.randn(1 + i % 7, 5, generator=g)
            sums.append(shm.all_reduce(t.clone()))
            parts = shm.gather(t)
            gathered.append(None if parts is None else [p.clone() for p in parts])
        return sums, gathered
    out = _ranks_in_threads(tmp_path, 3, 4096, rank)
    for i in range(50):
        parts = [torch.randn(1 + i % 7, 5, generator=torch.Generator().manual_seed(1000 * r + i))
                 for r in range(3)]
        assert all(torch.equal(o[0][i], out[0][0][i]) for o in out)
        assert torch.allclose(out[0][0][i], parts[0] + parts[1] + parts[2])
        assert all(torch.equal(a, b) for a, b in zip(out[0][1][i], parts)) and out[1][1][i] is None


def test_shared_memory_wait_fails_on_abort_and_on_timeout(tmp_path):
    path = tmp_path / "seg"
    alone = ShmCollectives(path, 0, 2, 64, timeout_s=0.3, create=True)
    with pytest.raises(RuntimeError, match="did not reach the collective within 0.3s"):
        alone.all_reduce(torch.ones(4))
    other = ShmCollectives(path, 1, 2, 64, timeout_s=30, create=False)
    other.abort()
    with pytest.raises(RuntimeError, match="abort flag"):
        other.all_reduce(torch.ones(4))
    assert not alone.fits(torch.ones(17))  # 68 bytes: through gloo instead


def test_shared_memory_channel_delivers_every_message_in_order(tmp_path):
    """Rank 0 sends 40 messages (every 10th larger than a frame: through the fallback) to two
    readers in threads, which read at their own pace: each gets all of them, in order; a frame is
    reused only after both have read it. An abort fails a waiting reader."""
    import queue

    class Fallback:  # stands in for the gloo broadcast: one queue per reader
        def __init__(self):
            self.queues = [queue.Queue() for _ in range(2)]

        def send(self, msg):
            for q in self.queues:
                q.put(msg)

    fb = Fallback()
    path = tmp_path / "msgs"
    sender = ShmChannel(path, 0, 3, 256, 30.0, True, fb)
    readers = [ShmChannel(path, r, 3, 256, 30.0, False, type("R", (), {"recv": fb.queues[r - 1].get})())
               for r in (1, 2)]
    msgs = [b"%d:" % i + b"x" * (400 if i % 10 == 9 else i) for i in range(40)]

    def read(ch):
        out = []
        for _ in msgs:
            out.append(ch.recv())
            time.sleep(0.001 * ch.rank)  # the readers drift apart; the sender must wait for the slower
        return out
    with ThreadPoolExecutor(3) as ex:
        got = [ex.submit(read, ch) for ch in readers]
        for msg in msgs:
            sender.send(msg)
        assert [g.result(60) for g in got] == [msgs, msgs]
    readers[0].abort()
    with pytest.raises(RuntimeError, match="abort flag"):
        readers[1].recv()


# ---- same tokens --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,collectives,ahead", [("llama-gqa-tied", "shm", False),
                                                    ("llama-gqa-tied", "gloo", True),
                                                    ("llama3-rope-scaling", "shm", False),
                                                    ("qwen2-bias", "shm", True)])
def test_two_ranks_match_one_rank_and_hf(name, collectives, ahead, tiny_path, monkeypatch):
    """gqa-tied: 2 KV heads, one per rank; rope-scaling: 1 KV head, replicated; qwen2: QKV bias,
    untied LM head. Collectives through shared memory (one CPU node), and through gloo. Half the cases
    schedule one step ahead (the followers receive each plan with its placeholders resolved)."""
    if collectives == "gloo":  # rank 0 sizes the shared-memory slots; 0 = none
        monkeypatch.setattr("nanoserve.parallel.ranks.shm_slot_bytes", lambda *a: 0)
    path = tiny_path(name)
    prompts = random_prompts(4, 3, 60, seed=7)
    kw = dict(dtype="float32", block_size=16, num_kv_blocks=64)
    with LLM(str(path), **kw) as one:
        single = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
    with LLM(str(path), tensor_parallel_size=2, async_scheduling=ahead, **kw) as two:
        assert two.engine.pipeline.one_ahead is ahead
        parallel = [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY)]
        assert two.engine.model.num_heads == 2 and two.engine.model.embed.shape[0] == 49152 // 2
        room = os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 256 << 20  # else gloo
        assert (two.engine.ranks.tp.shm is not None) == (collectives == "shm" and room)
    assert parallel == single == hf_greedy(path, prompts, GREEDY.max_tokens)


def test_embedded_model_on_three_ranks_matches_one_rank_and_hf(embedded_dir):
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)  # the prefill and 4 decode steps
    with LLM(dtype="float32", tensor_parallel_size=3, num_kv_blocks=32) as llm:
        tok = llm.tokenizer
        prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):")]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        assert llm.engine.model.num_heads == 3 and llm.engine.model.num_kv_heads == 1
    with LLM(dtype="float32", num_kv_blocks=32) as one:
        single = [o.outputs[0].token_ids for o in one.generate(prompts, greedy)]
    assert got == single == hf_greedy(embedded_dir, prompts, greedy.max_tokens)


# ---- the host tier -------------------------------------------------------------------------------------
def test_host_tier_round_trips_on_two_ranks(tiny_path):
    """Device holds ~2 of 5 documents; later rounds load them from every rank's host slice."""
    path = tiny_path("llama-gqa-tied")
    docs = random_prompts(5, 40, 40, vocab=5000, seed=3)
    prompts = [d + q for d, q in zip(docs, random_prompts(5, 3, 3, vocab=5000, seed=4))]
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    with LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=24, max_num_seqs=2, host_cache_gb=0.01,
             tensor_parallel_size=2) as llm:
        eng = llm.engine
        for round_ in range(3):
            outs = [llm.generate([p], GREEDY)[0] for p in prompts]
            assert [o.outputs[0].token_ids for o in outs] == expected, f"round {round_}"
            eng.check_invariants()
        assert sum(o.num_host_cached_tokens for o in outs) >= 4 * 40
        assert all(o.num_cached_tokens == o.num_device_cached_tokens + o.num_host_cached_tokens for o in outs)
        device, host = eng.kv.reports()
        assert host.bytes_out > 0 and host.bytes_in > 0 and host.blocks_in_use == 0
        assert eng.kv.host.num_bytes <= 0.01 * (1 << 30) / 2  # rank 0's slice of the budget


class _Peers(TensorParallel):
    """The other ranks' copy reports, as rank 0 receives them (reduce_flags: MAX over ranks)."""
    def __init__(self, failed: bool) -> None:
        super().__init__(0, 2)
        self.failed = failed

    def reduce_flags(self, values, op=None):
        return [int(self.failed)] * len(values)


class _Channel:
    """What the workers would receive: each message's bytes, decoded as they decode them."""
    def __init__(self) -> None:
        self.sent = []

    def send(self, data: bytes) -> None:
        self.sent.append(decode(data))


@pytest.mark.parametrize("peer_failed", [False, True])
def test_a_save_is_published_only_when_every_rank_reports_it(peer_failed):
    channel = _Channel()
    followers = Followers(channel, _Peers(peer_failed))
    device = torch.randn(4, 2, 2, 4, 1, 8)
    tier = HostTier(4, device, ParallelCopier(ThreadCopier(), followers))
    copy = tier.begin_save([2], [(b"h" * 32, (1, 2, 3))])
    assert copy.handle.wait(30)  # its own copy done, and the pending command flushed to the workers
    assert isinstance(channel.sent[-1].copies[0], CopyCommand) and channel.sent[-1].plan is None
    assert channel.sent[-1].copies[0].src_ids == [2]
    assert tier.end_save(copy) is not peer_failed
    assert (tier.lookup(b"h" * 32, (1, 2, 3)) is None) is peer_failed
    assert tier.transfers.failed == int(peer_failed)


# ---- the server ----------------------------------------------------------------------------------------
# The server tests run on a tiny Llama: the embedded model's 3-rank split is checked in-process above;
# here the point is the server around the ranks. Every answer is compared with one rank's.
TINY = "llama-gqa-tied"


@pytest.fixture(scope="module")
def one_rank(tiny_path):
    with LLM(str(tiny_path(TINY)), dtype="float32", num_kv_blocks=256) as llm:
        yield llm


@pytest.fixture(scope="module")
def tp_server(tiny_path):
    """Its device cache holds about two of the concurrent test's eight documents; a host tier behind."""
    path = tiny_path(TINY)
    srv = ServerProcess("--model", str(path), "--served-model-name", TINY, "--dtype", "float32", "-tp", "2",
                        "--block-size", "4", "--num-kv-blocks", "40", "--host-cache-gb", "0.01",
                        "--max-num-seqs", "8")
    yield srv
    srv.stop()


def test_openai_request_through_two_ranks(tp_server, one_rank):
    out = tp_server.client().chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, temperature=0)
    assert out.choices[0].message.content and out.usage.completion_tokens > 0
    ref = tp_server.client().completions.create(model=TINY, prompt="The capital of France is", max_tokens=6,
                                                temperature=0)
    assert ref.choices[0].text == one_rank.generate(
        ["The capital of France is"], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text


def test_concurrent_requests_with_host_tier_on_two_ranks_match_one_rank(tp_server, one_rank):
    """32 streamed requests at once over 8 shared documents through `-tp 2` with a device cache that
    holds about two of them and a host tier: loads, saves and their acks under load; every answer
    equals one rank's, and nothing is left held."""
    import asyncio
    docs = random_prompts(8, 48, 48, vocab=5000, seed=11)
    prompts = [docs[i % 8] + q for i, q in enumerate(random_prompts(32, 2, 6, vocab=5000, seed=12))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].text for o in one_rank.generate(prompts, params)]
    hits0 = m(tp_server.metrics(), "nanoserve:prefix_cache_hits_total", tier="host")

    async def ask(client, p):
        chunks = await client.completions.create(model=TINY, prompt=p, max_tokens=6, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    async def main():
        client = tp_server.async_client()
        return await asyncio.gather(*(ask(client, p) for p in prompts))
    try:
        got = asyncio.run(main())
        snap = tp_server.metrics()
    finally:
        assert tp_server.terminate() == 0  # runs last on this server: saves and loads in flight end cleanly
    assert got == expected
    assert m(snap, "nanoserve:prefix_cache_hits_total", tier="host") > hits0


def test_killed_worker_fails_the_request_and_the_server_exits_non_zero(tiny_path):
    srv = ServerProcess("--model", str(tiny_path(TINY)), "--served-model-name", TINY,
                        "--dtype", "float32", "-tp", "2")
    try:
        [core] = srv.children
        [worker] = child_pids(core)
        # about the longest request the context allows (512): the kill lands hundreds of steps before its end
        max_len = httpx.get(srv.base_url + "/models").json()["data"][0]["max_model_len"]
        stream = srv.client().completions.create(model=TINY, prompt="Once upon a time",
                                                 max_tokens=max_len - 16, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))  # the request is running
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="tensor-parallel"):
            for _ in stream:
                pass
        t0 = time.monotonic()
        code = srv.proc.wait(30)
        assert code != 0 and time.monotonic() - t0 < 30
        assert not wait_gone([core, worker], 15), "a rank outlived the server"
    finally:
        if srv.proc.poll() is None:
            srv.stop()


def test_two_nodes_on_one_machine_serve_like_one_rank(tiny_path, one_rank):
    """--nnodes 2: node 1 runs only its worker, node 0 the API and rank 0; they meet at
    --master-addr/--master-port (gloo collectives: shared memory is for one node)."""
    path = tiny_path(TINY)
    port = str(free_port())
    dist = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    node1 = subprocess.Popen([sys.executable, "-m", "nanoserve.server.cli", *dist, "--node-rank", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    srv = ServerProcess("--model", str(path), "--dtype", "float32", *dist, "--node-rank", "0")
    try:
        got = srv.client().completions.create(model=str(path), prompt="Hello there", max_tokens=8,
                                              temperature=0)
    finally:
        assert srv.terminate() == 0
    assert node1.wait(30) == 0, node1.stderr.read()
    [ref] = one_rank.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=8))
    assert got.choices[0].text == ref.outputs[0].text
