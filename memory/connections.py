"""The SQL stores' connections: one a thread, opened at its first use, all closed together."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

Conn = TypeVar("Conn")


class Connections(Generic[Conn]):
    """A store's connections: each thread's own, opened by `connect` at the thread's first use (and again when
    `usable` says its last one is not), and those handed to `keep`. `close()` closes them all; after it, `mine()`
    raises RuntimeError(`closed_error`)."""

    def __init__(self, connect: Callable[[], Conn], closed_error: str,
                 usable: Callable[[Conn], bool] = lambda conn: True) -> None:
        self._connect = connect
        self._closed_error = closed_error
        self._usable = usable
        self._local = threading.local()
        self._all: list[Conn] = []
        self._lock = threading.Lock()
        self.closed = False

    def keep(self, conn: Conn) -> Conn:
        """`conn`, to be closed with the others."""
        with self._lock:
            self._all.append(conn)
        return conn

    def mine(self) -> Conn:
        """This thread's connection."""
        if self.closed:
            raise RuntimeError(self._closed_error)
        conn = getattr(self._local, "conn", None)
        if conn is None or not self._usable(conn):
            conn = self._local.conn = self.keep(self._connect())
        return conn

    def close(self) -> None:
        self.closed = True
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()
