"""Flags and checks `kvstash proxy` and `kvstash router` share: engine URLs, the clients'
and the engines' API keys, the body size limit, how long a failed engine is left out, and
listening (the port taken before anything else starts)."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

import click

from engine.server.guards import DEFAULT_MAX_REQUEST_BYTES
from engine.server.upstream.pool import DEFAULT_RETRY_AFTER_S


def check_urls(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    """Each value an ``http(s)://HOST[:PORT]`` URL (a click callback)."""
    for value in values:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise click.BadParameter(
                f"{value!r} is no http(s)://HOST:PORT URL of a kvstash serve", ctx, param
            )
        try:
            parts.port  # noqa: B018 - raises on a port that is no number
        except ValueError:
            raise click.BadParameter(f"{value!r}: the port is no number", ctx, param) from None
    return values


def check_keys(api_key: str | None, engine_api_key: str | None) -> str | None:
    """Refuses empty keys; returns the key to send to the engines (``--api-key``'s when
    ``--engine-api-key`` is not given)."""
    for name, key in (("--api-key", api_key), ("--engine-api-key", engine_api_key)):
        if key is not None and not key.strip():
            raise click.UsageError(f"{name} is empty; leave it unset to go without a key")
    return engine_api_key if engine_api_key is not None else api_key


def front_options(command: Callable) -> Callable:
    """``--host --port --api-key --engine-api-key --max-request-bytes --retry-after-s``."""
    options = [
        click.option("--host", default="0.0.0.0", show_default=True, help="Address to listen on."),
        click.option(
            "--port", type=int, default=8000, show_default=True, help="TCP port; 0 picks a free one."
        ),
        click.option(
            "--api-key",
            envvar="KVSTASH_API_KEY",
            default=None,
            help="Require 'Authorization: Bearer KEY' from clients on /v1/* and /metrics, and send it to "
            "the engines [env: KVSTASH_API_KEY; default: no key].",
        ),
        click.option(
            "--engine-api-key",
            envvar="KVSTASH_ENGINE_API_KEY",
            default=None,
            help="The engines' API key when it is not --api-key's [env: KVSTASH_ENGINE_API_KEY].",
        ),
        click.option(
            "--max-request-bytes",
            type=click.IntRange(min=1),
            default=DEFAULT_MAX_REQUEST_BYTES,
            show_default=True,
            help="Larger request bodies get 413 before they are read.",
        ),
        click.option(
            "--retry-after-s",
            type=click.FloatRange(min=0.001),
            default=DEFAULT_RETRY_AFTER_S,
            show_default=True,
            help="An engine that did not answer is left out this long, then tried again.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def listening_socket(host: str, port: int):
    """The bound listening socket, or one clear error line (exit 1) when it cannot be had."""
    from engine.server.listen import listen_on

    try:
        return listen_on(host, port)
    except OSError as error:
        raise click.ClickException(str(error)) from None
