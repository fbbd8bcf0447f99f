"""/v1/models read once (``parse_models``) and held once (``ServedModels``), re-read when the engine comes back."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, cast

import orjson
import pytest

from gateway.engine.client import Upstream, UpstreamReply
from gateway.engine.live import never_scraped
from gateway.engine.models import ServedModels
from gateway.engine.vllm_api import ModelList, ServedModel, parse_models, rewrite_max_model_len
from gateway.errors import BadUpstreamResponse, ModelNotFound, UpstreamUnavailable

LISTING = orjson.dumps({"object": "list", "data": [{"id": "tiny", "root": "/models/tiny", "max_model_len": 2048}]})


@pytest.mark.parametrize(
    ("body", "models"),
    [
        (LISTING, (ServedModel("tiny", "/models/tiny", 2048),)),
        (b'{"data":[{"id":"tiny"}]}', (ServedModel("tiny"),)),
        (b'{"data":[]}', ()),
        # Wrong types read as absent; entries without a string id are no model.
        (b'{"data":[{"max_model_len":true,"id":5}]}', ()),
        (b'{"data":[{"id":"a","max_model_len":-1,"root":7},"junk",{"id":""},{"id":"b","parent":"a"}]}',
         (ServedModel("a"), ServedModel("b", parent="a"))),
    ],
)
def test_a_listing_reads_into_its_models(body: bytes, models: tuple[ServedModel, ...]) -> None:
    listing = parse_models(body)
    assert listing.models == models
    assert listing.ids == tuple(m.id for m in models)


def test_the_first_model_gives_root_and_context_length() -> None:
    listing = parse_models(LISTING)
    assert (listing.root, listing.max_model_len) == ("/models/tiny", 2048)
    assert (ModelList().root, ModelList().max_model_len, ModelList().first) == (None, None, None)


@pytest.mark.parametrize("body", [b"<html>", b"[1, 2]", b"null", b'{"object":"list"}', b'{"data":{"id":"x"}}'])
def test_a_body_that_is_no_model_list_is_a_bad_upstream_response(body: bytes) -> None:
    with pytest.raises(BadUpstreamResponse):
        parse_models(body)


def test_the_listing_is_relayed_with_the_gateways_context_length() -> None:
    two = orjson.dumps({"object": "list", "data": [{"id": "a", "max_model_len": 8192}, {"id": "b"}]})
    assert orjson.loads(rewrite_max_model_len(two, 1024))["data"] == [
        {"id": "a", "max_model_len": 1024}, {"id": "b", "max_model_len": 1024}
    ]
    assert orjson.loads(rewrite_max_model_len(two, None)) == orjson.loads(two)


# -- the registry ---------------------------------------------------------------------------------
class FakeUpstream:
    def __init__(self) -> None:
        self.status = 200
        self.body = LISTING
        self.calls = 0
        self.gate: asyncio.Event | None = None

    async def request(self, method: str, path: str, **kwargs: Any) -> UpstreamReply:
        assert (method, path) == ("GET", "/v1/models")
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        return UpstreamReply(self.status, {}, self.body)


def registry(upstream: FakeUpstream, served_model_name: str | None = None) -> ServedModels:
    return ServedModels(cast(Upstream, upstream), served_model_name=served_model_name)


async def test_the_listing_is_read_on_first_use_only() -> None:
    upstream = FakeUpstream()
    models = registry(upstream)
    assert models.cached is None
    first, second = await asyncio.gather(models.info(), models.info())
    assert first is second is models.cached and upstream.calls == 1
    assert first.ids == ("tiny",)


async def test_an_error_answer_is_the_upstream_being_unavailable() -> None:
    upstream = FakeUpstream()
    upstream.status, upstream.body = 503, b'{"error": {"message": "loading", "type": "ServiceUnavailable"}}'
    with pytest.raises(UpstreamUnavailable, match="HTTP 503: loading") as caught:
        await registry(upstream).refresh()
    assert caught.value.retry_after == 5


@pytest.mark.parametrize(
    ("requested", "served_name", "refused"),
    [(None, None, False), ("tiny", None, False), ("other", None, True), ("alias", "alias", False)],
)
def test_a_model_the_upstream_does_not_serve_is_not_found(requested: str | None, served_name: str | None,
                                                          refused: bool) -> None:
    models = registry(FakeUpstream(), served_name)
    listing = parse_models(LISTING)
    if refused:
        with pytest.raises(ModelNotFound, match="Served: tiny"):
            models.check_model(requested, listing)
    else:
        models.check_model(requested, listing)
    models.check_model("anything", ModelList())  # an empty listing refuses nothing


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_the_listing_is_read_again_when_the_engine_comes_back() -> None:
    upstream = FakeUpstream()
    models = registry(upstream)
    down, up = never_scraped(1.0), replace(never_scraped(2.0), ok=True)
    models.follow(down, up)  # the first scrape: nothing read yet
    await settle()
    assert upstream.calls == 1 and models.cached is not None
    models.follow(up, up)
    models.follow(up, down)
    await settle()
    assert upstream.calls == 1
    upstream.body = LISTING.replace(b"2048", b"1024")  # restarted with another context length
    models.follow(down, up)
    await settle()
    assert upstream.calls == 2 and models.cached.max_model_len == 1024


async def test_a_listing_without_context_length_is_read_again_one_at_a_time() -> None:
    upstream = FakeUpstream()
    upstream.body = b'{"data":[{"id":"tiny"}]}'
    upstream.gate = asyncio.Event()
    models = registry(upstream)
    up = replace(never_scraped(2.0), ok=True)
    models.follow(up, up)
    models.follow(up, up)
    await settle()
    assert upstream.calls == 1  # the second scrape found the first read still under way
    upstream.gate.set()
    await settle()
    models.follow(up, up)
    await settle()
    assert upstream.calls == 2


async def test_a_failed_read_keeps_the_last_listing() -> None:
    upstream = FakeUpstream()
    models = registry(upstream)
    await models.refresh()
    upstream.status = 500
    models.follow(never_scraped(1.0), replace(never_scraped(2.0), ok=True))
    await settle()
    assert upstream.calls == 2 and models.cached is not None and models.cached.ids == ("tiny",)


async def test_closing_cancels_and_awaits_a_read_still_running() -> None:
    upstream = FakeUpstream()
    upstream.gate = asyncio.Event()  # the engine never answers
    models = registry(upstream)
    models.follow(never_scraped(1.0), replace(never_scraped(2.0), ok=True))
    await settle()
    running = models._refreshing
    assert upstream.calls == 1 and running is not None and not running.done()
    await models.close()
    assert running.cancelled() and models.cached is None
