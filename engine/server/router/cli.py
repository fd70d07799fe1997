"""`kvstash router --replica URL ... --replica-events PUB,REPLAY ... --tokenizer MODEL_DIR`:
one OpenAI-compatible endpoint in front of `kvstash serve` replicas that sends each request
where its prompt's KV is (docs/serving.md, "Routing across replicas")."""

from __future__ import annotations

from urllib.parse import urlsplit

import click

from engine.server.upstream.cli_options import check_keys, check_urls, front_options, listening_socket

#: ZeroMQ transports a replica's event endpoints may use
_EVENT_SCHEMES = ("tcp", "ipc")


def _check_events(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
) -> list[tuple[str, str]]:
    pairs = []
    for value in values:
        endpoints = [part.strip() for part in value.split(",")]
        if len(endpoints) != 2 or not all(
            urlsplit(e).scheme in _EVENT_SCHEMES and "://" in e and e.split("://", 1)[1] for e in endpoints
        ):
            raise click.BadParameter(
                f"{value!r} is not PUB,REPLAY: two ZeroMQ endpoints (tcp://HOST:PORT) separated by a comma, "
                "those the replica's --kv-events-endpoint and --kv-events-replay-endpoint bound",
                ctx,
                param,
            )
        pairs.append((endpoints[0], endpoints[1]))
    return pairs


@click.command("router")
@click.option(
    "--replica",
    "replica_urls",
    multiple=True,
    required=True,
    callback=check_urls,
    help="A replica (kvstash serve), e.g. http://10.0.0.5:8000; repeat for more.",
)
@click.option(
    "--replica-events",
    "replica_events",
    multiple=True,
    callback=_check_events,
    help="The i-th replica's KV events as PUB,REPLAY endpoints, e.g. tcp://10.0.0.5:5557,tcp://10.0.0.5:5558 "
    "(what its --kv-events-endpoint and --kv-events-replay-endpoint bound); one per --replica, in the "
    "same order. Without any, requests are spread by load alone.",
)
@click.option(
    "--tokenizer",
    "tokenizer_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="The served model's folder (its tokenizer and chat template: prompts are hashed as the replicas "
    "hash them).",
)
@click.option(
    "--costs-interval-s",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    help="Seconds between two reads of each replica's /metrics, whose measured prefill and tier rates "
    "price a token loaded from each tier against one recomputed.",
)
@front_options
def router(
    replica_urls: tuple[str, ...],
    replica_events: list[tuple[str, str]],
    tokenizer_dir: str,
    host: str,
    port: int,
    api_key: str | None,
    engine_api_key: str | None,
    max_request_bytes: int,
    retry_after_s: float,
    costs_interval_s: float,
) -> None:
    """Serve one OpenAI-compatible endpoint in front of kvstash serve replicas (--replica), sending each
    request to the replica that holds most of its prompt's KV for the least queue."""
    engine_api_key = check_keys(api_key, engine_api_key)
    if replica_events and len(replica_events) != len(replica_urls):
        raise click.UsageError(
            f"{len(replica_events)} --replica-events for {len(replica_urls)} --replica: give one per replica, "
            "in the same order, or none"
        )
    sock = listening_socket(host, port)
    from engine.prompts import load_tokenizer

    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except (OSError, ValueError) as error:
        raise click.ClickException(f"--tokenizer {tokenizer_dir}: no tokenizer there ({error})") from None
    from engine.server.listen import serve_on
    from engine.server.router.app import create_router_app

    if not replica_events:
        click.echo(
            "Warning: no --replica-events: requests are spread by load alone, not by their KV", err=True
        )
    app = create_router_app(
        replica_urls,
        replica_events,
        tokenizer,
        api_key=api_key,
        engine_api_key=engine_api_key,
        max_request_bytes=max_request_bytes,
        retry_after_s=retry_after_s,
        costs_interval_s=costs_interval_s,
    )
    serve_on(sock, app, log_level="info", timeout_graceful_shutdown=10)
