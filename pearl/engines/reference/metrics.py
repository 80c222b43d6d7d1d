"""The reference engine's Prometheus metrics, with vLLM's names and labels.

Names as vLLM's v1 engine exposes them (``docs/design/metrics.md``; labels ``model_name``
and ``engine``): gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``; counters ``vllm:prompt_tokens``, ``vllm:generation_tokens``,
``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits`` (both in tokens),
``vllm:num_preemptions``, ``vllm:request_success{finished_reason}`` (exposed with
``_total``); histograms of request latencies in seconds and of request token counts. One
metric is pearl's own: ``pearl:prompt_tokens_computed`` counts the prompt tokens this
instance actually computed, neither found in its prefix cache nor pulled from a prefill
instance (vLLM's ``vllm:prompt_tokens`` counts every prompt token), so that a test and the
engine benchmark can see that a decode instance recomputed no prompt; the gauge
``pearl:weight_version`` is the version of the weights being served.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_S = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class MirroredCounter:
    """A counter that follows a running total kept elsewhere (increments by the delta)."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.seen = 0

    def set_total(self, total: int) -> None:
        if total > self.seen:
            self.counter.inc(total - self.seen)
            self.seen = total


class EngineMetrics:
    def __init__(self, model_name: str, engine: str = "0") -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": engine}
        names = list(labels)
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(**labels)

        def hist(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_S) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).")
        self.weight_version = gauge("pearl:weight_version", "The version of the weights served.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.prompt_tokens_computed = counter(
            "pearl:prompt_tokens_computed",
            "Prompt tokens computed here (neither prefix-cached nor transferred).",
        )
        self.prefix_queries = MirroredCounter(
            counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        )
        self.prefix_hits = MirroredCounter(
            counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        )
        self.num_preemptions = MirroredCounter(
            counter("vllm:num_preemptions", "Sequences preempted (to be recomputed).")
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            [*names, "finished_reason"],
            registry=r,
        )
        self._labels = labels
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to the first token.")
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between two tokens.")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = hist("vllm:request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill_time = hist("vllm:request_prefill_time_seconds", "Scheduled to first token.")
        self.decode_time = hist("vllm:request_decode_time_seconds", "First token to finish.")
        self.request_prompt_tokens = hist(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", _TOKENS
        )
        self.request_generation_tokens = hist(
            "vllm:request_generation_tokens", "Generated tokens per request.", _TOKENS
        )
        self.kv_transfer_time = hist(
            "vllm:nixl_xfer_time_seconds", "Time of one KV pull from a prefill instance."
        )
        self.kv_transfer_bytes = counter("vllm:nixl_bytes_transferred", "KV bytes pulled.")

    def success(self, finished_reason: str) -> None:
        self.request_success.labels(**self._labels, finished_reason=finished_reason).inc()
