"""vLLM's HTTP surfaces, each read in one place: ``/metrics``, ``/v1/models``, ``/version`` and its error bodies."""

from gateway.engine.vllm_api.errors import upstream_error_from
from gateway.engine.vllm_api.metrics import EngineMetrics, RankMetrics, parse_metrics
from gateway.engine.vllm_api.models import ModelList, ServedModel, parse_models, rewrite_max_model_len
from gateway.engine.vllm_api.version import VllmVersion, parse_version, release_of

__all__ = [
    "EngineMetrics",
    "ModelList",
    "RankMetrics",
    "ServedModel",
    "VllmVersion",
    "parse_metrics",
    "parse_models",
    "parse_version",
    "release_of",
    "rewrite_max_model_len",
    "upstream_error_from",
]
