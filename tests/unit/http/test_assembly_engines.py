"""Engines assembled side by side must serve one model with one context length: requests are counted and clamped
once, for whichever engine takes them. An engine not reachable at start is not held against the others, and the
first engine, unreachable, serves what the others list until it answers."""

from __future__ import annotations

import pytest

from gateway.config import Settings
from gateway.engine.client import Upstream
from gateway.engine.engine import Engine
from gateway.engine.live import EngineView
from gateway.engine.vllm_api.models import ModelList, ServedModel
from gateway.errors import ConfigInvalid
from gateway.guard.models import Models
from gateway.http.assembly import check_same_model
from gateway.metrics import Metrics

TINY = ModelList((ServedModel("tiny", max_model_len=512),))
TINY_LONGER = ModelList((ServedModel("tiny", max_model_len=1024),))
OTHER = ModelList((ServedModel("other", max_model_len=512),))
TINY_AND_ADAPTER = ModelList((ServedModel("tiny", max_model_len=512), ServedModel("sql-lora", parent="tiny")))


def engine(url: str, listing: ModelList | None) -> Engine[Models]:
    """An engine at ``url`` whose model listing was read at start as ``listing`` (None: it did not answer)."""
    settings = Settings.model_validate({"upstream": [url]})
    client = Upstream(settings, base_url=lambda: url)
    models = Models(settings, client, Metrics())
    if listing is not None:
        models.update(listing)
    view = EngineView(client.get, interval=1.0, stale_after=2.0, metrics=Metrics())
    return Engine(client, models, view)


def pool(*listings: ModelList | None) -> list[Engine[Models]]:
    return [engine(f"http://engine-{i}:8000", listing) for i, listing in enumerate(listings)]


@pytest.mark.parametrize(
    "listings",
    [(TINY, TINY), (TINY, TINY, TINY), (TINY, None), (None, None), (TINY_AND_ADAPTER, TINY_AND_ADAPTER)],
    ids=["two alike", "three alike", "the second not up yet", "none up yet", "alike with an adapter"],
)
def test_engines_that_agree_or_are_not_up_yet_pass(listings: tuple[ModelList | None, ...]) -> None:
    check_same_model(pool(*listings))


@pytest.mark.parametrize(
    ("listings", "said"),
    [
        ((TINY, OTHER), "--upstream http://engine-1:8000 serves ('other',) with max_model_len 512, but "
                        "http://engine-0:8000 serves ('tiny',) with max_model_len 512"),
        ((TINY, TINY_LONGER), "serves ('tiny',) with max_model_len 1024, but http://engine-0:8000 serves ('tiny',) "
                              "with max_model_len 512"),
        ((TINY, TINY_AND_ADAPTER), "serves ('tiny', 'sql-lora')"),
        ((TINY, TINY, OTHER), "--upstream http://engine-2:8000 serves ('other',)"),
        ((None, TINY, OTHER), "--upstream http://engine-2:8000 serves ('other',)"),
    ],
    ids=["another model", "another context length", "another adapter", "the third differs",
         "the first not up, the others differ"],
)
def test_engines_that_disagree_stop_the_start_naming_both(listings: tuple[ModelList | None, ...], said: str) -> None:
    with pytest.raises(ConfigInvalid) as caught:
        check_same_model(pool(*listings))
    assert said in caught.value.message
    assert caught.value.message.endswith("every engine must serve the same model with the same limits")


@pytest.mark.parametrize(
    ("first", "other", "alike"),
    [
        (TINY, TINY, True), (TINY, OTHER, False), (TINY, TINY_LONGER, False), (TINY, TINY_AND_ADAPTER, False),
        (None, OTHER, True), (TINY, None, True),
    ],
    ids=["the same", "another model", "another context length", "another adapter", "the first not up yet",
         "it is not up yet"],
)
def test_an_engine_serves_like_the_first_only_with_the_same_models_and_context_length(
    first: ModelList | None, other: ModelList | None, alike: bool
) -> None:
    engines = pool(first, other)
    assert engines[1].serves_like(engines[0]) is alike


def test_the_first_engine_not_up_yet_takes_the_listing_of_the_first_that_is() -> None:
    engines = pool(None, None, TINY)
    check_same_model(engines)
    assert engines[0].models.cached == TINY


def test_the_message_keeps_the_engines_credentials_out() -> None:
    engines = [engine("http://admin:s3cret@engine-0:8000", TINY), engine("http://admin:s3cret@engine-1:8000", OTHER)]
    with pytest.raises(ConfigInvalid) as caught:
        check_same_model(engines)
    assert "s3cret" not in caught.value.message and "engine-1:8000" in caught.value.message
