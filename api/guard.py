"""Who may ask what of the server, checked before any route: the API keys (one or several named ones), protected
mode (no open server on a non-loopback address), the Host and Origin checks of a keyless loopback server, the
body size limit; and the cache salt that keeps one key's prefix-cache blocks and image features from another's.
docs/security.md says what is public and what needs a key."""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
from pathlib import Path
from urllib.parse import urlsplit

from starlette.requests import HTTPConnection
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import APIError, error_response
from api.metrics import Metrics
from api.pools import CLIENT_KEY
from api.settings import ServerSettings

# Behind the API key when one is set: the API and its description (the docs page loads scripts from a CDN).
KEYED_PREFIXES = ("/v1", "/api", "/docs", "/redoc", "/openapi.json")  # /api: Ollama's routes
METRICS_PATH = "/metrics"
# Probes and scrapers reach these by any address (an orchestrator's probe sends the pod's IP as Host).
PROBE_PATHS = frozenset({"/health", "/ready", METRICS_PATH})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# The label values of the request counter are a fixed set: a method outside this list counts as "other",
# a path no route matches as "unmatched", so no client can add series.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# The name of the key a request was let in with, in its ASGI scope (routes read it through `key_name`).
KEY_NAME_SCOPE = "vlmcap.api_key_name"
DEFAULT_KEY_NAME = "default"  # the name of `--api-key`'s key among the named ones
KEY_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
# A Host header's name (a DNS name or an IPv4 address) and its port: nothing else may be in it.
HOST_LABELS = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*\.?", re.ASCII)
PORT = re.compile(r":[0-9]{1,5}", re.ASCII)
ANY_HOST = "*"


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is over the limit of {limit} bytes", code="body_too_large")


def method_label(method: str) -> str:
    return method if method in HTTP_METHODS else "other"


def host_name(host_header: str) -> str:
    """The host of a Host header (or of a listen address), lowercased, without port or IPv6 brackets; "" for
    one that is not `name[:port]` or `[ipv6][:port]` (`localhost:80@evil.example` names no loopback host)."""
    host = host_header.strip().lower()
    if host.startswith("["):
        inside, closed, rest = host[1:].partition("]")
        if not closed or (rest and not PORT.fullmatch(rest)):
            return ""
        return inside if _is_ip(inside) else ""
    if host.count(":") > 1:  # a bare IPv6 address (a listen address, never a valid Host header)
        return host if _is_ip(host) else ""
    name, colon, port = host.partition(":")
    if colon and not PORT.fullmatch(colon + port):
        return ""
    return name if HOST_LABELS.fullmatch(name) else ""


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def is_loopback_name(host: str) -> bool:
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# -- keys ----------------------------------------------------------------------------------------------------

def parse_api_keys(text: str) -> dict[str, str]:
    """Named keys from `name:key` lines (blank lines and `#` comments skipped), or from the file named by
    `text` when its first line has no `:`. ValueError naming the line that is wrong."""
    lines = [line.strip() for line in text.splitlines()]
    first = next((line for line in lines if line and not line.startswith("#")), "")
    if first and ":" not in first:
        path = Path(first).expanduser()
        try:
            lines = [line.strip() for line in path.read_text().splitlines()]
        except OSError as err:
            raise ValueError(f"cannot read the API keys file {str(path)!r}: {err.strerror or err}") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        if not line or line.startswith("#"):
            continue
        name, _, key = (part.strip() for part in line.partition(":"))
        if not KEY_NAME.match(name):
            raise ValueError(f"API keys line {number}: the name {name[:80]!r} must be 1-64 letters, digits or "
                             "_ . @ - (write 'name:key')")
        if not key or any(c.isspace() for c in key):
            raise ValueError(f"API keys line {number}: the key of {name!r} is empty or holds whitespace")
        if name in keys:
            raise ValueError(f"API keys line {number}: the name {name!r} is given twice")
        if key in keys.values():
            raise ValueError(f"API keys line {number}: the key of {name!r} is another name's too")
        keys[name] = key
    return keys


def configured_keys(settings: ServerSettings) -> dict[str, str]:
    """Every key the server takes, by name: `api_keys`, and `api_key` as "default"."""
    keys = dict(settings.api_keys)
    if settings.api_key:
        if DEFAULT_KEY_NAME in keys:
            raise ValueError(f"the API key name {DEFAULT_KEY_NAME!r} is --api-key's: give that named key another")
        if settings.api_key in keys.values():
            raise ValueError("--api-key is also one of the named API keys")
        keys[DEFAULT_KEY_NAME] = settings.api_key
    return keys


def check_exposure(host: str, settings: ServerSettings) -> None:
    """Protected mode: ValueError, saying what to do, for a server about to listen on a non-loopback address
    with no API key, unless the operator accepted an open server (`allow_unauthenticated`)."""
    if configured_keys(settings) or settings.allow_unauthenticated or is_loopback_name(host_name(host or "")):
        return
    raise ValueError(
        f"refusing to listen on {host or 'all addresses'!r} without an API key: anyone who reaches that address "
        "could use the server (the Host header check stops browsers, not other clients). Set --api-key / "
        "VLMCAP_API_KEY (or named keys with --api-keys / VLMCAP_API_KEYS), listen on a loopback address "
        "(--host 127.0.0.1), or accept an open server with --allow-unauthenticated / "
        "VLMCAP_ALLOW_UNAUTHENTICATED=1")


def key_name(connection: HTTPConnection) -> str | None:
    """The name of the API key the request was let in with (None: the server has no key)."""
    return connection.scope.get(KEY_NAME_SCOPE)


