"""The captioner of `vlmcap worker`: any OpenAI-compatible `/v1/chat/completions` (this project's server,
vLLM, ...) behind the queue worker's `Captioner` protocol."""

from __future__ import annotations

import base64

from jobqueue.consumer import frame_parts
from jobqueue.structured import SchemaRefused


class OpenAICaptioner:
    """Captions through any OpenAI-compatible `/v1/chat/completions` (this project's server, vLLM, ...),
    the image sent inline as a data URL. `priority` is sent as the request's `priority` (vLLM's and
    this server's name for it) unless it is 0, so servers without priority scheduling accept it."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str = "default",
                 max_tokens: int = 128, timeout_seconds: float = 300.0) -> None:
        from openai import AsyncOpenAI

        base_url = base_url.rstrip("/")
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"VLM URL must start with http:// or https://, got {base_url!r}")
        if not base_url.endswith("/v1"):
            base_url += "/v1"
        # Retries are the queue's business (redelivery), not the HTTP client's.
        self.client = AsyncOpenAI(base_url=base_url, api_key=api_key or "none", timeout=timeout_seconds,
                                  max_retries=0)
        self.model = model
        self.max_tokens = max_tokens

    async def caption(self, image_jpeg: bytes, prompt: str, priority: int, schema: dict | None = None,
                      cache_salt: str | None = None) -> str:
        return await self.caption_frames([image_jpeg], [""], prompt, priority, schema, cache_salt)

    async def caption_frames(self, images: list[bytes], notes: list[str], prompt: str, priority: int,
                             schema: dict | None = None, cache_salt: str | None = None) -> str:
        """Several frames as one message (`jobqueue.consumer.frame_parts`), each image inline as a data URL."""
        def image_part(index: int) -> dict:
            url = "data:image/jpeg;base64," + base64.b64encode(images[index]).decode()
            return {"type": "image_url", "image_url": {"url": url}}

        return await self._complete(frame_parts(notes, prompt, image_part), priority, schema, cache_salt)

    async def caption_video(self, video: bytes, prompt: str, priority: int, schema: dict | None = None,
                            cache_salt: str | None = None) -> str:
        """A job's clip inline as a `video_url` data URL (vLLM's and this server's part), then `prompt`; the
        server samples its frames."""
        url = "data:video/mp4;base64," + base64.b64encode(video).decode()
        content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": prompt}]
        return await self._complete(content, priority, schema, cache_salt)

    async def _complete(self, content: list[dict], priority: int, schema: dict | None,
                        cache_salt: str | None) -> str:
        """One user message of `content`; `cache_salt` is sent as the request's (vLLM's and this server's name
        for it)."""
        response_format = None if schema is None else {
            "type": "json_schema", "json_schema": {"name": "caption", "schema": schema, "strict": True}}
        from openai import BadRequestError

        try:
            response = await self.client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": content}],
                max_tokens=self.max_tokens,
                extra_body={**({"priority": priority} if priority else {}),
                            **({"cache_salt": cache_salt} if cache_salt else {})} or None,
                **({"response_format": response_format} if response_format else {}),
            )
        except BadRequestError as err:  # a schema the server refuses: no redelivery can succeed
            if schema is not None and str(err.param or "").startswith("response_format"):
                raise SchemaRefused(f"the server refused the schema: {err.message}") from None
            raise
        text = response.choices[0].message.content if response.choices else None
        if not text or not text.strip():
            raise ValueError(f"VLM returned no caption (finish reason "
                             f"{response.choices[0].finish_reason if response.choices else 'none'})")
        return text.strip()

    async def aclose(self) -> None:
        await self.client.close()
