"""The vLLM simulator's ``vllm:`` metrics: vLLM 0.32's series, names, help texts and buckets.

A registry of the simulator's own, so that several simulators in one process do not collide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from .vllm_sim_types import SimConfig

# vLLM's own bucket bounds (vllm/v1/metrics/buckets.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


class SimMetrics:
    """vLLM's ``vllm:`` series on a registry of the simulator's own."""

    def __init__(self, config: SimConfig) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        values = [config.model, "0"]
        r = self.registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*labels, "finished_reason"], registry=r)
        self.success = {reason: success.labels(*values, reason) for reason in ("stop", "length", "abort")}
        token_buckets = _one_two_five_buckets(config.max_model_len)
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                        token_buckets)
        self.request_generation = histogram("vllm:request_generation_tokens",
                                            "Number of generation tokens processed.", token_buckets)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS)
        info = _cache_config_info(config)
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
              registry=r).labels(**info).set(1)


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


def _cache_config_info(config: SimConfig) -> dict[str, str]:
    # The label set of vLLM 0.32's CacheConfig.metrics_info(), plus "engine".
    tokens = config.num_blocks * config.block_size
    return {
        "block_size": str(config.block_size), "user_specified_block_size": "True", "kv_cache_layout": "None",
        "prefix_match_unit": "None", "gpu_memory_utilization": "0.92", "cache_dtype": "auto",
        "is_attention_free": "False", "num_gpu_blocks_override": "None", "sliding_window": "None",
        "enable_prefix_caching": str(config.prefix_caching), "prefix_caching_hash_algo": "sha256",
        "prefix_cache_retention_interval": "0", "kv_cache_dtype_skip_layers": "[]",
        "mamba_page_size_padded": "None", "skip_page_size_padded": "None", "mamba_block_size": "None",
        "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto", "mamba_cache_mode": "none",
        "enable_mamba_shared_prefix_checkpoint": "False", "replayssm_buffer_len": "16",
        # num_blocks is what requests can hold; vLLM reports one more, the null block it keeps out of the pool.
        "use_replayssm": "False", "use_kda_recoverssm": "False", "num_gpu_blocks": str(config.num_blocks + 1),
        "num_cpu_blocks": "None", "effective_attention_block_size": "None",
        "kv_cache_size_tokens": str(tokens), "kv_cache_max_concurrency": str(round(tokens / config.max_model_len, 2)),
        "hash_block_size": "None", "cache_hit_alignment_tokens": "None", "kv_sharing_fast_prefill": "False",
        "swa_bounded_replay": "True", "kv_cache_memory_bytes": "None", "kv_offloading_size": "None",
        "kv_offloading_backend": "native", "engine": "0",
    }
