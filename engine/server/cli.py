"""`kvstash serve MODEL [engine flags] [--kv-offload ...]`: the OpenAI-compatible server."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import click

from connector.config import KV_TRANSFERS
from engine.config import KV_ROLES
from engine.engine_flags import engine_args_from_options, engine_options
from engine.offload_cli import offload_config_from_options, offload_options
from engine.server.guards import DEFAULT_MAX_REQUEST_BYTES

#: serve's default `--max-decode-gap-ms` (`EngineArgs`, `LLM`, `generate` and `bench` keep 0,
#: off). A server has streams decoding while new prompts arrive, and without the cap each
#: long prompt's steps stall them: on one H100 (8B shape, bf16, benchmarks/head_of_line.py)
#: a decode waited 229 ms between two tokens while a 16k-token hit loaded from disk and
#: 369 ms while a 16k prompt was recomputed. At 50 ms its gaps were 29-33 ms (the cap aims a
#: step at 3/4 of it, 37.5 ms), and the price was that prompt's TTFT: 848 ms instead of 603
#: (1.41x), only because it arrived while another request decoded; a prompt with nothing
#: decoding is not capped (engine.prefill_cap). 50 is the value measured there; a smaller
#: one leaves fewer prompt tokens per step beside a step's fixed cost, so a long prompt
#: pays more. docs/serving.md, "Decode gaps".
SERVE_MAX_DECODE_GAP_MS = 50.0


@click.command("serve")
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--host",
    default="0.0.0.0",
    show_default=True,
    help="Address to listen on (all interfaces by default, as in a container; 127.0.0.1 for local only).",
)
@click.option("--port", type=int, default=8000, show_default=True, help="TCP port; 0 picks a free one.")
@click.option(
    "--served-model-name", default=None, help="Model name clients send in 'model' [default: MODEL as given]."
)
@click.option(
    "--api-key",
    envvar="KVSTASH_API_KEY",
    default=None,
    help="Require 'Authorization: Bearer KEY' on /v1/* and /metrics (/health stays open) "
    "[env: KVSTASH_API_KEY; default: no key].",
)
@click.option(
    "--max-request-bytes",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_REQUEST_BYTES,
    show_default=True,
    help="Larger request bodies get 413 before they are read.",
)
@click.option(
    "--kv-role",
    type=click.Choice(KV_ROLES),
    default="both",
    show_default=True,
    help="Disaggregated prefill/decode: a producer computes prompts and answers once their KV is "
    "handed over (kv_transfer_params); a consumer loads it instead of computing it. Both need "
    "--kv-offload, and --kv-offload-remote URL (the tier they share) unless --kv-transfer direct; "
    "put `kvstash proxy` in front.",
)
@click.option(
    "--kv-transfer",
    type=click.Choice(KV_TRANSFERS),
    default=None,
    help="How a producer hands KV to a consumer: direct (NIXL reads the producer's CPU tier; needs "
    "kvstash[nixl]), shared (through --kv-offload-remote), auto (direct where NIXL imports, else "
    "shared) [env: KVSTASH_KV_OFFLOAD_KV_TRANSFER; default: auto].",
)
@click.option(
    "--kv-handoff-durable-timeout-s",
    type=click.FloatRange(min=0, min_open=True, max=86400),
    default=None,
    help="Producer, shared path: the longest wait for a prompt's chunks to reach the shared tier "
    "before answering [default: 30].",
)
@click.option(
    "--kv-handoff-fetch-deadline-s",
    type=click.FloatRange(min=0, min_open=True, max=86400),
    default=None,
    help="Consumer: the longest wait for a handed-over prompt's chunks; what has not come is "
    "recomputed [default: 30].",
)
@click.option(
    "--kv-direct-hold-s",
    type=click.FloatRange(min=0, min_open=True, max=86400),
    default=None,
    help="Producer, direct path: how long offered chunks stay pinned when no consumer says it is "
    "done (a consumer reads them within half of it) [default: 60].",
)
@engine_options(max_decode_gap_ms=SERVE_MAX_DECODE_GAP_MS)
@offload_options
def serve(
    model: str,
    host: str,
    port: int,
    served_model_name: str | None,
    api_key: str | None,
    max_request_bytes: int,
    kv_role: str,
    kv_transfer: str | None,
    kv_handoff_durable_timeout_s: float | None,
    kv_handoff_fetch_deadline_s: float | None,
    kv_direct_hold_s: float | None,
    **options,
) -> None:
    """Serve the model in folder MODEL over an OpenAI-compatible HTTP API
    (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)."""
    from engine.server.listen import listen_on, serve_on

    if options["node_rank"] > 0:
        _serve_node(model, kv_role, options)
        return
    try:
        # The port first: a taken one fails now, in a line, before torch or the model load.
        sock = listen_on(host, port)
    except OSError as error:
        raise click.ClickException(str(error)) from None

    import psutil

    from engine.config import EngineArgs
    from engine.engine_core import EngineCore
    from engine.pipeline.control import NodeError
    from engine.server.app import create_app
    from engine.server.async_engine import AsyncEngine
    from engine.startup_phases import StartupPhases

    startup = StartupPhases()
    # process start to here: the interpreter, torch and the CLI (psutil reads the process's start)
    startup.add("imports", max(0.0, time.time() - psutil.Process().create_time()))

    try:
        # every flag is checked before the model loads
        if api_key is not None and not api_key.strip():
            raise ValueError("--api-key (KVSTASH_API_KEY) is empty; leave it unset to serve without a key")
        kv_offload = offload_config_from_options(options)
        handoff = {
            "kv_transfer": kv_transfer,
            "handoff_durable_timeout_s": kv_handoff_durable_timeout_s,
            "handoff_fetch_deadline_s": kv_handoff_fetch_deadline_s,
            "direct_hold_s": kv_direct_hold_s,
        }
        handoff = {name: value for name, value in handoff.items() if value is not None}
        if handoff and kv_offload is None:
            raise ValueError("--kv-transfer and the --kv-handoff-*/--kv-direct-* flags need --kv-offload")
        if handoff:
            kv_offload = dataclasses.replace(kv_offload, **handoff)
        engine_args = EngineArgs(kv_offload=kv_offload, kv_role=kv_role, **engine_args_from_options(options))
        engine_args.validate()  # the role's needs are told before the model loads
        engine = EngineCore(model, engine_args, startup=startup)
        ready_mark = startup.now()
        app = create_app(
            AsyncEngine(engine),
            served_model_name or model,
            api_key=api_key,
            max_request_bytes=max_request_bytes,
            kv_role=kv_role,
        )
    except ValueError as error:
        sock.close()
        raise click.UsageError(str(error)) from error
    except NodeError as error:  # --nnodes > 1: another node did not come in time
        sock.close()
        raise click.ClickException(str(error)) from None

    # Logs "Uvicorn running on http://HOST:PORT" with the bound port (also for --port 0).
    def on_started() -> None:
        startup.add_since("server", ready_mark)
        logging.getLogger("uvicorn.error").info("kvstash serve: ready; start-up %s", startup.describe())

    serve_on(sock, app, on_started=on_started, log_level="info", timeout_graceful_shutdown=10)


def _serve_node(model: str, kv_role: str, options: dict) -> None:
    """`serve --node-rank R` (R ≥ 1): run this node's share of node 0's ranks, no HTTP
    server, until node 0's engine shuts down (exit 0) or fails (exit 1, with why)."""
    from engine.config import EngineArgs
    from engine.pipeline.control import NodeError
    from engine.pipeline.node import run_node

    try:
        engine_args = EngineArgs(
            kv_offload=offload_config_from_options(options),
            kv_role=kv_role,
            **engine_args_from_options(options),
        )
        engine_args.validate()
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    try:
        run_node(Path(model), engine_args)
    except NodeError as error:
        raise click.ClickException(str(error)) from None
