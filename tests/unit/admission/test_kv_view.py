"""The engine's part of ``/guard/status``: one engine's figures, and each data-parallel engine's own beside them."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.admission.rig import Rig

TWO_RANKS = """\
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="1",model_name="m"} 3.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
vllm:num_preemptions_total{engine="0",model_name="m"} 1.0
vllm:num_preemptions_total{engine="1",model_name="m"} 2.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="101"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="101"} 1.0
"""
ONE_RANK = """\
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="101"} 1.0
"""


def rank(kv_usage: float, running: int, waiting: int, preemptions: float) -> dict[str, Any]:
    return {"kv_usage": kv_usage, "running": running, "waiting": waiting, "preemptions_total": preemptions,
            "capacity_blocks": 101}


@pytest.mark.parametrize(
    ("page", "whole", "ranks"),
    [
        (TWO_RANKS, {"kv_usage": 0.7, "running": 7, "waiting": 3, "preemptions_total": 3.0},
         {"0": rank(0.1, 2, 0, 1.0), "1": rank(0.7, 5, 3, 2.0)}),
        (ONE_RANK, {"kv_usage": 0.1, "running": 2, "waiting": None, "preemptions_total": None}, {}),
    ],
    ids=["two data-parallel engines are listed each", "one engine lists no ranks"],
)
async def test_the_status_shows_each_data_parallel_engine(
    page: str, whole: dict[str, Any], ranks: dict[str, Any]
) -> None:
    rig = Rig(engine=True)
    rig.upstream.text = page
    assert rig.view is not None
    await rig.view.refresh()
    engine = rig.adm.status()["engine"]
    assert {key: engine[key] for key in whole} == whole
    assert engine["ranks"] == ranks
