"""Tenants: the keys file, each tenant's limits and KV share, windows shared through Redis, and usage."""

from gateway.tenants.keys import DEFAULT_TENANT, KeyDirectory, Tenant, load_keys_file
from gateway.tenants.service import Grant, Tenants

__all__ = ["DEFAULT_TENANT", "Grant", "KeyDirectory", "Tenant", "Tenants", "load_keys_file"]
