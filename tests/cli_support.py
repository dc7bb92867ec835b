"""Helpers of the command line's tests: a command run in a fresh interpreter, with its exit status and which of
some modules it had imported by then, and a port that another socket holds."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A port of 127.0.0.1 that another socket listens on while the block runs."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        yield holder.getsockname()[1]
    finally:
        holder.close()


def run_command(args: list[str], modules: tuple[str, ...],
                timeout_s: float = 120) -> tuple[list[str], subprocess.CompletedProcess]:
    """`vlmcap ARGS` in a fresh interpreter, and what it ended with: ["exit", its status, then for each of `modules`
    whether it was imported ("True" / "False")], with the run (its output and errors)."""
    code = ("import sys\nfrom cli.main import app\ntry:\n    app(sys.argv[1:])\nexcept SystemExit as done:\n"
            f"    print('exit', done.code, *(name in sys.modules for name in {modules!r}))")
    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout_s)
    return run.stdout.split()[-2 - len(modules):], run
