"""Prometheus metrics, all under the `nanoserve:` prefix.

Gauges and counters are read from an engine snapshot taken by the engine loop at scrape time
(so they are consistent with each other); latency histograms are observed by the engine client as outputs
reach the API side (step durations travel from the engine core with its outputs)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanoserve.engine.protocol import EngineSnapshot, MetricsObserver

P = "nanoserve:"

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 10.0, 20.0)
# fine geometric buckets (x1.25 from 0.5 ms to ~40 s), fine enough to read step-time medians from
STEP_BUCKETS = tuple(round(0.0005 * 1.25 ** i, 6) for i in range(51))
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0)


class _SnapshotCollector:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot = EngineSnapshot()

    def collect(self):
        s, m = self.snapshot, self.model_name
        g = GaugeMetricFamily(P + "num_requests_running", "Requests with a sequence in the running batch.",
                              labels=["model_name"])
        g.add_metric([m], s.num_running)
        yield g
        g = GaugeMetricFamily(P + "num_requests_waiting", "Requests waiting to be scheduled.",
                              labels=["model_name"])
        g.add_metric([m], s.num_waiting)
        yield g
        yield from self._tier_metrics()
        for name, doc, v in (("prompt_tokens", "Prompt tokens admitted (x n choices).", s.prompt_tokens),
                             ("generation_tokens", "Tokens generated.", s.generation_tokens),
                             ("num_preemptions", "Sequences preempted for lack of KV blocks.",
                              s.num_preemptions),
                             ("engine_step_errors", "Engine steps that raised (their requests failed).",
                              s.step_errors),
                             ("kv_invariant_violations", "KV block accounting checks that failed (checked "
                              "whenever the engine goes idle and after a failed step; must stay 0).",
                              s.invariant_violations)):
            c = CounterMetricFamily(P + name, doc, labels=["model_name"])
            c.add_metric([m], v)
            yield c
        c = CounterMetricFamily(P + "request_success", "Finished sequences (choices) by finish reason.",
                                labels=["model_name", "finished_reason"])
        for reason in sorted(set(s.finished) | {"stop", "length", "abort"}):
            c.add_metric([m, reason], s.finished.get(reason, 0))
        yield c

    def _tier_metrics(self):
        s, m = self.snapshot, self.model_name
        usage = GaugeMetricFamily(P + "kv_cache_usage_perc", "Fraction of KV blocks in use, per tier (0..1).",
                                  labels=["model_name", "tier"])
        blocks = GaugeMetricFamily(P + "kv_cache_blocks", "KV blocks per tier by state "
                                   "(in_use, cached = free but findable by the prefix cache, free, total).",
                                   labels=["model_name", "tier", "state"])
        queries = CounterMetricFamily(P + "prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache, per tier.", labels=["model_name", "tier"])
        hits = CounterMetricFamily(P + "prefix_cache_hits", "Prompt tokens served from the prefix cache, "
                                   "per tier.", labels=["model_name", "tier"])
        evictions = CounterMetricFamily(P + "kv_cache_evictions", "Cached KV blocks evicted, per tier.",
                                        labels=["model_name", "tier"])
        clean = CounterMetricFamily(P + "kv_clean_evictions", "Cached KV blocks evicted whose KV the other "
                                    "tier also held (nothing lost), per tier.", labels=["model_name", "tier"])
        lossy = CounterMetricFamily(P + "kv_lossy_evictions", "Cached KV blocks evicted with no copy "
                                    "anywhere else (their KV is lost), per tier. With a host tier, "
                                    "device-side ones happen only when the host has no room.",
                                    labels=["model_name", "tier"])
        moved = CounterMetricFamily(P + "kv_transfer_bytes", "KV bytes copied into (in) and out of a tier.",
                                    labels=["model_name", "tier", "direction"])
        moved_s = CounterMetricFamily(P + "kv_transfer_seconds", "Seconds spent copying KV into (in) and "
                                      "out of a tier.", labels=["model_name", "tier", "direction"])
        failures = CounterMetricFamily(P + "kv_transfer_failures", "KV copies between tiers that failed or "
                                       "could not start (a save's KV not kept, a load recomputed).",
                                       labels=["model_name", "tier", "direction"])
        for t in s.tiers:
            failures.add_metric([m, t.tier, "in"], t.save_failures)
            failures.add_metric([m, t.tier, "out"], t.load_failures)
            usage.add_metric([m, t.tier], t.blocks_in_use / max(1, t.blocks_total))
            for state, v in (("in_use", t.blocks_in_use), ("cached", t.blocks_cached),
                             ("free", t.blocks_free), ("total", t.blocks_total)):
                blocks.add_metric([m, t.tier, state], v)
            queries.add_metric([m, t.tier], t.query_tokens)
            hits.add_metric([m, t.tier], t.hit_tokens)
            evictions.add_metric([m, t.tier], t.evictions)
            clean.add_metric([m, t.tier], t.evictions - t.lossy_evictions)
            lossy.add_metric([m, t.tier], t.lossy_evictions)
            moved.add_metric([m, t.tier, "in"], t.bytes_in)
            moved.add_metric([m, t.tier, "out"], t.bytes_out)
            moved_s.add_metric([m, t.tier, "in"], t.seconds_in)
            moved_s.add_metric([m, t.tier, "out"], t.seconds_out)
        yield from (usage, blocks, queries, hits, evictions, clean, lossy, moved, moved_s, failures)


class ServerMetrics(MetricsObserver):
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.model_name = model_name
        self.collector = _SnapshotCollector(model_name)
        self.registry.register(self.collector)
        lbl = ["model_name"]
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token (server arrival to "
                              "first generated token).", lbl, registry=self.registry, buckets=TTFT_BUCKETS)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between successive outputs of a "
                             "request.", lbl, registry=self.registry, buckets=ITL_BUCKETS)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Server arrival to last output of a request.",
                             lbl, registry=self.registry, buckets=E2E_BUCKETS)
        self.step = Histogram(P + "engine_step_seconds", "Duration of one engine step (schedule, forward, "
                              "sample, detokenize), by kind: decode = one token per running sequence, "
                              "mixed = prompt work may have run in it.", ["model_name", "kind"],
                              registry=self.registry, buckets=STEP_BUCKETS)
        self._ttft, self._itl, self._e2e = (h.labels(model_name) for h in (self.ttft, self.itl, self.e2e))
        self._step = {k: self.step.labels(model_name, k) for k in ("decode", "mixed")}

    # observed by the engine client as outputs leave for the client
    def on_first_token(self, ttft: float) -> None:
        self._ttft.observe(ttft)

    def on_inter_token(self, itl: float) -> None:
        self._itl.observe(itl)

    def on_finished(self, e2e: float) -> None:
        self._e2e.observe(e2e)

    def on_step(self, kind: str, seconds: float) -> None:
        self._step[kind].observe(seconds)

    def render(self, snapshot: EngineSnapshot) -> bytes:
        self.collector.snapshot = snapshot
        return generate_latest(self.registry)
