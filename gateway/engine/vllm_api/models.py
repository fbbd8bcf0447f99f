"""vLLM's ``/v1/models`` answer read into one typed record, and rewritten with the gateway's context limit.

vLLM lists its base model first (once per ``--served-model-name``), then any LoRA adapters, which name the base
model in ``parent`` and carry no ``max_model_len`` of their own. The shape has not changed since 0.4.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.errors import BadUpstreamResponse


@dataclass(frozen=True, slots=True)
class ServedModel:
    id: str
    root: str | None = None  # the model's path or hub id: where its tokenizer can be loaded from
    max_model_len: int | None = None
    parent: str | None = None


@dataclass(frozen=True, slots=True)
class ModelList:
    """Every model the engine serves; ``root`` and ``max_model_len`` are the first (base) model's."""

    models: tuple[ServedModel, ...] = ()
    ids: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        # Checked on every guarded request: built once.
        object.__setattr__(self, "ids", tuple(m.id for m in self.models))

    @property
    def first(self) -> ServedModel | None:
        return self.models[0] if self.models else None

    @property
    def root(self) -> str | None:
        return self.models[0].root if self.models else None

    @property
    def max_model_len(self) -> int | None:
        return self.models[0].max_model_len if self.models else None


def parse_models(payload: bytes) -> ModelList:
    """The models of a ``/v1/models`` body. Entries without a string ``id`` are skipped and fields of the wrong
    type read as absent; a body that is not a model list at all raises ``BadUpstreamResponse``."""
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise BadUpstreamResponse(f"The upstream's /v1/models answer is not JSON ({exc}).") from exc
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise BadUpstreamResponse("The upstream's /v1/models answer is not a model list (no `data` array).")
    return ModelList(tuple(model for entry in entries if (model := _model(entry)) is not None))


def _model(entry: object) -> ServedModel | None:
    if not isinstance(entry, dict):
        return None
    model_id = _text(entry.get("id"))
    if model_id is None:
        return None
    mml = entry.get("max_model_len")
    valid_mml = isinstance(mml, int) and not isinstance(mml, bool) and mml > 0
    return ServedModel(
        model_id, _text(entry.get("root")), mml if valid_mml else None, _text(entry.get("parent"))
    )


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def rewrite_max_model_len(payload: bytes, max_model_len: int | None) -> bytes:
    """The ``/v1/models`` body as the engine wrote it, with every ``max_model_len`` lowered to the gateway's
    limit (``None``: unchanged)."""
    data: Any = orjson.loads(payload)
    if max_model_len is not None and isinstance(data, dict):
        for entry in data.get("data") or []:
            if isinstance(entry, dict):
                entry["max_model_len"] = max_model_len
    return orjson.dumps(data)
