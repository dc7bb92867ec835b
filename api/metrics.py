"""Prometheus metrics of one server: requests by route and status, latency histograms (TTFT, inter-token,
end to end) observed as outputs reach their request, and the engine's gauges and counters read from the
bridge's latest stats (so a scrape never waits for a step). Inter-token latencies, tokens per step and
output tokens are also kept as the last minute's samples, for the dashboard's live charts."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
RECENT_HORIZON_S = 60.0

if TYPE_CHECKING:
    from engine.outputs import EngineStats


class RecentSamples:
    """The samples of the last `horizon_s` seconds; safe to add to from any thread."""

    def __init__(self, horizon_s: float = RECENT_HORIZON_S) -> None:
        self.horizon_s = horizon_s
        self._samples: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()

    def add(self, value: float) -> None:
        now = time.monotonic()
        with self._lock:
            self._samples.append((now, value))
            while self._samples[0][0] < now - self.horizon_s:
                self._samples.popleft()

    def last(self, seconds: float) -> list[float]:
        """The values added in the last `seconds` (at most the horizon), oldest first."""
        since = time.monotonic() - min(seconds, self.horizon_s)
        with self._lock:
            return [value for at, value in self._samples if at >= since]


class Count:
    """A count that only goes up, safe to add to from any thread; exported by a collector."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def inc(self, amount: int = 1) -> None:
        with self._lock:
            self.value += amount


class EngineCollector(Collector):
    """Engine gauges and counters from `Engine.stats()`. Step failures are those
    the engine reports (a step it ended, failing the requests it carried) plus `step_raises`, steps that
    raised out of the engine (counted by the bridge)."""

    def __init__(self, stats: Callable[[], EngineStats], step_raises: Count) -> None:
        self.stats = stats
        self.step_raises = step_raises

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.stats()
        used, total = stats.kv_blocks_used, stats.kv_blocks_total
        yield GaugeMetricFamily("vlmcap_num_requests_running", "Requests running in the engine",
                                value=stats.num_running)
        yield GaugeMetricFamily("vlmcap_num_requests_waiting", "Requests waiting in the engine",
                                value=stats.num_waiting)
        yield GaugeMetricFamily("vlmcap_kv_cache_usage_ratio", "Fraction of KV cache blocks in use",
                                value=used / total if total else 0.0)
        yield GaugeMetricFamily("vlmcap_kv_cache_blocks_used", "KV cache blocks in use", value=used)
        yield GaugeMetricFamily("vlmcap_kv_cache_blocks_total", "KV cache blocks", value=total)
        yield CounterMetricFamily("vlmcap_num_preemptions", "Requests preempted (recomputed later)",
                                  value=stats.num_preemptions)
        yield CounterMetricFamily("vlmcap_vision_encoder_seconds", "Time spent in the vision encoder",
                                  value=stats.encoder_seconds)
        yield CounterMetricFamily("vlmcap_vision_encoder_inputs", "Images or tiles run through the vision encoder",
                                  value=stats.encoder_inputs_encoded)
        yield GaugeMetricFamily("vlmcap_prefix_cache_hit_rate", "Share of the prompt tokens looked up in the prefix "
                                "cache that were found there (since start)", value=stats.prefix_cache_hit_rate)
        yield CounterMetricFamily("vlmcap_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=stats.prefix_cache_queried_tokens)
        yield CounterMetricFamily("vlmcap_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache (not "
                                  "computed again)", value=stats.prefix_cache_hit_tokens)
        yield CounterMetricFamily("vlmcap_vision_encoder_cache_hits", "Images or tiles whose features were reused "
                                  "instead of running the vision encoder", value=stats.encoder_cache_hits)
        yield CounterMetricFamily("vlmcap_engine_steps", "Engine steps run", value=stats.num_steps)
        yield CounterMetricFamily("vlmcap_generation_tokens", "Tokens generated",
                                  value=stats.num_generated_tokens)
        yield CounterMetricFamily("vlmcap_engine_step_failures", "Engine steps that failed (their requests ended "
                                  "with an error)", value=stats.num_step_failures + self.step_raises.value)
        yield CounterMetricFamily("vlmcap_engine_request_failures", "Requests the engine ended alone with an error "
                                  "(the others of their step went on)", value=stats.num_request_failures)


class AlertWebhookCollector(Collector):
    """The fall-alert webhook's counters (`jobqueue.alerts.WebhookStats`), read at each scrape."""

    HELP = {"sent": "Fall alerts the webhook accepted", "failed": "Fall alerts given up after every retry",
            "failed_attempts": "Webhook attempts that failed", "dropped": "Fall alerts dropped: too many waiting",
            "restarts": "Times the webhook's delivery task ended and was started again"}

    def __init__(self, stats: Callable[[], Any]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.stats()
        for name, text in self.HELP.items():
            yield CounterMetricFamily(f"vlmcap_alert_webhook_{name}", text, value=getattr(stats, name))


class Metrics:
    """One registry per server, so several servers (tests) in one process do not collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Labels from fixed sets only (see api.guard.method_label and its route templates).
        self.requests = Counter("vlmcap_http_requests", "HTTP requests by route and status",
                                ["method", "route", "status"], registry=r)
        self.ttft = Histogram("vlmcap_time_to_first_token_seconds", "From request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vlmcap_inter_token_latency_seconds", "Between consecutive tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vlmcap_e2e_request_latency_seconds", "From request arrival to its last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.step_tokens = Histogram("vlmcap_step_num_tokens", "Tokens scheduled in one engine step",
                                     buckets=STEP_TOKEN_BUCKETS, registry=r)
        self.finished = Counter("vlmcap_requests_finished", "Engine requests finished, by reason", ["reason"],
                                registry=r)
        self.aborted = Counter("vlmcap_requests_aborted", "Engine requests aborted (client left, shutdown)",
                               registry=r)
        self.step_failures = Count()  # steps that raised out of the engine; see EngineCollector
        self.recent_itl = RecentSamples()  # seconds between consecutive tokens of a request
        self.recent_step_tokens = RecentSamples()  # tokens scheduled in one step
        self.recent_output_tokens = RecentSamples()  # new tokens of one output reaching its request

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.recent_itl.add(seconds)

    def observe_step_tokens(self, tokens: int) -> None:
        self.step_tokens.observe(tokens)
        self.recent_step_tokens.add(tokens)

    def watch_engine(self, stats: Callable[[], EngineStats]) -> None:
        self.registry.register(EngineCollector(stats, self.step_failures))

    def watch_alert_webhook(self, stats: Callable[[], Any]) -> None:
        self.registry.register(AlertWebhookCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
