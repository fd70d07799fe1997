"""The ``kvstash`` command line: the root group and the subcommands that belong to
the engine. Subcommands of lower packages (cache server, admin) are defined
next to their code and attached here, because only ``engine`` may import every
package (DESIGN §1)."""

from __future__ import annotations

import logging

import click

from cache_server.cli import admin, cache_server
from engine.bench import bench
from engine.generate_cli import generate
from engine.server.cli import serve


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    help="Logging level for kvstash's own loggers.",
)
def main(log_level: str) -> None:
    """kvstash: an LLM inference engine with KV-cache offloading to CPU, disk, Redis
    and a gRPC cache server."""
    logging.basicConfig(
        level=getattr(logging, log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@main.command("make-tiny-model")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option(
    "--arch",
    type=click.Choice(["llama", "qwen2", "qwen3", "mistral"]),
    default="llama",
    show_default=True,
    help="Model family whose config and weight names to produce.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the random weights.")
@click.option(
    "--size",
    type=click.Choice(["tiny", "bench"]),
    default="tiny",
    show_default=True,
    help="tiny: ~0.2M parameters for tests; bench: ~25M parameters, 16k context.",
)
def make_tiny_model_cmd(directory: str, arch: str, seed: int, size: str) -> None:
    """Write a small random-weight Hugging Face checkpoint with a local tokenizer to DIRECTORY."""
    from engine.tiny_model import make_tiny_model

    path = make_tiny_model(directory, arch=arch, seed=seed, size=size)
    click.echo(f"wrote a tiny {arch} model to {path}")


main.add_command(cache_server)
main.add_command(admin)


main.add_command(generate)
main.add_command(serve)
main.add_command(bench)


if __name__ == "__main__":
    main()
