"""The vLLM simulator's ``vllm:`` metrics: vLLM 0.32's series, names, help texts and buckets.

A registry of the simulator's own, so that several simulators in one process do not collide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from .types import SimConfig

# vLLM's own bucket bounds (vllm/v1/metrics/buckets.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineMetrics:
    """One engine core's children of the ``vllm:`` families: the series carrying its ``engine`` label."""

    def __init__(self, families: dict[str, Any], values: list[str]) -> None:
        def child(name: str) -> Any:
            return families[name].labels(*values)

        self.running = child("running")
        self.waiting = child("waiting")
        self.kv_usage = child("kv_usage")
        self.preemptions = child("preemptions")
        self.prompt_tokens = child("prompt_tokens")
        self.generation_tokens = child("generation_tokens")
        self.prefix_queries = child("prefix_queries")
        self.prefix_hits = child("prefix_hits")
        self.success = {reason: families["success"].labels(*values, reason) for reason in ("stop", "length", "abort")}
        self.request_prompt = child("request_prompt")
        self.request_generation = child("request_generation")
        self.ttft = child("ttft")
        self.e2e = child("e2e")


class SimMetrics:
    """vLLM's ``vllm:`` series on a registry of the simulator's own, one set per data-parallel engine.

    vLLM's PrometheusStatLogger labels every series ``engine="<rank>"`` and publishes ``vllm:cache_config_info``
    once per engine with the same labels but ``engine``; ``engines[rank]`` holds one engine's series.
    """

    def __init__(self, config: SimConfig) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        r = self.registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        token_buckets = _one_two_five_buckets(config.max_model_len)
        families = {
            "running": gauge("vllm:num_requests_running", "Number of requests in model execution batches."),
            "waiting": gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
            "kv_usage": gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
            "preemptions": counter("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
            "prompt_tokens": counter("vllm:prompt_tokens", "Number of prefill tokens processed."),
            "generation_tokens": counter("vllm:generation_tokens", "Number of generation tokens processed."),
            "prefix_queries": counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens."),
            "prefix_hits": counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens."),
            "success": Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*labels, "finished_reason"], registry=r),
            "request_prompt": histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                        token_buckets),
            "request_generation": histogram("vllm:request_generation_tokens",
                                            "Number of generation tokens processed.", token_buckets),
            "ttft": histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS),
            "e2e": histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS),
        }
        ranks = range(config.data_parallel_size)
        self.engines = [EngineMetrics(families, [config.model, str(rank)]) for rank in ranks]
        info = _cache_config_info(config, 0)
        info_gauge = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
                           registry=r)
        for rank in ranks:
            info_gauge.labels(**_cache_config_info(config, rank)).set(1)


def _one_two_five_buckets(limit: int) -> tuple[float, ...]:
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


def admission_rejections(registry: CollectorRegistry | None, model: str) -> Any:
    """vLLM's ``vllm:admission_rejections_total{model_name, reason}`` (vllm/v1/metrics/loggers.py: every reason
    published from the start); None under --disable-log-stats."""
    if registry is None:
        return None
    counter = Counter("vllm:admission_rejections", "Number of admission attempts rejected by a queue limit, by "
                      "reason.", ["model_name", "reason"], registry=registry)
    for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
        counter.labels(model, reason)
    return counter


def _cache_config_info(config: SimConfig, rank: int) -> dict[str, str]:
    # The label set of vLLM 0.32's CacheConfig.metrics_info(), plus "engine"; every engine has its own cache.
    # num_blocks is what requests can hold; vLLM reports one more, the null block it keeps out of the pool, and
    # its API server labels every engine with the sum over the data-parallel engines (core_client.py: "Sum
    # num_gpu_blocks from all engines in DP case"), while kv_cache_size_tokens stays one engine's.
    blocks = config.num_blocks + 1
    tokens = blocks * config.block_size
    return {
        "block_size": str(config.block_size), "user_specified_block_size": "True", "kv_cache_layout": "None",
        "prefix_match_unit": "None", "gpu_memory_utilization": "0.92", "cache_dtype": "auto",
        "is_attention_free": "False", "num_gpu_blocks_override": "None", "sliding_window": "None",
        "enable_prefix_caching": str(config.prefix_caching), "prefix_caching_hash_algo": "sha256",
        "prefix_cache_retention_interval": "0", "kv_cache_dtype_skip_layers": "[]",
        "mamba_page_size_padded": "None", "skip_page_size_padded": "None", "mamba_block_size": "None",
        "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto", "mamba_cache_mode": "none",
        "enable_mamba_shared_prefix_checkpoint": "False", "replayssm_buffer_len": "16",
        "use_replayssm": "False", "use_kda_recoverssm": "False",
        "num_gpu_blocks": str(blocks * config.data_parallel_size),
        "num_cpu_blocks": "None", "effective_attention_block_size": "None",
        "kv_cache_size_tokens": str(tokens), "kv_cache_max_concurrency": str(round(tokens / config.max_model_len, 2)),
        "hash_block_size": "None", "cache_hit_alignment_tokens": "None", "kv_sharing_fast_prefill": "False",
        "swa_bounded_replay": "True", "kv_cache_memory_bytes": "None", "kv_offloading_size": "None",
        "kv_offloading_backend": "native", "engine": str(rank),
    }
