"""Two-tier prefix cache: exact copies, identical outputs whatever tier a prefix came from,
per-tier accounting, host LRU, in-flight pinning, and one shared copy-in for concurrent hits."""
from __future__ import annotations

import random
import re
import threading

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.kvcache.host_tier import HostTier
from nanoserve.kvcache.transfer import ThreadCopier
from tests.conftest import KV_GB, hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_round_trip_is_exact_for_every_element():
    device = torch.randn(6, 3, 2, 2, 4, 8)  # [blocks, layers, K/V, heads, block_size, dim]
    tier = HostTier(4, device)
    original = device.clone()
    assert tier.save([(1, 11, (1,)), (4, 44, (4,))]) == 2
    h1, h4 = tier.lookup(11, (1,)), tier.lookup(44, (4,))
    assert torch.equal(tier.cache[h1], original[1]) and torch.equal(tier.cache[h4], original[4])
    device[0].zero_()
    device[5].zero_()
    tier.load([h1, h4], [0, 5])
    assert torch.equal(device[0], original[1]) and torch.equal(device[5], original[4])
    assert torch.equal(device[1:5], original[1:5])  # nothing else touched
    assert tier.transfers.blocks_in == 2 and tier.transfers.blocks_out == 2
    assert tier.transfers.bytes_in == 2 * original[0].numel() * 4


def test_host_lru_evicts_least_recently_used():
    device = torch.randn(4, 1, 2, 1, 2, 2)
    tier = HostTier(2, device)
    tier.save([(0, 100, (0,)), (1, 101, (1,))])
    tier.load([tier.lookup(100, (0,))], [3])  # touch block 100: 101 is now the oldest
    tier.save([(2, 102, (2,))])
    assert tier.lookup(101, (1,)) is None
    assert tier.lookup(100, (0,)) is not None and tier.lookup(102, (2,)) is not None
    assert tier.pool.num_evictions == 1


class GatedCopy:
    """A block copy that runs only once the test opens the gate (loads only, unless `all`): a copy
    slowed for as long as the test wants, with no sleeps and no timing assumptions."""

    def __init__(self, device_cache: torch.Tensor, all_copies: bool = False) -> None:
        self.device_ptr = device_cache.untyped_storage().data_ptr()
        self.all_copies = all_copies
        self.gate = threading.Event()
        self.started = threading.Event()
        self.fail: type[BaseException] | None = None

    def __call__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if self.all_copies or dst.untyped_storage().data_ptr() == self.device_ptr:
            self.started.set()
            assert self.gate.wait(60), "gate never opened"
            if self.fail is not None:
                raise self.fail("injected copy failure")
        dst.copy_(src)


def test_host_block_not_handed_out_while_copy_in_flight():
    device = torch.randn(8, 1, 2, 1, 2, 2)
    gated = GatedCopy(device)
    tier = HostTier(3, device, ThreadCopier(gated))
    tier.save([(0, 1, (1,)), (1, 2, (2,)), (2, 3, (3,))])  # host full of cached blocks
    src = [tier.lookup(1, (1,)), tier.lookup(2, (2,))]
    copy = tier.begin_load(src, [5, 6])
    assert gated.started.wait(60) and not copy.handle.done()
    handed_out: list[int] = []
    while tier.pool.num_available():  # mid-copy, someone needs host blocks
        handed_out.append(tier.pool.allocate())
    assert handed_out and not set(handed_out) & set(src)  # only the block not being copied
    assert tier.pool.stats().in_flight == 2
    gated.gate.set()
    assert copy.handle.wait(60) and tier.end_load(copy)
    assert torch.equal(device[5], device[0]) and torch.equal(device[6], device[1])
    tier.pool.check_invariants()
    assert tier.pool.stats().in_flight == 0


@pytest.fixture(scope="module")
def tiny_setup(tiny_model):
    """Device: 24 blocks of 4 tokens, host: plenty. Documents of 40 tokens: two fit on device."""
    rng = random.Random(3)
    docs = [[rng.randrange(100, 5000) for _ in range(40)] for _ in range(5)]
    prompts = [d + [rng.randrange(100, 5000) for _ in range(3)] for d in docs]
    expected = hf_greedy(tiny_model, prompts, GREEDY.max_tokens)
    return tiny_model, prompts, expected


def make_llm(path, **kw):
    return LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=24, max_num_seqs=2, **kw)


