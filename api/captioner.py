"""Captions on this server's own engine, through the bridge: the `Captioner` the in-process queue worker
uses, and what the captioning REST routes run.

A caption's one image is tiled no finer than its own pixels (`Engine.tiling_options`: SmolVLM's processor would
upscale a camera frame to 2,048 px first). Where each of a caption's frames is one encoder input (a job's frames;
a one-image job where the family does not tile images or one tile holds the image), the engine pools the frames'
features as it encodes them for the caption (`embed_images`), and the captioner hands those embeddings to
`keep_embeddings` (the camera memory's, keyed by the frames' bytes), so that the event store's writer need not
run the vision tower again for them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from PIL import Image

from api.bridge import EngineBridge, RequestStream
from api.errors import ENGINE_FAILED, APIError
from api.grammars import GrammarRefused, compile_ahead
from api.images import decode_image
from api.pools import CLIENT_KEY, work_pools
from api.settings import Limits
from api.videos import check_video_input, decode_video, video_sampling
from engine import RequestOutput, SamplingParams
from engine.grammar import GrammarSpec
from engine.video import Video
from jobqueue.consumer import current_job, frame_parts


def job_key() -> str | None:
    """The key a queue job's blocking work (decoding, admission, schema) takes turns by in the server's pools: its
    camera's (`camera:<id>`), a fall alert's its own (`alert:<id>`), so that one camera's heavy media wait behind
    each other, not the other cameras' jobs nor an alert behind them; None outside a job."""
    job = current_job.get()
    return None if job is None else f"{'alert' if job.fall else 'camera'}:{job.camera_id}"


@contextmanager
def _job_turns() -> Iterator[None]:
    """The calling job's key as the client key of the work done within (a request's own key is kept)."""
    key = job_key() if CLIENT_KEY.get() is None else None
    token = CLIENT_KEY.set(key) if key is not None else None
    try:
        yield
    finally:
        if token is not None:
            CLIENT_KEY.reset(token)


