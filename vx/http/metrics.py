"""Prometheus metrics for /metrics: vLLM's set under a `vx:` prefix, plus request accounting.

Beside them, always, the three gauges under vLLM's own names that routers read to steer
traffic between replicas (the Gateway API Inference Extension's model-server protocol; llm-d,
the vLLM production-stack router): `vllm:num_requests_waiting`, `vllm:num_requests_running`
and `vllm:kv_cache_usage_perc`, the same figures as their `vx:` twins, with the same labels.
They are on without a flag: a router finds a replica's load under the name it already knows,
they cost three series per engine, and no `vllm:` name means anything else here. So is
`vllm:cache_config_info` (value 1; `block_size` and `num_gpu_blocks`, the pool's size in
blocks on any device, in its labels), which routers read for the pool's geometry. vx serves no
LoRA adapters, so there is no `vllm:lora_requests_info`.

Runs in: the ApiServer process, with its own CollectorRegistry (two apps in one test process
never share counters). Engine-side figures (running, waiting, KV usage, prefix cache,
preemptions) are read from the latest `SchedulerStats` of each engine at scrape time; request
latencies are observed in the front as outputs arrive.

Accounting invariant, per HTTP inference request (a POST to /v1/completions or
/v1/chat/completions, whatever its n): exactly one of `vx:requests_rejected_total{status}`,
`vx:request_success_total{finished_reason}` or `vx:request_aborted_total{cause}` is counted for
each `vx:requests_received_total`, so received == rejected + finished + aborted once idle.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import anyio
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from vx.http.engine_client import EngineClient

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: How long a scrape waits for an engine's KV self-check.
SELF_CHECK_TIMEOUT_S = 2.0

# vLLM's buckets (seconds), trimmed to what a small server sees.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0)  # fmt: skip


class _EngineCollector(Collector):
    """Gauges and counters read from each engine's latest SchedulerStats at scrape time."""

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self._client = client
        self._model = model_name
        #: The latest `kv_self_check` result of each engine (run at idle, on scrape).
        self.self_checks: dict[int, dict[str, object]] = {}

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["model_name", "engine"]
        running = GaugeMetricFamily(
            "vx:num_requests_running", "Requests in model execution batches.", labels=labels
        )
        waiting = GaugeMetricFamily(
            "vx:num_requests_waiting", "Requests waiting to be processed.", labels=labels
        )
        kv = GaugeMetricFamily(
            "vx:kv_cache_usage_perc", "KV-cache usage (1 means 100 percent).", labels=labels
        )
        queries = CounterMetricFamily(
            "vx:prefix_cache_queries", "Prefix cache queries, in tokens.", labels=labels
        )
        hits = CounterMetricFamily(
            "vx:prefix_cache_hits", "Prefix cache hits, in tokens.", labels=labels
        )
        preempt = CounterMetricFamily(
            "vx:num_preemptions", "Cumulative preemptions.", labels=labels
        )
        dead = GaugeMetricFamily(
            "vx:engine_dead", "1 when the engine is dead.", labels=["model_name"]
        )
        check_ok = GaugeMetricFamily(
            "vx:kv_self_check_ok",
            "1 when the last idle KV self-check passed (free + cached == total, every "
            "referenced block owned, nothing running or waiting), 0 when it failed, -1 before "
            "the first check.",
            labels=labels,
        )
        blocks = GaugeMetricFamily("vx:kv_num_blocks", "KV blocks in the pool.", labels=labels)
        free = GaugeMetricFamily(
            "vx:kv_num_free_blocks", "Free KV blocks (cached ones included).", labels=labels
        )
        cached_free = GaugeMetricFamily(
            "vx:kv_num_cached_free_blocks",
            "Free KV blocks still holding a cached prefix (evictable; at idle, the whole cache).",
            labels=labels,
        )
        drafts = CounterMetricFamily(
            "vx:spec_decode_num_draft_tokens", "Draft tokens scored (speculative decoding).",
            labels=labels,
        )  # fmt: skip
        accepted = CounterMetricFamily(
            "vx:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels=labels
        )
        by_position = CounterMetricFamily(
            "vx:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 first).",
            labels=[*labels, "position"],
        )
        for i in range(self._client.num_engines):
            stats = self._client.latest_stats(i)
            values = [self._model, str(i)]
            check = self.self_checks.get(i)
            check_ok.add_metric(values, -1 if check is None else 1 if check.get("ok") else 0)
            if stats is None:
                running.add_metric(values, 0)
                waiting.add_metric(values, 0)
                kv.add_metric(values, 0.0)
                queries.add_metric(values, 0)
                hits.add_metric(values, 0)
                preempt.add_metric(values, 0)
                continue
            running.add_metric(values, stats.num_running)
            waiting.add_metric(values, stats.num_waiting)
            kv.add_metric(values, stats.kv_usage)
            queries.add_metric(values, stats.prefix_queries_total)
            hits.add_metric(values, stats.prefix_hits_total)
            preempt.add_metric(values, stats.num_preempted_total)
            blocks.add_metric(values, stats.num_blocks)
            free.add_metric(values, stats.num_free_blocks)
            cached_free.add_metric(values, stats.num_cached_free_blocks)
            drafts.add_metric(values, stats.spec_num_draft_tokens_total)
            accepted.add_metric(values, stats.spec_num_accepted_tokens_total)
            for pos, n in enumerate(stats.spec_num_accepted_by_position):
                by_position.add_metric([*values, str(pos)], n)
        dead.add_metric([self._model], 1.0 if self._client.is_dead else 0.0)
        # vLLM's cache info gauge (value 1, the figures in its labels), which routers read for
        # the pool's block size and capacity; known once each engine is ready.
        cache_info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the KV cache configuration.",
            labels=["engine", "block_size", "num_gpu_blocks"],
        )  # fmt: skip
        for ready in self._client.ready:
            cache_info.add_metric(
                [str(ready.engine_index), str(ready.block_size), str(ready.num_blocks)], 1.0
            )
        yield cache_info
        yield from (running, waiting, kv, queries, hits, preempt, dead, check_ok, blocks, free,
                    cached_free, drafts, accepted, by_position)  # fmt: skip
        for family in (running, waiting, kv):
            yield _vllm_twin(family)

    async def refresh_self_check(self) -> None:
        """At idle (no request in the front), ask every engine for its KV self-check.

        The engine reads its input ring in order, so aborts sent before this call are applied
        before it answers. A failed check is logged with its problems; a busy front keeps the
        previous result.
        """
        client = self._client
        for i in range(client.num_engines):
            if client.is_dead or client.num_unfinished:
                return
            try:
                with anyio.fail_after(SELF_CHECK_TIMEOUT_S):
                    result = await client.call_utility("kv_self_check", engine_index=i)
            except Exception as e:  # a scrape must never fail because of the check
                logger.warning("KV self-check on engine %d did not run: %r", i, e)
                continue
            self.self_checks[i] = result
            if not result.get("ok"):
                logger.error("KV self-check failed on engine %d: %s", i, result.get("problems"))


