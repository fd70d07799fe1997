"""`kvstash proxy --prefill URL ... --decode URL ...`: one OpenAI-compatible endpoint in front
of producer and consumer engines (docs/serving.md, "Disaggregated prefill/decode")."""

from __future__ import annotations

from urllib.parse import urlsplit

import click

from engine.server.guards import DEFAULT_MAX_REQUEST_BYTES
from engine.server.proxy.pool import DEFAULT_RETRY_AFTER_S


def _check_urls(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
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


@click.command("proxy")
@click.option(
    "--prefill",
    "prefill_urls",
    multiple=True,
    callback=_check_urls,
    help="A producer engine (kvstash serve --kv-role producer), e.g. http://10.0.0.5:8000; repeat for more. "
    "Without any, every consumer computes its prompts.",
)
@click.option(
    "--decode",
    "decode_urls",
    multiple=True,
    required=True,
    callback=_check_urls,
    help="A consumer engine (kvstash serve --kv-role consumer); repeat for more. At least one.",
)
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True, help="TCP port; 0 picks a free one.")
@click.option(
    "--api-key",
    envvar="KVSTASH_API_KEY",
    default=None,
    help="Require 'Authorization: Bearer KEY' from clients on /v1/* and /metrics, and send it to the "
    "engines [env: KVSTASH_API_KEY; default: no key].",
)
@click.option(
    "--engine-api-key",
    envvar="KVSTASH_ENGINE_API_KEY",
    default=None,
    help="The engines' API key when it is not --api-key's [env: KVSTASH_ENGINE_API_KEY].",
)
@click.option(
    "--max-request-bytes",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_REQUEST_BYTES,
    show_default=True,
    help="Larger request bodies get 413 before they are read.",
)
@click.option(
    "--retry-after-s",
    type=click.FloatRange(min=0.001),
    default=DEFAULT_RETRY_AFTER_S,
    show_default=True,
    help="An engine that did not answer is left out this long, then tried again.",
)
def proxy(
    prefill_urls: tuple[str, ...],
    decode_urls: tuple[str, ...],
    host: str,
    port: int,
    api_key: str | None,
    engine_api_key: str | None,
    max_request_bytes: int,
    retry_after_s: float,
) -> None:
    """Serve one OpenAI-compatible endpoint in front of producer (--prefill) and consumer
    (--decode) engines: each request is prefilled by a producer, then decoded by a consumer."""
    for name, key in (("--api-key", api_key), ("--engine-api-key", engine_api_key)):
        if key is not None and not key.strip():
            raise click.UsageError(f"{name} is empty; leave it unset to go without a key")
    from engine.server.listen import listen_on, serve_on

    try:
        sock = listen_on(host, port)
    except OSError as error:
        raise click.ClickException(str(error)) from None
    from engine.server.proxy.app import create_proxy_app

    app = create_proxy_app(
        prefill_urls,
        decode_urls,
        api_key=api_key,
        engine_api_key=engine_api_key if engine_api_key is not None else api_key,
        max_request_bytes=max_request_bytes,
        retry_after_s=retry_after_s,
    )
    serve_on(sock, app, log_level="info", timeout_graceful_shutdown=10)
