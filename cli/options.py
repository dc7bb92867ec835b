"""What the commands share: each option's default read from the dataclass field (or the parameter) it sets, so
a default is written once, where it takes effect; the log format; the exit on a bad option."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import typer

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PORT = 8000  # the API server's TCP port: `vlmcap serve` and `vlmcap demo`
STARTUP_FAILURE = 3  # the exit status of a server that could not start (uvicorn's)


_terminated = threading.Event()


def stop_on_sigterm() -> None:
    """SIGTERM (docker stop, systemd, `timeout`) ends the command as Ctrl-C does: a KeyboardInterrupt in the main
    thread, so the command's cleanup runs (an embedded Redis stopped, a camera released). The signal is also
    remembered (`terminated`), so that the next `run_until_signalled` stops at once: Python drops an exception
    raised while the main thread runs a finalizer (a garbage collection's `__del__`), and so the interrupt.
    An event loop running in the main thread gets the interrupt from a callback of its own, between two of its
    steps, not inside its own bookkeeping; a loop whose work must end cleanly is run with `run_until_signalled`,
    which throws nothing into it."""
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: object) -> None:
    _terminated.set()
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise KeyboardInterrupt from None
    loop.call_soon_threadsafe(_interrupt)


def _interrupt() -> None:
    raise KeyboardInterrupt


def terminated() -> bool:
    """Whether SIGTERM has come since `stop_on_sigterm`."""
    return _terminated.is_set()


T = TypeVar("T")


def run_until_signalled(main: Callable[[asyncio.Event], Awaitable[T]]) -> tuple[T, bool]:
    """Run `main(stop)` in a new event loop, where Ctrl-C or SIGTERM only sets `stop`: `main` watches it and
    returns, its own cleanup awaited like any other step. No exception is thrown into its tasks, so none can be
    swallowed on the way (Python 3.11's `asyncio.wait_for` loses a cancellation that comes as its awaitable
    finishes, and a loop around it then never ends). Returns main's result and whether a signal stopped it.
    The signals' handlers from before (`stop_on_sigterm`'s, Ctrl-C's) are back once `main` has returned."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signalled: list[int] = []

    async def watched() -> T:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(sig: int) -> None:
            if sig == signal.SIGTERM:
                _terminated.set()
            signalled.append(sig)
            stop.set()

        for sig in before:
            loop.add_signal_handler(sig, on_signal, sig)
        if terminated():  # a SIGTERM came before, its interrupt dropped (`stop_on_sigterm`)
            on_signal(signal.SIGTERM)
        try:
            return await main(stop)
        finally:
            for sig, handler in before.items():
                loop.remove_signal_handler(sig)
                signal.signal(sig, handler)

    return asyncio.run(watched()), bool(signalled)


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
