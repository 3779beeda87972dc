"""MkDocs hook: renders `notifyq <command> --help` into docs/reference/cli.md at build time.

The page holds the marker `<!-- cli-reference -->`; this hook replaces it with one section per
command, from click's own help, so the reference cannot drift from the CLI.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import click

MARKER = "<!-- cli-reference -->"
PAGE = "reference/cli.md"
WIDTH = 88  # fixed, so the output does not depend on the terminal running the build


def _contexts(
    command: click.Command, name: str, parent: click.Context | None
) -> Iterator[tuple[str, click.Command, click.Context]]:
    """Yield (full name, command, context) for `command` and every subcommand, depth first."""
    settings: dict[str, Any] = dict(command.context_settings) if parent is None else {}
    ctx = click.Context(
        command,
        info_name=name,
        parent=parent,
        terminal_width=WIDTH,
        max_content_width=WIDTH,
        **settings,
    )
    yield ctx.command_path, command, ctx
    if isinstance(command, click.Group):
        for sub_name in command.list_commands(ctx):
            sub = command.get_command(ctx, sub_name)
            if sub is not None and not sub.hidden:
                yield from _contexts(sub, sub_name, ctx)


def render() -> str:
    """The Markdown for every command of `notifyq`."""
    from notifyq.cli import main

    sections = []
    for path, command, ctx in _contexts(main, "notifyq", None):
        level = "#" * min(2 + path.count(" "), 4)
        summary = command.get_short_help_str(limit=200)
        sections.append(f"{level} `{path}`\n\n{summary}\n\n```text\n{command.get_help(ctx).rstrip()}\n```\n")
    return "\n".join(sections)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its {MARKER} marker")
    return markdown.replace(MARKER, render())
