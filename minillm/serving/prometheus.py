"""Chapter 8 — the server's /metrics: engine state and request latencies in Prometheus form, with vLLM's metric
names.

Gauges are read from the engine's stats when Prometheus scrapes; counters and latency histograms are fed
from each step's outputs (`AsyncLLM.listeners`), and refusals (429, 503) by the app. Everything lives in
the app's own registry, so several servers in one process (tests, notebooks) never share counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily

from ..outputs import RequestOutput
from .async_llm import AsyncLLM

PREFIX = "minillm:"
disable_created_metrics()  # no `*_created` timestamp series beside each counter (vLLM turns them off too)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """Prometheus metrics of one served model, in `registry`."""

    def __init__(self, llm: AsyncLLM, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str, read) -> None:
            Gauge(PREFIX + name, doc, list(labels), registry=self.registry).labels(**labels).set_function(read)

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, list(labels), buckets=buckets, registry=self.registry).labels(**labels)

        gauge("num_requests_running", "Sequences in the running batch.", lambda: llm.stats()["num_running"])
        gauge("num_requests_waiting", "Sequences waiting to start (or to resume after preemption).",
              lambda: llm.stats()["num_waiting"])
        gauge("kv_cache_usage_perc", "Share of KV-cache blocks in use (1 = full).", lambda: _kv_usage(llm.stats()))
        gauge("kv_offload_bytes_used", "Bytes of the KV offload tier's slots holding a block (chapter 10).",
              lambda: llm.stats().get("kv_offload_bytes_used", 0))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.").labels(**labels)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(**labels)
        self.success = counter("request_success", "Requests finished, by finish reason.", "finished_reason")
        self.rejected = counter("request_rejected", "Requests refused before they started: overloaded (429) or "
                                "unavailable (503).", "reason")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS)
        self.registry.register(_EngineCounters(llm, labels))
        self.labels = labels
        self._seen: dict[str, int] = {}  # request id -> token times already observed
        llm.listeners.append(self.observe)

    def observe(self, outputs: list[RequestOutput]) -> None:
        """Record the tokens and finishes in one step's outputs."""
        for out in outputs:
            m = out.metrics
            seen, times = self._seen.get(out.request_id, 0), list(m.token_times)  # the engine may append meanwhile
            if seen == 0 and times:
                self.ttft.observe(times[0] - m.arrival_time)
                self.prompt_tokens.inc(m.prompt_tokens)
            for i in range(max(seen, 1), len(times)):
                self.itl.observe(times[i] - times[i - 1])
            self.generation_tokens.inc(len(times) - seen)
            self._seen[out.request_id] = len(times)
            if out.finished:
                self._seen.pop(out.request_id, None)
                self.e2e.observe(m.finished_time - m.arrival_time)
                reason = out.outputs[0].finish_reason if out.outputs else None
                self.success.labels(**self.labels, finished_reason=reason or "abort").inc()


def _kv_usage(stats: dict) -> float:
    return 1 - stats["kv_blocks_free"] / stats["kv_blocks_total"] if stats["kv_blocks_total"] else 0.0


class _EngineCounters:
    """Counters the engine keeps itself, read at scrape time (a Prometheus Counter cannot be set)."""

    def __init__(self, llm: AsyncLLM, labels: dict[str, str]):
        self.llm, self.labels = llm, labels

    def collect(self):
        stats = self.llm.stats()
        for name, doc, value in (
                ("num_preemptions", "Sequences preempted (their KV blocks freed, recomputed later).",
                 stats["num_preemptions"]),
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 stats["prefix_cache_query_tokens"]),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats["prefix_cache_hit_tokens"]),
                ("request_retries", "Requests sent again after their replica failed before any output (chapter 9's "
                 "service; 0 for one engine).", stats.get("num_retries", 0)),
                ("spec_decode_num_drafts", "Sequence-steps that checked drafted tokens (chapter 10).",
                 stats.get("spec_decode_num_drafts", 0)),
                ("spec_decode_num_draft_tokens", "Tokens drafted.", stats.get("spec_decode_num_draft_tokens", 0)),
                ("spec_decode_num_accepted_tokens", "Drafted tokens the model kept.",
                 stats.get("spec_decode_num_accepted_tokens", 0)),
                ("kv_offload_blocks_stored", "Prefix-cache blocks copied to the KV offload tier as the pool evicted "
                 "them (chapter 10).", stats.get("kv_offload_blocks_stored", 0)),
                ("kv_offload_blocks_loaded", "Blocks reloaded from the KV offload tier instead of recomputed.",
                 stats.get("kv_offload_blocks_loaded", 0)),
                ("kv_offload_load_failures", "Offloaded blocks refused at reload (checksum, hash or layout mismatch) "
                 "and recomputed.", stats.get("kv_offload_load_failures", 0))):
            family = CounterMetricFamily(PREFIX + name, doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), value)
            yield family
        per_position = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                           "Drafted tokens kept, by their position among a step's drafts.",
                                           labels=[*self.labels, "position"])
        for position, value in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos", [])):
            per_position.add_metric([*self.labels.values(), str(position)], value)
        yield per_position
