"""The FastAPI app of `vlmcap serve`: one engine per process behind the async bridge, OpenAI-compatible
routes, captioning routes, the in-process queue worker (when Redis is configured), health, metrics and
the dashboard page at `/`.

The engine loads in the background at startup: `/health` answers at once, `/ready` and the `/v1` routes
answer 503 until the model is loaded and the step loop runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from api import (
    mcp_server,
    routes_alerts,
    routes_ask,
    routes_captions,
    routes_completions,
    routes_dashboard,
    routes_events,
    routes_ollama,
    routes_openai,
    routes_stored,
    routes_summaries,
)
from api.bridge import EngineBridge, build_engine
from api.caption_store import CaptionStore, MemoryCaptionStore, RedisCaptionStore
from api.captioner import EngineCaptioner
from api.errors import RETRY_AFTER_S, install_error_handlers
from api.feeds import FeedHub
from api.guard import GuardMiddleware, configured_keys
from api.metrics import Metrics
from api.pools import work_pools
from api.settings import ServerSettings
from api.state import ServerState
from memory.outputs import each, start_mqtt, stop_outputs

log = logging.getLogger(__name__)

READY_PING_TIMEOUT_S = 2.0


async def _build_state(settings: ServerSettings, metrics: Metrics, engine: Any | None) -> ServerState:
    if engine is None:
        log.info("loading model %s", settings.engine.model)
        engine = await asyncio.to_thread(build_engine, settings.engine)
    # One server's pools (api/pools.py), kept on its settings: admission is the bridge's, the others the routes'.
    bridge = EngineBridge(engine, settings.limits.max_waiting_requests, metrics,
                          admission=work_pools(settings)["admission"])
    bridge.start()
    metrics.watch_engine(lambda: bridge.stats)
    captions: CaptionStore
    if settings.redis_url:
        from jobqueue.connection import connect

        captions = RedisCaptionStore(connect(settings.redis_url))
    else:
        captions = MemoryCaptionStore()
    captioner = EngineCaptioner(bridge, settings.limits, settings.caption_max_tokens,
                                settings.structured_caption_max_tokens, settings.fall_itl_target_ms or None)
    feeds = FeedHub(captions.redis if isinstance(captions, RedisCaptionStore) else None,
                    settings.max_sse_subscribers)
    return ServerState(settings=settings, bridge=bridge, metrics=metrics, captions=captions, captioner=captioner,
                       feeds=feeds)


def _mqtt_hook(app: FastAPI, settings: ServerSettings) -> Callable[[Any, Any], None] | None:
    """MQTT out started (`app.state.mqtt`, for /ready) when --mqtt-url is set: its finish hook, else None."""
    app.state.mqtt = start_mqtt(settings)
    return app.state.mqtt.on_finished if app.state.mqtt is not None else None


def create_app(settings: ServerSettings, engine: Any | None = None) -> FastAPI:
    """The server's app. `engine` is an already built `engine.Engine` to serve (else one is built from
    `settings.engine` at startup). ValueError for keys that contradict each other."""
    configured_keys(settings)
    settings.configure_media_box()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.vlmcap = None
        app.state.load_error = None
        app.state.memory = None  # the camera memory (api/routes_events.py), once the engine is loaded
        app.state.mqtt = None  # MQTT out (memory/mqtt.py), with --mqtt-url and the queue worker
        worker = None
        webhook = None
        summaries = None

        async def load() -> None:
            nonlocal worker, webhook, summaries
            try:
                state = await _build_state(settings, metrics, engine)
            except Exception as exc:
                log.exception("the engine failed to load")
                app.state.load_error = f"{type(exc).__name__}: {exc}"
                return
            app.state.memory = memory = await routes_events.open_memory(settings, state.bridge)
            if memory is not None:  # the store's writer reuses the embeddings of captions' own encoder runs
                state.captioner.keep_embeddings = memory.remember
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
                    claim_idle_seconds=settings.claim_idle_seconds, max_deliveries=settings.max_deliveries,
                    caption_priority=settings.caption_priority, batch_size=settings.batch_size,
                    fall_priority=settings.fall_priority, on_alert=webhook.notify if webhook else None,
                    on_finished=each(memory.on_finished if memory else None, _mqtt_hook(app, settings)),
                )
                worker.start()
                state.worker, state.webhook = worker, webhook
            if settings.summary_every_s is not None and settings.redis_url:
                summaries = asyncio.create_task(routes_summaries.summarize_every(
                    state, settings.summary_every_s, routes_summaries.summary_cache(app.state)))
            app.state.vlmcap = state
            log.info("ready: serving %s as %r", settings.engine.model, settings.model_name)

        loading = asyncio.create_task(load())
        try:
            yield
        finally:
            if not loading.done():
                loading.cancel()
            if summaries is not None:
                summaries.cancel()
            state: ServerState | None = app.state.vlmcap
            if state is not None:
                if worker is not None:
                    await worker.stop(settings.shutdown_grace_s)
                if webhook is not None:
                    await webhook.stop(settings.shutdown_grace_s)
                # after the worker: its last jobs are published and written
                await asyncio.to_thread(stop_outputs, app.state.memory, app.state.mqtt, settings.shutdown_grace_s)
                await state.bridge.shutdown(settings.shutdown_grace_s)
                await asyncio.gather(*state.background, return_exceptions=True)
                await state.feeds.close()
                await state.captions.close()

    app = FastAPI(title="vlmcap", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible chat and REST captioning on one shared VLM engine.")
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, settings=settings, metrics=metrics, routes=app.router.routes)
    app.include_router(routes_openai.router)
    app.include_router(routes_completions.router)
    app.include_router(routes_ollama.router)
    app.include_router(routes_stored.router)
    app.include_router(routes_captions.router)
    app.include_router(routes_dashboard.router)
    app.include_router(routes_alerts.router)
    app.include_router(routes_summaries.router)
    app.include_router(routes_ask.router)
    mcp_server.mount_mcp(app)
    app.include_router(routes_events.router)
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
        # The webhook is not a reason to refuse traffic (it restarts itself): its state is shown, not judged.
        webhook = {"alert_webhook": state.webhook.health()} if state is not None and state.webhook else {}
        if request.app.state.mqtt is not None:  # shown, not judged: it reconnects by itself
            webhook["mqtt"] = request.app.state.mqtt.health()
        if reason is not None:
            return JSONResponse({"status": "not ready", "reason": reason, **webhook}, status_code=503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        return JSONResponse({"status": "ready", "model": settings.model_name, **webhook})

    @app.get("/metrics", response_class=Response)
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
