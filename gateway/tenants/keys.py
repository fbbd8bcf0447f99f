"""The keys file (``--keys-file``): tenants, their keys, weight, default priority and limits.

YAML or TOML by the file's extension (``.toml``; anything else is read as YAML)::

    tenants:
      search:
        weight: 3            # share of the engine under contention (fair queueing)
        priority: 5          # default x-guard-priority of its requests
        limits: {requests_per_minute: 600, tokens_per_minute: 200000, concurrent_requests: 16, kv_share: 0.5}
        keys:
          - sk-search-1                 # a plain key
          - sha256:9f86d0...0a08        # or its SHA-256 digest, in hex

A key is matched by its SHA-256 digest, so a hashed key works like a plain one and the file need not hold
secrets. Errors name the tenant and field, and the line in a YAML file (a TOML file's syntax errors carry
their own), never a key's value. ``KeysFile`` re-reads the file when it changes; a file that no longer parses
leaves the previous one in force.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import tomllib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway.config import PRIORITY_LIMIT
from gateway.errors import ConfigInvalid
from gateway.periodic import Periodic
from gateway.tenants.limits import NO_LIMITS, TenantLimits

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
HASHED_PREFIX = "sha256:"
# Tenant names become metric labels and Redis keys: short, plain.
_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_HEX_DIGEST = re.compile(r"^[0-9a-fA-F]{64}$")
POLL_SECONDS = 1.0


class TenantSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    weight: float = Field(default=1.0, gt=0.0, le=1000.0)
    priority: int = Field(default=0, ge=-PRIORITY_LIMIT, le=PRIORITY_LIMIT)
    limits: TenantLimits = NO_LIMITS
    keys: list[str] = Field(default_factory=list)

    @field_validator("keys")
    @classmethod
    def _well_formed(cls, keys: list[str]) -> list[str]:
        for i, key in enumerate(keys):
            if key != key.strip() or not key:
                raise ValueError(f"key #{i + 1} is empty or has spaces around it")
            if key.startswith(HASHED_PREFIX) and not _HEX_DIGEST.match(key[len(HASHED_PREFIX):]):
                raise ValueError(f"key #{i + 1} starts with {HASHED_PREFIX!r} but is not 64 hex digits after it")
        return keys


class KeysFileModel(BaseModel):
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    tenants: dict[str, TenantSpec]

    @field_validator("tenants")
    @classmethod
    def _names(cls, tenants: dict[str, TenantSpec]) -> dict[str, TenantSpec]:
        for name in tenants:
            if not _TENANT_NAME.match(name):
                raise ValueError(f"tenant name {name!r} must be 1-64 letters, digits, '.', '_' or '-'")
        return tenants


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    weight: float = 1.0
    priority: int = 0
    limits: TenantLimits = NO_LIMITS


DEFAULT = Tenant(DEFAULT_TENANT)


@dataclass(frozen=True, slots=True)
class KeyDirectory:
    """One version of the keys file: every key's digest with its tenant's name, and the tenants."""

    tenants: dict[str, Tenant] = field(default_factory=dict)
    digests: tuple[tuple[bytes, str], ...] = ()

    @property
    def has_keys(self) -> bool:
        return bool(self.digests)

    def tenant(self, name: str) -> Tenant:
        """The tenant ``name``; the unnamed callers' tenant is ``default`` (limited when the file names it)."""
        found = self.tenants.get(name)
        if found is not None:
            return found
        return DEFAULT if name == DEFAULT_TENANT else Tenant(name)

    def find(self, digest: bytes) -> Tenant | None:
        """The tenant of the key with SHA-256 ``digest``, comparing in constant time with every key."""
        found: str | None = None
        for key_digest, tenant in self.digests:
            if hmac.compare_digest(digest, key_digest):
                found = tenant
        return None if found is None else self.tenants[found]


def key_digest(key: str) -> bytes:
    """A configured key's digest: ``sha256:<hex>`` as written, a plain key hashed as the UTF-8 a client sends."""
    if key.startswith(HASHED_PREFIX):
        return bytes.fromhex(key[len(HASHED_PREFIX):])
    return hashlib.sha256(key.encode("utf-8")).digest()


