"""``nasd-serve [MODEL] [--setting value ...]``: serve a model on the OpenAI API, as ``vllm serve``.

It runs the application ``serve run deployments:build_app`` runs, with the same settings
(``AppArgs``): each is an option here (``redis_url`` is ``--redis-url``), read from its ``NASD_*``
environment variable when not given, and checked the same way. ``--host`` and ``--port`` place
the HTTP server; ``--address`` joins a running Ray cluster instead of starting one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from pydantic import SecretStr, ValidationError

from deployments.builder import ENV_VARS, AppArgs, args_from_env
from deployments.shutdown import drain_on_sigterm

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default_text(name: str) -> str:
    default = AppArgs.model_fields[name].default
    if isinstance(default, SecretStr) or name in ("api_key",):
        return "none"
    return "none" if default is None else json.dumps(default) if isinstance(default, dict) else str(default)


def parser() -> argparse.ArgumentParser:
    """The command's options: one per ``AppArgs`` field, with its description and default."""
    command = argparse.ArgumentParser(
        prog="nasd-serve",
        description="Serve a model on the OpenAI API with n-gram speculative decoding: the application "
        "`serve run deployments:build_app` runs, with the same settings. A setting not given here is read "
        "from its NASD_* environment variable.",
        epilog="Example: nasd-serve Qwen/Qwen2.5-0.5B-Instruct --num-replicas 2 --redis-url redis://127.0.0.1:6379",
    )
    command.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF model id or local dir [NASD_MODEL; default: the embedded SmolLM2-135M]",
    )
    command.add_argument("--host", default=DEFAULT_HOST, help=f"HTTP host (default: {DEFAULT_HOST})")
    command.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"HTTP port (default: {DEFAULT_PORT})"
    )
    command.add_argument(
        "--address", default=None, help="a running Ray cluster to join (default: start one here)"
    )
    settings = command.add_argument_group("settings (each also read from its environment variable)")
    for name, field in AppArgs.model_fields.items():
        if name == "model":
            continue
        settings.add_argument(
            _option(name),
            dest=name,
            default=None,
            metavar="VALUE",
            help=f"{field.description} [{ENV_VARS[name]}; default: {_default_text(name)}]",
        )
    return command


def app_args(options: argparse.Namespace) -> dict[str, Any]:
    """The application's arguments: the environment's ``NASD_*`` settings, then the options given."""
    given = {
        name: getattr(options, name)
        for name in AppArgs.model_fields
        if getattr(options, name, None) is not None
    }
    return {**args_from_env(), **given}


def main(argv: list[str] | None = None) -> int:
    options = parser().parse_args(argv)
    from deployments.builder import build_app

    try:
        args = AppArgs.model_validate(app_args(options))
    except ValidationError as exc:
        print(f"nasd-serve: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    app = build_app(args)
    import ray
    from ray import serve

    # SIGTERM drains, then raises KeyboardInterrupt (set as ray.init returns).
    drain_on_sigterm(args.drain_timeout_s)
    ray.init(address=options.address, ignore_reinit_error=True)
    try:  # Ctrl-C may come while the application is still starting
        serve.start(http_options={"host": options.host, "port": options.port})
        serve.run(app, name="default", route_prefix="/")
        print(f"nasd-serve: serving on http://{options.host}:{options.port}/v1 (Ctrl-C stops)", flush=True)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
