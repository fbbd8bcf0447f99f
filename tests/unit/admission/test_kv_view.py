"""The engine's part of ``/guard/status``: one engine's figures, and each data-parallel engine's own beside them."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.paths import FIXTURES
from tests.unit.admission.rig import Rig

TWO_RANKS = (FIXTURES / "vllm" / "v1-0.32.0-dp2" / "metrics.txt").read_text()  # vLLM with two engines
ONE_RANK = """\
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="32"} 1.0
"""


def rank(kv_usage: float, running: int, waiting: int, preemptions: float) -> dict[str, Any]:
    return {"kv_usage": kv_usage, "running": running, "waiting": waiting, "preemptions_total": preemptions,
            "capacity_blocks": 32}


@pytest.mark.parametrize(
    ("page", "whole", "ranks"),
    [
        (TWO_RANKS, {"kv_usage": 0.7, "running": 7, "waiting": 2, "preemptions_total": 3.0},
         {"0": rank(0.1, 2, 0, 1.0), "1": rank(0.7, 5, 2, 2.0)}),
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