def test_outputs_identical_from_device_host_and_recompute(tiny_setup):
    path, prompts, expected = tiny_setup
    llm = make_llm(path, host_cache_gb=0.01)
    eng = llm.engine
    for round_ in range(3):
        outs = [llm.generate([p], GREEDY)[0] for p in prompts]  # one at a time: LRU order is known
        assert [o.outputs[0].token_ids for o in outs] == expected, f"round {round_}"
        eng.check_invariants()
    # later rounds found the documents on host (device holds only ~2 of 5)
    assert sum(o.num_host_cached_tokens for o in outs) >= 4 * 40
    for o in outs:
        assert o.num_cached_tokens == o.num_device_cached_tokens + o.num_host_cached_tokens
    device, host = eng.kv.reports()
    assert host.hit_tokens > 0 and host.bytes_out > 0 and host.bytes_in > 0
    assert eng.kv.pool.stats().in_use == 0 and host.blocks_in_use == 0
    assert eng.kv.host.num_bytes <= 0.01 * (1 << 30)
    # device only: the same workload finds (almost) nothing after the first round
    dev_only = make_llm(path)
    for _ in range(2):
        outs = [dev_only.generate([p], GREEDY)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.num_cached_tokens for o in outs) < sum(len(p) for p in prompts) // 4


def test_accounting_with_preemption_and_aborts(tiny_setup):
    path, prompts, _ = tiny_setup
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=20, host_cache_gb=0.0005,
              max_num_batched_tokens=16)
    eng = llm.engine
    rng = random.Random(1)
    for i in range(40):
        if i < 30:
            eng.add_request(f"r{i}", rng.choice(prompts)[:rng.randint(5, 43)],
                            SamplingParams(temperature=0, max_tokens=rng.randint(1, 20), ignore_eos=True))
        if i % 7 == 3:
            eng.abort(f"r{i - 2}")
        eng.step()
        eng.check_invariants()
    while eng.has_unfinished():
        eng.step()
        eng.check_invariants()
    device, host = eng.kv.reports()
    assert eng.scheduler.num_preemptions > 0 and host.hit_tokens > 0
    assert device.blocks_in_use == 0 and host.blocks_in_use == 0
    assert host.blocks_total * eng.layout.bytes_per_block <= 0.0005 * (1 << 30)


def test_concurrent_requests_share_one_copy_in(tiny_setup):
    path, prompts, expected = tiny_setup
    llm = make_llm(path, host_cache_gb=0.01, max_num_batched_tokens=256)
    llm.engine.scheduler.max_num_seqs = 8
    eng = llm.engine
    llm.generate([prompts[0]], GREEDY)
    for p in prompts[1:4]:  # push document 0 off the device
        llm.generate([p], GREEDY)
    assert eng.kv.match_prefix(eng.make_request("probe", prompts[0], GREEDY).seqs[0])[0][0] == "host"
    before = eng.kv.host.transfers.blocks_out
    outs = llm.generate([prompts[0]] * 6, GREEDY)
    assert all(o.outputs[0].token_ids == expected[0] for o in outs)
    assert eng.kv.host.transfers.blocks_out - before == 40 // 4  # the document's blocks, once
    assert sum(o.num_host_cached_tokens for o in outs) == 40
    eng.check_invariants()


def test_embedded_model_identical_from_host(embedded_dir):
    llm = LLM(dtype="float32", num_kv_blocks=14, host_cache_gb=0.05, max_num_seqs=1)  # 224 device tokens
    tok = llm.tokenizer
    doc = tok.encode("The history of the city goes back many centuries. " * 8)
    q = [doc + tok.encode(f" Question {i}: what happened next?") for i in range(2)]
    filler = [tok.encode(f"Unrelated text number {i} about gardening and the weather. " * 8)
              for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([q[0]], params)[0]
    for f in filler:
        llm.generate([f], params)
    again = llm.generate([q[1]], params)[0]
    assert again.num_host_cached_tokens > 0
    fresh = LLM(dtype="float32", enable_prefix_caching=False, kv_cache_gb=KV_GB)
    assert again.outputs[0].token_ids == fresh.generate([q[1]], params)[0].outputs[0].token_ids
    assert first.outputs[0].token_ids == fresh.generate([q[0]], params)[0].outputs[0].token_ids


from hypothesis import given, settings, strategies as st  # noqa: E402

from nanoserve.kvcache.manager import KVCacheManager, LoadState  # noqa: E402
from nanoserve.sequence import Sequence  # noqa: E402


def _pattern(tokens: tuple[int, ...]) -> float:
    return float(hash(tokens) % 100003)


@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), min_size=1, max_size=25),
       st.integers(2, 12))
