"""What the commands share: each option's default read from the dataclass field (or the parameter) it sets, so
a default is written once, where it takes effect; the log format; the exit on a bad option."""

from __future__ import annotations

import dataclasses
import inspect
import signal
import threading
from collections.abc import Callable
from typing import Any

import typer

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PORT = 8000  # the API server's TCP port: `vlmcap serve` and `vlmcap demo`


_terminated = threading.Event()


def stop_on_sigterm() -> None:
    """SIGTERM (docker stop, systemd, `timeout`) ends the command as Ctrl-C does: a KeyboardInterrupt in the main
    thread, so the command's cleanup runs (an embedded Redis stopped, a camera released). The signal is also
    remembered (`terminated`) for the loops that wait in the main thread to poll: Python drops an exception
    raised while the main thread runs a finalizer (a garbage collection's `__del__`), and so the interrupt."""
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: object) -> None:
    _terminated.set()
    raise KeyboardInterrupt


def terminated() -> bool:
    """Whether SIGTERM has come since `stop_on_sigterm`."""
    return _terminated.is_set()


def fail(message: str) -> typer.Exit:
    """An exit with status 2 after `error: message` on stderr (raise it)."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def default(owner: type | Callable, name: str) -> Any:
    """The default of field `name` of dataclass `owner` (its default_factory called), or of parameter `name` of
    the function or class `owner`; ValueError when it has none."""
    if dataclasses.is_dataclass(owner):
        field = {f.name: f for f in dataclasses.fields(owner)}[name]
        if field.default is not dataclasses.MISSING:
            return field.default
        if field.default_factory is not dataclasses.MISSING:
            return field.default_factory()
    else:
        parameter = inspect.signature(owner).parameters[name]
        if parameter.default is not inspect.Parameter.empty:
            return parameter.default
    raise ValueError(f"{getattr(owner, '__name__', owner)}.{name} has no default")
