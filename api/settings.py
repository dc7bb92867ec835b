"""Everything `vlmcap serve` can be told: the engine's configuration, the served name, security and limits."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.media_box import BoxLimits
from jobqueue.settings import QueueSettings
from memory.settings import MemorySettings, MqttSettings

if TYPE_CHECKING:
    from engine import EngineConfig


def _engine_config() -> EngineConfig:
    """The engine's defaults, imported only when settings are made: the command line reads the defaults of
    these settings without loading torch."""
    from engine import EngineConfig

    return EngineConfig()


@dataclass
class Limits:
    """What one client may ask for. Each limit answers with a clear 4xx when passed.

    max_body_bytes: largest request body.
    max_image_bytes: largest encoded image.
    max_image_pixels: largest image in pixels, checked before decoding.
    max_images_per_request: most images in one request (none: as many as fit the context and the size limits).
    max_tokens_cap: most new tokens one request may ask for (none: the context, max_model_len).
    default_max_tokens: new tokens of a request that sets no max_tokens (none: up to the context, as OpenAI does).
    max_waiting_requests: requests waiting in the engine beyond which new ones get 429.
    max_videos_per_request: most videos in one request.
    max_video_bytes: largest encoded video (a data URL or a remote file).
    max_video_seconds: longest video, by its container's frame count and rate, checked before decoding.
    max_video_frame_pixels: largest video frame in pixels, checked before decoding; a video's decoded frames take
        at most max_video_frames x this x 3 bytes.
    video_frames: frames taken from a video, spread evenly from its first to its last (a request's
        video_options.num_frames overrides it).
    max_video_frames: most frames one video may give (a request's num_frames, or frames at video_fps).
    video_fps: take frames at this rate instead of video_frames, up to max_video_frames spread over the clip.
    allow_remote_images: fetch http(s) image URLs (only from the allowed remote image hosts).
    remote_image_hosts: a host allowed for remote images (repeat; '*.example.com').
    allow_private_remote_images: allow remote image hosts that resolve to private or loopback addresses.
    remote_image_timeout_s: seconds one remote image may take to arrive.
    min_client_priority: the most urgent priority a client may ask for (lower runs first; chat's own by default;
        fall alerts and camera captions are the server's own priorities); below it answers 400.
    """

    max_body_bytes: int = 32 * 1024 * 1024
    max_image_bytes: int = 16 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    max_images_per_request: int | None = None
    max_tokens_cap: int | None = None
    default_max_tokens: int | None = None
    max_waiting_requests: int = 256
    max_videos_per_request: int = 2
    max_video_bytes: int = 16 * 1024 * 1024
    max_video_seconds: float = 600.0
    max_video_frame_pixels: int = 1920 * 1080
    video_frames: int = 8
    max_video_frames: int = 32
    video_fps: float | None = None
    allow_remote_images: bool = False
    remote_image_hosts: tuple[str, ...] = ()
    allow_private_remote_images: bool = False
    remote_image_timeout_s: float = 10.0
    min_client_priority: int = 0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_image_bytes", "max_image_pixels", "max_images_per_request",
                     "max_tokens_cap", "default_max_tokens", "max_waiting_requests", "max_videos_per_request",
                     "max_video_bytes", "max_video_seconds", "max_video_frame_pixels", "video_frames",
                     "max_video_frames"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.video_frames > self.max_video_frames:
            raise ValueError(f"video_frames {self.video_frames} is over max_video_frames {self.max_video_frames}")
        if self.video_fps is not None and self.video_fps <= 0:
            raise ValueError(f"video_fps must be positive, got {self.video_fps!r}")
        if None not in (self.default_max_tokens, self.max_tokens_cap) and self.default_max_tokens > self.max_tokens_cap:
            raise ValueError(
                f"default_max_tokens {self.default_max_tokens} is over max_tokens_cap {self.max_tokens_cap}"
            )


DEFAULT_SUMMARY_PRIORITY = 3  # between chats (0) and camera captions (QueueSettings.caption_priority)
DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


def parse_duration(text: str) -> float:
    """Seconds from '90', '90s', '15m', '2h' or '1d'; ValueError naming the text otherwise."""
    match = DURATION.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"a duration is a positive number with s, m, h or d (15m), got {text!r}")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


@dataclass(kw_only=True)
class ServerSettings(QueueSettings, MemorySettings, MqttSettings):
    """The server around the engine: who may call it, the caption queue (its worker's settings are
    `QueueSettings`', where its finished jobs go `MemorySettings`' and `MqttSettings`'), shutdown.

    served_model_name: model id clients send and /v1/models lists (default: the engine's model).
    api_key: when set, every /v1 route and the API docs need 'Authorization: Bearer <key>'.
    api_keys: named keys besides api_key, name -> key (`VLMCAP_API_KEYS`: 'name:key' lines; api.guard).
    allow_unauthenticated: listen on a non-loopback address without an API key (an open server; refused otherwise).
    public_metrics: serve /metrics without the API key (it needs one when keys are set).
    share_prefix_cache: let requests of different API keys share cached prefixes and image features.
    max_sse_subscribers: server-sent event streams open at once; one more answers 503 with Retry-After.
    allowed_hosts: without an API key, a Host name clients may use besides loopback ones (repeat; '*': any).
    redis_url: Redis for caption results shared with camera queue workers (default: results in memory, no queue).
    run_queue_worker: with a Redis URL, caption camera jobs from the Redis queue in-process.
    caption_prompt: prompt of captions that give none.
    caption_max_tokens: new tokens of a caption.
    structured_caption_max_tokens: new tokens of a caption under a JSON schema (a job's or a request's `schema`).
    fall_itl_target_ms: the inter-token latency a fall alert's caption asks of the engine: while it decodes, camera
        captions and other less urgent prompts fill each step only up to it, so that the alert ends seconds sooner
        under load (0: the engine's own target, `--itl-target-ms`).
    shutdown_grace_s: seconds in-flight requests get to finish at shutdown.
    summary_every: with Redis, append one summary per camera of the interval just ended to vlmcap:summaries:<camera>
        this often ('90s', '15m', '1h'; default: never).
    summary_max_tokens: new tokens of a camera summary (POST /v1/cameras/{id}/summary).
    summary_priority: engine priority of camera summaries (lower first: after chats, before camera captions).
    work_deadline_s: seconds a request's blocking work (admission, decoding, rendering, a summary's reading) may wait
        for a worker and run before it answers 503.
    key_share: the most of each work pool's threads one client (API key, else address) holds at once (0-1].
    header_timeout_s: seconds a connection gets to send a request's headers before it is closed.
    body_timeout_s: seconds a request gets to send its body once its headers are in, before it is closed.
    max_connections: connections open at once; one more closes the oldest still sending its headers, else itself.
    access_log_per_s: access log lines (and socket accept errors) written a second at most; the rest are counted.
    decode_timeout_s: seconds one media decode (a video, an image whose decode can be slow) may run in its child
        process, and wait for a free one; past it 413 (a wait: 503 busy, with Retry-After).
    decode_memory_bytes: address space a media decoding child may take beyond what it holds once started.
    decode_workers: media decoding child processes at once.
    store_max_completions: chat completions kept per client key for `store: true` (the oldest go first).
    store_max_bytes: bytes of stored chat completions (their JSON, with the messages they answered) kept per key.
    store_max_age_s: seconds a stored chat completion is kept.
    """

    engine: EngineConfig = field(default_factory=_engine_config)
    served_model_name: str | None = None
    api_key: str | None = None
    api_keys: dict[str, str] = field(default_factory=dict)
    allow_unauthenticated: bool = False
    public_metrics: bool = False
    share_prefix_cache: bool = False
    max_sse_subscribers: int = 256
    allowed_hosts: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)
    redis_url: str | None = None
    run_queue_worker: bool = True
    caption_prompt: str = "Describe the people in this image in one sentence."
    caption_max_tokens: int = 64
    structured_caption_max_tokens: int = 512
    fall_itl_target_ms: float = 30.0
    shutdown_grace_s: float = 10.0
    summary_every: str | None = None
    summary_max_tokens: int = 768
    summary_priority: int = DEFAULT_SUMMARY_PRIORITY
    work_deadline_s: float = 60.0
    key_share: float = 0.5
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 512
    access_log_per_s: float = 20.0
    decode_timeout_s: float = BoxLimits.timeout_s
    decode_memory_bytes: int = BoxLimits.memory_bytes
    decode_workers: int = BoxLimits.workers
    store_max_completions: int = 256
    store_max_bytes: int = 32 * 1024 * 1024
    store_max_age_s: float = 86400.0

    def __post_init__(self) -> None:
        MemorySettings.__post_init__(self)
        MqttSettings.__post_init__(self)
        if self.summary_every is not None:
            parse_duration(self.summary_every)
        if self.summary_max_tokens < 1:
            raise ValueError(f"summary_max_tokens must be positive, got {self.summary_max_tokens}")
        for name in ("work_deadline_s", "header_timeout_s", "body_timeout_s", "access_log_per_s", "max_connections"):
            if not getattr(self, name) > 0:  # NaN too
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not (math.isfinite(self.fall_itl_target_ms) and self.fall_itl_target_ms >= 0):
            raise ValueError(f"fall_itl_target_ms must be 0 or a positive number of milliseconds, got "
                             f"{self.fall_itl_target_ms!r}")
        if not 0 < self.key_share <= 1:
            raise ValueError(f"key_share must be over 0 and at most 1, got {self.key_share!r}")
        self.media_box_limits  # noqa: B018  (its ValueError names the option)
        for name in ("store_max_completions", "store_max_bytes", "store_max_age_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")

    @property
    def media_box_limits(self) -> BoxLimits:
        """The media box's limits (engine/media_box.py) these settings give; ValueError naming a bad option."""
        try:
            return BoxLimits(self.decode_timeout_s, self.decode_memory_bytes, self.decode_workers)
        except ValueError as exc:
            raise ValueError(f"decode_{exc}") from None

    def configure_media_box(self) -> None:
        """Make the process's media box one of these settings' limits where they are not its defaults (a box
        configured otherwise, as a test does, is then left as it is)."""
        from engine.media_box import configure_default_box, default_box

        limits = self.media_box_limits
        if limits != BoxLimits() and default_box().limits != limits:
            configure_default_box(limits)

    @property
    def summary_every_s(self) -> float | None:
        return parse_duration(self.summary_every) if self.summary_every is not None else None

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model
