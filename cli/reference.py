"""docs/configuration.md, generated from the commands themselves (each option's flags, environment variable,
default and help): `python -m cli.reference > docs/configuration.md`. tests/cli/test_cli_defaults.py checks
that the page is up to date."""

from __future__ import annotations

from collections.abc import Iterator

import typer.core
import typer.main

from cli.main import app

HEADER = """# Configuration

Every option of every `vlmcap` command, with its environment variable and default. Generated from the
commands (`python -m cli.reference > docs/configuration.md`; a test fails when it is out of date). The
engine's, the server's and the limits' options are the fields of `EngineConfig` (engine/config.py),
`ServerSettings` and `Limits` (api/settings.py): a field added there appears here and in `vlmcap serve`.
"""


def commands(group: typer.core.TyperGroup, prefix: str = "vlmcap") -> Iterator[tuple[str, object]]:
    for name, command in sorted(group.commands.items()):
        if isinstance(command, typer.core.TyperGroup):
            yield from commands(command, f"{prefix} {name}")
        else:
            yield f"{prefix} {name}", command


def row(param: typer.core.TyperOption) -> str:
    flags = " / ".join(f"`{flag}`" for flag in [*param.opts, *param.secondary_opts])
    envvar = f"`{param.envvar}`" if param.envvar else ""
    default = "" if param.default in (None, [], ()) or param.required else f"`{param.default}`"
    help_text = (getattr(param, "help", "") or "").replace("|", "\\|").replace("\n", " ")
    return f"| {flags} | {envvar} | {default} | {help_text} |"


def markdown() -> str:
    lines = [HEADER]
    for name, command in commands(typer.main.get_command(app)):
        lines += [f"## `{name}`", "", (command.help or "").strip().split("\n")[0], "",
                  "| option | environment | default | what it sets |", "| --- | --- | --- | --- |"]
        lines += [row(p) for p in command.params if isinstance(p, typer.core.TyperOption) and p.name != "help"]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
