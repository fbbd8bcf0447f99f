"""Settings: every knob of the gateway, typed, validated, built once.

Sources, highest first: command-line flags, ``VLLM_GUARD_<FLAG>`` environment variables, an optional
YAML/TOML config file, the defaults below. Library code receives a ``Settings`` and never reads the
environment itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal, Self

from pydantic import Field, PrivateAttr, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.config_admission import AdmissionFields
from gateway.config_http import HttpFields
from gateway.config_managed import MANAGED_HANG_TIMEOUT, ManagedFields
from gateway.config_observe import ObserveFields
from gateway.redact import redact_url, url_has_credentials, url_secrets
from gateway.vllm_args import arg_value

ENV_PREFIX = "VLLM_GUARD_"
_BOOL = TypeAdapter(bool)

PromptOverflowPolicy = Literal["reject", "truncate"]
MaxTokensOverflowPolicy = Literal["clamp", "reject"]
# vLLM's routes that generate outside the guard's counting; --passthrough-route may name only these.
GENERATING_ROUTES = (
    "/v1/messages", "/invocations", "/inference/v1/generate", "/v1/audio/transcriptions", "/v1/audio/translations",
)


class Settings(BaseSettings, AdmissionFields, HttpFields, ManagedFields, ObserveFields):
    """The whole configuration. Field descriptions double as ``--help`` texts; the groups of fields of
    one concern live in the ``config_*`` modules."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", validate_default=True, frozen=True, populate_by_name=True,
        hide_input_in_errors=True,  # a validation error must not print the keys and URLs it was given
    )
    _key_priorities: Mapping[str, int] = PrivateAttr(default_factory=dict)

    # -- where things are -------------------------------------------------------------------------
    upstream: list[str] = Field(
        ["http://127.0.0.1:8000"],
        description="Base URL of the vLLM server to guard; repeat it (or separate with commas) for several servers "
        "serving the same model.",
    )
    host: str = Field("0.0.0.0", description="Address the gateway listens on.")
    port: int = Field(8080, ge=1, le=65535, description="Port the gateway listens on.")
    tokenizer: str | None = Field(
        None,
        description="Tokenizer: a local directory or a hub id (cache only when offline). "
        "Default: the upstream's /v1/models root; if none can be loaded, the upstream's /tokenize.",
    )
    served_model_name: str | None = Field(
        None, description="Model name clients use; default: the upstream's first model (managed: --model)."
    )

    # -- token policy -----------------------------------------------------------------------------
    max_model_len: int | None = Field(
        None, ge=1, description="Context length to enforce; may only lower what the upstream reports."
    )
    max_prompt_tokens: int | None = Field(None, ge=1, description="Largest prompt accepted, in tokens.")
    max_output_tokens: int | None = Field(
        None, ge=1, description="Largest max_tokens sent upstream; also the default when a client omits it."
    )
    min_output_tokens: int = Field(
        16, ge=1, description="Room left for the answer when truncating a prompt whose max_tokens is unset."
    )
    on_prompt_overflow: PromptOverflowPolicy = Field(
        "reject", description="Prompt too long: reject (400 context_length_exceeded) or truncate."
    )
    on_max_tokens_overflow: MaxTokensOverflowPolicy = Field(
        "clamp", description="max_tokens larger than what is left of the context: clamp or reject."
    )

    # -- auth -------------------------------------------------------------------------------------
    api_key: list[str] = Field(
        default_factory=list,
        description="Accepted client API key (repeatable). KEY or KEY=PRIORITY. None: no auth.",
    )
    admin_api_key: list[str] = Field(
        default_factory=list, description="Key allowed to call admin endpoints such as POST /guard/restart."
    )
    upstream_api_key: str | None = Field(None, description="API key sent to the upstream vLLM.")

    # -- tenants ----------------------------------------------------------------------------------
    keys_file: str | None = Field(
        None,
        description="YAML or TOML file of tenants: their keys (plain or sha256:<hex>), weight, default priority and "
        "limits (requests and tokens per minute, concurrent requests, KV share); re-read when it changes.",
    )
    redis_url: str | None = Field(
        None,
        description="Redis shared by gateway replicas for the tenants' limits (redis://host:6379/0); unreachable: "
        "each replica enforces them alone until it is back.",
    )

    # -- routes -----------------------------------------------------------------------------------
    passthrough_route: list[str] = Field(
        default_factory=list,
        description="A vLLM generating route to forward unguarded (repeatable), e.g. /v1/messages; "
        "unnamed ones are 404. One of: " + ", ".join(GENERATING_ROUTES) + ".",
    )

    @field_validator("passthrough_route")
    @classmethod
    def _known_generating_routes(cls, v: list[str]) -> list[str]:
        for path in v:
            if path not in GENERATING_ROUTES:
                raise ValueError(
                    f"{path!r} is not a vLLM generating route the gateway can pass through; "
                    f"choose from {', '.join(GENERATING_ROUTES)}"
                )
        return list(dict.fromkeys(v))

    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")

    @field_validator("upstream", mode="before")
    @classmethod
    def _upstream_list(cls, v: Any) -> Any:
        # One URL, or several separated by commas (a config file's or a caller's plain string).
        return [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v

    @field_validator("upstream")
    @classmethod
    def _strip_slash(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("--upstream needs at least one URL")
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"upstream must be an http(s) URL, got {redact_url(url)!r}")
        urls = [url.rstrip("/") for url in v]
        if len(set(urls)) != len(urls):
            raise ValueError("--upstream names the same server twice")
        return urls

    @model_validator(mode="before")
    @classmethod
    def _managed_hang_timeout(cls, data: Any) -> Any:
        # A restart costs minutes of serving, refusing a hung engine nothing: the managed bound stays longer.
        if isinstance(data, dict) and "hang_timeout" not in data:
            try:
                managed = _BOOL.validate_python(data.get("managed", False))
            except ValidationError:
                return data  # the field's own validation reports it
            if managed:
                return {**data, "hang_timeout": MANAGED_HANG_TIMEOUT}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.managed and not self.model:
            raise ValueError("--managed needs --model")
        prompt_cap, context = self.max_prompt_tokens, self.max_model_len
        if prompt_cap is not None and context is not None and prompt_cap >= context:
            raise ValueError(
                f"--max-prompt-tokens ({self.max_prompt_tokens}) must be below --max-model-len "
                f"({self.max_model_len}) to leave room for output"
            )
        if self.managed and len(self.upstream) > 1:
            raise ValueError("--managed runs its own engines (--managed-engines): give no second --upstream")
        groups = self.device_groups()
        if self.managed_engines is not None and len(groups) > 1 and len(groups) != self.managed_engines:
            raise ValueError(
                f"--managed-engines is {self.managed_engines} but --engine-devices names {len(groups)} engines "
                f"({self.engine_devices!r})"
            )
        if not self.managed and (self.managed_engines or self.engine_devices or self.restart_every):
            raise ValueError("--managed-engines, --engine-devices and --restart-every need --managed")
        if self.upstream_api_key and not self.managed and any(url_has_credentials(u) for u in self.upstream):
            # Both would be the one Authorization header (Basic from the URL, Bearer from the key).
            raise ValueError("--upstream carries credentials and --upstream-api-key is set: give only one")
        self._derive()
        return self

    def _derive(self) -> None:
        # What the request path reads of the settings on every request, worked out once.
        self._key_priorities = MappingProxyType(dict(_split_key(k) for k in self.api_key))

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        copy = super().model_copy(update=update, deep=deep)
        copy._derive()  # a copy is not validated: what derives from its fields is derived again
        return copy

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # build_settings merges file, environment and flags itself, so construction stays pure.
        return (init_settings,)

    # -- derived ----------------------------------------------------------------------------------
    def device_groups(self) -> list[str]:
        """Each managed engine's CUDA_VISIBLE_DEVICES, as ``--engine-devices`` names them (none: no list)."""
        return [g.strip() for g in (self.engine_devices or "").split(";") if g.strip()]

    def watermark(self) -> float:
        """The fraction of KV blocks the engine keeps free when admitting beside running requests: the flag, else
        in managed mode vLLM's own ``--watermark`` among its arguments (its last value, as vLLM reads it)."""
        if self.engine_watermark is not None:
            return self.engine_watermark
        value = arg_value(self.vllm_args, "--watermark") if self.managed else None
        try:
            fraction = float(value) if value is not None else 0.0
        except ValueError:
            return 0.0  # vLLM refuses to start with it, and says why
        return fraction if 0.0 <= fraction < 1.0 else 0.0

    def engine_count(self) -> int:
        """How many engines managed mode runs."""
        return self.managed_engines or max(1, len(self.device_groups()))

    def key_priorities(self) -> Mapping[str, int]:
        """Client API keys mapped to their default priority (0 when none is given)."""
        return self._key_priorities

    def secrets(self) -> list[str]:
        """Every secret the settings hold, for the log redaction (``SecretRedactor``): client, admin and upstream
        keys, the upstream URL's password."""
        keys = [*self.key_priorities(), *self.api_key, *self.admin_api_key]
        if self.upstream_api_key:
            keys.append(self.upstream_api_key)
        return [*keys, *(s for url in self.upstream for s in url_secrets(url))]


# The largest priority, either way: a request's (x-guard-priority), an API key's or a tenant's. Priorities are only
# compared, but they travel on the workers' channel as 64-bit integers, and a 40-digit one failed there (a 500
# with --workers where one process answered 200); a 32-bit range is what any scheduler's priority takes.
PRIORITY_LIMIT = 2**31 - 1


def priority_in_range(value: int, what: str) -> int:
    """``value``, or a ValueError stating the range, naming ``what`` (the header, the flag, the field)."""
    if not -PRIORITY_LIMIT <= value <= PRIORITY_LIMIT:
        raise ValueError(f"{what} must be an integer from -{PRIORITY_LIMIT} to {PRIORITY_LIMIT}; got {value}")
    return value


def _split_key(spec: str) -> tuple[str, int]:
    key, sep, prio = spec.rpartition("=")
    if not sep or not key:
        return spec, 0
    try:
        value = int(prio)
    except ValueError:
        # An '=' inside a key without a number after it is part of the key.
        return spec, 0
    return key, priority_in_range(value, "the priority of an --api-key")
