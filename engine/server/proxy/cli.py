"""`kvstash proxy --prefill URL ... --decode URL ...`: one OpenAI-compatible endpoint in front
of producer and consumer engines (docs/serving.md, "Disaggregated prefill/decode")."""

from __future__ import annotations

import click

from engine.server.upstream.cli_options import check_keys, check_urls, front_options, listening_socket


@click.command("proxy")
@click.option(
    "--prefill",
    "prefill_urls",
    multiple=True,
    callback=check_urls,
    help="A producer engine (kvstash serve --kv-role producer), e.g. http://10.0.0.5:8000; repeat for more. "
    "Without any, every consumer computes its prompts.",
)
@click.option(
    "--decode",
    "decode_urls",
    multiple=True,
    required=True,
    callback=check_urls,
    help="A consumer engine (kvstash serve --kv-role consumer); repeat for more. At least one.",
)
@front_options
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
    engine_api_key = check_keys(api_key, engine_api_key)
    sock = listening_socket(host, port)
    from engine.server.listen import serve_on
    from engine.server.proxy.app import create_proxy_app

    app = create_proxy_app(
        prefill_urls,
        decode_urls,
        api_key=api_key,
        engine_api_key=engine_api_key,
        max_request_bytes=max_request_bytes,
        retry_after_s=retry_after_s,
    )
    serve_on(sock, app, log_level="info", timeout_graceful_shutdown=10)
