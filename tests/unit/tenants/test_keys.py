"""The keys file: what it may hold, how a bad one is reported (its line or field, never a key), hashed keys
that match like plain ones, and reloads that keep the old file when the new one is bad."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from pathlib import Path

import pytest

from gateway.errors import ConfigInvalid
from gateway.tenants.keys import DEFAULT, KeysFile, key_digest, load_keys_file
from gateway.tenants.limits import TenantLimits
from tests.support.clock import ManualSleep

SECRET = "sk-search-0f3c9a"
HASHED = "sha256:" + hashlib.sha256(b"sk-batch-77e1d2").hexdigest()

YAML = f"""\
tenants:
  search:
    weight: 3
    priority: 5
    limits:
      requests_per_minute: 600
      tokens_per_minute: 200000
      concurrent_requests: 16
      kv_share: 0.5
    keys:
      - {SECRET}
  batch:
    keys: ["{HASHED}"]
"""

TOML = f"""\
[tenants.search]
weight = 3
priority = 5
keys = ["{SECRET}"]

[tenants.search.limits]
requests_per_minute = 600
tokens_per_minute = 200000
concurrent_requests = 16
kv_share = 0.5

[tenants.batch]
keys = ["{HASHED}"]
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(("name", "text"), [("keys.yaml", YAML), ("keys.toml", TOML)])
def test_yaml_and_toml_files_read_the_same(tmp_path: Path, name: str, text: str) -> None:
    directory = load_keys_file(write(tmp_path, name, text))
    search = directory.tenants["search"]
    assert (search.weight, search.priority) == (3, 5)
    assert search.limits == TenantLimits(
        requests_per_minute=600, tokens_per_minute=200000, concurrent_requests=16, kv_share=0.5
    )
    assert directory.tenants["batch"].limits == TenantLimits()
    assert directory.find(hashlib.sha256(SECRET.encode()).digest()) == search


def test_a_hashed_key_matches_the_key_it_is_the_digest_of(tmp_path: Path) -> None:
    directory = load_keys_file(write(tmp_path, "keys.yaml", YAML))
    batch = directory.find(hashlib.sha256(b"sk-batch-77e1d2").digest())
    assert batch is not None and batch.name == "batch"
    assert directory.find(hashlib.sha256(b"sk-batch-77e1d3").digest()) is None
    assert key_digest(HASHED) == key_digest("sk-batch-77e1d2")


def test_a_tenant_the_file_does_not_name_is_the_unlimited_default(tmp_path: Path) -> None:
    directory = load_keys_file(write(tmp_path, "keys.yaml", YAML))
    assert directory.tenant("default") == DEFAULT
    assert not directory.tenant("default").limits.windowed


BAD = [
    pytest.param("keys.yaml", "tenants:\n  a:\n    weight: 0\n", "line 3, tenants.a.weight", id="a zero weight"),
    pytest.param("keys.yaml", "tenants:\n  a:\n    priority: " + "9" * 40 + "\n", "line 3, tenants.a.priority",
                 id="a priority past the range"),
    pytest.param("keys.yaml", "tenants:\n  a:\n    limits:\n      token_per_minute: 5\n",
                 "line 4, tenants.a.limits.token_per_minute: Extra inputs", id="a misspelt limit"),
    pytest.param("keys.yaml", "tenants:\n  a:\n    limits:\n      kv_share: 1.5\n",
                 "line 4, tenants.a.limits.kv_share", id="a share over 1"),
    pytest.param("keys.yaml", "tenants:\n  a:\n    keys: ['sha256:abc']\n",
                 "line 3, tenants.a.keys: Value error, key #1 starts with 'sha256:' but is not 64 hex digits",
                 id="a hashed key that is no digest"),
    pytest.param("keys.yaml", f"tenants:\n  a:\n    keys: ['{SECRET}']\n  b:\n    keys: ['{SECRET}']\n",
                 "tenants.b.keys.0: the same key is listed in tenants 'a' and 'b'", id="a key in two tenants"),
    pytest.param("keys.yaml", "tenants:\n  'no spaces':\n    weight: 1\n", "tenant name 'no spaces'",
                 id="a tenant name that cannot be a label"),
    pytest.param("keys.yaml", "tenants: [\n", "not valid YAML at line 2", id="broken YAML"),
    pytest.param("keys.yaml", "- a\n", "must hold a mapping", id="a list"),
    pytest.param("keys.yaml", "tenant: {}\n", "line 1, tenants: Field required", id="no tenants table"),
    pytest.param("keys.toml", "[tenants.a\n", "not valid TOML", id="broken TOML"),
    pytest.param("keys.toml", "[tenants.a.limits]\nrequests_per_minute = -1\n",
                 "line 2, tenants.a.limits.requests_per_minute", id="a negative limit in TOML"),
]


