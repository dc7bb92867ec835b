"""Captions on this server's own engine, through the bridge: the `Captioner` the in-process queue worker
uses, and what the captioning REST routes run."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from PIL import Image

from api.bridge import AsyncEngine, RequestStream
from api.errors import APIError
from api.images import decode_image
from api.settings import Limits
from engine import SamplingParams


class EngineCaptioner:
    """Implements `api.queue_worker.Captioner`. Greedy, so a frame gets the same caption on every run."""

    def __init__(self, bridge: AsyncEngine, limits: Limits, max_tokens: int) -> None:
        self.bridge = bridge
        self.limits = limits
        self.max_tokens = max_tokens

    async def caption(self, image_jpeg: bytes, prompt: str, priority: int) -> str:
        """The caption of one encoded image. Raises APIError for an image or prompt the server refuses
        (its message says why)."""
        image = await asyncio.to_thread(decode_image, image_jpeg, self.limits, "image")
        return await self.collect(await self.submit(image, prompt, priority))

    async def submit(self, image: Image.Image, prompt: str, priority: int,
                     max_tokens: int | None = None) -> RequestStream:
        return await self.bridge.add(
            messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}],
            images=[image], sampling=SamplingParams(max_tokens=max_tokens or self.max_tokens, temperature=0.0),
            priority=priority,
        )

    async def collect(self, stream: RequestStream, on_running: Callable[[], Awaitable[None]] | None = None) -> str:
        """The caption once finished; `on_running` is awaited when the first token arrives. Aborts the
        request if cancelled."""
        output = None
        try:
            async for output in stream:
                if on_running is not None and len(output.token_ids) == 1:
                    await on_running()
        finally:
            self.bridge.abort(stream.request_id)  # a no-op once finished
        if output is None or output.finish_reason == "abort":
            raise APIError(503, "the caption request was aborted (server shutting down)", code="aborted")
        return output.text.strip()
