"""``GET /metrics`` of ``kvplug serve``: Prometheus text with vLLM's metric names where vLLM has
one, so dashboards and benchmark scrapers built for vLLM read kvplug unchanged.

Gauges and counters come from the cache's statistics and the server's running requests at scrape
time; the latency histograms are recorded by the generation routes (``ServeMetrics.observe``):
time to first token is the first streamed chunk of a streaming response, time per output token
the mean gap between its later chunks, and end-to-end latency every response's whole time.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Any

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


@dataclass
class Histogram:
    """Cumulative Prometheus histogram; ``counts[i]``: observations <= ``buckets[i]`` (the last: +Inf)."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {running}')
        out += [f"{name}_sum{{{labels}}} {self.total!r}", f"{name}_count{{{labels}}} {running}"]
        return out


class ServeMetrics:
    """The server's latency histograms (one owner: this object; the routes call ``observe``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ttft = Histogram(TTFT_BUCKETS)
        self._tpot = Histogram(TPOT_BUCKETS)
        self._e2e = Histogram(E2E_BUCKETS)

    def observe(self, *, e2e_s: float, first_chunk_s: float | None = None, chunk_gaps_s: list[float] = ()) -> None:
        """One finished response: its whole time, and for a stream its first chunk and later gaps."""
        with self._lock:
            self._e2e.observe(e2e_s)
            if first_chunk_s is not None:
                self._ttft.observe(first_chunk_s)
            for gap in chunk_gaps_s:
                self._tpot.observe(gap)

    def render(self, model_name: str, stats: dict, running: int, in_flight: int) -> str:
        """The Prometheus exposition text; ``stats``: ``/kvplug/stats``'s cache fields."""
        labels = f'model_name="{_escape(model_name)}"'
        waiting = max(in_flight - running, 0)
        num_pages = int(stats.get("num_pages", 0) or 0)
        usage = float(stats.get("utilisation", 0.0) or 0.0)
        rows: list[str] = []

        def metric(name: str, kind: str, text: str, value: Any) -> None:
            rows.extend([f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {value}"])

        metric("vllm:num_requests_running", "gauge", "Requests in the batching worker (holding KV rows).", running)
        metric("vllm:num_requests_waiting", "gauge", "Requests accepted and not yet running.", waiting)
        metric("vllm:kv_cache_usage_perc", "gauge", "KV pool usage, 1 = full.", usage)
        metric("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
               int(stats.get("queried_tokens", 0) or 0))
        metric("vllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
               int(stats.get("cache_hit_tokens", 0) or 0))
        metric("kvplug:num_pages", "gauge", "Pages of the KV pool.", num_pages)
        metric("kvplug:evicted_tokens_total", "counter", "Tokens evicted from the prefix cache.",
               int(stats.get("evicted_tokens", 0) or 0))
        with self._lock:
            for name, histogram, text in (
                ("vllm:time_to_first_token_seconds", self._ttft, "Time to the first streamed chunk."),
                ("vllm:time_per_output_token_seconds", self._tpot, "Gap between later streamed chunks."),
                ("vllm:e2e_request_latency_seconds", self._e2e, "Whole response time."),
            ):
                rows.extend([f"# HELP {name} {text}", f"# TYPE {name} histogram", *histogram.lines(name, labels)])
        return "\n".join(rows) + "\n"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def add_metrics_route(app: Any, metrics: ServeMetrics, model_name: str, cache_stats: Any, in_flight: Any) -> None:
    """``GET /metrics``; ``cache_stats()``: the cache's statistics as ``/kvplug/stats`` has them
    (``{}`` for the native backend), ``in_flight()``: the server's running requests."""
    from fastapi.responses import PlainTextResponse

    def metrics_route() -> PlainTextResponse:
        stats = cache_stats()
        count = in_flight()
        running = int(stats["running_requests"]) if "running_requests" in stats else count
        return PlainTextResponse(metrics.render(model_name, stats, running, count),
                                 media_type="text/plain; version=0.0.4")

    app.add_api_route("/metrics", metrics_route, methods=["GET"], response_model=None)