def _vllm_twin(family: GaugeMetricFamily) -> GaugeMetricFamily:
    """The gauge under vLLM's name (`vx:x` -> `vllm:x`), same help, labels and values."""
    twin = GaugeMetricFamily("vllm:" + family.name.removeprefix("vx:"), family.documentation)
    twin.samples = [s._replace(name="vllm:" + s.name.removeprefix("vx:")) for s in family.samples]
    return twin


class Metrics:
    """The front's metrics. Also the EngineClient's `OutputObserver` (TTFT and ITL).

    Invariant: see the module docstring (received == rejected + finished + aborted).
    """

    def __init__(self, client: EngineClient, model_name: str) -> None:
        # The `_created` series double every counter's output and nothing reads them (vLLM
        # turns them off too). The switch is process-wide; the ApiServer has no other registry.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        m = ["model_name"]
        self._model = model_name
        self.ttft = Histogram("vx:time_to_first_token_seconds", "Time to first token.", m,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)  # fmt: skip
        self.itl = Histogram("vx:inter_token_latency_seconds", "Inter-token latency.", m,
                             buckets=ITL_BUCKETS, registry=r).labels(model_name)  # fmt: skip
        self.e2e = Histogram("vx:e2e_request_latency_seconds", "End-to-end request latency.", m,
                             buckets=E2E_BUCKETS, registry=r).labels(model_name)  # fmt: skip
        self.prompt_tokens = Counter("vx:prompt_tokens", "Prefill tokens processed.", m,
                                     registry=r).labels(model_name)  # fmt: skip
        self.generation_tokens = Counter("vx:generation_tokens", "Generation tokens processed.",
                                         m, registry=r).labels(model_name)  # fmt: skip
        self.received = Counter("vx:requests_received", "Inference HTTP requests received.", m,
                                registry=r).labels(model_name)  # fmt: skip
        self._rejected = Counter("vx:requests_rejected", "Inference HTTP requests refused "
                                 "before admission, by status.", ["model_name", "status"],
                                 registry=r)  # fmt: skip
        self._success = Counter("vx:request_success", "Inference HTTP requests finished, by "
                                "finish reason.", ["model_name", "finished_reason"],
                                registry=r)  # fmt: skip
        self._aborted = Counter("vx:request_aborted", "Inference HTTP requests aborted, by "
                                "cause.", ["model_name", "cause"], registry=r)  # fmt: skip
        self._http = Counter("vx:http_responses", "HTTP responses by route and status.",
                             ["path", "status"], registry=r)  # fmt: skip
        self.structured_requests = Counter(
            "vx:structured_requests", "Inference HTTP requests with an output constraint.", m,
            registry=r).labels(model_name)  # fmt: skip
        self.grammar_compile = Histogram(
            "vx:grammar_compile_seconds", "Time to compile a new grammar (cache misses).", m,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0), registry=r,
        ).labels(model_name)  # fmt: skip
        self.grammar_failures = Counter(
            "vx:grammar_compile_failures", "Grammars refused: failed or timed out.",
            ["model_name", "cause"], registry=r)  # fmt: skip
        self._engine_collector = _EngineCollector(client, model_name)
        r.register(self._engine_collector)
        # Make the labelled series exist at 0, so a scrape always shows the whole set.
        for reason in ("stop", "length"):
            self._success.labels(model_name, reason)
        for cause in ("client_disconnect", "error"):
            self._aborted.labels(model_name, cause)

    # ── OutputObserver ──
    def on_tokens(self, *, num_tokens: int, ttft_s: float | None, itl_s: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if itl_s is not None:
            self.itl.observe(itl_s)

    # ── request accounting ──
    def rejected(self, status: int) -> None:
        self._rejected.labels(self._model, str(status)).inc()

    def finished(self, reason: str, e2e_s: float) -> None:
        self._success.labels(self._model, reason).inc()
        self.e2e.observe(e2e_s)

    def grammar_failure(self, cause: str) -> None:
        self.grammar_failures.labels(self._model, cause).inc()

    def aborted(self, cause: str) -> None:
        self._aborted.labels(self._model, cause).inc()

    def http_response(self, path: str, status: int) -> None:
        self._http.labels(path, str(status)).inc()

    async def refresh_self_check(self) -> None:
        """Run the engines' KV self-check if the front is idle (see `vx:kv_self_check_ok`)."""
        await self._engine_collector.refresh_self_check()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def totals(self) -> dict[str, float]:
        """received / rejected / finished / aborted sums (tests and the accounting check)."""
        out = {"received": 0.0, "rejected": 0.0, "finished": 0.0, "aborted": 0.0}
        names = {
            "vx:requests_received": "received",
            "vx:requests_rejected": "rejected",
            "vx:request_success": "finished",
            "vx:request_aborted": "aborted",
        }
        for family in self.registry.collect():
            key = names.get(family.name)
            if key is None:
                continue
            out[key] += sum(s.value for s in family.samples if s.name.endswith("_total"))
        return out
