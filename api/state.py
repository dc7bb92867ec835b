"""What the routes share: settings, the engine bridge, metrics and the caption store of one server."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from api.bridge import EngineBridge
from api.caption_store import CaptionStore, RedisCaptionStore
from api.captioner import EngineCaptioner
from api.errors import APIError
from api.feeds import FeedHub
from api.metrics import Metrics
from api.settings import ServerSettings

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from jobqueue.alerts import AlertWebhook
    from jobqueue.consumer import QueueWorker


@dataclass
class ServerState:
    settings: ServerSettings
    bridge: EngineBridge
    metrics: Metrics
    captions: CaptionStore
    captioner: EngineCaptioner
    feeds: FeedHub  # the event streams' Redis readers, fanned out in memory
    started_at: float = field(default_factory=time.time)
    background: set[asyncio.Task] = field(default_factory=set)  # caption requests answered with 202
    worker: QueueWorker | None = None  # the in-process queue worker, when Redis is configured
    webhook: AlertWebhook | None = None  # the worker's fall-alert webhook, when one is configured

    @property
    def redis(self) -> aioredis.Redis | None:
        """The server's Redis (camera frames, stats, alerts live there), or None when results are kept in
        memory."""
        return self.captions.redis if isinstance(self.captions, RedisCaptionStore) else None


def server_state(request: Request) -> ServerState:
    """The server's state, or 503 while the engine is loading (or failed to load)."""
    state = getattr(request.app.state, "vlmcap", None)
    if state is None:
        error = getattr(request.app.state, "load_error", None)
        raise APIError(503, f"the engine failed to load: {error}" if error else "the model is still loading",
                       code="not_ready")
    return state
