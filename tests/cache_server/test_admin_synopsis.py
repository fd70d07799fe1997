"""The README's `kvstash admin` synopsis names every subcommand with its arguments and options
(issue 35: `evict` and `clear` were listed bare, though `evict` needs KEY or --prefix and
`clear` asks for confirmation unless --yes)."""

from __future__ import annotations

import re
from pathlib import Path

import click

from cache_server.admin_cli import admin

README = Path(__file__).resolve().parents[2] / "README.md"


def admin_synopsis_lines() -> list[str]:
    return [line for line in README.read_text().splitlines() if line.startswith("kvstash admin ")]


def test_every_admin_subcommand_is_in_the_synopsis_with_its_arguments_and_options() -> None:
    lines = admin_synopsis_lines()
    assert lines
    for name, command in admin.commands.items():
        mentions = [line for line in lines if re.search(rf"[{{|, ]{name}([ ,|}}\]]|$)", line)]
        assert mentions, f"admin {name} is not in the README synopsis"
        for param in command.params:
            if isinstance(param, click.Argument):
                assert any(param.name.upper() in line for line in mentions), (
                    f"admin {name}: {param.name.upper()}"
                )
            elif param.name not in ("as_json", "help"):
                flag = param.opts[0]
                assert any(flag in line for line in mentions), (
                    f"admin {name}: {flag} missing from the synopsis"
                )
    # the group's own options that a deployment needs
    assert all("--server HOST:PORT" in line for line in lines)
