"""A real uvicorn server for an app on a thread of this process, for the demo, tests and benchmarks."""

from __future__ import annotations

import socket
from typing import Any

from fastapi import FastAPI

from api.settings import ServerSettings
from api.state import ServerState


def app_settings(app: FastAPI) -> ServerSettings:
    """The settings `create_app` made `app` with (its guard's), else the defaults."""
    for middleware in getattr(app, "user_middleware", []):
        settings = getattr(middleware, "kwargs", {}).get("settings")
        if isinstance(settings, ServerSettings):
            return settings
    return ServerSettings()


class BackgroundServer:
    """A real uvicorn server for `app` on a thread of this process (tests, benchmarks, notebooks):
    `with BackgroundServer(app) as server: ... server.url ...`. Waits until `/ready` says so."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, ready_timeout_s: float = 300.0,
                 sockets: list[socket.socket] | None = None) -> None:
        """`sockets`: listening sockets bound beforehand (`api.connections.bind_listeners`), else bound here on
        `host` and `port` (OSError naming the address where they cannot be); the url is the first one's."""
        import uvicorn

        from api.connections import bind_listeners, socket_url, uvicorn_config

        self.app = app
        self.sockets = sockets if sockets is not None else bind_listeners(host, port)
        self.url = socket_url(self.sockets[0])
        self.server = uvicorn.Server(uvicorn_config(app, app_settings(app), log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.ready_timeout_s = ready_timeout_s
        self._thread: Any = None

    def __enter__(self) -> BackgroundServer:
        import threading
        import time

        import httpx

        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": self.sockets}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.ready_timeout_s
        with httpx.Client(timeout=5) as http:
            while time.monotonic() < deadline and self._thread.is_alive():
                try:
                    if http.get(f"{self.url}/ready").status_code == 200:
                        return self
                    if http.get(f"{self.url}/health").status_code != 200:
                        break  # the engine failed to load
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        self.__exit__(None, None, None)
        raise RuntimeError(f"the server at {self.url} did not become ready")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(60)
        for sock in self.sockets:
            sock.close()

    @property
    def state(self) -> ServerState:
        return self.app.state.vlmcap
