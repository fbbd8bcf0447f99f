"""Command line: flags + environment + config file -> Settings; subcommands. No logic here.

Every Settings field is a flag of ``serve`` (``--kv-target``), an environment variable
(``VLLM_GUARD_KV_TARGET``) and a key of the optional ``--config`` file (YAML or TOML).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

from gateway import __version__
from gateway.config import ENV_PREFIX, Settings
from gateway.settings_sources import build_settings, load_config_file

# Short flag names (as docs/reference/configuration.md shows them) where the Settings field name differs.
FLAG_ALIASES = {"api_key": "--api-key", "admin_api_key": "--admin-api-key"}


def _field_flag(name: str) -> str:
    return FLAG_ALIASES.get(name, "--" + name.replace("_", "-"))


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per Settings field; defaults are None so that only flags actually given override."""
    for name, field in Settings.model_fields.items():
        if name == "vllm_args":
            continue  # taken from everything after "--"
        flag = _field_flag(name)
        help_text = f"{field.description} [env {ENV_PREFIX}{name.upper()}; default {field.get_default()!r}]"
        ann = field.annotation
        args = typing.get_args(ann)
        origin = typing.get_origin(ann)
        if ann is bool:
            parser.add_argument(flag, dest=name, action="store_true", default=None, help=help_text)
        elif origin is list:
            parser.add_argument(flag, dest=name, action="append", default=None, metavar="VALUE", help=help_text)
        elif origin is typing.Literal:
            parser.add_argument(flag, dest=name, choices=list(args), default=None, help=help_text)
        else:
            is_optional = origin in (typing.Union, types.UnionType)
            base = next((a for a in args if a is not type(None)), ann) if is_optional else ann
            conv: Callable[[str], Any] = int if base is int else float if base is float else str
            if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("duration"):
                conv = str  # "6h": the field parses it
            parser.add_argument(flag, dest=name, type=conv, default=None, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-guard", description="An OpenAI-compatible guarding proxy in front of vLLM."
    )
    parser.add_argument("--version", action="version", version=f"vllm-guard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the gateway",
        description="Run the gateway in front of --upstream, or (--managed) run and supervise vLLM itself. "
        "Arguments after '--' are passed to vllm serve in managed mode.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument("--config", help="YAML or TOML file with settings (keys as the flags, without --)")
    add_settings_arguments(serve)

    plan = sub.add_parser("plan", help="what fits on a GPU: weights, KV bytes per token, max_model_len")
    doctor = sub.add_parser("doctor", help="check GPU, stale processes, upstream and configuration")
    # A missing dependency must fail loudly here: swallowed, it showed up as "unrecognized arguments".
    from gateway.tools import doctor as doctor_mod
    from gateway.tools import planner

    planner.add_plan_arguments(plan)
    doctor_mod.add_doctor_arguments(doctor)
    return parser


def parse_serve(argv: Sequence[str], env: dict[str, str]) -> Settings:
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    if extra:
        flags["vllm_args"] = extra
    file_values = load_config_file(args.config) if args.config else None
    return build_settings(flags, file_values, env)


def main(argv: Sequence[str] | None = None) -> int:
    # The tokenizer's own worker threads only fight the gateway's for the CPU (measured: a batch took 68 ms
    # with them, 35 ms without, on 2 cores); counting is already parallel across requests.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "serve":
        args = build_parser().parse_args(argv)
        if args.command == "plan":
            from gateway.tools.planner import run_plan

            return run_plan(args)
        if args.command == "doctor":
            from gateway.tools.doctor import run_doctor

            return run_doctor(args)
        return 2
    try:
        settings = parse_serve(argv, dict(os.environ))
        if settings.keys_file:
            from gateway.tenants import load_keys_file

            load_keys_file(settings.keys_file)  # a bad keys file stops the start with its line and field
    except ValidationError as exc:
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "settings"
            print(f"vllm-guard: invalid {_field_flag(loc) if loc in Settings.model_fields else loc}: {err['msg']}",
                  file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"vllm-guard: {exc}", file=sys.stderr)
        return 2
    return serve(settings)


def serve(settings: Settings) -> int:
    from gateway.http.app import create_app
    from gateway.http.serving import build_server, sockets_for
    from gateway.http.workers import WorkerPlan
    from gateway.observe.process_logging import install_logging

    access = install_logging(settings)
    plan = WorkerPlan.for_settings(settings)  # --workers: this process is the admission authority
    server = build_server(create_app(settings, plan), settings)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=sockets_for(settings, plan))
    finally:
        if plan is not None:
            plan.remove()
        if access is not None:
            access.stop()
    return 0 if server.started else 3


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
