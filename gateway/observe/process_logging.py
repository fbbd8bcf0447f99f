"""Logging as every gateway process sets it up: the command line's ``serve`` and each worker of ``--workers``."""

from __future__ import annotations

import logging

from gateway.config import Settings
from gateway.observe.access_log import DefaultHandler, install_default_handler
from gateway.redact import SecretRedactor, install_log_redaction


def install_logging(settings: Settings) -> DefaultHandler | None:
    """Returns the access log's handler, to stop last (it writes what is still queued)."""
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Every record, from any logger (uvicorn's, vLLM's relayed lines), has its secrets replaced before it is
    # handled: the places that show URLs and keys redact them already; this catches what they miss.
    install_log_redaction(SecretRedactor(settings.secrets()))
    # The access log on standard output, written by a thread of its own.
    return install_default_handler(settings.access_log)
