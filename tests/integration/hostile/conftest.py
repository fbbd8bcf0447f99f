"""Shared servers for the hostile-input suite: one simulator, one misbehaving upstream, and as few gateways as
the cases allow (each is a real uvicorn server on loopback, started once per session or module)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.config import Settings
from testing.gateway_thread import run_gateway
from testing.hostile_checks import Target
from testing.rogue_engine import SILENCE_S, Rogue, run_rogue
from testing.vllm_sim import SimConfig, SimServer, run_sim_server

MAX_MODEL_LEN = 512
# Small, so that cases near and past the limit stay cheap.
BODY_LIMIT = 64 * 1024
CLIENT_KEY = "sk-hostile-client-0001"
PRIO_KEY = "sk-hostile-prio-0002"
ADMIN_KEY = "sk-hostile-admin-0003"
UPSTREAM_KEY = "sk-upstream-secret-7f3a9c"

NORMAL_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
ROGUE_OK_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "rogue:ok"}], "max_tokens": 2}


def hostile_settings(tokenizer_dir: Path, **overrides: Any) -> Settings:
    base = Settings(
        tokenizer=str(tokenizer_dir), scrape_interval=0.05, queue_timeout=5.0, read_timeout=5.0,
        max_body_bytes=BODY_LIMIT,
    )
    return base.model_copy(update=overrides)


@pytest.fixture(scope="session")
def sim(tokenizer: Any, tokenizer_dir: Path) -> Iterator[SimServer]:
    config = SimConfig(
        model="tiny", root=str(tokenizer_dir), max_model_len=MAX_MODEL_LEN, num_blocks=256, block_size=16,
        tokenizer=tokenizer, api_key=UPSTREAM_KEY,
    )
    with run_sim_server(config) as server:
        yield server


@pytest.fixture(scope="session")
def gw(sim: SimServer, tokenizer_dir: Path) -> Iterator[Target]:
    """The main gateway: auth on (client, priority and admin keys), the simulator behind it."""
    settings = hostile_settings(
        tokenizer_dir, upstream=sim.url, upstream_api_key=UPSTREAM_KEY,
        api_key=[CLIENT_KEY, f"{PRIO_KEY}=7"], admin_api_key=[ADMIN_KEY],
    )
    with run_gateway(settings) as server:
        target = Target(server, CLIENT_KEY, json.dumps(NORMAL_CHAT).encode())
        yield target
        target.close()


@pytest.fixture(scope="session")
def rogue() -> Iterator[Rogue]:
    with run_rogue() as server:
        yield server


@pytest.fixture(scope="session")
def rogue_gw(rogue: Rogue, tokenizer_dir: Path) -> Iterator[Target]:
    """A gateway without client keys (anyone may call it) in front of the misbehaving upstream; its short read
    timeout turns a hung upstream into a 504 within a few seconds."""
    settings = hostile_settings(
        tokenizer_dir, upstream=rogue.url, upstream_api_key=UPSTREAM_KEY, read_timeout=SILENCE_S,
        request_timeout=SILENCE_S + 5.0,
    )
    with run_gateway(settings) as server:
        target = Target(server, None, json.dumps(ROGUE_OK_CHAT).encode())
        yield target
        target.close()
