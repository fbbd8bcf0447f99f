"""Settings of managed mode: running and supervising vLLM (a part of ``Settings``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator

from gateway.durations import parse_duration

MANAGED_HANG_TIMEOUT = 60.0  # --hang-timeout's default in managed mode, where a hang means a restart


class ManagedFields(BaseModel):
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
    engine_core_nice: int | None = Field(
        None, ge=-20, le=19, description="Managed mode: run vLLM's engine core processes at this niceness once the "
        "engine is ready (off by default). Its busy loop spins while it waits for its worker; where it shares CPU "
        "cores with vLLM's API server and the gateway (a small host, the CPU build), 10 gives them their turns."
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

    @field_validator("restart_every", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Any:
        return parse_duration(v) if isinstance(v, str) else v