class EngineCaptioner:
    """Implements `jobqueue.consumer.Captioner`. Greedy, so a frame gets the same caption on every run."""

    def __init__(self, bridge: EngineBridge, limits: Limits, max_tokens: int,
                 structured_max_tokens: int | None = None, fall_itl_target_ms: float | None = None) -> None:
        """`structured_max_tokens`: the default for captions under a JSON schema (longer than a sentence);
        `fall_itl_target_ms`: the engine's own target of a fall alert's caption (None: the engine's)."""
        self.bridge = bridge
        self.limits = limits
        self.max_tokens = max_tokens
        self.structured_max_tokens = structured_max_tokens or max_tokens
        self.fall_itl_target_ms = fall_itl_target_ms
        # Where a caption's frames' embeddings go, with the frames' bytes (the camera memory's `remember`); None:
        # the engine pools none.
        self.keep_embeddings: Callable[[list[bytes], list[list[float]]], None] | None = None

    async def caption(self, image_jpeg: bytes, prompt: str, priority: int, schema: dict | None = None,
                      cache_salt: str | None = None) -> str:
        """The caption of one encoded image (JSON text under `schema` when one is given; sharing cached prefixes
        and image features only with requests of the same `cache_salt`). Raises APIError for an image, prompt or
        schema the server refuses (its message says why)."""
        with _job_turns():
            image = await work_pools(self.limits).run("decode", decode_image, image_jpeg, self.limits, "image")
            options = self.tiling(image)
            # One image is one encoder input where the family does not tile it or one tile holds it (its caption
            # sees every tile).
            one_input = self.bridge.engine.single_input_options in (None, options)
            content = [{"type": "image"}, {"type": "text", "text": prompt}]
            return await self._caption(content, [image], [image_jpeg] if one_input else None, priority, schema,
                                       cache_salt, options)

    def tiling(self, image: Image.Image) -> dict[str, Any] | None:
        """A caption's one image tiled no finer than its own pixels (`Engine.tiling_options`): a 640 x 480 camera
        frame 5 SmolVLM tiles, not 13 of an upscaled copy."""
        return self.bridge.engine.tiling_options(*image.size)

    async def caption_frames(self, images: list[bytes], notes: list[str], prompt: str, priority: int,
                             schema: dict | None = None, cache_salt: str | None = None) -> str:
        """The caption of several encoded frames as one prompt (`jobqueue.consumer.frame_parts`)."""
        with _job_turns():
            decoded = [await work_pools(self.limits).run("decode", decode_image, data, self.limits, f"frame {index}")
                       for index, data in enumerate(images)]
            content = frame_parts(notes, prompt, lambda _: {"type": "image"})
            # Each frame one encoder input where the family tiles images (SmolVLM: 64 tokens a frame, not ~1,000).
            return await self._caption(content, decoded, images, priority, schema, cache_salt,
                                       self.bridge.engine.single_input_options)

    async def _caption(self, content: list[dict], images: list[Image.Image], frames: list[bytes] | None,
                       priority: int, schema: dict | None, cache_salt: str | None,
                       options: dict[str, Any] | None) -> str:
        """A caption of `images`, each one encoder input when `frames` (their bytes) are given: then their
        embeddings, pooled by the engine from this caption's own encoder run, go to `keep_embeddings`."""
        embed = frames is not None and self.keep_embeddings is not None
        output = await self.final(await self.submit_content(content, images, priority, schema=schema,
                                                            cache_salt=cache_salt, mm_processor_kwargs=options,
                                                            embed_images=embed))
        vectors = output.image_embeddings
        if embed and vectors and len(vectors) == len(frames) and all(v is not None for v in vectors):
            self.keep_embeddings(frames, vectors)
        return output.text.strip()

    async def caption_video(self, video: bytes, prompt: str, priority: int, schema: dict | None = None,
                            cache_salt: str | None = None) -> str:
        """The caption of an encoded clip (`jobqueue.consumer.Captioner`): its frames sampled under the
        server's video settings and limits, then `prompt`. APIError for a clip the server refuses, and (400)
        when the model has no video path."""
        check_video_input(self.bridge.engine, "video")
        sampling = video_sampling(self.limits, None, None, "video")
        with _job_turns():
            clip = await work_pools(self.limits).run("decode", decode_video, video, sampling, self.limits, "video")
            content = [{"type": "video"}, {"type": "text", "text": prompt}]
            return await self.collect(await self.submit_content(content, [], priority, schema=schema,
                                                                cache_salt=cache_salt, videos=[clip]))

    async def submit(self, image: Image.Image, prompt: str, priority: int,
                     max_tokens: int | None = None, schema: dict | None = None,
                     cache_salt: str | None = None) -> RequestStream:
        content = [{"type": "image"}, {"type": "text", "text": prompt}]
        return await self.submit_content(content, [image], priority, max_tokens, schema, cache_salt,
                                         mm_processor_kwargs=self.tiling(image))

    async def submit_content(self, content: list[dict], images: list[Image.Image], priority: int,
                             max_tokens: int | None = None, schema: dict | None = None,
                             cache_salt: str | None = None, videos: list[Video] | None = None,
                             mm_processor_kwargs: dict | None = None, embed_images: bool = False) -> RequestStream:
        """One user message of `content` parts (an `{"type": "image"}` part per image, a `{"type": "video"}`
        part per video, in order)."""
        try:
            grammar = None if schema is None else GrammarSpec.from_schema(schema)
        except ValueError as exc:
            raise GrammarRefused(400, f"schema: {exc}", "schema", "invalid_json_schema") from None
        await compile_ahead(self.bridge.engine, grammar, "schema", key=cache_salt,  # GrammarRefused: dead-lettered
                            pools=work_pools(self.limits))
        default = self.max_tokens if grammar is None else self.structured_max_tokens
        job = current_job.get()
        return await self.bridge.add(
            # A fall alert's caption is waited for to its end: its decodes keep their own, tighter target.
            itl_target_ms=self.fall_itl_target_ms if job is not None and job.fall else None,
            prompt=self.bridge.engine.user_prompt(content),  # any checkpoint: with or without a chat template
            images=images,
            videos=videos,
            sampling=SamplingParams(max_tokens=max_tokens or default, temperature=0.0, grammar=grammar),
            priority=priority,
            cache_salt=cache_salt,
            mm_processor_kwargs=mm_processor_kwargs,
            embed_images=embed_images,
        )

    async def collect(self, stream: RequestStream, on_running: Callable[[], Awaitable[None]] | None = None) -> str:
        """The caption once finished; `on_running` is awaited when the first token arrives. Aborts the
        request if cancelled."""
        return (await self.final(stream, on_running)).text.strip()

    async def final(self, stream: RequestStream, on_running: Callable[[], Awaitable[None]] | None = None
                    ) -> RequestOutput:
        """The request's finished output (as `collect`, which gives its text)."""
        output = None
        try:
            async for output in stream:
                if on_running is not None and len(output.token_ids) == 1:
                    await on_running()
        finally:
            self.bridge.abort(stream.request_id)  # a no-op once finished
        if output is None or output.finish_reason == "abort":
            raise APIError(503, "the caption request was aborted (server shutting down)", code="aborted")
        if output.finish_reason == "error":
            raise APIError(500, ENGINE_FAILED, code="engine_error")
        return output
