"""Request fields the gateway acts on, read as vLLM reads them.

vLLM parses a request's JSON body into its pydantic models (FastAPI validates the decoded body in pydantic's
lax mode), so a field declared ``bool`` takes ``1``, ``"yes"``, ``"on"``, ``"t"`` or ``1.0`` as true and a
field declared ``int`` takes ``"12"`` or ``12.0``. A gateway that read only JSON booleans and integers would
see "not asked" where the engine sees "asked" (a stream the gateway believed carried no usage, a request it
believed would stop early). So the values are read here with the same declarations, validated by the same
library: whatever vLLM accepts, and as what, the gateway reads alike, and what vLLM refuses is left for vLLM
to refuse (the caller sends it on as it came). ``tests/unit/engine/test_vllm_reading.py`` checks these readings
against the installed vLLM's own models.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError


class _StreamOptions(BaseModel):
    """``StreamOptions`` of vllm/entrypoints/generate/base/protocol.py (vLLM 0.32; earlier in
    vllm/entrypoints/openai/protocol.py), which allows fields it does not declare."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


_BOOL: TypeAdapter[bool] = TypeAdapter(bool)
_INT: TypeAdapter[int] = TypeAdapter(int)


def stream_usage(options: Any) -> tuple[bool, bool] | None:
    """What a stream's ``stream_options`` (the body's value, None when absent) asks of usage, as vLLM's serving
    code reads it (``should_include_usage``): the final usage chunk, and usage on every chunk (only with the
    former). None: vLLM refuses the value (its own 400)."""
    if options is None:
        return False, False
    try:
        parsed = _StreamOptions.model_validate(options)
    except ValidationError:
        return None
    include = bool(parsed.include_usage)
    return include, include and bool(parsed.continuous_usage_stats)


def flag(body: dict[str, Any], name: str) -> bool | None:
    """A request flag vLLM declares ``bool = False`` (``ignore_eos``): False when absent, None when vLLM refuses
    the value."""
    if name not in body:
        return False
    try:
        return _BOOL.validate_python(body[name])
    except ValidationError:
        return None


def count(body: dict[str, Any], name: str) -> int | None:
    """A request count vLLM declares ``int = 0`` (``min_tokens``): 0 when absent, None when vLLM refuses the
    value."""
    if name not in body:
        return 0
    try:
        return _INT.validate_python(body[name])
    except ValidationError:
        return None