@pytest.mark.parametrize(("name", "text", "said"), BAD)
def test_a_bad_file_is_refused_naming_the_line_and_field(tmp_path: Path, name: str, text: str, said: str) -> None:
    with pytest.raises(ConfigInvalid) as caught:
        load_keys_file(write(tmp_path, name, text))
    assert said in caught.value.message
    assert SECRET not in caught.value.message


def test_a_refusal_never_shows_a_key_even_when_the_key_is_the_fault(tmp_path: Path) -> None:
    text = f"tenants:\n  a:\n    keys: [' {SECRET}']\n"
    with pytest.raises(ConfigInvalid) as caught:
        load_keys_file(write(tmp_path, "keys.yaml", text))
    assert "key #1 is empty or has spaces around it" in caught.value.message
    assert SECRET not in caught.value.message


def touch_later(path: Path, text: str) -> None:
    """Rewrite ``path`` with a modification time surely different from the last one."""
    before = path.stat().st_mtime_ns
    path.write_text(text, encoding="utf-8")
    os.utime(path, ns=(before + 10**9, before + 10**9))


def test_a_changed_file_is_reloaded_and_a_bad_one_keeps_the_old(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, "keys.yaml", YAML)
    reloads: list[bool] = []
    keys = KeysFile(path, on_reload=reloads.append)
    assert keys.poll() is False  # unchanged

    touch_later(path, YAML.replace("weight: 3", "weight: 4"))
    assert keys.poll() is True
    assert keys.current.tenants["search"].weight == 4

    with caplog.at_level(logging.WARNING):
        touch_later(path, "tenants: [\n")
        assert keys.poll() is False
        assert keys.poll() is False  # the same bad version is reported once
    assert keys.current.tenants["search"].weight == 4
    assert reloads == [True, False]
    assert len([r for r in caplog.records if "previous version stays in force" in r.getMessage()]) == 1

    touch_later(path, YAML)
    assert keys.poll() is True and keys.current.tenants["search"].weight == 3


async def test_the_watcher_polls_the_file_one_interval_after_its_start_and_each_interval_after(tmp_path: Path) -> None:
    path = write(tmp_path, "keys.yaml", YAML)
    reloads: list[bool] = []
    keys, sleep = KeysFile(path, on_reload=reloads.append), ManualSleep()
    watcher = keys.watcher(2.5, sleep=sleep)
    touch_later(path, YAML.replace("weight: 3", "weight: 4"))
    watcher.start()
    await asyncio.sleep(0)
    assert reloads == [] and sleep.delays == [2.5]
    await sleep.wake_and_run()
    assert reloads == [True] and keys.current.tenants["search"].weight == 4
    await sleep.wake_and_run()
    assert reloads == [True] and sleep.delays == [2.5, 2.5, 2.5]
    await watcher.stop()


def test_a_file_that_disappears_keeps_the_old_version(tmp_path: Path) -> None:
    path = write(tmp_path, "keys.yaml", YAML)
    keys = KeysFile(path)
    path.unlink()
    assert keys.poll() is False
    assert "search" in keys.current.tenants


def test_the_command_line_refuses_to_start_on_a_bad_keys_file_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.cli import main

    path = write(tmp_path, "keys.yaml", f"tenants:\n  a:\n    keys: ['{SECRET}']\n    weight: -1\n")
    assert main(["serve", "--keys-file", str(path)]) == 2
    said = capsys.readouterr().err
    assert "line 4, tenants.a.weight" in said and SECRET not in said