@settings(max_examples=80, deadline=None)
def test_manager_with_host_tier_keeps_kv_content_and_accounting(prompts, host_blocks):
    """Random prompts over a tiny alphabet (many shared prefixes) through a 6-block device tier and a
    2..12-block host tier (both tiers evict). Each computed block is filled with a value derived from its
    tokens; whatever tier a cached block comes from, its device content must be that value."""
    bs = 2
    device = torch.zeros(6, 1, 2, 1, bs, 1)
    kv = KVCacheManager(6, bs, host=HostTier(host_blocks, device), offload_watermark=6)  # >= one admission
    for i, prompt in enumerate(prompts):
        kv.offload_cold_blocks()
        seq = Sequence(i, str(i), 0, prompt, SamplingParams(), 4, frozenset())
        for _ in range(10):  # deferred while saves make room without loss: never for long
            if kv.admit(seq, len(prompt)):
                break
            kv.wait_for_transfer()
        else:
            raise AssertionError("admission deferred forever")
        while kv.load_state(seq) is LoadState.LOADING:  # host hits are readable once copied
            kv.wait_for_transfer()
        for j in range(seq.num_computed_tokens // bs):  # reused blocks hold this prefix's KV
            assert device[seq.block_table[j]].eq(_pattern(tuple(prompt[j * bs:(j + 1) * bs]))).all()
        for j in range(seq.num_computed_tokens // bs, len(prompt) // bs):  # "compute" the rest
            device[seq.block_table[j]] = _pattern(tuple(prompt[j * bs:(j + 1) * bs]))
        seq.num_computed_tokens = len(prompt)
        kv.publish_computed(seq)
        assert seq.num_cached_tokens == seq.num_device_cached_tokens + seq.num_host_cached_tokens
        kv.free(seq)
        kv.check_invariants()
    device_report, host_report = kv.reports()
    assert device_report.blocks_in_use == 0 and host_report.blocks_in_use == 0
    assert host_report.hit_tokens <= host_report.query_tokens
    assert kv.policy.num_lossy_with_room == 0  # uncopied KV dropped only when the host had no room


def test_manager_property_setup_reaches_the_host_tier():
    """The property test above is only worth something if its setup produces host hits."""
    bs = 2
    device = torch.zeros(6, 1, 2, 1, bs, 1)
    kv = KVCacheManager(6, bs, host=HostTier(12, device), offload_watermark=6)
    got = []
    for i, prompt in enumerate([[0, 0, 0, 0, 1], [1] * 11, [0, 0, 0, 0, 2]]):
        kv.offload_cold_blocks()
        kv.drain_transfers()  # saves publish on host only once complete
        seq = Sequence(i, str(i), 0, prompt, SamplingParams(), 4, frozenset())
        assert kv.admit(seq, len(prompt))
        kv.drain_transfers()
        got.append(seq.num_host_cached_tokens)
        seq.num_computed_tokens = len(prompt)
        kv.publish_computed(seq)
        kv.free(seq)
    assert got == [0, 0, 4]


class ModelLookedFor(Exception):
    pass


def test_budgets_beyond_available_memory_are_refused_before_the_model_is_looked_for(tiny_model, monkeypatch):
    """On CPU the device KV cache and the host tier are both host memory: together they must fit what is
    available, checked before the model is looked for (a download, a read, a dequantization)."""
    from nanoserve.engine import llm_engine
    from nanoserve.parallel import shard

    def look_for(*_):
        raise ModelLookedFor
    monkeypatch.setattr(llm_engine, "resolve_model", look_for)
    monkeypatch.setattr(shard, "host_memory_available", lambda: 2 << 30)
    refused = {"--host-cache-gb 3 asks for 3.0 GiB": dict(host_cache_gb=3),
               "--kv-cache-gb 2.5 asks for 2.5 GiB": dict(kv_cache_gb=2.5),
               "--kv-cache-gb 1.5 + --host-cache-gb 1 ask for 2.5 GiB": dict(kv_cache_gb=1.5,
                                                                              host_cache_gb=1)}
    for said, budgets in refused.items():
        with pytest.raises(ValueError, match=f"^{re.escape(said)} of host memory, more than this machine has "
                                             r"available \(2\.0 GiB\)$"):
            LLM(str(tiny_model), device="cpu", **budgets)
    with pytest.raises(ModelLookedFor):  # what fits goes on to the model
        LLM(str(tiny_model), device="cpu", kv_cache_gb=1.5, host_cache_gb=0.5)
    with pytest.raises(ValueError, match="needs prefix caching"):
        LLM(str(tiny_model), dtype="float32", host_cache_gb=0.01, enable_prefix_caching=False,
            kv_cache_gb=KV_GB)
