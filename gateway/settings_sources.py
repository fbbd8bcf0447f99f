"""Where settings come from besides flags: the optional config file (YAML or TOML) and the environment, merged
into one ``Settings`` (flags over environment over file over defaults)."""

from __future__ import annotations

import shlex
import tomllib
from pathlib import Path
from typing import Any

import yaml

from gateway.config import ENV_PREFIX, Settings


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or TOML config file into field values (keys with '-' or '_' both accepted)."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    data: Any = tomllib.loads(text) if p.suffix == ".toml" else yaml.safe_load(text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {p} must hold a mapping, not {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def build_settings(
    flags: dict[str, Any], file_values: dict[str, Any] | None = None, env: dict[str, str] | None = None
) -> Settings:
    """Merge the sources: flags over environment over file over defaults.

    ``env`` is passed in by the caller (the CLI hands ``os.environ``) so that this module stays pure.
    """
    merged: dict[str, Any] = dict(file_values or {})
    merged.update(_env_values(env or {}))
    merged.update({k: v for k, v in flags.items() if v is not None})
    return Settings.model_validate(merged)


def _env_values(env: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    list_fields = {n for n, f in Settings.model_fields.items() if f.annotation == list[str]}
    for name in Settings.model_fields:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        if name in list_fields:
            # Comma-separated, or a JSON list; vllm_args is split like a shell line.
            if name == "vllm_args":
                out[name] = shlex.split(raw)
            elif raw.lstrip().startswith("["):
                out[name] = yaml.safe_load(raw)
            else:
                out[name] = [p.strip() for p in raw.split(",") if p.strip()]
        else:
            out[name] = raw
    return out
