"""Settings: every knob of the gateway, typed, validated, built once.

Sources, highest first: command-line flags, ``VLLM_GUARD_<FLAG>`` environment variables, an optional
YAML/TOML config file, the defaults below. Library code receives a ``Settings`` and never reads the
environment itself.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.durations import parse_duration
from gateway.redact import redact_url, url_has_credentials

ENV_PREFIX = "VLLM_GUARD_"
MANAGED_HANG_TIMEOUT = 60.0  # --hang-timeout's default in managed mode, where a hang means a restart
_BOOL = TypeAdapter(bool)

PromptOverflowPolicy = Literal["reject", "truncate"]
MaxTokensOverflowPolicy = Literal["clamp", "reject"]
AdmissionPolicyName = Literal["strict", "adaptive"]
PrefixSharing = Literal["auto", "on", "off"]
# vLLM's routes that generate outside the guard's counting; --passthrough-route may name only these.
GENERATING_ROUTES = (
    "/v1/messages", "/invocations", "/inference/v1/generate", "/v1/audio/transcriptions", "/v1/audio/translations",
)


class Settings(BaseSettings):
    """The whole configuration. Field descriptions double as ``--help`` texts."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", validate_default=True, frozen=True, populate_by_name=True,
        hide_input_in_errors=True,  # a validation error must not print the keys and URLs it was given
    )

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

    # -- KV admission -----------------------------------------------------------------------------
    kv_target: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Fraction of the engine's KV blocks the gateway may commit; lower it when clients "
        "bypass the gateway.",
    )
    kv_blocks: int | None = Field(
        None, ge=1, description="Engine KV capacity in blocks, when the engine does not publish it."
    )
    kv_tokens: int | None = Field(
        None, ge=1, description="Engine KV capacity in tokens (alternative to --kv-blocks)."
    )
    block_size: int | None = Field(None, ge=1, description="Engine KV block size in tokens, when unpublished.")
    admission_policy: AdmissionPolicyName = Field(
        "adaptive", description="strict: never commit past the ledger; adaptive: use live usage too."
    )
    prefix_sharing: PrefixSharing = Field(
        "auto",
        description="Book prompt blocks shared by requests in flight once, as vLLM's prefix cache holds them: auto "
        "(when the engine reports enable_prefix_caching), on, or off.",
    )
    placement: Literal["prefix", "headroom"] = Field("prefix", description="Which of several engines that can take a "
        "request gets it: prefix (the one holding or lately holding the longest prefix of its prompt, then the one "
        "with the most free blocks) or headroom (the most free blocks only).")
    max_queue: int = Field(256, ge=0, description="Requests allowed to wait for capacity; more get 429.")
    queue_timeout: float = Field(
        30.0, gt=0, description="Seconds a request may wait in the queue before a 503."
    )
    shed_early: Literal["on", "off"] = Field(
        "on", description="on: a queued request forecast to wait past --queue-timeout (from the KV blocks waiting "
        "ahead of it and the rate the engine frees blocks) is refused at once with 503 and that wait as "
        "Retry-After; off: it waits until the timeout."
    )
    max_concurrency: int | None = Field(
        None, ge=1, description="Most requests in flight upstream at once, whatever the KV budget."
    )
    starvation_bound: int = Field(
        8, ge=0, description="How many smaller requests may pass a blocked larger one at the head of the queue."
    )
    fair_queueing: Literal["on", "off"] = Field(
        "on", description="on: the queue serves tenants by weighted fair share of tokens served, priorities within "
        "a tenant; off: one queue by priority, FIFO within a priority."
    )
    tenant_headroom: Literal["on", "off"] = Field(
        "on", description="on (with fair queueing): while two or more tenants are active (sent a request in the last "
        "30 s), a request leaves free the KV blocks each other one recently held and asked for, up to its weighted "
        "fair share; off: a tenant may take every free block."
    )
    time_aware: Literal["on", "off"] = Field(
        "off", description="on: strict also admits when the peak of the engine's usage over the coming steps fits the "
        "budget, the streamed requests in flight ending in turn and the new one growing a token a step (not with "
        "speculative decoding); off: every request in flight counts at its full size at once."
    )
    scrape_interval: float = Field(
        0.25, gt=0, description="Seconds between scrapes of the engine's /metrics."
    )
    metrics_stale_after: float = Field(
        2.0, gt=0, description="Engine metrics older than this are stale and only the ledger is trusted."
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

    # -- HTTP limits and timeouts -----------------------------------------------------------------
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Largest request body accepted; larger gets 413."
    )
    connect_timeout: float = Field(5.0, gt=0, description="Seconds to connect to the upstream.")
    request_timeout: float = Field(
        600.0, gt=0, description="Seconds an upstream request may take in total (streams included)."
    )
    read_timeout: float = Field(
        300.0, gt=0, description="Seconds the upstream may stay silent (first byte or between chunks)."
    )
    upstream_connections: int = Field(
        512, ge=1, description="Most pooled connections to the upstream."
    )

    # -- connection limits ------------------------------------------------------------------------
    max_header_bytes: int = Field(
        32 * 1024, ge=1024, description="Largest request line plus headers, in bytes; larger gets 431."
    )
    max_headers: int = Field(100, ge=1, description="Most headers in one request; more gets 431.")
    header_timeout: float = Field(
        10.0, gt=0, description="Seconds a request line and its headers may take from their first byte; "
        "slower gets 408 and the connection is closed."
    )
    keep_alive_timeout: float = Field(
        5.0, gt=0, description="Seconds a connection may stay idle (just opened, or after a response) before "
        "it is closed."
    )
    max_connections: int = Field(
        2048, ge=1, description="Most client connections open at once; one more gets 503 with Retry-After and "
        "is closed."
    )
    body_timeout: float = Field(
        30.0, gt=0, description="Seconds a request body may take to arrive in total; slower gets 408."
    )
    min_body_rate: float = Field(
        1024.0, ge=0, description="Slowest request body accepted after --body-rate-grace, in bytes per second; "
        "slower gets 408 (0: no minimum)."
    )
    body_rate_grace: float = Field(
        5.0, ge=0, description="Seconds a request body may take before --min-body-rate applies."
    )

    # -- request templates ------------------------------------------------------------------------
    trust_request_chat_template: bool = Field(
        False,
        description="Accept a chat_template sent in a request (as vLLM's flag of the same name; the engine "
        "needs it too). Off: such requests get 400. On: the gateway renders them in a sandboxed worker "
        "process bounded by the --request-template-* limits.",
    )
    request_template_timeout: float = Field(
        1.0, gt=0, le=60, description="Seconds a request's chat_template may take to render; longer gets 400."
    )
    request_template_max_chars: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="Most characters a request's chat_template may render; more gets 400.",
    )
    request_template_memory_mib: int = Field(
        512,
        ge=64,
        description="Memory (MiB of address space) a request template's render may add to its worker process; "
        "more gets 400.",
    )
    request_template_workers: int = Field(
        1,
        ge=1,
        le=32,
        description="Worker processes rendering request templates; further renders queue for one.",
    )

    # -- upstream streams -------------------------------------------------------------------------
    max_stream_event_bytes: int = Field(
        16 * 1024 * 1024,
        ge=64 * 1024,
        description="Largest single server-sent event accepted from the upstream (streams are relayed one whole "
        "event per write, so an event is held until its end); a larger one ends the stream with an error event.",
    )

    # -- managed mode -----------------------------------------------------------------------------
    managed: bool = Field(False, description="Run and supervise vLLM as a child process.")
    model: str | None = Field(None, description="Model to serve in managed mode (path or hub id).")
    vllm_command: str | None = Field(
        None, description="Command that starts vLLM's API server; default: auto-detected."
    )
    vllm_port: int = Field(0, ge=0, le=65535, description="Private port for the managed vLLM (0: pick one).")
    vllm_args: list[str] = Field(
        default_factory=list, description="Extra arguments passed to vllm serve (after --)."
    )
    managed_engines: int | None = Field(
        None, ge=1, le=64, description="vLLM engines to run and supervise in managed mode, each on its own port "
        "(default: one per --engine-devices group, else 1). Each is supervised on its own; restarts roll."
    )
    engine_devices: str | None = Field(
        None, description="Each managed engine's CUDA_VISIBLE_DEVICES, engines separated by ';' "
        "(\"0;1\": one engine per GPU; \"0,1;2,3\": two engines of two GPUs each)."
    )
    restart_every: float | None = Field(
        None, gt=0, json_schema_extra={"duration": True},
        description="Restart the managed engines this often, one at a time while the others serve (a duration: "
        "3600, 90m, 6h, 1d; off by default). The usual cure for slow memory creep.",
    )
    startup_timeout: float = Field(900.0, gt=0, description="Seconds the managed vLLM may take to be ready.")
    hang_timeout: float = Field(
        15.0, gt=0, description="Seconds without progress, while work runs, that count as a hang. Proxy mode: "
        "the engine is refused and its requests cut until it moves again. Managed mode (default there "
        f"{MANAGED_HANG_TIMEOUT:g}): seconds without generated tokens before the engine is restarted."
    )
    drain_timeout: float = Field(
        30.0, ge=0, description="Seconds in-flight requests may finish before a restart cuts them."
    )
    max_restarts: int = Field(
        10, ge=0, description="Restarts allowed within --restart-window before the gateway gives up."
    )
    restart_window: float = Field(600.0, gt=0, description="Window for --max-restarts, in seconds.")
    autofit_attempts: int = Field(4, ge=0, description="Start-up auto-fit retries before giving up.")
    fragmentation_growth_mib: int = Field(
        2048, ge=0, description="Growth of vLLM's GPU memory past its post-start baseline that forces a restart."
    )
    preemption_storm: int = Field(
        50, ge=0, description="Preemptions within a minute that count as a storm and force a restart (0: off)."
    )

    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")

    @field_validator("restart_every", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Any:
        return parse_duration(v) if isinstance(v, str) else v

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
        for key in self.api_key:
            _split_key(key)
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
        return self

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

    def engine_count(self) -> int:
        """How many engines managed mode runs."""
        return self.managed_engines or max(1, len(self.device_groups()))

    def key_priorities(self) -> dict[str, int]:
        """Client API keys mapped to their default priority (0 when none is given)."""
        return dict(_split_key(k) for k in self.api_key)


def _split_key(spec: str) -> tuple[str, int]:
    key, sep, prio = spec.rpartition("=")
    if not sep or not key:
        return spec, 0
    try:
        return key, int(prio)
    except ValueError:
        # An '=' inside a key without a number after it is part of the key.
        return spec, 0