def cache_salt(connection: HTTPConnection, settings: ServerSettings, salt: str | None) -> str | None:
    """The engine's cache salt of a request: the client's `salt`, joined with its key's name unless the
    operator shares the prefix cache between keys; None: the unsalted cache everyone without a salt shares."""
    name = key_name(connection)
    if name is None or settings.share_prefix_cache:
        return salt
    return json.dumps(["key", name, salt])


# -- the middleware ----------------------------------------------------------------------------------------

class GuardMiddleware:
    """Before any route: an API key on `KEYED_PREFIXES` (and `/metrics`, unless `public_metrics`) when the
    server has keys, the key's name put in the scope; without a key, the Host header (loopback names and
    `allowed_hosts` only, against DNS rebinding) and the origin of state-changing requests (same origin only,
    against cross-site forms); the body size limit, also for chunked bodies. After it: request counts by
    method, route template and status."""

    def __init__(self, app: ASGIApp, settings: ServerSettings, metrics: Metrics, routes: list[BaseRoute]) -> None:
        self.app = app
        self.routes = routes
        self.keys = [(name, key.encode()) for name, key in configured_keys(settings).items()]
        self.keyed_prefixes = KEYED_PREFIXES + (() if settings.public_metrics else (METRICS_PATH,))
        self.allowed_hosts = frozenset(ANY_HOST if h.strip() == ANY_HOST else host_name(h)
                                       for h in settings.allowed_hosts) - {""}
        self.max_body = settings.limits.max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        too_large = False
        replaced = False
        started = False

        async def send_counted(message: Message) -> None:
            nonlocal status, replaced, started
            if replaced:
                return
            if message["type"] == "http.response.start":
                started = True
                if too_large:  # the app saw the body limit passed mid-stream: answer 413 whatever it made of it
                    replaced = True
                    await self._too_large()(scope, receive, send)
                    status = 413
                    return
                status = message["status"]
            await send(message)

        def limited(inner: Receive) -> Receive:
            received = 0

            async def counted() -> Message:
                nonlocal received, too_large
                message = await inner()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > self.max_body:
                        too_large = True
                        raise BodyTooLarge(self.max_body)
                return message

            return counted

        client = scope.get("client")
        key = None
        try:
            refusal = self._refusal(scope)
            # The work pools' turns are taken by key name, else by client address (api/pools.py).
            key = CLIENT_KEY.set(scope.get(KEY_NAME_SCOPE) or f"client:{client[0] if client else '?'}")
            if refusal is not None:
                await refusal(scope, receive, send_counted)
            else:
                await self.app(scope, limited(receive), send_counted)
        except BodyTooLarge:
            if not started:
                await self._too_large()(scope, receive, send)
                status = 413
            else:
                raise
        finally:
            if key is not None:
                CLIENT_KEY.reset(key)
            self.metrics.requests.labels(method_label(scope["method"]), self._route(scope), str(status)).inc()

    def _too_large(self) -> Response:
        too_large = BodyTooLarge(self.max_body)
        return error_response(413, too_large.message, code=too_large.code)

    def _route(self, scope: Scope) -> str:
        """The route's path template (a refused request never reached the router: match it here)."""
        route = scope.get("route")
        return getattr(route, "path", None) or _match_path(self.routes, scope) or "unmatched"

    def _refusal(self, scope: Scope) -> Response | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        if self.keys:
            name = self._key_name(headers.get("authorization", ""))
            if name is not None:
                scope[KEY_NAME_SCOPE] = name
            elif path.startswith(self.keyed_prefixes):
                return error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key")
        elif path not in PROBE_PATHS:
            refusal = self._browser_refusal(headers, scope["method"])
            if refusal is not None:
                return refusal
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return self._too_large()
        return None

    def _key_name(self, authorization: str) -> str | None:
        """The name of the key in a bearer Authorization header, or None. Every key is compared, in constant
        time, so the time taken tells nothing of which one nearly matched."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        sent = token.strip().encode("latin-1")
        found = None
        for name, key in self.keys:
            if hmac.compare_digest(sent, key):
                found = name
        return found

    def _browser_refusal(self, headers: dict[str, str], method: str) -> Response | None:
        """Without a key, what a web page in a browser could otherwise do to a local server: reach it under
        its own name (DNS rebinding) or send it a form or request from another site (CSRF)."""
        host = headers.get("host", "")
        name = host_name(host)
        if not name or not (is_loopback_name(name) or name in self.allowed_hosts or ANY_HOST in self.allowed_hosts):
            return error_response(403, f"the Host header {host[:100]!r} is not allowed: without an API key this "
                                       "server answers only to loopback names and --allowed-host names",
                                  code="host_not_allowed")
        if method in SAFE_METHODS:
            return None
        fetch_site = headers.get("sec-fetch-site")
        origin = headers.get("origin")
        if fetch_site not in (None, "same-origin", "none") or (
                origin is not None and urlsplit(origin).netloc.lower() != host.strip().lower()):
            return error_response(403, f"cross-site request refused (Origin {origin!r}, Sec-Fetch-Site "
                                       f"{fetch_site!r}): without an API key this server takes requests from its "
                                       "own pages and from non-browser clients only", code="cross_site_request")
        return None


def _match_path(routes: list[BaseRoute], scope: Scope) -> str | None:
    for route in routes:
        if route.matches(scope)[0] != Match.FULL:
            continue
        included = getattr(getattr(route, "original_router", None), "routes", None)
        return _match_path(included, scope) if included else getattr(route, "path", None)
    return None