def load_keys_file(path: str | Path) -> KeyDirectory:
    """Read and check the keys file; ``ConfigInvalid`` names what is wrong and where."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    data = _parse(p, text)
    try:
        model = KeysFileModel.model_validate(data)
    except ValidationError as exc:
        raise ConfigInvalid(_validation_message(p, text, exc)) from None
    return _directory(p, model)


def _parse(p: Path, text: str) -> Any:
    try:
        data = tomllib.loads(text) if p.suffix == ".toml" else yaml.safe_load(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigInvalid(f"keys file {p}: not valid TOML: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigInvalid(f"keys file {p}: not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    if not isinstance(data, dict):
        raise ConfigInvalid(f"keys file {p} must hold a mapping with a 'tenants' table")
    return data


def _validation_message(p: Path, text: str, exc: ValidationError) -> str:
    problems = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        line = _toml_line(text, loc) if p.suffix == ".toml" else _yaml_line(text, loc)
        where = f"line {line}, " if line is not None else ""
        problems.append(f"{where}{'.'.join(str(x) for x in loc) or 'file'}: {err['msg']}")
    return f"keys file {p}: " + "; ".join(problems)


def _directory(p: Path, model: KeysFileModel) -> KeyDirectory:
    tenants: dict[str, Tenant] = {}
    owner: dict[bytes, str] = {}
    for name, spec in model.tenants.items():
        tenants[name] = Tenant(name, spec.weight, spec.priority, spec.limits)
        for i, key in enumerate(spec.keys):
            digest = key_digest(key)
            other = owner.setdefault(digest, name)
            if other != name or spec.keys.index(key) != i:
                where = "twice in tenant" if other == name else f"in tenants {other!r} and"
                raise ConfigInvalid(f"keys file {p}: tenants.{name}.keys.{i}: the same key is listed {where} {name!r}")
    return KeyDirectory(tenants, tuple(owner.items()))


def _yaml_line(text: str, loc: tuple[int | str, ...]) -> int | None:
    """The 1-based line of the node at ``loc`` (as far as it exists) in a YAML document."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    if node is None:
        return None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = next(((k, v) for k, v in node.value if k.value == str(part)), None)
            if nxt is None:
                break
            node = nxt[0] if isinstance(nxt[1], yaml.MappingNode | yaml.SequenceNode) and part == loc[-1] else nxt[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
        else:
            break
    return int(node.start_mark.line) + 1


def _toml_line(text: str, loc: tuple[int | str, ...]) -> int | None:
    """The 1-based line of ``loc``'s key in a TOML document: under the deepest table header it names."""
    lines = text.splitlines()
    names = [str(x) for x in loc if isinstance(x, str)]
    start, depth = 0, 0
    for i, line in enumerate(lines):
        header = re.match(r"^\s*\[([^\[\]]+)\]\s*$", line)
        if header:
            parts = [s.strip().strip('"') for s in header.group(1).split(".")]
            if parts == names[: len(parts)] and len(parts) >= depth:
                start, depth = i, len(parts)
    rest = names[depth:]
    if not rest:
        return start + 1 if depth else None
    key = re.compile(rf"^\s*{re.escape(rest[0])}\s*=")
    for i in range(start, len(lines)):
        if key.match(lines[i]):
            return i + 1
    return start + 1 if depth else None


class KeysFile:
    """The keys file in force, re-read when its modification time or size changes. ``watch`` is the polling
    loop (its owner cancels it); a file that fails to load keeps the previous version and logs why once."""

    def __init__(self, path: str | Path, *, on_reload: Callable[[bool], None] | None = None) -> None:
        self.path = Path(path)
        self._on_reload = on_reload
        self._stamp = self._stat()
        self.current = load_keys_file(self.path)
        self._failed_stamp: tuple[int, int] | None = None

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def poll(self) -> bool:
        """Re-read the file if it changed; True when a new version is in force."""
        stamp = self._stat()
        if stamp is None or stamp == self._stamp or stamp == self._failed_stamp:
            return False
        try:
            directory = load_keys_file(self.path)
        except (ConfigInvalid, OSError, UnicodeDecodeError) as exc:
            self._failed_stamp = stamp
            log.warning("keys file %s not reloaded, the previous version stays in force: %s", self.path, exc)
            if self._on_reload is not None:
                self._on_reload(False)
            return False
        self._stamp, self._failed_stamp, self.current = stamp, None, directory
        log.info("keys file %s reloaded: %d tenants, %d keys", self.path, len(directory.tenants),
                 len(directory.digests))
        if self._on_reload is not None:
            self._on_reload(True)
        return True

    def watcher(self, interval: float = POLL_SECONDS,
                sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> Periodic:
        """The loop that polls the file every ``interval`` seconds, the first time one interval after its start."""
        # A stat and, rarely, a small parse: cheap enough for the event loop.
        return Periodic(self.poll, interval, name="keys-file-watch", immediately=False,
                        failed=f"watching the keys file {self.path} failed", logger=log, sleep=sleep)
