"""`kvstash serve MODEL [engine flags] [--kv-offload ...]`: the OpenAI-compatible server."""

from __future__ import annotations

import click

from engine.engine_flags import engine_args_from_options, engine_options
from engine.offload_cli import offload_config_from_options, offload_options


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
@engine_options
@offload_options
def serve(model: str, host: str, port: int, served_model_name: str | None, **options) -> None:
    """Serve the model in folder MODEL over an OpenAI-compatible HTTP API
    (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)."""
    import uvicorn

    from engine.config import EngineArgs
    from engine.engine_core import EngineCore
    from engine.server.app import create_app
    from engine.server.async_engine import AsyncEngine

    try:
        kv_offload = offload_config_from_options(options)
        engine_args = EngineArgs(kv_offload=kv_offload, **engine_args_from_options(options))
        engine = EngineCore(model, engine_args)
        app = create_app(AsyncEngine(engine), served_model_name or model)
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    # uvicorn logs "Uvicorn running on http://HOST:PORT" with the bound port (also for --port 0).
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=10)
