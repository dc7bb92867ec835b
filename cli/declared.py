"""Command-line options built from the settings they set, so that each setting is declared once: its name, type
and default in its dataclass, its help beside the field (`field(metadata={"help": ...})`, as `EngineConfig` writes
it) or in the dataclass's docstring (`name: what it does.`, one entry a field), its environment variable
`VLMCAP_<NAME>`. Where an option's public name or variable differs (kept so that existing command lines and
deployments keep working), `Rename` says so.

`EngineConfig` and `GrammarLimits` are imported from engine/config.py and engine/grammar_limits.py, which import
neither torch nor the rest of the engine, so that `--help` and the defaults never load torch. A field whose type no
option takes is named in `NOT_OPTIONS` with where its value comes from; any other such field is an error."""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import typer

# Field types an option can take, as written in the dataclasses (the `X | None` forms: not given means None).
TYPES: dict[str, Any] = {
    "int": int, "float": float, "str": str, "bool": bool,
    "int | None": int | None, "float | None": float | None, "str | None": str | None, "bool | None": bool | None,
    "tuple[str, ...]": list[str],
}
# Fields of a type no option takes (`owner.field`), each with where its value comes from.
NOT_OPTIONS = {
    "EngineConfig.grammar_limits": "GrammarLimits' fields, options of their own",
    "ServerSettings.engine": "EngineConfig's fields",
    "ServerSettings.limits": "Limits' fields",
    "ServerSettings.api_keys": "--api-keys (cli/serve.py)",
    "PipelineConfig.backpressure": "--backpressure, declared by hand (cli/camera.py)",
    "PipelineConfig.annotate": "--annotate, declared by hand (cli/camera.py)",
    "PipelineConfig.caption_schema": "--caption-schema, a file (cli/camera.py)",
    "ServeConfig.slo": "the benchmark's own targets (bench/configs.py)",
}
# Fields where 0 on the command line gives None (the limit off), as these options have always taken it.
ZERO_MEANS_NONE = {"max_encoder_tokens_per_step", "encoder_slices_per_step"}


@dataclass(frozen=True)
class Declared:
    """One setting: a field of `owner` (a dataclass's name)."""

    owner: str
    name: str
    type: str
    default: Any
    help: str


@dataclass(frozen=True)
class Rename:
    """Where an option's public name differs from its field's: `flag` as typer takes it (`--a/--no-a`), `envvar`."""

    flag: str | None = None
    envvar: str | None = None


def docstring_entries(doc: str | None) -> dict[str, str]:
    """`name: text` entries of a docstring (continuation lines indented deeper), each reduced to its first
    sentence."""
    entries: dict[str, str] = {}
    current = None
    for line in inspect.cleandoc(doc or "").splitlines():
        match = re.match(r"^(\w+): (.*)$", line)
        if match:
            current = match.group(1)
            entries[current] = match.group(2)
        elif current is not None and line.startswith(" ") and line.strip():
            entries[current] += " " + line.strip()
        else:
            current = None
    return {name: first_sentence(text) for name, text in entries.items()}


def first_sentence(text: str) -> str:
    match = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", text)
    return text[: match.start() + 1] if match else text


def from_dataclass(cls: type) -> list[Declared]:
    """The fields of a torch-free settings dataclass, in their order, with their help (the field's `help`
    metadata, else its entry in the class's docstring, a base class's or its module's); TypeError for a field
    whose type no option takes unless `NOT_OPTIONS` names it."""
    helps = docstring_entries(sys.modules[cls.__module__].__doc__)  # shared entries of the module
    helps |= {name: text for base in reversed(cls.__mro__) for name, text in docstring_entries(base.__doc__).items()}
    declared = []
    for f in dataclasses.fields(cls):
        if f.type not in TYPES:
            if f"{cls.__name__}.{f.name}" not in NOT_OPTIONS:
                raise TypeError(f"{cls.__name__}.{f.name} is of type {f.type!r}, which no option takes "
                                f"(the types are {sorted(TYPES)}): give it one, or name it in NOT_OPTIONS")
            continue
        value = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else ...)
        text = first_sentence(f.metadata["help"]) if "help" in f.metadata else helps.get(f.name, "")
        declared.append(Declared(cls.__name__, f.name, f.type, value, text))
    return declared


def engine_fields() -> list[Declared]:
    from engine.config import EngineConfig

    return from_dataclass(EngineConfig)


def grammar_limit_fields() -> list[Declared]:
    from engine.grammar_limits import GrammarLimits

    return from_dataclass(GrammarLimits)


def option_name(setting: Declared, renames: dict[str, Rename]) -> str:
    """The option's flag as typer takes it."""
    rename = renames.get(setting.name, Rename())
    if rename.flag:
        return rename.flag
    dashed = "--" + setting.name.replace("_", "-")
    return f"{dashed}/--no-{dashed[2:]}" if setting.type in ("bool", "bool | None") else dashed


def envvar(setting: Declared, renames: dict[str, Rename], envvars: bool = True) -> str | None:
    """The option's environment variable: the renamed one, else `VLMCAP_<NAME>` (none when not `envvars`)."""
    rename = renames.get(setting.name, Rename())
    return rename.envvar or ("VLMCAP_" + setting.name.upper() if envvars else None)


def parameter(setting: Declared, renames: dict[str, Rename], envvars: bool = True) -> inspect.Parameter:
    """The typer parameter of one setting; its Python name is the field's."""
    help_text = setting.help[:1].upper() + setting.help[1:] + (" 0: None." if setting.name in ZERO_MEANS_NONE else "")
    default = list(setting.default) if setting.type == "tuple[str, ...]" else setting.default
    option = typer.Option(default, option_name(setting, renames), envvar=envvar(setting, renames, envvars),
                          help=help_text,
                          show_default=default not in (None, [], ...))
    return inspect.Parameter(setting.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                             annotation=TYPES[setting.type])


def values_for(settings: Iterable[Declared], given: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of the settings' owner from what the command was given: lists back to tuples,
    0 to None where `ZERO_MEANS_NONE`."""
    values = {}
    for setting in settings:
        value = given[setting.name]
        if setting.name in ZERO_MEANS_NONE and value == 0:
            value = None
        elif setting.type == "tuple[str, ...]":
            value = tuple(value)
        values[setting.name] = value
    return values


def command(func: Callable, extra: list[inspect.Parameter], settings: list[Declared], renames: dict[str, Rename],
            envvars: bool = True) -> Callable:
    """`func(**options)` as a typer command whose options are `extra` (declared by hand) then `settings` (each
    with its environment variable unless not `envvars`: then only the renamed ones have one)."""
    names = [p.name for p in extra] + [s.name for s in settings]
    if len(set(names)) != len(names):
        raise ValueError(f"an option is declared twice: {sorted(n for n in names if names.count(n) > 1)}")
    parameters = extra + [parameter(s, renames, envvars) for s in settings]

    def run(**options: Any) -> None:
        func(**options)

    run.__name__, run.__doc__ = func.__name__, func.__doc__
    run.__signature__ = inspect.Signature(parameters)
    run.__annotations__ = {p.name: p.annotation for p in parameters}
    return run


def hand_option(name: str, annotation: Any, default: Any, *flags: str, **option: Any) -> inspect.Parameter:
    """An option that sets no settings field (a listening address, a log level)."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(default, *flags, **option))
