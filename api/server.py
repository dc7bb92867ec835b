"""The FastAPI app of `vlmcap serve`: one engine per process behind the async bridge, OpenAI-compatible
routes, captioning routes, the in-process queue worker (when Redis is configured), health, metrics and
the dashboard page at `/`.

The engine loads in the background at startup: `/health` answers at once, `/ready` and the `/v1` routes
answer 503 until the model is loaded and the step loop runs.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import routes_alerts, routes_captions, routes_dashboard, routes_openai
from api.bridge import AsyncEngine
from api.caption_store import CaptionStore, MemoryCaptionStore, RedisCaptionStore
from api.captioner import EngineCaptioner
from api.errors import RETRY_AFTER_S, APIError, error_response, install_error_handlers
from api.metrics import Metrics
from api.settings import ServerSettings
from api.state import ServerState

log = logging.getLogger(__name__)

READY_PING_TIMEOUT_S = 2.0


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is over the limit of {limit} bytes", code="body_too_large")


# The label values of the request counter are a fixed set: a method outside this list counts as "other",
# a path no route matches as "unmatched", so no client can add series.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# Behind the API key when one is set: the API and its description (the docs page loads scripts from a CDN).
KEYED_PREFIXES = ("/v1", "/docs", "/redoc", "/openapi.json")
# Probes and scrapers reach these by any address (an orchestrator's probe sends the pod's IP as Host).
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def method_label(method: str) -> str:
    return method if method in HTTP_METHODS else "other"


def host_name(host_header: str) -> str:
    """The host of a Host header, lowercased, without port or IPv6 brackets."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def is_loopback_name(host: str) -> bool:
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class GuardMiddleware:
    """Before any route: the API key on `KEYED_PREFIXES`; without a key, the Host header (loopback names
    and `allowed_hosts` only, against DNS rebinding) and the origin of state-changing requests (same
    origin only, against cross-site forms); the body size limit, also for chunked bodies. After it:
    request counts by method, route template and status."""

    def __init__(self, app: ASGIApp, settings: ServerSettings, metrics: Metrics, routes: list[BaseRoute]) -> None:
        self.app = app
        self.routes = routes
        self.key = settings.api_key.encode() if settings.api_key else None
        self.allowed_hosts = frozenset(host_name(h) for h in settings.allowed_hosts)
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

        try:
            refusal = self._refusal(scope)
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
        if self.key is not None:
            if path.startswith(KEYED_PREFIXES):
                scheme, _, token = headers.get("authorization", "").partition(" ")
                if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"), self.key):
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

    def _browser_refusal(self, headers: dict[str, str], method: str) -> Response | None:
        """Without a key, what a web page in a browser could otherwise do to a local server: reach it under
        its own name (DNS rebinding) or send it a form or request from another site (CSRF)."""
        host = headers.get("host", "")
        name = host_name(host)
        if not (is_loopback_name(name) or name in self.allowed_hosts or "*" in self.allowed_hosts):
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


async def _build_state(settings: ServerSettings, metrics: Metrics, engine: Any | None) -> ServerState:
    if engine is None:
        from engine import Engine

        log.info("loading model %s", settings.engine.model)
        engine = await asyncio.to_thread(Engine, settings.engine)
    bridge = AsyncEngine(engine, settings.limits.max_waiting_requests, metrics)
    bridge.start()
    metrics.watch_engine(lambda: bridge.stats)
    captions: CaptionStore
    if settings.redis_url:
        from jobqueue.connection import connect

        captions = RedisCaptionStore(connect(settings.redis_url))
    else:
        captions = MemoryCaptionStore()
    captioner = EngineCaptioner(bridge, settings.limits, settings.caption_max_tokens,
                                settings.structured_caption_max_tokens)
    return ServerState(settings=settings, bridge=bridge, metrics=metrics, captions=captions, captioner=captioner)


def create_app(settings: ServerSettings, engine: Any | None = None) -> FastAPI:
    """The server's app. `engine` is an already built `engine.Engine` to serve (else one is built from
    `settings.engine` at startup)."""
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.vlmcap = None
        app.state.load_error = None
        worker = None
        webhook = None

        async def load() -> None:
            nonlocal worker, webhook
            try:
                state = await _build_state(settings, metrics, engine)
            except Exception as exc:
                log.exception("the engine failed to load")
                app.state.load_error = f"{type(exc).__name__}: {exc}"
                return
            if settings.redis_url and settings.run_queue_worker:
                from jobqueue.connection import connect
                from jobqueue.consumer import QueueWorker

                if settings.alert_webhook:
                    from jobqueue.alerts import AlertWebhook

                    webhook = AlertWebhook(settings.alert_webhook)
                    webhook.start()
                    metrics.watch_alert_webhook(lambda: webhook.stats)
                worker = QueueWorker(
                    connect(settings.redis_url), state.captioner, consumer_name=settings.consumer_name,
                    claim_idle_seconds=settings.claim_idle_s, max_deliveries=settings.max_deliveries,
                    priority=settings.caption_priority, batch_size=settings.queue_batch_size,
                    fall_priority=settings.fall_priority, on_alert=webhook.notify if webhook else None,
                )
                worker.start()
                state.worker = worker
            app.state.vlmcap = state
            log.info("ready: serving %s as %r", settings.engine.model, settings.model_name)

        loading = asyncio.create_task(load())
        try:
            yield
        finally:
            if not loading.done():
                loading.cancel()
            state: ServerState | None = app.state.vlmcap
            if state is not None:
                if worker is not None:
                    await worker.stop(settings.shutdown_grace_s)
                if webhook is not None:
                    await webhook.stop(settings.shutdown_grace_s)
                await state.bridge.shutdown(settings.shutdown_grace_s)
                await asyncio.gather(*state.background, return_exceptions=True)
                await state.captions.close()

    app = FastAPI(title="vlmcap", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible chat and REST captioning on one shared VLM engine.")
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, settings=settings, metrics=metrics, routes=app.router.routes)
    app.include_router(routes_openai.router)
    app.include_router(routes_captions.router)
    app.include_router(routes_dashboard.router)
    app.include_router(routes_alerts.router)
    app.mount("/static", routes_dashboard.static_files, name="static")

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """Alive (the process answers); 503 when the engine failed to load."""
        error = request.app.state.load_error
        if error:
            return JSONResponse({"status": "error", "error": error}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        """Ready: the model is loaded, the step loop runs, and with Redis: Redis answers and the queue
        worker runs. 503 with the reason otherwise."""
        state: ServerState | None = request.app.state.vlmcap
        reason = None
        if state is None or not state.bridge.alive:
            reason = request.app.state.load_error or ("loading" if state is None else "step loop stopped")
        elif state.worker is not None and not state.worker.alive:
            reason = "the queue worker stopped"
        else:
            try:
                await asyncio.wait_for(state.captions.ping(), READY_PING_TIMEOUT_S)
            except Exception as exc:  # any failure to answer is "not ready", with its reason
                reason = f"the caption store (Redis) is unreachable: {type(exc).__name__}: {exc}"
        if reason is not None:
            return JSONResponse({"status": "not ready", "reason": reason}, status_code=503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        return JSONResponse({"status": "ready", "model": settings.model_name})

    @app.get("/metrics", response_class=Response)
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
