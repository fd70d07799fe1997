"""`kvstash generate MODEL --prompt ...`: run prompts offline and print the text."""

from __future__ import annotations

import click

from engine.engine_flags import engine_args_from_options, engine_options
from engine.offload_cli import offload_config_from_options, offload_options


@click.command("generate")
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--prompt", "prompts", multiple=True, help="Prompt text (repeatable; none with --node-rank > 0)."
)
@click.option("--max-tokens", type=int, default=32, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--sampling-seed", type=int, default=None, help="Seed of each request's sampler.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past EOS.")
@engine_options
@offload_options
def generate(model: str, prompts: tuple[str, ...], **options) -> None:
    """Generate text for each --prompt with the model in folder MODEL."""
    from engine import LLM, SamplingParams
    from engine.pipeline.control import NodeError

    try:
        params = SamplingParams(
            max_tokens=options.pop("max_tokens"),
            temperature=options.pop("temperature"),
            top_p=options.pop("top_p"),
            top_k=options.pop("top_k"),
            seed=options.pop("sampling_seed"),
            stop=list(options.pop("stop")) or None,
            ignore_eos=options.pop("ignore_eos"),
        )
        kv_offload = offload_config_from_options(options)
        engine_args = engine_args_from_options(options)
        if engine_args["node_rank"] == 0 and not prompts:
            raise ValueError("give at least one --prompt")
        llm = LLM(model, kv_offload=kv_offload, **engine_args)
        if llm.engine is None:
            return  # another node's ranks ran until node 0's engine shut down
        outputs = llm.generate(list(prompts), params)
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    except NodeError as error:
        raise click.ClickException(str(error)) from None
    for output in outputs:
        click.echo(output.text)
