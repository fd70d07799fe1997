"""The ``kvstash`` command line: the root group and the subcommands that belong to
the engine. Subcommands of lower packages (cache server, admin) are defined
next to their code and attached here, because only ``engine`` may import every
package (docs/architecture.md, Layout and dependency direction). ``kvstash bench`` and ``kvstash make-tiny-model`` run code of the
``bench`` package, which sits above ``engine``: the map below names its command by string
and ``make-tiny-model`` imports its maker when it runs, so nothing here imports ``bench``
at module level.

The root group is lazy (click's LazyGroup pattern): a subcommand's module is
imported only when that subcommand runs (or its own ``--help`` is asked for), so
``kvstash --help``, ``kvstash admin ...`` and ``kvstash cache-server`` start
without importing torch (issue 35). ``kvstash --help`` lists each lazy
subcommand with the short help kept in :data:`LAZY_SUBCOMMANDS`; a test checks
that it matches the command's own.
"""

from __future__ import annotations

import importlib
import logging
from typing import NamedTuple

import click


class LazySubcommand(NamedTuple):
    """Where a subcommand is defined (``"module:attribute"``) and the first paragraph of its
    help, from which ``kvstash --help`` makes the one-line summary as click would."""

    import_path: str
    summary: str


#: subcommand name -> where it lives and the first paragraph of its help (a copy:
#: tests/foundation/test_cli_imports.py checks that ``kvstash --help`` reads as it would
#: with every command imported)
LAZY_SUBCOMMANDS: dict[str, LazySubcommand] = {
    "admin": LazySubcommand(
        "cache_server.admin_cli:admin", "Inspect and manage a running kvstash cache server."
    ),
    "bench": LazySubcommand(
        "bench.cli:bench",
        "Multi-round QA with KV offload off, then on: TTFT per round, table, JSON and plot.",
    ),
    "cache-server": LazySubcommand(
        "cache_server.cli:cache_server",
        "Serve KV chunks over gRPC from memory, with optional disk and Redis tiers below.",
    ),
    "generate": LazySubcommand(
        "engine.generate_cli:generate", "Generate text for each --prompt with the model in folder MODEL."
    ),
    "proxy": LazySubcommand(
        "engine.server.proxy.cli:proxy",
        "Serve one OpenAI-compatible endpoint in front of producer (--prefill) and consumer "
        "(--decode) engines: each request is prefilled by a producer, then decoded by a consumer.",
    ),
    "serve": LazySubcommand(
        "engine.server.cli:serve",
        "Serve the model in folder MODEL over an OpenAI-compatible HTTP API "
        "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).",
    ),
}


class LazyGroup(click.Group):
    """A click group whose ``lazy_subcommands`` (name -> :class:`LazySubcommand`) are imported
    by name when resolved (to run them or show their own ``--help``); listing them in the
    group's ``--help`` imports nothing."""

    def __init__(self, *args, lazy_subcommands: dict[str, LazySubcommand] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_subcommands = dict(lazy_subcommands or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_subcommands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy_subcommands:
            return self._load(cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The Commands section of ``--help``, as :meth:`click.Group.format_commands` writes it,
        with each lazy subcommand's summary shortened by click's own rule instead of importing it."""
        commands = []
        for name in self.list_commands(ctx):
            if name in self.lazy_subcommands:
                commands.append((name, None))
                continue
            command = super().get_command(ctx, name)
            if command is not None and not command.hidden:
                commands.append((name, command))
        if not commands:
            return
        limit = formatter.width - 6 - max(len(name) for name, _ in commands)
        rows = []
        for name, command in commands:
            if command is None:  # a stand-in with the same help shortens it by click's own rule
                command = click.Command(name, help=self.lazy_subcommands[name].summary)
            rows.append((name, command.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def _load(self, cmd_name: str) -> click.Command:
        module_name, attribute = self.lazy_subcommands[cmd_name].import_path.split(":")
        command = getattr(importlib.import_module(module_name), attribute)
        if not isinstance(command, click.Command):
            raise TypeError(f"{module_name}:{attribute} is not a click command")
        return command


@click.group(
    cls=LazyGroup,
    lazy_subcommands=LAZY_SUBCOMMANDS,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
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
    from bench.tiny_model import make_tiny_model

    path = make_tiny_model(directory, arch=arch, seed=seed, size=size)
    click.echo(f"wrote a tiny {arch} model to {path}")


if __name__ == "__main__":
    main()
